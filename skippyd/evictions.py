"""The eviction clock: an eviction cancels the work that began before it, and only that work.

Captures, restores, durable writes and L3 fills can run for milliseconds to seconds while an operator
evicts a digest (or everything). Each unit of work takes a number when it begins (:meth:`begin`);
every eviction moves the clock on and marks the digest (or everything) with the new number. A unit of
work asks :meth:`cancelled` before it makes something visible: a mark newer than its own number means
an eviction happened while it ran, and the eviction wins. Work that begins after the eviction has a
newer number and is not affected.

Marks are forgotten once no work that began before them is still outstanding, so the clock's memory
stays proportional to the evictions of the last moment, not to the daemon's lifetime.
"""

from __future__ import annotations

import threading

__all__ = ["EvictionClock"]


class EvictionClock:
    """Thread-safe. Pair every :meth:`begin` with one :meth:`end`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._all_at = 0  # the number of the last evict-everything
        self._marks: dict[str, int] = {}  # digest or "key:<cache key>" -> number of its last eviction
        self._outstanding = 0

    def begin(self) -> int:
        """The number this unit of work runs under; it counts as outstanding until :meth:`end`."""
        with self._lock:
            self._outstanding += 1
            return self._seq

    def end(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding <= 0:
                self._outstanding = 0
                self._marks.clear()  # no work that predates these marks is left to ask about them

    def evict(self, digest: str | None, *, key: str | None = None) -> None:
        """Cancels the work begun before now: of ``digest``, of one cache ``key``, or of everything
        when both are None."""
        with self._lock:
            self._seq += 1
            if key is not None:
                self._marks["key:" + key] = self._seq
            elif digest is None:
                self._all_at = self._seq
            else:
                self._marks[digest] = self._seq

    def cancelled(self, digest: str, seq: int, key: str | None = None) -> bool:
        """Whether work begun at ``seq`` on ``digest`` (under ``key``) was overtaken by an eviction."""
        with self._lock:
            if self._all_at > seq or self._marks.get(digest, -1) > seq:
                return True
            return key is not None and self._marks.get("key:" + key, -1) > seq

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    @property
    def marks(self) -> int:
        with self._lock:
            return len(self._marks)
