"""Long-lived background threads that survive any failure of one job, and a record of their health.

Every background thread of the daemon (the L3 writer, the promoter, the Redis link) runs its jobs
through :meth:`Health.guard`: an exception of one job is logged once, counted against the thread (a
metric and a ``doctor`` finding), and the loop goes on with the next job; the job's own ``finally``
blocks release what it held. A thread that ends anyway (a bug outside the guard, ``SystemExit``) is
seen by :meth:`Health.healthy`: ``status``/``doctor``/``status --check`` report it, and the server
stops feeding systemd's watchdog so the service is restarted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .errors import SkippydError

__all__ = ["Health", "Pacer", "ThreadHealth", "Wakeable"]

log = logging.getLogger("skippyd.workers")


@dataclass(slots=True)
class ThreadHealth:
    """One background thread as ``stats`` reports it."""

    alive: bool = True
    errors: int = 0
    last_error: str = ""

    def to_wire(self) -> dict[str, object]:
        return {"alive": self.alive, "errors": self.errors, "last_error": self.last_error}


@dataclass(slots=True)
class _Entry:
    thread: threading.Thread | None = None
    errors: int = 0
    last_error: str = ""
    logged: set[str] = field(default_factory=set)  # exception types already logged with a traceback
    stopped: bool = False  # ended on purpose (shutdown): not a failure


class Health:
    """Which background threads run, and what their jobs raised. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, _Entry] = {}

    def start(self, name: str, target: Callable[[], None]) -> threading.Thread:
        """Starts ``target`` as the daemon thread ``name`` and watches it."""
        thread = threading.Thread(target=self._run, args=(name, target), name=name, daemon=True)
        with self._lock:
            self._threads.setdefault(name, _Entry()).thread = thread
        thread.start()
        return thread

    def _run(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # logged and recorded here; the thread ends (dead() reports it)
            log.critical("background thread %s died", name, exc_info=exc)
            self._record(name, exc)
            return
        with self._lock:
            self._threads[name].stopped = True

    @contextlib.contextmanager
    def guard(self, name: str, what: str) -> Iterator[None]:
        """Runs one job of thread ``name``: any :class:`Exception` it raises is logged, counted and
        swallowed, so the thread goes on with its next job."""
        try:
            yield
        except Exception as exc:
            self.failed(name, what, exc)

    def failed(self, name: str, what: str, exc: BaseException) -> None:
        """Counts a failed job of ``name``. A typed failure is one warning line; anything else is a bug,
        logged with its traceback the first time each exception type is seen."""
        first = self._record(name, exc)
        if isinstance(exc, SkippydError | OSError):
            log.warning("%s: %s", what, exc)
        elif first:
            log.error("%s (%s: %s)", what, type(exc).__name__, exc, exc_info=exc)
        else:
            log.error("%s (%s: %s; traceback logged before)", what, type(exc).__name__, exc)

    def _record(self, name: str, exc: BaseException) -> bool:
        with self._lock:
            entry = self._threads.setdefault(name, _Entry())
            entry.errors += 1
            entry.last_error = f"{type(exc).__name__}: {exc}"[:300]
            kind = type(exc).__name__
            first = kind not in entry.logged
            entry.logged.add(kind)
            return first

    def dead(self) -> list[str]:
        """Threads that were started and ended without being asked to."""
        with self._lock:
            return sorted(
                name
                for name, entry in self._threads.items()
                if entry.thread is not None and not entry.thread.is_alive() and not entry.stopped
            )

    @property
    def healthy(self) -> bool:
        return not self.dead()

    def snapshot(self) -> dict[str, ThreadHealth]:
        dead = set(self.dead())
        with self._lock:
            return {
                name: ThreadHealth(name not in dead and not entry.stopped, entry.errors, entry.last_error)
                for name, entry in sorted(self._threads.items())
            }


class Wakeable:
    """A background thread that runs one job each time it is woken, or every ``interval`` seconds, each
    job guarded by :meth:`Health.guard` (the L2 reserve, the digester). Subclasses name the thread and
    the job.

    A job returns when it wants to run again at the latest: a number of seconds (``0.0``: at once; what
    a job that stopped for a put's quiet window returns is the window's remaining time, never a fixed
    poll), or None to wait for the next :meth:`wake` or ``interval``. A wake-up that comes while a job
    runs is kept: the next wait returns at once."""

    thread_name = ""
    failure = ""  # what the log says when a job fails

    def __init__(self, health: Health, *, interval: float) -> None:
        self.health = health
        self.interval = interval
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def job(self) -> float | None:
        raise NotImplementedError

    def start_thread(self) -> None:
        self._thread = self.health.start(self.thread_name, self._run)

    def wake(self) -> None:
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        again: float | None = None
        while not self._stop.is_set():
            self._wake.wait(self.interval if again is None else again)
            self._wake.clear()  # (before the job: a wake-up during it makes the next wait return at once)
            if self._stop.is_set():
                break
            again = None
            with self.health.guard(self.thread_name, self.failure):
                again = self.job()

    def stop_thread(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


class Pacer:
    """Paces background work two ways (0 turns either off): ``rate`` bytes per second, and a ``share`` of
    the wall clock (a unit of work that took ``d`` seconds is followed by ``d * (1 - share) / share``
    seconds of rest, so on a loaded machine, where the same work takes longer, the work backs off). A
    token bucket that holds ``burst`` seconds of work: over any span of ``t`` seconds, work that began in
    it adds up to at most ``rate * (t + burst)`` bytes (plus the unit that began last). The burst only
    makes up for a thread the scheduler woke late; it never lets work run ahead for longer. Not
    thread-safe: one thread's work."""

    def __init__(self, rate: int, *, share: float = 0.0, burst: float = 0.02) -> None:
        self.rate = max(0, int(rate))
        self.share = min(1.0, max(0.0, share))
        self.burst = burst
        self._next = 0.0  # when the bucket is empty enough for the next unit

    def delay(self) -> float:
        """Seconds until the next unit of work may begin (0.0: now)."""
        return max(0.0, self._next - self.burst - time.monotonic())

    def spent(self, nbytes: int, began: float) -> None:
        """``nbytes`` of work began at ``began`` (``time.monotonic()``) and ended now."""
        cost = nbytes / self.rate if self.rate else 0.0
        if 0.0 < self.share < 1.0:
            cost = max(cost, (time.monotonic() - began) / self.share)
        self._next = max(self._next, began) + cost
