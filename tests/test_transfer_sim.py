"""The device transfer's own logic on the CPU, against a real daemon: CUDA's streams and events are
replaced by stand-ins that record what was asked (skippyd.client.transfer.sim, which bench.gpu_host uses too),
the "device" tensors are CPU tensors, and the batched copy is a stand-in that moves bytes by address
with ``memmove`` (so the addresses the batch call would get are checked byte for byte). What this cannot
check is CUDA itself: tests/test_cuda.py does that on a GPU. Both copy paths (one batch call, one
``copy_`` per run) run here."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemonutil import eventually

from skippyd.client.tensors import device_views
from skippyd.client.transfer import cuda, plan
from skippyd.client.transfer import device as dev
from skippyd.client.transfer import leases as leases_module
from skippyd.client.transfer.sim import FakeEvent, FakeStream, Recorder
from skippyd.keys import encode_tokens
from skippyd.payload import TensorSpec

MODEL, STATE = "sim-model@sha256:0", "paged-kv-v1"
BLOCK = 16


def _memmove_batch(dsts: Any, srcs: Any, sizes: Any, count: int, *rest: Any) -> int:
    for i in range(count):
        ctypes.memmove(dsts[i], srcs[i], sizes[i])
    _memmove_batch.calls += 1  # type: ignore[attr-defined]
    return 0


@pytest.fixture(params=["batch", "per-run"])
def sim(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    current = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda _stream: contextlib.nullcontext())
    _memmove_batch.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(cuda, "_batch", [_memmove_batch if request.param == "batch" else None])
    rec = Recorder()
    transfer = dev.DeviceTransfer(register=rec.register, unregister=rec.unregister)
    transfer.idle_sweep = 3600  # (calls sweep; a test of the idle sweeper sets its own)
    yield {"transfer": transfer, "rec": rec, "current": current, "mode": request.param}
    transfer.close()


def _random(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _ident(tokens: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "state": STATE, "namespace": "", "tokens": encode_tokens(tokens)}


def test_an_entry_goes_to_the_device_in_one_run_registered_once_and_the_caller_waits_on_its_event(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    transfer, rec, current = sim["transfer"], sim["rec"], sim["current"]
    proc = make_daemon(budget="64MiB").start()
    tensors = {"k": _random(3 << 20, 1).view(torch.float16), "v": _random(1 << 20, 2).view(torch.int32)}
    with proc.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1], tensors=tensors, durable=False)
        for attempt in range(2):
            reply, fds = client._call({"op": "restore", **_ident([1])})
            try:
                data = transfer.entry_to_device(
                    fds[0], reply["generation"], reply["data_offset"], reply["data_len"], torch.device("cpu")
                )
            finally:
                os.close(fds[0])
            assert data is not None
            specs = [TensorSpec.from_wire(t) for t in reply["tensors"]]
            views = device_views(data, specs)
            assert all(
                torch.equal(views[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items()
            )
            # the caller's stream waits on skippyd's event; skippyd's stream first waited for the caller's
            assert current.waited and current.waited[-1][0] == "event"
            assert current.waited[-1][1].blocking  # (the leases' thread sleeps on it: no core spins)
            assert [c[0] for c in rec.calls] == ["register"], f"attempt {attempt}: registered again"
            assert rec.calls[0][3] == 8  # read-only
        assert transfer.copies == 2  # one run per restore
        transfer.drain()
        assert transfer.in_flight == 0  # the duplicated leases were closed once the events passed


def test_blocks_into_pages_of_one_tensor_merge_into_runs_and_a_new_generation_reregisters(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    transfer, rec = sim["transfer"], sim["rec"]
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    nbytes = 64 * 1024
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        keys = blocks.keys(list(range(8 * BLOCK)))
        data = [_random(nbytes, 10 + i) for i in range(8)]
        blocks.put(keys, data, durable=False)
        pages = torch.zeros((8, nbytes), dtype=torch.uint8)
        reply, fds = client._call(blocks._body("blocks_get", keys))
        try:
            placements = [tuple(p) for p in reply["blocks"]]
            order = [3, 1, 0, 2, 7, 6, 5, 4]  # scattered pages: no two blocks merge
            scattered = [pages[i] for i in order]
            assert transfer.blocks_to_device(placements, fds, reply["generations"], scattered)
            assert all(torch.equal(pages[order[i]], data[i]) for i in range(8))
            runs_scattered = transfer.copies
            pages.zero_()
            assert transfer.blocks_to_device(placements, fds, reply["generations"], list(pages.unbind(0)))
            assert all(torch.equal(pages[i], data[i]) for i in range(8))
            runs_in_order = transfer.copies - runs_scattered
        finally:
            for fd in fds:
                os.close(fd)
        assert runs_scattered == 8 and runs_in_order == 1  # 64 KiB blocks fill 64 KiB slots: one run
        registered = [c for c in rec.calls if c[0] == "register"]
        assert len(registered) == 1 and registered[0][2] == 8 * nbytes  # the slots read, not the slab
        # punch and refill: the same slab, another generation, so registered again
        transfer.drain()  # (the copies' leases are closed once their events pass: here at once)
        held = blocks.get(keys[:1])
        client.evict(all=True)
        other = blocks.keys(list(range(5000, 5000 + 4 * BLOCK)))
        newer = [_random(nbytes, 50 + i) for i in range(4)]
        blocks.put(other, newer, durable=False)
        reply, fds = client._call(blocks._body("blocks_get", other))
        try:
            outs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in other]
            assert transfer.blocks_to_device(
                [tuple(p) for p in reply["blocks"]], fds, reply["generations"], outs
            )
            assert all(torch.equal(o, n) for o, n in zip(outs, newer, strict=True))
        finally:
            for fd in fds:
                os.close(fd)
        assert transfer.book.stats.generation_changes == 1
        assert [c[0] for c in rec.calls[len(registered) :]][:1] == ["unregister"]
        del held
    if sim["mode"] == "batch":
        assert _memmove_batch.calls >= 3  # type: ignore[attr-defined]


def test_device_to_host_copies_land_in_the_staging_region_at_their_offsets(sim: dict[str, Any]) -> None:
    import mmap

    transfer, rec = sim["transfer"], sim["rec"]
    mapping = mmap.mmap(-1, 1 << 20)
    region = memoryview(mapping)[: 1 << 20]
    both = _random(104_096, 1)
    first, second = both[:100_000], both[100_000:]  # one storage: adjacent on both sides
    strided = _random(64 * 32, 3).view(64, 32).t()  # made contiguous first
    transfer.to_host(region, [(0, first), (100_000, second), (200_000, strided)])
    got = torch.frombuffer(region, dtype=torch.uint8)
    assert torch.equal(got[:100_000], first) and torch.equal(got[100_000:104_096], second)
    assert torch.equal(got[200_000 : 200_000 + 2048], strided.contiguous().reshape(-1))
    assert transfer.copies == 2  # the first two merge into one run
    assert all(c[3] == 0 for c in rec.calls if c[0] == "register")  # writable: no read-only flag
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    del got
    region.release()
    transfer.release_later(mapping, [base])  # (a staging buffer's close)
    transfer.sweep_idle()
    assert rec.calls[-1][0] == "unregister" and transfer.book.stats.registered_bytes == 0
    assert mapping.closed


def test_a_descriptor_served_once_is_left_to_the_host_path(sim: dict[str, Any]) -> None:
    import tempfile

    with tempfile.TemporaryFile() as handle:
        handle.write(b"x" * 8192)
        handle.flush()
        outs = [torch.zeros(4096, dtype=torch.uint8)]
        assert not sim["transfer"].blocks_to_device([(0, 0, 4096)], [handle.fileno()], [0], outs)
        assert sim["transfer"].entry_to_device(handle.fileno(), 0, 0, 4096, torch.device("cpu")) is None
    assert sim["rec"].calls == []


def test_a_layered_get_issues_every_blocks_first_layer_before_any_second_and_gives_an_event_each(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    transfer, current = sim["transfer"], sim["current"]
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    nbytes, half = 64 * 1024, 40 * 1024
    issued: list[int] = []  # each run's destination address
    issue = transfer._issue_flat

    def recording(runs: Any, *args: Any) -> None:
        issued.extend(int(d) for d in runs[1])
        issue(runs, *args)

    transfer._issue_flat = recording
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        keys = blocks.keys(list(range(6 * BLOCK)))
        data = [_random(nbytes, 70 + i) for i in range(6)]
        blocks.put(keys, data, durable=False)
        pages = torch.zeros((6, nbytes), dtype=torch.uint8)
        with transfer.layered([(0, half), (half, nbytes)]) as copies:
            for first in (0, 3):  # two replies, as a long get gets
                reply, fds = client._call(blocks._body("blocks_get", keys[first : first + 3]))
                try:
                    outs = list(pages[first : first + 3].unbind(0))
                    placements = [tuple(p) for p in reply["blocks"]]
                    assert transfer.blocks_to_device(placements, fds, reply["generations"], outs)
                finally:
                    for fd in fds:
                        os.close(fd)
            assert transfer.copies == 0 and not pages.any()  # only collected so far
        assert len(copies.events) == 2
        assert all(torch.equal(pages[i], data[i]) for i in range(6))
        # every block's first span, then every block's second
        assert [(d - pages.data_ptr()) % nbytes for d in issued] == [0] * 6 + [half] * 6
        assert not [w for w in current.waited if w[0] == "event"]  # the caller waits per layer, not here
        transfer.drain()
        assert transfer.in_flight == 0


def test_mappings_a_layered_get_still_needs_outlive_the_limit_and_go_once_it_is_issued(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    rec = Recorder()
    transfer = dev.DeviceTransfer(register=rec.register, unregister=rec.unregister, maps=1)
    transfer.idle_sweep = 3600
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    nbytes = 2 << 20  # two slots a slab here: four blocks take two slabs
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = [_random(nbytes, 90 + i) for i in range(4)]
        blocks.put(keys, data, durable=False)
        pages = torch.zeros((4, nbytes), dtype=torch.uint8)
        with transfer.layered([(0, nbytes // 2), (nbytes // 2, nbytes)]):
            reply, fds = client._call(blocks._body("blocks_get", keys))
            try:
                assert len(fds) == 2
                placements = [tuple(p) for p in reply["blocks"]]
                assert transfer.blocks_to_device(placements, fds, reply["generations"], list(pages.unbind(0)))
            finally:
                for fd in fds:
                    os.close(fd)
            assert len(transfer.maps) == 2  # past the limit of 1: both are still needed
        assert all(torch.equal(pages[i], data[i]) for i in range(4))
        reply, fds = client._call(blocks._body("blocks_get", keys[:1]))
        try:
            outs = [torch.zeros(nbytes, dtype=torch.uint8)]
            assert transfer.blocks_to_device([tuple(reply["blocks"][0])], fds, reply["generations"], outs)
        finally:
            for fd in fds:
                os.close(fd)
        assert len(transfer.maps) == 1 and torch.equal(outs[0], data[0])
        assert [c[0] for c in rec.calls].count("unregister") >= 1  # the dropped mapping's ranges
    transfer.close()


@pytest.fixture
def through_sim(sim: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``BlockSpace.get_into`` sends every tensor piece to the simulated transfer (as it does CUDA ones), and
    counts the memcpys its host path makes (none are expected)."""
    from skippyd.client import blockspace

    monkeypatch.setattr(blockspace, "_CPU_AS_DEVICE", True)
    monkeypatch.setattr(dev, "transfer", lambda: sim["transfer"])
    host: list[int] = []
    original = blockspace._memmoves

    def spy(copies: list[Any]) -> None:
        host.append(len(copies))
        original(copies)

    monkeypatch.setattr(blockspace, "_memmoves", spy)
    return {**sim, "host": host}


def test_get_into_a_vllm_paged_layout_goes_by_dma_one_run_per_consecutive_pages_and_layer(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    from paged import vllm_block, vllm_caches

    transfer, current = through_sim["transfer"], through_sim["current"]
    layers, heads = 4, 2
    source = vllm_caches(layers, 32, heads, seed=3)
    engine = vllm_caches(layers, 64, heads)
    held = [list(range(16)), list(range(16, 32))]
    into = [list(range(48, 64)), list(range(15, -1, -1))]  # consecutive pages; then pages in reverse
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(2 * 256)))
        assert blocks.put(keys, [vllm_block(source, pages) for pages in held], durable=False).stored == 2
        assert blocks.get_into(keys, [vllm_block(engine, pages) for pages in into]) == 2
    for layer in range(layers):
        for b in range(2):
            for src, dst in zip(held[b], into[b], strict=True):
                assert torch.equal(
                    engine[layer][:, dst].view(torch.uint8), source[layer][:, src].view(torch.uint8)
                )
    assert transfer.copies == layers * 2 + layers * 2 * 16  # merged runs: block 0 one per layer and K/V
    assert sum(through_sim["host"]) == 0  # nothing bounced through the host
    assert current.waited and current.waited[-1][0] == "event"  # the caller's stream waits on skippyd's event
    transfer.drain()
    assert transfer.in_flight == 0


def test_get_into_pages_sends_large_pages_by_dma_into_them_and_small_ones_through_one_staging_buffer(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    from paged import vllm_block, vllm_caches

    transfer, current = through_sim["transfer"], through_sim["current"]
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        # large pages (1 MiB): one DMA each, straight into its page (scattered: none merge)
        big = client.blocks(model=MODEL, state="big", block_tokens=BLOCK)
        data = [_random(1 << 20, seed) for seed in range(4)] + [_random(1000, 9)]
        keys = big.keys(list(range(5 * BLOCK)))
        assert big.put(keys, data, durable=False).stored == 5
        pool = torch.zeros(8, 1 << 20, dtype=torch.uint8)
        before = transfer.copies
        assert big.get_into_pages(keys, [pool], [6, 1, 4, 3, 0]) == 5
        assert transfer.copies - before == 5
        for page, block in zip([6, 1, 4, 3], data, strict=False):
            assert torch.equal(pool[page], block)
        assert torch.equal(pool[0, :1000], data[4]) and not pool[0, 1000:].any()  # a short block: its bytes
        assert not pool[[2, 5, 7]].any()
        # small pages (vLLM's 8 KiB rows): whole blocks by DMA into a staging buffer, one run for the
        # reply's consecutive slots, then scattered into the pages on the device
        layers, heads = 3, 2
        source = vllm_caches(layers, 48, heads, seed=5)
        engine = vllm_caches(layers, 96, heads)
        held = [list(range(16)), list(range(16, 32)), list(range(32, 48))]
        into = [list(range(48, 64)), list(range(15, -1, -1)), [64 + 2 * i for i in range(16)]]
        paged = client.blocks(model=MODEL, state="paged", block_tokens=256)
        keys = paged.keys(list(range(3 * 256)))
        assert paged.put(keys, [vllm_block(source, pages) for pages in held], durable=False).stored == 3
        planes = [cache[kv] for cache in engine for kv in range(2)]
        before = transfer.copies
        assert paged.get_into_pages(keys, planes, into) == 3
        assert transfer.copies - before == 1  # 288 pieces of 8 KiB: one DMA of the three blocks
    for layer in range(layers):
        for b in range(3):
            assert torch.equal(
                engine[layer][:, into[b]].view(torch.uint8), source[layer][:, held[b]].view(torch.uint8)
            )
    untouched = sorted(set(range(96)) - {p for pages in into for p in pages})
    assert not any(cache[:, untouched].view(torch.uint8).any() for cache in engine)
    assert sum(through_sim["host"]) == 0  # nothing bounced through the host
    assert current.waited and current.waited[-1][0] == "event"  # the caller's stream waits on skippyd's event
    transfer.drain()
    assert transfer.in_flight == 0


def test_put_pages_of_small_device_pages_gathers_them_on_the_device_in_chunks_that_chain(
    through_sim: dict[str, Any], make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from paged import vllm_block, vllm_caches

    from skippyd.client import blockspace

    gathered: list[int] = []
    real = dev.gather_pages

    def spy(layout: Any, start: int, stop: int) -> torch.Tensor:
        gathered.append(stop - start)
        return real(layout, start, stop)

    monkeypatch.setattr(dev, "gather_pages", spy)
    monkeypatch.setattr(blockspace, "_GATHER_PUT_BYTES", 2 * 512 * 1024)  # two blocks a put
    source = vllm_caches(2, 96, 2, seed=8)  # a block: 2 layers × K/V × 16 pages of 8 KiB = 512 KiB
    pages = torch.randperm(96, generator=torch.Generator().manual_seed(8))[:80].view(5, 16).tolist()
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state="put-pages", block_tokens=256)
        keys = blocks.keys(list(range(5 * 256)))
        put = blocks.put_pages(keys, [cache[kv] for cache in source for kv in range(2)], pages, durable=False)
        assert (put.stored, put.present) == (5, 0)
        assert gathered == [2, 2, 1]
        assert blocks.contains(keys) == 5  # each put named the block before it: one chain
        got = [t.clone() for t in blocks.get(keys)]
        expected = [
            torch.cat([p.reshape(-1).view(torch.uint8) for p in vllm_block(source, page)]) for page in pages
        ]
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_device_destinations_that_require_grad_are_filled_by_dma_and_by_copy(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    """Pages of a leaf tensor that requires grad (an engine's parameters-like buffer): a contiguous page
    goes by DMA as it is, a strided one is laid out with copy_ on a detached view (an in-place copy_
    into the view itself would raise), and the source tensor keeps requiring grad."""
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=16)
        keys = blocks.keys(list(range(2 * 16)))
        data = [_random(4096, seed=11), _random(4096, seed=12)]
        assert blocks.put(keys, data, durable=False).stored == 2
        pages = torch.zeros(2, 1024, dtype=torch.float32, requires_grad=True)
        strided = torch.zeros(32, 32, dtype=torch.float32, requires_grad=True)
        assert blocks.get_into(keys, [pages[0], strided.t()]) == 2
        assert torch.equal(pages[0].detach().view(torch.uint8), data[0])
        assert torch.equal(strided.detach().t().contiguous().view(torch.uint8).reshape(-1), data[1])
        assert pages.requires_grad and strided.requires_grad
        assert sum(through_sim["host"]) == 0
    through_sim["transfer"].drain()


def test_device_destinations_that_require_grad_are_filled_by_the_host_path_when_served_once(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    """Blocks only L3 holds are served once from a memfd (generation 0), which the transfer declines:
    the host path fills the device pieces then, detached, so a destination that requires grad works."""
    import shutil

    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    data = [_random(4096, seed=21), _random(4096, seed=22)]
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=16)
        keys = blocks.keys(list(range(2 * 16)))
        assert blocks.put(keys, data, durable="sync").stored == 2
    proc.stop()
    shutil.rmtree(proc.shm_dir)  # a reboot: only L3 holds the blocks
    proc.shm_dir.mkdir()
    proc.start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=16)
        pages = torch.zeros(2, 1024, dtype=torch.float32, requires_grad=True)
        assert blocks.get_into(keys, [pages[0], pages[1]]) == 2
        assert torch.equal(pages.detach().view(torch.uint8).reshape(2, -1), torch.stack(data))
    assert through_sim["rec"].calls == []  # nothing registered: the host path copied
    through_sim["transfer"].drain()


def test_device_copies_into_both_staging_halves_register_apart_and_both_are_forgotten(
    sim: dict[str, Any],
) -> None:
    """A put writes the half the daemon's last reply freed (docs/protocol.md, "Staging halves"): each half
    is registered on its own, never overlapping the other, and the client's ``_Staging.close`` forgets
    both (the mapping's base and its second half's)."""
    import mmap

    transfer, rec = sim["transfer"], sim["rec"]
    half = 256 * 1024
    mapping = mmap.mmap(-1, 2 * half)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    data = _random(2 * 100_000, 4)
    for index in (0, 1, 0, 1):  # alternating puts: each half registered once, then reused
        region = memoryview(mapping)[index * half : (index + 1) * half]
        transfer.to_host(region, [(0, data[index * 100_000 : (index + 1) * 100_000])])
        region.release()
    got = torch.frombuffer(mapping, dtype=torch.uint8)
    assert torch.equal(got[:100_000], data[:100_000]) and torch.equal(
        got[half : half + 100_000], data[100_000:]
    )
    del got
    spans = sorted((c[1], c[1] + c[2]) for c in rec.calls if c[0] == "register")
    assert len(spans) == 2 and spans[0][1] <= spans[1][0] and spans[0][0] >= base
    transfer.release_later(mapping, [base, base + half])  # (what _Staging.close asks for)
    transfer.sweep_idle()
    assert transfer.book.stats.registered_bytes == 0 and mapping.closed


def _closed(mapping: mmap.mmap) -> bool:
    return bool(mapping.closed)


def test_a_staging_buffer_dropped_without_close_is_unregistered_before_it_is_unmapped(
    sim: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client garbage-collected without close() drops its staging mapping. Unmapped while registered,
    CUDA would keep the old pages for that range, and the next staging mapping, likely at the same
    address, would be found registered already and written through them (the daemon storing other bytes
    than the caller's). So the mapping stays until the transfer's next call unregisters both halves, and
    only then goes; one never registered goes at once."""
    import gc

    from skippyd.client.client import _Staging

    transfer, rec = sim["transfer"], sim["rec"]
    monkeypatch.setattr(dev, "_transfer", [transfer])
    half = 256 * 1024

    def staging() -> _Staging:
        fd = os.memfd_create("staging", os.MFD_CLOEXEC)
        os.ftruncate(fd, 2 * half)
        return _Staging(fd, 2 * half)

    first = staging()
    mapping = first.mapping
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    for index in (0, 1):
        region, _ = first.take(100_000, halves=True)
        transfer.to_host(region, [(0, _random(100_000, index))])
        region.release()
        first.answered(index)
    assert ("host", base) in transfer.book and ("host", base + half) in transfer.book
    del first, region
    gc.collect()
    assert not _closed(mapping) and rec.count("unregister") == 0, "still mapped, still registered"
    second = staging()
    region, _ = second.take(100_000, halves=True)
    data = _random(100_000, 7)
    transfer.to_host(region, [(0, data)])  # its next call: the dropped one's halves go, then its mapping
    assert torch.equal(torch.frombuffer(region, dtype=torch.uint8), data)
    region.release()
    unregistered = [call[1] for call in rec.calls if call[0] == "unregister"]
    assert sorted(unregistered) == [base, base + half] and _closed(mapping)
    second.close()
    third = staging()  # a close (an event loop's, say): deferred the same way, never waiting for the lock
    region, _ = third.take(100_000, halves=True)
    transfer.to_host(region, [(0, data)])
    region.release()
    third_base = third._halves[0]
    rec.calls.clear()
    held = third.mapping
    third.close()
    assert rec.calls == [] and not _closed(held)
    transfer.sweep_idle()  # (what the idle sweeper does a second after the last call)
    assert [c[:2] for c in rec.calls] == [("unregister", third_base)] and _closed(held)
    # closed while a copy into it is on its way (another thread holds its region; it registers after
    # this): kept, its registration dropped again at each look, until it can be unmapped
    racing = staging()
    region, _ = racing.take(100_000, halves=True)
    held = racing.mapping
    racing.close()
    transfer.sweep_idle()
    assert not _closed(held), "still in use: not unmapped"
    transfer.to_host(region, [(0, data)])  # (the copy that was on its way: registers the range)
    region.release()
    assert ("host", racing._halves[0]) in transfer.book
    transfer.sweep_idle()
    assert ("host", racing._halves[0]) not in transfer.book and _closed(held)
    monkeypatch.setattr(dev, "_transfer", [])  # no transfer in this process: nothing was registered
    never = staging()
    kept = never.mapping
    del never
    gc.collect()
    assert _closed(kept)
    closed = staging()
    kept = closed.mapping
    closed.close()
    assert _closed(kept), "with no transfer, a close unmaps at once"


def test_strided_device_pieces_land_in_a_staging_buffer_then_one_copy_each_in_put_order(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    from paged import hf_block, hf_layers, random_like, sglang_block, sglang_pool

    transfer = through_sim["transfer"]
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        source = hf_layers(2, 512, seed=0)
        keys = blocks.keys(list(range(2 * 256)))
        assert blocks.put(keys, [hf_block(source, b) for b in range(2)], durable=False).stored == 2
        engine = hf_layers(2, 512)
        issued: list[Any] = []
        issue = transfer._issue_flat

        def recording(runs: Any, *args: Any) -> None:
            issued.append(list(runs[0]))
            issue(runs, *args)

        transfer._issue_flat = recording
        assert blocks.get_into(keys, [hf_block(engine, b) for b in range(2)]) == 2
        assert all(
            torch.equal(e.view(torch.uint8), s.view(torch.uint8))
            for pe, ps in zip(engine, source, strict=True)
            for e, s in zip(pe, ps, strict=True)
        )
        # the 8 strided pieces are consecutive in the slab and in staging: one DMA per block's slot run
        assert len(issued) == 1 and len(issued[0]) <= 2
        assert sum(through_sim["host"]) == 0
        # a transposed piece, a conjugate one and a piece the block fills only in part, mixed with pages
        pool = sglang_pool(1, 256, 1, seed=5)
        odd, cplx = random_like((16, 8), torch.float32, 6).t(), random_like((4, 8), torch.complex64, 7)
        other = blocks.keys([3] * 256)
        assert (
            blocks.put(
                other,
                [[*sglang_block(pool, [0, 1, 2, 3]), odd, cplx.conj(), torch.arange(8.0)]],
                durable=False,
            ).stored
            == 1
        )
        got_pool = sglang_pool(1, 256, 1)
        got_odd, got_cplx, tail = (
            torch.zeros(16, 8),
            torch.zeros(4, 8, dtype=torch.complex64),
            torch.full((4, 4), -1.0),
        )
        pieces = [*sglang_block(got_pool, [0, 1, 2, 3]), got_odd.t(), got_cplx.conj(), tail.t()]
        assert blocks.get_into(other, [pieces]) == 1
        assert torch.equal(got_pool.view(torch.uint8), pool.view(torch.uint8))
        assert torch.equal(got_odd.t().contiguous().view(torch.uint8), odd.contiguous().view(torch.uint8))
        assert torch.equal(got_cplx.view(torch.uint8), cplx.view(torch.uint8))
        assert torch.equal(tail.t().reshape(-1), torch.cat([torch.arange(8.0), torch.full((8,), -1.0)]))
    transfer.drain()


def test_a_layered_get_into_pieces_gives_each_layers_pieces_their_bytes_by_that_layers_event(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    from paged import vllm_block, vllm_caches

    transfer = through_sim["transfer"]
    layers, heads = 3, 1
    source = vllm_caches(layers, 16, heads, seed=8)
    engine = vllm_caches(layers, 16, heads)
    strided = torch.zeros(256, 4, dtype=torch.float16)  # a strided piece after the pages, in the last layer
    extra = torch.arange(1024, dtype=torch.float16).reshape(4, 256)
    layer_bytes = 2 * 16 * 16 * heads * 128 * 2
    spans = [(i * layer_bytes, (i + 1) * layer_bytes) for i in range(layers)]
    spans[-1] = (spans[-1][0], spans[-1][1] + extra.numel() * 2)
    seen: list[bool] = []
    scatter = dev._scatter

    def recording(scatters: Any, dests: Any, stream: Any) -> None:
        scatter(scatters, dests, stream)
        seen.append(bool(scatters) and torch.equal(strided.t(), extra))

    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(256)))
        assert blocks.put(keys, [[*vllm_block(source, list(range(16))), extra]], durable=False).stored == 1
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dev, "_scatter", recording)
            with transfer.layered(spans) as copies:
                assert blocks.get_into(keys, [[*vllm_block(engine, list(range(16))), strided.t()]]) == 1
                assert not engine[0].any()  # only collected
    assert len(copies.events) == layers
    assert seen == [False, False, True]  # the strided piece is laid out with its own layer's copies
    assert all(
        torch.equal(e.view(torch.uint8), s.view(torch.uint8)) for e, s in zip(engine, source, strict=True)
    )
    assert torch.equal(strided.t(), extra)
    transfer.drain()


def test_a_transfer_that_fails_part_way_still_holds_its_leases_until_what_it_queued_has_landed(
    sim: dict[str, Any], make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy queued before a failure still reads the daemon's memory: the leases go to the thread that
    closes them once the stream's event passes, never straight back (the daemon could then reuse the slots
    under the copy)."""
    transfer = sim["transfer"]
    held: list[tuple[Any, list[int]]] = []
    real_hold = transfer._leases.hold

    def hold(event: Any, fds: list[int], registrations: set[int] | None = None, stream: Any = None) -> None:
        held.append((event, fds))
        real_hold(event, fds, registrations, stream)

    monkeypatch.setattr(transfer._leases, "hold", hold)
    real_issue = transfer._issue

    def issue_then_fail(*args: Any) -> None:
        real_issue(*args)  # the copies are queued...
        raise RuntimeError("the driver refused the next copy")  # ...and then something fails

    monkeypatch.setattr(transfer, "_issue", issue_then_fail)
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        client.capture(
            model=MODEL, state=STATE, tokens=[1], tensors={"x": _random(1 << 20, 3)}, durable=False
        )
        reply, fds = client._call({"op": "restore", **_ident([1])})
        try:
            with pytest.raises(RuntimeError, match="refused"):
                transfer.entry_to_device(
                    fds[0], reply["generation"], reply["data_offset"], reply["data_len"], torch.device("cpu")
                )
        finally:
            os.close(fds[0])
        assert len(held) == 1 and held[0][0].recorded_on is not None, "the leases wait for the stream's event"
        assert len(held[0][1]) == 1  # the entry's lease, duplicated
        transfer.drain()
        assert transfer.in_flight == 0


#: a reserve whose window ends soon after the puts: it then punches the free slots, one at a time
_DECAYING = ("--l2-reserve", "1MiB", "--l2-reserve-window", "1s")


def _until_free_slots_are_punched(client: Any) -> None:

    assert eventually(lambda: client.stats()["l2"]["block_free_slots"] == 0, timeout=15)


def _get_to_device(
    transfer: Any, client: Any, blocks: Any, keys: list[bytes], outs: list[torch.Tensor]
) -> dict[str, Any]:
    reply, fds = client._call(blocks._body("blocks_get", keys))
    try:
        placements = [tuple(p) for p in reply["blocks"]]
        assert len(reply["slot_generations"]) == len(placements)
        assert transfer.blocks_to_device(
            placements, fds, reply["generations"], outs, slot_generations=reply["slot_generations"]
        )
        return dict(reply)
    finally:
        for fd in fds:
            os.close(fd)


def _kept_and_other(
    client: Any, kept_blocks: int, seed: int, nbytes: int
) -> tuple[Any, Any, list[bytes], list[torch.Tensor], list[bytes]]:
    """``kept_blocks`` blocks of one space and one block of another (whose eviction frees a slot), put."""
    kept = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
    other = client.blocks(model="sim-other@sha256:0", state=STATE, block_tokens=BLOCK)
    keys = kept.keys(list(range(kept_blocks * BLOCK)))
    data = [_random(nbytes, seed + i) for i in range(kept_blocks)]
    kept.put(keys, data, durable=False)
    other_keys = other.keys(list(range(BLOCK)))
    other.put(other_keys, [_random(nbytes, seed + 100)], durable=False)
    return kept, other, keys, data, other_keys


def test_punching_a_free_slot_of_a_slab_leaves_the_other_slots_registrations_alone(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    transfer, rec = sim["transfer"], sim["rec"]
    proc = make_daemon(*_DECAYING, budget="64MiB").start()
    nbytes = 64 * 1024
    with proc.client() as client:
        kept, _, keys, data, _ = _kept_and_other(client, 3, 200, nbytes)
        pages = torch.zeros((3, nbytes), dtype=torch.uint8)
        before = _get_to_device(transfer, client, kept, keys, list(pages.unbind(0)))
        assert [c[0] for c in rec.calls] == ["register"]
        transfer.drain()
        assert client.evict(model="sim-other@sha256:0", state=STATE, namespace="", blocks=True) >= 1
        _until_free_slots_are_punched(client)
        pages.zero_()
        rec.calls.clear()
        after = _get_to_device(transfer, client, kept, keys, list(pages.unbind(0)))
        assert after["generations"] != before["generations"]  # the slab's file generation moved...
        assert after["slot_generations"] == before["slot_generations"]  # ...its slots did not
        assert rec.calls == []  # nothing unregistered or registered again, nothing drained for it
        assert all(torch.equal(pages[i], data[i]) for i in range(3))
        assert transfer.book.stats.generation_changes == 0


def test_a_slot_punched_and_filled_again_is_registered_again_and_its_new_bytes_are_read(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    transfer, rec = sim["transfer"], sim["rec"]
    proc = make_daemon(*_DECAYING, budget="64MiB").start()
    nbytes = 64 * 1024
    with proc.client() as client:
        kept, other, keys, data, old = _kept_and_other(client, 2, 400, nbytes)
        pages = torch.zeros((2, nbytes), dtype=torch.uint8)
        _get_to_device(transfer, client, kept, keys, list(pages.unbind(0)))
        out = torch.zeros(nbytes, dtype=torch.uint8)
        first = _get_to_device(transfer, client, other, old, [out])
        assert [c[0] for c in rec.calls] == ["register", "register"]
        transfer.drain()
        client.evict(model="sim-other@sha256:0", state=STATE, namespace="", blocks=True)
        _until_free_slots_are_punched(client)
        new = other.keys(list(range(1000, 1000 + BLOCK)))
        fresh = _random(nbytes, 501)
        other.put(new, [fresh], durable=False)
        rec.calls.clear()
        out.zero_()
        second = _get_to_device(transfer, client, other, new, [out])
        assert second["blocks"][0][1] == first["blocks"][0][1]  # the same slot, filled again...
        assert second["slot_generations"] != first["slot_generations"]  # ...is new memory
        assert [c[0] for c in rec.calls] == ["unregister", "register"]
        assert rec.calls[0][1] == rec.calls[1][1]  # that slot's range, and only it
        assert torch.equal(out, fresh)  # the new bytes, never the old ones
        rec.calls.clear()
        pages.zero_()
        _get_to_device(transfer, client, kept, keys, list(pages.unbind(0)))
        assert rec.calls == []  # the other slots' registration stayed
        assert all(torch.equal(pages[i], data[i]) for i in range(2))


class _SlowEvent:
    def __init__(self) -> None:
        self.passed = threading.Event()

    def synchronize(self) -> None:
        self.passed.wait(10)


def test_unregistering_one_range_waits_only_for_the_copies_that_read_it() -> None:
    leases = leases_module._Leases()
    slow = _SlowEvent()
    leases.hold(slow, [], {0x1000})
    leases.drain_for(0x9000)  # another range: no wait (it would hang here otherwise)
    waited = threading.Event()

    def unregister() -> None:
        leases.drain_for(0x1000)
        waited.set()

    thread = threading.Thread(target=unregister)
    thread.start()
    assert not waited.wait(0.2)  # the copy reading 0x1000 is still in flight
    slow.passed.set()
    assert waited.wait(5)
    thread.join(5)
    assert len(leases) == 0


def _entry_to_device(transfer: Any, client: Any, tokens: list[int]) -> torch.Tensor:
    reply, fds = client._call({"op": "restore", **_ident(tokens)})
    try:
        data = transfer.entry_to_device(
            fds[0], reply["generation"], reply["data_offset"], reply["data_len"], torch.device("cpu")
        )
    finally:
        os.close(fds[0])
    assert data is not None
    return views_of(data, reply)


def views_of(data: torch.Tensor, reply: dict[str, Any]) -> torch.Tensor:
    specs = [TensorSpec.from_wire(t) for t in reply["tensors"]]
    return device_views(data, specs)["x"]


def test_a_recycled_entry_file_keeps_its_registration_and_a_punched_slot_does_not(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    """The daemon recycles an evicted entry's file for the next entry of its size class: the same pages,
    rewritten, the same generation, so the registration made for the first entry serves the second (no
    unregister, no register) and the copy shows the second entry's bytes. A slab slot punched and filled
    again is new memory: its registration goes and comes back."""
    transfer, rec = sim["transfer"], sim["rec"]
    # no reserve for the entries (its decay could give the evicted file back before it is recycled)
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    first, second = _random(4 << 20, 31), _random(4 << 20, 32)
    with proc.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1], tensors={"x": first}, durable=False)
        assert torch.equal(_entry_to_device(transfer, client, [1]), first)
        assert [c[0] for c in rec.calls] == ["register"]
        transfer.drain()  # the copy's lease is given back: the daemon may recycle the file
        client.evict(model=MODEL, state=STATE, tokens=[1])
        reused = client.stats()["l2"]["reused_files"]
        client.capture(model=MODEL, state=STATE, tokens=[2], tensors={"x": second}, durable=False)
        assert client.stats()["l2"]["reused_files"] == reused + 1  # the first entry's file
        assert torch.equal(_entry_to_device(transfer, client, [2]), second)  # its new bytes
        assert [c[0] for c in rec.calls] == ["register"]  # kept: nothing unregistered or registered
        assert transfer.book.stats.generation_changes == 0
    with make_daemon(*_DECAYING, budget="64MiB").start().client() as client:
        # a slot: punched (its block evicted, the reserve's decay) and filled again
        _, other, _, _, old = _kept_and_other(client, 1, 600, 64 * 1024)
        out = torch.zeros(64 * 1024, dtype=torch.uint8)
        _get_to_device(transfer, client, other, old, [out])
        transfer.drain()
        client.evict(model="sim-other@sha256:0", state=STATE, namespace="", blocks=True)
        _until_free_slots_are_punched(client)
        new = other.keys(list(range(3000, 3000 + BLOCK)))
        fresh = _random(64 * 1024, 601)
        other.put(new, [fresh], durable=False)
        rec.calls.clear()
        _get_to_device(transfer, client, other, new, [out])
        assert [c[0] for c in rec.calls] == ["unregister", "register"] and torch.equal(out, fresh)


@pytest.mark.parametrize("into", ["pieces", "pages"])  # get_into; get_into_pages
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])  # the reply planned in Python; as arrays
def test_a_slot_punched_while_another_of_its_slab_is_read_loses_its_registration_at_that_read(
    through_sim: dict[str, Any], make_daemon: Any, monkeypatch: pytest.MonkeyPatch, many: bool, into: str
) -> None:
    """A registration pins the pages it was made for: once the daemon punches a slot (an eviction under
    its budget), the client's registration of it would keep those pages alive outside the daemon's
    budget. A device get asks for the slabs' slot maps, and the next reply naming that slab (reading
    another slot of it) lets the book drop the punched slot's registration, not only that slot's next
    read: in a reply of a few blocks and in one of more than 64 (planned as arrays)."""
    transfer, rec = through_sim["transfer"], through_sim["rec"]
    transfer._punch_swept = float("inf")  # the replies' maps alone (no look at the slabs' records)
    planned: list[int] = []
    original = plan.page_spans_of

    def spans_of(column: Any, *rest: Any) -> Any:
        planned.append(len(column))
        return original(column, *rest)

    monkeypatch.setattr(dev, "page_spans_of", spans_of)
    proc = make_daemon("--l2-reserve", "0", budget="16MiB").start()
    # slabs of at most 256 slots. Few: 2 blocks a chain, both chains in one slab of 4 slots of 256 KiB.
    # Many: 4 KiB blocks; a chain of 192 fills slab A to its last 64 slots, where the first 64 blocks of
    # the first chain go (its first reply), its other 128 to slab B (its second reply, planned as arrays)
    # and the second chain's 100 after them in B
    nbytes, count, filler, second_count = (4096, 192, 192, 100) if many else (256 << 10, 2, 0, 2)
    pool = torch.zeros(count, nbytes, dtype=torch.uint8)
    outs = list(pool.unbind(0))

    def read(space: Any, keys: list[bytes]) -> int:
        if into == "pages":
            return int(space.get_into_pages(keys, [pool], list(range(len(keys)))))
        return int(space.get_into(keys, outs[: len(keys)]))

    with proc.client() as client:
        kept = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        if filler:
            kept.put(kept.keys(list(range(10**7, 10**7 + filler * BLOCK))), [_random(nbytes, 0)] * filler,
                     durable=False)  # fmt: skip
        first = kept.keys(list(range(count * BLOCK)))
        second = kept.keys(list(range(10**6, 10**6 + second_count * BLOCK)))
        kept.put(first, [_random(nbytes, i) for i in range(count)], durable=False)
        kept.put(second, [_random(nbytes, 1000 + i) for i in range(second_count)], durable=False)
        assert read(kept, second) == second_count  # registered first (the older use)...
        second_ranges = [c[1] for c in rec.calls]
        assert read(kept, first) == count  # ...then the first chain: ranges of the same slab
        assert {c[0] for c in rec.calls} == {"register"}
        transfer.drain()
        other = client.blocks(model="sim-other@sha256:0", state=STATE, block_tokens=BLOCK)
        n = 0
        while kept.contains(second):  # the second chain (least recently used) goes; the first stays
            assert (
                len(kept.get(first)) == count
            )  # (the first chain used again: newer than all but the last put)
            other.put(other.keys(list(range(n * BLOCK, (n + 1) * BLOCK))), [_random(256 << 10, 100 + n)],
                      durable=False)  # fmt: skip
            n += 1
            assert n < 256
        assert kept.contains(first) == count  # (each block evicted was punched: its bytes made room)
        rec.calls.clear()
        planned.clear()
        assert read(kept, first) == count
        assert rec.calls == [
            ("unregister", at) for at in sorted(second_ranges)
        ]  # punched slots', read or not
        assert planned == ([128] if many else [])
        transfer.drain()
        assert all(torch.equal(pool[i], _random(nbytes, i)) for i in range(count))
        assert transfer.book.stats.registered_bytes == count * nbytes


_NBYTES = 256 << 10  # a slab of 1 MiB: four slots


def _two_blocks_read(client: Any) -> tuple[Any, list[bytes], list[bytes], list[torch.Tensor]]:
    """Two blocks of one slab, each read once into the "device" (registered): (space, first, second, out)."""
    kept = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
    first, second = kept.keys(list(range(BLOCK))), kept.keys(list(range(5000, 5000 + BLOCK)))
    kept.put(first, [_random(_NBYTES, 1)], durable=False)
    kept.put(second, [_random(_NBYTES, 2)], durable=False)
    out = [torch.zeros(_NBYTES, dtype=torch.uint8)]
    assert kept.get_into(second, out) == 1 and kept.get_into(first, out) == 1
    return kept, first, second, out


def _punch(client: Any, kept: Any, first: list[bytes], second: list[bytes]) -> Any:
    """Puts other blocks until the daemon evicts (punches) ``second``, the least recently used, while
    ``first`` stays (read on the CPU each round: no device transfer, no reply for the book); returns the
    other space."""
    other = client.blocks(model="sim-other@sha256:0", state=STATE, block_tokens=BLOCK)
    n = 0
    while kept.contains(second):
        assert len(kept.get(first)) == 1
        other.put(other.keys(list(range(n * BLOCK, (n + 1) * BLOCK))), [_random(_NBYTES, 100 + n)],
                  durable=False)  # fmt: skip
        n += 1
        assert n < 256
    return other


def test_a_punched_slot_of_a_slab_no_reply_names_again_loses_its_registration_at_the_next_sweep(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    """The slab's records carry its slots' generations: the transfer reads them from its kept mapping
    (about once a second, while it transfers), so a slab this process never reads again does not keep a
    punched slot's old pages pinned. A sweep that finds nothing moved does no work."""
    transfer, rec = through_sim["transfer"], through_sim["rec"]
    proc = make_daemon("--l2-reserve", "0", budget="16MiB").start()
    with proc.client() as client:
        kept, first, second, out = _two_blocks_read(client)
        second_range = rec.calls[0][1]
        transfer.drain()
        rec.calls.clear()
        transfer.sweep_punched(every=0)
        assert rec.calls == []  # nothing punched
        other = _punch(client, kept, first, second)
        assert kept.contains(first) == 1 and rec.calls == []
        transfer.sweep_punched(every=3600)  # swept less than an hour ago: not yet
        assert rec.calls == []
        # a device get of another slab, a second after the last look: the kept slabs' records are read
        transfer._punch_swept = time.monotonic() - 1.5
        assert other.get_into(other.keys(list(range(BLOCK))), out) == 1
        assert [c[:2] for c in rec.calls] == [("unregister", second_range), ("register", rec.calls[1][1])]
        assert transfer.book.stats.registered_bytes == 2 * _NBYTES  # the first block's, the other's
        compared: list[Any] = []
        original = transfer.book._drop_punched

        def counted(*args: Any) -> None:
            compared.append(args)
            original(*args)

        transfer.book._drop_punched = counted
        transfer.sweep_punched(every=0)  # (the other slab's first look)
        compared.clear()
        transfer.sweep_punched(every=0)  # nothing moved since: no slab's parts are walked
        assert compared == [] and len(transfer.book.slotted()) == 2


def test_an_idle_process_still_gives_back_punched_slots_and_removed_files_without_another_call(
    through_sim: dict[str, Any], make_daemon: Any
) -> None:
    """An engine that goes idle makes no further call: its registrations of slots the daemon punched (and
    its mappings of files it removed) would keep their pages, pinned, outside the daemon's budget until
    its next transfer. The idle sweeper drops them once no call came for ``idle_sweep`` s, and ends with
    the transfer."""
    transfer, rec = through_sim["transfer"], through_sim["rec"]
    transfer.idle_sweep = 0.2
    proc = make_daemon("--l2-reserve", "0", budget="16MiB").start()
    with proc.client() as client:
        kept, first, second, _ = _two_blocks_read(client)
        second_range = rec.calls[0][1]
        last_call = transfer._last_call
        _punch(client, kept, first, second)  # (no device call follows)
        assert eventually(lambda: ("unregister", second_range) in [c[:2] for c in rec.calls], timeout=10)
        assert transfer._last_call == last_call, "no call was made: the sweeper did it"
        assert transfer.book.stats.registered_bytes == _NBYTES  # the first block's stays
        sweeper = transfer._sweeper
        assert sweeper is not None and sweeper.is_alive()
        transfer.close()
        sweeper.join(timeout=5)
        assert not sweeper.is_alive()


def test_descriptors_of_one_slab_in_replies_of_several_generations_are_judged_by_the_newest_map(
    sim: dict[str, Any],
) -> None:
    """A layered get hands the book one need per source made of several replies' descriptors: the slab's
    newest generation and that reply's slot map decide what was punched, in whatever order they came."""
    transfer, rec = sim["transfer"], sim["rec"]
    base, start, size = 0x400000, 8192, 4096

    def slot_map(generations: list[int]) -> tuple[int, int, bytes]:
        return start, size, b"".join(g.to_bytes(8, "little") for g in generations)

    slot0, slot2 = [(start, start + size)], [(start + 2 * size, start + 3 * size)]
    transfer._register([("slab", 1, base, slot0 + slot2, [10, 10], slot_map([10, 10, 10]))])
    rec.calls.clear()
    newest = ("slab", 3, base, slot0, [10], slot_map([10, 10, 11]))  # slot 2 punched since
    older = ("slab", 2, base, slot0, [10], slot_map([10, 10, 10]))
    transfer._register([newest, older])
    assert rec.calls == [("unregister", base + slot2[0][0])]
    assert transfer.book.ranges("slab") == slot0


def test_a_reply_without_slot_generations_keys_its_registrations_by_the_file_generation_however_long(
    sim: dict[str, Any], make_daemon: Any
) -> None:
    """An older daemon's reply names no slot generations: the slab is then one unit, and another file
    generation drops its registrations, for a few blocks (planned in Python) and for many (numpy)."""
    transfer, rec = sim["transfer"], sim["rec"]
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        for count in (3, 80):
            keys = blocks.keys(list(range(10_000 * count, 10_000 * count + count * BLOCK)))
            blocks.put(keys, [_random(4096, i) for i in range(count)], durable=False)
            reply, fds = client._call(blocks._body("blocks_get", keys))
            try:
                placements = [tuple(p) for p in reply["blocks"]]
                outs = [torch.zeros(4096, dtype=torch.uint8) for _ in placements]
                generations = list(reply["generations"])
                assert transfer.blocks_to_device(placements, fds, generations, outs)
                transfer.drain()
                rec.calls.clear()
                assert transfer.blocks_to_device(placements, fds, [g + 1 for g in generations], outs)
                transfer.drain()
                kinds = [c[0] for c in rec.calls]
                assert kinds.count("unregister") >= 1 and kinds[0] == "unregister", (count, kinds)
                assert all(torch.equal(outs[i], _random(4096, i)) for i in range(count))
            finally:
                for fd in fds:
                    os.close(fd)


@pytest.mark.parametrize("first", ["entry", "blocks"])  # the batch of one run list; of merged arrays
@pytest.mark.parametrize("code", [1, 700])  # CUDA_ERROR_INVALID_VALUE (a refusal); ILLEGAL_ADDRESS (not)
def test_a_batch_call_that_fails_is_issued_one_copy_a_run_and_only_a_refusal_stops_batches_after(
    first: str, code: int, monkeypatch: pytest.MonkeyPatch, make_daemon: Any
) -> None:
    """A ``cuMemcpyBatchAsync`` that returns an error: the same copies go out one ``copy_`` a run and the
    bytes land. Only a refusal (the driver cannot do it) stops later transfers from trying the batch call
    again; any other error (one an earlier launch left, say) costs that transfer alone its batch."""
    tried: list[int] = []

    def refusing(dsts: Any, srcs: Any, sizes: Any, count: int, *rest: Any) -> int:
        tried.append(count)
        return code

    current = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda _stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "_batch", [refusing])
    rec = Recorder()
    transfer = dev.DeviceTransfer(register=rec.register, unregister=rec.unregister)
    transfer.idle_sweep = 3600
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    nbytes = 64 * 1024
    try:
        with proc.client() as client:
            entry = {"k": _random(3 << 20, 1)}
            client.capture(model=MODEL, state=STATE, tokens=[1], tensors=entry, durable=False)
            blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
            keys = blocks.keys(list(range(4 * BLOCK)))
            data = [_random(nbytes, 20 + i) for i in range(4)]
            blocks.put(keys, data, durable=False)

            def restore_entry() -> None:
                reply, fds = client._call({"op": "restore", **_ident([1])})
                try:
                    got = transfer.entry_to_device(
                        fds[0], reply["generation"], reply["data_offset"], reply["data_len"],
                        torch.device("cpu"),
                    )  # fmt: skip
                finally:
                    os.close(fds[0])
                assert got is not None and torch.equal(got[: 3 << 20], entry["k"])

            def restore_blocks() -> None:
                pages = torch.zeros((4, nbytes), dtype=torch.uint8)
                reply, fds = client._call(blocks._body("blocks_get", keys))
                try:
                    placements = [tuple(p) for p in reply["blocks"]]
                    assert transfer.blocks_to_device(placements, fds, reply["generations"], list(pages))
                finally:
                    for fd in fds:
                        os.close(fd)
                assert all(torch.equal(pages[i], data[i]) for i in range(4))

            order = [restore_entry, restore_blocks] if first == "entry" else [restore_blocks, restore_entry]
            for restore in order:
                restore()
            if code == 1:
                assert len(tried) == 1, "tried once, for the first transfer's runs, never again"
                assert transfer.calls == 1 + transfer.copies  # the refused call, then one copy_ a run
            else:
                assert len(tried) == 2, "each transfer tried the batch call"
                assert transfer.calls == 2 + transfer.copies
    finally:
        transfer.close()
