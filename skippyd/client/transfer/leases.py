"""The leases of copies in flight (client side): the reply descriptors a device copy reads through stay
open until its CUDA event has passed, then a thread of skippyd's closes them, so the daemon may reuse
that memory as soon as the copy has landed and never before."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
from collections import Counter, deque
from typing import Any

from .cuda import _device_index_of, _make_current

__all__: list[str] = []

log = logging.getLogger("skippyd.client.transfer")

_MAX_PENDING = 256  # copies in flight (their leases held) before a new one waits for the oldest


def _fd_budget() -> int:
    """Descriptors the copies in flight may hold together: a quarter of this process's open-files limit,
    at least 64 (each is a duplicate of a reply's, up to 64 a reply; the engine opens files of its own)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, (1 << 20 if soft == resource.RLIM_INFINITY else soft) // 4)


class _Leases:
    """The leases of copies in flight: a thread waits for each copy's event, then closes its descriptors,
    so the daemon may reuse the memory as soon as the copy has landed (and never before). At most
    ``_MAX_PENDING`` copies are held, and together at most :func:`_fd_budget` descriptors; past either, a
    new one waits for the oldest (:meth:`room`, before its descriptors are duplicated)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Any, list[int], set[int], int | None]] = deque()
        self._held = 0
        self._fds = 0  # descriptors held by the copies in flight
        self._fd_budget = _fd_budget()
        self._reading: Counter[int] = Counter()  # registration address -> copies in flight reading it
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def hold(
        self, event: Any, fds: list[int], registrations: set[int] | None = None, stream: Any = None
    ) -> None:
        """Holds ``fds`` until ``event`` (recorded on ``stream``) passes; ``registrations``: the addresses
        of the registered ranges the copy reads (each unregisters only once the copy has landed)."""
        reads = registrations or set()
        index = _device_index_of(stream)
        with self._cond:
            self._wait_for_room(len(fds))
            self._queue.append((event, fds, reads, index))
            self._reading.update(reads)
            self._held += 1
            self._fds += len(fds)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="skippyd-leases", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def room(self, fds: int) -> None:
        """Waits until a copy holding ``fds`` descriptors may be held (call it before duplicating them:
        past the process's open-files limit, ``dup`` itself would fail)."""
        with self._cond:
            self._wait_for_room(fds)

    def _wait_for_room(self, fds: int) -> None:
        while self._held and (self._held >= _MAX_PENDING or self._fds + fds > self._fd_budget):
            self._cond.wait()  # (none held: any one copy may go, whatever it holds)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                event, fds, reads, index = self._queue.popleft()
            try:
                _make_current(index)
            except Exception as exc:  # (the copy is still waited for below)
                log.warning("cannot make cuda:%s current on the leases' thread (%s)", index, exc)
            try:
                event.synchronize()
            except Exception as exc:  # a failed copy still gives its leases back
                log.warning("a copy's event failed (%s); its leases are released", exc)
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                with self._cond:
                    self._held -= 1
                    self._fds -= len(fds)
                    self._reading.subtract(reads)
                    for address in reads:
                        if self._reading[address] <= 0:
                            del self._reading[address]
                    self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            while self._held:
                self._cond.wait()

    def drain_for(self, address: int) -> None:
        """Waits until no copy in flight reads the registration made at ``address`` (copies of other
        registrations go on)."""
        with self._cond:
            while self._reading.get(address, 0) > 0:
                self._cond.wait()

    def __len__(self) -> int:
        with self._cond:
            return self._held
