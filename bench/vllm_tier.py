"""skippyd as vLLM's secondary tier, through vLLM 0.33's own TieringOffloadingManager, one run.

Run in vLLM's environment against a daemon from .venv (scripts/vllm-env.sh builds the environment):

    SKIPPYD_DAEMON_PYTHON=.venv/bin/python PYTHONPATH=. $(scripts/vllm-env.sh) -m bench.vllm_tier

* promotion (load) of 16 chunks from skippyd into the CPU primary tier's slots, from the step that
  schedules it to the job reported, beside a numpy memcpy of the same bytes, hot (the same buffers
  copied again and again, in the CPU caches) and cold (after a sweep of 256 MiB, as a chunk that sat in
  skippyd is); chunks of 256 KiB (the issue's size) and of 2 MiB (one 16-token block of a Llama-3-8B
  in bf16: 16 x 128 KiB);
* cascade (store) of 16 chunks, from the completed GPU->CPU store to the job reported, likewise (with
  the tier's default ``durable``, whose L3 writes of earlier jobs run beside it, and without); a put is
  answered once its slots are reserved, its copy out of staging behind the reply, so the job is reported
  before the chunks are readable elsewhere: "until committed" runs on until a ping on the tier's store
  connection is answered (the daemon answers a connection's next request once the copies behind its
  last reply have committed), the sustained figure;
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

CHUNKS = (256 * 1024, 2 << 20)
COUNT = 16
TIER = {"type": "SkippydTier", "module_path": "skippyd.integrations.vllm"}


def _key(i: int, salt: str = "") -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return bytes(make_offload_key(hashlib.sha256(f"{salt}block {i}".encode()).digest(), 0))


def _fill(key: bytes, size: int) -> bytes:
    return (hashlib.sha256(key).digest() * (size // 32))[:size]


_SWEEP: list[np.ndarray] = []  # 256 MiB, made at the first sweep (not when the module is imported)


def _evict_caches() -> None:
    """Sweeps 256 MiB through the CPU caches, so what is copied next comes from memory."""
    if not _SWEEP:
        _SWEEP.append(np.ones(256 << 20, dtype=np.uint8))
    np.copyto(_SWEEP[0][: 128 << 20], _SWEEP[0][128 << 20 :])


def _memcpy(nbytes: int, *, cold: bool, reps: int = 9) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    samples = []
    for _ in range(reps):
        if cold:
            _evict_caches()
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return median(samples)


def _engine(socket: Path, chunks: int, size: int, *, durable: bool = True) -> Engine:
    tier = {**TIER, "socket": str(socket), "durable": durable}
    return Engine(tier, num_chunks=chunks, bytes_per_block=size)


def _committed(engine: Engine) -> None:
    """Returns once the copies behind the replies to the tier's stores have committed (every chunk stored
    is readable elsewhere): the daemon answers a connection's next request only then."""
    assert engine.tier._clients["store"].ping()


def _cascade(engine: Engine, keys: list[bytes]) -> tuple[float, float]:
    """Seconds to the job reported, and to its chunks committed."""
    with engine.manager.lock:
        out = engine.manager.prepare_store(keys, engine.ctx)
    assert out is not None
    slot = engine.slot
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        engine.flat[int(chunk) * slot : (int(chunk) + 1) * slot] = _fill(bytes(key), slot)
    _evict_caches()  # the GPU->CPU copy of a real store leaves the slots in memory, not in the caches
    start = time.perf_counter()
    with engine.manager.lock:
        engine.manager.complete_store(out.keys_to_store, engine.ctx)
    engine.end_step()
    engine.tier.drain_jobs()
    elapsed = time.perf_counter() - start
    _committed(engine)
    committed = time.perf_counter() - start
    engine.end_step()
    return elapsed, committed


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
    _evict_caches()
    start = time.perf_counter()
    engine.end_step()
    engine.tier.drain_jobs()
    elapsed = time.perf_counter() - start
    engine.end_step()
    got = engine.load(keys)
    assert got == [_fill(k, engine.slot) for k in keys], "a promoted chunk differs from what was stored"
    return elapsed


def _settle(daemon: BenchDaemon) -> None:
    """Waits (3 s at most) until the daemon's reserve has stocked the block group the first round used,
    so the timed rounds see a long-running daemon, not one faulting its reserve in beside them."""
    import skippyd

    with skippyd.Client(daemon.socket) as client:
        last, deadline = -1, time.monotonic() + 3
        while time.monotonic() < deadline:
            free = client.stats()["l2"]["block_free_slots"]
            if free == last:
                return
            last = free
            time.sleep(0.2)


def _rows(daemon: BenchDaemon, size: int, reps: int, *, durable: bool = True) -> list[list[str]]:
    hot, cold = _memcpy(COUNT * size, cold=False), _memcpy(COUNT * size, cold=True)
    cascades, commits, promotions, lookups = [], [], [], []
    import skippyd

    with skippyd.Client(daemon.socket) as client:
        stored_before = client.stats()["ops"]["block_put_stored"]
    engine = _engine(daemon.socket, 2 * COUNT, size, durable=durable)  # long-lived: warm connections
    try:
        for rep in range(reps + 2):  # two rounds untimed: connections, staging, the reserve's stock
            if rep == 1:
                _settle(daemon)
            keys = [_key(i, f"{size}-{durable}-r{rep}") for i in range(COUNT)]
            cascade, committed = _cascade(engine, keys)
            evict = [_key(i, f"{size}-{durable}-r{rep}-evict") for i in range(2 * COUNT)]
            _cascade(engine, evict)  # the first 16 out of the primary tier, committed
            elapsed, answers = _ask(engine, keys)
            assert set(answers) == {"HIT_PENDING"}, answers
            promotion = _promote(engine, keys)
            if rep > 1:
                cascades.append(cascade)
                commits.append(committed)
                lookups.append(elapsed)
                promotions.append(promotion)
    finally:
        engine.close()
    with skippyd.Client(daemon.socket) as client:  # every cascade stored all its chunks: none was held
        assert client.stats()["ops"]["block_put_stored"] - stored_before == (reps + 2) * 3 * COUNT
    label = f"{COUNT} × {size >> 10} KiB" if size < 1 << 20 else f"{COUNT} × {size >> 20} MiB"
    if not durable:
        label += ", durable off"

    def row(name: str, value: float) -> list[str]:
        return [f"{label}: {name}", fmt_time(value), f"{value / hot:.2f}×", f"{value / cold:.2f}×"]

    references = [row("numpy memcpy, hot (reference)", hot), row("numpy memcpy, cold (reference)", cold)]
    return [
        *(references if durable else []),
        row("promotion skippyd → primary slots", median(promotions)),
        row("cascade primary slots → skippyd", median(cascades)),
        row("cascade, until committed", median(commits)),
        [f"{label}: lookup of the request (RETRY → answer)", fmt_time(median(lookups)), "-", "-"],
    ]


def measure(workdir: Path, reps: int) -> tuple[list[list[str]], list[list[str]]]:
    daemon = BenchDaemon(workdir / "d", budget="2GiB").start()
    try:
        rows = [row for size in CHUNKS for row in _rows(daemon, size, reps)]
        # the default tier writes every chunk to L3 too: the same job without that background work
        rows += _rows(daemon, CHUNKS[-1], reps, durable=False)
        import skippyd

        size = CHUNKS[0]
        with skippyd.Client(daemon.socket) as client:
            before = client.stats()["l2"]["block_bytes"]
        one, two = _engine(daemon.socket, 2 * COUNT, size), _engine(daemon.socket, 2 * COUNT, size)
        try:
            shared = [_key(i, "shared") for i in range(COUNT)]
            _cascade(one, shared + [_key(i, "one") for i in range(COUNT)])  # each committed
            _cascade(two, shared + [_key(i, "two") for i in range(COUNT)])
            with skippyd.Client(daemon.socket) as client:
                held = client.stats()["l2"]["block_bytes"] - before
            alone = 2 * 2 * COUNT * size
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
        f"Through vLLM {vllm.__version__}'s TieringOffloadingManager and CPU primary tier (16 chunks a job; "
        f"median of {args.reps}; ratios: time ÷ a numpy memcpy of the same bytes, hot in the CPU caches or "
        "cold after a 256 MiB sweep, as the chunks a promotion or cascade moves are; target ≤ 2× a memcpy; "
        "the caches are swept before every timed promotion and cascade):\n\n"
        + table(["operation", "median", "÷ hot memcpy", "÷ cold memcpy"], rows),
        "Two vLLM instances on one host:\n\n"
        + table(["workload", "skippyd holds", "two private tiers would hold", "ratio"], sharing),
    ])  # fmt: skip
    print(text)
    if args.write_docs:
        write_section("vllm_tier", f"Machine: {machine()}. `python -m bench.vllm_tier`, one run.\n\n{text}")


if __name__ == "__main__":
    main()
