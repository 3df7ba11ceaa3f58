"""The view behind ``skippyd top``: rates from two snapshots of the daemon's counters, in 80 columns."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .display import human_age, human_size, human_us, plural

__all__ = ["render"]


def _rate(now: dict[str, Any], before: dict[str, Any] | None, key: str, seconds: float) -> str:
    if before is None:
        return "-"
    return f"{(now.get(key, 0) - before.get(key, 0)) / seconds:.1f}"


def _hit_rate(now: dict[str, Any], before: dict[str, Any] | None) -> str:
    hits, misses = now.get("hits", 0), now.get("misses", 0)
    if before is not None:
        hits -= before.get("hits", 0)
        misses -= before.get("misses", 0)
    total = hits + misses
    return f"{100 * hits / total:.1f}%" if total else "-"


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right", no_wrap=True)
    return table


def render(now: dict[str, Any], before: dict[str, Any] | None, seconds: float) -> Group:
    server = now.get("server", {})
    header = Text(
        f"skippyd {now.get('version')}  node {now.get('node')}  up {human_age(now.get('uptime_s', 0))}  "
        f"{plural(server.get('connections', 0), 'client')}  {server.get('inflight', 0)} in flight",
        style="bold",
    )
    tiers = _table("tiers", ["tier", "entries", "used", "budget", "hit%", "hits/s", "evict/s", "notes"])
    l2, l2_before = now["l2"], (before or {}).get("l2")
    tiers.add_row(
        "L2",
        str(l2["entries"]),
        human_size(l2["bytes"]),
        human_size(l2["budget_bytes"]),
        _hit_rate(l2, l2_before),
        _rate(l2, l2_before, "hits", seconds),
        _rate(l2, l2_before, "evictions", seconds),
        f"{human_size(l2.get('free_bytes', 0))} free",
    )
    l3 = now.get("l3")
    if l3:
        l3_before = (before or {}).get("l3")
        durable = now.get("durable") or {}
        waiting = durable.get("queue_depth", 0) + durable.get("backlog", 0)
        notes = "READ-ONLY" if l3.get("readonly") else f"{waiting} to write"
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
    ops = _table("operations", ["op", "count", "per s", "p50", "p99", "mean"])
    counts = server.get("ops", {})
    previous = (before or {}).get("server", {}).get("ops", {}) if before else None
    for op, latency in sorted(server.get("latency", {}).items()):
        rate = "-" if previous is None else f"{(counts.get(op, 0) - previous.get(op, 0)) / seconds:.1f}"
        ops.add_row(
            op,
            str(counts.get(op, 0)),
            rate,
            human_us(latency["p50_us"]),
            human_us(latency["p99_us"]),
            human_us(latency["mean_us"]),
        )
    redis = now.get("redis", {})
    if not redis.get("configured", True):
        footer = Text("redis: not configured")
    elif redis.get("degraded"):
        footer = Text(f"redis: DEGRADED ({redis.get('cause')})", style="bold red")
    else:
        footer = Text(f"redis: ok, {plural(redis.get('ran_sent', 0), 'warm-table update')} sent")
    dead = sorted(name for name, t in (now.get("threads") or {}).items() if not t.get("alive", True))
    parts: list[Any] = [header, tiers, ops, footer]
    if dead:
        parts.append(Text(f"UNHEALTHY: {', '.join(dead)} died", style="bold red"))
    return Group(*parts)
