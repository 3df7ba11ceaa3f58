"""The L3 tier, one run: verified loads beside plain reads, and restore latency by tier.

    python -m bench.l3 [--sizes 16,64,256] [--write-docs]

1. L3 restore (read + verify every segment and the payload digest) beside a plain sequential read of
   the same object file into the same preallocated buffer; the page cache is dropped for the file
   before every read (posix_fadvise DONTNEED on its clean pages), and again with it warm;
2. restore latency over the daemon's socket: an L2 hit alone (a daemon without L3), an L2 hit that L3
   vouches for, and an L3 hit (a cold fill into L2 memory), for the same payload size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench._common import (
    BenchDaemon,
    admit,
    borrow,
    fmt_rate,
    fmt_time,
    machine,
    median,
    percentile,
    table,
    timed,
    write_section,
)
from skippyd.keys import Identity, cache_key, encode_tokens
from skippyd.l2 import L2Tier
from skippyd.l3 import L3Store
from skippyd.payload import TensorDecl

MiB = 1 << 20
IDENT = Identity("bench-model", "bench-state")


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(path: Path, buffer: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buffer):
            done += os.preadv(fd, [buffer[done : done + (4 << 20)]], done)
    finally:
        os.close(fd)


def load_rows(sizes: list[int], workdir: Path) -> list[list[str]]:
    rows = []
    with (
        L2Tier.open(workdir / "shm", 2 * max(sizes) * MiB + 64 * MiB) as l2,
        L3Store.open(workdir / "l3", 1 << 40) as l3,
    ):
        for size in sizes:
            n = size * MiB
            key = cache_key(IDENT, encode_tokens([size]))
            data = np.random.default_rng(size).integers(0, 255, n, dtype=np.uint8)
            table_ = [TensorDecl("kv", "uint8", (n,))]
            admit(l2, key, IDENT, table_, [data])
            with borrow(l2, key) as (e, view):
                l3.write(e, view)
            l2.remove(key)
            stored = l3.get(key)
            assert stored is not None
            obj = next((workdir / "l3" / "objects").rglob(f"{stored.object}.obj"))
            buffer = memoryview(bytearray(n))
            buffer[:] = b"\x01" * n  # pre-faulted, like a preallocated tensor
            reps = max(3, min(15, 1024 // size))
            for cache in ("dropped", "warm"):
                setup = partial(drop_cache, obj) if cache == "dropped" else None
                plain = median(timed(partial(plain_read, obj, buffer), reps=reps, setup=setup))
                verified = median(timed(partial(l3.load_into, key, buffer), reps=reps, setup=setup))
                ratio = f"{plain / verified:.2f}×"
                rows.append(
                    [f"{size} MiB", f"page cache {cache}", fmt_rate(n, plain), fmt_rate(n, verified), ratio]
                )
    return rows


def latency_rows(size_mib: int, workdir: Path) -> list[list[str]]:
    import torch

    import skippyd

    n = size_mib * MiB
    payload = {"kv": torch.from_numpy(np.random.default_rng(7).integers(0, 255, n, dtype=np.uint8))}
    alone = BenchDaemon(workdir / "alone", "--l3-dir", "off")
    tiered = BenchDaemon(workdir / "tiered")
    rows = []
    try:
        for daemon in (alone, tiered):
            daemon.start()
            client = skippyd.Client(daemon.socket, timeout=120)
            for i in range(20):
                payload["kv"][0] = i  # distinct content per entry: each fill below is its own object
                client.capture(model="bench", state="s", tokens=[i, 1, 2], tensors=payload)
            while daemon is tiered and client.stats()["l3"]["writes"] < 20:
                time.sleep(0.05)

            def restore(c: object = client) -> None:
                restored = c.restore(model="bench", state="s", tokens=[0, 1, 2])  # type: ignore[attr-defined]
                assert restored is not None

            samples = timed(restore, reps=300)
            label = "L2 hit, no L3 configured" if daemon is alone else "L2 hit vouched for by L3"
            rows.append(
                [f"{size_mib} MiB", label, fmt_time(median(samples)), fmt_time(percentile(samples, 99))]
            )
            client.close()
        tiered.stop(wipe_tmpfs=True)
        tiered.start()
        client = skippyd.Client(tiered.socket, timeout=120)
        fills = []
        for i in range(1, 20):  # each a first (cold) fill: never promoted on the first sight
            started = time.perf_counter()
            restored = client.restore(model="bench", state="s", tokens=[i, 1, 2])
            fills.append(time.perf_counter() - started)
            assert restored is not None and restored.source == "l3"
            del restored
        rows.append([f"{size_mib} MiB", "L3 hit: cold fill (read + verify) into L2 memory",
                     fmt_time(median(fills)), fmt_time(percentile(fills, 99))])  # fmt: skip
        client.close()
    finally:
        alone.cleanup()
        tiered.cleanup()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="16,64,256", help="payload sizes in MiB for the load comparison")
    parser.add_argument("--latency-size", type=int, default=16, help="payload MiB for the latency comparison")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="skippyd-bench-l3-", dir="/var/tmp"))
    try:
        loads = load_rows([int(s) for s in args.sizes.split(",")], workdir)
        latency = latency_rows(args.latency_size, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "\n\n".join([
        "Verified L3 loads beside a plain read of the same file into the same preallocated buffer:\n\n"
        + table(["size", "cache", "plain read", "L3 read + verify", "L3 / plain"], loads),
        "Restore over the socket (zero-copy to CPU), by where the entry is:\n\n"
        + table(["size", "served as", "p50", "p99"], latency),
    ])  # fmt: skip
    print(text)
    if args.write_docs:
        write_section(
            "l3", f"Machine: {machine()}, L3 on the root filesystem. `python -m bench.l3`, one run.\n\n{text}"
        )


if __name__ == "__main__":
    main()
