"""One typed snapshot of every counter the daemon keeps: what ``stats`` answers, what Prometheus reads.

Each part is the owner's own dataclass (:class:`~skippyd.l2.L2Stats`, :class:`~skippyd.l3.L3Stats`,
:class:`~skippyd.durable.DurableStats`, :class:`~skippyd.fills.FillStats`,
:class:`~skippyd.tiers.Counters`, ...). The daemon builds a :class:`Snapshot`; the wire form
(:meth:`Snapshot.to_wire`, the ``stats`` reply documented in docs/protocol.md) is a map of maps; the
commands rebuild the typed snapshot from it (:meth:`Snapshot.from_wire`) and read attributes, so a
counter renamed in one place is a type error everywhere it is read, never a silent 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from .blocks import BlockCounters
from .cluster.coordination import RedisStatus
from .display import human_age, plural
from .durable import DurableStats
from .fills import FillStats
from .l2 import L2Stats
from .l3 import L3Stats, Reconciliation
from .latency import LatencyTracker
from .packer import BlockWriterStats
from .tiers import Counters
from .workers import ThreadHealth

__all__ = [
    "Condition",
    "LatencySummary",
    "RedisStatus",
    "ServerState",
    "ServerStats",
    "Snapshot",
    "from_fields",
    "redis_summary",
]

T = TypeVar("T")


def from_fields(cls: type[T], doc: Any) -> T:
    """A dataclass from a map, keeping the fields it knows (a newer or older peer may send others)."""
    if not isinstance(doc, dict):
        return cls()
    known = {f.name for f in fields(cls) if f.init}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in doc.items() if k in known})


def _wire(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(slots=True)
class LatencySummary:
    count: int = 0
    mean_us: float = 0.0
    p50_us: float = 0.0  # an upper bound (power-of-two buckets)
    p99_us: float = 0.0


@dataclass(slots=True)
class ServerStats:
    connections: int = 0
    inflight: int = 0
    copies_behind: int = 0  # puts answered whose copy out of staging has not committed yet
    lingering: int = 0  # closed connections kept open until their clients read the descriptors sent
    fds_unread: int = 0  # descriptors sent in replies clients had not read when last looked at
    fd_refusals: int = 0  # replies the kernel would not pass descriptors for yet (ETOOMANYREFS)
    accepted: int = 0
    refused: int = 0
    errors: int = 0
    protocol_errors: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    latency: dict[str, LatencySummary] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        doc = _wire(self)
        doc["latency"] = {op: _wire(summary) for op, summary in self.latency.items()}
        return doc

    @classmethod
    def from_wire(cls, doc: Any) -> ServerStats:
        stats = from_fields(cls, doc)
        stats.latency = {op: from_fields(LatencySummary, s) for op, s in dict(stats.latency or {}).items()}
        stats.ops = dict(stats.ops or {})
        return stats


@dataclass
class ServerState:
    """What the server counts as it serves (it writes, the ``stats`` operation reads)."""

    connections: int = 0
    inflight: int = 0
    copies_behind: int = 0
    lingering: int = 0
    fds_unread: int = 0
    fd_refusals: int = 0
    accepted: int = 0
    refused: int = 0
    errors: int = 0
    protocol_errors: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    latency: LatencyTracker = field(default_factory=LatencyTracker)

    def stats(self) -> ServerStats:
        return ServerStats(
            connections=self.connections, inflight=self.inflight, copies_behind=self.copies_behind,
            lingering=self.lingering, fds_unread=self.fds_unread,
            fd_refusals=self.fd_refusals, accepted=self.accepted,
            refused=self.refused, errors=self.errors, protocol_errors=self.protocol_errors,
            ops=dict(self.ops),
            latency={op: LatencySummary(**s) for op, s in self.latency.summaries().items()},  # type: ignore[arg-type]
        )  # fmt: skip


@dataclass(slots=True)
class Snapshot:
    node: str = ""
    version: str = ""
    uptime_s: float = 0.0
    healthy: bool = True
    staging_bytes: int = 0
    l2: L2Stats = field(default_factory=L2Stats)
    ops: Counters = field(default_factory=Counters)
    fills: FillStats = field(default_factory=FillStats)
    blocks: BlockCounters = field(default_factory=BlockCounters)
    l3: L3Stats | None = None
    durable: DurableStats | None = None
    block_writer: BlockWriterStats | None = None
    reconciliation: Reconciliation | None = None
    server: ServerStats = field(default_factory=ServerStats)
    redis: RedisStatus = field(default_factory=RedisStatus)
    threads: dict[str, ThreadHealth] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The ``stats`` reply: ``ops`` holds the request counters, the fill table's and the blocks'."""
        doc: dict[str, Any] = {
            "node": self.node,
            "version": self.version,
            "uptime_s": self.uptime_s,
            "healthy": self.healthy,
            "staging_bytes": self.staging_bytes,
            "l2": _wire(self.l2),
            "ops": {**_wire(self.ops), **_wire(self.fills), **_wire(self.blocks)},
            "server": self.server.to_wire(),
            "redis": _wire(self.redis) if self.redis.configured else {"configured": False},
            "threads": {name: thread.to_wire() for name, thread in self.threads.items()},
        }
        if self.l3 is not None:
            doc["l3"] = _wire(self.l3)
        if self.durable is not None:
            doc["durable"] = {
                **_wire(self.durable),
                **(_wire(self.block_writer) if self.block_writer else {}),
            }
        if self.reconciliation is not None:
            report = self.reconciliation.as_dict()
            report["problems"] = report["problems"][:20]
            doc["l3_reconciliation"] = report
        return doc

    def condition(self) -> Condition:
        """How the daemon is doing, the one definition ``status``, ``status --check`` and ``doctor``
        share: ``unhealthy`` once a background thread died (restart it), ``degraded`` while its
        configured Redis is unreachable (it serves on: warm-table updates wait in a buffer, promotions
        are counted locally; a restart would not help), else ``healthy``."""
        problems = []
        died = sorted(name for name, thread in self.threads.items() if not thread.alive)
        if not self.healthy and died:
            problems.append(f"background thread(s) {', '.join(died)} died: restart the daemon")
        elif not self.healthy:
            problems.append("a background thread died: restart the daemon")
        if self.redis.configured and self.redis.degraded:
            problems.append(f"redis {redis_summary(self.redis)}")
        state = "unhealthy" if not self.healthy else "degraded" if problems else "healthy"
        return Condition(state, tuple(problems))

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> Snapshot:
        """The typed snapshot of a ``stats`` reply (fields a peer does not send keep their defaults)."""
        ops = doc.get("ops") or {}
        return cls(
            node=str(doc.get("node", "")),
            version=str(doc.get("version", "")),
            uptime_s=float(doc.get("uptime_s", 0.0)),
            healthy=bool(doc.get("healthy", True)),
            staging_bytes=int(doc.get("staging_bytes", 0)),
            l2=from_fields(L2Stats, doc.get("l2")),
            ops=from_fields(Counters, ops),
            fills=from_fields(FillStats, ops),
            blocks=from_fields(BlockCounters, ops),
            l3=from_fields(L3Stats, doc["l3"]) if isinstance(doc.get("l3"), dict) else None,
            durable=from_fields(DurableStats, doc["durable"])
            if isinstance(doc.get("durable"), dict)
            else None,
            block_writer=from_fields(BlockWriterStats, doc["durable"])
            if isinstance(doc.get("durable"), dict)
            else None,
            reconciliation=(
                from_fields(Reconciliation, doc["l3_reconciliation"])
                if isinstance(doc.get("l3_reconciliation"), dict)
                else None
            ),
            server=ServerStats.from_wire(doc.get("server")),
            redis=from_fields(RedisStatus, doc.get("redis")),
            threads={
                str(name): from_fields(ThreadHealth, thread)
                for name, thread in dict(doc.get("threads") or {}).items()
            },
        )


@dataclass(frozen=True, slots=True)
class Condition:
    """``healthy``, ``degraded`` or ``unhealthy`` (:meth:`Snapshot.condition`) and one line per problem."""

    state: str
    problems: tuple[str, ...] = ()


def redis_summary(redis: RedisStatus) -> str:
    """The Redis link in a few words: ``ok``, or ``degraded since 16:05:01 (4s): <cause>``; with the embedded
    server's restarts when it had any (``restarted 2 times, last 1m05s ago: it was killed by SIGKILL``)."""
    if not redis.configured:
        return "not configured"
    text = "ok"
    if redis.degraded:
        since = time.strftime("%H:%M:%S", time.localtime(time.time() - redis.degraded_for_s))
        text = f"degraded since {since} ({human_age(redis.degraded_for_s)}): {redis.cause}"
    if redis.embedded and redis.server_down_for_s is not None and not redis.degraded:
        text += f"; embedded redis-server down for {human_age(redis.server_down_for_s)}"
    if redis.embedded and redis.server_restarts:
        text += f"; embedded redis-server {server_restarts(redis)}"
    return text


def server_restarts(redis: RedisStatus) -> str:
    """``restarted 2 times, last 1m05s ago (the one before was killed by SIGKILL)``: the embedded
    redis-server's restarts, as ``status`` and ``doctor`` word them."""
    age = redis.server_last_restart_age_s
    last = f", last {human_age(age)} ago" if age is not None else ""
    why = f" (the one before {redis.server_last_exit})" if redis.server_last_exit else ""
    return f"restarted {plural(redis.server_restarts, 'time')}{last}{why}"


def counter_names(cls: type[Any]) -> set[str]:
    """The fields of a stats dataclass (what the metrics tables may name)."""
    return {f.name for f in dataclasses.fields(cls)}
