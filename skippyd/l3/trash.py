"""Files L3 lets go of (evicted objects and packs, trimmed quarantine), unlinked by a thread of their own.

On a journaled disk, unlinking a large file frees its extents there and then: about 4 ms for a file of
16 MiB on this project's ext4 VMs, against 22 µs for a rename. An eviction frees 15 % of the budget at
once, so thousands of unlinks ran under the L3 lock, and every restore's look at L3 waited for them
(seconds). Under the lock a file is now renamed into ``tmp/`` (same filesystem, emptied at every start:
a crash in between loses nothing and leaves nothing), and this thread unlinks it after. Until then its
bytes count as free disk (:attr:`Trash.pending_bytes`), so a write right after an eviction is not refused
for room the eviction already gave.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import deque
from pathlib import Path

from skippyd.shm import new_name

__all__ = ["Trash"]

log = logging.getLogger("skippyd.l3")


class Trash:
    """Renames discarded files into ``directory`` (under the caller's lock: cheap) and unlinks them on a
    thread started at the first discard (outside any lock)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._queue: deque[tuple[Path, int]] = deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        """Bytes of discarded files not unlinked yet (free disk once they are, within milliseconds)."""
        with self._cond:
            return self._pending

    def discard(self, path: Path, size: int) -> None:
        """Takes ``path`` (``size`` bytes) out of the way now and unlinks it soon. Already gone is fine;
        a file that cannot be renamed there (another filesystem) is unlinked at once."""
        moved = self.directory / f"{path.name}.{new_name('.gone')}"
        try:
            os.rename(path, moved)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                log.warning("L3 could not move %s aside (%s); unlinking it now", path.name, exc)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        with self._cond:
            if self._closed:  # (a late discard at close: unlinked here)
                moved.unlink(missing_ok=True)
                return
            self._queue.append((moved, max(0, size)))
            self._pending += max(0, size)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="skippyd-l3-trash", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                path, size = self._queue[0]
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # (tmp/ is emptied at the next start anyway)
                log.warning("L3 could not unlink %s (%s); it goes at the next start", path.name, exc)
            with self._cond:
                self._queue.popleft()
                self._pending -= size
                self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every discarded file is unlinked; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout)

    def close(self) -> None:
        """Unlinks what is left (the thread finishes the queue), then stops."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
