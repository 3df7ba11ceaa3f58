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
from collections import Counter

__all__ = ["EvictionClock"]


class EvictionClock:
    """Thread-safe. Pair every :meth:`begin` with one :meth:`end` of the number it returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._all_at = 0  # the number of the last evict-everything
        self._marks: dict[str, int] = {}  # digest or "key:<cache key>" -> number of its last eviction
        self._running: Counter[int] = Counter()  # number -> units of work outstanding under it

    def begin(self, since: int | None = None) -> int:
        """The number this unit of work runs under; it counts as outstanding until :meth:`end`.

        ``since``: the number of earlier work this one carries on (a capture's, for its durable write;
        a restore's, for its fill): evictions since then cancel it too.
        """
        with self._lock:
            seq = self._seq if since is None else min(since, self._seq)
            self._running[seq] += 1
            return seq

    def end(self, seq: int) -> None:
        """The work that :meth:`begin` numbered ``seq`` is over; marks no remaining work can ask about go.
        An end with no work left under its number is ignored."""
        with self._lock:
            left = self._running.get(seq, 0) - 1
            if left > 0:
                self._running[seq] = left
            else:
                self._running.pop(seq, None)
            # a mark numbered m cancels work numbered below m: once the oldest work left is at m or
            # later (or none is left), nothing can ask about it
            oldest = min(self._running) if self._running else self._seq
            if self._marks and min(self._marks.values()) <= oldest:
                self._marks = {name: m for name, m in self._marks.items() if m > oldest}

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
            return sum(self._running.values())

    @property
    def marks(self) -> int:
        with self._lock:
            return len(self._marks)
