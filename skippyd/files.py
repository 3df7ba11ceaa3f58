"""Small filesystem helpers the tiers share: owner locks, private directories, removal, fsync."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from .errors import ConfigError, InvalidArgument, StoreLocked

__all__ = [
    "durable_dir",
    "fsync_dir",
    "lock_holder",
    "private_dirs",
    "release_owner_lock",
    "remove",
    "take_owner_lock",
]

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


def durable_dir(path: Path) -> None:
    """``path`` is a directory (0700) whose entry in its parent is on disk: where this call creates it,
    it fsyncs the parent, so a file fsynced and renamed into it later survives a power cut with it."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return
    fsync_dir(path.parent)


# The owner locks this process holds: directory (st_dev, st_ino) -> (descriptor, owner) for each holder; the
# descriptors are dups of one open file description, so the flock lives while any of them is open. One
# daemon whose state, L2 and L3 directories are one directory (``--l3-dir`` = ``--state-dir``) shares the
# lock between its different owners instead of refusing itself; two owners of one kind still conflict.
_held: dict[tuple[int, int], list[tuple[int, str]]] = {}
_held_lock = threading.Lock()


def take_owner_lock(directory: Path, owner: str) -> int:
    """An exclusive, non-blocking flock on ``directory/.lock`` with our pid inside, for ``owner`` (what
    keeps its files there: ``state directory``, ``L2 tier``, ``L3 store``); the caller gives the fd back
    with :func:`release_owner_lock`.

    A second live owner gets :class:`StoreLocked` naming the holder's pid. The lock dies with its process,
    so a crashed owner never blocks a restart. A directory this process already holds (the same directory
    by device and inode, whatever the path) is shared with an owner of another kind, which gets a duplicate
    of the held descriptor (the lock goes once every holder has released it); one of the same kind is refused.
    """
    st = os.stat(directory)
    key = (st.st_dev, st.st_ino)
    with _held_lock:
        holders = _held.get(key)
        if holders:
            if any(kind == owner for _, kind in holders):
                pid = os.getpid()
                raise StoreLocked(f"{directory} is owned by another {owner} of this process (pid {pid})")
            fd = os.dup(holders[0][0])  # os.dup descriptors are non-inheritable, like O_CLOEXEC
            holders.append((fd, owner))
            return fd
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StoreLocked(f"{directory} is owned by another process (pid {holder or '?'})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = [(fd, owner)]
        return fd


def release_owner_lock(fd: int) -> None:
    """Gives back a descriptor :func:`take_owner_lock` returned; the last holder out releases the lock."""
    with _held_lock:
        for key, holders in _held.items():
            kept = [held for held in holders if held[0] != fd]
            if len(kept) != len(holders):
                if kept:
                    _held[key] = kept
                else:
                    del _held[key]
                break
        os.close(fd)


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


def set_mtimes(touched: Iterable[tuple[Path, int]]) -> None:
    """Sets each file's atime and mtime to its tick (ns): the recency a restart reads back. A file gone
    since is skipped (written outside the lock that listed them: one replaced meanwhile gets an older
    mtime, harmless)."""
    for path, tick in touched:
        with contextlib.suppress(FileNotFoundError):
            os.utime(path, ns=(tick, tick))
