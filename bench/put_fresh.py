"""A put of fresh blocks (slots the tier has never had pages for), in-process: the reply's wait and the
tier's lock.

    python -m bench.put_fresh [--blocks 2048] [--reps 5] [--compare TREE]

Puts ``--blocks`` blocks of 256 KiB as puts of 256 (64 MiB: what one staging half carries) into a new L2
tier on tmpfs (every slot fresh: its pages are allocated by the put), as the handler runs them: no
socket. Prints, medians over ``--reps`` runs: the time until the replies could go (``begin_put``: checks,
reservation and the slots' pages), the whole put (the copy and commit behind the replies too), and the
longest any other caller waited for the tier's lock meanwhile (a thread taking it every millisecond:
every ``contains``, ``get`` and ``put`` of the daemon takes it). ``--compare TREE`` runs the same from
another checkout (a ``git worktree``, its C extension built: ``python setup.py build_ext --inplace``
there) in a subprocess, alternating, five times each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SLOT = 256 << 10
PER_PUT = 256


def measure(blocks: int, reps: int) -> dict[str, float]:
    """Medians in ms: ``reply`` (all the puts' ``begin_put``), ``put`` (whole), ``lock_wait`` (longest)."""
    from skippyd.blocks import BlockRules
    from skippyd.config import Config
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier

    threads = Config().copy_thread_count
    raw = os.urandom(PER_PUT * SLOT)
    offsets = [i * SLOT for i in range(PER_PUT)]
    replies, puts, waits = [], [], []
    for _ in range(reps + 1):
        shm = Path(tempfile.mkdtemp(prefix="skippyd-bench-fresh-", dir="/dev/shm"))
        try:
            with L2Tier.open(shm, (blocks + 256) * SLOT) as tier:
                rules = BlockRules(tier, copy_threads=threads)
                space = block_space("bench-fresh@sha256:1", "kv", "", 16)
                keys = [os.urandom(32) for _ in range(blocks)]
                stop, longest = threading.Event(), [0.0]
                prober = threading.Thread(target=_probe, args=(tier.lock, stop, longest), daemon=True)
                prober.start()
                reply = 0.0
                began = time.perf_counter()
                for start in range(0, blocks, PER_PUT):
                    batch = keys[start : start + PER_PUT]
                    at = time.perf_counter()
                    job = rules.begin_put(space, batch, [SLOT] * len(batch), offsets[: len(batch)],
                                          memoryview(raw), durable=False)  # fmt: skip
                    reply += time.perf_counter() - at
                    job.finish()
                whole = time.perf_counter() - began
                stop.set()
                prober.join()
                replies.append(reply)
                puts.append(whole)
                waits.append(longest[0])
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    # the first run warms the process (imports, the copy pool): not counted
    return {
        "reply": statistics.median(replies[1:]) * 1e3,
        "put": statistics.median(puts[1:]) * 1e3,
        "lock_wait": statistics.median(waits[1:]) * 1e3,
    }


def _probe(lock: Any, stop: threading.Event, longest: list[float]) -> None:
    """Takes ``lock`` every millisecond until ``stop``; the longest wait for it in ``longest[0]``."""
    while not stop.is_set():
        began = time.perf_counter()
        with lock:
            pass
        longest[0] = max(longest[0], time.perf_counter() - began)
        time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compare", metavar="TREE", help="another checkout to run beside this one")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a compare run's child
    args = parser.parse_args()
    title = (
        f"A put of {args.blocks} fresh blocks of 256 KiB (puts of {PER_PUT}), in-process, ms (medians of "
        f"{args.reps}): until the replies, the whole put, the longest wait for the tier's lock meanwhile\n"
    )
    if args.one:
        print(json.dumps(measure(args.blocks, args.reps)))
        return
    if not args.compare:
        got = measure(args.blocks, args.reps)
        print(title)
        print("| replies | whole put | longest lock wait |\n|---|---|---|")
        print(f"| {got['reply']:.1f} | {got['put']:.1f} | {got['lock_wait']:.1f} |")
        return
    from bench._common import alternate

    lines = alternate("put_fresh", args.compare, ["--blocks", str(args.blocks), "--reps", str(args.reps)])
    runs = {name: [json.loads(line) for line in got] for name, got in lines.items()}
    print(title)
    print("| tree | replies | whole put | longest lock wait | runs (replies / put / lock wait) |")
    print("|------|---------|-----------|-------------------|----------------------------------|")
    for name, label in (("before", f"before ({args.compare})"), ("after", "after (this tree)")):
        med = {k: statistics.median(r[k] for r in runs[name]) for k in ("reply", "put", "lock_wait")}
        shown = "; ".join(f"{r['reply']:.0f} / {r['put']:.0f} / {r['lock_wait']:.1f}" for r in runs[name])
        print(f"| {label} | {med['reply']:.1f} | {med['put']:.1f} | {med['lock_wait']:.1f} | {shown} |")


if __name__ == "__main__":
    main()
