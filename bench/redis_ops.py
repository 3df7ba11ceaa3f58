"""Coordination in Redis, one run: warmest/route/ran/consider beside a trivial EVALSHA and PING.

    python -m bench.redis_ops [--reps 300] [--write-docs]

End to end (client-side hashing and encoding included) p50/p99 through redis-py + hiredis, each call
alternating with a trivial EVALSHA (the ratio column), and the Redis server time per call from
``INFO commandstats`` (reset before each operation; for ``warmest``, over calls with the chain already
hashed, so the client's hashing does not compete with Redis for the two cores). The warm table
holds every prompt measured, so ``warmest`` searches the whole chain; a Lua linear scan (the seed's
algorithm, kept here only as the reference) shows what the binary search saves.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import redis

from bench._common import fmt_time, machine, median, percentile, redis_server, table, timed, write_section
from skippyd import Promotions, WarmTable
from skippyd.keys import WARM_HASH_BYTES, encode_tokens, warm_chain

TRIVIAL = "return 1"
LINEAR = """
local chain, hl = ARGV[1], tonumber(ARGV[2])
local best = 0
for k = 1, math.floor(#chain / hl) do
  if not redis.call('HGET', KEYS[1], string.sub(chain, (k - 1) * hl + 1, k * hl)) then break end
  best = k
end
return best
"""


def server_usec(client: redis.Redis, fn: Callable[[], object], reps: int) -> float:
    """Redis's own time per EVALSHA/PING while running ``fn`` ``reps`` times."""
    client.config_resetstat()
    for _ in range(reps):
        fn()
    stats = client.info("commandstats")
    for name in ("cmdstat_evalsha", "cmdstat_ping"):
        if name in stats and stats[name]["calls"]:
            return float(stats[name]["usec"]) / float(stats[name]["calls"])
    return float("nan")


def interleaved(
    fn: Callable[[], object], reference: Callable[[], object], reps: int
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``fn`` and of ``reference``, called alternately ``reps`` times each."""
    fn()
    reference()
    ours, theirs = [], []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        middle = time.perf_counter()
        reference()
        ours.append(middle - start)
        theirs.append(time.perf_counter() - middle)
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    reps = args.reps
    rows: list[list[str]] = []
    with redis_server() as url:
        probe = redis.Redis.from_url(url)
        warm = WarmTable.from_url(url, max_prefixes=1 << 20)
        promotions = Promotions.from_url(url, scope="bench")
        trivial = probe.register_script(TRIVIAL)
        linear = probe.register_script(LINEAR)
        trivial()
        for node in ("node-a", "node-b", "node-c", "node-d"):
            warm.heartbeat(node, 1, 3600)

        def row(
            name: str, fn: Callable[[], object], n: int = reps, server: Callable[[], object] | None = None
        ) -> None:
            # each call alternates with a trivial EVALSHA, so the ratio compares the two under the same
            # conditions (these machines drift by tens of percent over a run); Redis's time is taken
            # over ``server`` where given: the same call without the client's hashing between calls
            # (on two cores that hashing competes with Redis for the CPU and inflates its time)
            samples, baseline = interleaved(fn, trivial, n)
            usec = server_usec(probe, server or fn, min(n, 500))
            rows.append([name, fmt_time(median(samples)), fmt_time(percentile(samples, 99)),
                         f"{usec:.1f} µs", f"{median(samples) / median(baseline):.2f}×"])  # fmt: skip

        row("PING", probe.ping, reps * 3)
        row("trivial EVALSHA (return 1)", trivial, reps * 3)
        rng = np.random.default_rng(0)
        for n in (1024, 32768, 131072):
            prompt = rng.integers(0, 2**17, n).astype(np.int64)
            warm.ran("bench-model", prompt, "node-a")
            half = np.concatenate([prompt[: n // 2], rng.integers(0, 2**17, n - n // 2)])
            cold = rng.integers(0, 2**17, n).astype(np.int64)
            encoded = encode_tokens(prompt)
            chain = warm_chain("bench-model", encoded)
            hashing = median(timed(partial(warm_chain, "bench-model", encoded), reps=reps))
            label = f"{n // 1024}k tokens"
            assert warm.warmest("bench-model", prompt) == ("node-a", n)
            assert warm.warmest("bench-model", half) == ("node-a", n // 2 // 64 * 64)
            assert warm.warmest("bench-model", cold) is None
            cases = (("all warm (hashing included)", prompt), ("half warm", half), ("cold", cold))
            for case, tokens in cases:
                row(
                    f"warmest, {label}, {case}",
                    partial(warm.warmest, "bench-model", tokens),
                    server=partial(warm.warmest_chain, warm.chain("bench-model", tokens)),
                )
            rows.append([f"  of which: chain hashing, {label}", fmt_time(hashing), "", "", ""])
            row(
                f"  reference: seed's linear scan as a script, {label} all warm",
                partial(linear, keys=[warm.shard_of(chain).prefixes], args=[chain, WARM_HASH_BYTES]),
            )
            loads = {"node-a": 20, "node-b": 1, "node-c": 3, "node-d": 2}
            row(
                f"route, {label}, all warm, 4 live nodes, loads",
                partial(warm.route, "bench-model", prompt, loads=loads),
                server=partial(warm.route_chain, chain, loads=loads),
            )
            ran = partial(warm.ran, "bench-model", prompt, "node-a")
            row(f"ran, {label} (hashing included)", ran, max(20, reps // (1 + n // 8192)))
        keys = iter(range(10**9))
        row("consider (new key each call)", lambda: promotions.consider(f"k{next(keys)}", 10, 1000))
        row("consider (same key)", lambda: promotions.consider("hot", 10, 1000))
        row("settle", lambda: promotions.settle("hot"))
    text = table(["operation", "p50", "p99", "Redis time/call", "vs trivial EVALSHA p50"], rows)
    print(text)
    if args.write_docs:
        write_section(
            "redis_ops",
            f"Machine: {machine()}. `python -m bench.redis_ops`, one run; redis-py with hiredis over a "
            "unix socket to a local redis-server, each call alternating with a trivial EVALSHA (the "
            "ratio); Redis time from `INFO commandstats` (for warmest, over calls with the chain already "
            f"hashed).\n\n{text}",
        )


if __name__ == "__main__":
    main()
