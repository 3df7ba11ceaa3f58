"""Prometheus metrics, off by default (``--metrics-addr host:port``).

Everything is read from the daemon's own counters at scrape time (one custom collector), so serving
metrics adds nothing to the request path. Labels are operation names and tier names only: no model
names, prompt tokens, keys or digests ever appear.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from . import __version__
from .config import parse_addr
from .errors import ConfigError
from .latency import BUCKETS_US, OpLatency

__all__ = ["DaemonCollector", "MetricsServer"]

log = logging.getLogger("skippyd.metrics")

# (stat key, metric suffix, help, counter?) for each tier
_L2 = [
    ("entries", "entries", "entries held", False),
    ("bytes", "bytes", "tmpfs bytes held by entries", False),
    ("budget_bytes", "budget_bytes", "byte budget", False),
    ("free_bytes", "recycled_bytes", "pre-faulted bytes kept for reuse", False),
    ("reserved_bytes", "reserved_bytes", "bytes held by captures and fills in flight", False),
    ("hits", "hits", "lookups that found an entry", True),
    ("misses", "misses", "lookups that found nothing", True),
    ("inserts", "inserts", "entries admitted", True),
    ("evictions", "evictions", "entries evicted to make room", True),
    ("admission_rejects", "admission_rejects", "admissions refused for a digest mismatch", True),
    ("refused_bytes", "refused_bytes", "bytes refused as larger than the whole budget", True),
    ("reader_held_drops", "reader_held_drops", "evicted entries still read by a client (not recycled)", True),
]
_L3 = [
    ("entries", "entries", "entries held", False),
    ("bytes", "bytes", "bytes on disk (objects, manifests, quarantine, writes in flight)", False),
    ("budget_bytes", "budget_bytes", "byte cap", False),
    ("free_disk_bytes", "free_disk_bytes", "free bytes on the L3 filesystem", False),
    ("readonly", "readonly", "1 while the disk is below its free-space floor", False),
    ("hits", "hits", "restores served from L3", True),
    ("fills", "fills", "entries read and verified from disk", True),
    ("writes", "writes", "entries written", True),
    ("refused_writes", "refused_writes", "writes refused (budget, floor, full disk)", True),
    ("evictions", "evictions", "entries evicted to stay under the cap", True),
    ("corrupt", "corrupt", "entries quarantined after failing verification", True),
    ("bytes_read", "read_bytes", "bytes read", True),
    ("bytes_written", "written_bytes", "bytes written", True),
]
_OPS = [
    ("promotions", "promotions", "L3 entries promoted into L2", True),
    ("corrupt_fallbacks", "corrupt_fallbacks", "restores that fell back to a shorter prefix", True),
    ("fills_refused", "l3_fills_refused", "L3 restores over the fill budget (a shorter prefix served)", True),
    ("fill_bytes", "l3_fill_bytes", "memory held by L3 restores outside L2 (memfd)", False),
    ("captures", "captures", "captures", True),
    ("capture_bytes", "capture_bytes", "bytes captured", True),
    ("restore_bytes", "restore_bytes", "bytes restored", True),
]


_DURABLE = [
    ("queue_depth", "l3_queue_depth", "durable writes queued or running", False),
    ("backlog", "l3_backlog", "durable writes deferred until L3 can take them", False),
    ("queued", "l3_queued_writes", "durable writes queued with a lease on their bytes", True),
    ("deferred", "l3_deferred_writes", "durable writes deferred (queue full, L3 read-only)", True),
    ("written", "l3_durable_writes", "durable writes completed", True),
    ("failed", "l3_write_failures", "durable writes that failed (retried when L3 has room again)", True),
    ("lost", "l3_lost_writes", "deferred durable writes lost: the entry left L2 first", True),
    ("sync_timeouts", "l3_sync_timeouts", 'durable="sync" captures answered before their fsync', True),
]


def _metric(name: str, help_text: str, counter: bool, value: float, **labels: str) -> Metric:
    family: Metric
    if counter:
        family = CounterMetricFamily(name, help_text, labels=list(labels))
    else:
        family = GaugeMetricFamily(name, help_text, labels=list(labels))
    family.add_metric(list(labels.values()), float(value))
    return family


class DaemonCollector(Collector):
    """Turns the daemon's counters into Prometheus families on every scrape."""

    def __init__(
        self, snapshot: Callable[[], dict[str, Any]], latency: Callable[[], dict[str, OpLatency]]
    ) -> None:
        self._snapshot = snapshot
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        data = self._snapshot()
        info = GaugeMetricFamily("skippyd_info", "skippyd build", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info
        yield _metric("skippyd_uptime_seconds", "seconds since start", False, data.get("uptime_s", 0))
        for tier, table in (("l2", _L2), ("l3", _L3)):
            stats = data.get(tier)
            if not isinstance(stats, dict):
                continue
            for key, suffix, help_text, counter in table:
                yield _metric(
                    f"skippyd_{tier}_{suffix}", f"{tier.upper()}: {help_text}", counter, stats.get(key, 0)
                )
        ops = data.get("ops", {})
        for key, suffix, help_text, counter in _OPS:
            yield _metric(f"skippyd_{suffix}", help_text, counter, ops.get(key, 0))
        durable = data.get("durable", {})
        if isinstance(durable, dict) and durable:
            for key, suffix, help_text, counter in _DURABLE:
                yield _metric(f"skippyd_{suffix}", help_text, counter, durable.get(key, 0))
        server = data.get("server", {})
        yield _metric("skippyd_connections", "clients connected", False, server.get("connections", 0))
        yield _metric("skippyd_requests_in_flight", "requests running", False, server.get("inflight", 0))
        yield _metric(
            "skippyd_request_errors", "requests answered with an error", True, server.get("errors", 0)
        )
        protocol = server.get("protocol_errors", 0)
        yield _metric("skippyd_protocol_errors", "connections closed for a bad frame", True, protocol)
        requests = CounterMetricFamily("skippyd_requests", "requests by operation", labels=["op"])
        for op, count in sorted(server.get("ops", {}).items()):
            requests.add_metric([op], float(count))
        yield requests
        redis = data.get("redis", {})
        if redis.get("configured", False):
            degraded = 1 if redis.get("degraded") else 0
            yield _metric("skippyd_redis_degraded", "1 while Redis is unreachable or slow", False, degraded)
            yield _metric(
                "skippyd_redis_ran_buffered", "warm-table updates waiting", False, redis.get("buffered", 0)
            )
            dropped = redis.get("ran_dropped", 0)
            yield _metric(
                "skippyd_redis_ran_dropped", "warm-table updates dropped (Redis away)", True, dropped
            )
            resent = redis.get("batches_resent", 0)
            yield _metric(
                "skippyd_redis_ran_batches_resent",
                "warm-table batches sent again after a failed call (Redis applies each batch once)",
                True,
                resent,
            )
        threads = data.get("threads")
        if isinstance(threads, dict) and threads:
            up = GaugeMetricFamily(
                "skippyd_background_thread_up", "1 while a background thread runs", labels=["thread"]
            )
            errors = CounterMetricFamily(
                "skippyd_background_errors", "jobs of a background thread that failed", labels=["thread"]
            )
            for name, thread in sorted(threads.items()):
                up.add_metric([name], 1.0 if thread.get("alive") else 0.0)
                errors.add_metric([name], float(thread.get("errors", 0)))
            yield up
            yield errors
        histogram = HistogramMetricFamily(
            "skippyd_request_duration_seconds", "request latency in the daemon, by operation", labels=["op"]
        )
        for op, latency in sorted(self._latency().items()):
            buckets = []
            running = 0
            for bound, count in zip(BUCKETS_US, latency.counts, strict=False):
                running += count
                buckets.append((f"{bound / 1e6:.6g}", float(running)))
            buckets.append(("+Inf", float(latency.total)))
            histogram.add_metric([op], buckets, latency.sum_us / 1e6)
        yield histogram


class MetricsServer:
    def __init__(self, addr: str, collector: DaemonCollector) -> None:
        self.host, self.port = parse_addr(addr)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server: Any = None

    def start(self) -> None:
        try:
            server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"invalid metrics_addr {self.host}:{self.port}: cannot listen there ({exc.strerror})"
            ) from exc
        self._server = server
        self.port = server.server_port
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
