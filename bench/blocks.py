"""Blocks over the daemon's socket, one run, each figure beside its reference measured in the same run.

    python -m bench.blocks [--turns 8] [--conversations 10] [--write-docs] [--paged-only] [--neighbour-only]

1. ``put`` of 64 MiB as 256 blocks of 256 KiB into a tier with room and into a full one, ``get_into``
   the same, zero-copy ``get``: beside a numpy memcpy of the same 64 MiB;
2. ``contains`` of 128 keys (a hit and a miss) and a ping, over the socket;
3. a multi-turn chat through entries (one capture of the whole prefix per turn) and through blocks
   (only the new blocks each turn): bytes held ÷ unique KV bytes, bytes the client sent, capture per
   turn beside a memcpy of the turn's new bytes, a restore of the whole prefix into the engine's paged
   buffer beside a memcpy of those bytes, and hit rates under a budget of one fifth of the working set;
4. L3: ``get_into`` after a restart with the tmpfs wiped and the page cache dropped, beside a plain
   read of the same bytes from a file on the same disk (cache dropped too);
5. a restore into the engine's paged layout: ``get_into`` with each block given as its pieces in a
   vLLM-shaped cache (pages in order and scattered), beside a memcpy of the same bytes, the same copies
   without skippyd, and ``get`` views plus one copy per page (``--paged-only`` runs just this part);
6. a quiet neighbour: another process copying memory (16 MiB at a time) while the daemon does its
   background work after a put of 128 MiB (the digester hashing it, the reserve refilling what it took),
   beside the same neighbour while the daemon is idle, with the reserve unpaced and paced
   (``--neighbour-only`` runs just this part).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import BenchDaemon, fmt_time, machine, median, percentile, table, timed, write_section
from bench.l3 import drop_cache, plain_read

MODEL, STATE = "bench-model", "paged-bf16"
MiB = 1 << 20
BLOCK_TOKENS = 256


def _memcpy(nbytes: int, reps: int = 9) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    return median(timed(lambda: np.copyto(dst, src), reps=reps))


def _after_idle(
    op: Callable[[], object], nbytes: int, *, reps: int = 5, idle: float = 1.0
) -> tuple[float, float]:
    """Medians of ``op`` and of a memcpy of ``nbytes``, each timed after the same idle pause: a vCPU idle
    for a second copies ≈ 1.5× slower at first here, so a reference timed hot would flatter nothing."""
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    ops, refs = [], []
    for _ in range(reps):
        time.sleep(idle)
        start = time.perf_counter()
        np.copyto(dst, src)
        refs.append(time.perf_counter() - start)
        time.sleep(idle)  # (the reserve, if any, refills here too)
        start = time.perf_counter()
        op()
        ops.append(time.perf_counter() - start)
    return median(ops), median(refs)


def _blocks(count: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(count)]


def bulk_rows(workdir: Path) -> list[list[str]]:
    import skippyd

    count, nbytes = 256, 256 * 1024
    total = count * nbytes
    memcpy = _memcpy(total)
    rows = [["numpy memcpy of 64 MiB (reference)", fmt_time(memcpy), "1.00×"]]
    daemon = BenchDaemon(workdir / "bulk", "--l2-reserve", "128MiB", budget="512MiB").start()
    try:
        client = skippyd.Client(daemon.socket, timeout=120)
        space = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK_TOKENS)
        data = _blocks(count, nbytes, seed=1)
        round_ = [0]

        def put_new() -> None:
            round_[0] += 1
            keys = [f"{round_[0]}:{i}".encode() for i in range(count)]
            put = space.put(keys, data, durable=False)
            assert put.stored == count

        # a connection's first put sets up its staging buffer (once per connection, as an engine does), and
        # the block group is in use from then on: the reserve stocks it
        space.put([f"warm-up:{i}".encode() for i in range(count)], data, durable=False)
        # a tier with room, the reserve refilled between puts (as between turns): timed after an idle
        # pause, beside a memcpy after the same pause
        room, room_ref = _after_idle(put_new, total, reps=3)
        while round_[0] < 8:  # 512 MiB of budget: from here on every put evicts an older one
            put_new()
        full = timed(put_new, reps=6)
        rows.append(
            ["put 256 × 256 KiB, tier with room (after 1 s idle)", fmt_time(room), f"{room_ref / room:.2f}×"]
        )
        rows.append(
            ["put 256 × 256 KiB, tier full (evicts)", fmt_time(median(full)), f"{memcpy / median(full):.2f}×"]
        )
        keys = [f"{round_[0]}:{i}".encode() for i in range(count)]
        out = [np.empty(nbytes, dtype=np.uint8) for _ in range(count)]
        got = timed(lambda: space.get_into(keys, out), reps=9)
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        rows.append(["get_into 256 × 256 KiB", fmt_time(median(got)), f"{memcpy / median(got):.2f}×"])
        zero = timed(lambda: space.get(keys), reps=21)
        rows.append(
            ["get zero-copy 256 × 256 KiB (views)", fmt_time(median(zero)), f"{memcpy / median(zero):.1f}×"]
        )
        client.close()
    finally:
        daemon.cleanup()
    return rows


def reserve_rows(workdir: Path) -> list[list[str]]:
    """An entry capture of 64 MiB into a tier with room, without and with the reserve."""
    import torch

    import skippyd

    memcpy = _memcpy(64 * MiB)
    rows = [["numpy memcpy of 64 MiB (reference)", fmt_time(memcpy), "1.00×"]]
    tensor = torch.from_numpy(np.random.default_rng(4).integers(0, 255, 64 * MiB, dtype=np.uint8))
    for reserve in ("0", "256MiB"):
        daemon = BenchDaemon(workdir / f"reserve-{reserve}", "--l2-reserve", reserve, budget="2GiB").start()
        try:
            client = skippyd.Client(daemon.socket, timeout=120)
            client.capture(model=MODEL, state=STATE, tokens=[0], tensors={"kv": tensor}, durable=False)
            turn = [0]

            def capture(client: Any = client, turn: list[int] = turn) -> None:
                turn[0] += 1
                client.capture(
                    model=MODEL, state=STATE, tokens=[turn[0]], tensors={"kv": tensor}, durable=False
                )

            took, ref = _after_idle(capture, 64 * MiB)
            client.close()
        finally:
            daemon.cleanup()
        label = "without the reserve (fresh tmpfs pages)" if reserve == "0" else f"with a {reserve} reserve"
        rows.append([f"capture 64 MiB, tier with room, {label}", fmt_time(took), f"{ref / took:.2f}×"])
    return rows


def small_rows(workdir: Path) -> list[list[str]]:
    import skippyd

    daemon = BenchDaemon(workdir / "small", budget="256MiB").start()
    try:
        client = skippyd.Client(daemon.socket)
        space = client.blocks(model=MODEL, state=STATE, block_tokens=16)
        keys = space.keys(list(range(128 * 16)))
        space.put(keys, [b"x" * 4096] * len(keys), durable=False)
        hit = timed(lambda: space.contains(keys), reps=2000)
        miss = timed(lambda: space.contains([b"absent", *keys[1:]]), reps=2000)
        ping = timed(client.ping, reps=2000)
        client.close()
    finally:
        daemon.cleanup()
    return [
        ["contains, 128 keys, all held", fmt_time(median(hit)), fmt_time(percentile(hit, 99))],
        ["contains, 128 keys, first missing", fmt_time(median(miss)), fmt_time(percentile(miss, 99))],
        ["ping (protocol round trip, reference)", fmt_time(median(ping)), fmt_time(percentile(ping, 99))],
    ]


class Chat:
    """Conversations of ``turns`` turns, each adding ``new_tokens`` tokens; KV of ``token_bytes`` a token."""

    def __init__(self, conversations: int, turns: int, new_tokens: int, token_bytes: int) -> None:
        self.conversations, self.turns = conversations, turns
        self.new_tokens, self.token_bytes = new_tokens, token_bytes
        self.block_bytes = BLOCK_TOKENS * token_bytes
        self._kv: dict[int, np.ndarray] = {}

    def tokens(self, conv: int, turn: int) -> list[int]:
        return [conv * 1_000_000 + i for i in range(self.new_tokens * (turn + 1))]

    def kv(self, conv: int) -> np.ndarray:
        """The engine's KV of a whole conversation (bytes per token, position-major)."""
        if conv not in self._kv:
            size = self.new_tokens * self.turns * self.token_bytes
            self._kv[conv] = np.random.default_rng(conv).integers(0, 255, size, dtype=np.uint8)
        return self._kv[conv]

    def unique_bytes(self) -> int:
        return self.conversations * self.new_tokens * self.turns * self.token_bytes


def chat_rows(workdir: Path, chat: Chat) -> tuple[list[list[str]], list[list[str]]]:
    import torch

    import skippyd

    results: dict[str, dict[str, Any]] = {}
    working_set = chat.unique_bytes()
    for shape in ("entries", "blocks"):
        for budget_name, budget in (("room", working_set * 4), ("fifth", working_set // 5)):
            daemon = BenchDaemon(workdir / f"{shape}-{budget_name}", budget=str(max(budget, 8 * MiB))).start()
            try:
                client = skippyd.Client(daemon.socket, timeout=300)
                space = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK_TOKENS)
                sent = 0
                capture_s: list[float] = []
                new_s: list[float] = []
                hits = restorable = restored = lookups = 0
                for turn in range(chat.turns):
                    for conv in range(chat.conversations):
                        tokens = chat.tokens(conv, turn)
                        n = len(tokens)
                        kv = chat.kv(conv)
                        if turn:  # the next turn starts by restoring what the last one left
                            lookups += 1
                            restorable += n - chat.new_tokens
                            got = _restore(client, space, shape, chat, tokens[: n - chat.new_tokens])
                            hits += got > 0
                            restored += got
                        start = time.perf_counter()
                        if shape == "entries":
                            with contextlib.suppress(skippyd.TooLarge):  # larger than the budget: not kept
                                client.capture(model=MODEL, state=STATE, tokens=tokens,
                                               tensors={"kv": torch.from_numpy(kv[: n * chat.token_bytes])},
                                               durable=False)  # fmt: skip
                            sent += n * chat.token_bytes
                        else:
                            keys = space.keys(tokens)
                            held = space.contains(keys)
                            blocks = [
                                kv[i * chat.block_bytes : (i + 1) * chat.block_bytes]
                                for i in range(held, len(keys))
                            ]
                            put = space.put(
                                keys[held:], blocks, durable=False, parent=keys[held - 1] if held else None
                            )
                            sent += sum(len(b) for b in blocks)
                            del put
                        capture_s.append(time.perf_counter() - start)
                        new_s.append(_memcpy(chat.new_tokens * chat.token_bytes, reps=3))
                stats = client.stats()["l2"]
                held_bytes = stats["bytes"] + stats["block_bytes"]
                results[f"{shape}-{budget_name}"] = {
                    "held": held_bytes, "sent": sent, "capture": capture_s, "new": new_s,
                    "hit_rate": hits / max(lookups, 1), "restored": restored / max(restorable, 1),
                }  # fmt: skip
                if budget_name == "room":
                    conv = 0
                    tokens = chat.tokens(conv, chat.turns - 1)
                    prefix = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS
                    paged = [
                        np.empty(chat.block_bytes, dtype=np.uint8) for _ in range(prefix // BLOCK_TOKENS)
                    ]
                    restore = partial(_restore, client, space, shape, chat, tokens[:prefix], paged)
                    samples = timed(restore, reps=9)
                    results[f"{shape}-room"]["restore"] = median(samples)
                    results[f"{shape}-room"]["restore_memcpy"] = _memcpy(prefix * chat.token_bytes)
                client.close()
            finally:
                daemon.cleanup()
    rows = []
    for shape in ("entries", "blocks"):
        room, fifth = results[f"{shape}-room"], results[f"{shape}-fifth"]
        capture = room["capture"]
        ratio = [c / m for c, m in zip(capture, room["new"], strict=True)]
        rows.append([
            shape,
            f"{room['held'] / working_set:.2f}",
            f"{room['sent'] / working_set:.2f}",
            fmt_time(median(capture)), fmt_time(percentile(capture, 99)),
            f"{median(ratio):.1f}×", f"{percentile(ratio, 99):.1f}×",
            f"{room['restore'] / room['restore_memcpy']:.2f}×",
            f"{fifth['hit_rate']:.2f}", f"{fifth['restored']:.2f}",
        ])  # fmt: skip
    return rows, []


def _restore(  # noqa: PLR0917 - one workload's parts, passed through
    client: Any, space: Any, shape: str, chat: Chat, tokens: list[int], paged: list[np.ndarray] | None = None
) -> int:
    """Restores the longest held prefix of ``tokens`` into the engine's paged buffer; returns its tokens."""
    if shape == "entries":
        restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
        if restored is None:
            return 0
        flat = restored.tensors["kv"].numpy()
        count = restored.token_count // BLOCK_TOKENS
        pages = (
            paged if paged is not None else [np.empty(chat.block_bytes, dtype=np.uint8) for _ in range(count)]
        )
        for i in range(min(count, len(pages))):  # the engine's pages are elsewhere: one copy into them
            np.copyto(pages[i], flat[i * chat.block_bytes : (i + 1) * chat.block_bytes])
        return int(restored.token_count)
    keys = space.keys(tokens)
    pages = paged if paged is not None else [np.empty(chat.block_bytes, dtype=np.uint8) for _ in keys]
    return int(space.get_into(keys, pages)) * BLOCK_TOKENS


PAGED_LAYERS, PAGED_HEADS, PAGED_BLOCKS = 8, 8, 8
PAGED_TITLE = (
    "Restore into the engine's paged layout (pieces): {blocks} blocks of 256 tokens into a vLLM-shaped KV "
    "cache ({layers} layers, one bf16 tensor (2, pages, 16, {heads} heads, 128) each), every block given to "
    "`get_into` as its {pieces} pieces (16 pages × every layer × K and V, 32 KiB each); ÷ memcpy is the "
    "median over 11 rounds of its time ÷ a numpy memcpy of the same {mib} MiB timed right before it "
    "(target ≤ 1.3×); under each, the same copies from one plain buffer without skippyd (the layout's "
    "own cost: 32 KiB copies into scattered pages run slower than one long memcpy):\n\n"
)


def paged_rows(workdir: Path) -> list[list[str]]:
    """``get_into`` with pieces into a vLLM-shaped paged layout: pages in runs of consecutive page ids (the
    pieces of a run merge into one copy per layer and K/V) and pages scattered (one copy each), beside a
    memcpy of the bytes and beside what an engine did without pieces (``get`` views, one copy per page)."""
    import torch

    import skippyd

    layers, heads, count = PAGED_LAYERS, PAGED_HEADS, PAGED_BLOCKS
    pages = count * 16
    shape = (2, pages, 16, heads, 128)
    gen = torch.Generator().manual_seed(5)
    source = [torch.randint(0, 256, (2 * pages * 16 * heads * 128 * 2,), dtype=torch.uint8, generator=gen)
              .view(torch.bfloat16).view(shape) for _ in range(layers)]  # fmt: skip
    engine = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]

    def pieces(caches: list[Any], ids: list[int]) -> list[Any]:
        return [cache[kv, page] for cache in caches for kv in range(2) for page in ids]

    in_order = [list(range(16 * b, 16 * (b + 1))) for b in range(count)]
    scattered_ids = torch.randperm(pages, generator=gen).tolist()
    scattered = [scattered_ids[16 * b : 16 * (b + 1)] for b in range(count)]
    total = count * layers * 2 * 16 * 16 * heads * 128 * 2
    src_bytes = np.random.default_rng(6).integers(0, 255, total, dtype=np.uint8)
    dst_bytes = np.ones_like(src_bytes)

    def paired(op: Callable[[], object], reps: int = 11) -> tuple[float, float]:
        """Medians of ``op`` and of the ratio to a memcpy of the same bytes timed right before it each
        time (the machine is shared: its load drifts between a reference and a later figure)."""
        took, ratios = [], []
        for _ in range(reps):
            start = time.perf_counter()
            np.copyto(dst_bytes, src_bytes)
            ref = time.perf_counter() - start
            start = time.perf_counter()
            op()
            took.append(time.perf_counter() - start)
            ratios.append(took[-1] / ref)
        return median(took), median(ratios)

    memcpy = _memcpy(total)
    rows = [[f"numpy memcpy of {total // MiB} MiB (reference)", fmt_time(memcpy), "1.00×"]]
    daemon = BenchDaemon(workdir / "paged", "--l2-reserve", "0", budget="512MiB").start()
    try:
        client = skippyd.Client(daemon.socket, timeout=120)
        space = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK_TOKENS)
        keys = space.keys(list(range(count * BLOCK_TOKENS)))
        space.put(keys, [pieces(source, ids) for ids in in_order], durable=False)
        flat = torch.from_numpy(src_bytes)
        for label, ids in (("pages in order", in_order), ("pages scattered", scattered)):
            outs = [pieces(engine, block) for block in ids]

            def restore(outs: list[list[Any]] = outs) -> None:
                space.get_into(keys, outs)

            took, ratio = paired(restore)
            for b in range(count):
                for src, dst in zip(in_order[b], ids[b], strict=True):
                    for layer in range(layers):
                        assert torch.equal(
                            engine[layer][:, dst].view(torch.uint8), source[layer][:, src].view(torch.uint8)
                        )
            rows.append([f"get_into with pieces, {label}", fmt_time(took), f"{ratio:.2f}×"])
            starts = [(p.data_ptr(), p.numel() * 2) for out in outs for p in out]

            def floor(starts: list[tuple[int, int]] = starts) -> None:  # the same copies, no skippyd
                at = flat.data_ptr()
                for address, size in starts:
                    ctypes.memmove(address, at, size)
                    at += size

            took, ratio = paired(floor)
            rows.append(
                [
                    f"  the same 32 KiB copies from one buffer (no skippyd), {label}",
                    fmt_time(took),
                    f"{ratio:.2f}×",
                ]
            )

        def views_then_copies() -> None:  # without pieces: views of the blocks, one copy_ per page
            for block, ids in zip(space.get(keys), scattered, strict=True):
                at = 0
                for piece in pieces(engine, ids):
                    size = piece.numel() * 2
                    piece.view(-1).view(torch.uint8).copy_(block[at : at + size])
                    at += size

        took, ratio = paired(views_then_copies)
        rows.append(
            [
                "get views + one copy_ per page (without pieces), pages scattered",
                fmt_time(took),
                f"{ratio:.2f}×",
            ]
        )
        client.close()
    finally:
        daemon.cleanup()
    return rows


def l3_rows(workdir: Path) -> list[list[str]]:
    import skippyd

    count, nbytes = 256, 256 * 1024
    data = _blocks(count, nbytes, seed=3)
    daemon = BenchDaemon(workdir / "l3", budget="512MiB").start()
    keys = [f"l3:{i}".encode() for i in range(count)]
    out = [np.empty(nbytes, dtype=np.uint8) for _ in range(count)]
    try:
        with skippyd.Client(daemon.socket, timeout=120) as client:
            client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK_TOKENS).put(keys, data, durable="sync")
        reads, plains = [], []
        plain_path = workdir / "plain.bin"
        plain_path.write_bytes(b"".join(d.tobytes() for d in data))
        os.sync()  # written back, so dropping the cache really drops it
        buffer = memoryview(bytearray(count * nbytes))
        packs = workdir / "l3" / "state" / "l3" / "packs"

        def plain() -> None:
            drop_cache(plain_path)
            start = time.perf_counter()
            plain_read(plain_path, buffer)
            plains.append(time.perf_counter() - start)

        for rep in range(7):  # this VM's disk speed moves by 2-3x within seconds: pairs, in both orders
            if rep % 2:
                plain()
            daemon.stop(wipe_tmpfs=True)
            daemon.start()
            for pack in packs.glob("*.pack"):  # (packs are fsynced by the daemon)
                drop_cache(pack)
            with skippyd.Client(daemon.socket, timeout=120) as client:
                space = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK_TOKENS)
                time.sleep(1.0)  # the daemon just started: its reserve stocks the groups L3 holds
                start = time.perf_counter()
                assert space.get_into(keys, out) == count
                reads.append(time.perf_counter() - start)
            if not rep % 2:
                plain()
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    finally:
        daemon.cleanup()
    ratio = median([p / r for p, r in zip(plains, reads, strict=True)])
    return [
        ["plain read of 64 MiB, page cache dropped (reference)", fmt_time(median(plains)), "1.00×"],
        ["get_into 256 × 256 KiB from L3, 1 s after a restart, cache dropped", fmt_time(median(reads)),
         f"{ratio:.2f}×"],
    ]  # fmt: skip


_NEIGHBOUR = r"""
import json, sys, time
import numpy as np
src = np.random.default_rng(5).integers(0, 255, 16 << 20, dtype=np.uint8)
dst = np.ones_like(src)
for _ in range(4):
    np.copyto(dst, src)
for line in sys.stdin:
    end = time.perf_counter() + float(line)
    took = []
    while time.perf_counter() < end:
        start, cpu = time.perf_counter(), time.thread_time()
        np.copyto(dst, src)
        took.append((time.perf_counter() - start, time.thread_time() - cpu))
    print(json.dumps(took), flush=True)
"""


NEIGHBOUR_TITLE = (
    "A quiet neighbour: another process copying 16 MiB at a time for 1 s right after a put of 64 MiB to a "
    "daemon returns (its background work: the digester hashing the put, the reserve refilling what it "
    "took), against the second before the put; one daemon per setting, taken in turn, 7 rounds (target: "
    "throughput ≥ 0.9× undisturbed; vs idle is the median of the pairs' ratios, the machine being shared "
    "and its load drifting; vs nothing divides that by the same ratio with no background work at all, "
    "the control; per CPU second is the same ratio of bytes per second of the neighbour's own CPU time, "
    "which leaves out the time the scheduler gave others; p90 copy is the slowest tenth of the copies after "
    "a put ÷ before one); refilled is what the reserve faulted in within the second after a put, daemon "
    "CPU its user and system time in that second:\n\n"
)
NEIGHBOUR_CASES = (  # what a daemon does in the background after a put
    ("nothing (no reserve; puts hash their blocks)", ("--l2-reserve", "0", "--l2-digest-backlog", "0")),
    ("the digester only", ("--l2-reserve", "0")),
    (
        "the reserve only, unpaced",
        ("--l2-reserve-rate", "0", "--l2-reserve-share", "0", "--l2-digest-backlog", "0"),
    ),
    ("the reserve only, paced (defaults)", ("--l2-digest-backlog", "0")),
    ("the reserve only, share 0.1", ("--l2-reserve-share", "0.1", "--l2-digest-backlog", "0")),
    ("the digester and the reserve (defaults)", ()),
)
NEIGHBOUR_HEADERS = [
    "neighbour's memcpy", "throughput", "vs idle", "vs nothing", "per CPU second", "p90 copy",
    "refilled / put", "daemon CPU",
]  # fmt: skip


def neighbour_rows(workdir: Path, *, trials: int = 7, window: float = 1.0) -> list[list[str]]:
    """A neighbour process copying 16 MiB at a time, for ``window`` seconds at once: while a daemon is
    idle (its background work settled), and right after a put of 64 MiB to it returns (its background
    work: the digester hashes the put, the reserve refills the slots it took). One daemon per setting,
    all started at once and taken in turn in every trial, so the machine's drifting load falls on every
    setting alike. Throughput (vs idle: the median of the ratio of each pair, the second after the put to
    the second before it), and the slowest tenth of the copies (what a neighbour's request sees)."""
    import skippyd

    count, nbytes = 256, 256 * 1024
    data = _blocks(count, nbytes, seed=9)
    neighbour = subprocess.Popen(
        [sys.executable, "-c", _NEIGHBOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def copies() -> list[tuple[float, float]]:
        """Each copy's wall and CPU seconds, for ``window`` seconds."""
        assert neighbour.stdin is not None and neighbour.stdout is not None
        neighbour.stdin.write(f"{window}\n")
        neighbour.stdin.flush()
        return [(float(w), float(c)) for w, c in json.loads(neighbour.stdout.readline())]

    def gbps(took: list[tuple[float, float]], *, cpu: bool = False) -> float:
        return len(took) * 16 * MiB / sum(t[cpu] for t in took) / 1e9

    def cpu_s(daemon: BenchDaemon) -> float:
        """The daemon's CPU time so far, user and system (its faults are system time)."""
        assert daemon.proc is not None
        fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    daemons: list[BenchDaemon] = []
    cpu = [0.0] * len(NEIGHBOUR_CASES)
    idle: list[tuple[float, float]] = []
    busy: list[list[tuple[float, float]]] = [[] for _ in NEIGHBOUR_CASES]
    ratios: list[list[float]] = [[] for _ in NEIGHBOUR_CASES]
    cpu_ratios: list[list[float]] = [[] for _ in NEIGHBOUR_CASES]
    refilled = [0] * len(NEIGHBOUR_CASES)
    try:
        for n, (_, args) in enumerate(NEIGHBOUR_CASES):
            daemons.append(BenchDaemon(workdir / f"neighbour-{n}", *args, budget="1GiB").start())
        clients = [skippyd.Client(daemon.socket, timeout=120) for daemon in daemons]
        spaces = [client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK_TOKENS) for client in clients]
        for trial in range(trials):
            for n, (client, space) in enumerate(zip(clients, spaces, strict=True)):
                time.sleep(1.0)  # the last put's background work done
                before_put = copies()
                before = client.stats()["l2"]["block_prefaulted"]
                space.put([b"n%d-%d" % (trial, i) for i in range(count)], data, durable=False)
                used = cpu_s(daemons[n])
                after_put = copies()
                cpu[n] += cpu_s(daemons[n]) - used
                refilled[n] += client.stats()["l2"]["block_prefaulted"] - before
                ratios[n].append(gbps(after_put) / gbps(before_put))
                cpu_ratios[n].append(gbps(after_put, cpu=True) / gbps(before_put, cpu=True))
                idle += before_put
                busy[n] += after_put
        for client in clients:
            client.close()
    finally:
        neighbour.kill()
        neighbour.wait()
        for daemon in daemons:
            daemon.cleanup()
    slow_idle = percentile([wall for wall, _ in idle], 90)
    rows = [["the daemons idle (every second before a put)", f"{gbps(idle):.2f} GB/s", "1.00×", "-", "1.00×",
             "1.00×", "-", "-"]]  # fmt: skip
    control = median(ratios[0])  # the put alone, nothing in the background: what the order of a pair does
    for n, (label, _) in enumerate(NEIGHBOUR_CASES):
        slow = percentile([wall for wall, _ in busy[n]], 90)
        rows.append([
            f"after a put: {label}", f"{gbps(busy[n]):.2f} GB/s", f"{median(ratios[n]):.2f}×",
            f"{median(ratios[n]) / control:.2f}×", f"{median(cpu_ratios[n]):.2f}×",
            f"{slow / slow_idle:.2f}×",
            f"{refilled[n] * nbytes / trials / MiB:.0f} MiB", f"{cpu[n] / trials / window:.2f} core",
        ])  # fmt: skip
    return rows


PUTS_TITLE = (
    "Puts and captures, the call against the time until the data is committed (readable from another "
    "connection), before ({before}) and after ({after}); each ÷ a numpy memcpy of the same bytes in the same "
    "process; CPU tensors, durable off, a tier with room (the previous repetition's blocks or entry "
    "evicted before each, so its slots or file are reused faulted in, as after an LRU eviction), median of "
    "{reps}:\n\n"
)
PUTS_HEADERS = ["operation", "code", "memcpy", "call", "call ÷ memcpy", "committed", "committed ÷ memcpy"]
_PUT_CASES = [("BlockSpace.put 64 × 8 MiB", 64, 8 * MiB), ("BlockSpace.put 2048 × 256 KiB", 2048, 256 * 1024)]
_CAPTURE_CASES = [
    ("capture 64 MiB", 64 * MiB, False),
    ("capture 512 MiB", 512 * MiB, False),
    ("capture 512 MiB, a fresh file", 512 * MiB, True),  # nothing evicted before: new tmpfs pages
]


def put_measures(workdir: Path, reps: int) -> list[tuple[str, float, float, float]]:
    """(case, memcpy, call, committed) medians for each put and capture case, on this tree's skippyd."""
    import torch

    import skippyd

    daemon = BenchDaemon(workdir, "--l3-dir", "off", budget="6GiB").start()
    out: list[tuple[str, float, float, float]] = []
    try:
        with skippyd.Client(daemon.socket, timeout=120) as client, skippyd.Client(daemon.socket) as other:
            for name, count, nbytes in _PUT_CASES:
                data = [torch.from_numpy(b) for b in _blocks(count, nbytes, seed=7)]
                memcpy = _memcpy(count * nbytes, reps=reps)
                calls, commits = [], []
                for rep in range(reps + 1):
                    state = f"{STATE}-{count}"
                    blocks = client.blocks(model=MODEL, state=state, block_tokens=BLOCK_TOKENS)
                    look = other.blocks(model=MODEL, state=state, block_tokens=BLOCK_TOKENS)
                    keys = [b"%d-%d" % (rep, i) for i in range(count)]
                    # the last repetition's blocks go: their slots stay faulted in for this one's, as an
                    # LRU eviction leaves them
                    other.evict(model=MODEL, state=state, blocks=True)
                    time.sleep(0.5)
                    start = time.perf_counter()
                    blocks.put(keys, data, durable=False)
                    called = time.perf_counter() - start
                    while look.contains(keys[-1:]) < 1:  # the last request's copy commits last
                        pass
                    committed = time.perf_counter() - start
                    if rep:  # the first warms the staging buffer and the slots
                        calls.append(called)
                        commits.append(committed)
                out.append((name, memcpy, median(calls), median(commits)))
                del data
            for case, (name, nbytes, fresh) in enumerate(_CAPTURE_CASES):
                tensor = torch.from_numpy(_blocks(1, nbytes, seed=8)[0])
                memcpy = _memcpy(nbytes, reps=reps)
                calls, commits = [], []
                for rep in range(reps + 1):
                    if rep and not fresh:  # the last one's file is recycled (kept faulted in)
                        other.evict(model=MODEL, state=STATE, tokens=[case, rep, 7])
                    time.sleep(0.5)
                    tokens = [case, rep + 1, 7]
                    start = time.perf_counter()
                    client.capture(
                        model=MODEL, state=STATE, tokens=tokens, tensors={"kv": tensor}, durable=False
                    )
                    called = time.perf_counter() - start
                    while other.lookup(model=MODEL, state=STATE, tokens=tokens) is None:
                        pass
                    committed = time.perf_counter() - start
                    if rep:
                        calls.append(called)
                        commits.append(committed)
                out.append((name, memcpy, median(calls), median(commits)))
                del tensor
    finally:
        daemon.cleanup()
    return out


def put_rows(workdir: Path, reps: int, before: Path | None) -> tuple[list[list[str]], str]:
    """Rows for ``--puts``: this tree's measures, and beside each the same run on ``before`` (another
    checkout of skippyd, e.g. main's, measured in a subprocess of this script from there)."""
    runs: list[tuple[str, list[tuple[str, float, float, float]]]] = []
    if before is not None:
        done = subprocess.run(
            [sys.executable, "-m", "bench.blocks", "--puts-json", "--reps", str(reps)],
            cwd=before, check=True, capture_output=True, text=True,
        )  # fmt: skip
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(("before", [(str(n), float(m), float(c), float(t)) for n, m, c, t in measured]))
    runs.append(("after", put_measures(workdir, reps)))
    rows = []
    by_name = [(label, {m[0]: m for m in measures}) for label, measures in runs]
    for case in runs[-1][1]:
        for label, measured in by_name:
            if case[0] not in measured:  # (a row the other tree does not have)
                continue
            name, memcpy, call, committed = measured[case[0]]
            rows.append([
                name, label, fmt_time(memcpy), fmt_time(call), f"{memcpy / call:.2f}×", fmt_time(committed),
                f"{memcpy / committed:.2f}×",
            ])  # fmt: skip
    return rows, PUTS_TITLE.format(before=before or "-", after=Path.cwd().name, reps=reps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--token-bytes", type=int, default=8192, help="KV bytes per token (all layers)")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--neighbour-only", action="store_true", help="run only the neighbour's part")
    parser.add_argument("--neighbour-rounds", type=int, default=7, help="put/measure rounds per setting")
    parser.add_argument("--paged-only", action="store_true", help="run only the paged-layout restore")
    parser.add_argument("--puts", action="store_true", help="run only the put and capture table")
    parser.add_argument(
        "--before", type=Path, help="with --puts: a checkout of skippyd (e.g. main's) to run beside"
    )
    parser.add_argument("--reps", type=int, default=5, help="with --puts: repetitions")
    parser.add_argument("--puts-json", action="store_true", help=argparse.SUPPRESS)  # what --before runs
    args = parser.parse_args()
    if args.puts or args.puts_json:
        workdir = Path(tempfile.mkdtemp(prefix="skbp-", dir="/tmp"))
        try:
            if args.puts_json:
                print(json.dumps(put_measures(workdir, args.reps)))
                return
            rows, title = put_rows(workdir, args.reps, args.before)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(title + table(PUTS_HEADERS, rows))
        return
    workdir = Path(tempfile.mkdtemp(prefix="skbb-", dir="/tmp"))
    neighbour_title = NEIGHBOUR_TITLE.replace("7 rounds", f"{args.neighbour_rounds} rounds")
    paged_title = PAGED_TITLE.format(
        blocks=PAGED_BLOCKS, layers=PAGED_LAYERS, heads=PAGED_HEADS, pieces=PAGED_LAYERS * 2 * 16,
        mib=PAGED_BLOCKS * PAGED_LAYERS * 2 * 16 * 16 * PAGED_HEADS * 128 * 2 // MiB,
    )  # fmt: skip
    if args.paged_only:
        try:
            print(paged_title + table(["operation", "median", "÷ memcpy"], paged_rows(workdir)))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    if args.neighbour_only:
        try:
            rows = neighbour_rows(workdir, trials=args.neighbour_rounds)
            print(
                NEIGHBOUR_TITLE.replace("7 rounds", f"{args.neighbour_rounds} rounds")
                + table(NEIGHBOUR_HEADERS, rows)
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        bulk = bulk_rows(workdir)
        small = small_rows(workdir)
        reserve = reserve_rows(workdir)
        chat = Chat(args.conversations, args.turns, args.new_tokens, args.token_bytes)
        chat_table, _ = chat_rows(workdir, chat)
        paged = paged_rows(workdir)
        l3 = l3_rows(workdir)
        neighbour = neighbour_rows(workdir, trials=args.neighbour_rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "\n\n".join([
        "Bulk block transfers (64 MiB as 256 blocks of 256 KiB; speed relative to a numpy memcpy of the same "
        "bytes measured in this run; targets: put ≥ 0.5×, get_into ≥ 0.6×, get ≤ 0.5 ms):\n\n"
        + table(["operation", "median", "vs memcpy"], bulk),
        "Small requests (target: contains of 128 keys ≤ 0.3 ms):\n\n"
        + table(["operation", "p50", "p99"], small),
        f"Multi-turn chat: {chat.conversations} conversations × {chat.turns} turns of {chat.new_tokens} new "
        f"tokens, {chat.token_bytes} KV bytes a token, blocks of {BLOCK_TOKENS} tokens; entries capture the "
        "whole prefix each turn, blocks put only the new whole blocks (the partial tail is left to the next "
        "turn). held and sent are ÷ the unique KV bytes; capture is per turn, ÷ a memcpy of the turn's new "
        "bytes; restore is the longest prefix into the engine's paged buffer ÷ a memcpy of those bytes; "
        "hit rate and tokens restored ÷ restorable are under an L2 budget of one fifth "
        "of the working set:\n\n"
        + table(["shape", "held ÷ unique", "sent ÷ unique", "capture p50", "capture p99", "÷ new memcpy p50",
                 "÷ new memcpy p99", "restore ÷ memcpy", "hit rate (⅕)", "restored (⅕)"], chat_table),
        paged_title + table(["operation", "median", "÷ memcpy"], paged),
        "Entry capture end to end into a tier with room, before and after the pre-faulted reserve "
        "(target ≥ 0.3× memcpy; each capture and its memcpy timed after the same 1 s idle pause):\n\n"
        + table(["operation", "median", "vs memcpy"], reserve),
        "L3 (target ≥ 0.6× a plain read; vs plain read is the median over 7 adjacent pairs, in alternating "
        "order):\n\n" + table(["operation", "median", "vs plain read"], l3),
        neighbour_title + table(NEIGHBOUR_HEADERS, neighbour),
    ])  # fmt: skip
    print(text)
    if args.write_docs:
        write_section("blocks", f"Machine: {machine()}. `python -m bench.blocks`, one run.\n\n{text}")


if __name__ == "__main__":
    main()
