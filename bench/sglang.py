"""skippyd as SGLang's HiCache storage backend, through SGLang 0.5.23's own host pool classes, one run.

Run in SGLang's environment against a daemon from .venv (scripts/sglang-env.sh builds the environment):

    SKIPPYD_DAEMON_PYTHON=.venv/bin/python PYTHONPATH=. $(scripts/sglang-env.sh) -m bench.sglang

One page is 64 tokens of a 7.2B-shape model: 8 KV heads × 128 × bf16 × 32 layers × K and V = 8 MiB.

* ``batch_set_v1`` of 64 pages (512 MiB) from SGLang's host pool into skippyd (fresh page hashes each
  time, so every page is copied; L2 has room for all of them), with ``durable`` off and on (on: the
  pages are queued for L3 and written to disk beside the next calls; the rows after wait until the L3
  writer is done);
* ``batch_get_v1`` of those 64 pages from skippyd's L2 straight into another host pool's pages, by page
  numbers into the pool's planes (``get_into_pages``, what the backend does) and, beside it, as each
  page's pieces (``get_into``, what it did before);
* both beside a numpy memcpy of the same 512 MiB, in the same run;
* for the page-first layout (two pieces a page: K and V) and the layer-first one (64 pieces a page);
* ``batch_exists`` of 128 page hashes, all held and none held;
* the same pages through skippyd's own ``BlockSpace.put``/``get_into`` (a contiguous buffer a page):
  what the backend adds to them.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import BenchDaemon, fmt_time, machine, median, table, write_section
from bench._sglang import host_indices, make_backend, make_pool, page_hashes

PAGES = 64


def _pool(layout: str) -> Any:
    return make_pool(layout, layers=32, heads=8, head_dim=128, page_size=64, pages=PAGES)


def _times(fn: Callable[[int], object], reps: int) -> list[float]:
    """Seconds per call of ``fn(rep)`` for ``reps`` calls, after one untimed warm-up (rep 0)."""
    fn(0)
    samples = []
    for rep in range(1, reps + 1):
        start = time.perf_counter()
        fn(rep)
        samples.append(time.perf_counter() - start)
    return samples


def _memcpy(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    return median(_times(lambda _: np.copyto(dst, src), reps))


def _settle(socket: Path) -> None:
    """Waits (2 min at most) until skippyd's digester has hashed and its L3 writer has written what the
    stores before left them, so the rows after do not share the machine with that work."""
    import skippyd

    with skippyd.Client(socket) as client:
        last, deadline = -1, time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = client.stats()
            written = int(stats["l3"]["block_count"])
            idle = not int(stats["l2"]["block_unhashed"]) and not int(stats["durable"]["block_queue_depth"])
            if idle and written == last:
                return
            last = written
            time.sleep(0.5)


def _rows(socket: Path, layout: str, reps: int, memcpy: float) -> tuple[list[list[str]], int]:
    import torch

    source, target = _pool(layout), _pool(layout)
    raw = source.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    indices = host_indices(source, list(range(PAGES)))
    rows: list[list[str]] = []
    page_bytes = 0
    keys: dict[str, list[str]] = {}
    for durable in (False, True):
        _settle(socket)
        backend = make_backend(source, {"socket": str(socket), "durable": durable, "timeout": 2.0})
        page_bytes = backend.page_bytes

        fresh = [page_hashes(PAGES, seed=rep + (1000 if durable else 0)) for rep in range(reps + 1)]

        def store(rep: int, backend: Any = backend, fresh: list[list[str]] = fresh) -> None:
            assert all(backend.batch_set_v1(fresh[rep], indices))
            keys["last"] = fresh[rep]

        took = median(_times(store, reps))
        label = f"batch_set_v1 64 × 8 MiB, {layout}, durable {'on' if durable else 'off'}"
        rows.append([label, fmt_time(took), f"{memcpy / took:.2f}×"])
        backend.close()
    _settle(socket)
    reader = make_backend(target, {"socket": str(socket), "timeout": 2.0})

    def load(_: int) -> None:
        assert all(reader.batch_get_v1(keys["last"], indices))

    took = median(_times(load, reps))
    # every page came back bit for bit (compared as bytes: random bits make NaNs of bf16)
    assert torch.equal(source.kv_buffer.view(torch.uint8), target.kv_buffer.view(torch.uint8))
    rows.append([f"batch_get_v1 64 × 8 MiB, {layout}", fmt_time(took), f"{memcpy / took:.2f}×"])
    planes, reader._planes = reader._planes, None  # the same loads as each page's pieces (get_into)
    target.kv_buffer.zero_()
    took = median(_times(load, reps))
    assert torch.equal(source.kv_buffer.view(torch.uint8), target.kv_buffer.view(torch.uint8))
    reader._planes = planes
    rows.append([f"... the same, as each page's pieces ({layout})", fmt_time(took), f"{memcpy / took:.2f}×"])
    hit = median(_times(lambda _: reader.batch_exists(keys["last"] * 2), reps * 5))  # 128 held
    absent = page_hashes(128, seed=3)
    miss = median(_times(lambda _: reader.batch_exists(absent), reps * 5))
    if layout == "page_first":
        rows.append(["batch_exists 128 keys, all held", fmt_time(hit), ""])
        rows.append(["batch_exists 128 keys, none held", fmt_time(miss), ""])
        rows += _plain_rows(socket, source, reps, memcpy)
    reader.close()
    return rows, page_bytes


def _plain_rows(socket: Path, pool: Any, reps: int, memcpy: float) -> list[list[str]]:
    """The same bytes through skippyd's own ``BlockSpace`` (one contiguous buffer a page, durable off):
    what the backend adds to skippyd's put and get_into."""
    import torch

    import skippyd

    pages = [pool.get_data_page(p * int(pool.page_size)).view(torch.uint8).clone() for p in range(PAGES)]
    out = [torch.empty_like(p) for p in pages]
    _settle(socket)
    with skippyd.Client(socket, timeout=60) as client:
        space = client.blocks(model="bench", state="plain", block_tokens=int(pool.page_size))
        fresh = [[b"plain %d %d" % (rep, i) for i in range(PAGES)] for rep in range(reps + 1)]
        put = median(_times(lambda rep: space.put(fresh[rep], pages, durable=False), reps))
        get = median(_times(lambda _: space.get_into(fresh[-1], out), reps))
    return [
        ["BlockSpace.put of the same pages (a buffer each)", fmt_time(put), f"{memcpy / put:.2f}×"],
        ["BlockSpace.get_into of the same pages", fmt_time(get), f"{memcpy / get:.2f}×"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--write-docs", action="store_true", help="replace the sglang section of benchmarks.md"
    )
    args = parser.parse_args()
    memcpy = _memcpy(PAGES * 8 << 20, args.reps)
    rows = [["numpy memcpy of the same 512 MiB", fmt_time(memcpy), "1.00×"]]
    for layout in ("page_first", "layer_first"):  # a fresh daemon each, with room for every page stored
        workdir = Path(tempfile.mkdtemp(prefix="sk-bench-sglang-"))
        daemon = BenchDaemon(workdir / "d", budget=f"{(3 * args.reps + 4) * 512}MiB").start()
        try:
            more, page_bytes = _rows(daemon.socket, layout, args.reps, memcpy)
            assert page_bytes == 8 << 20
            rows += more
        finally:
            daemon.cleanup()
            shutil.rmtree(workdir, ignore_errors=True)
    text = (
        f"SGLang HiCache storage through SGLang 0.5.23's host pools (64 pages of 8 MiB; speed relative to a "
        f"memcpy of the same bytes in this run; median of {args.reps}):\n\n"
        + table(["operation", "median", "÷ memcpy (speed)"], rows)
    )
    print(text)
    if args.write_docs:
        write_section("sglang", f"Machine: {machine()}. `python -m bench.sglang`, one run.\n\n{text}")


if __name__ == "__main__":
    main()
