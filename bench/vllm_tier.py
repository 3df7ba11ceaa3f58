"""skippyd as vLLM's secondary tier, through vLLM 0.33's own TieringOffloadingManager, one run.

Run in vLLM's environment against a daemon from .venv (scripts/vllm-env.sh builds the environment):

    SKIPPYD_DAEMON_PYTHON=.venv/bin/python PYTHONPATH=. $(scripts/vllm-env.sh) -m bench.vllm_tier

* promotion (load) of 16 chunks of 256 KiB from skippyd into the CPU primary tier's slots, from the
  step that schedules it to the job reported, beside a numpy memcpy of the same 4 MiB;
* cascade (store) of 16 chunks, from the completed GPU->CPU store to the job reported, likewise;
* lookup: from a request's first lookup (RETRY) to the manager's answer, per request of 16 chunks;
* two instances sharing the host: what skippyd holds after both offload 16 shared and 16 own chunks,
  against what two private tiers would hold.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._common import BenchDaemon, fmt_time, machine, median, table, write_section
from bench._vllm import Engine

CHUNK = 256 * 1024
COUNT = 16
TIER = {"type": "SkippydTier", "module_path": "skippyd.integrations.vllm"}


def _key(i: int, salt: str = "") -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return bytes(make_offload_key(hashlib.sha256(f"{salt}block {i}".encode()).digest(), 0))


def _fill(key: bytes) -> bytes:
    return (hashlib.sha256(key).digest() * (CHUNK // 32))[:CHUNK]


def _memcpy(nbytes: int, reps: int = 9) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return median(samples)


def _engine(socket: Path, chunks: int) -> Engine:
    return Engine({**TIER, "socket": str(socket)}, num_chunks=chunks, bytes_per_block=CHUNK)


def _cascade(engine: Engine, keys: list[bytes]) -> float:
    with engine.manager.lock:
        out = engine.manager.prepare_store(keys, engine.ctx)
    assert out is not None
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        engine.flat[int(chunk) * engine.slot : (int(chunk) + 1) * engine.slot] = _fill(bytes(key))
    start = time.perf_counter()
    with engine.manager.lock:
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
    engine.end_step()
    engine.tier.drain_jobs()
    elapsed = time.perf_counter() - start
    engine.end_step()
    return elapsed


def _ask(engine: Engine, keys: list[bytes]) -> tuple[float, list[str]]:
    """Looks every key up until the manager stops saying RETRY: the time it took and the answers."""
    from vllm.v1.kv_offload.base import LookupResult

    start = time.perf_counter()
    while True:
        with engine.manager.lock:
            answers = [engine.manager.lookup(k, engine.ctx) for k in keys]
        if all(a is not LookupResult.RETRY for a in answers):
            return time.perf_counter() - start, [a.name for a in answers]
        engine.end_step()
        time.sleep(0.0005)


def _promote(engine: Engine, keys: list[bytes]) -> float:
    """From the step that flushes the promotions (submit_load) to the load reported."""
    start = time.perf_counter()
    engine.end_step()
    engine.tier.drain_jobs()
    elapsed = time.perf_counter() - start
    engine.end_step()
    got = engine.load(keys)
    assert got == [_fill(k) for k in keys], "a promoted chunk differs from what was stored"
    return elapsed


def measure(workdir: Path, reps: int) -> tuple[list[list[str]], list[list[str]]]:
    daemon = BenchDaemon(workdir / "d", budget="1GiB").start()
    rows: list[list[str]] = []
    try:
        memcpy = _memcpy(COUNT * CHUNK)
        cascades, promotions, lookups = [], [], []
        engine = _engine(daemon.socket, 2 * COUNT)  # one long-lived instance: its connections are warm
        try:
            for rep in range(reps + 1):  # the first round sets up the connections and staging: not timed
                keys = [_key(i, f"r{rep}") for i in range(COUNT)]
                cascade = _cascade(engine, keys)
                _cascade(engine, [_key(i, f"r{rep}-evict") for i in range(2 * COUNT)])  # out of the primary
                elapsed, answers = _ask(engine, keys)
                assert set(answers) == {"HIT_PENDING"}, answers
                promotion = _promote(engine, keys)
                if rep:
                    cascades.append(cascade)
                    lookups.append(elapsed)
                    promotions.append(promotion)
        finally:
            engine.close()
        rows = [
            ["numpy memcpy of 16 × 256 KiB (reference)", fmt_time(memcpy), "1.00×"],
            ["promotion: 16 chunks skippyd → primary slots", fmt_time(median(promotions)),
             f"{median(promotions) / memcpy:.2f}×"],
            ["cascade: 16 chunks primary slots → skippyd", fmt_time(median(cascades)),
             f"{median(cascades) / memcpy:.2f}×"],
            ["lookup of a 16-chunk request (RETRY → answer)", fmt_time(median(lookups)), "-"],
        ]  # fmt: skip
        import skippyd

        with skippyd.Client(daemon.socket) as client:
            before = client.stats()["l2"]["block_bytes"]
        one, two = _engine(daemon.socket, 2 * COUNT), _engine(daemon.socket, 2 * COUNT)
        try:
            shared = [_key(i, "shared") for i in range(COUNT)]
            _cascade(one, shared + [_key(i, "one") for i in range(COUNT)])
            _cascade(two, shared + [_key(i, "two") for i in range(COUNT)])
            with skippyd.Client(daemon.socket) as client:
                held = client.stats()["l2"]["block_bytes"] - before
            alone = 2 * 2 * COUNT * CHUNK
            sharing = [["two instances, 16 shared + 16 own chunks each", f"{held / 2**20:.1f} MiB",
                        f"{alone / 2**20:.1f} MiB", f"{held / alone:.2f}"]]  # fmt: skip
        finally:
            one.close()
            two.close()
    finally:
        daemon.cleanup()
    return rows, sharing


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    import vllm

    workdir = Path(tempfile.mkdtemp(prefix="skvb-", dir="/tmp"))
    try:
        rows, sharing = measure(workdir, args.reps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "\n\n".join([
        f"Through vLLM {vllm.__version__}'s TieringOffloadingManager and CPU primary tier (chunks of "
        f"256 KiB; median of {args.reps}; ratios: time ÷ a numpy memcpy of the same 4 MiB, target ≤ 2×):\n\n"
        + table(["operation", "median", "÷ memcpy"], rows),
        "Two vLLM instances on one host:\n\n"
        + table(["workload", "skippyd holds", "two private tiers would hold", "ratio"], sharing),
    ])  # fmt: skip
    print(text)
    if args.write_docs:
        write_section("vllm_tier", f"Machine: {machine()}. `python -m bench.vllm_tier`, one run.\n\n{text}")


if __name__ == "__main__":
    main()
