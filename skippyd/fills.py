"""L3 fills: an L3 entry read and verified into memory a restore can serve, shared, then promoted or not.

* **One load per object.** Concurrent restores that need the same L3 object join one :class:`Fill`:
  the first loads it, the others wait for that load and each gets its own leased descriptor.
* **Where the bytes go.** Into free L2 memory (a reservation that never evicts an entry: whether the
  entry earns a place in L2 is the promoter's decision), or, when L2 has no free room, into a memfd that
  is sealed read-only once loaded. Memfd fills are RAM outside the L2 budget, so they are capped by the
  fill budget: one fill may always run, however large; past the cap a restore is told :class:`Busy` and
  serves a shorter prefix. Block reads from L3 that L2 has no free slots for land in memfds too and
  take their share of the same budget (:meth:`FillTable.charge`): past it, a get serves a shorter run.
* **Promotion.** After each fill a bounded queue hands it to the promoter thread, which asks the
  promotion policy (second hit within the window, counted in Redis across the scope, or locally). Yes
  publishes the loaded L2 memory as an entry (no second copy; a memfd fill is copied into room made by
  LRU) and settles the observation; no gives the memory back.
* **No restore loses its bytes.** A fill counts the restores between joining it and holding their own
  descriptor (``users``); the promoter's decision is carried out once the last of them is done.
* **Evictions win.** A fill takes its number on the eviction clock when it begins; a promotion is
  skipped, or withdrawn if the eviction raced its commit, when its digest or key was evicted since.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from .errors import Busy, CorruptEntry, NoSpace, NotFound, SkippydError, TooLarge
from .evictions import EvictionClock
from .l2 import L2Tier, Reservation, copy_into
from .l3 import L3Ref, L3Store, Manifest
from .payload import Entry, TensorDecl
from .shm import memfd, reopen_readonly, seal_readonly
from .workers import Health

__all__ = ["PROMOTER", "FillStats", "FillTable", "Loaded", "PromotionPolicy"]

log = logging.getLogger("skippyd.fills")

PROMOTER = "skippyd-promoter"


class PromotionPolicy(Protocol):
    """Whether an L3 fill earns a place in L2 (see :class:`skippyd.cluster.coordination.Promotions`)."""

    def consider(self, digest: str, token_count: int, payload_bytes: int, /) -> bool: ...

    def settle(self, digest: str, /) -> None: ...


@dataclass(slots=True)
class FillStats:
    fills: int = 0
    fill_waits: int = 0  # restores that joined a fill another restore began
    fills_refused: int = 0  # over the fill budget: a shorter prefix was served instead
    fills_in_flight: int = 0
    fill_bytes: int = 0  # memfd memory held now
    fill_budget: int = 0
    promotions: int = 0
    promotions_declined: int = 0
    promotions_dropped: int = 0  # the promotion queue was full: the fill was given back


@dataclass(frozen=True, slots=True)
class Loaded:
    """A restore's share of a fill: its own leased fd of the loaded bytes."""

    fd: int
    data_offset: int
    manifest: Manifest
    fill_ms: float


@dataclass
class Fill:
    """One L3 entry being loaded or loaded, shared by every restore that wants it."""

    ref: L3Ref  # what the first restore looked up
    seq: int  # its eviction-clock number: a later eviction of its digest or key wins
    done: Future[None] = field(default_factory=Future)
    manifest: Manifest | None = None  # read by the leader
    reservation: Reservation | None = None
    fd: int = -1  # a sealed memfd when L2 had no free room
    memfd_bytes: int = 0  # charged to the fill budget while the memfd is held
    fill_ms: float = 0.0
    users: int = 0
    resolution: str | None = None  # "commit" | "abort"
    released: bool = False

    @property
    def key(self) -> str:
        return self.ref.entry.key


class FillTable:
    """The fills in flight, their memory budget, and the promoter thread. Thread-safe."""

    def __init__(
        self,
        l2: L2Tier,
        l3: L3Store,
        clock: EvictionClock,
        health: Health,
        *,
        promotions: PromotionPolicy | None = None,
        budget: int = 2 << 30,
        queue_size: int = 16,
        copy_threads: int = 2,
    ) -> None:
        self.l2 = l2
        self.l3 = l3
        self.clock = clock
        self.health = health
        self.promotions = promotions
        self._budget = budget
        self._copy_threads = copy_threads
        self._lock = threading.Lock()
        # by the whole L3 reference: two keys may share one object (the same bytes) but not a tensor
        # table, meta or token count, and a fill loads one key's entry
        self._fills: dict[L3Ref, Fill] = {}
        self._bytes = 0
        self._stats = FillStats(fill_budget=budget)
        self._queue: queue.Queue[Fill | None] = queue.Queue(maxsize=max(1, queue_size))
        self._thread = health.start(PROMOTER, self._promoter)

    # ------------------------------------------------------------------ restores
    def open(self, ref: L3Ref, seq: int) -> Loaded:
        """The L3 entry ``ref`` loaded (by this call or a concurrent one) and leased to the caller.

        Raises what the load raised for everyone who waited on it: :class:`CorruptEntry` (quarantined),
        :class:`NotFound` (gone or rewritten since it was looked up), :class:`Busy` (over the budget).
        """
        with self._lock:
            fill = self._fills.get(ref)
            leader = fill is None
            if fill is None:
                fill = self._fills[ref] = Fill(ref, self.clock.begin(since=seq))
            else:
                self._stats.fill_waits += 1
            fill.users += 1
        try:
            if leader:
                self._load(fill)
            fill.done.result()  # the leader's CorruptEntry/NotFound/Busy reaches every waiter
            fd, data_offset = self._reader(fill)
            assert fill.manifest is not None
            return Loaded(fd, data_offset, fill.manifest, fill.fill_ms)
        finally:
            self._leave(fill)

    def _load(self, fill: Fill) -> None:
        """Reads and verifies the entry into free L2 memory (never evicting for it), or into a sealed memfd
        when L2 has no free room; then queues the promotion decision."""
        began = time.perf_counter()
        try:
            manifest = fill.manifest = self.l3.manifest(fill.key, expected=fill.ref)
            entry = manifest.entry
            try:
                fill.reservation = self.l2.reserve(
                    key=fill.key, identity=entry.identity, token_count=entry.token_count,
                    tensors=_decls(entry), kind=entry.kind, meta=entry.meta, origin="l3", evict=False,
                    replace=False,
                )  # fmt: skip
                if fill.reservation.entry.data_len != entry.data_len:  # pragma: no cover - one layout rule
                    raise CorruptEntry("L3 entry layout differs from L2's")
                self.l3.load_into(fill.key, fill.reservation.data, expected=fill.ref)
            except (TooLarge, NoSpace):
                if fill.reservation is not None:
                    fill.reservation.abort()
                    fill.reservation = None
                size = max(entry.data_len, 1)
                if not self.charge(size):
                    raise Busy("L3 restores in flight hold the whole fill budget") from None
                fill.memfd_bytes = size  # given back by _finish_locked
                fill.fd = self._load_memfd(fill)
            fill.fill_ms = (time.perf_counter() - began) * 1e3
            with self._lock:
                self._stats.fills += 1
        except BaseException as exc:
            if fill.reservation is not None:
                fill.reservation.abort()
                fill.reservation = None
            with self._lock:
                self._retire_locked(fill)
                self._finish_locked(fill)
            fill.done.set_exception(exc)
            return
        fill.done.set_result(None)
        try:
            self._queue.put_nowait(fill)
        except queue.Full:
            with self._lock:
                self._stats.promotions_dropped += 1
            self._resolve(fill, promote=False)

    def _load_memfd(self, fill: Fill) -> int:
        """The entry in anonymous memory, sealed read-only once loaded (clients get O_RDONLY fds)."""
        assert fill.manifest is not None
        length = fill.manifest.entry.data_len
        size = max(length, 1)
        fd = memfd("skippyd-l3-fill", size, seal=False)
        try:
            with (
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mapping,
                memoryview(mapping) as view,
                view[:length] as dest,  # released here even when an exception keeps the frames
            ):
                self.l3.load_into(fill.key, dest, expected=fill.ref)
            seal_readonly(fd)  # our writable mapping is gone: from now on nobody can change a byte
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _reader(self, fill: Fill) -> tuple[int, int]:
        with self._lock:
            if fill.reservation is not None:
                return fill.reservation.open_reader(), fill.reservation.data_offset
            if fill.fd >= 0:
                return reopen_readonly(fill.fd), 0
        raise NotFound("the loaded L3 entry was already released")  # pragma: no cover - users guard it

    # ------------------------------------------------------------------ the life of a fill
    def _finish_locked(self, fill: Fill) -> None:
        """The fill's memory is given back (or now L2's): its budget share and its clock number end."""
        self._bytes -= fill.memfd_bytes
        fill.memfd_bytes = 0
        self.clock.end(fill.seq)

    def _retire_locked(self, fill: Fill) -> None:
        """No restore joins this fill any more (it keeps its memory until :meth:`_release`)."""
        fill.released = True
        if self._fills.get(fill.ref) is fill:
            del self._fills[fill.ref]

    def _leave(self, fill: Fill) -> None:
        with self._lock:
            fill.users -= 1
            ready = fill.users == 0 and fill.resolution is not None and not fill.released
            if ready:
                self._retire_locked(fill)
        if ready:
            self._release(fill)

    def _resolve(self, fill: Fill, *, promote: bool) -> None:
        with self._lock:
            fill.resolution = "commit" if promote else "abort"
            ready = fill.users == 0 and not fill.released
            if ready:
                self._retire_locked(fill)
        if ready:
            self._release(fill)

    def _cancelled(self, fill: Fill) -> bool:
        return self.clock.cancelled(fill.ref.entry.digest, fill.seq, fill.key)

    def _release(self, fill: Fill) -> None:
        reservation, fill.reservation = fill.reservation, None
        fd, fill.fd = fill.fd, -1
        digest = fill.ref.entry.digest
        promote = fill.resolution == "commit" and not self._cancelled(fill)
        if promote:  # a newer capture of the key may have retired these bytes
            durable = self.l3.get(fill.key)
            promote = durable is not None and durable.entry.digest == digest
        try:
            committed: Entry | None = None
            if promote and reservation is not None:
                committed = reservation.commit_if_absent(expected_digest=digest)
                reservation = None
            elif promote and fd >= 0:
                committed = self._promote_copy(fill, fd)
            if committed is not None:
                with self._lock:
                    self._stats.promotions += 1
                # an eviction that marked this digest after the check above may have swept L2 before
                # the commit: take the promoted entry back out
                if self._cancelled(fill):
                    self.l2.remove(committed.key, digest=committed.digest)
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
                self._finish_locked(fill)

    def _promote_copy(self, fill: Fill, fd: int) -> Entry | None:
        """Promotes a fill that L2 had no free room for: now room is made (LRU) and the bytes copied."""
        assert fill.manifest is not None
        entry = fill.manifest.entry
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
                        copy_into(
                            reservation.data, spec.offset, spec.nbytes, part, threads=self._copy_threads
                        )
            return reservation.commit_if_absent(expected_digest=entry.digest)

    def _promoter(self) -> None:
        """Decides each fill's promotion; one decision's failure never stops the thread."""
        while True:
            fill = self._queue.get()
            if fill is None:
                return
            resolved = False
            try:
                entry = fill.ref.entry
                promote = False
                with self.health.guard(PROMOTER, "promotion check failed"):
                    if self.promotions is not None:
                        promote = self.promotions.consider(entry.digest, entry.token_count, entry.nbytes)
                if not promote:
                    with self._lock:
                        self._stats.promotions_declined += 1
                resolved = True
                self._resolve(fill, promote=promote)
                if promote and self.promotions is not None:
                    with self.health.guard(PROMOTER, "settling a promotion failed"):
                        self.promotions.settle(entry.digest)
            except Exception as exc:
                self.health.failed(PROMOTER, "a promotion failed", exc)
            finally:
                if not resolved:  # the fill's memory always goes back
                    with contextlib.suppress(Exception):
                        self._resolve(fill, promote=False)

    # ------------------------------------------------------------------ the budget, shared with block reads
    def charge(self, size: int) -> bool:
        """Takes ``size`` bytes of the fill budget for memory outside L2 (a memfd fill, a block read into a
        memfd): one charge may always run, however large; False (counted as refused) past the budget."""
        with self._lock:
            if self._bytes and self._bytes + size > self._budget:
                self._stats.fills_refused += 1
                return False
            self._bytes += size
            return True

    def refund(self, size: int) -> None:
        with self._lock:
            self._bytes -= size

    # ------------------------------------------------------------------ admin
    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._fills)

    def stats(self) -> FillStats:
        with self._lock:
            stats = FillStats(**{name: getattr(self._stats, name) for name in FillStats.__slots__})
            stats.fills_in_flight = len(self._fills)
            stats.fill_bytes = self._bytes
            stats.fill_budget = self._budget
            return stats

    def close(self, timeout: float = 10.0) -> None:
        """Stops the promoter; fills still waiting for a decision give their memory back."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=max(0.1, timeout))
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, timeout))
        while True:
            try:
                fill = self._queue.get_nowait()
            except queue.Empty:
                break
            if fill is not None:
                self._resolve(fill, promote=False)


def _decls(entry: Entry) -> list[TensorDecl]:
    return [TensorDecl(s.name, s.dtype, s.shape) for s in entry.tensors]
