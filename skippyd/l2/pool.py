"""The L2 file pool: tmpfs files by size class, kept pre-faulted for reuse while nobody reads them.

Faulting fresh tmpfs pages runs at ≈ 1 GB/s on these machines, rewriting mapped ones at memory speed,
so a file an entry no longer needs keeps its pages (and, for large files, its mapping) and serves the
next entry of the same size class. That is only safe when no reader holds a lease on it
(:func:`skippyd.shm.has_readers`); a file someone still reads is unlinked instead, so the reader's
bytes never change under it.

A file once handed to a client (a restore's descriptor) is reused only for entries of the identity it
was handed out for (:attr:`File.owner`). A client may keep a lease-free description of an entry file
(reopened through ``/proc/self/fd``, as kept CUDA mappings are): it then sees whatever the file holds
next, so a file served for one model, state and namespace never holds another's bytes. Files no client
was given (fresh ones, the reserve's) serve any identity. Free files carry their owner in their name.

Directory layout (inside the tier's directory): ``free/<random>.<owner>.free`` files kept for reuse
(``any`` for files no client was given), ``tmp/<random>.part`` files being written. Not thread-safe: the
tier calls it under its lock, except :meth:`FilePool.fresh`, which allocates outside it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from skippyd.files import remove
from skippyd.shm import allocate_mapped, has_readers, map_rw, new_name, next_generation, populate_write

__all__ = ["ANY_OWNER", "File", "FilePool", "PoolStats", "owner_of"]

log = logging.getLogger("skippyd.l2")

ANY_OWNER = "any"  # a file no client was given: it may serve any identity


def owner_of(identity: str) -> str:
    """The owner mark of files served for ``identity`` (a hex digest): its first 128 bits."""
    return identity[:32]


@dataclass(slots=True)
class File:
    """A tmpfs file the tier owns, with its persistent mapping when it is worth keeping."""

    path: Path
    size: int
    mapping: mmap.mmap | None = None
    fresh: bool = False  # its pages were never written: no stale bytes to zero
    freed_at: float = 0.0
    #: Names the file's pages (docs/protocol.md, "Generations"): new for a new or adopted file, kept when
    #: the file is recycled for another entry (a recycled file is renamed and rewritten through its
    #: pages, never punched, truncated or re-allocated), so a client's CUDA registration of it stays good.
    generation: int = field(default_factory=next_generation)
    #: The identity (:func:`owner_of`) the file was handed to a client for: reused only for that one.
    owner: str = ANY_OWNER

    def ensure_mapped(self) -> mmap.mmap:
        if self.mapping is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                self.mapping = map_rw(fd, self.size)
            finally:
                os.close(fd)
        return self.mapping

    def prefault(self) -> None:
        """Faults the whole file into its mapping now (writes through it then run at memory speed)."""
        populate_write(self.ensure_mapped(), 0, self.size)

    def unmap(self) -> None:
        if self.mapping is not None:
            with contextlib.suppress(BufferError):
                self.mapping.close()
            self.mapping = None


@dataclass(slots=True)
class PoolStats:
    free_bytes: int = 0
    free_files: int = 0
    reused_files: int = 0
    fresh_files: int = 0
    reader_held_drops: int = 0  # files unlinked rather than reused because a reader still held them


@dataclass(slots=True)
class FilePool:
    """Free files by size class (their bytes count against the tier's budget) and fresh allocation."""

    free_dir: Path
    tmp_dir: Path
    map_threshold: int  # files at least this large keep their mapping between uses
    threads: int = 1  # a large fresh file is faulted in by this many threads (shm.allocate_mapped)
    _free: dict[int, list[File]] = field(default_factory=dict)
    free_bytes: int = 0
    _reused: int = 0
    _fresh: int = 0
    _reader_held: int = 0

    # ------------------------------------------------------------------ free files
    def add_free(self, file: File) -> None:
        self._free.setdefault(file.size, []).append(file)
        self.free_bytes += file.size

    def has_free(self, size: int) -> bool:
        return bool(self._free.get(size))

    def take(self, size: int, owner: str) -> File | None:
        """A free file of exactly ``size`` bytes that may hold an entry of ``owner`` (no client was given
        it, or it was served for that identity), moved into ``tmp/``; None if none."""
        while True:
            files = self._free.get(size)
            if not files:
                return None
            # its own served files first (they serve nobody else), then files any entry may take (the
            # reserve's stock, which every identity shares); the most recently freed of each first
            newest_first = range(len(files) - 1, -1, -1)
            at = next((i for i in newest_first if files[i].owner == owner), None)
            if at is None:
                at = next((i for i in newest_first if files[i].owner == ANY_OWNER), None)
            if at is None:
                return None
            file = files.pop(at)
            if not files:
                del self._free[size]
            self.free_bytes -= size
            claimed = self.claim(file)
            if claimed is not None:
                return claimed

    def claim(self, file: File) -> File | None:
        """Moves a recycled file into ``tmp/`` for a reservation; None if that failed (file gone)."""
        target = self.tmp_dir / new_name(".part")
        try:
            os.rename(file.path, target)
        except OSError as exc:
            log.warning("could not reuse %s (%s); allocating a fresh file", file.path.name, exc)
            self.unlink(file)
            return None
        file.path = target
        file.fresh = False  # (its generation stays: the same pages, rewritten in place)
        self._reused += 1
        return file

    def recycle(self, file: File, *, room: int) -> None:
        """A file leaving use: kept as a free file when nobody reads it and ``room`` (budget bytes not
        otherwise taken) allows; unlinked otherwise."""
        if has_readers(file.path) or room < file.size:
            self.discard(file)
            return
        target = self.free_dir / new_name(f".{file.owner}.free")
        try:
            os.rename(file.path, target)
        except OSError:
            self.discard(file)
            return
        file.path = target
        file.freed_at = time.monotonic()
        self.add_free(file)

    def drop_one(self) -> bool:
        """Gives back the largest free file's memory; False when there is none."""
        if not self._free:
            return False
        size = max(self._free)
        files = self._free[size]
        file = files.pop()
        if not files:
            del self._free[size]
        self.free_bytes -= size
        self.unlink(file)
        return True

    def free_of(self, size: int, owner: str | None = None) -> int:
        """Bytes of the free files of size class ``size`` (only those of ``owner``, where given: the
        reserve's stock is the files that may serve any entry, :data:`ANY_OWNER`)."""
        files = self._free.get(size, ())
        return size * (len(files) if owner is None else sum(1 for f in files if f.owner == owner))

    def free_sizes(self) -> list[int]:
        """The size classes that have free files."""
        return list(self._free)

    def drop_free(self, size: int, owner: str | None = None) -> int:
        """Gives back the memory of one free file of size class ``size`` (of ``owner``, where given: the
        reserve's decay gives back its own stock); the bytes given back (0: there was none)."""
        files = self._free.get(size)
        at = next((i for i, f in enumerate(files or ()) if owner is None or f.owner == owner), None)
        if files is None or at is None:
            return 0
        file = files.pop(at)  # (the longest free)
        if not files:
            del self._free[size]
        self.free_bytes -= size
        self.unlink(file)
        return size

    def drop_all(self) -> None:
        while self.drop_one():
            pass

    def trim(self, idle_seconds: float) -> int:
        """Gives back free files unused for ``idle_seconds``; returns the bytes released."""
        cutoff = time.monotonic() - idle_seconds
        released = 0
        for size, files in list(self._free.items()):
            keep = [f for f in files if f.freed_at > cutoff]
            for file in files:
                if file.freed_at <= cutoff:
                    self.unlink(file)
                    self.free_bytes -= size
                    released += size
            if keep:
                self._free[size] = keep
            else:
                del self._free[size]
        return released

    # ------------------------------------------------------------------ files
    def fresh(self, size: int, *, threads: int | None = None) -> File:
        """A new file of ``size`` bytes in ``tmp/``, allocated (ENOSPC is :class:`~skippyd.errors.NoSpace`,
        never SIGBUS) and mapped, faulted in on ``threads`` threads (default :attr:`threads`; the reserve
        asks for one: it must not take the copy threads from puts). Called without the tier's lock, so it
        counts nothing: the tier calls :meth:`note_fresh` under its lock."""
        path = self.tmp_dir / new_name(".part")
        mapping = allocate_mapped(path, size, threads=self.threads if threads is None else threads)
        return File(path, size, mapping=mapping, fresh=True)

    def note_fresh(self) -> None:
        self._fresh += 1

    def discard(self, file: File) -> None:
        """Unlinks a file that leaves the tier (counting it when a reader still holds its pages)."""
        if has_readers(file.path):
            self._reader_held += 1
        self.unlink(file)

    @staticmethod
    def unlink(file: File) -> None:
        file.unmap()
        remove(file.path)

    def keep_or_unmap(self, file: File) -> None:
        if file.size < self.map_threshold:
            file.unmap()

    def unmap_all(self) -> None:
        for files in self._free.values():
            for file in files:
                file.unmap()

    def stats(self) -> PoolStats:
        return PoolStats(
            free_bytes=self.free_bytes,
            free_files=sum(len(files) for files in self._free.values()),
            reused_files=self._reused,
            fresh_files=self._fresh,
            reader_held_drops=self._reader_held,
        )
