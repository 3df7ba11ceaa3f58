"""Per-operation latency histograms, cheap enough for every request.

Buckets are powers of two in microseconds (1 µs … ~33 s); an observation is one ``bit_length`` and
two integer increments. ``skippyd stats``/``top`` read percentiles from them, and the Prometheus
endpoint exports them as histograms without any second bookkeeping on the request path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["BUCKETS_US", "LatencyTracker", "OpLatency"]

BUCKETS_US = tuple(1 << i for i in range(26))  # upper bounds: 1 µs, 2 µs, … 2^25 µs (~33 s)


@dataclass(slots=True)
class OpLatency:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_US) + 1))
    total: int = 0
    sum_us: float = 0.0

    def percentile(self, pct: float) -> float:
        """An upper bound of the ``pct`` percentile in microseconds (0 when nothing was observed)."""
        if not self.total:
            return 0.0
        rank = pct / 100 * self.total
        seen = 0
        for bound, count in zip((*BUCKETS_US, float("inf")), self.counts, strict=True):
            seen += count
            if seen >= rank:
                return float(bound)
        return float("inf")  # pragma: no cover - the loop always reaches the total

    def summary(self) -> dict[str, float]:
        return {
            "count": self.total,
            "mean_us": self.sum_us / self.total if self.total else 0.0,
            "p50_us": self.percentile(50),
            "p99_us": self.percentile(99),
        }


class LatencyTracker:
    def __init__(self) -> None:
        self._ops: dict[str, OpLatency] = {}
        self._lock = threading.Lock()

    def observe(self, op: str, seconds: float) -> None:
        micros = max(0, int(seconds * 1e6))
        index = min(micros.bit_length(), len(BUCKETS_US))  # bucket i holds values <= 2^i µs
        with self._lock:
            latency = self._ops.get(op)
            if latency is None:
                latency = self._ops[op] = OpLatency()
            latency.counts[index] += 1
            latency.total += 1
            latency.sum_us += seconds * 1e6

    def snapshot(self) -> dict[str, OpLatency]:
        with self._lock:
            return {op: OpLatency(list(v.counts), v.total, v.sum_us) for op, v in self._ops.items()}

    def summaries(self) -> dict[str, dict[str, float]]:
        return {op: latency.summary() for op, latency in self.snapshot().items()}
