"""The view behind ``skippyd top``: rates from two snapshots of the daemon's counters, in 80 columns.

L2's "used" is what ``status`` says too (:attr:`~skippyd.l2.L2Stats.used_bytes`: entries and blocks);
its notes name the pre-faulted reserve beside it (memory holding no data)."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .display import human_age, human_size, human_us, plural
from .stats import Snapshot

__all__ = ["render"]


def _rate(now: float, before: float | None, seconds: float) -> str:
    return "-" if before is None else f"{(now - before) / seconds:.1f}"


def _hit_rate(hits: int, misses: int) -> str:
    total = hits + misses
    return f"{100 * hits / total:.1f}%" if total else "-"


def _table(title: str, columns: list[str]) -> Table:
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )  # widest figures of every column still fit in 80
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right", no_wrap=True)
    return table


def render(now: Snapshot, before: Snapshot | None, seconds: float) -> Group:
    server = now.server
    header = Text(
        f"skippyd {now.version}  node {now.node}  up {human_age(now.uptime_s)}  "
        f"{plural(server.connections, 'client')}  {server.inflight} in flight",
        style="bold",
    )
    tiers = _table("tiers", ["tier", "entries", "used", "budget", "hit%", "hits/s", "evict/s", "notes"])
    l2, l2_before = now.l2, before.l2 if before is not None else None
    hits = l2.hits - (l2_before.hits if l2_before else 0)
    misses = l2.misses - (l2_before.misses if l2_before else 0)
    tiers.add_row(
        "L2",
        str(l2.entries),
        human_size(l2.used_bytes),
        human_size(l2.budget_bytes),
        _hit_rate(hits, misses),
        _rate(l2.hits, l2_before.hits if l2_before else None, seconds),
        _rate(l2.evictions, l2_before.evictions if l2_before else None, seconds),
        f"+{human_size(l2.reserve_bytes)} reserve",
    )
    l3 = now.l3
    if l3 is not None:
        l3_before = before.l3 if before is not None else None
        durable = now.durable
        waiting = durable.queue_depth + durable.backlog if durable is not None else 0
        tiers.add_row(
            "L3",
            str(l3.entries),
            human_size(l3.bytes),
            human_size(l3.budget_bytes),
            "-",
            _rate(l3.hits, l3_before.hits if l3_before else None, seconds),
            _rate(l3.evictions, l3_before.evictions if l3_before else None, seconds),
            "READ-ONLY" if l3.readonly else f"{waiting} to write",
        )
    ops = _table("operations", ["op", "count", "per s", "p50", "p99", "mean"])
    previous = before.server.ops if before is not None else None
    for op, latency in sorted(server.latency.items()):
        count = server.ops.get(op, 0)
        rate = _rate(count, previous.get(op, 0) if previous is not None else None, seconds)
        ops.add_row(op, str(count), rate, human_us(latency.p50_us), human_us(latency.p99_us),
                    human_us(latency.mean_us))  # fmt: skip
    redis = now.redis
    if not redis.configured:
        footer = Text("redis: not configured")
    elif redis.degraded:
        footer = Text(f"redis: DEGRADED ({redis.cause})", style="bold red")
    else:
        footer = Text(f"redis: ok, {plural(redis.ran_sent, 'warm-table update')} sent")
    dead = sorted(name for name, thread in now.threads.items() if not thread.alive)
    parts: list[Text | Table] = [header, tiers, ops, footer]
    if dead:
        parts.append(Text(f"UNHEALTHY: {', '.join(dead)} died", style="bold red"))
    return Group(*parts)
