"""L2 tier, one run, side by side: memcpy vs admit vs zero-copy restore vs copy restore vs Redis.

    python -m bench.l2 [--sizes 1,16,64,256] [--write-docs]

Every figure is the median of several calls in this one run; ratios compare against the numpy copy
into a preallocated array measured in the same run (the memcpy reference), since these 2-core machines
are too noisy for absolute times to mean much.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import redis
import torch

from bench._common import admit as admit_entry
from bench._common import fmt_rate, fmt_time, machine, median, redis_server, table, timed, write_section
from skippyd.client import tensors as skt
from skippyd.keys import Identity, cache_key, encode_tokens
from skippyd.l2 import L2Tier
from skippyd.payload import TensorDecl

MiB = 1 << 20
IDENT = Identity("bench-model", "bench-state")


def _reps(nbytes: int) -> int:
    return max(5, min(40, (512 * MiB) // max(nbytes, 1)))


def bench_size(size_mib: int, workdir: Path, redis_url: str) -> list[list[str]]:
    nbytes = size_mib * MiB
    reps = _reps(nbytes)
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    target.fill(1)
    memcpy = median(timed(lambda: np.copyto(target, source), reps=reps))

    decls = [TensorDecl("kv", "uint8", (nbytes,))]
    budget = 4 * L2Tier.file_size_for(token_count=1, tensors=decls)
    tier = L2Tier.open(workdir / f"l2-{size_mib}", budget)
    counter = iter(range(10**9))

    def admit() -> None:
        key = cache_key(IDENT, encode_tokens([next(counter)]))
        admit_entry(tier, key, IDENT, decls, [source])

    for _ in range(5):  # fill past the budget so every timed admission evicts and recycles
        admit()
    admit_warm = median(timed(admit, reps=reps))
    assert tier.stats().reused_files >= reps
    admit_cold = median(timed(admit, reps=max(3, reps // 4), setup=tier.clear))
    admit()
    entry = tier.entries()[-1].entry

    def zero_copy() -> None:
        held = tier.hold(entry.key)
        assert held is not None
        out = skt.map_entry(held.fd, held.data_offset, held.entry.data_len, held.entry.tensors)
        os.close(held.fd)
        del out

    # The destination is allocated like the memcpy reference's (numpy, so transparent huge pages alike),
    # so the comparison isolates what reading from the tier costs.
    into = {"kv": torch.from_numpy(np.ones(nbytes, dtype=np.uint8))}

    def copy_restore() -> None:
        held = tier.hold(entry.key)
        assert held is not None
        skt.copy_entry(held.fd, held.data_offset, held.entry.data_len, held.entry.tensors, out=into)
        os.close(held.fd)

    zc = median(timed(zero_copy, reps=max(reps, 50)))
    cp = median(timed(copy_restore, reps=reps))
    check = tier.hold(entry.key)
    assert check is not None
    os.close(check.fd)
    assert np.array_equal(into["kv"].numpy(), source), "restored bytes differ"
    tier.close()

    client = redis.Redis.from_url(redis_url)
    blob = source.tobytes()
    client.set("bench", blob)
    redis_set = median(timed(lambda: client.set("bench", blob), reps=max(3, reps // 2)))
    redis_get = median(timed(lambda: client.get("bench"), reps=max(3, reps // 2)))
    client.delete("bench")
    client.close()

    def row(name: str, seconds: float) -> list[str]:
        return [
            f"{size_mib} MiB",
            name,
            fmt_time(seconds),
            fmt_rate(nbytes, seconds),
            f"{memcpy / seconds:.2f}×",
        ]

    return [
        row("numpy copy into preallocated (memcpy)", memcpy),
        row("admit: copy + BLAKE3, recycled memory", admit_warm),
        row("admit: copy + BLAKE3, fresh tmpfs pages", admit_cold),
        row("restore zero-copy (lease + mmap + tensors)", zc),
        row("restore with copy into preallocated tensor", cp),
        row("redis-py SET (hiredis)", redis_set),
        row("redis-py GET (hiredis)", redis_get),
        [f"{size_mib} MiB", "→ zero-copy restore vs redis-py GET", "", "", f"{redis_get / zc:.0f}× faster"],
    ]


def _describe_mount(path: str) -> str:
    best, options = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and path.startswith(parts[1]) and len(parts[1]) > len(best):
            best, options = parts[1], f"{parts[2]} {parts[3]}"
    return options or "unknown mount"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,16,64,256", help="payload sizes in MiB")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument(
        "--shm", default="/dev/shm", help="tmpfs to put the tier on (e.g. one mounted huge=always)"
    )
    parser.add_argument("--section", default="l2", help="docs/benchmarks.md section to write")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="skippyd-bench-", dir=args.shm))
    rows: list[list[str]] = []
    try:
        with redis_server() as url:
            for size in sizes:
                rows.extend(bench_size(size, workdir, url))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = table(["size", "operation", "median", "throughput", "vs memcpy"], rows)
    print(text)
    if args.write_docs:
        where = _describe_mount(args.shm)
        write_section(
            args.section,
            f"Machine: {machine()}. `python -m bench.l2 --shm {args.shm}` ({where}), one run; medians; "
            f"ratios are to the numpy copy measured in the same run.\n\n{text}",
        )


if __name__ == "__main__":
    main()
