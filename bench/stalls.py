"""Stalls: how long a cheap request waits while the daemon does work that grows with the cache.

    python -m bench.stalls [--compare TREE] [--scale F]

A daemon (no Redis, L2 on tmpfs) from this tree, or from ``--compare TREE`` as well (a checkout of an
older commit: ``git worktree add /tmp/before <commit>`` and its C extension built there), each scenario
run against each daemon in turn. A probe client times a cheap request in a loop (``blocks_contains`` of
a space of its own, or ``ping``) before and while the work runs; the table shows its p50, p99 and max,
and how long the work took. Work done under a tier's lock in one piece, or on the event loop, shows up
as the probe's max:

* **leased free slots**: a client holds views of 512 blocks in each of 16 block spaces, those blocks
  are evicted (their slots stay read under its leases), then puts of 2,048 blocks fill a 64 MiB L2;
* **evict all blocks**: ``evict(all=True)`` of 120,000 blocks of 4 KiB;
* **recency flush**: 120,000 blocks read in a loop for 6 s (one housekeeping flush of their recency);
* **L3 evictions**: 3 GiB of 1 MiB blocks put with ``durable="sync"`` through a 2 GiB L3 on the real
  disk (``/var/tmp``): each write past the budget evicts 15 % of it; the probe is a ``lookup`` (a look
  at L3 under its lock).

``--scale`` multiplies the block counts (0.25 for a quick look). Figures are from this machine: compare
trees in one run, quote ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import skippyd

HERE = str(Path(__file__).resolve().parents[1])
BLOCK = 4096


@contextlib.contextmanager
def daemon(tree: str, budget: str = "1GiB", l3: str | None = None) -> Iterator[str]:
    """A daemon of ``tree`` on a fresh state and tmpfs directory (and an L3 of ``l3`` bytes on the real
    disk, else none); yields its socket."""
    work = Path(tempfile.mkdtemp(prefix="skippyd-stalls-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="skippyd-stalls-", dir="/dev/shm"))
    sock = str(work / "s.sock")
    disk = ["--l3-dir", str(work / "l3"), "--l3-budget", l3] if l3 else ["--l3-dir", "off"]
    args = [sys.executable, "-m", "skippyd", "serve", "--socket", sock, "--state-dir", str(work / "state"),
            "--shm-dir", str(shm / "l2"), "--redis-url", "none", "--l2-budget", budget, "--l2-reserve", "0",
            "--l2-digest-backlog", "0", *disk]  # fmt: skip
    log = (work / "daemon.log").open("w")
    proc = subprocess.Popen(  # (cwd: ``-m`` puts the working directory before PYTHONPATH)
        args, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(skippyd.SkippydError), skippyd.Client(sock, connect_timeout=1) as client:
                if client.ping():
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(
                f"the daemon of {tree} did not start: {(work / 'daemon.log').read_text()[-500:]}"
            )
        yield sock
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


class Probe:
    """Times ``request`` in a loop on a thread of its own until stopped: the samples, in seconds."""

    def __init__(self, request: Callable[[], object]) -> None:
        self.request = request
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self.request()
            self.samples.append(time.perf_counter() - started)
            time.sleep(0.002)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(120)


def spread(samples: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max in ms."""
    ordered = sorted(samples) or [0.0]
    return (
        statistics.median(ordered) * 1e3,
        ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
        ordered[-1] * 1e3,
    )


def payload(count: int) -> list[torch.Tensor]:
    return [torch.full((BLOCK,), i % 251, dtype=torch.uint8) for i in range(count)]


def keys_of(space: Any, count: int, start: int = 0) -> list[bytes]:
    return list(space.keys(np.arange(start * 16, (start + count) * 16, dtype=np.uint32)))


def put_chains(space: Any, count: int, data: list[torch.Tensor], step: int = 256) -> list[bytes]:
    """``count`` blocks put ``step`` at a time, each put a chain of its own (as an engine's requests put
    theirs); their keys."""
    keys: list[bytes] = []
    for at in range(0, count, step):
        part = keys_of(space, min(step, count - at), 1_000_000 + at)
        space.put(part, data[: len(part)], durable=False)
        keys += part
    return keys


def leased_free_slots(sock: str, scale: float) -> tuple[float, list[float]]:
    spaces, each = 16, max(64, int(512 * scale))
    with skippyd.Client(sock) as client, skippyd.Client(sock) as holder, skippyd.Client(sock) as prober:
        data = payload(2048)
        held = []
        for n in range(spaces):
            space = client.blocks(model="stall", state="s", namespace=f"held{n}", block_tokens=16)
            keys = put_chains(space, each, data)
            views = holder.blocks(model="stall", state="s", namespace=f"held{n}", block_tokens=16)
            held.append(views.get(keys))  # (the views hold the leases)
            client.evict(model="stall", state="s", namespace=f"held{n}", blocks=True)
        probe_space = prober.blocks(model="probe", state="s", block_tokens=16)
        probe_keys = keys_of(probe_space, 4)
        probe_space.put(probe_keys, data[:4], durable=False)
        big = client.blocks(model="big", state="s", block_tokens=16)
        with Probe(lambda: probe_space.contains(probe_keys)) as probe:
            started = time.perf_counter()
            for round_ in range(max(2, int(10 * scale))):
                big.put(keys_of(big, 2048, round_ * 2048), data, durable=False)
            took = time.perf_counter() - started
        del held
        return took, probe.samples


def evict_all_blocks(sock: str, scale: float) -> tuple[float, list[float]]:
    count = max(4096, int(120_000 * scale))
    with skippyd.Client(sock) as client, skippyd.Client(sock) as prober:
        space = client.blocks(model="stall", state="s", block_tokens=16)
        put_chains(space, count, payload(256))
        probe_space = prober.blocks(model="probe", state="s", block_tokens=16)
        probe_keys = keys_of(probe_space, 4)
        with Probe(lambda: probe_space.contains(probe_keys)) as probe:
            time.sleep(0.5)
            started = time.perf_counter()
            client.evict(all=True)
            took = time.perf_counter() - started
            time.sleep(0.3)
        return took, probe.samples


def recency_flush(sock: str, scale: float) -> tuple[float, list[float]]:
    count = max(4096, int(120_000 * scale))
    with skippyd.Client(sock) as client, skippyd.Client(sock) as prober:
        space = client.blocks(model="stall", state="s", block_tokens=16)
        keys = put_chains(space, count, payload(256))
        probe_space = prober.blocks(model="probe", state="s", block_tokens=16)
        probe_keys = keys_of(probe_space, 4)
        probe_space.put(probe_keys, payload(4), durable=False)
        with Probe(lambda: probe_space.contains(probe_keys)) as probe:
            started = time.perf_counter()
            while time.perf_counter() - started < 6.0:  # (the housekeeping flushes every 5 s)
                for at in range(0, count, 256):
                    got = space.get(keys[at : at + 256])  # touched: their recency is flushed later
                    del got
            took = time.perf_counter() - started
        return took, probe.samples


def l3_evictions(sock: str, scale: float) -> tuple[float, list[float]]:
    count = max(256, int(3072 * scale))  # 1 MiB blocks through an L3 of two thirds of them
    with skippyd.Client(sock) as client, skippyd.Client(sock) as prober:
        space = client.blocks(model="stall", state="s", block_tokens=16)
        data = [torch.full((1 << 20,), i % 251, dtype=torch.uint8) for i in range(64)]
        with Probe(lambda: prober.lookup(model="probe", state="s", tokens=[1, 2, 3])) as probe:
            started = time.perf_counter()
            for at in range(0, count, 64):
                space.put(keys_of(space, 64, at), data, durable="sync")
            took = time.perf_counter() - started
        return took, probe.samples


#: name -> (the work, the L2 budget it runs against, the L3 budget or None)
SCENARIOS: dict[str, tuple[Callable[[str, float], tuple[float, list[float]]], str, str | None]] = {
    "leased free slots (16 spaces), puts into a full L2": (leased_free_slots, "64MiB", None),
    "evict all blocks": (evict_all_blocks, "1GiB", None),
    "recency flush of blocks read": (recency_flush, "1GiB", None),
    "L3 evictions (sync puts through a full L3)": (l3_evictions, "1GiB", "L3"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compare", metavar="TREE", help="another checkout whose daemon runs beside this one's"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the block counts (default 1)")
    parser.add_argument("--only", metavar="TEXT", help="only the scenarios whose name contains TEXT")
    args = parser.parse_args(argv)
    trees = [("before", args.compare)] if args.compare else []
    trees.append(("this tree", HERE))
    rows = []
    for name, (scenario, budget, l3) in SCENARIOS.items():
        if args.only and args.only not in name:
            continue
        l3_budget = f"{max(256, int(2048 * args.scale))}MiB" if l3 else None
        for label, tree in trees:
            with daemon(tree, budget, l3_budget) as sock:
                took, samples = scenario(sock, args.scale)
            p50, p99, most = spread(samples)
            rows.append((name, label, p50, p99, most, took, len(samples)))
            print(f"  {name} / {label}: max {most:.1f} ms", file=sys.stderr, flush=True)
    print(f"\nbench.stalls: a probe request's latency while the daemon works ({os.cpu_count()} CPUs)\n")
    print("| scenario | daemon | probe p50 ms | p99 ms | max ms | work s | probes |")
    print("|----------|--------|--------------|--------|--------|--------|--------|")
    for name, label, p50, p99, most, took, n in rows:
        print(f"| {name} | {label} | {p50:.2f} | {p99:.2f} | {most:.1f} | {took:.2f} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
