"""The L2 hot tier: committed entries as files in a tmpfs directory, a byte budget, LRU eviction.

Semantics follow the seed's ``L2Tier`` (shared/seeds/skippy-server-l2_serving.rs.txt):

* the budget covers every byte the tier holds in tmpfs (entries, recycled free files and in-flight
  reservations); an entry larger than the whole budget is refused before anything is evicted;
* LRU eviction, oldest use first, ties by key; ``get`` moves recency only on a real hit, ``peek`` never;
* re-admitting a key replaces it with exact accounting; ``remove``, ``remove_by_digest``, ``clear``;
* the daemon computes the payload digest after copying the bytes into memory no client can write;
  a mismatch with an expected digest stores nothing and counts ``admission_rejects``;
* a new process over the same directory re-adopts committed entries after checking each header and
  digest, removes partial leftovers and anything that fails, and rebuilds LRU order from the recorded
  last use (file mtimes).

Speed comes from reusing pre-faulted memory: an evicted or replaced file nobody reads any more (see
:mod:`skippyd.shm`, "leases") keeps its pages and its mapping, and the next entry of the same size class
is copied into it at memory speed instead of faulting fresh tmpfs pages. A file somebody still reads is
unlinked instead, so a reader's bytes never change under it.

Directory layout (0700): ``.lock`` (owner), ``entries/<key>.skp``, ``free/<random>.free``, ``tmp/``.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import (
    CorruptEntry,
    DigestMismatch,
    InvalidArgument,
    NoSpace,
    NotFound,
    SkippydError,
    TooLarge,
)
from .files import private_dirs, remove, take_owner_lock
from .keys import Identity, is_hex_digest, prefix_keys
from .payload import (
    EntryHeader,
    TensorDecl,
    TensorSpec,
    check_kind,
    check_meta,
    decode_fixed,
    decode_header,
    encode_header,
    header_span,
    payload_digest,
    plan_layout,
)
from .shm import allocate_file, copy_bytes, has_readers, map_rw, new_name, open_reader, size_class, zero

__all__ = ["L2Entry", "L2Stats", "L2Tier", "Reservation"]

log = logging.getLogger("skippyd.l2")

_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.skp$")
_THREADED_HASH_BYTES = 4 << 20
_PLACEHOLDER_DIGEST = "0" * 64


@dataclass(frozen=True, slots=True)
class L2Entry:
    """A committed entry as the tier describes it (immutable; safe to hand out)."""

    key: str
    identity: str
    token_count: int
    kind: str
    digest: str
    meta: Mapping[str, Any]
    tensors: tuple[TensorSpec, ...]
    data_offset: int
    data_len: int
    file_size: int
    created_ns: int
    origin: str

    @property
    def nbytes(self) -> int:
        """Logical payload bytes (the tensors, padding excluded)."""
        return sum(spec.nbytes for spec in self.tensors)


@dataclass(slots=True)
class L2Stats:
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    admission_rejects: int = 0
    refused_bytes: int = 0
    payload_bytes: int = 0
    free_bytes: int = 0
    free_files: int = 0
    reserved_bytes: int = 0
    reused_files: int = 0
    fresh_files: int = 0
    reader_held_drops: int = 0
    adopted: int = 0
    adopt_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class _File:
    """A tmpfs file the tier owns, with its persistent mapping when it is worth keeping."""

    path: Path
    size: int
    mapping: mmap.mmap | None = None
    fresh: bool = False
    freed_at: float = 0.0

    def ensure_mapped(self) -> mmap.mmap:
        if self.mapping is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                self.mapping = map_rw(fd, self.size)
            finally:
                os.close(fd)
        return self.mapping

    def unmap(self) -> None:
        if self.mapping is not None:
            with contextlib.suppress(BufferError):
                self.mapping.close()
            self.mapping = None


@dataclass(slots=True)
class _Slot:
    entry: L2Entry
    file: _File
    last_use: int = 0


@dataclass(slots=True)
class _Lengths:
    """Distinct captured prefix lengths of one identity, sorted, with how many entries have each."""

    sorted: list[int] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)

    def add(self, n: int) -> None:
        if n in self.counts:
            self.counts[n] += 1
        else:
            self.counts[n] = 1
            bisect.insort(self.sorted, n)

    def discard(self, n: int) -> None:
        left = self.counts.get(n, 0) - 1
        if left > 0:
            self.counts[n] = left
        elif left == 0:
            del self.counts[n]
            self.sorted.pop(bisect.bisect_left(self.sorted, n))

    def upto(self, n: int) -> list[int]:
        return self.sorted[: bisect.bisect_right(self.sorted, n)]


class Reservation:
    """Room for one entry: write the tensor bytes into :attr:`data`, then :meth:`commit`.

    The data region lives in memory only the daemon can write; the digest is computed at commit over
    exactly these bytes. A reservation that is neither committed nor aborted is aborted when collected.
    """

    def __init__(
        self,
        tier: L2Tier,
        file: _File,
        header: EntryHeader,
        data_offset: int,
    ) -> None:
        self._tier = tier
        self._file = file
        self._header = header
        self._data_offset = data_offset
        self._done = False
        self.tensors: tuple[TensorSpec, ...] = header.tensors
        self.key = header.key
        self.file_size = file.size
        mapping = file.ensure_mapped()
        self.data: memoryview = memoryview(mapping)[data_offset : data_offset + header.data_len]

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            with contextlib.suppress(Exception):
                self.abort()

    def open_reader(self) -> int:
        """A leased read-only fd of the reserved file (its data region is at ``data_offset``)."""
        if self._done:
            raise InvalidArgument("reservation already committed or aborted")
        return open_reader(self._file.path)

    @property
    def data_offset(self) -> int:
        return self._data_offset

    @property
    def header(self) -> EntryHeader:
        return self._header

    def tensor_view(self, name: str) -> memoryview:
        for spec in self.tensors:
            if spec.name == name:
                return self.data[spec.offset : spec.offset + spec.nbytes]
        raise NotFound(f"no tensor named {name!r} in this reservation")

    def commit(
        self, expected_digest: str | None = None, *, before_publish: Callable[[str], None] | None = None
    ) -> L2Entry:
        """Hashes the bytes, writes the header and publishes the entry atomically under its key.

        ``before_publish`` is called with the payload digest after hashing and before the entry becomes
        visible (the tier rules use it to retire a stale durable copy first).
        """
        entry = self._finish(expected_digest, before_publish, only_if_absent=False)
        assert entry is not None
        return entry

    def commit_if_absent(self, expected_digest: str | None = None) -> L2Entry | None:
        """:meth:`commit`, unless an entry appeared under the key meanwhile (then None: it is newer)."""
        return self._finish(expected_digest, None, only_if_absent=True)

    def _finish(
        self,
        expected_digest: str | None,
        before_publish: Callable[[str], None] | None,
        *,
        only_if_absent: bool,
    ) -> L2Entry | None:
        if self._done:
            raise InvalidArgument("reservation already committed or aborted")
        self._done = True
        self.data.release()
        try:
            entry = self._tier._commit(
                self._file,
                self._header,
                self._data_offset,
                expected_digest,
                before_publish,
                only_if_absent=only_if_absent,
            )
        except BaseException:
            self._tier._abort(self._file)
            raise
        if entry is None:
            self._tier._abort(self._file)
        return entry

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self.data.release()
        self._tier._abort(self._file)


class L2Tier:
    """The tmpfs tier. Thread-safe; one owning process per directory."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        hash_threads: int = 2,
        map_threshold: int = 1 << 20,
        verify_on_adopt: bool = True,
    ) -> None:
        if budget_bytes <= 0:
            raise InvalidArgument("the L2 budget must be positive")
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self._hash_threads = max(1, hash_threads)
        # Files at least this large keep their mapping between uses (re-mapping costs a page-table
        # fault per page); the floor keeps the number of mappings under the kernel's vm.max_map_count.
        self._map_threshold = max(map_threshold, self.budget_bytes // 16384)
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, _Slot] = OrderedDict()
        self._by_identity: dict[str, _Lengths] = {}
        self._by_digest: dict[str, set[str]] = {}
        self._free: dict[int, list[_File]] = {}
        self._bytes = 0
        self._free_bytes = 0
        self._reserved = 0
        self._stats = L2Stats(budget_bytes=self.budget_bytes)
        self._tick = 0
        self._dirty: set[str] = set()
        self._closed = False
        self._entries_dir = self.directory / "entries"
        self._free_dir = self.directory / "free"
        self._tmp_dir = self.directory / "tmp"
        private_dirs(self.directory, self._entries_dir, self._free_dir, self._tmp_dir)
        self._lock_fd = take_owner_lock(self.directory)
        try:
            self._adopt(verify_on_adopt)
        except BaseException:
            os.close(self._lock_fd)
            raise

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Writes pending recency, drops mappings and releases the directory. Entries stay on tmpfs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.flush_recency()
            for slot in self._entries.values():
                slot.file.unmap()
            for files in self._free.values():
                for file in files:
                    file.unmap()
            os.close(self._lock_fd)

    def __enter__(self) -> L2Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- adoption

    def _adopt(self, verify: bool) -> None:
        for child in self._tmp_dir.iterdir():
            remove(child)
        for child in self._free_dir.iterdir():
            try:
                st = child.lstat()
            except FileNotFoundError:
                continue
            if (
                not child.name.endswith(".free")
                or not _is_regular(st)
                or size_class(st.st_size) != st.st_size
            ):
                remove(child)
                continue
            self._add_free(_File(child, st.st_size, freed_at=time.monotonic()))
        found: list[tuple[int, str, _Slot]] = []
        for child in self._entries_dir.iterdir():
            try:
                slot, mtime = self._adopt_one(child, verify)
            except (CorruptEntry, OSError, SkippydError, ValueError) as exc:
                log.warning("dropping an L2 entry that failed verification: %s", exc)
                self._stats.adopt_dropped += 1
                remove(child)
                continue
            found.append((mtime, slot.entry.key, slot))
        found.sort(key=lambda item: (item[0], item[1]))
        for mtime, _key, slot in found:
            self._tick = max(self._tick, mtime)
            self._insert(slot)
            self._stats.adopted += 1
        while self._bytes + self._free_bytes > self.budget_bytes:
            if not self._drop_one_free() and not self._evict_oldest():
                break

    def _adopt_one(self, path: Path, verify: bool) -> tuple[_Slot, int]:
        if not _ENTRY_NAME.match(path.name):
            raise CorruptEntry(f"unexpected file {path.name}")
        st = path.lstat()
        if not _is_regular(st):
            raise CorruptEntry(f"{path.name} is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fixed = decode_fixed(os.pread(fd, 64, 0))
            header = decode_header(fixed, os.pread(fd, fixed.header_len, 64))
            if header.key + ".skp" != path.name:
                raise CorruptEntry(f"{path.name} holds the entry of another key")
            if fixed.data_offset + fixed.data_len > st.st_size:
                raise CorruptEntry(f"{path.name} is truncated")
            if verify and header.data_len:
                with mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as view:
                    digest = payload_digest(
                        view, header.tensors, base=fixed.data_offset, threads=self._hash_threads
                    )
                if digest != header.digest:
                    raise CorruptEntry(f"{path.name}: payload digest does not match")
        finally:
            os.close(fd)
        entry = _entry_from_header(header, fixed.data_offset, st.st_size)
        return _Slot(entry, _File(path, st.st_size), st.st_mtime_ns), st.st_mtime_ns

    # ----------------------------------------------------------------- admission

    def reserve(
        self,
        *,
        key: str,
        identity: Identity | str,
        token_count: int,
        tensors: Sequence[TensorDecl],
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        origin: str = "capture",
        evict: bool = True,
        replace: bool = True,
    ) -> Reservation:
        """Room for a new entry; evicts LRU entries as needed. Refuses what can never fit.

        Re-admitting a key replaces it: the old entry leaves the index now (its memory may serve the new
        one), and the new one is visible from :meth:`Reservation.commit` on.
        """
        header, data_offset, size = self._plan(
            key=key,
            identity=identity,
            token_count=token_count,
            tensors=tensors,
            kind=kind,
            meta=meta,
            origin=origin,
        )
        file = self._obtain(size, replacing=key if replace else None, evict=evict)
        try:
            return Reservation(self, file, header, data_offset)
        except BaseException:
            self._abort(file)
            raise

    @staticmethod
    def file_size_for(
        *,
        token_count: int,
        tensors: Sequence[TensorDecl],
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        origin: str = "capture",
    ) -> int:
        """The tmpfs bytes an entry with this table would occupy (what the budget is charged)."""
        return L2Tier._plan(
            key=_PLACEHOLDER_DIGEST,
            identity=_PLACEHOLDER_DIGEST,
            token_count=token_count,
            tensors=tensors,
            kind=kind,
            meta=meta,
            origin=origin,
        )[2]

    @staticmethod
    def _plan(
        *,
        key: str,
        identity: Identity | str,
        token_count: int,
        tensors: Sequence[TensorDecl],
        kind: str,
        meta: Mapping[str, Any] | None,
        origin: str,
    ) -> tuple[EntryHeader, int, int]:
        if not is_hex_digest(key):
            raise InvalidArgument("key must be a hex BLAKE3 digest")
        ident = identity.digest if isinstance(identity, Identity) else identity
        specs, data_len = plan_layout(tensors)
        header = EntryHeader(
            key=key,
            identity=ident,
            token_count=token_count,
            kind=check_kind(kind),
            digest=_PLACEHOLDER_DIGEST,
            meta=check_meta(meta),
            tensors=tuple(specs),
            data_len=data_len,
            created_ns=time.time_ns(),
            origin=origin,
        )
        data_offset = header_span(header)
        return header, data_offset, size_class(data_offset + data_len)

    def admit(
        self,
        *,
        key: str,
        identity: Identity | str,
        token_count: int,
        tensors: Sequence[TensorDecl],
        data: Sequence[Any],
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        expected_digest: str | None = None,
        origin: str = "capture",
    ) -> L2Entry:
        """Copies each tensor's bytes (``data[i]`` for ``tensors[i]``) into a new entry and commits it."""
        if len(data) != len(tensors):
            raise InvalidArgument("one buffer per declared tensor")
        with self.reserve(
            key=key,
            identity=identity,
            token_count=token_count,
            tensors=tensors,
            kind=kind,
            meta=meta,
            origin=origin,
        ) as reservation:
            for spec, source in zip(reservation.tensors, data, strict=True):
                copy_into(reservation.data, spec.offset, spec.nbytes, source, threads=self._hash_threads)
            return reservation.commit(expected_digest)

    def _obtain(self, size: int, replacing: str | None, *, evict: bool = True) -> _File:
        """A file of exactly ``size`` bytes for a reservation, accounted as reserved.

        Everything that picks a file and moves it out of ``entries/``/``free/`` happens under the lock, so
        no commit of the same key can slip a new file under the old name in between. With ``evict=False``
        no entry is evicted for room (only recycled free files are given back): :class:`NoSpace` instead.
        """
        with self._lock:
            self._check_open()
            if size > self.budget_bytes:
                self._stats.refused_bytes += size
                raise TooLarge(f"an entry of {size} bytes is larger than the L2 budget ({self.budget_bytes})")
            old = self._entries.get(replacing) if replacing is not None else None
            if old is not None:
                self._detach(old)
                self._recycle(old.file)
            reuse = self._take_free(size)
            if reuse is None:
                if not evict and self._room() + self._free_bytes < size:  # free files alone would not do
                    raise NoSpace("no room in L2 without evicting an entry")
                reuse = self._make_room(size)  # (drops free files before it evicts any entry)
            self._reserved += size
            if reuse is not None:
                claimed = self._claim(reuse)
                if claimed is not None:
                    return claimed
        try:
            return self._fresh(size)
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise

    def _claim(self, file: _File) -> _File | None:
        """Moves a recycled file into ``tmp/`` for a reservation (lock held); None if that failed."""
        target = self._tmp_dir / new_name(".part")
        try:
            os.rename(file.path, target)
        except OSError as exc:
            log.warning("could not reuse %s (%s); allocating a fresh file", file.path.name, exc)
            self._unlink_file(file)
            return None
        file.path = target
        file.fresh = False
        self._stats.reused_files += 1
        return file

    def _fresh(self, size: int) -> _File:
        path = self._tmp_dir / new_name(".part")
        try:
            fd = allocate_file(path, size)
        except NoSpace:
            # tmpfs is shared with others: give back our free files and try once more
            with self._lock:
                while self._drop_one_free():
                    pass
            fd = allocate_file(path, size)
        try:
            mapping = map_rw(fd, size)
        except BaseException:
            remove(path)
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._stats.fresh_files += 1
        return _File(path, size, mapping=mapping, fresh=True)

    def _make_room(self, size: int) -> _File | None:
        """Frees budget for ``size`` bytes; returns a recycled same-size file when eviction yields one."""
        while self._room() < size:
            if self._drop_one_free():
                continue
            victim = self._oldest()
            if victim is None:
                raise NoSpace("the L2 budget is held by captures still in flight; retry shortly")
            self._detach(victim)
            self._stats.evictions += 1
            if victim.file.size == size and not has_readers(victim.file.path):
                return victim.file
            self._discard_file(victim.file)
        return None

    def _room(self) -> int:
        return self.budget_bytes - self._bytes - self._free_bytes - self._reserved

    def _commit(
        self,
        file: _File,
        header: EntryHeader,
        data_offset: int,
        expected: str | None,
        before_publish: Callable[[str], None] | None,
        *,
        only_if_absent: bool,
    ) -> L2Entry | None:
        mapping = file.ensure_mapped()
        view = memoryview(mapping)
        try:
            if not file.fresh:
                _zero_gaps(view, header.tensors, data_offset, header.data_len, file.size)
            threads = self._hash_threads if header.data_len >= _THREADED_HASH_BYTES else 1
            digest = payload_digest(view, header.tensors, base=data_offset, threads=threads)
            if expected is not None and digest != expected:
                with self._lock:
                    self._stats.admission_rejects += 1
                raise DigestMismatch(f"payload digest {digest} is not the expected {expected}")
            final = replace(header, digest=digest)
            head, offset = encode_header(final)
            if offset != data_offset:  # pragma: no cover - the placeholder keeps the length
                raise RuntimeError("entry header changed length between reserve and commit")
            view[: len(head)] = head
            zero(view, len(head), data_offset)
        finally:
            view.release()
        if before_publish is not None:
            before_publish(digest)
        with self._lock:
            self._check_open()
            if only_if_absent and final.key in self._entries:
                return None
            tick = self._next_tick()
            os.utime(file.path, ns=(tick, tick))
            old = self._entries.get(final.key)
            if old is not None:
                self._detach(old)
                self._recycle(old.file)
            target = self._entries_dir / f"{final.key}.skp"
            os.rename(file.path, target)
            file.path = target
            self._reserved -= file.size
            entry = _entry_from_header(final, data_offset, file.size)
            self._insert(_Slot(entry, file, tick))
            self._keep_or_unmap(file)
            self._stats.inserts += 1
            return entry

    def _abort(self, file: _File) -> None:
        with self._lock:
            self._reserved -= file.size
            if self._closed:
                file.unmap()
                remove(file.path)
                return
            self._recycle(file)

    # ----------------------------------------------------------------- lookups

    def get(self, key: str) -> L2Entry | None:
        """The entry under ``key``; a hit moves it to most recently used, a miss counts."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            return self._touch(slot)

    def count_miss(self) -> None:
        """Counts a miss found by a lookup made elsewhere (the tier rules look at both tiers)."""
        with self._lock:
            self._stats.misses += 1

    def peek(self, key: str) -> L2Entry | None:
        """The entry under ``key`` without touching recency or counters."""
        with self._lock:
            slot = self._entries.get(key)
            return slot.entry if slot is not None else None

    def lookup(self, identity: Identity, token_bytes: bytes | memoryview) -> L2Entry | None:
        """The longest captured prefix of ``token_bytes`` for ``identity`` (a hit moves recency).

        Cost: one pass over the prompt plus one hash finalisation per distinct captured length of this
        identity; entries of other identities are never looked at.
        """
        candidates = self.prefix_lengths(identity.digest, len(token_bytes) // 4)
        if candidates:
            keys = prefix_keys(identity, token_bytes, candidates)
            with self._lock:
                for key in reversed(keys):
                    slot = self._entries.get(key)
                    if slot is not None:
                        self._stats.hits += 1
                        return self._touch(slot)
        with self._lock:
            self._stats.misses += 1
        return None

    def prefix_lengths(self, identity_digest: str, upto: int) -> list[int]:
        """Distinct captured token counts of an identity that are at most ``upto``, ascending."""
        with self._lock:
            lengths = self._by_identity.get(identity_digest)
            return lengths.upto(upto) if lengths is not None else []

    def open_reader(self, key: str) -> tuple[int, L2Entry] | None:
        """A read-only fd of the entry holding a lease (see :mod:`skippyd.shm`); the caller closes it.

        Does not count a hit or move recency (call :meth:`get`/:meth:`lookup` for that).
        """
        with self._lock:
            slot = self._entries.get(key)
            if slot is None:
                return None
            return open_reader(slot.file.path), slot.entry

    @contextlib.contextmanager
    def borrow(self, key: str) -> Iterator[tuple[L2Entry, memoryview]]:
        """A read-only view of an entry's data region, leased for the duration of the block."""
        opened = self.open_reader(key)
        if opened is None:
            raise NotFound("no such L2 entry")
        fd, entry = opened
        try:
            mapping = mmap.mmap(fd, entry.file_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = memoryview(mapping)[entry.data_offset : entry.data_offset + entry.data_len]
        try:
            yield entry, view
        finally:
            view.release()
            mapping.close()

    def entries(self) -> list[L2Entry]:
        """Every entry, least recently used first."""
        with self._lock:
            return [slot.entry for slot in self._entries.values()]

    def entries_with_last_use(self) -> list[tuple[L2Entry, int]]:
        """Every entry with its last use (ns since the epoch), least recently used first."""
        with self._lock:
            return [(slot.entry, slot.last_use) for slot in self._entries.values()]

    def keys_by_digest(self, digest: str) -> list[str]:
        with self._lock:
            return sorted(self._by_digest.get(digest, ()))

    def digests(self) -> list[str]:
        """Every payload digest held (once each)."""
        with self._lock:
            return list(self._by_digest)

    # ----------------------------------------------------------------- removal

    def remove(self, key: str) -> bool:
        with self._lock:
            slot = self._entries.get(key)
            if slot is None:
                return False
            self._detach(slot)
            self._recycle(slot.file)
            return True

    def remove_by_digest(self, digest: str) -> int:
        """Removes every entry whose payload digest is ``digest``; returns how many."""
        with self._lock:
            keys = list(self._by_digest.get(digest, ()))
            for key in keys:
                self.remove(key)
            return len(keys)

    def clear(self) -> int:
        """Removes every entry and gives the free files' memory back to the system."""
        with self._lock:
            count = len(self._entries)
            for slot in list(self._entries.values()):
                self._detach(slot)
                self._discard_file(slot.file)
            while self._drop_one_free():
                pass
            return count

    def trim_free(self, idle_seconds: float) -> int:
        """Gives back free files unused for ``idle_seconds``; returns the bytes released."""
        cutoff = time.monotonic() - idle_seconds
        released = 0
        with self._lock:
            for size, files in list(self._free.items()):
                keep = [f for f in files if f.freed_at > cutoff]
                for file in files:
                    if file.freed_at <= cutoff:
                        self._unlink_file(file)
                        self._free_bytes -= size
                        released += size
                if keep:
                    self._free[size] = keep
                else:
                    del self._free[size]
        return released

    # ----------------------------------------------------------------- stats & housekeeping

    def stats(self) -> L2Stats:
        with self._lock:
            stats = replace(self._stats)
            stats.budget_bytes = self.budget_bytes
            stats.entries = len(self._entries)
            stats.bytes = self._bytes
            stats.payload_bytes = sum(slot.entry.nbytes for slot in self._entries.values())
            stats.free_bytes = self._free_bytes
            stats.free_files = sum(len(files) for files in self._free.values())
            stats.reserved_bytes = self._reserved
            return stats

    def flush_recency(self) -> None:
        """Records each touched entry's last use as its file's mtime, so a restart keeps LRU order."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                slot = self._entries.get(key)
                if slot is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.utime(slot.file.path, ns=(slot.last_use, slot.last_use))

    # ----------------------------------------------------------------- internals (lock held)

    def _check_open(self) -> None:
        if self._closed:
            raise SkippydError("the L2 tier is closed")

    def _next_tick(self) -> int:
        self._tick = max(self._tick + 1, time.time_ns())
        return self._tick

    def _touch(self, slot: _Slot) -> L2Entry:
        slot.last_use = self._next_tick()
        self._entries.move_to_end(slot.entry.key)
        self._dirty.add(slot.entry.key)
        return slot.entry

    def _insert(self, slot: _Slot) -> None:
        entry = slot.entry
        self._entries[entry.key] = slot
        self._entries.move_to_end(entry.key)
        self._by_identity.setdefault(entry.identity, _Lengths()).add(entry.token_count)
        self._by_digest.setdefault(entry.digest, set()).add(entry.key)
        self._bytes += slot.file.size

    def _detach(self, slot: _Slot) -> None:
        entry = slot.entry
        del self._entries[entry.key]
        self._dirty.discard(entry.key)
        lengths = self._by_identity.get(entry.identity)
        if lengths is not None:
            lengths.discard(entry.token_count)
            if not lengths.counts:
                del self._by_identity[entry.identity]
        keys = self._by_digest.get(entry.digest)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._by_digest[entry.digest]
        self._bytes -= slot.file.size

    def _oldest(self) -> _Slot | None:
        return next(iter(self._entries.values()), None)

    def _evict_oldest(self) -> bool:
        victim = self._oldest()
        if victim is None:
            return False
        self._detach(victim)
        self._stats.evictions += 1
        self._discard_file(victim.file)
        return True

    def _recycle(self, file: _File) -> None:
        """A file leaving use: kept as a free file when nobody reads it and the budget allows."""
        if has_readers(file.path) or self._room() < file.size:
            self._discard_file(file)
            return
        target = self._free_dir / new_name(".free")
        try:
            os.rename(file.path, target)
        except OSError:
            self._discard_file(file)
            return
        file.path = target
        file.freed_at = time.monotonic()
        self._add_free(file)

    def _add_free(self, file: _File) -> None:
        self._free.setdefault(file.size, []).append(file)
        self._free_bytes += file.size

    def _take_free(self, size: int) -> _File | None:
        files = self._free.get(size)
        if not files:
            return None
        file = files.pop()
        if not files:
            del self._free[size]
        self._free_bytes -= size
        return file

    def _drop_one_free(self) -> bool:
        if not self._free:
            return False
        size = max(self._free)
        file = self._take_free(size)
        assert file is not None
        self._unlink_file(file)
        return True

    def _discard_file(self, file: _File) -> None:
        if has_readers(file.path):
            self._stats.reader_held_drops += 1
        self._unlink_file(file)

    def _unlink_file(self, file: _File) -> None:
        file.unmap()
        remove(file.path)

    def _keep_or_unmap(self, file: _File) -> None:
        if file.size < self._map_threshold:
            file.unmap()


def copy_into(region: memoryview, offset: int, nbytes: int, source: Any, *, threads: int = 1) -> None:
    """Copies ``nbytes`` from a buffer into ``region[offset:]`` (releases the GIL)."""
    if nbytes == 0:
        return
    src = memoryview(source).cast("B")
    if src.nbytes != nbytes:
        raise InvalidArgument(f"a tensor buffer holds {src.nbytes} bytes, its declaration {nbytes}")
    copy_bytes(region[offset : offset + nbytes], src, threads)


def _zero_gaps(view: memoryview, tensors: Sequence[TensorSpec], base: int, data_len: int, size: int) -> None:
    """Zeroes every byte of a recycled file that the new entry does not write (no stale data leaks)."""
    cursor = base
    for spec in tensors:
        zero(view, cursor, base + spec.offset)
        cursor = max(cursor, base + spec.offset + spec.nbytes)
    zero(view, cursor, size)
    del data_len


def _entry_from_header(header: EntryHeader, data_offset: int, file_size: int) -> L2Entry:
    return L2Entry(
        key=header.key,
        identity=header.identity,
        token_count=header.token_count,
        kind=header.kind,
        digest=header.digest,
        meta=MappingProxyType(dict(header.meta)),
        tensors=header.tensors,
        data_offset=data_offset,
        data_len=header.data_len,
        file_size=file_size,
        created_ns=header.created_ns,
        origin=header.origin,
    )


def _is_regular(st: os.stat_result) -> bool:
    import stat

    return stat.S_ISREG(st.st_mode)
