"""Small filesystem helpers the tiers share: owner locks, private directories, removal, fsync."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from .errors import ConfigError, InvalidArgument, StoreLocked

__all__ = ["fsync_dir", "lock_holder", "private_dirs", "remove", "take_owner_lock"]

log = logging.getLogger("skippyd.files")


def private_dirs(*paths: Path) -> None:
    """Creates each directory 0700 (parents as needed); refuses symlinks, non-directories and
    directories another user owns (whoever owns a directory can swap the files inside it)."""
    euid = os.geteuid()
    for path in paths:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.is_symlink() or not path.is_dir():
            raise InvalidArgument(f"{path} is not a directory")
        owner = os.lstat(path).st_uid
        if owner != euid:
            raise ConfigError(
                f"{path} belongs to uid {owner}, not to this process's uid {euid}: "
                "give it to the daemon's user or choose another directory"
            )
        if os.lstat(path).st_mode & 0o077:
            os.chmod(path, 0o700)


def take_owner_lock(directory: Path) -> int:
    """An exclusive, non-blocking flock on ``directory/.lock`` with our pid inside; the caller closes the fd.

    A second live owner gets :class:`StoreLocked` naming the holder's pid. The lock dies with its process,
    so a crashed owner never blocks a restart.
    """
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StoreLocked(f"{directory} is owned by another process (pid {holder or '?'})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_holder(directory: Path) -> int | None:
    """The pid of the live process holding ``directory``'s owner lock (:func:`take_owner_lock`), or None
    when nobody holds it. Asked through a fresh open file description, so it answers for this process too
    (``flock`` locks of two descriptions conflict even within one process); it never takes the lock."""
    try:
        fd = os.open(directory / ".lock", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1  # held; -1: by a process that wrote no pid yet
        return None  # nobody holds it (our shared lock goes with the descriptor)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Removes a file, a link or a whole directory tree; already gone is fine, never follows links."""
    try:
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                remove(child)
            path.rmdir()
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
