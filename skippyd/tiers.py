"""The rules across tiers: where a capture goes, which tier answers a lookup, what a restore serves.

* **capture**: copied into L2 (the daemon hashes it there) and answered at once. A durable capture's
  intent is recorded before its entry becomes visible and its L3 copy written in the background
  (:mod:`skippyd.durable`); ``durable="sync"`` waits for that copy's fsync. The newest capture of a key
  wins: an older L3 copy of the key is retired before the new entry is visible.
* **lookup/restore**: the longest captured prefix across both tiers wins. Where L3 holds that prefix
  it is the authority: an L2 entry is served only if its digest and token count match L3's (a mismatch
  removes the L2 entry). On an L2 miss the L3 entry is loaded and verified (:mod:`skippyd.fills`: once
  per object however many restores want it) and served from there. Corruption quarantines the L3 entry,
  drops every L2 entry with that digest and falls back to a shorter prefix.
* **promotion**: each fill's promotion into L2 is decided by the fill table's promoter
  (:mod:`skippyd.fills`), by the same second-hit rules across the scope.
* **eviction**: evicting a digest, a key or everything cancels the work that began before it
  (:mod:`skippyd.evictions`), so nothing in flight brings an evicted entry back.

Nothing here touches sockets or imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .blocks import Admission, BlockCounters, BlockRules
from .durable import DurableStats, DurableWriter
from .errors import Busy, CorruptEntry, InvalidArgument, NotFound, TooLarge
from .evictions import EvictionClock
from .fills import PROMOTER, FillStats, FillTable, PromotionPolicy
from .keys import Identity, cache_key, prefix_keys, token_count
from .l2 import Held, L2Stats, L2Tier, copy_and_hash, copy_into
from .l2.digests import Digester
from .l2.reserve import Reserve
from .l3 import L3Ref, L3Stats, L3Store, Reconciliation
from .packer import BlockWriter, BlockWriterStats
from .payload import Entry, EntryRef, TensorDecl, TensorSpec, plan_layout
from .workers import Health

_PIPELINED_BYTES = 8 << 20  # captures this large are copied and hashed overlapped (copy_and_hash)
_EXPECTED_GROUPS = 4  # block groups (space, block size) of L3 the reserve stocks after a restart

__all__ = [
    "PROMOTER",
    "CaptureOutcome",
    "Counters",
    "Listing",
    "Located",
    "Opened",
    "PromotionPolicy",
    "RestorePlan",
    "Tiers",
    "TiersStats",
]

log = logging.getLogger("skippyd.tiers")


@dataclass(frozen=True, slots=True)
class CaptureOutcome:
    digest: str
    token_count: int
    nbytes: int
    l2: bool
    l3: bool
    durability: str = "none"  # "written" | "queued" | "deferred" | "none" (see skippyd.durable)


@dataclass(frozen=True, slots=True)
class Located:
    token_count: int
    source: str
    digest: str
    nbytes: int


@dataclass(slots=True)
class Opened:
    """What a restore sends: the entry's description and a leased read-only fd (the caller closes it)."""

    entry: Entry
    data_offset: int
    fd: int
    source: str
    timings: dict[str, float] = field(default_factory=dict)
    generation: int = 0  # the file's generation (docs/protocol.md); 0: a file served once (an L3 fill)


@dataclass(frozen=True, slots=True)
class Listing:
    """One row of ``ls``."""

    tier: str  # "l2", "l3" or "l2+l3"
    entry: Entry | EntryRef
    size: int  # bytes it takes in its tier
    age_s: float
    idle_s: float

    def to_wire(self) -> dict[str, Any]:
        e = self.entry
        return {
            "tier": self.tier,
            "digest": e.digest,
            "identity": e.identity,
            "token_count": e.token_count,
            "kind": e.kind,
            "nbytes": e.nbytes,
            "file_size": self.size,
            "age_s": self.age_s,
            "idle_s": self.idle_s,
            "tensors": e.tensor_count if isinstance(e, EntryRef) else len(e.tensors),
        }


@dataclass(slots=True)
class Counters:
    captures: int = 0
    capture_bytes: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    restores: int = 0
    restore_hits: int = 0
    restore_bytes: int = 0
    restores_l2: int = 0
    restores_l3: int = 0
    l3_vouched: int = 0
    l2_mismatches_removed: int = 0
    corrupt_fallbacks: int = 0
    evictions_requested: int = 0


@dataclass(frozen=True, slots=True)
class TiersStats:
    """Every tier's typed counters, as one snapshot."""

    l2: L2Stats
    ops: Counters
    blocks: BlockCounters
    fills: FillStats | None
    l3: L3Stats | None
    durable: DurableStats | None
    block_writer: BlockWriterStats | None
    reconciliation: Reconciliation | None


@dataclass(slots=True)
class _Candidate:
    key: str
    length: int


@dataclass(slots=True)
class RestorePlan:
    """A restore in progress: the prompt's candidate keys, longest first, and how far it got.

    Made once (the prompt is hashed once); :meth:`Tiers.restore` can stop where a candidate needs the disk
    (on the event loop) and a worker thread resumes the same plan there.
    """

    identity: Identity
    candidates: list[_Candidate]
    started: float
    position: int = 0
    needs_disk: bool = False  # the candidate at ``position`` is an L3 fill
    resolved: L3Ref | None = None  # its L3 entry, looked up on the event loop


class Tiers:
    def __init__(
        self,
        l2: L2Tier,
        *,
        l3: L3Store | None = None,
        promotions: PromotionPolicy | None = None,
        admission: Admission | None = None,
        copy_threads: int = 2,
        max_entry: int | None = None,
        l3_queue: int = 64,
        promotion_queue: int = 16,
        fill_budget: int = 2 << 30,
        sync_timeout: float = 20.0,
        health: Health | None = None,
        reserve_bytes: int = 0,
        reserve_window: float = 10.0,
        reserve_rate: int = 0,
        reserve_share: float = 0.0,
        digest_backlog: int = 0,
        settle_waiters: int = 16,
    ) -> None:
        self.l2 = l2
        self.l3 = l3
        self.health = health or Health()
        self._copy_threads = copy_threads
        self._max_entry = max_entry
        self._sync_timeout = sync_timeout
        self.counters = Counters()
        self.capture_hooks: list[Callable[[Identity, bytes, Entry], None]] = []
        self.clock = EvictionClock()  # evictions cancel the work begun before them
        self.writer: DurableWriter | None = None
        self.fills: FillTable | None = None
        if l3 is not None:
            self.writer = DurableWriter(l2, l3, self.clock, self.health, queue_size=l3_queue)
            self.writer.recover()
            self.writer.start()
            self.fills = FillTable(
                l2, l3, self.clock, self.health, promotions=promotions, budget=fill_budget,
                queue_size=promotion_queue, copy_threads=copy_threads,
            )  # fmt: skip
        self._lock = threading.Lock()
        self.block_writer: BlockWriter | None = None
        if l3 is not None:
            self.block_writer = BlockWriter(l2, l3, self.health, queue_size=l3_queue * 64)
            self.block_writer.recover()
            self.block_writer.start()
        cap = min(reserve_bytes, l2.budget_bytes // 4)
        self.reserve = Reserve(
            l2, cap, self.health, window=reserve_window, rate=reserve_rate, share=reserve_share
        )
        if l3 is not None and self.reserve.limit > 0:
            # After a restart the reserve has no demand to go by; the block groups L3 holds most of are
            # what reads will bring back into L2 first: stock those, so the first reads land on
            # pre-faulted memory instead of faulting fresh pages on their request path.
            held = sorted(l3.blocks.sizes().items(), key=lambda item: -item[1])[:_EXPECTED_GROUPS]
            with l2.lock:
                for (space, nbytes), _ in held:
                    l2.blocks.expect(space, nbytes)
        self.reserve.start()
        self.digester = Digester(l2, min(digest_backlog, l2.budget_bytes // 4), self.health)
        self.digester.start()
        self.blocks = BlockRules(
            l2, l3=l3, writer=self.block_writer, promotions=promotions, admission=admission,
            memory=self.fills, copy_threads=copy_threads, sync_timeout=sync_timeout, digester=self.digester,
            settle_waiters=settle_waiters,
        )  # fmt: skip

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    # ----------------------------------------------------------------- capture
    def capture(
        self,
        *,
        identity: Identity,
        tokens: bytes,
        tensors: Sequence[TensorDecl],
        source: memoryview,
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        durable: bool | str = True,
    ) -> CaptureOutcome:
        """Copies the tensors out of ``source`` (laid out by :func:`plan_layout`) into a new L2 entry.

        The copy lands in memory only the daemon can write, and the digest is computed over it there, so
        whatever the client does to ``source`` afterwards cannot change the committed entry. ``durable``
        is True (an L3 copy is queued), ``"sync"`` (returns once it is fsynced, within the sync
        timeout) or False.
        """
        if durable not in (True, False, "sync"):
            raise InvalidArgument('durable must be true, false or "sync"')
        count = token_count(tokens)
        if count == 0:
            raise InvalidArgument("a capture needs at least one token")
        specs, data_len = plan_layout(tensors)
        if data_len > len(source):
            raise InvalidArgument(
                f"the staging buffer holds {len(source)} bytes; the tensors need {data_len}"
            )
        if self._max_entry is not None and data_len > self._max_entry:
            raise TooLarge(f"an entry of {data_len} bytes exceeds the entry limit of {self._max_entry}")
        key = cache_key(identity, tokens)
        seq = self.clock.begin()  # an eviction from here on cancels this capture's durable write
        try:
            admitted = self._admit(
                identity, key, count, tensors, specs, source, kind, meta, bool(durable), seq
            )
            if isinstance(admitted, str):  # an eviction of it came while it was copied: nothing is kept
                self._count(captures=1)
                return CaptureOutcome(admitted, count, data_len, False, False, "none")
            entry = admitted
            durability = "none"
            if durable and self.writer is not None:
                durability = self.writer.submit(
                    entry, seq, sync=durable == "sync", timeout=self._sync_timeout
                )
            for hook in self.capture_hooks:
                hook(identity, tokens, entry)
            self._count(captures=1, capture_bytes=entry.nbytes)
            l3 = durability == "written" if durable == "sync" else durability in ("written", "queued")
            return CaptureOutcome(entry.digest, entry.token_count, entry.nbytes, True, l3, durability)
        finally:
            self.clock.end(seq)

    def _admit(  # noqa: PLR0917 - capture's own arguments, passed on
        self,
        identity: Identity,
        key: str,
        count: int,
        tensors: Sequence[TensorDecl],
        specs: Sequence[TensorSpec],
        source: memoryview,
        kind: str,
        meta: Mapping[str, Any] | None,
        durable: bool,
        seq: int,
    ) -> Entry | str:
        """Where a capture is admitted: copied into a reservation, hashed, and published; or, where an
        eviction of its key or digest came after it began (``seq``), not published: its digest."""
        writer, l3 = self.writer, self.l3
        intended: list[str] = []
        hashed: list[str] = []

        def before_publish(digest: str) -> None:
            """The newest capture wins over older durable copies, before it becomes visible: a restore never
            sees the new L2 entry beside an older L3 authority (which would remove it). A durable capture's
            intent is recorded here too, so a crash right after the commit keeps it."""
            hashed.append(digest)
            if writer is None or l3 is None:
                return
            writer.intend(key, digest, durable=durable)
            intended.append(digest)
            stale = l3.get(key)
            if stale is not None and stale.entry.digest != digest:
                l3.remove(key, digest=stale.entry.digest)

        published = False
        try:
            with self.l2.reserve(
                key=key, identity=identity, token_count=count, tensors=tensors, kind=kind, meta=meta
            ) as reservation:
                computed: str | None = None
                if reservation.entry.data_len >= _PIPELINED_BYTES:  # copy and hash overlapped, chunk by chunk
                    computed = copy_and_hash(reservation.data, specs, source, threads=self._copy_threads)
                else:
                    for spec in specs:
                        view = source[spec.offset : spec.offset + spec.nbytes]
                        copy_into(
                            reservation.data, spec.offset, spec.nbytes, view, threads=self._copy_threads
                        )
                entry = reservation.commit_unless(
                    lambda digest: self.clock.cancelled(digest, seq, key),
                    before_publish=before_publish,
                    digest=computed,
                )
            published = entry is not None
            return entry if entry is not None else hashed[0]
        finally:
            if not published and writer is not None and intended and durable:
                writer.withdraw(key, intended[0])  # nothing was published under that intent

    # ----------------------------------------------------------------- locating
    def _candidates(self, identity: Identity, tokens: bytes) -> list[_Candidate]:
        """Every captured prefix length of this prompt in either tier, longest first (one hashing pass)."""
        upto = token_count(tokens)
        lengths = set(self.l2.prefix_lengths(identity.digest, upto))
        if self.l3 is not None:
            lengths.update(self.l3.prefix_lengths(identity.digest, upto))
        if not lengths:
            return []
        ordered = sorted(lengths)
        keys = prefix_keys(identity, tokens, ordered)
        return [_Candidate(k, n) for n, k in zip(reversed(ordered), reversed(keys), strict=True)]

    def _authority(self, key: str, l2: Entry | None) -> tuple[Entry | None, L3Ref | None]:
        """What may serve ``key``: L3 is the authority where it holds the key, so an L2 entry that
        disagrees with it (another digest or token count) is removed, not served."""
        l3 = self.l3.get(key) if self.l3 is not None else None
        if (
            l3 is not None
            and l2 is not None
            and (l2.digest != l3.entry.digest or l2.token_count != l3.entry.token_count)
        ):
            if self.l2.remove(key, digest=l2.digest):
                self._count(l2_mismatches_removed=1)
            return None, l3
        return l2, l3

    def busy(self) -> bool:
        """Whether another thread holds a tier's lock right now: a request run on the event loop would
        wait for it there, and every other client with it (the server runs it on a worker instead)."""
        locks = [self.l2.lock] if self.l3 is None else [self.l2.lock, self.l3.lock]
        for lock in locks:
            if not lock.acquire(blocking=False):
                return True
            lock.release()
        return False

    def lookup(self, identity: Identity, tokens: bytes) -> Located | None:
        """The longest captured prefix in either tier, without loading it or touching recency."""
        for candidate in self._candidates(identity, tokens):
            l2, l3 = self._authority(candidate.key, self.l2.peek(candidate.key))
            if l2 is not None:
                self._count(lookups=1, lookup_hits=1)
                return Located(l2.token_count, "l2", l2.digest, l2.nbytes)
            if l3 is not None:
                self._count(lookups=1, lookup_hits=1)
                return Located(l3.entry.token_count, "l3", l3.entry.digest, l3.entry.nbytes)
        self._count(lookups=1)
        return None

    # ----------------------------------------------------------------- restore
    def plan_restore(self, identity: Identity, tokens: bytes) -> RestorePlan:
        """Hashes the prompt's candidate prefixes (once); :meth:`restore` then walks them."""
        return RestorePlan(identity, self._candidates(identity, tokens), time.perf_counter())

    def restore(self, plan: RestorePlan, *, may_fill: bool = True) -> Opened | None:
        """The longest captured prefix of ``plan`` opened for reading (L3 fills happen here), or None.

        With ``may_fill=False`` (the event loop) it stops where a candidate needs an L3 fill and leaves
        ``plan.needs_disk`` set: call it again with the same plan on a worker thread to go on from there.
        """
        seq = self.clock.begin()  # an eviction from here on cancels the promotion of a fill
        try:
            while plan.position < len(plan.candidates):
                candidate = plan.candidates[plan.position]
                if plan.needs_disk:  # resumed on a worker: the L3 entry looked up on the event loop
                    opened = self._open_l3(plan, plan.resolved, seq) if plan.resolved is not None else None
                    plan.needs_disk, plan.resolved = False, None
                else:
                    opened, l3 = self._open_l2(candidate, plan.started)
                    if opened is None and l3 is not None:
                        if not may_fill:
                            plan.needs_disk, plan.resolved = True, l3
                            return None
                        opened = self._open_l3(plan, l3, seq)
                if opened is not None:
                    self._count(restores=1, restore_hits=1, restore_bytes=opened.entry.nbytes)
                    return opened
                plan.position += 1
            self.l2.count_miss()
            if self.l3 is not None:
                self.l3.count_hit(False)
            self._count(restores=1)
            return None
        finally:
            self.clock.end(seq)

    def open_restore(self, identity: Identity, tokens: bytes) -> Opened | None:
        """:meth:`plan_restore` and :meth:`restore` in one call, disk allowed."""
        return self.restore(self.plan_restore(identity, tokens))

    def _open_l2(self, candidate: _Candidate, started: float) -> tuple[Opened | None, L3Ref | None]:
        """The L2 entry of ``candidate`` opened if L3 agrees with it (one L2 lookup), and L3's entry."""
        held: Held | None = self.l2.hold(candidate.key)  # counts the hit and moves recency
        l2, l3 = self._authority(candidate.key, held.entry if held is not None else None)
        if held is None:
            return None, l3
        if l2 is None:  # L3 disagreed: that entry is gone now
            os.close(held.fd)
            return None, l3
        if l3 is not None and self.l3 is not None:
            self.l3.touch(candidate.key)
            self._count(l3_vouched=1)
        self._count(restores_l2=1)
        timings = {"lookup_ms": (time.perf_counter() - started) * 1e3}
        return Opened(held.entry, held.data_offset, held.fd, "l2", timings, held.generation), l3

    def _open_l3(self, plan: RestorePlan, ref: L3Ref, seq: int) -> Opened | None:
        """The L3 entry ``ref`` loaded through the fill table; a corrupt, vanished or over-budget one is
        None (the next shorter prefix is tried)."""
        assert self.fills is not None and self.l3 is not None
        lookup_ms = (time.perf_counter() - plan.started) * 1e3
        try:
            loaded = self.fills.open(ref, seq)
        except CorruptEntry:
            self.l2.remove_by_digest(ref.entry.digest)
            self._count(corrupt_fallbacks=1)
            return None  # never served: fall back to a shorter prefix
        except (NotFound, Busy):
            return None  # a shorter prefix, if any, is served instead
        self.l2.count_miss()
        self.l3.count_hit(True)
        self._count(restores_l3=1)
        timings = {"lookup_ms": lookup_ms, "fill_ms": loaded.fill_ms}
        return Opened(loaded.manifest.entry, loaded.data_offset, loaded.fd, "l3", timings)

    # ----------------------------------------------------------------- admin
    def evict_digest(self, digest: str) -> int:
        """Removes every entry with this payload digest from both tiers; returns how many cache keys."""
        self._count(evictions_requested=1)
        keys: set[str] = set()
        # Twice: the first mark cancels the work begun before this call; work that began while the tiers
        # were being swept (a fill of the L3 copy, a capture's durable write) is cancelled by the second
        # mark, and whatever of it became visible before that mark is swept the second time.
        for _ in range(2):
            self._mark_evicted(digest)
            keys.update(self.l2.keys_by_digest(digest))
            self.l2.remove_by_digest(digest)
            if self.l3 is not None:
                keys.update(self.l3.keys_by_digest(digest))
                self.l3.remove_by_digest(digest)
        return len(keys)

    def evict_key(self, key: str) -> int:
        """Removes the entry under one cache key from both tiers; returns 1 if there was one, else 0."""
        self._count(evictions_requested=1)
        found = False
        for _ in range(2):  # as in evict_digest
            self._mark_evicted(None, key=key)
            found = self.l2.remove(key) or found
            if self.l3 is not None:
                found = self.l3.remove(key) or found
        return int(found)

    def evict_all(self) -> int:
        """Removes every entry from both tiers (and every durable write still waiting)."""
        self._count(evictions_requested=1)
        keys: set[str] = set()
        for _ in range(2):  # as in evict_digest
            self._mark_evicted(None)
            keys.update(item.entry.key for item in self.l2.entries())
            self.l2.clear()
            self.blocks.clear()
            if self.l3 is not None:
                keys.update(ref.entry.key for ref, _ in self.l3.entries())
                self.l3.clear()
        return len(keys)

    def _mark_evicted(self, digest: str | None, *, key: str | None = None) -> None:
        """Cancels the work begun before now: of this digest, this key, or of everything."""
        self.clock.evict(digest, key=key)
        if self.writer is not None:
            self.writer.forget(digest, key=key)

    def resolve_digest(self, prefix: str) -> str:
        """The one payload digest either tier holds that starts with ``prefix`` (8 to 64 hex digits)."""
        digests = set(self.l2.digests())
        if self.l3 is not None:
            digests.update(self.l3.digests())
        matches = sorted(d for d in digests if d.startswith(prefix))
        if not matches:
            raise NotFound(f"no entry's digest starts with {prefix}")
        if len(matches) > 1:
            raise InvalidArgument(f"{len(matches)} digests start with {prefix}: give more of it")
        return matches[0]

    def entries(self) -> list[Listing]:
        """Every entry of both tiers, most recently used first."""
        now = time.time_ns()
        durable = {ref.entry.key: ref.entry.digest for ref, _ in self.l3.entries()} if self.l3 else {}
        out: list[Listing] = []
        seen: set[str] = set()
        for item in reversed(self.l2.entries()):
            e = item.entry
            seen.add(e.key)
            tier = "l2+l3" if durable.get(e.key) == e.digest else "l2"
            out.append(_listing(tier, e, item.file_size, item.last_use, now))
        if self.l3 is not None:
            for ref, last_use in reversed(self.l3.entries()):
                if ref.entry.key not in seen:
                    out.append(_listing("l3", ref.entry, ref.entry.data_len, last_use, now))
        return out

    def stats(self) -> TiersStats:
        with self._lock:
            ops = Counters(**{name: getattr(self.counters, name) for name in Counters.__slots__})
        l3 = self.l3
        return TiersStats(
            l2=self.l2.stats(),
            ops=ops,
            blocks=self.blocks.stats(),
            fills=self.fills.stats() if self.fills is not None else None,
            l3=l3.stats() if l3 is not None else None,
            durable=self.writer.stats() if self.writer is not None else None,
            block_writer=self.block_writer.stats() if self.block_writer is not None else None,
            reconciliation=l3.last_reconciliation if l3 is not None else None,
        )

    def housekeeping(self) -> None:
        self.l2.flush_recency()
        self.l2.trim_free(idle_seconds=300.0)
        if self.l3 is not None:
            self.l3.flush_recency()

    def close(self, timeout: float = 10.0) -> None:
        """Lets queued durable writes finish (within ``timeout``), stops the threads, closes the tiers.
        Durable writes left undone keep their markers and are written by the next start."""
        self.reserve.close()
        if self.writer is not None:
            self.writer.close(timeout)
        if self.block_writer is not None:
            self.block_writer.close(timeout)
        if self.fills is not None:
            self.fills.close(timeout)
        self.digester.close()  # after the block writer, which hashes what it writes: the rest now
        if self.l3 is not None:
            self.l3.close()
        self.l2.close()


def _listing(tier: str, entry: Entry | EntryRef, size: int, last_use: int, now: int) -> Listing:
    return Listing(
        tier, entry, size, max(0.0, (now - entry.created_ns) / 1e9), max(0.0, (now - last_use) / 1e9)
    )
