"""Recent demand: how many bytes of one kind of memory (a block group's slots, an entry size class's
files) puts and captures took in the last few seconds, which is what the reserve keeps ready for the next
few (:mod:`.reserve`).

Counted in buckets of a quarter of a second, so recording one take is an add (it runs once per block a
put stores) and the figure decays a bucket at a time once takes stop: a window after the last take it is 0.
"""

from __future__ import annotations

from collections import deque

__all__ = ["Demand"]

_WIDTH_S = 0.25


class Demand:
    """Bytes taken recently, in buckets of a quarter of a second. Not thread-safe: the tier's lock
    guards it."""

    __slots__ = ("_buckets", "_total")

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque()  # [bucket number, bytes], oldest first
        self._total = 0

    def add(self, nbytes: int, now: float) -> None:
        bucket = int(now / _WIDTH_S)
        buckets = self._buckets
        if buckets and buckets[-1][0] == bucket:
            buckets[-1][1] += nbytes
        else:
            buckets.append([bucket, nbytes])
        self._total += nbytes

    def recent(self, now: float, window: float) -> int:
        """Bytes taken within ``window`` seconds before ``now`` (to a quarter of a second); forgets older
        takes (so ask with one window)."""
        oldest = int(now / _WIDTH_S) - max(1, round(window / _WIDTH_S))
        buckets = self._buckets
        while buckets and buckets[0][0] <= oldest:
            self._total -= buckets.popleft()[1]
        return self._total
