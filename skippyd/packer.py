"""The durable writer of blocks: L2 slots → L3 packs, in the background, one pack per batch.

* **Intent survives a crash.** A durable block's slot record carries a flag from its commit until its
  pack is fsynced; a new daemon re-queues every flagged block L3 lacks (:meth:`BlockWriter.recover`).
* **Group commit.** The thread takes every job queued (up to ``batch_bytes``) and writes them as one
  pack: one fsync per batch. While it reads a slot it holds a lease on it, like any reader. A batch
  larger than that (a big put, the backlog, what a restart recovered) goes as several packs of at most
  ``batch_bytes`` (and :data:`_PART_BLOCKS` blocks), the L2 lock taken once per pack, never one pack
  L3's budget could refuse for good.
* **Evictions win.** Each job runs under an :class:`~skippyd.evictions.EvictionClock` number taken when
  its put began; a pack's block whose identity (or everything) was evicted since is dead on arrival, so
  nothing evicted comes back from L3.
* A batch that L3 cannot take (disk floor, budget) is kept and tried again later (``deferred``); its
  blocks keep their flag. A sync put waits for its own batch's fsync, within its timeout.
* A block committed before its digest was computed (:mod:`skippyd.l2.digests`) is hashed here, through
  the lease, before it goes into a pack; its L2 record gets the digest too.
* When nothing is queued, the thread compacts a pack that is at least half dead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, replace

from .errors import NoSpace, SkippydError, TooLarge
from .evictions import EvictionClock
from .l2 import L2Tier
from .l2.slabs import Slab, SlotRecord, block_digest
from .l3 import L3Store
from .l3.packs import BlockItem, PackRecord
from .workers import Health

__all__ = ["BlockWriter", "BlockWriterStats"]

log = logging.getLogger("skippyd.packer")

THREAD = "skippyd-l3-blocks"
_RETRY_S = 5.0
_PART_BLOCKS = 4096  # blocks of one pack at most (each a lease and a view taken under the L2 lock)


@dataclass(slots=True)
class BlockWriterStats:
    block_jobs_queued: int = 0
    block_queue_depth: int = 0
    block_backlog: int = 0  # blocks waiting for L3 to have room
    block_writes_deferred: int = 0
    block_write_failures: int = 0
    block_recovered: int = 0
    block_writes_lost: int = 0  # blocks a write found in neither tier (evicted from L2 before it ran)


@dataclass(slots=True)
class _Job:
    keys: list[bytes]
    identity: bytes
    seq: int  # its number on the writer's eviction clock (ended once the job is done or dropped)
    nbytes: int
    done: threading.Event | None = None
    outcome: str = "deferred"  # what a sync put's waiter hears once done: "written", "none" or "deferred"
    attempts: int = 0
    ready_at: float = 0.0


def _mark(identity: bytes) -> str:
    return "blocks:" + identity.hex()


class BlockWriter:
    def __init__(
        self, l2: L2Tier, l3: L3Store, health: Health, *, batch_bytes: int = 64 << 20, queue_size: int = 4096
    ) -> None:
        self.l2, self.l3, self.health = l2, l3, health
        # (an eighth of L3's budget at most: a pack L3 can always make room for)
        self._batch_bytes = max(1 << 20, min(batch_bytes, l3.budget_bytes // 8))
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._backlog: list[_Job] = []
        self._lock = threading.Lock()
        self._clock = EvictionClock()
        self._stats = BlockWriterStats()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ the request side
    def begin(self) -> int:
        """The eviction-clock number of a put that may queue blocks (pair it with :meth:`end`)."""
        return self._clock.begin()

    def end(self, seq: int) -> None:
        self._clock.end(seq)

    def submit(
        self, keys: list[bytes], identity: bytes, seq: int, nbytes: int, *, sync: bool, timeout: float
    ) -> str:
        """Queues these blocks (of a put begun at ``seq``) for L3: ``"queued"``, ``"written"`` (sync: every
        one of them is in an fsynced pack), ``"none"`` (sync: some left L2 before the write could read
        them, or were evicted, and L3 does not hold them), or ``"deferred"`` (the queue is full, or a sync
        wait ran out: written later unless evicted)."""
        if not keys:
            return "written" if sync else "queued"
        job = _Job(keys, identity, self._clock.begin(since=seq), nbytes, threading.Event() if sync else None)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._stats.block_writes_deferred += 1
                self._backlog.append(job)
            return "deferred"
        with self._lock:
            self._stats.block_jobs_queued += 1
        if job.done is None:
            return "queued"
        return job.outcome if job.done.wait(timeout) else "deferred"

    def forget(self, identity: bytes | None) -> None:
        """An explicit eviction: the blocks of ``identity`` (None: all) of puts begun before now are never
        written."""
        if identity is None:
            self._clock.evict(None)
        else:
            self._clock.evict(_mark(identity))

    def _wanted(self, job: _Job) -> bool:
        return not self._clock.cancelled(_mark(job.identity), job.seq)

    # ------------------------------------------------------------------ lifecycle
    def recover(self) -> int:
        """Queues every block whose record still asks for an L3 copy (a crash came before its pack)."""
        with self.l2.lock:
            wanted = self.l2.blocks.durable_wanted()
        by_identity: dict[bytes, list[SlotRecord]] = {}
        written = []
        for record in wanted:
            if self.l3.blocks.holds(record.key):
                written.append(record.key)
            else:
                by_identity.setdefault(record.identity, []).append(record)
        with self.l2.lock:
            for key in written:
                self.l2.blocks.mark_written(key)
        count = 0
        for identity, records in by_identity.items():
            for start in range(0, len(records), _PART_BLOCKS):  # (jobs of a pack's size each)
                part = records[start : start + _PART_BLOCKS]
                job = _Job([r.key for r in part], identity, self._clock.begin(), sum(r.nbytes for r in part))
                with self._lock:
                    self._backlog.append(job)
                count += len(job.keys)
        with self._lock:
            self._stats.block_recovered += count
        return count

    def start(self) -> None:
        self._thread = self.health.start(THREAD, self._run)

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued (within ``timeout``), then stops; what is left keeps its flags."""
        self._stopping = True
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=min(timeout, 1.0))
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> BlockWriterStats:
        with self._lock:
            stats = BlockWriterStats(**{n: getattr(self._stats, n) for n in BlockWriterStats.__slots__})
            stats.block_backlog = sum(len(job.keys) for job in self._backlog)
        stats.block_queue_depth = self._queue.qsize()
        return stats

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=1.0)
                stop = first is None
            except queue.Empty:
                first, stop = None, False
            jobs = [first] if first is not None else []
            total = jobs[0].nbytes if jobs else 0
            while total < self._batch_bytes:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
                total += more.nbytes
            now = time.monotonic()
            with self._lock:  # ready backlog jobs, a batch's worth at a time (all of them at a stop)
                ready: list[_Job] = []
                kept: list[_Job] = []
                for job in self._backlog:
                    if (job.ready_at <= now or stop) and (stop or not ready or total < self._batch_bytes):
                        ready.append(job)
                        total += job.nbytes
                    else:
                        kept.append(job)
                self._backlog = kept
            jobs += ready
            if jobs:
                with self.health.guard(THREAD, "writing blocks to L3 failed"):
                    self._write(jobs)
            elif not stop:
                with self.health.guard(THREAD, "compacting an L3 pack failed"):
                    candidate = self.l3.blocks.compaction_candidate()
                    if candidate:
                        self.l3.blocks.compact(candidate)
            if stop or (self._stopping and self._queue.empty()):
                return

    def _write(self, jobs: list[_Job]) -> None:
        live = [job for job in jobs if self._wanted(job)]
        for job in jobs:
            if job not in live:  # evicted while it waited: done, nothing to write
                self._finish(job)
        if not live:
            return
        if self.l3.readonly:  # (before anything is read out of L2: the whole backlog waits, untouched)
            self._defer(live, NoSpace("L3 is read-only: its disk is below the free-space floor"))
            return
        pending = [(key, job) for job in live for key in job.keys]
        owners: dict[bytes, _Job] = {}
        written: set[bytes] = set()  # in an fsynced pack (L3 may have evicted some since, for a later part)
        at = 0
        try:
            while at < len(pending):
                at = self._write_part(pending, at, owners, written)
        except (NoSpace, TooLarge, OSError) as exc:
            self._defer(live, exc)
            return
        except BaseException:
            self._defer(live, None)
            raise
        lost = 0
        for job in live:  # written where every block the job named went into an fsynced pack; where the
            # job was evicted since, only those L3 still holds (evictions win; a block L3 let go of for a
            # later pack's room was written all the same)
            kept = written if self._wanted(job) else set()
            missing = sum(1 for key in job.keys if key not in kept and not self.l3.blocks.holds(key))
            job.outcome = "none" if missing else "written"
            lost += missing
        if lost:
            with self._lock:
                self._stats.block_writes_lost += lost
            log.info("%d block(s) left L2 or were evicted before their L3 write; not written", lost)
        for job in live:
            self._finish(job)

    def _write_part(
        self, pending: list[tuple[bytes, _Job]], at: int, owners: dict[bytes, _Job], written: set[bytes]
    ) -> int:
        """Writes the blocks of ``pending`` from ``at`` on as one pack of at most ``batch_bytes`` (and
        :data:`_PART_BLOCKS` blocks), reading them under one hold of the L2 lock; returns where the next
        pack starts. Blocks L2 no longer holds are skipped (the caller finds them missing)."""
        items: list[BlockItem] = []
        unhashed: list[tuple[int, Slab, int]] = []  # items whose digest is still to compute: item, slot
        leases: list[int] = []
        views = []
        nbytes = 0
        try:
            with self.l2.lock:
                by_slab: dict[int, tuple[Slab, list[int]]] = {}
                while at < len(pending) and nbytes < self._batch_bytes and len(items) < _PART_BLOCKS:
                    key, job = pending[at]
                    at += 1
                    found = self.l2.blocks.data_of(key)
                    if found is None or key in owners:
                        continue
                    if self.l3.blocks.holds(key):  # (a pack of an earlier try, or another put's)
                        owners[key] = job
                        written.add(key)
                        self.l2.blocks.mark_written(key)
                        continue
                    slab, index, record = found
                    by_slab.setdefault(id(slab), (slab, []))[1].append(index)
                    view = slab.data(index, record.nbytes)
                    views.append(view)
                    owners[key] = job
                    nbytes += record.nbytes
                    if not record.hashed:
                        unhashed.append((len(items), slab, index))
                    items.append(BlockItem(_pack_record(record), view))
                for slab, indexes in by_slab.values():
                    leases.append(slab.lease(_runs(indexes)))  # (a lock a run of slots, not one a slot)
                claimed = [items[i].record.key for i, _, _ in unhashed]
                self.l2.blocks.hashing_begun(claimed)  # hashed below: the digester leaves them alone
            digests = []
            try:
                for i, slab, index in unhashed:  # (the leases keep these slots as they are)
                    item = items[i]
                    digest = block_digest(item.data)
                    items[i] = BlockItem(replace(item.record, digest=digest), item.data)
                    digests.append((item.record.key, slab, index, digest))
            finally:
                with self.l2.lock:
                    self.l2.blocks.record_digests(digests)
                    self.l2.blocks.hashing_ended(claimed)
            if items:
                self.l3.blocks.write(items, wanted=lambda key: self._wanted(owners[key]))
                with self.l2.lock:  # (now: a later part may make L3 evict these for room)
                    for item in items:
                        key = item.record.key
                        if self.l3.blocks.holds(key):
                            written.add(key)
                            self.l2.blocks.mark_written(key)
            return at
        finally:
            for view in views:
                view.release()
            for fd in leases:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _finish(self, job: _Job) -> None:
        self._clock.end(job.seq)
        if job.done is not None:
            job.done.set()

    def _defer(self, jobs: list[_Job], exc: SkippydError | OSError | None) -> None:
        with self._lock:
            self._stats.block_writes_deferred += len(jobs)
            if exc is None:
                self._stats.block_write_failures += 1
            for job in jobs:
                job.attempts += 1
                job.ready_at = time.monotonic() + min(60.0, _RETRY_S * job.attempts)
                self._backlog.append(job)
                if job.done is not None:
                    job.done.set()  # its waiter hears "deferred"
        if exc is not None:
            log.warning("L3 cannot take %d block job(s) now (%s); they are retried later", len(jobs), exc)


def _runs(indexes: list[int]) -> list[tuple[int, int]]:
    """Slot indexes as runs of consecutive ones, ``(first, last)`` each."""
    runs: list[tuple[int, int]] = []
    for index in sorted(set(indexes)):
        if runs and runs[-1][1] + 1 == index:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def _pack_record(r: SlotRecord) -> PackRecord:
    return PackRecord(r.key, r.space, r.identity, r.block_tokens, r.parent, r.nbytes, r.digest)
