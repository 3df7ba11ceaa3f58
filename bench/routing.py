"""Routing by the warm-prefix table against the usual routers, one run, real daemons.

Four ``skippyd serve`` daemons on this host share one redis-server; each is a node with its own small
L2 budget (L3 off), so a node holds only part of the fleet's prefixes and where a turn runs decides what
it can restore. A multi-tenant chat trace (conversations of several turns, each opening with one of a
few system prompts picked with Zipf popularity) is replayed in simulated time: conversations arrive as a
Poisson process, each turn occupies its node for a service time (prefill of the tokens not restored,
plus decoding the answer), the next turn of a conversation arrives a think time after the answer. Every
request really runs against the chosen node's daemon: ``contains`` says how many leading blocks it
holds (the tokens restored), the prompt and answer are ``put`` as blocks (16 KiB a 64-token block) and
``ran`` tells the warm table, through the daemon's own batched Redis link.

Routers: round-robin; least-loaded (fewest requests in flight); consistent hashing of the first block
(a hash ring, 64 virtual nodes a node); ``warmest`` (the table's warmest live node, else the least
loaded); ``route`` with loads (the requests in flight per node), with the table's default thresholds and
with tight ones. For each: tokens restored ÷ restorable (restorable: the leading blocks of the prompt
that an earlier request of the trace ran anywhere), hit rate (requests that restored something among
those that could), load imbalance (max ÷ mean over nodes of the time-averaged requests in flight), the
router's wall time per decision, and Redis's own time per decision (``INFO commandstats``, measured
after the replay with the daemons stopped, so only the router's calls count), on the trace's prompts and
on 32k-token prompts.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import redis

import skippyd
from skippyd import WarmTable
from skippyd.cluster.coordination import script_text

from ._common import BenchDaemon, fmt_time, machine, redis_server, table, write_section

MODEL = "bench-routing"
STATE = "kv-bench-v1"
BLOCK = 64
NODES = 4


@dataclass
class Turn:
    conversation: int
    index: int
    prompt: list[int]
    answer: list[int]


@dataclass
class Trace:
    conversations: list[list[Turn]]
    starts: list[float]
    think: list[list[float]]
    tenant_of: list[int]


@dataclass(frozen=True)
class Shape:
    """The trace's shape: ranges are inclusive (low, high)."""

    conversations: int
    tenants: int
    zipf: float
    rate: float
    system_blocks: tuple[int, int]
    turns: tuple[int, int]
    user: tuple[int, int]
    answer: tuple[int, int]
    think_s: float


def make_trace(rng: np.random.Generator, shape: Shape) -> Trace:
    """Conversations of several turns; each opens with one of ``tenants`` system prompts (Zipf
    popularity); a turn adds a user message and the answer; token ids never collide across segments."""
    conversations, tenants, zipf, rate = shape.conversations, shape.tenants, shape.zipf, shape.rate

    def pick(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    next_id = iter(range(1, 10**9))

    def segment(n: int) -> list[int]:
        return [next(next_id) for _ in range(n)]

    systems = [segment(pick(shape.system_blocks) * BLOCK) for _ in range(tenants)]
    weights = 1.0 / np.arange(1, tenants + 1) ** zipf
    weights /= weights.sum()
    convs, think, tenant_of = [], [], []
    for c in range(conversations):
        tenant = int(rng.choice(tenants, p=weights))
        tenant_of.append(tenant)
        history = list(systems[tenant])
        turns = []
        for t in range(pick(shape.turns)):
            history += segment(pick(shape.user))
            answer = segment(pick(shape.answer))
            turns.append(Turn(c, t, list(history), answer))
            history += answer
        convs.append(turns)
        think.append([float(rng.exponential(shape.think_s)) for _ in turns])
    starts = np.cumsum(rng.exponential(1.0 / rate, conversations)).tolist()
    return Trace(convs, starts, think, tenant_of)


@dataclass
class Result:
    name: str
    restored: int = 0
    restorable: int = 0
    hits: int = 0
    could: int = 0
    requests: int = 0
    busy: list[float] = field(default_factory=lambda: [0.0] * NODES)
    decision_s: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    redis_us: str = "-"
    redis_us_32k: str = "-"

    @property
    def imbalance(self) -> float:
        mean = sum(self.busy) / len(self.busy)
        return max(self.busy) / mean if mean else 0.0

    @property
    def share(self) -> float:
        return self.restored / self.restorable if self.restorable else 0.0


class Ring:
    """Consistent hashing: ``vnodes`` points a node on a 64-bit ring; a key goes to the next point."""

    def __init__(self, nodes: list[str], vnodes: int = 64) -> None:
        points = sorted(
            (int.from_bytes(hashlib.blake2b(f"{n}#{v}".encode(), digest_size=8).digest(), "big"), n)
            for n in nodes
            for v in range(vnodes)
        )
        self.keys = [p for p, _ in points]
        self.nodes = [n for _, n in points]

    def node(self, key: bytes) -> str:
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        return self.nodes[bisect.bisect(self.keys, h) % len(self.nodes)]


Decide = Callable[[Turn, dict[str, int]], tuple[str, str]]


def replay(name: str, trace: Trace, decide: Decide, clients: dict[str, Any], *, payload: bytes,
           prefill_s: float, decode_s: float) -> Result:  # fmt: skip
    """Replays the trace in simulated time; every request really runs against its node's daemon."""
    result = Result(name)
    spaces = {n: c.blocks(model=MODEL, state=STATE, block_tokens=BLOCK) for n, c in clients.items()}
    keyer = next(iter(spaces.values()))
    seen: set[bytes] = set()
    nodes = list(clients)
    inflight = dict.fromkeys(nodes, 0)
    # (simulated time, tie-break, node index or -1 for an arrival, conversation, turn)
    events: list[tuple[float, int, int, int, int]] = []
    order = iter(range(10**9))
    for c, start in enumerate(trace.starts):
        heapq.heappush(events, (start, next(order), -1, c, 0))
    now = 0.0
    while events:
        at, _, done_on, c, t = heapq.heappop(events)
        for i, n in enumerate(nodes):
            result.busy[i] += inflight[n] * (at - now)
        now = at
        if done_on >= 0:  # an answer finished: the conversation's next turn comes after a think time
            inflight[nodes[done_on]] -= 1
            if t + 1 < len(trace.conversations[c]):
                heapq.heappush(events, (now + trace.think[c][t], next(order), -1, c, t + 1))
            continue
        turn = trace.conversations[c][t]
        started = time.perf_counter()
        node, reason = decide(turn, dict(inflight))
        result.decision_s.append(time.perf_counter() - started)
        result.reasons[reason] = result.reasons.get(reason, 0) + 1
        keys = keyer.keys(turn.prompt)
        restorable = 0
        while restorable < len(keys) and keys[restorable] in seen:
            restorable += 1
        held = spaces[node].contains(keys) if keys else 0
        restored = min(held, restorable) * BLOCK
        result.restored += restored
        result.restorable += restorable * BLOCK
        result.requests += 1
        if restorable:
            result.could += 1
            result.hits += restored > 0
        ran = turn.prompt + turn.answer  # the node now holds the prompt and its answer
        all_keys = keyer.keys(ran)
        missing = all_keys[held:]
        if missing:
            spaces[node].put(missing, [payload] * len(missing), durable=False,
                             parent=all_keys[held - 1] if held else None)  # fmt: skip
        clients[node].ran(model=MODEL, tokens=ran)  # the daemon feeds the warm table (batched)
        seen.update(all_keys)
        service = (len(turn.prompt) - restored) * prefill_s + len(turn.answer) * decode_s
        inflight[node] += 1
        heapq.heappush(events, (now + service, next(order), nodes.index(node), c, t))
    return result


def slowlog_start(probe: redis.Redis) -> None:
    """Every command goes to Redis's slow log from now on, with its own execution time."""
    probe.config_set("slowlog-log-slower-than", 0)
    probe.config_set("slowlog-max-len", 200_000)
    probe.slowlog_reset()


def slowlog_times(probe: redis.Redis, script: str) -> str:
    """Redis's own time per call of ``script`` since :func:`slowlog_start` (other clients' commands are
    told apart by the script's SHA): the median and the 99th percentile."""
    sha = hashlib.sha1(script_text(script).encode(), usedforsecurity=False).hexdigest()  # Redis's script name
    durations = []
    for entry in probe.slowlog_get(200_000):
        command = entry["command"]
        text = command.decode(errors="replace") if isinstance(command, bytes) else str(command)
        words = text.split(" ", 2)
        if len(words) > 1 and words[0].upper() == "EVALSHA" and words[1] == sha:
            durations.append(float(entry["duration"]))
    probe.config_set("slowlog-log-slower-than", 10_000)
    if not durations:
        return "-"
    durations.sort()
    p50 = durations[len(durations) // 2]
    p99 = durations[min(len(durations) - 1, round(0.99 * (len(durations) - 1)))]
    return f"{p50:.0f} µs (p99 {p99:.0f})"


def one_call_time(probe: redis.Redis, call: Callable[[], object]) -> float:
    """Redis's own µs for the one script ``call`` makes (the slow log logs every command meanwhile)."""
    probe.slowlog_reset()
    call()
    for entry in probe.slowlog_get(8):
        command = entry["command"]
        text = command.decode(errors="replace") if isinstance(command, bytes) else str(command)
        if text.upper().startswith("EVALSHA"):
            return float(entry["duration"])
    raise RuntimeError("the call made no EVALSHA")


def long_prompt_times(probe: redis.Redis, warm: WarmTable, names: list[str]) -> dict[str, str]:
    """Redis's time per decision at 32k-token prompts: 64 prompts over 4 shared 30k-token documents,
    2k tokens of their own, each ran by two nodes (half of it, then all of it); daemons stopped. The
    three kinds of call alternate prompt by prompt, so the machine's other work weighs on each alike."""
    probe.flushall()
    for node in names:
        warm.heartbeat(node, time.time_ns(), 600)
    docs = [list(range(10**8 + d * 10**6, 10**8 + d * 10**6 + 30 * 1024)) for d in range(4)]
    chains = []
    for i in range(64):
        p = docs[i % 4] + list(range(2 * 10**8 + i * 4096, 2 * 10**8 + i * 4096 + 2 * 1024))
        warm.ran(MODEL, p[: len(p) // 2 + 1024 * (i % 3)], names[i % NODES])
        warm.ran(MODEL, p, names[(i + 1) % NODES])
        chains.append(warm.chain(MODEL, p))
    spread = {n: i for i, n in enumerate(names)}
    samples: dict[str, list[float]] = {"warmest": [], "route": [], "route, warmest overloaded": []}
    probe.config_set("slowlog-log-slower-than", 0)
    for _ in range(4):
        for i, chain in enumerate(chains):
            busy = {**dict.fromkeys(names, 40), names[(i + 1) % NODES]: 100}  # the warmest: overloaded
            samples["warmest"].append(one_call_time(probe, partial(warm.warmest_chain, chain)))
            samples["route"].append(one_call_time(probe, partial(warm.route_chain, chain, loads=spread)))
            samples["route, warmest overloaded"].append(
                one_call_time(probe, partial(warm.route_chain, chain, loads=busy))
            )
    probe.config_set("slowlog-log-slower-than", 10_000)
    out = {}
    for label, durations in samples.items():
        durations.sort()
        p50 = durations[len(durations) // 2]
        p99 = durations[min(len(durations) - 1, round(0.99 * (len(durations) - 1)))]
        out[label] = f"{p50:.0f} µs (p99 {p99:.0f})"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--tenants", type=int, default=24, help="system prompts")
    parser.add_argument("--zipf", type=float, default=1.8, help="Zipf exponent of system prompt popularity")
    parser.add_argument("--rate", type=float, default=2.0, help="conversations a second (simulated)")
    parser.add_argument("--system-blocks", default="4,16", help="system prompt length in 64-token blocks")
    parser.add_argument("--turns", default="4,10", help="turns a conversation")
    parser.add_argument("--user", default="32,200", help="tokens of a user message")
    parser.add_argument("--answer", default="200,800", help="tokens of an answer")
    parser.add_argument("--think", type=float, default=4.0, help="mean think time, simulated seconds")
    parser.add_argument("--l2-budget", default="40MiB", help="each node's L2 budget")
    parser.add_argument("--block-bytes", type=int, default=16384, help="payload of one 64-token block")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=100.0, help="simulated prefill cost")
    parser.add_argument("--decode-ms", type=float, default=20.0, help="simulated time per answer token")
    parser.add_argument("--tight", default="2,1.25", help="balance_abs,balance_rel of the tight route row")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default="", help="only the routers whose names contain one of these (a,b)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()

    def bounds(text: str) -> tuple[int, int]:
        low, high = (int(x) for x in text.split(","))
        return low, high

    shape = Shape(args.conversations, args.tenants, args.zipf, args.rate, bounds(args.system_blocks),
                  bounds(args.turns), bounds(args.user), bounds(args.answer), args.think)  # fmt: skip
    trace = make_trace(np.random.default_rng(args.seed), shape)
    payload = bytes(args.block_bytes)
    tight_abs, tight_rel = (float(x) for x in args.tight.split(","))
    names = [f"node-{i}" for i in range(NODES)]
    results: list[Result] = []
    work = Path(tempfile.mkdtemp(prefix="skb-route-", dir="/tmp"))
    started = time.monotonic()
    with redis_server() as url:
        probe = redis.Redis.from_url(url)
        default = WarmTable.from_url(url)
        tight = WarmTable.from_url(url, balance_abs=tight_abs, balance_rel=tight_rel)
        ring = Ring(names)
        counter = iter(range(10**9))

        def least(loads: dict[str, int]) -> str:
            low = min(loads.values())
            tied = [n for n in names if loads[n] == low]
            return tied[next(counter) % len(tied)]

        def round_robin(_turn: Turn, _loads: dict[str, int]) -> tuple[str, str]:
            return names[next(counter) % NODES], "-"

        def least_loaded(_turn: Turn, loads: dict[str, int]) -> tuple[str, str]:
            return least(loads), "-"

        def hashed(turn: Turn, _loads: dict[str, int]) -> tuple[str, str]:
            return ring.node(default.chain(MODEL, turn.prompt[:BLOCK])), "-"  # model + first block

        def warmest(turn: Turn, loads: dict[str, int]) -> tuple[str, str]:
            found = default.warmest(MODEL, turn.prompt)
            return (found[0], "warm") if found else (least(loads), "cold")

        def route(warm: WarmTable) -> Decide:
            def decide(turn: Turn, loads: dict[str, int]) -> tuple[str, str]:
                chosen = warm.route(MODEL, turn.prompt, loads=loads)
                return chosen.node, chosen.reason

            return decide

        policies: list[tuple[str, Decide, str]] = [
            ("round-robin", round_robin, ""),
            ("least-loaded", least_loaded, ""),
            ("consistent hash, first block", hashed, ""),
            ("warmest (else least loaded)", warmest, "warm_warmest.lua"),
            (f"route, loads, defaults ({default.balance_abs:g}, {default.balance_rel:g})", route(default),
             "warm_route.lua"),
            (f"route, loads, tight ({tight_abs:g}, {tight_rel:g})", route(tight), "warm_route.lua"),
        ]  # fmt: skip
        wanted = [w for w in args.only.split(",") if w]
        for name, decide, script in policies:
            if wanted and not any(w in name for w in wanted):
                continue
            probe.flushall()
            daemons = []
            for i, node in enumerate(names):
                root = work / f"{len(results)}-{i}"
                root.mkdir()
                daemons.append(BenchDaemon(root, "--node", node, "--l3-dir", "off", "--heartbeat", "1s",
                                           budget=args.l2_budget, redis_url=url))  # fmt: skip
            try:
                with ThreadPoolExecutor(NODES) as pool:
                    list(pool.map(BenchDaemon.start, daemons))
                clients = {
                    n: skippyd.Client(d.socket, timeout=60) for n, d in zip(names, daemons, strict=True)
                }
                deadline = time.monotonic() + 20
                while len(default.nodes()) < NODES and time.monotonic() < deadline:
                    time.sleep(0.05)
                slowlog_start(probe)
                result = replay(name, trace, decide, clients, payload=payload,
                                prefill_s=args.prefill_ms_per_1k / 1e6,
                                decode_s=args.decode_ms / 1e3)  # fmt: skip
                if script:
                    result.redis_us = slowlog_times(probe, script)
                for c in clients.values():
                    c.close()
            finally:
                for d in daemons:
                    d.cleanup()
            results.append(result)
            print(
                f"  {name}: {result.requests} requests, {time.monotonic() - started:.0f} s so far", flush=True
            )
        long = long_prompt_times(probe, default, names)
    shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    out = render(args, shape, trace, results, long=long, elapsed=elapsed)
    print(out)
    if args.write_docs:
        write_section("routing", out)


def render(args: argparse.Namespace, shape: Shape, trace: Trace, results: list[Result], *,
           long: dict[str, str], elapsed: float) -> str:  # fmt: skip
    rows = []
    for r in results:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items()) if k != "-")
        rows.append([
            r.name, f"{r.share:.1%}", f"{r.hits / r.could:.1%}" if r.could else "-", f"{r.imbalance:.2f}",
            fmt_time(float(np.median(r.decision_s))), r.redis_us, reasons or "-",
        ])  # fmt: skip
    text = table(["router", "tokens restored ÷ restorable", "hit rate", "load imbalance (max ÷ mean)",
                  "decision p50 (router, wall)", "Redis/decision p50 (p99)", "reasons"], rows)  # fmt: skip
    long_rows = [[label, value] for label, value in long.items()]
    text += "\n\n" + table(["at 32k-token prompts", "Redis/decision p50 (p99)"], long_rows)
    rr = next((r for r in results if r.name.startswith("round")), None)
    warm = next((r for r in results if r.name.startswith("warmest")), None)
    notes = []
    for r in results:
        if not r.name.startswith("route") or rr is None or warm is None:
            continue
        gain = r.restored / rr.restored if rr.restored else float("inf")
        of_warm = r.restored / warm.restored if warm.restored else float("inf")
        balance = "met" if r.imbalance <= 1.25 else "NOT met"
        if warm.imbalance <= 2:
            balance += "; warmest was not above 2 in this run"
        notes.append(
            f"{r.name}: {gain:.2f}× round-robin's tokens restored (target ≥ 2×: "
            f"{'met' if gain >= 2 else 'NOT met'}), {of_warm:.0%} of warmest's (target ≥ 90%: "
            f"{'met' if of_warm >= 0.9 else 'NOT met'}), imbalance {r.imbalance:.2f} against warmest's "
            f"{warm.imbalance:.2f} (target ≤ 1.25 where warmest > 2: {balance})."
        )
    total = sum(len(c) for c in trace.conversations)
    header = (
        f"Machine: {machine()}. "
        f"`python -m bench.routing`, one run ({elapsed:.0f} s): {NODES} daemons (L2 {args.l2_budget} each, "
        f"L3 off) and one redis-server on this host; {shape.conversations} conversations, {total} requests; "
        f"{shape.tenants} system prompts of {shape.system_blocks[0] * BLOCK:,}-"
        f"{shape.system_blocks[1] * BLOCK:,} tokens, Zipf({shape.zipf:g}) popularity; "
        f"{shape.turns[0]}-{shape.turns[1]} turns of "
        f"{shape.user[0]}-{shape.user[1]} user + {shape.answer[0]}-{shape.answer[1]} answer tokens; "
        f"{shape.rate:g} conversations/s, think time {shape.think_s:g} s (mean), service = "
        f"{args.prefill_ms_per_1k:g} ms per 1k tokens not restored + {args.decode_ms:g} ms an answer token "
        f"(simulated time); {args.block_bytes // 1024} KiB a 64-token block. Redis/decision: Redis's own "
        "time per call of the decision's script (slow log, every command logged), during the replay "
        "beside the daemons' own traffic; at 32k tokens with the daemons stopped."
    )
    return header + "\n\n" + text + "\n\n" + "\n".join(f"- {n}" for n in notes)


if __name__ == "__main__":
    main()
