"""The rules for blocks across tiers: what a put stores, what ``contains`` counts, what a get serves.

* **Keys.** Every key a client names (skippyd's own chained keys or an engine's block hashes, 1 to 64
  bytes) is bound to its block space with BLAKE3 (:func:`skippyd.keys.bind_keys`) before any tier sees
  it; tiers store, index and name blocks only by bound key.
* **put**: blocks already held are left as they are (``present``); each new one is copied from the
  connection's staging buffer into a slot only the daemon can write (spread over the copy threads), and
  its record written last. Its BLAKE3 digest is computed there too, or, while the digester's backlog has
  room (:class:`skippyd.l2.digests.Digester`), after the reply, off the request path: what a get serves
  is the daemon's own copy either way, and the digest is only what adoption and L3 check. A block whose
  chain has a hole before it (its parent is held by no tier) is not stored: ``contains`` could never
  reach it.
* **contains**: the leading run of keys held in L2 or L3, from memory.
* **Acknowledged means visible.** A put may be answered once its slots are reserved, before its copy
  (docs/protocol.md, "Staging halves"). A read on any connection that reaches a block such a copy is
  still writing waits for it, at most :data:`SETTLE_SECONDS` (the server parks it, holding no thread:
  :meth:`BlockRules.when_copied`; in-process callers wait on a condition), so whatever a put's reply
  called stored, every later ``contains`` or get sees whole.
* **get**: the leading run held, leased for reading: descriptors of the slabs (one per slab, at most
  the request's ``max_fds`` a reply, :data:`~skippyd.protocol.MAX_FDS` at most) and where each block
  is; the client asks again for the rest of a longer run. Blocks only L3 holds are read and verified
  first (on a worker thread): into L2 slots when the promotion rules say so (the second hit within the
  window, across the scope), into a sealed memfd served once otherwise.
* **durable**: a stored block's record asks for an L3 copy until its pack is fsynced
  (:mod:`skippyd.packer`); ``"sync"`` waits for that fsync. With an :data:`Admission` policy
  (``l3_block_admission = "second-put"``) a ``durable=True`` put keeps its blocks in L2 only and counts
  them; a block offered again within the window (by any put, across the scope) is then marked for its
  L3 copy, sparing the SSD the blocks nobody comes back for. ``"sync"`` always writes.

Nothing here touches sockets or imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from .errors import InvalidArgument, NoSpace, SkippydError, TooLarge
from .fills import PromotionPolicy
from .keys import BlockSpaceId, bind_keys
from .l2 import L2Tier
from .l2.blocks import BlockPlacement, Lease, Pending, allocate_runs, allocation_runs
from .l2.digests import Digester
from .l2.slabs import SlotRecord, block_digest
from .l3 import L3Store
from .l3.packs import PackRecord
from .packer import BlockWriter
from .shm import PAGE, _copy_pool, memfd, seal_readonly

__all__ = ["Admission", "BlockCounters", "BlockRules", "MemoryBudget", "PutJob", "PutOutcome", "Served"]

log = logging.getLogger(__name__)

#: The L3 admission count: one ``(key, block_tokens, bytes)`` per block only L2 holds, a yes or no for each
#: (``Coordinator.admit``: the promotion rules in their own scope, in Redis; ``LocalPromotions``).
Admission = Callable[[Sequence[tuple[str, int, int]]], list[bool]]


class MemoryBudget(Protocol):
    """Memory outside L2 that L3 reads may take: the fill budget (:class:`skippyd.fills.FillTable`)."""

    def charge(self, size: int, /) -> bool: ...

    def refund(self, size: int, /) -> None: ...


_PARALLEL_BYTES = 1 << 20  # puts smaller than this are copied and hashed on the calling thread
_FILL_BYTES = 64 << 20  # what one get reads from L3 at most
#: How long a read waits for a put's copy of a block it reaches (the copy takes milliseconds; past this
#: the block counts as not held, as if the put had not come)
SETTLE_SECONDS = 5.0
_WAIT, _NOW, _AS_IS = 0, 1, 2  # how a read meets a put's copy: waits for it, says so, or counts it absent


@dataclass(frozen=True, slots=True)
class PutOutcome:
    stored: int
    present: int
    skipped: int  # neither held nor sent, or left out because the chain has a hole before them
    nbytes: int
    durability: str = "none"


class PutJob:
    """A put whose slots are reserved (:meth:`BlockRules.begin_put`): :meth:`finish` copies and commits
    it, :meth:`abandon` gives its slots back; exactly one of them, once. :meth:`promised` is what the
    put's reply says when it is answered before the copy: every reserved block counted as stored."""

    def __init__(  # noqa: PLR0917 - one put's state, passed on
        self,
        rules: BlockRules,
        space: BlockSpaceId,
        bound: list[bytes],
        pending: list[tuple[int, Pending]],
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
        durable: bool | str,
        seq: int,
        *,
        present: list[bytes],
        skipped: int,
        hashed: bool,
        epoch: int,
        identity: bytes,
        to_disk: bool,
    ) -> None:
        self.rules, self.space, self.bound, self.pending = rules, space, bound, pending
        self.present_keys = present  # the blocks it found held (L2 or L3) when it reserved
        self.sizes, self.offsets, self.source, self.durable, self.seq = sizes, offsets, source, durable, seq
        self.present, self.skipped, self.hashed, self.epoch = len(present), skipped, hashed, epoch
        self.identity, self.to_disk = identity, to_disk
        self._ended = False
        self._lock = threading.Lock()

    def promised(self) -> PutOutcome:
        nbytes = sum(self.sizes[index] for index, _ in self.pending)
        # "pending": the commit, and what L3 gets of it (queued, deferred, or with second-put admission
        # maybe nothing yet), follow the reply (a kill -9 within the copy's few milliseconds loses the
        # blocks, a clean stop does not; the connection's next request sees them)
        pending = self.to_disk and bool(self.pending)
        return PutOutcome(
            len(self.pending), self.present, self.skipped, nbytes, "pending" if pending else "none"
        )

    def _end(self) -> bool:
        with self._lock:
            ended, self._ended = self._ended, True
        return not ended

    def finish(self) -> PutOutcome:
        """Copies the reserved blocks out of the source, commits them and queues their L3 copy."""
        if not self._end():
            raise RuntimeError("a put job runs once")
        try:
            return self.rules._finish_put(self)
        finally:
            self._release()

    def abandon(self) -> None:
        """Gives the reserved slots back, copying nothing (a no-op once the job ran)."""
        if self._end():
            try:
                self.rules._abandon_put(self)
            finally:
                self._release()

    def _release(self) -> None:
        source, self.source = self.source, memoryview(b"")
        with contextlib.suppress(BufferError):
            source.release()


@dataclass(slots=True)
class Served:
    """What a get hands out: the leased run (its descriptors are the caller's to send and close) and how
    many leading keys are held in all (a longer run than one reply carries)."""

    lease: Lease
    held: int
    needs_worker: bool = False  # the run needs the disk or a put's copy: nothing leased, ask on a worker
    copying: bool = False  # ... a put's copy (park it with BlockRules.when_copied, then ask without waiting)


@dataclass(slots=True)
class BlockCounters:
    block_puts: int = 0
    block_put_offered: int = 0  # blocks named by puts
    block_put_stored: int = 0
    block_put_present: int = 0
    block_bytes_offered: int = 0  # bytes of the blocks puts named (stored or not): the dedup ratio's top
    block_bytes_written: int = 0
    block_contains: int = 0
    block_gets: int = 0
    block_get_blocks: int = 0
    block_get_bytes: int = 0
    block_promotions: int = 0  # blocks an L3 hit brought into L2
    block_admission_waits: int = 0  # blocks a put offered once: kept in L2 only until a second put
    block_admissions: int = 0  # blocks a second put within the window admitted to L3
    block_reads_refused: int = 0  # L3 reads into memfds over the fill budget: a shorter run was served
    block_settle_skips: int = 0  # reads that reached a put's copy with every waiting place taken: a miss


class BlockRules:
    def __init__(
        self,
        l2: L2Tier,
        *,
        l3: L3Store | None = None,
        writer: BlockWriter | None = None,
        promotions: PromotionPolicy | None = None,
        admission: Admission | None = None,
        memory: MemoryBudget | None = None,
        copy_threads: int = 2,
        sync_timeout: float = 20.0,
        digester: Digester | None = None,
        settle_waiters: int = 16,
    ) -> None:
        self.l2 = l2
        self.digester = digester
        self.l3 = l3
        self.memory = memory  # the fill budget, for L3 reads into memory outside L2 (memfds)
        self.writer = writer
        self.promotions = promotions
        self.admission = admission
        self._copy_threads = max(1, copy_threads)
        self._sync_timeout = sync_timeout
        self.counters = BlockCounters()
        self._lock = threading.Lock()
        # bound keys that puts reserved slots for and have not committed yet (how many puts each): a
        # block whose parent is one of them is no hole (its parent's copy is behind its put's reply)
        self._reserved: dict[bytes, int] = {}
        self._copies_done = threading.Condition(l2.lock)  # notified whenever reserved keys commit or go
        # reads waiting for puts' copies at once, at most (each holds a worker thread while it waits: past
        # this a read answers at once, the blocks in copy counted as not held)
        self._settle_waiters = max(0, settle_waiters)
        self._settling = 0
        # parked reads (the server's, holding no thread): whether each still reaches a copy, and its wake-up
        self._parked: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        self._evict_epoch = 0  # explicit evictions so far; puts reserved before one never commit its blocks
        # the epochs puts and promotions in flight began under (how many each): marks no one of them could
        # be cancelled by are pruned (a put reads them at its commit, a promotion at its own)
        self._epochs: collections.Counter[int] = collections.Counter()
        # evictions between their mark and the end of their L3 removal, by identity (None: all): a
        # promotion that began meanwhile (its epoch is the mark's) read blocks the eviction is removing
        self._evicting: collections.Counter[bytes | None] = collections.Counter()
        self._evict_marks: dict[bytes | None, int] = {}  # identity (None: all) -> the epoch of its last

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    @contextlib.contextmanager
    def _filling(self) -> Iterator[None]:
        """Slots of L2 are being filled (a put, or an L3 read landing in L2): the reserve waits."""
        with self.l2.lock:
            self.l2.blocks.fill_begun()
        try:
            yield
        finally:
            with self.l2.lock:
                self.l2.blocks.fill_ended()

    def _on_disk(self, key: bytes) -> bool:
        return self.l3 is not None and self.l3.blocks.holds(key)

    # ----------------------------------------------------------------- contains / get
    def contains(self, space: BlockSpaceId, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held (L2 or L3); a run that stops at a block a put's copy is still
        writing waits for it."""
        count = self._contains(space, keys)
        assert count is not None
        return count

    def contains_now(self, space: BlockSpaceId, keys: Sequence[bytes]) -> int | None:
        """:meth:`contains` without waiting (the event loop): None where it would wait (park the request
        with :meth:`when_copied`, then ask :meth:`contains_as_is`)."""
        return self._contains(space, keys, mode=_NOW)

    def contains_as_is(self, space: BlockSpaceId, keys: Sequence[bytes]) -> int:
        """:meth:`contains` as things are, waiting for nothing (a block still in copy is not held)."""
        count = self._contains(space, keys, mode=_AS_IS)
        assert count is not None
        return count

    def _contains(self, space: BlockSpaceId, keys: Sequence[bytes], *, mode: int = _WAIT) -> int | None:
        bound = bind_keys(space, keys)
        with self.l2.lock:
            held = self._run(bound)
            if mode != _AS_IS and self._copying(bound, held):
                if mode == _NOW:
                    return None
                self._settle(lambda: self._in_copy(bound))
                held = self._run(bound)
        self._count(block_contains=1)
        return held

    def when_copied(
        self, space: BlockSpaceId, keys: Sequence[bytes], wake: Callable[[], None], *, each: bool = False
    ) -> Callable[[], None]:
        """Calls ``wake`` once the leading run of ``keys`` (with ``each``: any of them) no longer reaches
        a block a put's copy is still writing (at once if it does not; else from the thread that
        commits or gives back a block, under the tier's lock: it must only hand off, e.g.
        ``call_soon_threadsafe``). A read parked so holds no thread while it waits. Returns a function
        that forgets the wake-up (the server's own time limit, :data:`SETTLE_SECONDS`)."""
        bound = bind_keys(space, keys)

        def copying() -> bool:
            return self._in_copy(bound, each=each)

        with self.l2.lock:
            if not copying():
                wake()
                return lambda: None
            entry = (copying, wake)
            self._parked.append(entry)

        def forget() -> None:
            with self.l2.lock:
                self._parked = [parked for parked in self._parked if parked is not entry]

        return forget

    def _copying(self, bound: Sequence[bytes], held: int) -> bool:
        """The run of ``held`` keys stops at a block a put reserved and has not committed (under the lock)."""
        return held < len(bound) and bound[held] in self._reserved

    def _in_copy(self, bound: Sequence[bytes], *, each: bool = False) -> bool:
        """The leading run of ``bound`` (with ``each``: any of its keys) reaches a block a put's copy is
        still writing (under the lock)."""
        if each:
            reserved = self._reserved
            return bool(reserved) and any(key in reserved for key in bound)
        return self._copying(bound, self._run(bound))

    def _settle(self, copying: Callable[[], bool]) -> None:
        """Waits, the tier's lock released, while ``copying()`` (at most :data:`SETTLE_SECONDS`, and not
        at all while ``settle_waiters`` reads wait already); under the lock."""
        if self._settling >= self._settle_waiters:
            self._count(block_settle_skips=1)
            return
        self._settling += 1
        try:
            deadline = time.monotonic() + SETTLE_SECONDS
            while copying():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._copies_done.wait(left)
        finally:
            self._settling -= 1

    def _run(self, bound: Sequence[bytes], in_l2: int | None = None) -> int:
        """The leading run of ``bound`` either tier holds (``in_l2``: the leading run L2 holds, if known)."""
        blocks = self.l2.blocks
        held = blocks.held(bound) if in_l2 is None else in_l2
        if self.l3 is None:
            return held
        for key in bound[held:]:
            if not (blocks.holds(key) or self.l3.blocks.holds(key)):
                break
            held += 1
        return held

    def held(self, space: BlockSpaceId, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` are held, each (what a client asks before it copies a put's data); waits for
        puts' copies of any of them."""
        held = self._held(space, keys)
        assert held is not None
        return held

    def held_now(self, space: BlockSpaceId, keys: Sequence[bytes]) -> list[bool] | None:
        """:meth:`held` without waiting (the event loop): None where it would wait (park the request with
        :meth:`when_copied`, then ask :meth:`held_as_is`)."""
        return self._held(space, keys, mode=_NOW)

    def held_as_is(self, space: BlockSpaceId, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`held` as things are, waiting for nothing."""
        held = self._held(space, keys, mode=_AS_IS)
        assert held is not None
        return held

    def _held(self, space: BlockSpaceId, keys: Sequence[bytes], *, mode: int = _WAIT) -> list[bool] | None:
        bound = bind_keys(space, keys)
        with self.l2.lock:
            if mode != _AS_IS and self._in_copy(bound, each=True):
                if mode == _NOW:
                    return None
                self._settle(lambda: self._in_copy(bound, each=True))
            return [self.l2.blocks.holds(key) or self._on_disk(key) for key in bound]

    def get(
        self,
        space: BlockSpaceId,
        keys: Sequence[bytes],
        *,
        max_fds: int,
        may_read: bool = True,
        may_wait: bool = True,
        slot_maps: bool = False,
    ) -> Served:
        """The leading held run, leased. Blocks only L3 holds are read (verified) first: into L2 when the
        promotion rules say so, into a sealed memfd otherwise; a run that stops at a block a put's copy
        is still writing waits for it first. With ``may_read=False`` (the event loop) a run that needs
        the disk or a copy comes back with ``needs_worker`` set and nothing leased. ``slot_maps``: the
        lease carries each slab's slot map (docs/protocol.md "Generations")."""
        bound = bind_keys(space, keys)
        blocks = self.l2.blocks
        with self.l2.lock:
            in_l2 = blocks.held(bound)
            held = self._run(bound, in_l2)
            if may_wait and self._copying(bound, held):
                if not may_read:
                    return Served(Lease(), held, needs_worker=True, copying=True)
                self._settle(lambda: self._in_copy(bound))
                in_l2 = blocks.held(bound)
                held = self._run(bound, in_l2)
            run = bound[:held]
            from_disk = [key for key in run[in_l2:] if not blocks.holds(key)]
            if not from_disk:
                lease = blocks.lease(run, max_fds=max_fds, maps=slot_maps)
                return self._served(lease, held, len(bound))
        if not may_read:
            return Served(Lease(), held, needs_worker=True)
        return self._get_with_disk(space, run, from_disk, held, len(bound), max_fds, slot_maps)

    def _served(self, lease: Lease, held: int, asked: int) -> Served:
        if held < asked:
            self.l2.blocks.count_miss()
        served = lease.placements
        self._count(block_gets=1, block_get_blocks=len(served), block_get_bytes=sum(p[2] for p in served))
        return Served(lease, held)

    def _get_with_disk(  # noqa: PLR0917 - one get's state, passed on
        self,
        space: BlockSpaceId,
        run: list[bytes],
        from_disk: list[bytes],
        held: int,
        asked: int,
        max_fds: int,
        slot_maps: bool,
    ) -> Served:
        assert self.l3 is not None
        records: list[PackRecord] = []
        total = 0
        for key in from_disk:  # one reply reads at most _FILL_BYTES from the disk; the client asks again
            record = self.l3.blocks.record(key)
            if record is None or (records and total + record.nbytes > _FILL_BYTES):
                break
            records.append(record)
            total += record.nbytes
        with self.l3.lock:
            self.l3.blocks.touch([r.key for r in records])
        promote = bool(records) and self._promote(space, records, total)
        read: set[bytes] = set()
        # blocks read for this reply alone: descriptors, and each key's descriptor (of those) and offset
        extra_fds: list[int] = []
        extra: dict[bytes, tuple[int, int]] = {}
        try:
            if promote:
                with self._filling():
                    read = self._promote_into_l2(records)
            elif records:
                with self._filling():
                    extra_fds, extra = self._read_for_once(records)
                read = set(extra)
            with self.l3.lock:
                self.l3.blocks.count(hits=len(read), misses=0)
            with self.l2.lock:
                usable: list[bytes] = []
                for key in run:  # the run as far as it is now readable, in order
                    if not (key in extra or self.l2.blocks.holds(key) or key in read):
                        break
                    usable.append(key)
                in_l2 = [key for key in usable if key not in extra]
                lease = self.l2.blocks.lease(in_l2, max_fds=max(1, max_fds - len(extra_fds)), maps=slot_maps)
            placements = iter(zip(lease.placements, lease.slot_generations, strict=True))
            merged: list[BlockPlacement] = []
            slot_generations: list[int] = []
            base = len(lease.fds)
            by_key = {r.key: r for r in records}
            for key in usable:
                if key in extra:
                    fd_index, offset = extra[key]
                    record = by_key[key]
                    merged.append([base + fd_index, offset, record.nbytes])
                    slot_generations.append(0)
                    continue
                found = next(placements, None)
                if found is None:  # out of descriptors: the client asks again for the rest
                    break
                merged.append(found[0])
                slot_generations.append(found[1])
            lease.placements = merged
            lease.slot_generations = slot_generations
            lease.fds += extra_fds
            lease.generations += [0] * len(extra_fds)  # read for this reply alone: not worth registering
            if lease.slot_maps is not None:
                lease.slot_maps += [None] * len(extra_fds)
            extra_fds = []
            return self._served(lease, held, asked)
        finally:
            for fd in extra_fds:
                os.close(fd)

    def _read_for_once(self, records: list[PackRecord]) -> tuple[list[int], dict[bytes, tuple[int, int]]]:
        """Reads a run that has not earned a place in L2 for one reply: into free pre-faulted L2 slots
        when there are enough (leased to the reply, then freed: nobody reuses them while it reads), else
        into a sealed memfd."""
        assert self.l3 is not None
        blocks = self.l2.blocks
        borrowed: list[Pending] = []
        with self.l2.lock:
            for record in records:
                slot = blocks.reserve_free(_slot_record(record))
                if slot is None:
                    break
                borrowed.append(slot)
            if len(borrowed) < len(records) or len({id(p.home) for p in borrowed}) > 4:
                for slot in borrowed:
                    blocks.abort(slot)
                borrowed = []
        if not borrowed:
            size = sum(_pages(r.nbytes) for r in records)
            if self.memory is not None and not self.memory.charge(size):
                self._count(block_reads_refused=1)  # over the fill budget: the run ends before these
                return [], {}
            try:
                fd, offsets = self._read_into_memfd(records)
            finally:
                if self.memory is not None:
                    self.memory.refund(size)  # the memfd is the reply's now
            return [fd], {key: (0, offset) for key, offset in offsets.items()}
        done = 0
        try:
            done = self.l3.blocks.read_into([r.key for r in records], [p.view for p in borrowed])
            with self.l2.lock:
                fds, where = blocks.lease_pending(borrowed[:done])
        finally:
            with self.l2.lock:
                for slot in borrowed:
                    blocks.abort(slot)  # free again; the reply's read locks keep them from reuse
        return fds, {records[i].key: where[i] for i in range(done)}

    def _promote(self, space: BlockSpaceId, records: list[PackRecord], total: int) -> bool:
        if self.promotions is None:
            return True
        try:
            return self.promotions.consider(records[-1].key.hex(), len(records) * space.block_tokens, total)
        except Exception:  # a policy that fails promotes nothing; the run is still served
            return False

    def _promote_into_l2(self, records: list[PackRecord]) -> set[bytes]:
        """Reads the run into new L2 slots, verified; returns the keys that made it."""
        assert self.l3 is not None
        blocks = self.l2.blocks
        pending: list[Pending] = []
        mine = 0  # bytes of the slots reserved so far (what this fill must not wait for)
        with self.l2.lock:
            # an explicit eviction of these blocks from here on keeps them out: its reply may say they are
            # gone before this read ends (the marks are kept while a promotion may still look at them)
            epoch = self._hold_epoch()
            try:
                for record in records:
                    if blocks.holds(record.key):
                        continue
                    try:
                        pending.append(blocks.reserve(_slot_record(record), mine=mine, allocate=False))
                    except (NoSpace, TooLarge):
                        break
                    mine += pending[-1].home.slab.slot_size
            except BaseException:  # (say EMFILE making a slab): the slots and the epoch go back
                for slot in pending:
                    blocks.abort(slot)
                self._drop_epoch(epoch)
                raise
        done = 0
        try:
            try:
                kept, _ = self._allocate(pending)  # (the pages after the lock, as a put's)
            except BaseException:
                pending.clear()  # (every slot given back already)
                raise
            del pending[kept:]
            done = self.l3.blocks.read_into([p.record.key for p in pending], [p.view for p in pending])
        finally:
            with self.l2.lock:
                if done and self._cancelled(records[0].identity, epoch):
                    done = 0  # evicted while it was read (or as it began): nothing of it comes back
                self._drop_epoch(epoch)
                for index, slot in enumerate(pending):
                    if index < done:
                        blocks.commit(slot, slot.record.digest, durable=False)
                    else:
                        blocks.abort(slot)
                held = {r.key for r in records if blocks.holds(r.key)}
        if done and self.promotions is not None:
            with contextlib.suppress(Exception):
                self.promotions.settle(records[-1].key.hex())
        self._count(block_promotions=done)
        return held

    def _read_into_memfd(self, records: list[PackRecord]) -> tuple[int, dict[bytes, int]]:
        """Reads the run into a sealed memfd (served once, not kept); returns it and each key's offset."""
        assert self.l3 is not None
        offsets, cursor = [], 0
        for record in records:
            offsets.append(cursor)
            cursor += _pages(record.nbytes)
        fd = memfd("skippyd-blocks", cursor, seal=False)
        try:
            mapping = mmap.mmap(fd, cursor, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            view = memoryview(mapping)
            views = [view[o : o + r.nbytes] for o, r in zip(offsets, records, strict=True)]
            try:
                done = self.l3.blocks.read_into([r.key for r in records], views)
            finally:
                for v in views:
                    v.release()
                view.release()
                mapping.close()
            seal_readonly(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd, {r.key: o for r, o in zip(records[:done], offsets, strict=False)}

    # ----------------------------------------------------------------- put
    def put(
        self,
        space: BlockSpaceId,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
        *,
        parent: bytes | None = None,
        durable: bool | str = True,
    ) -> PutOutcome:
        """Stores the blocks of ``keys`` that are not held, each from ``source[offsets[i]:][:sizes[i]]``
        (an offset of -1: not sent, because the client found it held); returns once they are committed."""
        return self.begin_put(space, keys, sizes, offsets, source, parent=parent, durable=durable).finish()

    def begin_put(
        self,
        space: BlockSpaceId,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
        *,
        parent: bytes | None = None,
        durable: bool | str = True,
    ) -> PutJob:
        """The first half of a put: validates it and reserves (allocated, charged) a slot for every block
        it will store, so every error a put can meet (``too_large``, ``no_space``, bad offsets) is raised
        here, before anything is copied. The returned job copies the blocks out of ``source`` and commits
        them (:meth:`PutJob.finish`, on any thread, once) or gives the slots back
        (:meth:`PutJob.abandon`); ``source`` must stay as it is until then (the caller's promise: the
        connection's staging half is not written again before the job ends)."""
        if durable not in (True, False, "sync"):
            raise InvalidArgument('durable must be true, false or "sync"')
        if not len(keys) == len(sizes) == len(offsets):
            raise InvalidArgument("keys, sizes and offsets must be lists of the same length")
        for index, (size, offset) in enumerate(zip(sizes, offsets, strict=True)):
            if offset >= 0 and offset + size > len(source):
                raise InvalidArgument(f"block {index} lies outside the staging buffer")
        bound = bind_keys(space, keys)
        parent_key = bind_keys(space, [parent])[0] if parent is not None else None
        seq = self.writer.begin() if self.writer is not None else 0
        job: PutJob | None = None
        try:
            with self.l2.lock:
                self.l2.blocks.fill_begun()
            try:
                job = self._reserve_put(space, bound, parent_key, sizes, offsets, source, durable, seq)
            finally:
                if job is None:
                    with self.l2.lock:
                        self.l2.blocks.fill_ended()
        finally:
            if job is None and self.writer is not None:
                self.writer.end(seq)
        return job

    def _reserve_put(  # noqa: PLR0917 - one put's state, passed on
        self,
        space: BlockSpaceId,
        bound: list[bytes],
        parent_key: bytes | None,
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
        durable: bool | str,
        seq: int,
    ) -> PutJob:
        space_digest = bytes.fromhex(space.digest)
        identity = bytes.fromhex(space.identity.digest)
        to_disk = bool(durable) and self.writer is not None
        pending: list[tuple[int, Pending]] = []
        present: list[bytes] = []
        skipped = mine = 0
        failure: SkippydError | None = None
        blocks = self.l2.blocks
        reserved = self._reserved
        with self.l2.lock:
            blocks.touch(bound)  # the held ones become the newest before anything is evicted for the rest
            taken: set[bytes] = set()
            for index, key in enumerate(bound):
                if blocks.holds(key) or key in taken or self._on_disk(key):
                    present.append(key)
                    continue
                if offsets[index] < 0 or failure is not None:
                    skipped += 1
                    continue
                previous = bound[index - 1] if index else parent_key
                if previous is not None and not (
                    previous in taken
                    or previous in reserved
                    or blocks.holds(previous)
                    or self._on_disk(previous)
                ):
                    skipped += 1  # a hole before it: contains could never reach it
                    continue
                record = SlotRecord(
                    key=key, space=space_digest, identity=identity, block_tokens=space.block_tokens,
                    parent=previous, nbytes=sizes[index], digest=bytes(32),
                )  # fmt: skip
                try:
                    pending.append((index, blocks.reserve(record, mine=mine, allocate=False)))
                    mine += pending[-1][1].home.slab.slot_size
                except (NoSpace, TooLarge) as exc:
                    failure = exc
                    skipped += 1
                    continue
                except BaseException:
                    for _, slot in pending:
                        blocks.abort(slot)
                    raise
                taken.add(key)
            if failure is not None and not pending and not present:
                raise failure
            new_bytes = sum(sizes[index] for index, _ in pending)
            defer = self.digester is not None and self.digester.may_defer(new_bytes)
            epoch = self._hold_epoch()  # (dropped when the put commits or gives its slots back)
        # The keys count as reserved (a block of another put whose parent is one of them is no hole; reads
        # reaching them wait for the commit) only once their slots have pages: until then a full tmpfs
        # may still leave them out, and another put must not be promised a child of a block never stored.
        try:
            kept, full = self._allocate([slot for _, slot in pending])
            skipped += len(pending) - kept
            del pending[kept:]
            if full is not None and not pending and not present:
                raise full
        except BaseException:
            with self.l2.lock:
                self._drop_epoch(epoch)
            raise
        with self.l2.lock:
            for _, slot in pending:
                key = slot.record.key
                reserved[key] = reserved.get(key, 0) + 1
        return PutJob(
            self, space, bound, pending, sizes, offsets, source, durable, seq,
            present=present, skipped=skipped, hashed=not defer, epoch=epoch, identity=identity,
            to_disk=to_disk,
        )  # fmt: skip

    def _finish_put(self, job: PutJob) -> PutOutcome:
        """The second half of a put: copy, commit (the slot records), queue for L3."""
        blocks = self.l2.blocks
        pending, sizes = job.pending, job.sizes
        durable, identity, seq = job.durable, job.identity, job.seq
        to_disk = job.to_disk
        held_back = to_disk and durable is True and self.admission is not None  # L3 on a second put only
        try:
            try:
                digests = self._fill(pending, sizes, job.offsets, job.source, hashed=job.hashed)
            except BaseException:
                with self.l2.lock:
                    self._unreserve(pending, job.epoch)
                    for _, slot in pending:
                        blocks.abort(slot)
                    self._wake_parked()
                raise
            stored = nbytes = 0
            present, skipped = job.present, job.skipped
            committed: list[bytes] = []
            with self.l2.lock:
                cancelled = self._cancelled(identity, job.epoch)
                self._unreserve(pending, job.epoch)
                done = 0
                try:
                    for (index, slot), digest in zip(pending, digests, strict=True):
                        done += 1
                        parent_of = slot.record.parent
                        if cancelled or (
                            parent_of is not None
                            and not (
                                blocks.holds(parent_of)
                                or parent_of in self._reserved
                                or self._on_disk(parent_of)
                            )
                        ):
                            blocks.abort(slot)  # evicted meanwhile, or a hole before it
                            skipped += 1
                            continue
                        if blocks.commit(slot, digest, durable=to_disk and not held_back):
                            stored += 1
                            nbytes += sizes[index]
                            committed.append(slot.record.key)
                        else:
                            present += 1
                except BaseException:
                    for _, slot in pending[done - 1 :]:  # never left half written: the rest go back
                        try:
                            blocks.abort(slot)  # (a no-op for one committed already)
                        except Exception:
                            log.exception("giving back a slot after a failed commit")
                    raise
                finally:
                    blocks.room_changed()  # committed blocks are evictable: puts waiting look again
                    self._wake_parked()  # and reads parked on these copies go on
                blocks.touch(job.bound)
                gone = 0
                if to_disk and not held_back and self.writer is not None:
                    extra, gone = self._present_for_disk(job.present_keys, committed)
                    committed += extra
            durability = "none"
            if held_back:
                admitted, nbytes_to_disk = self._admit(job.space, job.bound)
                if admitted:
                    assert self.writer is not None
                    durability = self.writer.submit(
                        admitted, identity, seq, nbytes_to_disk, sync=False, timeout=self._sync_timeout
                    )
            elif to_disk and self.writer is not None:
                if committed:
                    durability = self.writer.submit(
                        committed, identity, seq, nbytes, sync=durable == "sync", timeout=self._sync_timeout
                    )
                elif stored or present:
                    durability = "written"  # every block it names was on disk already
                if gone and durability == "written":
                    durability = "none"  # a block it counted as held left both tiers before it ended
            self._count(
                block_puts=1, block_put_offered=len(job.bound), block_put_stored=stored,
                block_put_present=present, block_bytes_offered=sum(sizes), block_bytes_written=nbytes,
            )  # fmt: skip
            return PutOutcome(stored, present, skipped, nbytes, durability)
        finally:
            self._end_put(job)

    def _abandon_put(self, job: PutJob) -> None:
        """Gives back every slot a put reserved, nothing copied (its connection's copy was never run)."""
        try:
            with self.l2.lock:
                self._unreserve(job.pending, job.epoch)
                for _, slot in job.pending:
                    self.l2.blocks.abort(slot)
                self._wake_parked()
        finally:
            self._end_put(job)

    def _end_put(self, job: PutJob) -> None:
        try:
            with self.l2.lock:
                self.l2.blocks.fill_ended()
        finally:
            if self.writer is not None:
                self.writer.end(job.seq)

    def _unreserve(self, pending: list[tuple[int, Pending]], epoch: int) -> None:
        """The put's keys are no longer reserved (committed or given back), nor its epoch in flight: reads
        waiting in-process look again once the lock is let go (parked ones: :meth:`_wake_parked`). Under
        the lock."""
        reserved = self._reserved
        self._copies_done.notify_all()
        for _, slot in pending:
            key = slot.record.key
            left = reserved.get(key, 0) - 1
            if left > 0:
                reserved[key] = left
            else:
                reserved.pop(key, None)
        self._drop_epoch(epoch)

    def _wake_parked(self) -> None:
        """Wakes the parked reads whose run no longer reaches a block in copy (under the lock, after
        commits or give-backs)."""
        if self._parked:
            still: list[tuple[Callable[[], bool], Callable[[], None]]] = []
            for copying, wake in self._parked:
                if copying():
                    still.append((copying, wake))
                else:
                    wake()
            self._parked = still

    def _hold_epoch(self) -> int:
        """The epoch a put or a promotion begins under, held in flight until :meth:`_drop_epoch` (under
        the lock): the eviction marks it may be cancelled by are kept until then."""
        epoch = self._evict_epoch
        self._epochs[epoch] += 1
        return epoch

    def _drop_epoch(self, epoch: int) -> None:
        """One put or promotion of ``epoch`` is no longer in flight: the marks no one still in flight could
        be cancelled by go (a mark cancels what began before it; what begins now begins after them all)."""
        self._epochs[epoch] -= 1
        if self._epochs[epoch] <= 0:
            del self._epochs[epoch]
        self._prune_marks()

    def _prune_marks(self) -> None:
        """Drops the eviction marks no put or promotion in flight could be cancelled by (under the lock)."""
        if not self._epochs:
            self._evict_marks.clear()
            return
        floor = min(self._epochs)
        for identity in [i for i, mark in self._evict_marks.items() if mark <= floor]:
            del self._evict_marks[identity]

    def _cancelled(self, identity: bytes, epoch: int) -> bool:
        """Whether a put or promotion of ``identity`` begun under ``epoch`` must not commit: an eviction of
        its blocks (or of all) came after it began, or is still removing them (its L2 removal looked at
        what L2 held when it began, its L3 removal is still to come). An eviction that ended since it
        began marked once more as it ended, so the first case covers it. Under the lock."""
        return self._evicted_since(identity, epoch) or bool(self._evicting[identity] or self._evicting[None])

    def _evicted_since(self, identity: bytes, epoch: int) -> bool:
        """An explicit eviction of ``identity``'s blocks (or of everything) came after ``epoch``."""
        marks = self._evict_marks
        return marks.get(None, 0) > epoch or marks.get(identity, 0) > epoch

    @contextlib.contextmanager
    def _evicting_now(self, identity: bytes | None) -> Iterator[None]:
        """An explicit eviction of ``identity``'s blocks (None: all): marked as it begins (puts and
        promotions begun before it do not commit), in progress until its L3 removal ended (what commits
        meanwhile would land beside its removals: it does not), and marked again as it ends (what began
        while it ran does not commit later either: a promotion read blocks it was removing, a sync put
        would stay in L2 without its L3 copy)."""
        with self.l2.lock:
            self._evict_epoch += 1
            self._evict_marks[identity] = self._evict_epoch
            self._evicting[identity] += 1
        try:
            yield
        finally:
            with self.l2.lock:
                self._evicting[identity] -= 1
                if self._evicting[identity] <= 0:
                    del self._evicting[identity]
                self._evict_epoch += 1
                self._evict_marks[identity] = self._evict_epoch
                self._prune_marks()

    def _present_for_disk(
        self, present: Sequence[bytes], committed: Sequence[bytes]
    ) -> tuple[list[bytes], int]:
        """The blocks a put to disk found held (``present``) that L2 holds but L3 does not yet (an earlier
        put without ``durable``, or one whose write is still queued): they go to L3 with this put's own,
        so a ``"sync"`` reply says ``"written"`` only once every block it names is on disk; their records
        ask for the copy from now on (a restart re-queues it). And how many of them neither tier holds
        any more (evicted while this put copied). Under the tier's lock."""
        blocks = self.l2.blocks
        mine = set(committed)
        extra: list[bytes] = []
        gone = 0
        for key in dict.fromkeys(present):
            if key in mine or self._on_disk(key):
                continue
            if not blocks.holds(key):
                gone += 1
                continue
            blocks.want_written(key)  # (False when it asks already: still waited for, below)
            extra.append(key)
        return extra, gone

    def _admit(self, space: BlockSpaceId, bound: Sequence[bytes]) -> tuple[list[bytes], int]:
        """Counts every block of a put that only L2 holds toward L3 admission (one call for the put, in
        Redis across the scope or in this process) and marks the ones offered a second time within the
        window for an L3 copy: the keys to write and their bytes. A policy that fails admits nothing;
        the blocks stay in L2 and the next put counts them again."""
        assert self.admission is not None
        blocks = self.l2.blocks
        with self.l2.lock:
            waiting = []
            for key in bound:
                record = blocks.record(key)
                if record is not None and not record.durable and not self._on_disk(key):
                    waiting.append((key, record.nbytes))
        if not waiting:
            return [], 0
        try:
            answers = self.admission([(key.hex(), space.block_tokens, size) for key, size in waiting])
        except Exception:  # the put is done; only its L3 copy waits for a later put
            log.warning("block admission could not be counted; the put's blocks stay in L2", exc_info=True)
            answers = [False] * len(waiting)
        admitted: list[bytes] = []
        nbytes = 0
        with self.l2.lock:
            for (key, size), yes in zip(waiting, answers, strict=True):
                if yes and blocks.want_written(key):
                    admitted.append(key)
                    nbytes += size
        self._count(block_admission_waits=len(waiting) - len(admitted), block_admissions=len(admitted))
        return admitted, nbytes

    def _allocate(self, pending: list[Pending]) -> tuple[int, NoSpace | None]:
        """Gives the fresh slots of a put (or a promotion) their pages, outside the tier's lock, several
        slabs at once on the copy threads. Returns how many leading slots have them (all, or those before
        the first that got none: the fill keeps the blocks before it) and why not the rest; those are
        given back. Any other failure gives every slot back and raises."""
        slabs = allocation_runs(pending)
        full: list[NoSpace] = []

        def allocate(runs: list[list[Pending]]) -> None:
            try:
                allocate_runs(runs)
            except NoSpace as exc:
                full.append(exc)

        try:
            if self._copy_threads <= 1 or len(slabs) < 2:
                for runs in slabs:
                    allocate(runs)
                    if full:
                        break
            else:
                futures: list[Future[None]] = []
                try:
                    for runs in slabs[1:]:
                        futures.append(_copy_pool().submit(allocate, runs))
                    allocate(slabs[0])
                finally:
                    wait(futures)  # (no slot is given back while a thread may still allocate it)
                for future in futures:
                    future.result()
            if not full:
                return len(pending), None
            at = next(i for i, slot in enumerate(pending) if slot.unallocated)
            later = [slot for slot in pending[at + 1 :] if not slot.unallocated]
            if later:  # slabs after it took pages the ones before them lacked: in put order again
                with self.l2.lock:
                    for slot in later:
                        self.l2.blocks.unallocate(slot)
                full.clear()
                allocate([[slot] for slot in pending[at:]])
        except BaseException:
            with self.l2.lock:  # (none of its keys is reserved yet)
                for slot in pending:
                    self.l2.blocks.abort(slot)
                self.l2.blocks.room_changed()
            raise
        kept = next((i for i, slot in enumerate(pending) if slot.unallocated), len(pending))
        if kept < len(pending):
            with self.l2.lock:
                for slot in pending[kept:]:
                    self.l2.blocks.abort(slot)
                self.l2.blocks.room_changed()  # (puts waiting for room: the slots given back are room)
        return kept, full[0] if full else None

    def _fill(
        self,
        pending: list[tuple[int, Pending]],
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
        *,
        hashed: bool = True,
    ) -> list[bytes | None]:
        """Copies every pending block out of the staging buffer into its slot and, when ``hashed``, hashes
        it there (None for each block otherwise: the digester hashes it later)."""
        jobs = [(slot.view, source[offsets[i] : offsets[i] + sizes[i]]) for i, slot in pending]
        run = partial(_copy_blocks, hashed=hashed)
        try:
            total = sum(sizes[i] for i, _ in pending)
            if self._copy_threads <= 1 or total < _PARALLEL_BYTES or len(jobs) < 2:
                return run(jobs)
            step = -(-len(jobs) // self._copy_threads)
            pool = _copy_pool()
            futures: list[Future[list[bytes | None]]] = []
            try:  # (no slot is given back while a thread may still copy into it)
                for i in range(step, len(jobs), step):
                    futures.append(pool.submit(run, jobs[i : i + step]))
                first = run(jobs[:step])
            finally:
                wait(futures)
            return first + [digest for future in futures for digest in future.result()]
        finally:
            for _, src in jobs:
                src.release()

    # ----------------------------------------------------------------- admin
    def evict_identity(self, identity_digest: str) -> int:
        """Every block of an identity, from both tiers (queued durable writes of it are dropped)."""
        identity = bytes.fromhex(identity_digest)
        with self._evicting_now(identity):
            if self.writer is not None:
                self.writer.forget(identity)
            removed = self._remove_from_l2(identity)
            if self.l3 is not None:
                with self.l3.lock:
                    removed = max(removed, self.l3.blocks.remove_identity(identity))
        return removed

    def _remove_from_l2(self, identity: bytes | None) -> int:
        """Removes the blocks L2 holds now (of ``identity``; all with None) in steps, the lock let go
        between them (:meth:`L2Tier.in_steps`): 160k blocks evicted at once held it 1.5 s,
        and every request waited. (Puts and promotions that overlap the eviction never commit:
        :meth:`_cancelled`.)"""
        with self.l2.lock:
            keys = self.l2.blocks.keys_of(identity)
        return self.l2.in_steps(keys, self.l2.blocks.remove)

    def clear(self) -> int:
        with self._evicting_now(None):
            if self.writer is not None:
                self.writer.forget(None)
            removed = self._remove_from_l2(None)
            self.l2.release_free_slots()
            if self.l3 is not None:
                with self.l3.lock:
                    removed = max(removed, self.l3.blocks.clear())
        return removed

    def summary(self) -> list[dict[str, Any]]:
        """Blocks per identity in each tier (what ``ls`` shows), most blocks first."""
        rows: dict[bytes, dict[str, Any]] = {}

        def row(identity: bytes) -> dict[str, Any]:
            return rows.setdefault(
                identity,
                {"identity": identity.hex(), "l2_blocks": 0, "l2_bytes": 0, "l3_blocks": 0, "l3_bytes": 0},
            )

        with self.l2.lock:
            for space in self.l2.blocks.spaces():
                item = row(space.identity)
                item["l2_blocks"] += space.count
                item["l2_bytes"] += space.nbytes
        if self.l3 is not None:
            with self.l3.lock:
                for identity, (count, nbytes) in self.l3.blocks.identities().items():
                    item = row(identity)
                    item["l3_blocks"] += count
                    item["l3_bytes"] += nbytes
        return sorted(rows.values(), key=lambda r: -(r["l2_blocks"] + r["l3_blocks"]))

    def stats(self) -> BlockCounters:
        with self._lock:
            return BlockCounters(**{name: getattr(self.counters, name) for name in BlockCounters.__slots__})


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one): a block's place in a memfd read."""
    return -(-max(nbytes, 1) // PAGE) * PAGE


def _slot_record(record: PackRecord) -> SlotRecord:
    return SlotRecord(
        key=record.key, space=record.space, identity=record.identity, block_tokens=record.block_tokens,
        parent=record.parent, nbytes=record.nbytes, digest=record.digest,
    )  # fmt: skip


def _copy_blocks(jobs: list[tuple[memoryview, memoryview]], *, hashed: bool) -> list[bytes | None]:
    """Copies each source into its slot; the copy's digest for each when ``hashed``, else None."""
    digests: list[bytes | None] = []
    for target, source in jobs:
        if len(source):
            np.copyto(np.frombuffer(target, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8))
        digests.append(block_digest(target) if hashed else None)
    return digests
