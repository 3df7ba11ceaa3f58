"""Prometheus metrics, off by default (``--metrics-addr host:port``).

Everything is read from the daemon's own counters at scrape time (one custom collector), so serving
metrics adds nothing to the request path. Labels are operation names and tier names only: no model
names, prompt tokens, keys or digests ever appear.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from .blocks import BlockCounters
from .cluster.coordination import RedisStatus
from .config import parse_addr
from .durable import DurableStats
from .errors import ConfigError
from .fills import FillStats
from .l2 import L2Stats
from .l3 import L3Stats
from .latency import BUCKETS_US, OpLatency
from .packer import BlockWriterStats
from .stats import ServerStats, Snapshot
from .tiers import Counters

__all__ = ["TABLES", "DaemonCollector", "MetricsServer", "Row"]

log = logging.getLogger("skippyd.metrics")


@dataclass(frozen=True, slots=True)
class Row:
    """One exported metric: the attribute of a stats dataclass it reads, and how it is exported."""

    attr: str
    suffix: str
    help: str
    counter: bool


def _rows(*rows: tuple[str, str, str, bool]) -> tuple[Row, ...]:
    return tuple(Row(*row) for row in rows)


#: Each table names its stats dataclass; tests/test_ops.py checks every ``attr`` is one of its fields.
TABLES: dict[str, tuple[type[Any], str, tuple[Row, ...]]] = {
    "l2": (L2Stats, "skippyd_l2_", _rows(
        ("entries", "entries", "L2: entries held", False),
        ("bytes", "bytes", "L2: tmpfs bytes held by entries", False),
        ("budget_bytes", "budget_bytes", "L2: byte budget", False),
        ("used_bytes", "used_bytes", "L2: bytes of cached data (entries' files and held blocks' slots)",
         False),
        ("reserve_bytes", "reserve_bytes",
         "L2: pre-faulted memory holding no data (free entry files and free block slots)", False),
        ("free_bytes", "recycled_bytes", "L2: pre-faulted bytes kept for reuse", False),
        ("reserved_bytes", "reserved_bytes", "L2: bytes held by captures and fills in flight", False),
        ("hits", "hits", "L2: lookups that found an entry", True),
        ("misses", "misses", "L2: lookups that found nothing", True),
        ("inserts", "inserts", "L2: entries admitted", True),
        ("evictions", "evictions", "L2: entries evicted to make room", True),
        ("admission_rejects", "admission_rejects", "L2: admissions refused for a digest mismatch", True),
        ("refused_bytes", "refused_bytes", "L2: bytes refused as larger than the whole budget", True),
        ("reader_held_drops", "reader_held_drops", "L2: evicted entries still read by a client", True),
        ("prefaulted_files", "reserve_prefaulted_files", "L2: entry files the reserve faulted in",
         True),
        ("reserve_given_back", "reserve_given_back_bytes",
         "L2: bytes of free files and slots the reserve gave back once demand fell", True),
        ("fresh_files", "fresh_files", "L2: entry files a capture had to fault in on its request path", True),
        ("block_count", "blocks", "L2: blocks held", False),
        ("block_bytes", "block_bytes", "L2: tmpfs bytes held by blocks (their slots)", False),
        ("block_slab_bytes", "block_slab_bytes", "L2: tmpfs bytes of block slabs (all slots, headers)",
         False),
        ("block_hits", "block_hits", "L2: blocks served from L2", True),
        ("block_misses", "block_misses", "L2: block gets whose run ended before the last key", True),
        ("block_evictions", "block_evictions", "L2: blocks evicted to make room", True),
        ("block_cascade_evictions", "block_cascade_evictions",
         "L2: blocks evicted with the block they continue (a chain's tail)", True),
        ("block_prefaulted", "reserve_prefaulted_slots", "L2: slots the reserve faulted in ahead of demand",
         True),
        ("block_fresh_slots", "fresh_slots", "L2: slots a put had to fault in on its request path", True),
        ("block_deferred_digests", "deferred_digests",
         "L2: blocks a put committed before hashing them (hashed in the background)", True),
        ("block_unhashed_bytes", "unhashed_bytes", "L2: bytes of held blocks still waiting for their digest",
         False),
        ("block_free_slots_read", "free_slots_read",
         "L2: free block slots a client's lease still reads (not reused nor given back until it lets go)",
         False),
    )),
    "l3": (L3Stats, "skippyd_l3_", _rows(
        ("entries", "entries", "L3: entries held", False),
        ("bytes", "bytes", "L3: bytes on disk (objects, manifests, quarantine, writes in flight)", False),
        ("budget_bytes", "budget_bytes", "L3: byte cap", False),
        ("free_disk_bytes", "free_disk_bytes", "L3: free bytes on the L3 filesystem", False),
        ("readonly", "readonly", "L3: 1 while the disk is below its free-space floor", False),
        ("hits", "hits", "L3: restores served from L3", True),
        ("fills", "fills", "L3: entries read and verified from disk", True),
        ("writes", "writes", "L3: entries written", True),
        ("refused_writes", "refused_writes", "L3: writes refused (budget, floor, full disk)", True),
        ("evictions", "evictions", "L3: entries evicted to stay under the cap", True),
        ("corrupt", "corrupt", "L3: entries quarantined after failing verification", True),
        ("bytes_read", "read_bytes", "L3: bytes read", True),
        ("bytes_written", "written_bytes", "L3: bytes written", True),
        ("block_count", "blocks", "L3: blocks held", False),
        ("block_bytes", "block_bytes", "L3: bytes of live blocks in packs", False),
        ("block_dead_bytes", "block_dead_bytes", "L3: bytes of removed blocks awaiting compaction", False),
        ("block_packs", "block_packs", "L3: pack files", False),
        ("block_hits", "block_hits", "L3: blocks read and verified for gets", True),
        ("block_evictions", "block_evictions", "L3: blocks evicted to stay under the cap", True),
        ("block_compactions", "block_compactions", "L3: packs compacted", True),
        ("block_corrupt", "block_corrupt", "L3: packs quarantined after a block failed verification", True),
    )),
    "blocks": (BlockCounters, "skippyd_", _rows(
        ("block_puts", "block_puts", "block puts", True),
        ("block_bytes_offered", "block_offered_bytes", "bytes of the blocks puts named (held or not)", True),
        ("block_bytes_written", "block_written_bytes", "bytes of the blocks puts stored (rest deduplicated)",
         True),
        ("block_get_bytes", "block_get_bytes", "bytes of the blocks gets served", True),
        ("block_promotions", "block_promotions", "blocks an L3 hit brought into L2", True),
        ("block_admission_waits", "block_admission_waits", "blocks kept from L3 until a second put",
         True),
        ("block_admissions", "block_admissions", "blocks a second put admitted to L3", True),
        ("block_reads_refused", "block_reads_refused", "L3 block reads over the fill budget (run cut short)",
         True),
        ("block_settle_skips", "block_settle_skips",
         "reads that found a put's copy in flight and no place left to wait for it (a miss)", True),
    )),
    "block_writer": (BlockWriterStats, "skippyd_", _rows(
        ("block_queue_depth", "l3_block_queue_depth", "block write jobs queued", False),
        ("block_backlog", "l3_block_backlog", "blocks waiting for L3 to have room", False),
        ("block_writes_deferred", "l3_block_writes_deferred", "block write jobs deferred", True),
        ("block_recovered", "l3_blocks_recovered", "durable blocks re-queued at start", True),
        ("block_writes_lost", "l3_block_writes_lost",
         "blocks that left L2 (or were evicted) before their L3 write read them", True),
    )),
    "ops": (Counters, "skippyd_", _rows(
        ("corrupt_fallbacks", "corrupt_fallbacks", "restores that fell back to a shorter prefix", True),
        ("captures", "captures", "captures", True),
        ("capture_bytes", "capture_bytes", "bytes captured", True),
        ("restore_bytes", "restore_bytes", "bytes restored", True),
    )),
    "fills": (FillStats, "skippyd_", _rows(
        ("promotions", "promotions", "L3 entries promoted into L2", True),
        ("promotions_declined", "promotions_declined",
         "L3 restores not promoted (first hit, too large, or promoted already in the window)", True),
        ("promotions_dropped", "promotions_dropped", "promotions given up (queue full)", True),
        ("fill_waits", "l3_fill_waits", "L3 restores that joined a fill another restore began", True),
        ("fills_refused", "l3_fills_refused", "L3 restores over the fill budget", True),
        ("fill_bytes", "l3_fill_bytes", "memory held by L3 restores outside L2 (memfd)", False),
    )),
    "durable": (DurableStats, "skippyd_", _rows(
        ("queue_depth", "l3_queue_depth", "durable writes queued or running", False),
        ("backlog", "l3_backlog", "durable writes deferred until L3 can take them", False),
        ("queued", "l3_queued_writes", "durable writes queued with a lease on their bytes", True),
        ("deferred", "l3_deferred_writes", "durable writes deferred (queue full, L3 read-only)", True),
        ("written", "l3_durable_writes", "durable writes completed", True),
        ("failed", "l3_write_failures", "durable writes that failed (retried when L3 has room again)", True),
        ("lost", "l3_lost_writes", "deferred durable writes lost: the entry left L2 first", True),
        ("sync_timeouts", "l3_sync_timeouts", 'durable="sync" captures answered before their fsync', True),
    )),
    "server": (ServerStats, "skippyd_", _rows(
        ("connections", "connections", "clients connected", False),
        ("inflight", "requests_in_flight", "requests running", False),
        ("copies_behind", "put_copies_behind", "puts answered, their copy still running", False),
        ("lingering", "connections_lingering",
         "closed connections kept open until their clients read the descriptors they were sent", False),
        ("fd_refusals", "descriptor_refusals",
         "replies held back: the kernel would not pass more descriptors (ETOOMANYREFS)", True),
        ("errors", "request_errors", "requests answered with an error", True),
        ("protocol_errors", "protocol_errors", "connections closed for a bad frame", True),
    )),
    "redis": (RedisStatus, "skippyd_redis_", _rows(
        ("degraded", "degraded", "1 while Redis is unreachable or slow", False),
        ("buffered", "ran_buffered", "warm-table updates waiting", False),
        ("ran_dropped", "ran_dropped", "warm-table updates dropped (Redis away)", True),
        ("batches_resent", "ran_batches_resent",
         "warm-table batches sent again after a failed call (Redis applies each batch once)", True),
        ("promotions_redis", "promotions_counted", "promotion decisions counted in Redis", True),
        ("promotions_local", "promotions_counted_locally",
         "promotion decisions counted on this node (no Redis, or Redis away or slow)", True),
        ("slow_calls", "slow_calls",
         "promotion or admission counts Redis answered slowly: the next seconds of them count locally", True),
        ("server_restarts", "server_restarts",
         "times the embedded redis-server died and was started again", True),
    )),
}  # fmt: skip


def _metric(name: str, help_text: str, counter: bool, value: float, **labels: str) -> Metric:
    family: Metric
    if counter:
        family = CounterMetricFamily(name, help_text, labels=list(labels))
    else:
        family = GaugeMetricFamily(name, help_text, labels=list(labels))
    family.add_metric(list(labels.values()), float(value))
    return family


class DaemonCollector(Collector):
    """Turns the daemon's typed snapshot into Prometheus families on every scrape."""

    def __init__(
        self, snapshot: Callable[[], Snapshot | None], latency: Callable[[], dict[str, OpLatency]]
    ) -> None:
        self._snapshot = snapshot
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("skippyd_info", "skippyd build", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info
        data = self._snapshot()
        if data is None:  # still starting: the tiers are being verified
            return
        yield _metric("skippyd_uptime_seconds", "seconds since start", False, data.uptime_s)
        sections: dict[str, Any] = {
            "l2": data.l2, "l3": data.l3, "ops": data.ops, "fills": data.fills, "durable": data.durable,
            "blocks": data.blocks, "block_writer": data.block_writer, "server": data.server,
            "redis": data.redis if data.redis.configured else None,
        }  # fmt: skip
        for name, (_cls, prefix, rows) in TABLES.items():
            stats = sections[name]
            if stats is None:
                continue
            for row in rows:
                yield _metric(prefix + row.suffix, row.help, row.counter, float(getattr(stats, row.attr)))
        requests = CounterMetricFamily("skippyd_requests", "requests by operation", labels=["op"])
        for op, count in sorted(data.server.ops.items()):
            requests.add_metric([op], float(count))
        yield requests
        if data.threads:
            up = GaugeMetricFamily(
                "skippyd_background_thread_up", "1 while a background thread runs", labels=["thread"]
            )
            errors = CounterMetricFamily(
                "skippyd_background_errors", "jobs of a background thread that failed", labels=["thread"]
            )
            for name, thread in sorted(data.threads.items()):
                up.add_metric([name], 1.0 if thread.alive else 0.0)
                errors.add_metric([name], float(thread.errors))
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
