"""The rules across tiers: where a capture goes, which tier answers a lookup, what a restore serves.

* **capture**: copied into L2 (the daemon hashes it there) and answered at once; a durable capture is
  then written to L3 by a background writer through a bounded queue — when the queue is full the write
  is dropped and counted: L3 is a durability floor, not a serving dependency.
* **lookup/restore**: the longest captured prefix across both tiers wins. Where L3 holds that prefix
  it is the authority: an L2 entry is served only if its digest and token count match L3's (a mismatch
  removes the L2 entry). On an L2 miss the L3 entry is read and verified into free L2 memory (never
  evicting for it) or, when L2 has none, into a sealed memfd within the fill budget, and served from
  there; concurrent misses for one object load it once. Corruption quarantines the L3 entry, drops every
  L2 entry with that digest and falls back to a shorter prefix.
* **promotion**: after each L3 fill a bounded worker asks ``consider`` (the seed's should_promote,
  counted in Redis across the scope, or locally); yes publishes the loaded L2 memory as an entry (no
  second copy; a memfd fill is copied into room made by LRU) and ``settle``\\ s; no gives the memory
  back.

Nothing here touches sockets or imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from .durable import DurableWriter
from .errors import Busy, CorruptEntry, InvalidArgument, NoSpace, NotFound, SkippydError, TooLarge
from .evictions import EvictionClock
from .keys import Identity, cache_key, prefix_keys, token_count
from .l2 import L2Entry, L2Tier, Reservation, copy_into
from .l3 import L3Entry, L3Ref, L3Store
from .payload import TensorDecl, plan_layout
from .shm import memfd, reopen_readonly, seal_readonly
from .workers import Health

__all__ = ["CaptureOutcome", "Located", "Opened", "PromotionPolicy", "RunOnWorker", "Tiers"]

log = logging.getLogger("skippyd.tiers")

PROMOTER = "skippyd-promoter"


class RunOnWorker(Exception):
    """Raised on the event loop when a request turns out to need disk I/O (an L3 fill): run it again
    on a worker thread."""


class PromotionPolicy(Protocol):
    def consider(self, manifest_key: str, token_count: int, payload_bytes: int) -> bool: ...

    def settle(self, manifest_key: str) -> None: ...


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

    token_count: int
    kind: str
    digest: str
    meta: Mapping[str, Any]
    tensors: tuple[Any, ...]
    data_offset: int
    data_len: int
    fd: int
    source: str
    timings: dict[str, float] = field(default_factory=dict)


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
    fills: int = 0
    fill_waits: int = 0
    fills_refused: int = 0  # over the fill budget: a shorter prefix was served instead
    corrupt_fallbacks: int = 0
    promotions: int = 0
    promotions_declined: int = 0
    promotions_dropped: int = 0
    evictions_requested: int = 0


@dataclass
class _Fill:
    """One L3 entry loaded into reserved L2 memory, shared by every restore that wants it.

    ``users`` counts the restores between joining and holding their own fd; the promoter's decision
    (``resolution``: commit or abort) is carried out once the last of them is done, so no restore ever
    finds the memory gone between the load and its fd.
    """

    ref: L3Ref  # what the restore looked up
    key: str
    seq: int  # the eviction sequence number when the fill began: a later eviction of its digest wins
    entry: L3Entry | None = None  # the whole manifest, read by the leader
    done: Future[None] = field(default_factory=Future)
    reservation: Reservation | None = None
    fd: int = -1  # a sealed memfd when L2 had no free room
    memfd_bytes: int = 0  # charged to the fill budget while the memfd is held
    fill_ms: float = 0.0
    users: int = 0
    resolution: str | None = None  # "commit" | "abort"
    released: bool = False


@dataclass(slots=True)
class _Candidate:
    key: str
    length: int
    l2: L2Entry | None
    l3: L3Ref | None


class Tiers:
    def __init__(
        self,
        l2: L2Tier,
        *,
        l3: L3Store | None = None,
        promotions: PromotionPolicy | None = None,
        copy_threads: int = 2,
        max_entry: int | None = None,
        l3_queue: int = 64,
        promotion_queue: int = 16,
        fill_budget: int = 2 << 30,
        sync_timeout: float = 20.0,
        health: Health | None = None,
    ) -> None:
        self.l2 = l2
        self.l3 = l3
        self.promotions = promotions
        self.health = health or Health()
        self._copy_threads = copy_threads
        self._max_entry = max_entry
        self._sync_timeout = sync_timeout
        self._lock = threading.Lock()
        self.counters = Counters()
        self.capture_hooks: list[Callable[[Identity, bytes, L2Entry], None]] = []
        self._fills: dict[str, _Fill] = {}  # by L3 object: concurrent misses of the same bytes load once
        # Evictions cancel the work begun before them (captures, restores, durable writes, fills).
        self.clock = EvictionClock()
        # L3 fills held in memfds (L2 had no free room) are RAM outside the L2 budget: capped here. One
        # fill may always run, however large; past the cap a restore falls back to a shorter prefix.
        self._fill_budget = fill_budget
        self._fill_bytes = 0
        self.writer: DurableWriter | None = None
        if l3 is not None:
            self.writer = DurableWriter(l2, l3, self.clock, self.health, queue_size=l3_queue)
            self.writer.recover()
            self.writer.start()
        self._promote: queue.Queue[_Fill | None] = queue.Queue(maxsize=max(1, promotion_queue))
        self._promoter_thread = self.health.start(PROMOTER, self._promoter)

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
        writer = self.writer
        intended: list[str] = []
        try:

            def before_publish(digest: str) -> None:
                """The newest capture wins over older durable copies, before it becomes visible: a restore
                never sees the new L2 entry beside an older L3 authority (which would remove it). A
                durable capture's intent is recorded here too, so a crash right after the commit keeps it."""
                if writer is None or self.l3 is None:
                    return
                writer.intend(key, digest, durable=bool(durable))
                intended.append(digest)
                stale = self.l3.get(key)
                if stale is not None and stale.digest != digest:
                    self.l3.remove(key)

            try:
                with self.l2.reserve(
                    key=key, identity=identity, token_count=count, tensors=tensors, kind=kind, meta=meta
                ) as reservation:
                    for spec in specs:
                        view = source[spec.offset : spec.offset + spec.nbytes]
                        threads = self._copy_threads
                        copy_into(reservation.data, spec.offset, spec.nbytes, view, threads=threads)
                    entry = reservation.commit(before_publish=before_publish)
            except BaseException:
                if writer is not None and intended and durable:
                    writer.withdraw(key, intended[0])  # nothing was published under that intent
                raise
            durability = "none"
            if durable and writer is not None:
                durability = writer.submit(entry, seq, sync=durable == "sync", timeout=self._sync_timeout)
            for hook in self.capture_hooks:
                hook(identity, tokens, entry)
            self._count(captures=1, capture_bytes=entry.nbytes)
            l3 = durability == "written" if durable == "sync" else durability in ("written", "queued")
            return CaptureOutcome(entry.digest, entry.token_count, entry.nbytes, True, l3, durability)
        finally:
            self.clock.end()

    # ----------------------------------------------------------------- locating
    def _candidates(self, identity: Identity, tokens: bytes) -> list[_Candidate]:
        """Every captured prefix length of this prompt in either tier, longest first."""
        upto = token_count(tokens)
        lengths = set(self.l2.prefix_lengths(identity.digest, upto))
        if self.l3 is not None:
            lengths.update(self.l3.prefix_lengths(identity.digest, upto))
        if not lengths:
            return []
        ordered = sorted(lengths)
        keys = prefix_keys(identity, tokens, ordered)
        return [_Candidate(k, n, None, None) for n, k in zip(reversed(ordered), reversed(keys), strict=True)]

    def _resolve(self, candidate: _Candidate) -> _Candidate | None:
        """Which tier can serve this prefix, with L3 as the authority where it holds it."""
        l2 = self.l2.peek(candidate.key)
        l3 = self.l3.get(candidate.key) if self.l3 is not None else None
        if l3 is not None:
            if l2 is not None and (l2.digest != l3.digest or l2.token_count != l3.token_count):
                self.l2.remove(candidate.key)
                self._count(l2_mismatches_removed=1)
                l2 = None
            return _Candidate(candidate.key, candidate.length, l2, l3)
        if l2 is not None:
            return _Candidate(candidate.key, candidate.length, l2, None)
        return None

    def lookup(self, identity: Identity, tokens: bytes) -> Located | None:
        """The longest captured prefix in either tier, without loading it or touching recency."""
        for candidate in self._candidates(identity, tokens):
            found = self._resolve(candidate)
            if found is None:
                continue
            self._count(lookups=1, lookup_hits=1)
            if found.l2 is not None:
                return Located(found.l2.token_count, "l2", found.l2.digest, found.l2.nbytes)
            assert found.l3 is not None
            return Located(found.l3.token_count, "l3", found.l3.digest, found.l3.nbytes)
        self._count(lookups=1)
        return None

    def open_restore(self, identity: Identity, tokens: bytes, *, may_fill: bool = True) -> Opened | None:
        """The longest captured prefix opened for reading; L3 fills happen here.

        With ``may_fill=False`` (the event loop) a restore that needs an L3 fill raises
        :class:`RunOnWorker` instead of reading the disk.
        """
        started = time.perf_counter()
        seq = self.clock.begin()  # an eviction from here on cancels the promotion of a fill
        try:
            return self._open_restore(identity, tokens, may_fill, started, seq)
        finally:
            self.clock.end()

    def _open_restore(
        self, identity: Identity, tokens: bytes, may_fill: bool, started: float, seq: int
    ) -> Opened | None:
        for candidate in self._candidates(identity, tokens):
            found = self._resolve(candidate)
            if found is None:
                continue
            opened = self._open_l2(found, started) if found.l2 is not None else None
            if opened is None and found.l3 is not None:
                if not may_fill:
                    raise RunOnWorker
                try:
                    opened = self._open_l3(found.key, found.l3, started, seq)
                except CorruptEntry:
                    self.l2.remove_by_digest(found.l3.digest)
                    self._count(corrupt_fallbacks=1)
                    continue  # never served: fall back to a shorter prefix
                except (NotFound, Busy):
                    continue  # a shorter prefix, if any, is served instead
            if opened is None:
                continue
            self._count(restores=1, restore_hits=1, restore_bytes=sum(s.nbytes for s in opened.tensors))
            return opened
        self.l2.count_miss()
        if self.l3 is not None:
            self.l3.count_hit(False)
        self._count(restores=1)
        return None

    def _open_l2(self, found: _Candidate, started: float) -> Opened | None:
        entry = self.l2.get(found.key)  # counts the hit and moves recency
        if entry is None:
            return None
        opened = self.l2.open_reader(found.key)
        if opened is None:
            return None
        fd, entry = opened
        if found.l3 is not None:
            self.l3.touch(found.key)  # type: ignore[union-attr]
            self._count(l3_vouched=1)
        self._count(restores_l2=1)
        return _opened(
            entry, entry.data_offset, fd, "l2", {"lookup_ms": (time.perf_counter() - started) * 1e3}
        )

    # ----------------------------------------------------------------- L3 fills
    def _open_l3(self, key: str, ref: L3Ref, started: float, seq: int) -> Opened:
        assert self.l3 is not None
        lookup_ms = (time.perf_counter() - started) * 1e3
        with self._lock:
            fill = self._fills.get(ref.object)
            leader = fill is None
            if fill is None:
                fill = self._fills[ref.object] = _Fill(ref, key, min(seq, self.clock.begin()))
            else:
                self.counters.fill_waits += 1
            fill.users += 1
        try:
            if leader:
                self._load(fill)
            fill.done.result()  # the leader's CorruptEntry/NotFound reaches every waiter
            fd, data_offset = self._fill_reader(fill)
            entry = fill.entry
            assert entry is not None
        finally:
            self._leave(fill)
        self.l2.count_miss()
        self.l3.count_hit(True)
        self._count(restores_l3=1)
        return _opened(entry, data_offset, fd, "l3", {"lookup_ms": lookup_ms, "fill_ms": fill.fill_ms})

    def _load(self, fill: _Fill) -> None:
        """Reads and verifies the entry into free L2 memory (never evicting for it: the promoter decides
        whether it stays), or into a sealed memfd when L2 has no free room."""
        assert self.l3 is not None
        key = fill.key
        began = time.perf_counter()
        try:
            entry = fill.entry = self.l3.manifest(key, expected=fill.ref)
            try:
                fill.reservation = self.l2.reserve(
                    key=key, identity=entry.identity, token_count=entry.token_count, tensors=_decls(entry),
                    kind=entry.kind, meta=entry.meta, origin="l3", evict=False, replace=False,
                )  # fmt: skip
                if fill.reservation.header.data_len != entry.data_len:  # pragma: no cover - same layout rule
                    raise CorruptEntry("L3 entry layout differs from L2's")
                self.l3.load_into(key, fill.reservation.data, expected=entry)
            except (TooLarge, NoSpace):
                if fill.reservation is not None:
                    fill.reservation.abort()
                    fill.reservation = None
                size = max(entry.data_len, 1)
                with self._lock:
                    if self._fill_bytes and self._fill_bytes + size > self._fill_budget:
                        self.counters.fills_refused += 1
                        raise Busy("L3 restores in flight hold the whole fill budget") from None
                    self._fill_bytes += size
                    fill.memfd_bytes = size
                fill.fd = self._load_memfd(key, entry)
            fill.fill_ms = (time.perf_counter() - began) * 1e3
            self._count(fills=1)
        except BaseException as exc:
            if fill.reservation is not None:
                fill.reservation.abort()
                fill.reservation = None
            with self._lock:
                self._retire_locked(fill)
                self._finish_fill_locked(fill)
            fill.done.set_exception(exc)
            return
        fill.done.set_result(None)
        try:
            self._promote.put_nowait(fill)
        except queue.Full:
            self._count(promotions_dropped=1)
            self._resolve_fill(fill, promote=False)

    def _load_memfd(self, key: str, entry: L3Entry) -> int:
        """The entry in anonymous memory, sealed read-only once loaded (clients get O_RDONLY fds)."""
        assert self.l3 is not None
        size = max(entry.data_len, 1)
        fd = memfd("skippyd-l3-fill", size, seal=False)
        try:
            with (
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mapping,
                memoryview(mapping) as view,
                view[: entry.data_len] as dest,  # released here even when an exception keeps the frames
            ):
                self.l3.load_into(key, dest, expected=entry)
            seal_readonly(fd)  # our writable mapping is gone: from now on nobody can change a byte
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _fill_reader(self, fill: _Fill) -> tuple[int, int]:
        with self._lock:
            if fill.reservation is not None:
                return fill.reservation.open_reader(), fill.reservation.data_offset
            if fill.fd >= 0:
                return reopen_readonly(fill.fd), 0
        raise NotFound("the loaded L3 entry was already released")  # pragma: no cover - users guard it

    def _finish_fill_locked(self, fill: _Fill) -> None:
        """The fill's memory is given back (or now L2's): its budget share and its outstanding work end."""
        self._fill_bytes -= fill.memfd_bytes
        fill.memfd_bytes = 0
        self.clock.end()

    def _retire_locked(self, fill: _Fill) -> None:
        """No restore joins this fill any more (its work stays outstanding until :meth:`_release`)."""
        fill.released = True
        if self._fills.get(fill.ref.object) is fill:
            del self._fills[fill.ref.object]

    def _leave(self, fill: _Fill) -> None:
        with self._lock:
            fill.users -= 1
            ready = fill.users == 0 and fill.resolution is not None and not fill.released
            if ready:
                self._retire_locked(fill)
        if ready:
            self._release(fill)

    def _resolve_fill(self, fill: _Fill, *, promote: bool) -> None:
        with self._lock:
            fill.resolution = "commit" if promote else "abort"
            ready = fill.users == 0 and not fill.released
            if ready:
                self._retire_locked(fill)
        if ready:
            self._release(fill)

    def _release(self, fill: _Fill) -> None:
        reservation, fill.reservation = fill.reservation, None
        fd, fill.fd = fill.fd, -1
        with self._lock:
            promote = fill.resolution == "commit" and not self.clock.cancelled(
                fill.ref.digest, fill.seq, fill.key
            )
        if promote and self.l3 is not None:  # a newer capture of the key may have retired these bytes
            durable = self.l3.get(fill.key)
            promote = durable is not None and durable.digest == fill.ref.digest
        try:
            committed: L2Entry | None = None
            if promote and reservation is not None:
                committed = reservation.commit_if_absent(expected_digest=fill.ref.digest)
                reservation = None
            elif promote and fd >= 0:
                committed = self._promote_copy(fill, fd)
            if committed is not None:
                self._count(promotions=1)
                with self._lock:
                    # an eviction that marked this digest after the check above may have swept L2
                    # before the commit: take the promoted entry back out
                    withdraw = self.clock.cancelled(fill.ref.digest, fill.seq, fill.key)
                if withdraw:
                    current = self.l2.peek(committed.key)
                    if current is not None and current.digest == committed.digest:
                        self.l2.remove(committed.key)
        except Exception as exc:  # never escapes into the restore (or the promoter) that released the fill
            if isinstance(exc, SkippydError):
                reservation = None  # a failed commit gave its memory back
            self.health.failed(PROMOTER, "promotion into L2 failed", exc)
        finally:
            if reservation is not None:
                reservation.abort()
            if fd >= 0:
                os.close(fd)
            with self._lock:
                self._finish_fill_locked(fill)

    def _promote_copy(self, fill: _Fill, fd: int) -> L2Entry | None:
        """Promotes a fill that L2 had no free room for: now room is made (LRU) and the bytes copied."""
        entry = fill.entry
        assert entry is not None  # a fill that loaded has its manifest
        size = max(entry.data_len, 1)
        with (
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapping,
            self.l2.reserve(
                key=fill.key, identity=entry.identity, token_count=entry.token_count, tensors=_decls(entry),
                kind=entry.kind, meta=entry.meta, origin="l3", replace=False,
            ) as reservation,
        ):  # fmt: skip
            with memoryview(mapping) as view:
                for spec in entry.tensors:
                    with view[spec.offset : spec.offset + spec.nbytes] as part:
                        threads = self._copy_threads
                        copy_into(reservation.data, spec.offset, spec.nbytes, part, threads=threads)
            return reservation.commit_if_absent(expected_digest=entry.digest)

    def _promoter(self) -> None:
        """Decides each fill's promotion; one decision's failure never stops the thread."""
        while True:
            fill = self._promote.get()
            if fill is None:
                return
            resolved = False
            try:
                entry = fill.ref
                promote = False
                with self.health.guard(PROMOTER, "promotion check failed"):
                    if self.promotions is not None:
                        promote = self.promotions.consider(entry.digest, entry.token_count, entry.nbytes)
                if not promote:
                    self._count(promotions_declined=1)
                resolved = True
                self._resolve_fill(fill, promote=promote)
                if promote and self.promotions is not None:
                    with self.health.guard(PROMOTER, "settling a promotion failed"):
                        self.promotions.settle(entry.digest)
            except Exception as exc:
                self.health.failed(PROMOTER, "a promotion failed", exc)
            finally:
                if not resolved:  # the fill's memory always goes back
                    with contextlib.suppress(Exception):
                        self._resolve_fill(fill, promote=False)

    # ----------------------------------------------------------------- admin
    def evict_digest(self, digest: str) -> int:
        """Removes every entry with this payload digest from both tiers; returns how many cache keys."""
        with self._lock:
            self.counters.evictions_requested += 1
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

    def _mark_evicted(self, digest: str | None, *, key: str | None = None) -> None:
        """Cancels the work begun before now: of this digest, this key, or of everything."""
        self.clock.evict(digest, key=key)
        if self.writer is not None:
            self.writer.forget(digest, key=key)

    def evict_key(self, key: str) -> int:
        """Removes the entry under one cache key from both tiers; returns 1 if there was one, else 0."""
        with self._lock:
            self.counters.evictions_requested += 1
        found = False
        for _ in range(2):  # as in evict_digest
            self._mark_evicted(None, key=key)
            found = self.l2.remove(key) or found
            if self.l3 is not None:
                found = self.l3.remove(key) or found
        return int(found)

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

    def evict_all(self) -> int:
        """Removes every entry from both tiers (and every durable write still queued)."""
        with self._lock:
            self.counters.evictions_requested += 1
        keys: set[str] = set()
        for _ in range(2):  # as in evict_digest
            self._mark_evicted(None)
            keys.update(e.key for e in self.l2.entries())
            self.l2.clear()
            if self.l3 is not None:
                keys.update(e.key for e, _ in self.l3.entries())
                self.l3.clear()
        return len(keys)

    def entries(self) -> list[dict[str, Any]]:
        now = time.time_ns()
        out = []
        durable = {e.key: e.digest for e, _ in self.l3.entries()} if self.l3 is not None else {}
        seen = set()
        for e, last_use in reversed(self.l2.entries_with_last_use()):
            tier = "l2+l3" if durable.get(e.key) == e.digest else "l2"
            seen.add(e.key)
            out.append(_listing(tier, e, e.file_size, last_use, now))
        if self.l3 is not None:
            for e3, last_use in sorted(self.l3.entries(), key=lambda item: -item[1]):
                if e3.key not in seen:
                    out.append(_listing("l3", e3, e3.data_len, last_use, now))
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            ops = {name: getattr(self.counters, name) for name in self.counters.__slots__}
            ops["fills_in_flight"] = len(self._fills)
            ops["fill_bytes"] = self._fill_bytes
            ops["fill_budget"] = self._fill_budget
        result: dict[str, Any] = {"l2": self.l2.stats().as_dict(), "ops": ops}
        if self.l3 is not None:
            result["l3"] = self.l3.stats().as_dict()
            report = self.l3.last_reconciliation.as_dict()
            report["problems"] = report["problems"][:20]
            result["l3_reconciliation"] = report
        if self.writer is not None:
            result["durable"] = self.writer.stats().as_dict()
        return result

    def housekeeping(self) -> None:
        self.l2.flush_recency()
        self.l2.trim_free(idle_seconds=300.0)
        if self.l3 is not None:
            self.l3.flush_recency()

    def close(self, timeout: float = 10.0) -> None:
        """Lets queued durable writes finish (within ``timeout``), stops the threads, closes the tiers.
        Durable writes left undone keep their markers and are written by the next start."""
        if self.writer is not None:
            self.writer.close(timeout)
        with contextlib.suppress(queue.Full):
            self._promote.put(None, timeout=max(0.1, timeout))
        if self._promoter_thread.is_alive():
            self._promoter_thread.join(timeout=max(1.0, timeout))
        while True:
            try:
                fill = self._promote.get_nowait()
            except queue.Empty:
                break
            if fill is not None:
                self._resolve_fill(fill, promote=False)
        if self.l3 is not None:
            self.l3.close()
        self.l2.close()


def _opened(
    entry: L2Entry | L3Entry, data_offset: int, fd: int, source: str, timings: dict[str, float]
) -> Opened:
    return Opened(
        entry.token_count, entry.kind, entry.digest, entry.meta, entry.tensors, data_offset, entry.data_len,
        fd, source, timings,
    )  # fmt: skip


def _decls(entry: L3Entry) -> list[TensorDecl]:
    return [TensorDecl(s.name, s.dtype, s.shape) for s in entry.tensors]


def _listing(tier: str, entry: L2Entry | L3Ref, size: int, last_use: int, now: int) -> dict[str, Any]:
    return {
        "tier": tier,
        "digest": entry.digest,
        "identity": entry.identity,
        "token_count": entry.token_count,
        "kind": entry.kind,
        "nbytes": entry.nbytes,
        "file_size": size,
        "age_s": max(0.0, (now - entry.created_ns) / 1e9),
        "idle_s": max(0.0, (now - last_use) / 1e9),
        "tensors": entry.tensor_count if isinstance(entry, L3Ref) else len(entry.tensors),
    }
