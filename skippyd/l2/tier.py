"""The L2 hot tier: committed entries as files in a tmpfs directory, a byte budget, LRU eviction.

* The budget covers every byte the tier holds in tmpfs: entries, free files kept for reuse
  (:mod:`skippyd.l2.pool`) and reservations in flight. An entry larger than the whole budget is refused
  before anything is evicted.
* LRU eviction, oldest use first; :meth:`L2Tier.hold` moves recency on a real hit, :meth:`L2Tier.peek`
  never. Re-admitting a key replaces its entry with exact accounting.
* The daemon computes the payload digest after copying the bytes into memory no client can write; a
  mismatch with an expected digest stores nothing and counts ``admission_rejects``.
* A new process over the same directory re-adopts committed entries (:mod:`skippyd.l2.adopt`).

Directory layout (0700): ``.lock`` (owner), ``entries/<key>.skp``, ``free/<random>.free``, ``tmp/``;
``pending/`` belongs to the durable writer (:mod:`skippyd.durable`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from blake3 import blake3

from skippyd.errors import DigestMismatch, InvalidArgument, NoSpace, SkippydError, TooLarge
from skippyd.files import private_dirs, release_owner_lock, remove, set_mtimes, take_owner_lock
from skippyd.index import PrefixIndex
from skippyd.keys import Identity, is_hex_digest
from skippyd.payload import (
    Entry,
    TensorDecl,
    TensorSpec,
    check_kind,
    check_meta,
    encode_header,
    header_span,
    payload_digest,
    plan_layout,
)
from skippyd.shm import _copy_pool, copy_bytes, has_readers, open_reader, size_class, zero

from . import adopt as adoption
from .blocks import L2Blocks, L2BlockStats, Prefault
from .demand import Demand
from .pool import ANY_OWNER, File, FilePool, owner_of

__all__ = ["Held", "L2Stats", "L2Tier", "Listed", "Reservation", "copy_into"]

log = logging.getLogger("skippyd.l2")
T = TypeVar("T")

_THREADED_HASH_BYTES = 4 << 20
_PLACEHOLDER_DIGEST = "0" * 64


@dataclass(slots=True)
class L2Stats(L2BlockStats):
    """The tier's counters: its entries' below, its blocks' (``block_*``) from :class:`L2BlockStats`."""

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
    prefaulted_files: int = 0  # free entry files the reserve faulted in ahead of demand
    # The one reading of L2 usage that status, top, stats, metrics and doctor all print:
    used_bytes: int = 0  # what cached data takes: the entries' files and the held blocks' slots
    reserve_bytes: int = 0  # pre-faulted memory holding no data: free entry files and free block slots
    reserve_given_back: int = 0  # bytes of free files and slots the reserve gave back (its decay)


@dataclass(slots=True)
class Ready:
    """One kind of free memory the reserve keeps ready (:meth:`L2Tier._ready_plan`)."""

    group: tuple[bytes, int] | None  # a block group (space, slot size); None: entry files of ``unit`` bytes
    unit: int  # one slot's or one file's bytes
    target: int  # bytes to keep ready
    free: int  # bytes ready now


@dataclass(frozen=True, slots=True)
class Held:
    """An entry opened for reading: a read-only fd holding a lease (the caller closes it), the entry, and
    where its data region starts in the file."""

    fd: int
    entry: Entry
    data_offset: int
    generation: int = 0  # the file's (docs/protocol.md, "Generations")


@dataclass(frozen=True, slots=True)
class Listed:
    entry: Entry
    file_size: int
    last_use: int  # ns since the epoch


@dataclass(slots=True)
class _Slot:
    entry: Entry
    file: File
    data_offset: int
    last_use: int = 0


class Reservation:
    """Room for one entry: write the tensor bytes into :attr:`data`, then :meth:`commit`.

    The data region lives in memory only the daemon can write; the digest is computed at commit over
    exactly these bytes. A reservation that is neither committed nor aborted is aborted when collected.
    """

    def __init__(self, tier: L2Tier, file: File, entry: Entry, data_offset: int) -> None:
        self._tier = tier
        self._file = file
        self.entry = entry  # its digest is a placeholder until the commit
        self.data_offset = data_offset
        self._done = False
        self.key = entry.key
        self.file_size = file.size
        mapping = file.ensure_mapped()
        self.data: memoryview = memoryview(mapping)[data_offset : data_offset + entry.data_len]

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.entry.tensors

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
        """A leased read-only fd of the reserved file (its data region is at ``data_offset``), for a
        client: the file is reused only for this entry's identity from now on (see :mod:`.pool`)."""
        if self._done:
            raise InvalidArgument("reservation already committed or aborted")
        self._file.owner = owner_of(self.entry.identity)
        return open_reader(self._file.path)

    def commit(
        self,
        expected_digest: str | None = None,
        *,
        before_publish: Callable[[str], None] | None = None,
        digest: str | None = None,
    ) -> Entry:
        """Hashes the bytes, writes the header and publishes the entry atomically under its key.

        ``before_publish`` is called with the payload digest after hashing and before the entry becomes
        visible (the tier rules use it to retire a stale durable copy and record a durable intent).
        ``digest``: the payload digest the caller computed over :attr:`data` itself, as it wrote it (a
        capture hashes each chunk of its copy while it copies the next); not hashed again.
        """
        entry = self._finish(expected_digest, before_publish, only_if_absent=False, digest=digest)
        assert entry is not None
        return entry

    def commit_unless(
        self,
        evicted: Callable[[str], bool],
        *,
        before_publish: Callable[[str], None] | None = None,
        digest: str | None = None,
    ) -> Entry | None:
        """:meth:`commit`, unless ``evicted(digest)`` says, under the tier's lock right before the entry
        would become visible, that an eviction overtook it (then None: nothing is published)."""
        return self._finish(None, before_publish, only_if_absent=False, digest=digest, evicted=evicted)

    def commit_if_absent(self, expected_digest: str | None = None) -> Entry | None:
        """:meth:`commit`, unless an entry appeared under the key meanwhile (then None: it is newer)."""
        return self._finish(expected_digest, None, only_if_absent=True)

    def _finish(
        self,
        expected_digest: str | None,
        before_publish: Callable[[str], None] | None,
        *,
        only_if_absent: bool,
        digest: str | None = None,
        evicted: Callable[[str], bool] | None = None,
    ) -> Entry | None:
        if self._done:
            raise InvalidArgument("reservation already committed or aborted")
        self._done = True
        self.data.release()
        try:
            entry = self._tier._commit(
                self._file, self.entry, self.data_offset, expected_digest, before_publish,
                only_if_absent=only_if_absent, computed=digest, evicted=evicted,
            )  # fmt: skip
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
    """The tmpfs tier. Thread-safe; one owning process per directory.

    The constructor takes the directory (its lock, its subdirectories) and nothing else; :meth:`adopt`
    brings back what an earlier process left there. :meth:`open` does both.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        hash_threads: int = 2,
        map_threshold: int = 1 << 20,
    ) -> None:
        if budget_bytes <= 0:
            raise InvalidArgument("the L2 budget must be positive")
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self._hash_threads = max(1, hash_threads)
        self._lock = threading.RLock()
        # slots and files the reserve faults in outside the lock (charged, neither free nor evictable): a
        # put that finds no other room waits for them (the lock released) instead of failing NoSpace
        self._faults_in_flight = 0
        self._fault_done = threading.Condition(self._lock)  # also notified whenever a fill ends
        # puts and L3 reads (fills) that wait in _make_room for another fill to commit: a fill waits only
        # while some other fill is not waiting itself, so two never wait for each other
        self._fills_waiting = 0
        self._index: PrefixIndex[_Slot] = PrefixIndex()
        self._bytes = 0  # file bytes of committed entries
        self._payload = 0  # their payload bytes (kept, not summed: stats runs on the event loop)
        self._reserved = 0
        self._stats = L2Stats(budget_bytes=self.budget_bytes)
        self._tick = 0
        self._dirty: set[str] = set()
        self._entry_demand: dict[int, Demand] = {}  # size class -> file bytes new entries took lately
        self._closed = False
        self._entries_dir = self.directory / "entries"
        # Files at least this large keep their mapping between uses (re-mapping costs a page-table
        # fault per page); the floor keeps the number of mappings under the kernel's vm.max_map_count.
        self._pool = FilePool(
            self.directory / "free",
            self.directory / "tmp",
            max(map_threshold, self.budget_bytes // 16384),
            threads=self._hash_threads,
        )
        private_dirs(self.directory)
        # before anything under the directory is touched
        self._lock_fd = take_owner_lock(self.directory, "L2 tier")
        try:
            private_dirs(self._entries_dir, self._pool.free_dir, self._pool.tmp_dir)
            self.blocks = L2Blocks(
                self.directory / "blocks", self._lock, budget_bytes=self.budget_bytes,
                make_room=self._free_room, room=self._room, evict_one=self._evict_one, tick=self._next_tick,
                fill_ended=self._fault_done.notify_all,
            )  # fmt: skip
        except BaseException:
            release_owner_lock(self._lock_fd)
            raise

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        verify: bool = True,
        hash_threads: int = 2,
        map_threshold: int = 1 << 20,
    ) -> L2Tier:
        """The tier over ``directory`` with what an earlier process left there re-adopted."""
        tier = cls(directory, budget_bytes, hash_threads=hash_threads, map_threshold=map_threshold)
        try:
            tier.adopt(verify=verify)
        except BaseException:
            tier.close()
            raise
        return tier

    @property
    def lock(self) -> threading.RLock:
        """The tier's lock: its entries and its blocks (:attr:`blocks`) change under it."""
        return self._lock

    @staticmethod
    def bytes_to_verify(directory: str | os.PathLike[str]) -> int:
        """How many bytes :meth:`adopt` will hash in ``directory`` (for systemd's start timeout)."""
        return adoption.bytes_to_verify(Path(directory))

    # ----------------------------------------------------------------- lifecycle
    def adopt(self, *, verify: bool = True) -> None:
        """Re-adopts the committed entries and free files an earlier process left, dropping the rest."""
        found = adoption.adopt(self.directory, verify=verify, hash_threads=self._hash_threads)
        with self._lock:
            self.blocks.adopt(verify=verify)
            for path, size, owner in found.free:
                self._pool.add_free(File(path, size, freed_at=time.monotonic(), owner=owner))
            for item in found.entries:
                self._tick = max(self._tick, item.last_use)
                # (an earlier process may have served it: bound to its identity)
                file = File(item.path, item.file_size, owner=owner_of(item.entry.identity))
                slot = _Slot(item.entry, file, item.data_offset, item.last_use)
                self._insert(slot)
                self._stats.adopted += 1
            self._stats.adopt_dropped += found.dropped
            while self._room() < 0:
                if not (self.blocks.release_free() or self._evict_one()):
                    break

    def close(self) -> None:
        """Writes pending recency, gives back the memory that holds no data (free entry files and free
        block slots: the reserve, pre-faulted ahead of demand, and what evictions left for reuse), drops
        mappings and releases the directory. Entries and blocks stay on tmpfs for the next start to adopt;
        a file or slot a client still reads keeps its pages."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.flush_recency()
            self._pool.drop_all()
            self.blocks.close()
            for slot in self._index:
                slot.file.unmap()
            release_owner_lock(self._lock_fd)

    def __enter__(self) -> L2Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        """Room for a new entry; evicts LRU entries as needed (not with ``evict=False``: then only free
        files are given back, and :class:`NoSpace` is raised without room). Refuses what can never fit.

        With ``replace`` the key's current entry leaves the index now (its memory may serve the new one),
        and the new one is visible from :meth:`Reservation.commit` on.
        """
        entry, data_offset, size = self._plan(
            key=key, identity=identity, token_count=token_count, tensors=tensors, kind=kind, meta=meta,
            origin=origin,
        )  # fmt: skip
        file = self._obtain(size, owner_of(entry.identity), replacing=key if replace else None, evict=evict)
        try:
            return Reservation(self, file, entry, data_offset)
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
            key=_PLACEHOLDER_DIGEST, identity=_PLACEHOLDER_DIGEST, token_count=token_count, tensors=tensors,
            kind=kind, meta=meta, origin=origin,
        )[2]  # fmt: skip

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
    ) -> tuple[Entry, int, int]:
        if not is_hex_digest(key):
            raise InvalidArgument("key must be a hex BLAKE3 digest")
        ident = identity.digest if isinstance(identity, Identity) else identity
        specs, data_len = plan_layout(tensors)
        entry = Entry(
            key=key, identity=ident, token_count=token_count, kind=check_kind(kind),
            digest=_PLACEHOLDER_DIGEST, meta=check_meta(meta), tensors=tuple(specs), data_len=data_len,
            created_ns=time.time_ns(), origin=origin,
        )  # fmt: skip
        data_offset = header_span(entry)
        return entry, data_offset, size_class(data_offset + data_len)

    def _obtain(self, size: int, owner: str, replacing: str | None, *, evict: bool = True) -> File:
        """A file of exactly ``size`` bytes for a reservation of an entry of ``owner`` (:func:`owner_of` its
        identity: a file served for another identity is never reused for it), accounted as reserved.

        Everything that picks a file and moves it out of ``entries/``/``free/`` happens under the lock, so
        no commit of the same key can slip a new file under the old name in between.
        """
        with self._lock:
            self._check_open()
            if size > self.budget_bytes:
                self._stats.refused_bytes += size
                raise TooLarge(f"an entry of {size} bytes is larger than the L2 budget ({self.budget_bytes})")
            old = self._index.get(replacing) if replacing is not None else None
            if old is not None:
                self._detach(old)
                self._pool.recycle(old.file, room=self._room())
            if old is None or old.file.size != size:  # (a same-size replacement reuses its own file)
                self._entry_demand.setdefault(size, Demand()).add(size, time.monotonic())
            reuse = self._pool.take(size, owner)
            if reuse is None:
                if not evict and self._room() + self._pool.free_bytes < size:  # free files alone won't do
                    raise NoSpace("no room in L2 without evicting an entry")
                reuse = self._make_room(size, owner=owner)  # (drops free files before it evicts any entry)
            self._reserved += size
            if reuse is not None:
                return reuse
        try:
            return self._fresh(size)
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise

    def _fresh(self, size: int) -> File:
        try:
            file = self._pool.fresh(size)
        except NoSpace:
            with self._lock:  # tmpfs is shared with others: give back our free files, try once more
                self._pool.drop_all()
            file = self._pool.fresh(size)
        with self._lock:
            self._pool.note_fresh()
        return file

    def _make_room(
        self, size: int, *, owner: str | None = None, own_fills: int = 0, mine: int = 0
    ) -> File | None:
        """Frees budget for ``size`` bytes: free entry files first, then free block slots, then the least
        recently used entry or block, whichever is older. With ``owner`` (a reservation's), an evicted
        entry's file of exactly ``size`` bytes that may serve it is returned for reuse instead of being
        unlinked. Where nothing is left to
        evict but memory that is about to be (slots the reserve faults in, free slots a lease still reads,
        slots another put or L3 read is filling: ``own_fills`` of the fills are the caller's own, and
        ``mine`` bytes of their slots), it waits for that, the lock released, at most a few seconds each,
        before :class:`NoSpace`. A fill waits for others' slots only while some fill that is not waiting
        itself may commit them, so two fills never wait on each other."""
        fault_deadline = read_deadline = fill_deadline = 0.0
        while self._room() < size:
            if self._pool.drop_one() or self.blocks.release_free():
                continue
            if self._oldest_is_block():
                self.blocks.evict_oldest()
                continue
            victim = self._index.oldest()
            if victim is None:
                now = time.monotonic()
                if self._faults_in_flight:  # the reserve faults a slot or file in: it is free memory soon
                    fault_deadline = fault_deadline or now + _FAULT_WAIT_S
                    if now < fault_deadline:
                        self._fault_done.wait(fault_deadline - now)  # (the lock is released meanwhile)
                        continue
                if self.blocks.free_slots_read():  # read by a lease (the digester's, a get's): soon free
                    read_deadline = read_deadline or now + _READ_WAIT_S
                    if now < read_deadline:
                        self._fault_done.wait(0.005)  # (the lock is released meanwhile)
                        continue
                if (
                    self.blocks.fills - own_fills - self._fills_waiting > 0
                    and self.blocks.pending_bytes > mine
                ):  # another fill holds slots it commits (then evictable) or gives back soon
                    fill_deadline = fill_deadline or now + _FILL_WAIT_S
                    if now < fill_deadline:
                        self._fills_waiting += own_fills
                        try:
                            self._fault_done.wait(fill_deadline - now)  # (woken when a fill ends)
                        finally:
                            self._fills_waiting -= own_fills
                        continue
                raise NoSpace("the L2 budget is held by captures and puts still in flight; retry shortly")
            self._detach(victim)
            self._stats.evictions += 1
            if (
                owner is not None
                and victim.file.size == size
                and victim.file.owner in (ANY_OWNER, owner)
                and not has_readers(victim.file.path)
            ):
                claimed = self._pool.claim(victim.file)  # (a failed claim unlinked the file)
                if claimed is not None:
                    return claimed
                continue
            self._pool.discard(victim.file)
        return None

    def _free_room(self, size: int, mine: int = 0) -> None:
        """Room for ``size`` bytes of block slots (called by :class:`L2Blocks` under the lock, for a put or
        an L3 read that is a fill of its own)."""
        self._check_open()
        if size > self.budget_bytes:
            raise TooLarge(f"a block slot of {size} bytes is larger than the L2 budget ({self.budget_bytes})")
        self._make_room(size, own_fills=1, mine=mine)

    def _room(self) -> int:
        return self.budget_bytes - self._bytes - self._pool.free_bytes - self._reserved - self.blocks.charged

    def _commit(
        self,
        file: File,
        entry: Entry,
        data_offset: int,
        expected: str | None,
        before_publish: Callable[[str], None] | None,
        *,
        only_if_absent: bool,
        computed: str | None = None,
        evicted: Callable[[str], bool] | None = None,
    ) -> Entry | None:
        mapping = file.ensure_mapped()
        view = memoryview(mapping)
        try:
            if not file.fresh:
                _zero_gaps(view, entry.tensors, data_offset, file.size)
            threads = self._hash_threads if entry.data_len >= _THREADED_HASH_BYTES else 1
            digest = computed or payload_digest(view, entry.tensors, base=data_offset, threads=threads)
            if expected is not None and digest != expected:
                with self._lock:
                    self._stats.admission_rejects += 1
                raise DigestMismatch(f"payload digest {digest} is not the expected {expected}")
            final = replace(entry, digest=digest)
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
            if only_if_absent and final.key in self._index:
                return None
            if evicted is not None and evicted(digest):
                return None
            tick = self._next_tick()
            os.utime(file.path, ns=(tick, tick))
            old = self._index.get(final.key)
            if old is not None:
                self._detach(old)
                self._pool.recycle(old.file, room=self._room())
            target = self._entries_dir / f"{final.key}.skp"
            os.rename(file.path, target)
            file.path = target
            self._reserved -= file.size
            self._insert(_Slot(final, file, data_offset, tick))
            self._pool.keep_or_unmap(file)
            self._stats.inserts += 1
            return final

    def _abort(self, file: File) -> None:
        with self._lock:
            self._reserved -= file.size
            if self._closed:
                file.unmap()
                remove(file.path)
                return
            self._pool.recycle(file, room=self._room())

    # ----------------------------------------------------------------- lookups
    def hold(self, key: str, *, hit: bool = True) -> Held | None:
        """The entry under ``key`` opened for reading with a leased fd (see :mod:`skippyd.shm`), or None.

        With ``hit`` (a restore: the fd goes to a client) it counts a hit, moves recency and binds the file
        to the entry's identity (it is reused for no other: see :mod:`.pool`); without (a durable write
        reading the bytes) it changes nothing. One lookup under the lock, whatever the caller does next.
        """
        with self._lock:
            slot = self._index.get(key)
            if slot is None:
                return None
            fd = open_reader(slot.file.path)
            if hit:
                self._stats.hits += 1
                self._touch(slot)
                slot.file.owner = owner_of(slot.entry.identity)
            return Held(fd, slot.entry, slot.data_offset, slot.file.generation)

    def count_miss(self) -> None:
        """Counts a miss found by a lookup made elsewhere (the tier rules look at both tiers)."""
        with self._lock:
            self._stats.misses += 1

    def peek(self, key: str) -> Entry | None:
        """The entry under ``key`` without touching recency or counters."""
        with self._lock:
            slot = self._index.get(key)
            return slot.entry if slot is not None else None

    def prefix_lengths(self, identity_digest: str, upto: int) -> list[int]:
        """Distinct captured token counts of an identity that are at most ``upto``, ascending."""
        with self._lock:
            return self._index.lengths(identity_digest, upto)

    def entries(self) -> list[Listed]:
        """Every entry with its file size and last use, least recently used first."""
        with self._lock:
            return [Listed(slot.entry, slot.file.size, slot.last_use) for slot in self._index]

    def keys_by_digest(self, digest: str) -> list[str]:
        with self._lock:
            return self._index.keys_of(digest)

    def digests(self) -> list[str]:
        """Every payload digest held (once each)."""
        with self._lock:
            return self._index.digests()

    # ----------------------------------------------------------------- removal
    def remove(self, key: str, *, digest: str | None = None) -> bool:
        """Removes the entry under ``key`` (only if its payload digest is ``digest``, where given: a caller
        that looked at the entry first never removes one committed since)."""
        with self._lock:
            slot = self._index.get(key)
            if slot is None or (digest is not None and slot.entry.digest != digest):
                return False
            self._detach(slot)
            self._pool.recycle(slot.file, room=self._room())
            return True

    def remove_by_digest(self, digest: str) -> int:
        """Removes every entry whose payload digest is ``digest``; returns how many."""
        with self._lock:
            keys = self._index.keys_of(digest)
            for key in keys:
                self.remove(key)
            return len(keys)

    def clear(self) -> int:
        """Removes every entry held now and gives the free files' memory back to the system, in steps with
        the lock let go between them (:meth:`in_steps`; an unlink each: 100k entries at once held it
        about a second); an entry committed meanwhile stays (it came after)."""
        with self._lock:
            slots = list(self._index)
        removed = self.in_steps(slots, self._remove_slots)
        with self._lock:
            self._pool.drop_all()
        return removed

    def _remove_slots(self, slots: Sequence[_Slot]) -> int:
        """Removes these entries, those still indexed (lock held); returns how many."""
        removed = 0
        for slot in slots:
            if self._index.get(slot.entry.key) is slot:
                self._detach(slot)
                self._pool.discard(slot.file)
                removed += 1
        return removed

    def release_free_slots(self) -> int:
        """Gives back every free block slot nobody reads, :data:`_STEP` a hold of the lock (the read
        slots set aside looked at again once, first); returns how many."""
        released, look = 0, True
        while True:
            with self._lock:
                step = self.blocks.release_all_free(limit=_STEP, look=look)
            released += step
            if step < _STEP:
                return released
            look = False
            time.sleep(_PAUSE_S)

    def in_steps(self, items: Sequence[T], work: Callable[[Sequence[T]], int]) -> int:
        """Runs ``work`` on ``items`` :data:`_STEP` at a time, each step under the lock and the lock let go
        between steps (with a pause: a lock is not fair, a waiter gets it only if this thread pauses), so
        work that grows with the cache never holds it in one piece; returns the sum of what ``work``
        returned."""
        done = 0
        for start in range(0, len(items), _STEP):
            if start:
                time.sleep(_PAUSE_S)
            with self._lock:
                done += work(items[start : start + _STEP])
        return done

    def trim_free(self, idle_seconds: float) -> int:
        """Gives back free files unused for ``idle_seconds``; returns the bytes released."""
        with self._lock:
            return self._pool.trim(idle_seconds)

    # ----------------------------------------------------------------- stats & housekeeping
    def stats(self) -> L2Stats:
        with self._lock:
            pool = self._pool.stats()
            stats = replace(self._stats)
            stats.budget_bytes = self.budget_bytes
            stats.entries = len(self._index)
            stats.bytes = self._bytes
            stats.payload_bytes = self._payload
            stats.free_bytes = pool.free_bytes
            stats.free_files = pool.free_files
            stats.reused_files = pool.reused_files
            stats.fresh_files = pool.fresh_files
            stats.reader_held_drops = pool.reader_held_drops
            stats.reserved_bytes = self._reserved
            blocks = self.blocks.stats()
            for name in L2BlockStats.__slots__:
                setattr(stats, name, getattr(blocks, name))
            stats.used_bytes = stats.bytes + stats.block_bytes
            stats.reserve_bytes = stats.free_bytes + stats.block_free_bytes
            return stats

    def flush_recency(self) -> None:
        """Records each touched entry's last use as its file's mtime (a block's in its slot record), so a
        restart keeps LRU order."""
        with self._lock:
            blocks = self.blocks.take_dirty()
            dirty, self._dirty = self._dirty, set()
            touched = [
                (slot.file.path, slot.last_use) for key in dirty if (slot := self._index.get(key)) is not None
            ]
        self.in_steps(blocks, self.blocks.flush_recency)  # (160k blocks used held the lock 150-180 ms)
        set_mtimes(touched)

    # ----------------------------------------------------------------- internals (lock held)
    def _check_open(self) -> None:
        if self._closed:
            raise SkippydError("the L2 tier is closed")

    def _next_tick(self, count: int = 1) -> int:
        """The first of ``count`` new consecutive recency ticks (ns since the epoch, never repeated)."""
        first = max(self._tick + 1, time.time_ns())
        self._tick = first + count - 1
        return first

    def _touch(self, slot: _Slot) -> None:
        slot.last_use = self._next_tick()
        self._index.touch(slot.entry.key)
        self._dirty.add(slot.entry.key)

    def _insert(self, slot: _Slot) -> None:
        self._index.add(slot)
        self._bytes += slot.file.size
        self._payload += slot.entry.nbytes

    def _detach(self, slot: _Slot) -> None:
        self._index.remove(slot.entry.key)
        self._dirty.discard(slot.entry.key)
        self._bytes -= slot.file.size
        self._payload -= slot.entry.nbytes

    def _ready_plan(self, limit: int, window: float, active_s: float) -> list[Ready]:
        """What the reserve keeps ready (lock held): for each block group and entry size class, its free
        pre-faulted bytes and its target, the bytes puts (and L3 reads) or new entries took of it within
        ``window`` seconds (all of ``limit`` for a block group a restart expected within ``active_s``),
        scaled down together so that the targets add up to ``limit`` at most. Free memory of a class
        nothing took lately has a target of 0."""
        now = time.monotonic()
        plan: list[Ready] = []
        for group in self.blocks.demands(now, window, active_s=active_s):
            if group.recent or group.expected or group.free:
                want = limit if group.expected else group.recent
                plan.append(Ready(group.key, group.unit, want, group.free))
        for size in set(self._entry_demand) | set(self._pool.free_sizes()):
            demand = self._entry_demand.get(size)
            recent = demand.recent(now, window) if demand is not None else 0
            if not recent and demand is not None:
                del self._entry_demand[size]
            # (its stock: the free files that may serve any entry; those served for one identity wait
            # for that identity's entries, or are given back under pressure)
            plan.append(Ready(None, size, recent, self._pool.free_of(size, ANY_OWNER)))
        wanted = sum(item.target for item in plan)
        for item in plan:
            target = item.target if wanted <= limit else item.target * limit // wanted
            item.target = target // item.unit * item.unit
        return plan

    def prefault_step(self, limit: int, *, window: float = 10.0, active_s: float = 60.0) -> int:
        """One step of the reserve: a free block slot or a free entry file, of the kind whose free memory
        is furthest below its target (:meth:`_ready_plan`), faulted in ahead of demand within the budget's
        free room (never by evicting) and while no put or L3 read fills slots; returns the bytes it added
        (0: nothing to do now)."""
        with self._lock:
            if self._closed or self.blocks.busy():
                return 0
            plan = self._ready_plan(limit, window, active_s)
            short = [item for item in plan if item.free + item.unit <= item.target]
            if not short:
                return 0
            item = max(short, key=lambda i: i.target - i.free)
            size = item.unit
            slot: Prefault | None = None
            if item.group is not None:
                slot = self.blocks.prefault_take(item.group)
                if slot is None:
                    return 0
            elif self._room() >= size:
                self._reserved += size  # held while the file is faulted in outside the lock
            else:
                return 0
            self._faults_in_flight += 1
        if slot is not None:  # faulted in without the lock: lookups, gets and puts go on meanwhile
            faulted = False
            try:
                slot.fault()
                faulted = True
            except NoSpace:
                pass
            finally:  # (on any other error too: the slot goes back to being a hole)
                with self._lock:
                    added = self.blocks.prefault_done(slot, faulted=faulted)
                    self._fault_ended()
            return added
        file = None
        try:
            file = self._pool.fresh(size, threads=1)  # (paced, in the background: never the copy threads)
            file.prefault()
        except BaseException:
            if file is not None:
                self._pool.unlink(file)
            with self._lock:
                self._reserved -= size
                self._fault_ended()
            raise
        with self._lock:
            self._reserved -= size
            self._fault_ended()
            if self._closed_meanwhile():  # close gave the free files back while this one was faulted
                self._pool.unlink(file)  # in: it goes too, not left in free/ past a clean stop
                return 0
            self._pool.recycle(file, room=self._room())
            self._stats.prefaulted_files += 1  # (not fresh_files: no capture waited for this one)
            return size

    def _fault_ended(self) -> None:
        """A fault of the reserve ended (its slot or file is free now, or given back): waiting puts look
        again. Under the lock."""
        self._faults_in_flight -= 1
        self._fault_done.notify_all()

    def _closed_meanwhile(self) -> bool:
        """Whether :meth:`close` ran since this thread last looked (read again: mypy would keep the
        earlier check's answer)."""
        return self._closed

    def give_back_step(self, limit: int, *, window: float = 10.0, active_s: float = 60.0) -> int:
        """The reserve's decay: one free block slot or free entry file of the kind whose free memory is
        furthest above its target (:meth:`_ready_plan`) given back to the system; returns the bytes (0:
        nothing is above its target)."""
        with self._lock:
            if self._closed:
                return 0
            over = [item for item in self._ready_plan(limit, window, active_s) if item.free > item.target]
            for item in sorted(over, key=lambda i: i.target - i.free):
                if item.group is None:
                    given = self._pool.drop_free(item.unit, ANY_OWNER)
                else:
                    given = self.blocks.punch_free_slot(item.group)
                if given:
                    self._stats.reserve_given_back += given
                    return given
            return 0

    def _oldest_is_block(self) -> bool:
        """Whether the least recently used thing the tier holds is a block (else an entry, or nothing)."""
        oldest_block = self.blocks.oldest_tick()
        victim = self._index.oldest()
        return oldest_block is not None and (victim is None or oldest_block < victim.last_use)

    def _evict_one(self) -> bool:
        """Frees some memory: a free entry file, else the older of the oldest entry and the oldest block."""
        if self._pool.drop_one():
            return True
        return self.blocks.evict_oldest() if self._oldest_is_block() else self._evict_oldest()

    def _evict_oldest(self) -> bool:
        victim = self._index.oldest()
        if victim is None:
            return False
        self._detach(victim)
        self._stats.evictions += 1
        self._pool.discard(victim.file)
        return True


_FAULT_WAIT_S = 5.0  # the longest a put waits for the reserve's faults in flight before NoSpace
_FILL_WAIT_S = 5.0  # the longest a put waits for other puts' copies to commit (their slots then evictable)
_STEP = 4096  # items of work that grows with the cache done per hold of the lock (in_steps)
_PAUSE_S = 0.0005  # the pause between two such holds
_READ_WAIT_S = 1.0  # the longest it waits for free slots still read under a lease
_PIPELINE_CHUNK = 16 << 20  # a large capture is copied and hashed in chunks of this, overlapped


def copy_and_hash(
    region: memoryview, specs: Sequence[TensorSpec], source: memoryview, *, threads: int = 1
) -> str:
    """Copies each tensor's bytes from ``source`` into ``region`` at its offset and returns the payload
    digest of the COPY (:func:`skippyd.payload.payload_digest` of ``region``): chunk by chunk, hashing
    one chunk of the copy (BLAKE3 on ``threads`` threads) while the next is copied (``threads`` too),
    so a large capture takes about the longer of the two, not their sum. The digest is of what the
    daemon holds: whatever the client writes to ``source`` meanwhile cannot make them differ."""
    hasher = blake3(max_threads=max(1, threads))
    pool = _copy_pool()
    hashing: Future[Any] | None = None
    pieces: list[memoryview] = []
    try:
        for spec in specs:
            end = spec.offset + spec.nbytes
            for start in range(spec.offset, end, _PIPELINE_CHUNK):
                stop = min(end, start + _PIPELINE_CHUNK)
                copy_into(region, start, stop - start, source[start:stop], threads=threads)
                if hashing is not None:
                    hashing.result()
                piece = region[start:stop]
                pieces.append(piece)
                hashing = pool.submit(hasher.update, piece)
        if hashing is not None:
            hashing.result()
    finally:
        if hashing is not None:
            wait([hashing])
        for piece in pieces:
            piece.release()
    return str(hasher.hexdigest())


def copy_into(region: memoryview, offset: int, nbytes: int, source: Any, *, threads: int = 1) -> None:
    """Copies ``nbytes`` from a buffer into ``region[offset:]`` (releases the GIL)."""
    if nbytes == 0:
        return
    src = memoryview(source).cast("B")
    if src.nbytes != nbytes:
        raise InvalidArgument(f"a tensor buffer holds {src.nbytes} bytes, its declaration {nbytes}")
    copy_bytes(region[offset : offset + nbytes], src, threads)


def _zero_gaps(view: memoryview, tensors: Sequence[TensorSpec], base: int, size: int) -> None:
    """Zeroes every byte of a recycled file that the new entry does not write (no stale data leaks)."""
    cursor = base
    for spec in tensors:
        zero(view, cursor, base + spec.offset)
        cursor = max(cursor, base + spec.offset + spec.nbytes)
    zero(view, cursor, size)
