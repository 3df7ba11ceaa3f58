"""The daemon's own work for a ``blocks_get``, in-process: what bounds a restore of small blocks.

    python -m bench.blocks_get [--blocks 2048] [--reps 50] [--compare TREE]

Puts ``--blocks`` blocks of 256 KiB (in puts of 256) into an L2 tier on tmpfs, then times gets of 256 keys
as the handler serves them (key checks, binding, the lease, placements, the touch; descriptors closed):
no socket, no msgpack. ``--compare TREE`` runs the same from another checkout (a ``git worktree`` with
its C extension built: ``python setup.py build_ext --inplace`` there) in a subprocess, five times each,
alternating, and prints both. µs a block, medians of ``--reps`` calls a run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SLOT = 256 << 10
PER_GET = 256


def measure(blocks: int, reps: int) -> float:
    """Median µs a block of a get of ``PER_GET`` keys, over ``reps`` passes over ``blocks`` blocks."""
    from skippyd.blocks import BlockRules
    from skippyd.handlers import _block_keys, _blocks_reply
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier

    shm = Path(tempfile.mkdtemp(prefix="skippyd-bench-get-", dir="/dev/shm"))
    try:
        with L2Tier.open(shm, (blocks + 64) * SLOT) as tier:
            rules = BlockRules(tier)
            space = block_space("bench-get@sha256:1", "kv", "", 16)
            keys = [os.urandom(32) for _ in range(blocks)]
            raw = bytes(PER_GET * SLOT)
            offsets = [i * SLOT for i in range(PER_GET)]
            for start in range(0, blocks, PER_GET):
                batch = keys[start : start + PER_GET]
                sizes, at = [SLOT] * len(batch), offsets[: len(batch)]
                rules.put(space, batch, sizes, at, memoryview(raw), durable=False)

            def one_pass() -> None:
                for start in range(0, blocks, PER_GET):
                    asked = _block_keys({"keys": keys[start : start + PER_GET]})
                    reply = _blocks_reply(rules.get(space, asked, max_fds=8, may_read=False))
                    for fd in reply.fds:
                        os.close(fd)

            for _ in range(5):
                one_pass()
            samples = []
            for _ in range(reps):
                began = time.perf_counter()
                one_pass()
                samples.append(time.perf_counter() - began)
        return statistics.median(samples) / blocks * 1e6
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--compare", metavar="TREE", help="another checkout to run beside this one")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a compare run's child
    args = parser.parse_args()
    if args.one or not args.compare:
        figure = measure(args.blocks, args.reps)
        print(f"{figure:.3f}" if args.one else f"blocks_get, daemon's work: {figure:.2f} µs a block")
        return
    from bench._common import alternate

    lines = alternate("blocks_get", args.compare, ["--blocks", str(args.blocks), "--reps", str(args.reps)])
    runs = {name: [float(line.split()[-1]) for line in got] for name, got in lines.items()}
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    shown = {name: ", ".join(f"{v:.2f}" for v in values) for name, values in runs.items()}
    print(f"blocks_get, daemon's work, µs a 256 KiB block ({args.blocks} blocks, gets of {PER_GET})\n")
    print("| tree | median | runs | after ÷ before |")
    print("|------|--------|------|----------------|")
    print(f"| before ({args.compare}) | {before:.2f} | {shown['before']} | |")
    print(f"| after (this tree) | {after:.2f} | {shown['after']} | {after / before:.2f}× |")


if __name__ == "__main__":
    main()
