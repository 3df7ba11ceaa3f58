"""The daemon over its socket, one run, side by side with memcpy, redis-py and redis-benchmark.

    python -m bench.daemon [--sizes 4K,64K,1M,16M,64M,256M] [--seconds 5] [--write-docs]

1. restore latency (zero-copy, p50/p99) per payload size, beside an in-process numpy copy of the same
   bytes and a redis-py GET of them from a local redis-server;
2. lookup of a 32k-token prompt (hit and miss), client-side token encoding and daemon hashing included;
3. small-op throughput: lookup misses per second with 1, 8 and 32 connections driven by a C load
   generator (bench/skload.c), beside ``redis-benchmark -t ping`` with as many connections.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import redis

from bench._common import (
    BenchDaemon,
    fmt_time,
    machine,
    median,
    percentile,
    redis_server,
    table,
    timed,
    write_section,
)

MODEL, STATE = "bench-model", "bench-state"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)


def label(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def restore_rows(daemon: BenchDaemon, redis_url: str, sizes: list[int]) -> list[list[str]]:
    import torch

    import skippyd

    client = skippyd.Client(daemon.socket, timeout=120)
    store = redis.Redis.from_url(redis_url)
    rows = []
    for nbytes in sizes:
        data = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
        tokens = list(range(nbytes % 997, nbytes % 997 + 64))
        # not durable: no disk writes competing with the timed restores (bench.l3 covers L3)
        client.capture(
            model=MODEL, state=STATE, tokens=tokens, tensors={"kv": torch.from_numpy(data)}, durable=False
        )
        reps = max(20, min(2000, (2 << 30) // nbytes))

        def restore(tokens: list[int] = tokens) -> None:
            restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
            assert restored is not None
            del restored

        samples = timed(restore, reps=reps)
        target = np.empty_like(data)
        target.fill(1)
        memcpy = median(timed(partial(np.copyto, target, data), reps=max(5, reps // 4)))
        store.set("bench", data.tobytes())
        get = median(timed(lambda: store.get("bench"), reps=max(3, min(50, reps // 10))))
        store.delete("bench")
        p50, p99 = median(samples), percentile(samples, 99)
        rows.append([
            label(nbytes), fmt_time(p50), fmt_time(p99), fmt_time(memcpy), fmt_time(get),
            f"{memcpy / p50:.1f}×", f"{get / p50:.0f}×",
        ])  # fmt: skip
    client.close()
    store.close()
    return rows


def lookup_rows(daemon: BenchDaemon) -> list[list[str]]:
    import torch

    import skippyd

    client = skippyd.Client(daemon.socket)
    array = np.random.default_rng(1).integers(0, 2**17, 32768).astype(np.int64)
    prompt = array.tolist()
    for n in (4096, 16384, 32768):
        client.capture(model=MODEL, state=STATE, tokens=prompt[:n], tensors={"x": torch.ones(16)})
    hit = timed(lambda: client.lookup(model=MODEL, state=STATE, tokens=prompt), reps=500)
    hit_np = timed(lambda: client.lookup(model=MODEL, state=STATE, tokens=array), reps=500)
    miss = timed(lambda: client.lookup(model="other-model", state=STATE, tokens=prompt), reps=500)
    part = timed(lambda: client.lookup(model=MODEL, state=STATE, tokens=[*prompt[:30000], 1]), reps=500)
    ping = timed(client.ping, reps=2000)
    client.close()
    rows = [
        ("lookup 32k tokens as a numpy array, hit (longest of 3 captured)", hit_np),
        ("lookup 32k tokens as a Python list, hit", hit),
        ("lookup 32k tokens as a list, partial hit (16k prefix)", part),
        ("lookup 32k tokens as a list, miss (other model)", miss),
        ("ping (protocol round trip)", ping),
    ]
    return [[name, fmt_time(median(s)), fmt_time(percentile(s, 99))] for name, s in rows]


def build_skload(workdir: Path) -> Path:
    """Compiles bench/skload.c, our protocol's counterpart of redis-benchmark (a C load generator)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("a C compiler is needed for the throughput part (apt-get install gcc)")
    binary = workdir / "skload"
    source = Path(__file__).with_name("skload.c")
    subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], check=True)
    return binary


def throughput(skload: Path, path: Path, clients: int, seconds: float) -> float:
    done = subprocess.run(
        [str(skload), str(path), str(clients), str(seconds), "lookup"],
        capture_output=True,
        text=True,
        check=True,
    )
    rate, errors = done.stdout.split()
    if int(errors):
        raise RuntimeError(f"{errors} lookups failed under load")
    return float(rate)


def redis_benchmark(redis_url: str, clients: int) -> float:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return float("nan")
    sock = redis_url.removeprefix("unix://")
    done = subprocess.run(
        [binary, "-s", sock, "-t", "ping", "-c", str(clients), "-n", str(max(50000, clients * 5000)), "-q"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rates = [float(m) for m in re.findall(r"PING_MBULK: ([\d.]+) requests per second", done.stdout)]
    return rates[0] if rates else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput point")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="skb-", dir="/tmp"))
    try:
        with redis_server() as url:
            daemon = BenchDaemon(workdir, redis_url=url).start()
            try:
                restore = restore_rows(daemon, url, sizes)
                lookups = lookup_rows(daemon)
                rates = []
                skload = build_skload(workdir)
                for n in (int(c) for c in args.clients.split(",")):
                    ours = throughput(skload, daemon.socket, n, args.seconds)
                    theirs = redis_benchmark(url, n)
                    rates.append([str(n), f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}×"])
            finally:
                daemon.cleanup()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "\n\n".join([
        "Restore over the socket, zero-copy to CPU tensors (one tensor of the given size):\n\n"
        + table(["size", "restore p50", "restore p99", "numpy memcpy", "redis-py GET", "memcpy/restore",
                 "GET/restore"], restore),
        "Lookups, token encoding in the client and hashing in the daemon included:\n\n"
        + table(["operation", "p50", "p99"], lookups),
        "Small operations per second: lookup misses driven by `bench/skload.c` (one epoll thread, one "
        "request outstanding per connection, as redis-benchmark does) beside `redis-benchmark -t ping` "
        "(PING_MBULK) with as many connections:\n\n"
        + table(["clients", "skippyd lookups/s", "redis ping/s", "ratio"], rates),
    ])  # fmt: skip
    print(text)
    if args.write_docs:
        write_section("daemon", f"Machine: {machine()}. `python -m bench.daemon`, one run.\n\n{text}")


if __name__ == "__main__":
    main()
