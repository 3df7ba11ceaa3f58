"""Durable writes: L2 entries copied into L3 in the background, with their intent kept across crashes.

A durable capture is answered as soon as its L2 entry is committed; its L3 copy is written by one
background thread. What a reply promises (``durability`` in the capture reply, docs/protocol.md):

* ``"written"``: the entry's bytes and manifest were fsynced into L3 before the reply
  (``durable="sync"``, or L3 already held the same bytes under the key); they survive kill -9 and a
  reboot.
* ``"queued"``: a write is queued with a lease on the entry's bytes. It is written within moments;
  a daemon crash does not lose it (below), a reboot before it is written does.
* ``"deferred"``: L3 cannot take it now (read-only below its free-space floor, its queue full, its
  writer down); the intent is kept and the write happens once L3 can take it, unless the entry leaves
  L2 first.
* ``"none"``: not durable (``durable=False``, or no L3).

**Intent survives a crash.** Before a durable capture's entry becomes visible, a marker
``<l2 dir>/pending/<key>`` holding its digest is written (tmpfs: a daemon crash keeps it, a reboot
does not). The marker goes once the write is done, superseded or cancelled. At start, every marker
whose entry L2 re-adopted and L3 lacks goes into the backlog, and is written within seconds.

**The newest capture of a key wins.** A write of a key that was captured again meanwhile is skipped
(asked again under L3's lock right before the manifest goes into place), and an L3 copy written just
as the newer capture arrived is removed. An eviction cancels the writes that began before it
(:class:`~skippyd.evictions.EvictionClock`).

**Bounded.** At most ``queue_size`` writes hold leases on L2 memory; past that, writes wait in the
backlog as a key and a digest each (no lease: an entry evicted from L2 before its turn is lost, and
counted). One job's failure never stops the thread (:class:`~skippyd.workers.Health`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from .errors import NoSpace, NotFound, SkippydError, TooLarge
from .evictions import EvictionClock
from .files import private_dirs, remove
from .keys import is_hex_digest
from .l2 import L2Tier
from .l3 import L3Store
from .payload import Entry
from .shm import new_name
from .workers import Health

__all__ = ["DURABILITY", "DurableStats", "DurableWriter", "PendingMarks"]

log = logging.getLogger("skippyd.durable")

THREAD = "skippyd-l3-writer"
#: What a capture reply may say about its durable copy (docs/protocol.md).
DURABILITY = ("written", "queued", "deferred", "none")
_IDLE_WAIT_S = 0.5
_RETRY_AFTER_NO_SPACE_S = (5.0, 60.0)  # the backlog waits this long after L3 ran out of room, doubling


class PendingMarks:
    """One small file per durable write not yet done: ``<key>`` holding the digest it must write.

    Kept on the L2 tmpfs, beside the entries they name: a daemon crash keeps both, a reboot neither.
    Names are keys the daemon computed (hex digests), never client text.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        private_dirs(directory)

    def mark(self, key: str, digest: str) -> None:
        """Writes the marker; a full tmpfs is :class:`NoSpace` (the capture is refused, nothing is left)."""
        temp = self.directory / new_name(".tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                if os.write(fd, digest.encode()) != len(digest):
                    raise OSError(errno.ENOSPC, "short write")
            finally:
                os.close(fd)
            os.rename(temp, self.directory / key)
        except OSError as exc:
            remove(temp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(
                    f"no room on the L2 tmpfs for a durable write's intent: {exc.strerror}"
                ) from exc
            raise

    def named(self, key: str) -> str | None:
        """The digest the marker of ``key`` names, or None."""
        return self._read(self.directory / key)

    def clear(self, key: str, digest: str | None = None) -> None:
        """Removes the marker of ``key`` (only if it still names ``digest``, when given)."""
        path = self.directory / key
        found = self._read(path)  # None: no marker there (or not a file: left for the start-up clean)
        if found is None or (digest is not None and found != digest):
            return
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def load(self, *, clean: bool = False) -> dict[str, str]:
        """Every marker (key -> digest). With ``clean`` (at start, when no marker is being written)
        anything that is not a marker is removed."""
        found: dict[str, str] = {}
        for child in self.directory.iterdir():
            digest = self._read(child) if is_hex_digest(child.name) else None
            if digest is not None:
                found[child.name] = digest
            elif clean:
                remove(child)
        return found

    @staticmethod
    def _read(path: Path) -> str | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError:
            return None
        try:
            text = os.read(fd, 128).decode(errors="replace")
        except OSError:  # a directory, or unreadable: not a marker
            return None
        finally:
            os.close(fd)
        return text if is_hex_digest(text) else None


@dataclass(slots=True)
class DurableStats:
    queued: int = 0  # writes queued with a lease
    deferred: int = 0  # writes that went to the backlog (queue full, L3 read-only, writer down)
    written: int = 0
    skipped: int = 0  # superseded by a newer capture, cancelled by an eviction, or already in L3
    failed: int = 0
    lost: int = 0  # the entry left L2 before its deferred write could run
    recovered: int = 0  # intents found at start (written afterwards from the backlog)
    sync_waits: int = 0
    sync_timeouts: int = 0
    queue_depth: int = 0
    backlog: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class _Job:
    entry: Entry
    fd: int  # a lease on the entry's bytes (closed when the job ends)
    data_offset: int  # where they start in that file
    seq: int  # its eviction-clock number; the clock counts it outstanding until the job ends
    waiters: list[Future[str]] = field(default_factory=list)  # durable="sync" captures: their durability


class DurableWriter:
    """The L3 writer thread and its queue, backlog and markers. Thread-safe."""

    def __init__(
        self,
        l2: L2Tier,
        l3: L3Store,
        clock: EvictionClock,
        health: Health,
        *,
        queue_size: int = 64,
        marks: PendingMarks | None = None,
    ) -> None:
        self.l2 = l2
        self.l3 = l3
        self.clock = clock
        self.health = health
        self.marks = marks or PendingMarks(l2.directory / "pending")
        self._queue_size = max(1, queue_size)
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._opening = 0  # backlog items taken out and being opened (neither backlog nor running)
        self._backlog: dict[str, str] = {}  # key -> digest, in the order they were deferred
        self._newest: dict[str, str] = {}  # key -> digest of its newest capture while a write of it waits
        self._pending: collections.Counter[str] = collections.Counter()  # key -> queued jobs + backlog
        self._stats = DurableStats()
        self._stop = False
        self._retry_backlog_at = 0.0
        self._retry_wait = _RETRY_AFTER_NO_SPACE_S[0]
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = self.health.start(THREAD, self._run)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def recover(self) -> int:
        """Puts every durable write a crash left undone into the backlog; returns how many."""
        found = 0
        for key, digest in self.marks.load(clean=True).items():
            entry = self.l2.peek(key)
            stored = self.l3.get(key)
            if (
                entry is None
                or entry.digest != digest
                or (stored is not None and stored.entry.digest == digest)
            ):
                self.marks.clear(key, digest)
                continue
            with self._cond:
                self._defer_locked(key, digest)
                self._stats.recovered += 1
            found += 1
        if found:
            log.info("%d durable write(s) left undone by an earlier run will be written now", found)
            with self._cond:
                self._cond.notify()
        return found

    def close(self, timeout: float = 10.0) -> None:
        """Lets queued writes finish for up to ``timeout`` seconds, then stops; what is left keeps its
        marker and is written by the next start."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._jobs or self._running is not None) and self.alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 0.1))
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        with self._cond:
            jobs, self._jobs = list(self._jobs), collections.deque()
        for job in jobs:  # unwritten: their markers stay for the next start
            self._finish(job, written=False)

    # ------------------------------------------------------------------ the capture side
    def intend(self, key: str, digest: str, *, durable: bool) -> None:
        """A capture of ``key`` with ``digest`` is about to become visible (called before it is).

        Records the intent of a durable one (its marker) and lets it supersede older pending writes of
        the key; a non-durable capture withdraws the intent of an older durable one.
        """
        with self._cond:
            if durable:  # first: a full tmpfs refuses the capture here, before anything older is superseded
                self.marks.mark(key, digest)
            else:
                self.marks.clear(key)
            if self._pending[key]:
                self._newest[key] = digest
            if key in self._backlog:
                self._drop_backlog_locked(key)

    def submit(self, entry: Entry, seq: int, *, sync: bool = False, timeout: float = 20.0) -> str:
        """Queues the durable write of a committed entry; returns its durability (see module doc).

        ``seq`` is the eviction-clock number the capture began under. With ``sync`` it returns once the
        write is fsynced, or after ``timeout`` seconds (then ``"queued"``: the write goes on).
        """
        deadline = time.monotonic() + timeout
        if self._holds(entry):
            self._clear_mark(entry.key, entry.digest)
            return "written"
        if not self.alive or self.l3.readonly:
            self.defer(entry.key, entry.digest)
            return "deferred"
        waiter: Future[str] | None = Future() if sync else None
        with self._cond:
            while sync and len(self._jobs) >= self._queue_size and self.alive and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 0.1))
            if len(self._jobs) >= self._queue_size or self._stop:
                self._defer_locked(entry.key, entry.digest)
                self._cond.notify()
                return "deferred"
            # Registered before the lease is taken: a newer capture of the key that announces itself
            # (intend) from here on supersedes this write, however soon after it publishes.
            if not self._pending[entry.key]:
                self._newest[entry.key] = entry.digest
            self._pending[entry.key] += 1
        held = self.l2.hold(entry.key, hit=False)  # the lease keeps the bytes even if L2 evicts the entry
        if held is None or held.entry.digest != entry.digest:
            if held is not None:
                os.close(held.fd)
            with self._cond:
                self._release_key_locked(entry.key)
            self._clear_mark(entry.key, entry.digest)  # (a newer capture's marker names its own digest)
            return "none"  # replaced or evicted already: a newer capture (or an eviction) decided
        current = held.entry
        # an eviction since the capture began cancels the write too
        job = _Job(current, held.fd, held.data_offset, self.clock.begin(since=seq))
        if waiter is not None:
            job.waiters.append(waiter)
        with self._cond:
            self._jobs.append(job)
            self._stats.queued += 1
            if (
                self._newest.get(current.key) == current.digest
                and self.marks.named(current.key) != current.digest
            ):
                # two captures of the key announced themselves before either published: the marker names
                # the other one, this is the one L2 holds and the write queued; a crash must keep it
                with contextlib.suppress(OSError):
                    self.marks.mark(current.key, current.digest)
            self._cond.notify()
        if waiter is None:
            return "queued"
        with self._cond:
            self._stats.sync_waits += 1
        try:
            return waiter.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            with self._cond:
                self._stats.sync_timeouts += 1
            return "queued"

    def withdraw(self, key: str, digest: str) -> None:
        """A capture that recorded its intent failed before it was published: the intent goes."""
        self._clear_mark(key, digest)

    def _clear_mark(self, key: str, digest: str) -> None:
        with self._cond:
            self.marks.clear(key, digest)

    def defer(self, key: str, digest: str) -> None:
        """Keeps a durable write for later (its marker is already written)."""
        with self._cond:
            self._defer_locked(key, digest)
            self._cond.notify()

    def forget(self, digest: str | None, *, key: str | None = None) -> None:
        """An eviction: drops deferred writes and markers of ``digest`` (of ``key``; of everything with
        neither). Queued jobs are cancelled by the eviction clock when their turn comes."""

        def evicted(k: str, d: str) -> bool:
            return k == key if key is not None else digest is None or d == digest

        with self._cond:
            for pending_key, pending in list(self._backlog.items()):
                if evicted(pending_key, pending):
                    self._drop_backlog_locked(pending_key)
                    self.marks.clear(pending_key, pending)
        for marked_key, marked in self.marks.load().items():
            if evicted(marked_key, marked):
                self._clear_mark(marked_key, marked)

    def stats(self) -> DurableStats:
        with self._cond:
            stats = DurableStats(**self._stats.as_dict())
            stats.queue_depth = len(self._jobs) + (self._running is not None)
            stats.backlog = len(self._backlog)
            return stats

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Waits until nothing is queued, running or deferred (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (
                self._jobs
                or self._running is not None
                or self._opening
                or (self._backlog and not self.l3.readonly)
            ):
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return False
                self._cond.wait(timeout=min(left, 0.05))
            return True

    # ------------------------------------------------------------------ bookkeeping (lock held)
    def _defer_locked(self, key: str, digest: str) -> None:
        if key in self._backlog:
            self._drop_backlog_locked(key)
        self._backlog[key] = digest
        self._pending[key] += 1
        self._newest[key] = digest
        self._stats.deferred += 1

    def _drop_backlog_locked(self, key: str) -> None:
        self._backlog.pop(key, None)
        self._release_key_locked(key)

    def _release_key_locked(self, key: str) -> None:
        self._pending[key] -= 1
        if self._pending[key] <= 0:
            del self._pending[key]
            self._newest.pop(key, None)

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            written = False
            try:
                written = self._write(job)
            except Exception as exc:  # one job's failure: counted, logged, and the thread goes on
                with self._cond:
                    self._stats.failed += 1
                self.health.failed(THREAD, "durable write failed", exc)
            finally:
                self._finish(job, written=written)

    def _next_job(self) -> _Job | None:
        """The next queued job, else one from the backlog (opened now), else waits; None to stop."""
        while True:
            with self._cond:
                while not self._jobs and not self._stop and not self._backlog_ready_locked():
                    self._cond.wait(timeout=_IDLE_WAIT_S)
                if self._stop:
                    return None
                if self._jobs:
                    self._running = self._jobs.popleft()
                    return self._running
                key = next(iter(self._backlog))
                digest = self._backlog.pop(key)  # its count in _pending passes to the job
                self._opening += 1
            job: _Job | None = None
            again = False
            try:
                job = self._open_deferred(key, digest)
            except Exception as exc:  # (no lease to be had now): back to the backlog, the thread lives on
                again = True
                log.warning("a deferred durable write could not open its entry (%s); it is tried again", exc)
            finally:
                with self._cond:
                    self._opening -= 1
                    if again and key not in self._backlog:  # (unless a newer capture deferred the key)
                        self._backlog[key] = digest
                        self._retry_backlog_at = time.monotonic() + 1.0
                    elif job is None:
                        self._release_key_locked(key)
                    else:
                        self._running = job
                    self._cond.notify_all()
            if job is not None:
                return job

    def _backlog_ready_locked(self) -> bool:
        if not self._backlog or time.monotonic() < self._retry_backlog_at:
            return False
        if self.l3.readonly:
            self._retry_backlog_at = time.monotonic() + 1.0
            return False
        return True

    def _open_deferred(self, key: str, digest: str) -> _Job | None:
        seq = self.clock.begin()  # before the lease: an eviction between the two cancels the write
        try:
            held = self.l2.hold(key, hit=False)
        except BaseException:
            self.clock.end(seq)
            raise
        if held is None or held.entry.digest != digest:
            self.clock.end(seq)
            if held is not None:
                os.close(held.fd)
            self._clear_mark(key, digest)
            with self._cond:
                self._stats.lost += 1
            log.warning("a deferred durable write was lost: its entry left L2 before L3 could take it")
            return None
        return _Job(held.entry, held.fd, held.data_offset, seq)

    def _wanted(self, job: _Job) -> bool:
        entry = job.entry
        with self._cond:
            newest = self._newest.get(entry.key, entry.digest)
        return newest == entry.digest and not self.clock.cancelled(entry.digest, job.seq, entry.key)

    def _write(self, job: _Job) -> bool:
        entry = job.entry
        if not self._wanted(job):
            return False
        try:
            if entry.data_len == 0:
                return self.l3.write(entry, memoryview(b""), wanted=lambda: self._wanted(job))
            with mmap.mmap(
                job.fd, entry.data_len, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=job.data_offset
            ) as mapping:
                view = memoryview(mapping)
                try:
                    # asked again right before the entry becomes visible in L3: an eviction or a newer
                    # capture that arrived during the write wins
                    return self.l3.write(entry, view, wanted=lambda: self._wanted(job))
                finally:
                    view.release()
        except NoSpace:
            with self._cond:  # kept: written once the disk has room again
                self._defer_locked(entry.key, entry.digest)
                self._retry_backlog_at = time.monotonic() + self._retry_wait
                self._retry_wait = min(self._retry_wait * 2, _RETRY_AFTER_NO_SPACE_S[1])
            raise
        except (TooLarge, NotFound):
            self._clear_mark(entry.key, entry.digest)  # L3 can never hold it: the intent is void
            raise

    def _holds(self, entry: Entry) -> bool:
        """L3 holds these bytes under the key, on disk for good (never a rename whose fsync is to come)."""
        return self.l3.holds_durably(entry.key, entry.digest)

    def _finish(self, job: _Job, *, written: bool) -> None:
        entry = job.entry
        with contextlib.suppress(OSError):
            os.close(job.fd)
        newer = False
        outcome = "queued"  # stopping: the intent stays and the next start writes it
        try:
            with self._cond:  # markers change under the lock: intend() of a newer capture cannot interleave
                newer = self._newest.get(entry.key, entry.digest) != entry.digest
                redo = False
                if written:  # L3 has room (again): the backlog need not wait any longer
                    self._stats.written += 1
                    self._retry_wait = _RETRY_AFTER_NO_SPACE_S[0]
                    self._retry_backlog_at = 0.0
                elif not self._stop:
                    redo = entry.key in self._backlog  # deferred again after a failure
                    if not redo:
                        self._stats.skipped += 1
                self._release_key_locked(entry.key)
                if written or (not self._stop and not redo):  # written, superseded or cancelled
                    self.marks.clear(entry.key, entry.digest)
            if newer:  # captured again while this write ran: the newer one wins
                self.l3.remove(entry.key, digest=entry.digest)
                outcome = "none"
            elif written or self._holds(entry):  # written now, or L3 had these bytes already
                outcome = "written"
            elif redo:
                outcome = "deferred"
            elif not self._stop:
                outcome = "none"  # evicted (or superseded) while queued: nothing of it is kept
        except (OSError, SkippydError) as exc:
            self.health.failed(THREAD, "finishing a durable write failed", exc)
        finally:
            self.clock.end(job.seq)
            with self._cond:
                if self._running is job:
                    self._running = None
                self._cond.notify_all()
            for waiter in job.waiters:
                if not waiter.done():
                    waiter.set_result(outcome)
