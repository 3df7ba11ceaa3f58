"""The GPU data path on one CUDA device, in one run: correctness, bandwidth beside pinned copies, TTFT.

    python -m bench.gpu [--socket PATH] [--skip-ttft] [--dry] [--profile DIR]

On the GPU machine (docs/benchmarks.md, "GPU"): ``bash .gpu/on_device.sh python3 -m bench.gpu`` (the
daemon on_device.sh starts is used through ``SKIPPYD_SOCKET``; without one, this starts its own, without
Redis). ``--dry`` runs every step with tiny sizes on the CPU (device "cpu"), to check the script itself
where there is no GPU: its numbers mean nothing.

1. **Bit-exact** for every dtype skippyd knows: a capture restored to the device, a capture *of* device
   tensors restored to the host, blocks read into device pages with ``get_into``, blocks ``put`` from
   (strided) device tensors; and a restore after the memory was given to other bytes: an entry file
   recycled for another entry (the same pages: its registration is kept), and slab slots punched and
   filled again (a new generation each).
2. **Bandwidth** beside a pinned host↔device copy of the same bytes, timed in this run: restore to
   CUDA and capture from CUDA of entries of 64 MiB, 512 MiB and 2 GiB (first restore, which registers
   the file, and warm); ``get_into`` device pages and ``put`` from device pages of 512 MiB in blocks of
   256 KiB, 1 MiB and 2 MiB (pages in order, and scattered so no two blocks merge).
3. **TTFT** with Llama-shape bf16 models (seeded random weights, ``sdpa``): 1.1B (hidden 2048, 16 layers,
   32 heads, 8 KV heads, intermediate 8192) and 7.2B (hidden 4096, 32 layers, 32 heads, 8 KV heads,
   intermediate 14336), at 8k and 32k tokens + 1 new token and 32k + 2k new tokens: a full prefill beside
   ``skt.restore(device="cuda")`` + the forward of the new tokens, with the ideal ratio (the KV at the
   pinned host→device rate, plus the forward of the new tokens alone) printed next to each.

Prints one table at the end (``ok`` compares each ratio with issue 22's target).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

MiB = 1 << 20
GiB = 1 << 30
MODEL, STATE = "bench-gpu@sha256:0", "kv"


@dataclass
class Row:
    section: str
    case: str
    measured: str
    reference: str
    ratio: float | None = None
    target: str = ""
    ok: str = ""


ROWS: list[Row] = []


def hashed(client: Any, timeout: float = 60.0) -> None:
    """Waits (``timeout`` at most) until the daemon's digester has hashed every block the puts before
    committed unhashed: rows timed after a large put would otherwise share the CPU with that BLAKE3."""
    deadline = time.monotonic() + timeout
    while int(client.stats()["l2"].get("block_unhashed", 0)) and time.monotonic() < deadline:
        time.sleep(0.05)


def row(section: str, case: str, measured: str, reference: str = "", ratio: float | None = None, *,
        target: float | None = None, higher: bool = True) -> None:  # fmt: skip
    ok = ""
    if target is not None and ratio is not None:
        ok = "yes" if (ratio >= target if higher else ratio <= target) else "NO"
    ROWS.append(Row(section, case, measured, reference, ratio, f"{'≥' if higher else '≤'} {target}"
                    if target is not None else "", ok))  # fmt: skip
    print(f"  {section:<9} {case:<44} {measured:>14} {reference:>14}"
          f" {'' if ratio is None else f'{ratio:.2f}×':>8} {ok}", flush=True)  # fmt: skip


def print_table() -> None:
    head = ("section", "case", "measured", "reference (same run)", "ratio", "target", "ok")
    cells = [head] + [
        (r.section, r.case, r.measured, r.reference, "" if r.ratio is None else f"{r.ratio:.2f}×", r.target,
         r.ok) for r in ROWS
    ]  # fmt: skip
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    print()
    for index, line in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# ---------------------------------------------------------------- the daemon


@contextlib.contextmanager
def daemon(socket: str | None, budget: str) -> Iterator[str]:
    """The daemon at ``socket``, or one started here (no Redis) for the run."""
    if socket:
        yield socket
        return
    root = Path(tempfile.mkdtemp(prefix="sk-gpu-"))
    shm = Path(tempfile.mkdtemp(prefix="skippyd-bench-gpu-", dir="/dev/shm"))
    path = str(root / "d.sock")
    log = (root / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippyd", "serve", "--socket", path, "--state-dir", str(root / "state"),
         "--shm-dir", str(shm), "--l2-budget", budget, "--redis-url", "none", "--node", "bench"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        import skippyd

        for _ in range(300):
            if os.path.exists(path) and skippyd.Client(path, timeout=2).ping():
                break
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited:\n{(root / 'daemon.log').read_text()}")
            time.sleep(0.05)
        yield path
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


# ---------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Median seconds of ``fn()`` until its device work is done (after one warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def settle(device: torch.device) -> None:
    """The device's work done and skippyd's copies' leases given back (so the daemon may reuse memory)."""
    sync(device)
    if device.type == "cuda":
        from skippyd.client.transfer.device import transfer

        transfer().drain()


def random_bytes(nbytes: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu()))


def pinned_rates(nbytes: int, device: torch.device) -> tuple[float, float]:
    """Seconds of a pinned host→device and device→host copy of ``nbytes``."""
    if device.type != "cuda":
        host, other = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        t = seconds(lambda: other.copy_(host), device)
        return t, t
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = seconds(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = seconds(lambda: host.copy_(dev, non_blocking=True), device)
    return h2d, d2h


# ---------------------------------------------------------------- 1. correctness


def correctness(client: Any, device: torch.device) -> None:
    from skippyd.payload import DTYPES

    dtypes = [d for name in DTYPES if isinstance(d := getattr(torch, name, None), torch.dtype)]
    bad = []
    for i, dtype in enumerate(dtypes):
        size = torch.tensor([], dtype=dtype).element_size()
        raw = random_bytes(size * 4099, 100 + i)
        host = (raw & 1 if dtype == torch.bool else raw).view(dtype)  # a bool's bytes are 0 or 1
        client.capture(model=MODEL, state=STATE, tokens=[1, i], tensors={"t": host}, durable=False)
        got = client.restore(model=MODEL, state=STATE, tokens=[1, i], device=device)
        if got is None or not same(got.tensors["t"], host):
            bad.append(f"restore {dtype}")
        client.capture(model=MODEL, state=STATE, tokens=[2, i], tensors={"t": host.to(device)}, durable=False)
        got = client.restore(model=MODEL, state=STATE, tokens=[2, i])
        if got is None or not same(got.tensors["t"], host):
            bad.append(f"capture {dtype}")
    row("exact", f"entries, {len(dtypes)} dtypes, both ways", "all equal" if not bad else ", ".join(bad))

    blocks = client.blocks(model=MODEL, state=STATE, block_tokens=16)
    nbytes, count = 256 * 1024, 16
    keys = blocks.keys(list(range(count * 16)))
    data = [random_bytes(nbytes, 200 + i) for i in range(count)]
    blocks.put(keys, data, durable=False)
    pages = torch.empty((count, nbytes), dtype=torch.uint8, device=device)
    n = blocks.get_into(keys, list(pages.unbind(0)))
    ok_into = n == count and all(same(pages[i], data[i]) for i in range(count))
    strided = random_bytes(count * nbytes, 300, device).view(torch.bfloat16).view(count, 64, nbytes // 128)
    views = [strided[i].t() for i in range(count)]  # non-contiguous device pieces
    put_keys = blocks.keys(list(range(50_000, 50_000 + count * 16)))
    blocks.put(put_keys, views, durable=False)
    got = blocks.get(put_keys)
    ok_put = len(got) == count and all(same(got[i], views[i].contiguous()) for i in range(count))
    row("exact", "blocks: get_into device pages, put from device", f"{ok_into and ok_put}")
    # pages named as pools and page numbers: 8 planes of 4 KiB rows, 2 pages a block (the staging path),
    # put from the device's pages and read back into others
    planes = [random_bytes(64 * 4096, 600 + j, device).view(64, 4096) for j in range(8)]
    into = [torch.zeros_like(plane) for plane in planes]
    held, target = [[2 * i, 2 * i + 1] for i in range(8)], [[63 - i, 40 - i] for i in range(8)]
    page_keys = blocks.keys(list(range(70_000, 70_000 + 8 * 16)))
    blocks.put_pages(page_keys, planes, held, durable=False)
    n = blocks.get_into_pages(page_keys, into, target)
    ok_pages = n == 8 and all(
        same(a[t], b[h]) for a, b in zip(into, planes, strict=True) for t, h in zip(target, held, strict=True)
    )
    row("exact", "blocks: put_pages from device, get_into_pages", f"{ok_pages}")

    # the memory is given to other bytes: a slab slot punched and filled again, an entry file recycled
    settle(device)
    held = blocks.get(keys[:1])  # keeps its slab (and so the slab's other, punched slots) in place
    client.evict(all=True)
    other = blocks.keys(list(range(90_000, 90_000 + count * 16)))
    newer = [random_bytes(nbytes, 400 + i) for i in range(count)]
    blocks.put(other, newer, durable=False)
    pages.zero_()
    n = blocks.get_into(other, list(pages.unbind(0)))
    ok_slots = n == count and all(same(pages[i], newer[i]) for i in range(count))
    del held
    first, second = random_bytes(64 * MiB, 500), random_bytes(64 * MiB, 501)
    client.capture(model=MODEL, state=STATE, tokens=[7], tensors={"x": first}, durable=False)
    got = client.restore(model=MODEL, state=STATE, tokens=[7], device=device)
    ok_first = got is not None and same(got.tensors["x"], first)
    settle(device)
    del got
    client.evict(model=MODEL, state=STATE, tokens=[7])
    client.capture(model=MODEL, state=STATE, tokens=[8], tensors={"x": second}, durable=False)
    got = client.restore(model=MODEL, state=STATE, tokens=[8], device=device)
    ok_file = ok_first and got is not None and same(got.tensors["x"], second)
    reused = client.stats()["l2"].get("reused_files", "?")
    row("exact", "after reuse: punched+refilled slots, recycled file", f"{ok_slots and ok_file}",
        f"reused files {reused}")  # fmt: skip
    client.evict(all=True)


# ---------------------------------------------------------------- 2. bandwidth


def entry_bandwidth(client: Any, device: torch.device, sizes: list[int]) -> None:
    for nbytes in sizes:
        label = f"{nbytes // MiB} MiB" if nbytes < GiB else f"{nbytes // GiB} GiB"
        h2d, d2h = pinned_rates(nbytes, device)
        data = random_bytes(nbytes, nbytes % 997)
        client.capture(model=MODEL, state=STATE, tokens=[nbytes], tensors={"x": data}, durable=False)
        start = time.perf_counter()
        got = client.restore(model=MODEL, state=STATE, tokens=[nbytes], device=device)
        sync(device)
        cold = time.perf_counter() - start
        del got

        def restore(nbytes: int = nbytes) -> None:
            client.restore(model=MODEL, state=STATE, tokens=[nbytes], device=device)

        warm = seconds(restore, device)
        row("restore", f"entry {label} (first: registers)", gbs(nbytes, cold), gbs(nbytes, h2d), h2d / cold)
        row("restore", f"entry {label} warm", gbs(nbytes, warm), gbs(nbytes, h2d), h2d / warm, target=0.85)
        on_device = data.to(device)
        count = [0]

        def capture(nbytes: int = nbytes, count: list[int] = count, on_device: Any = on_device) -> None:
            count[0] += 1
            client.capture(model=MODEL, state=STATE, tokens=[nbytes, count[0]], tensors={"x": on_device},
                           durable=False)  # fmt: skip

        took = seconds(capture, device, reps=2)
        for index in range(1, count[0] + 1):
            client.evict(model=MODEL, state=STATE, tokens=[nbytes, index])
        row(
            "capture",
            f"entry {label} from device",
            gbs(nbytes, took),
            gbs(nbytes, d2h),
            d2h / took,
            target=0.5,
        )
        client.evict(model=MODEL, state=STATE, tokens=[nbytes])


def block_bandwidth(client: Any, device: torch.device, total: int, sizes: list[int]) -> None:
    h2d, d2h = pinned_rates(total, device)
    for nbytes in sizes:
        count = total // nbytes
        blocks = client.blocks(model=MODEL, state=f"{STATE}-{nbytes}", block_tokens=16)
        keys = blocks.keys(list(range(count * 16)))
        source = random_bytes(total, nbytes % 991)
        blocks.put(keys, list(source.view(count, nbytes).unbind(0)), durable=False)
        hashed(client)
        pages = torch.empty((count, nbytes), dtype=torch.uint8, device=device)
        in_order = list(pages.unbind(0))
        order = torch.randperm(count, generator=torch.Generator().manual_seed(1)).tolist()
        scattered = [pages[i] for i in order]
        label = f"{count} × {nbytes // 1024} KiB"
        for name, outs in (("in order", in_order), ("scattered", scattered)):

            def get(outs: list[torch.Tensor] = outs, blocks: Any = blocks, keys: list[bytes] = keys) -> None:
                blocks.get_into(keys, outs)

            took = seconds(get, device)
            row("get_into", f"{label} {name}", gbs(total, took), gbs(total, h2d), h2d / took, target=0.85)

        def get_pages(
            blocks: Any = blocks, keys: list[bytes] = keys, pages: Any = pages, order: Any = order
        ) -> None:
            blocks.get_into_pages(keys, pages, order)

        took = seconds(get_pages, device)
        row(
            "get_into",
            f"{label} scattered, pages",
            gbs(total, took),
            gbs(total, h2d),
            h2d / took,
            target=0.85,
        )
        round_ = [0]

        def put(round_: list[int] = round_, blocks: Any = blocks, count: int = count,
                in_order: list[torch.Tensor] = in_order) -> None:  # fmt: skip
            # new keys each time: every block is copied and stored
            round_[0] += 1
            first = 10**6 * round_[0]
            blocks.put(blocks.keys(list(range(first, first + count * 16))), in_order, durable=False)

        took = seconds(put, device, reps=2)
        row(
            "put",
            f"{label} from device (the call)",
            gbs(total, took),
            gbs(total, d2h),
            d2h / took,
            target=0.5,
        )

        def put_committed(
            put: Any = put, blocks: Any = blocks, count: int = count, round_: list[int] = round_
        ) -> None:
            # the call, then until the daemon's copy behind its reply has committed (the connection's
            # next request waits for it: docs/protocol.md, "Staging halves")
            put()
            first = 10**6 * round_[0]
            blocks.contains(blocks.keys(list(range(first, first + count * 16)))[-1:])

        took = seconds(put_committed, device, reps=2)
        row("put", f"{label} from device, committed", gbs(total, took), gbs(total, d2h), d2h / took)
        client.evict(model=MODEL, state=f"{STATE}-{nbytes}", blocks=True)
    paged_bandwidth(client, device, total, h2d)


def paged_bandwidth(client: Any, device: torch.device, total: int, h2d: float) -> None:
    """vLLM's layout of the 7.2B shape (a 16-token block is each layer's K and V page: 64 rows of 32 KiB,
    2 MiB), blocks into scattered pages: ``get_into`` with the rows as pieces beside ``get_into_pages``."""
    row_bytes, rows = (32 << 10, 64) if device.type == "cuda" else (4 << 10, 8)
    nbytes = row_bytes * rows
    count = total // nbytes
    blocks = client.blocks(model=MODEL, state=f"{STATE}-paged", block_tokens=16)
    keys = blocks.keys(list(range(count * 16)))
    source = random_bytes(total, 77)
    blocks.put(keys, list(source.view(count, nbytes).unbind(0)), durable=False)
    hashed(client)
    planes = [torch.empty((count + 7, row_bytes), dtype=torch.uint8, device=device) for _ in range(rows)]
    order = torch.randperm(count + 7, generator=torch.Generator().manual_seed(2))[:count].tolist()
    outs = [[plane[p] for plane in planes] for p in order]
    label = f"{count} × {nbytes >> 10} KiB as {rows} rows of {row_bytes >> 10} KiB, scattered"

    def by_pieces() -> None:
        blocks.get_into(keys, outs)

    def by_pages() -> None:
        blocks.get_into_pages(keys, planes, order)

    for name, call in (("pieces", by_pieces), ("pages", by_pages)):
        for plane in planes:
            plane.zero_()
        took = seconds(call, device)
        exact = same(torch.cat([plane[order] for plane in planes], dim=1), source.view(count, nbytes))
        row("get_into", f"{label}, {name}", gbs(total, took), gbs(total, h2d), h2d / took, target=0.85)
        if not exact:
            row("exact", f"{label}, {name}", "NOT EXACT")
    _, d2h = pinned_rates(total, device)
    round_ = [0]

    def fresh() -> list[bytes]:  # new keys each time: every block is copied and stored
        round_[0] += 1
        keys: list[bytes] = blocks.keys(list(range(10**6 * round_[0], 10**6 * round_[0] + count * 16)))
        return keys

    def put_pieces() -> None:
        blocks.put(fresh(), outs, durable=False)

    def put_pages() -> None:
        blocks.put_pages(fresh(), planes, order, durable=False)

    for name, call in (("pieces", put_pieces), ("pages", put_pages)):
        took = seconds(call, device, reps=2)
        row("put", f"{label} from device, {name}", gbs(total, took), gbs(total, d2h), d2h / took, target=0.5)
    client.evict(model=MODEL, state=f"{STATE}-paged", blocks=True)


# ---------------------------------------------------------------- 3. TTFT

_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size")  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "1.1B": dict(zip(_SHAPE_KEYS, (2048, 16, 32, 8, 8192), strict=True)),
    "7.2B": dict(zip(_SHAPE_KEYS, (4096, 32, 32, 8, 14336), strict=True)),
    "tiny": dict(zip(_SHAPE_KEYS, (64, 2, 4, 2, 128), strict=True)),
}
TARGETS = {("7.2B", 32768, 1): 10.0, ("7.2B", 8192, 1): 4.5, ("1.1B", 32768, 1): 6.0}


def _count(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def build(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32000, max_position_embeddings=40960, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"  # (the table says which one the model ended up with)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model: Any = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def ttft(
    client: Any, device: torch.device, shape: str, points: list[tuple[int, int]], h2d_rate: float
) -> None:
    from skippyd.integrations import transformers as skt

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(shape, device, dtype)
    gen = torch.Generator().manual_seed(3)
    longest = max(p + n for p, n in points)
    tokens = torch.randint(0, 32000, (longest,), generator=gen).to(device)

    def forward(ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
        logits, _ = skt.prefill(model, ids, cache=cache, logits_to_keep=1)
        return logits

    forward(tokens[:64])  # warm-up
    implementation = getattr(model.config, "_attn_implementation", "?")
    row("ttft", f"{shape} model: {implementation} attention, {dtype}", "", "")
    kv_bytes: dict[int, int] = {}
    for prefix, new in points:
        prompt = tokens[: prefix + new]
        if prefix not in kv_bytes:
            _, cache = skt.prefill(model, prompt[:prefix], logits_to_keep=1)
            skt.capture(client, model, cache, tokens=prompt[:prefix], durable=False)
            hashed(client)
            shape_of = SHAPES[shape]
            per_token = (
                2
                * shape_of["num_hidden_layers"]
                * shape_of["num_key_value_heads"]
                * (shape_of["hidden_size"] // shape_of["num_attention_heads"])
                * torch.tensor([], dtype=dtype).element_size()
            )
            kv_bytes[prefix] = prefix * per_token  # what a restore moves (blocks held before included)
            del cache

        def full_prefill(prompt: torch.Tensor = prompt) -> None:
            forward(prompt)

        full = seconds(full_prefill, device, reps=2)

        def restored(prompt: torch.Tensor = prompt, prefix: int = prefix) -> None:
            hit = skt.restore(client, model, tokens=prompt, device=device)
            assert hit is not None and hit[1] == prefix, f"restored {hit and hit[1]} of {prefix}"
            forward(prompt[hit[1] :], hit[0])

        took = seconds(restored, device, reps=2)
        rests = []
        for _ in range(2):  # the forward of the new tokens alone, on a restored cache
            hit = skt.restore(client, model, tokens=prompt, device=device)
            assert hit is not None
            sync(device)
            start = time.perf_counter()
            forward(prompt[prefix:], hit[0])
            sync(device)
            rests.append(time.perf_counter() - start)
            del hit
        rest = min(rests)
        copy = kv_bytes[prefix] / h2d_rate
        ideal = full / (copy + rest)
        if new > 1:  # 32k + 2k: restored ≤ 1.2 × max(copy, forward of the new tokens)
            bound = 1.2 * max(copy, rest)
            case = f"{shape} {_count(prefix)}+{new} restored vs 1.2×max(copy, fwd)"
            row("ttft", case, ms(took), ms(bound), took / bound, target=1.0, higher=False)
        case = f"{shape} {_count(prefix)}+{new} full ÷ restored (ideal {ideal:.1f}×)"
        row("ttft", case, ms(took), ms(full), full / took, target=TARGETS.get((shape, prefix, new)))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    client.evict(all=True)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--socket", default=os.environ.get("SKIPPYD_SOCKET"), help="a running daemon")
    parser.add_argument("--skip-ttft", action="store_true", help="correctness and bandwidth only")
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU: checks the script only")
    parser.add_argument(
        "--profile", metavar="DIR", type=Path,
        help="each section under cProfile, its stats written there (slower: the ratios are lower bounds)",
    )  # fmt: skip
    parser.add_argument(
        "--watchdog", metavar="S", type=float, default=180.0,
        help="every S seconds, print where each thread is (faulthandler): a hang shows where it stopped",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # a time limit's SIGINT ends the run with the rows so far, even where SIGINT came in ignored (a
    # background job of a shell without job control)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    from skippyd.client.transfer.device import batch_available

    if args.dry:
        device = torch.device("cpu")
        entries, block_total, block_sizes = [1 * MiB, 4 * MiB], 4 * MiB, [256 * 1024, 1 * MiB]
        ttft_points = {"tiny": [(256, 1), (512, 1), (512, 64)]}
        budget = "512MiB"
    else:
        if not torch.cuda.is_available():
            print("bench.gpu needs a CUDA device (or --dry)", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        entries, block_total, block_sizes = (
            [64 * MiB, 512 * MiB, 2 * GiB],
            512 * MiB,
            [256 << 10, 1 << 20, 2 << 20],
        )
        ttft_points = {"1.1B": [(8192, 1), (32768, 1), (32768, 2048)],
                       "7.2B": [(8192, 1), (32768, 1), (32768, 2048)]}  # fmt: skip
        budget = "40GiB"
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    print(f"bench.gpu on {name}, torch {torch.__version__}, cuMemcpyBatchAsync: {batch_available()}")
    try:
        if not args.dry:
            return _run(args, device, entries, block_total, block_sizes, ttft_points, budget)
        # the dry run's CPU "device" goes through the transfer layer as CUDA would (transfer.sim:
        # stand-in streams and events, a batch call that moves bytes by address), so its exact rows check
        # the same code paths a GPU run takes
        from skippyd.client.transfer.sim import simulated

        with simulated():
            return _run(args, device, entries, block_total, block_sizes, ttft_points, budget)
    except KeyboardInterrupt:  # (a time limit's SIGINT: the rows so far still print)
        row("bench", "INTERRUPTED", f"after {time.perf_counter() - started:.0f} s")
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        print_table()
        print(f"\n(one run, {time.perf_counter() - started:.0f} s)")


def _run(  # noqa: PLR0917 - main's choices
    args: argparse.Namespace,
    device: torch.device,
    entries: list[int],
    block_total: int,
    block_sizes: list[int],
    ttft_points: dict[str, list[tuple[int, int]]],
    budget: str,
) -> int:
    import skippyd
    from skippyd.client.transfer.device import batch_available

    section = partial(_section, profile=args.profile)
    with daemon(args.socket, budget) as path, skippyd.Client(path, timeout=300) as client:
        client.evict(all=True)
        failed = 0
        failed += section("exact", lambda: correctness(client, device))
        failed += section("restore", lambda: entry_bandwidth(client, device, entries))
        failed += section("get_into", lambda: block_bandwidth(client, device, block_total, block_sizes))
        if not args.skip_ttft:
            h2d, _ = pinned_rates(256 * MiB, device)
            for shape, points in ttft_points.items():
                failed += section("ttft", lambda shape=shape, points=points: ttft(  # type: ignore[misc]
                    client, device, shape, points, 256 * MiB / h2d))  # fmt: skip
        if device.type == "cuda" or args.dry:  # (the dry run's: the simulated transfer's)
            from skippyd.client.transfer.cuda import _torch_runtime
            from skippyd.client.transfer.device import transfer

            moved = transfer()
            stats = moved.book.stats
            row("book", "registrations / generation changes", f"{stats.registrations} / "
                f"{stats.generation_changes}", f"{stats.registered_bytes // MiB} MiB held")  # fmt: skip
            # a batch call the driver refused once turns to one copy a run for good (a warning in the log)
            row("book", "copies / calls (batch still in use)", f"{moved.copies} / {moved.calls}",
                f"{moved._use_batch and batch_available()}")  # fmt: skip
            row("book", "torch's libcudart found (errors cleared)", str(_torch_runtime() is not None), "")
    return 1 if failed else 0


def _section(name: str, run: Callable[[], None], *, profile: Path | None = None) -> int:
    """Runs one part of the bench; a failure becomes a row (with its traceback above the table), so the
    rest still runs and the table still prints. Returns 1 if it failed. With ``profile`` (a directory),
    under cProfile, its stats (by cumulative and by own time) written to ``<dir>/<n>-<name>.txt``."""
    import cProfile
    import traceback

    profiler = cProfile.Profile() if profile is not None else None
    if profiler is not None:
        profiler.enable()
    try:
        run()
    except Exception as exc:
        traceback.print_exc()
        row(name, f"FAILED: {type(exc).__name__}", str(exc)[:60])
        return 1
    finally:
        if profiler is not None and profile is not None:
            profiler.disable()
            _write_profile(profiler, profile, name)
    return 0


def _write_profile(profile: Any, where: Path, name: str) -> None:
    import io
    import pstats

    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{len(list(where.glob('*.txt'))):02d}-{name}.txt"
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    path.write_text(text.getvalue())
    print(f"(profile of {name}: {path})")


if __name__ == "__main__":
    raise SystemExit(main())
