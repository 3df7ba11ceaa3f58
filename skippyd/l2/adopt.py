"""L2 recovery at start: what a new daemon finds on the tmpfs an earlier one left behind.

Committed entries are re-adopted after their header checksum and (by default) payload digest are
verified; anything misnamed, truncated or failing verification is removed, as is everything in
``tmp/`` (entries that were being written). Free files are kept if they still have a size class's
size. Recency comes back from each entry file's mtime, where the tier records its last use.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from skippyd.errors import CorruptEntry, SkippydError
from skippyd.files import remove
from skippyd.payload import Entry, decode_fixed, decode_header, payload_digest
from skippyd.shm import fill_holes, share, size_class

from .pool import ANY_OWNER

__all__ = ["Adopted", "Found", "adopt", "bytes_to_verify"]

log = logging.getLogger("skippyd.l2")

_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.skp$")


@dataclass(frozen=True, slots=True)
class Found:
    entry: Entry
    path: Path
    data_offset: int
    file_size: int
    last_use: int  # ns since the epoch (the file's mtime)


@dataclass(slots=True)
class Adopted:
    entries: list[Found] = field(default_factory=list)  # least recently used first
    free: list[tuple[Path, int, str]] = field(default_factory=list)  # path, size, owner (pool.File.owner)
    dropped: int = 0


def bytes_to_verify(directory: Path) -> int:
    """The bytes adoption will hash (what a start-up has to read before the daemon is ready)."""
    entries = directory / "entries"
    if not entries.is_dir():
        return 0
    total = 0
    for child in entries.iterdir():
        try:
            st = child.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def _adopt_free(path: Path, size: int) -> None:
    """A free file is written into when it is reused: every page of it is there (:func:`fill_holes`)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fill_holes(fd, size)
        share(fd, adopted=True)
    finally:
        os.close(fd)


def _free_owner(name: str) -> str | None:
    """The owner a free file's name carries (``<random>.<owner>.free``), or None if it has none."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "free":
        return None
    owner = parts[1]
    if owner == ANY_OWNER or (len(owner) == 32 and all(c in "0123456789abcdef" for c in owner)):
        return owner
    return None


def adopt(directory: Path, *, verify: bool = True, hash_threads: int = 2) -> Adopted:
    """Scans ``entries/``, ``free/`` and ``tmp/`` under ``directory`` (the caller owns its lock)."""
    found = Adopted()
    for child in (directory / "tmp").iterdir():
        remove(child)
    for child in (directory / "free").iterdir():
        try:
            st = child.lstat()
        except FileNotFoundError:
            continue
        owner = _free_owner(child.name)
        if owner is not None and stat.S_ISREG(st.st_mode) and size_class(st.st_size) == st.st_size:
            try:
                _adopt_free(child, st.st_size)
            except OSError:  # (NoSpace too: the tmpfs cannot give a sparse one its pages)
                remove(child)
                continue
            found.free.append((child, st.st_size, owner))
        else:  # (a free file without an owner mark, from before them, may have been served to anyone)
            remove(child)
    for child in (directory / "entries").iterdir():
        try:
            found.entries.append(_adopt_one(child, verify, hash_threads))
        except (CorruptEntry, OSError, SkippydError, ValueError) as exc:
            log.warning("dropping an L2 entry that failed verification: %s", exc)
            found.dropped += 1
            remove(child)
    found.entries.sort(key=lambda item: (item.last_use, item.entry.key))
    return found


def _adopt_one(path: Path, verify: bool, hash_threads: int) -> Found:
    if not _ENTRY_NAME.match(path.name):
        raise CorruptEntry(f"unexpected file {path.name}")
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise CorruptEntry(f"{path.name} is not a regular file")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fill_holes(fd, st.st_size)  # (recycled into the pool once evicted: written through a mapping)
        fixed = decode_fixed(os.pread(fd, 64, 0))
        entry = decode_header(fixed, os.pread(fd, fixed.header_len, 64))
        if entry.key + ".skp" != path.name:
            raise CorruptEntry(f"{path.name} holds the entry of another key")
        if fixed.data_offset + fixed.data_len > st.st_size:
            raise CorruptEntry(f"{path.name} is truncated")
        if verify and entry.data_len:
            with mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as view:
                digest = payload_digest(view, entry.tensors, base=fixed.data_offset, threads=hash_threads)
            if digest != entry.digest:
                raise CorruptEntry(f"{path.name}: payload digest does not match")
        share(fd, adopted=True)  # (one an older daemon left 0600, or with another group or ACL)
    finally:
        os.close(fd)
    return Found(entry, path, fixed.data_offset, st.st_size, st.st_mtime_ns)
