"""Host work of the GPU data path, measured on the CPU through the CUDA simulator (no GPU needed).

    python -m bench.gpu_host [--compare TREE] [--profile CASE] [--reps N] [--json]

What a restore to CUDA costs the host before the DMA engine takes over: the daemon's ``blocks_get``
round trips, placements, piece lists, run planning, registration look-ups, lease bookkeeping, the batch
call's arguments. :mod:`skippyd.client.transfer.sim` stands in for CUDA (streams and events that record, a
``cudaHostRegister`` that records, a ``cuMemcpyBatchAsync`` that only counts in the timed calls and moves
the bytes by address in one checked call per case), and the "device" tensors are CPU tensors. So the
figures are host time (µs), never bandwidth; the bytes a GPU would move are not moved in the timed calls.

Cases (a daemon started here, no Redis):

* ``get_into`` of 512 MiB in 2048 × 256 KiB, 512 × 1 MiB, 256 × 2 MiB blocks into "device" pages, in
  order (runs merge) and scattered (none do): the first call (registers) and warm calls.
* ``get_into`` beside ``get_into_pages`` of the same pages (scattered): 2048 × 256 KiB blocks into one
  pool; vLLM's layout of the 7.2B shape, 256 blocks of 64 rows of 32 KiB (each layer's K and V page).
  (A ``--compare`` tree without ``get_into_pages`` skips these.)
* ``skt.restore`` of a Llama-shaped cache at 32k tokens + 1, with the 7.2B counts (32 layers, 8 KV
  heads, head_dim 128, bf16: 128 blocks of 32 MiB, one slab each, as on the GPU) and the 1.1B counts
  (16 layers, head_dim 64: 128 blocks of 8 MiB): ``skt.restore(device=...)`` alone, first and warm.
* an entry of 64 MiB restored to the "device": first and warm.

Each row: median wall ms of a call, of which the daemon's ``blocks_get`` round trips (the same gets with
no copy), host µs per block beside it, runs and batch calls per call, ``cudaHostRegister`` calls and bytes
on the first call and per warm call. ``--compare TREE`` runs the same bench from another checkout
(``git worktree add /tmp/before main``) in a subprocess and prints both side by side; ``--profile CASE``
prints a cProfile of that case's warm calls.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

KiB, MiB = 1 << 10, 1 << 20
MODEL = "bench-gpu-host@sha256:0"

#: Llama shapes: (layers, KV heads, head_dim); 32k tokens in blocks of 256 (skt's default)
SHAPES = {"7.2B": (32, 8, 128), "1.1B": (16, 8, 64)}


def hashed(client: Any, timeout: float = 60.0) -> None:
    """Waits (``timeout`` at most) until the daemon's digester has hashed every block the puts before
    committed unhashed: rows timed after a large put would otherwise share the CPU with that BLAKE3."""
    deadline = time.monotonic() + timeout
    while int(client.stats()["l2"].get("block_unhashed", 0)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


class Case:
    """Times ``call`` (after ``first``) and counts what the simulated CUDA was asked."""

    def __init__(self, sim: Any, name: str, blocks: int) -> None:
        self.sim, self.name, self.blocks = sim, name, blocks

    def run(self, call: Callable[[], Any], reps: int, *, gets: Callable[[], Any] | None = None,
            profile: bool = False) -> dict[str, Any]:  # fmt: skip
        sim = self.sim
        rec, transfer = sim.rec, sim.transfer
        before = len(rec.calls)
        start = time.perf_counter()
        call()
        first_s = time.perf_counter() - start
        transfer.drain()
        first = rec.calls[before:]
        samples: list[float] = []
        before = len(rec.calls)
        runs0, calls0 = transfer.copies, transfer.calls
        profiler = cProfile.Profile() if profile else None
        for _ in range(reps):
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            call()
            if profiler is not None:
                profiler.disable()
            samples.append(time.perf_counter() - start)
            transfer.drain()
        warm = rec.calls[before:]
        rtt = [0.0]
        if gets is not None:
            rtt = []
            for _ in range(reps):
                start = time.perf_counter()
                gets()
                rtt.append(time.perf_counter() - start)
        wall = _median_ms(samples)
        row = {
            "case": self.name,
            "blocks": self.blocks,
            "first_ms": first_s * 1e3,
            "wall_ms": wall,
            "rtt_ms": _median_ms(rtt),
            "us_per_block": wall * 1e3 / self.blocks if self.blocks else 0.0,
            "runs": (transfer.copies - runs0) / reps,
            "calls": (transfer.calls - calls0) / reps,
            "reg_first": sum(1 for c in first if c[0] == "register"),
            "reg_first_mib": sum(c[2] for c in first if c[0] == "register") / MiB,
            "unreg_first": sum(1 for c in first if c[0] == "unregister"),
            "reg_warm": sum(1 for c in warm if c[0] == "register") / reps,
            "unreg_warm": sum(1 for c in warm if c[0] == "unregister") / reps,
        }
        if profiler is not None:
            print(f"\n--- cProfile of {reps} warm calls: {self.name}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return row


def _raw_gets(client: Any, space: Any, keys: list[bytes]) -> None:
    """The daemon's side alone: the blocks_get requests a get_into makes, descriptors closed."""
    from skippyd.client.blockspace import MAX_KEYS_PER_REQUEST

    done = 0
    while done < len(keys):
        reply, fds = client._call(space._body("blocks_get", keys[done : done + MAX_KEYS_PER_REQUEST]))
        for fd in fds:
            os.close(fd)
        count = len(reply["blocks"])
        done += count
        if not count or count >= int(reply.get("held", 0)):
            break


def get_into_cases(client: Any, sim: Any, reps: int, profile: str | None) -> list[dict[str, Any]]:
    rows = []
    total = 512 * MiB
    for nbytes in (256 * KiB, 1 * MiB, 2 * MiB):
        count = total // nbytes
        space = client.blocks(model=MODEL, state=f"kv-{nbytes}", block_tokens=16)
        keys = space.keys(list(range(count * 16)))
        source = torch.randint(
            0, 256, (count, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
        )
        space.put(keys, list(source.unbind(0)), durable=False)
        hashed(client)
        pages = torch.empty((count, nbytes), dtype=torch.uint8)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(2)).tolist()
        for name, outs in (("in order", list(pages.unbind(0))), ("scattered", [pages[i] for i in order])):
            label = f"get_into {count} × {nbytes // KiB} KiB {name}"
            assert sim.batch is not None
            sim.batch.copy = False

            def call(outs: list[Any] = outs, space: Any = space, keys: list[bytes] = keys) -> None:
                space.get_into(keys, outs)

            def gets(space: Any = space, keys: list[bytes] = keys) -> None:
                _raw_gets(client, space, keys)

            want = profile is not None and profile in label
            row = Case(sim, label, count).run(call, reps, gets=gets, profile=want)
            sim.batch.copy = True  # one checked call: the bytes land where they belong
            pages.zero_()
            assert space.get_into(keys, outs) == count
            sim.transfer.drain()
            got = pages if name == "in order" else pages[order]
            row["exact"] = bool(torch.equal(got, source))
            rows.append(row)
        del pages, source
        client.evict(model=MODEL, state=f"kv-{nbytes}", blocks=True)
    return rows


def pages_cases(client: Any, sim: Any, reps: int, profile: str | None) -> list[dict[str, Any]]:
    """``get_into`` with one tensor (or a list of page rows) per block beside ``get_into_pages`` of the same
    pages: 2048 × 256 KiB blocks into one pool, scattered; and vLLM's layout of the 7.2B shape (32 layers,
    K and V, pages of 16 tokens × 8 heads × 128 × bf16 = 32 KiB rows: a 16-token block is 64 rows, 2 MiB)."""
    rows = []
    gen = torch.Generator().manual_seed(4)
    shapes = [("one pool", 2048, [256 * KiB]), ("vLLM 7.2B layout", 256, [32 * KiB] * 64)]
    for name, count, row_bytes in shapes:
        nbytes = sum(row_bytes)
        space = client.blocks(model=MODEL, state=f"pages-{name}", block_tokens=16)
        keys = space.keys(list(range(count * 16)))
        source = torch.randint(0, 256, (count, nbytes), dtype=torch.uint8, generator=gen)
        space.put(keys, list(source.unbind(0)), durable=False)
        hashed(client)
        planes = [torch.zeros((count + 7, row), dtype=torch.uint8) for row in row_bytes]  # 7 spare pages
        order = torch.randperm(count + 7, generator=gen)[:count].tolist()
        outs = [[plane[p] for plane in planes] if len(planes) > 1 else planes[0][p] for p in order]
        label = f"{count} × {nbytes // KiB} KiB, {name}, scattered"
        assert sim.batch is not None

        def by_pieces(space: Any = space, keys: list[bytes] = keys, outs: list[Any] = outs) -> None:
            space.get_into(keys, outs)

        def by_pages(
            space: Any = space, keys: list[bytes] = keys, planes: Any = planes, order: Any = order
        ) -> None:
            space.get_into_pages(keys, planes, order)

        calls: list[tuple[str, Callable[[], None]]] = [("get_into", by_pieces)]
        if hasattr(space, "get_into_pages"):  # (a --compare tree from before it: get_into alone)
            calls.append(("get_into_pages", by_pages))
        for how, call in calls:
            sim.batch.copy = False
            case = f"{how} {label}"
            row = Case(sim, case, count).run(
                call, reps, gets=partial(_raw_gets, client, space, keys),
                profile=profile is not None and profile in case,
            )  # fmt: skip
            sim.batch.copy = True  # one checked call: every page holds its block's row
            for plane in planes:
                plane.zero_()
            call()
            sim.transfer.drain()
            got = torch.cat([plane[order] for plane in planes], dim=1)
            row["exact"] = bool(torch.equal(got, source))
            rows.append(row)
        del planes, source, outs
        client.evict(model=MODEL, state=f"pages-{name}", blocks=True)
    return rows


def _llama(layers: int, kv_heads: int, head_dim: int) -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=40960)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model: Any = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def restore_cases(client: Any, sim: Any, reps: int, profile: str | None, tokens: int) -> list[dict[str, Any]]:
    from transformers import DynamicCache

    from skippyd.integrations import transformers as skt

    rows = []
    for shape, (layers, heads, dim) in SHAPES.items():
        model = _llama(layers, heads, dim)
        prompt = torch.arange(tokens + 1) % 128
        cache = DynamicCache(config=model.config)
        for index, layer in enumerate(
            cast(list[Any], cache.layers)
        ):  # the KV of every token: one row, seen through strides
            row_k = torch.full((1, heads, 1, dim), float(index + 1), dtype=torch.bfloat16)
            row_v = -row_k
            layer.lazy_initialization(row_k, row_v)
            layer.keys, layer.values = (
                row_k.expand(1, heads, tokens, dim),
                row_v.expand(1, heads, tokens, dim),
            )
        skt.capture(client, model, cache, tokens=prompt[:tokens], durable=False)
        hashed(client)
        del cache
        blocks = tokens // skt.DEFAULT_BLOCK_TOKENS
        label = f"skt.restore {shape} counts {tokens // 1024}k+1 ({layers} layers × {blocks} blocks)"
        assert sim.batch is not None
        sim.batch.copy = False

        def restore(model: Any = model, prompt: Any = prompt) -> None:
            hit = skt.restore(client, model, tokens=prompt, device="cpu")
            assert hit is not None and hit[1] == tokens, hit and hit[1]

        prof = skt.profile(model)
        layout = skt._layout(prof, skt.DEFAULT_BLOCK_TOKENS)
        assert layout is not None
        spaces = skt._Store(client, prof.model_id, "").spaces(layout)

        def gets(spaces: Any = spaces, prompt: Any = prompt, prof: Any = prof) -> None:
            client.restore(model=prof.model_id, state=prof.state, tokens=prompt, device="cpu")
            for space in spaces:
                _raw_gets(client, space, space.keys(prompt[:tokens]))

        row = Case(sim, label, blocks).run(
            restore, reps, gets=gets, profile=profile is not None and profile in label
        )
        sim.batch.copy = True  # one checked restore: layer i's keys are i + 1 everywhere
        hit = skt.restore(client, model, tokens=prompt, device="cpu")
        sim.transfer.drain()
        assert hit is not None
        first, last = cast(Any, hit[0].layers[0]), cast(Any, hit[0].layers[-1])
        row["exact"] = bool(first.keys.eq(1).all()) and bool(last.values.eq(-layers).all())
        rows.append(row)
        del hit, model
        client.evict(all=True)
    return rows


def entry_cases(client: Any, sim: Any, reps: int) -> list[dict[str, Any]]:
    data = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    client.capture(model=MODEL, state="entry", tokens=[1], tensors={"x": data}, durable=False)
    assert sim.batch is not None
    sim.batch.copy = False
    row = Case(sim, "restore entry 64 MiB", 1).run(
        lambda: client.restore(model=MODEL, state="entry", tokens=[1], device="cpu"), reps
    )
    sim.batch.copy = True
    got = client.restore(model=MODEL, state="entry", tokens=[1], device="cpu")
    sim.transfer.drain()
    row["exact"] = got is not None and bool(torch.equal(got.tensors["x"], data))
    client.evict(all=True)
    return [row]


def measure(reps: int, profile: str | None, tokens: int, only: str | None) -> list[dict[str, Any]]:
    import skippyd
    import skippyd.integrations.transformers  # (the simulator patches its hook)
    from bench.gpu import daemon
    from skippyd.client.transfer.sim import simulated

    rows: list[dict[str, Any]] = []
    with daemon(None, "10GiB") as path, skippyd.Client(path, timeout=300) as client, simulated() as sim:
        if only in (None, "get_into"):
            rows += get_into_cases(client, sim, reps, profile)
        if only in (None, "pages"):
            rows += pages_cases(client, sim, reps, profile)
        if only in (None, "restore"):
            rows += restore_cases(client, sim, reps, profile, tokens)
        if only in (None, "entry"):
            rows += entry_cases(client, sim, reps)
    return rows


COLUMNS = (
    ("case", "case", "{}"),
    ("wall_ms", "warm ms", "{:.2f}"),
    ("rtt_ms", "of which gets ms", "{:.2f}"),
    ("us_per_block", "µs/block", "{:.1f}"),
    ("first_ms", "first ms", "{:.1f}"),
    ("runs", "runs/call", "{:.0f}"),
    ("calls", "batch calls/call", "{:.0f}"),
    ("reg_first", "registers first", "{}"),
    ("reg_first_mib", "MiB first", "{:.0f}"),
    ("reg_warm", "registers warm", "{:.0f}"),
    ("exact", "exact", "{}"),
)


def table(rows: list[dict[str, Any]], label: str = "") -> str:
    head = [h for _, h, _ in COLUMNS]
    cells = [[f.format(r.get(k, "")) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    lines = [("**" + label + "**\n") if label else ""]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in cells
    ]
    return "\n".join(lines)


def side_by_side(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    head = ["case", "before ms", "after ms", "after ÷ before", "µs/block before", "µs/block after",
            "gets ms (after)", "registers first before/after", "registers warm before/after",
            "exact"]  # fmt: skip
    by_case = {r["case"]: r for r in before}
    cells = []
    for a in after:
        b = by_case.get(a["case"], {})
        cells.append([
            a["case"], f"{b.get('wall_ms', 0):.2f}", f"{a['wall_ms']:.2f}",
            f"{a['wall_ms'] / b['wall_ms']:.2f}×" if b.get("wall_ms") else "",
            f"{b.get('us_per_block', 0):.1f}", f"{a['us_per_block']:.1f}", f"{a['rtt_ms']:.2f}",
            f"{b.get('reg_first', '')} / {a['reg_first']}",
            f"{b.get('reg_warm', 0):.0f} / {a['reg_warm']:.0f}",
            f"{b.get('exact', '')} / {a['exact']}",
        ])  # fmt: skip
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in cells
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--only", choices=("get_into", "pages", "restore", "entry"))
    parser.add_argument(
        "--profile", metavar="CASE", help="a cProfile of the warm calls of cases containing CASE"
    )
    parser.add_argument("--compare", metavar="TREE", help="run the same bench from TREE first (before)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for --compare)")
    args = parser.parse_args(argv)
    passed = ["--reps", str(args.reps), "--tokens", str(args.tokens)] + (
        ["--only", args.only] if args.only else []
    )
    before = None
    if args.compare:
        tree = Path(args.compare).resolve()
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        bench = Path(__file__).resolve()  # this bench's own code, run against that tree's skippyd
        done = subprocess.run([sys.executable, str(bench), "--json", *passed], cwd=tree, env=env, check=True,
                              capture_output=True, text=True)  # fmt: skip
        before = json.loads(done.stdout.strip().splitlines()[-1])
    rows = measure(args.reps, args.profile, args.tokens, args.only)
    if args.json:
        print(json.dumps(rows))
        return 0
    import skippyd

    where = Path(skippyd.__file__).parent.parent
    print(f"bench.gpu_host: host work through the CUDA simulator, on the CPU ({os.cpu_count()} CPUs), "
          f"skippyd {skippyd.__version__} from {where}, {args.reps} warm calls")  # fmt: skip
    if before is not None:
        print(f"\nbefore: {args.compare}; after: this tree\n")
        print(side_by_side(before, rows))
    print()
    print(table(rows, "this tree"))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file by --compare: the bench package is this file's parent
        sys.path.append(str(Path(__file__).resolve().parent.parent))  # (after PYTHONPATH: its skippyd first)
    raise SystemExit(main())
