"""The view behind ``skippyd top``: rates from two snapshots of the daemon's counters."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .config import human_size

__all__ = ["render"]


def _rate(now: dict[str, Any], before: dict[str, Any] | None, key: str, seconds: float) -> str:
    if before is None:
        return "-"
    return f"{(now.get(key, 0) - before.get(key, 0)) / seconds:.1f}/s"


def _hit_rate(now: dict[str, Any], before: dict[str, Any] | None) -> str:
    hits, misses = now.get("hits", 0), now.get("misses", 0)
    if before is not None:
        hits -= before.get("hits", 0)
        misses -= before.get("misses", 0)
    total = hits + misses
    return f"{100 * hits / total:.1f}%" if total else "-"


def render(now: dict[str, Any], before: dict[str, Any] | None, seconds: float) -> Group:
    header = Text(
        f"skippyd {now.get('version')}  node {now.get('node')}  up {now.get('uptime_s', 0):.0f}s  "
        f"clients {now['server'].get('connections', 0)}  in flight {now['server'].get('inflight', 0)}",
        style="bold",
    )
    tiers = Table(title="tiers", expand=True)
    for column in ("tier", "entries", "bytes", "budget", "hit rate", "hits/s", "evictions/s", "notes"):
        tiers.add_column(column, justify="right" if column != "tier" else "left")
    l2, l2_before = now["l2"], (before or {}).get("l2")
    tiers.add_row(
        "L2",
        str(l2["entries"]),
        human_size(l2["bytes"]),
        human_size(l2["budget_bytes"]),
        _hit_rate(l2, l2_before),
        _rate(l2, l2_before, "hits", seconds),
        _rate(l2, l2_before, "evictions", seconds),
        f"recycled {human_size(l2.get('free_bytes', 0))}",
    )
    l3 = now.get("l3")
    if l3:
        l3_before = (before or {}).get("l3")
        notes = "READ-ONLY" if l3.get("readonly") else f"queue {now.get('durable', {}).get('queue_depth', 0)}"
        tiers.add_row(
            "L3",
            str(l3["entries"]),
            human_size(l3["bytes"]),
            human_size(l3["budget_bytes"]),
            "-",
            _rate(l3, l3_before, "hits", seconds),
            _rate(l3, l3_before, "evictions", seconds),
            notes,
        )
    ops = Table(title="operations", expand=True)
    for column in ("op", "count", "rate", "p50", "p99", "mean"):
        ops.add_column(column, justify="right" if column != "op" else "left")
    counts = now["server"].get("ops", {})
    previous = (before or {}).get("server", {}).get("ops", {}) if before else None
    for op, latency in sorted(now["server"].get("latency", {}).items()):
        rate = "-" if previous is None else f"{(counts.get(op, 0) - previous.get(op, 0)) / seconds:.1f}/s"
        ops.add_row(
            op,
            str(counts.get(op, 0)),
            rate,
            f"≤{latency['p50_us']:.0f} µs",
            f"≤{latency['p99_us']:.0f} µs",
            f"{latency['mean_us']:.0f} µs",
        )
    redis = now.get("redis", {})
    if not redis.get("configured", True):
        footer = Text("redis: not configured")
    elif redis.get("degraded"):
        footer = Text(f"redis: DEGRADED ({redis.get('cause')})", style="bold red")
    else:
        footer = Text(f"redis: ok, {redis.get('ran_sent', 0)} warm-table updates sent")
    return Group(header, tiers, ops, footer)
