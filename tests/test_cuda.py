"""The CUDA data path (skippyd.client.transfer.device), end to end against a real daemon: restores, get_into,
puts and captures by DMA through registered shared memory, bit-exact, including after the daemon gave
the memory to other bytes (a new generation). Every test here needs a CUDA device (marked ``cuda``);
the daemon runs without Redis, as on the GPU machine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import skippyd
from skippyd.payload import DTYPES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL, STATE = "cuda-model@sha256:0", "paged-kv-v1"
BLOCK = 16


@pytest.fixture
def proc(make_daemon: Any) -> Any:
    return make_daemon("--redis-url", "none", "--l2-reserve", "0", budget="1GiB").start()


def _transfer() -> Any:
    from skippyd.client.transfer.device import transfer

    return transfer()


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor([], dtype=dtype).element_size()) * _numel(shape),),
                        dtype=torch.uint8, generator=gen)  # fmt: skip
    if dtype == torch.bool:
        raw &= 1  # a bool's bytes are 0 or 1
    return raw.view(dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)))


def _dtypes() -> list[torch.dtype]:
    return [d for name in DTYPES if isinstance(d := getattr(torch, name, None), torch.dtype)]


def test_a_restore_to_cuda_is_bit_exact_for_every_dtype_and_registers_the_file_once(proc: Any) -> None:
    tensors = {str(d): _random(d, (33, 65), i) for i, d in enumerate(_dtypes())}
    with proc.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1, 2, 3], tensors=tensors, durable=False)
        restored = client.restore(model=MODEL, state=STATE, tokens=[1, 2, 3], device="cuda:0")
        assert restored is not None
        for name, tensor in tensors.items():
            assert restored.tensors[name].device.type == "cuda"
            assert _same_bytes(restored.tensors[name], tensor), name  # read on the current stream, no sync
        registrations = _transfer().book.stats.registrations
        again = client.restore(model=MODEL, state=STATE, tokens=[1, 2, 3], device="cuda:0")
        assert again is not None and _transfer().book.stats.registrations == registrations


def test_a_restore_after_the_entry_file_was_given_to_other_bytes_reads_the_new_bytes(proc: Any) -> None:
    first = {"kv": _random(torch.bfloat16, (1 << 21,), 1)}  # 4 MiB
    second = {"kv": _random(torch.bfloat16, (1 << 21,), 2)}
    with proc.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1], tensors=first, durable=False)
        got = client.restore(model=MODEL, state=STATE, tokens=[1], device="cuda")
        assert got is not None and _same_bytes(got.tensors["kv"], first["kv"])
        _transfer().drain()  # the copy's lease is given back, so the daemon may recycle the file
        client.evict(model=MODEL, state=STATE, tokens=[1])
        client.capture(model=MODEL, state=STATE, tokens=[2], tensors=second, durable=False)
        changes = _transfer().book.stats.generation_changes
        got = client.restore(model=MODEL, state=STATE, tokens=[2], device="cuda")
        assert got is not None and _same_bytes(got.tensors["kv"], second["kv"])
        # a recycled file keeps its pages and so its generation and registration: nothing changes
        assert _transfer().book.stats.generation_changes == changes


def test_get_into_cuda_pages_is_bit_exact_merges_consecutive_blocks_and_survives_slot_reuse(
    proc: Any,
) -> None:
    nbytes = 256 * 1024
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        keys = blocks.keys(list(range(8 * BLOCK)))
        data = [_random(torch.uint8, (nbytes,), 10 + i) for i in range(8)]
        blocks.put(keys, data, durable=False)
        cache = torch.empty((8, nbytes), dtype=torch.uint8, device="cuda")
        copies = _transfer().copies
        assert blocks.get_into(keys, list(cache.unbind(0))) == 8
        assert all(_same_bytes(cache[i], data[i]) for i in range(8))
        assert _transfer().copies - copies <= 2  # consecutive slots into consecutive pages: one run per slab
        # the slots are punched and filled with other bytes: a stale registration would give the old ones
        _transfer().drain()  # the copies' leases are given back, so the daemon may punch the slots
        held = blocks.get(keys[:1])
        client.evict(all=True)
        other = blocks.keys(list(range(10_000, 10_000 + 8 * BLOCK)))
        newer = [_random(torch.uint8, (nbytes,), 50 + i) for i in range(8)]
        blocks.put(other, newer, durable=False)
        out = torch.zeros((8, nbytes), dtype=torch.uint8, device="cuda")
        assert blocks.get_into(other, list(out.unbind(0))) == 8
        assert all(_same_bytes(out[i], newer[i]) for i in range(8))
        del held


def test_puts_and_captures_of_cuda_tensors_store_their_exact_bytes(proc: Any) -> None:
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        keys = blocks.keys(list(range(4 * BLOCK)))
        pages = _random(torch.float16, (4, 2, 8, BLOCK, 64), 3).cuda()
        strided = [pages[i].transpose(1, 2) for i in range(4)]  # any strides: copied as they lie
        assert blocks.put(keys, strided, durable=False).stored == 4
        got = blocks.get(keys)
        assert all(_same_bytes(got[i], strided[i].contiguous()) for i in range(4))
        tensors = {str(d): _random(d, (17, 129), i).cuda() for i, d in enumerate(_dtypes())}
        client.capture(model=MODEL, state=STATE, tokens=[9], tensors=tensors, durable=False)
        restored = client.restore(model=MODEL, state=STATE, tokens=[9])
        assert restored is not None
        assert all(_same_bytes(restored.tensors[n], t) for n, t in tensors.items())


def test_a_cuda_put_larger_than_a_staging_half_alternates_halves_and_a_capture_after_it_is_exact(
    make_daemon: Any,
) -> None:
    """Puts go as one request per staging half (docs/protocol.md, "Staging halves"): each half is its own
    registration, the DMA into one overlaps the daemon's copy out of the other; a capture after them
    (whole buffer when it does not fit a half: a fresh buffer) is still bit-exact."""
    small = make_daemon("--redis-url", "none", "--l2-reserve", "0", "--staging-budget", "4MiB", budget="1GiB")
    small.start()
    with small.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
        keys = blocks.keys(list(range(24 * BLOCK)))
        pages = _random(torch.uint8, (24, 256 * 1024), 5).cuda()  # 6 MiB: three requests of 2 MiB halves
        assert blocks.put(keys, list(pages.unbind(0)), durable=False).stored == 24
        assert client.stats()["ops"]["block_puts"] == 3
        out = torch.empty_like(pages)
        assert blocks.get_into(keys, list(out.unbind(0))) == 24
        torch.cuda.synchronize()
        assert torch.equal(out, pages)
        big = {"x": _random(torch.float16, (1536, 1024), 6).cuda()}  # 3 MiB: more than a half
        client.capture(model=MODEL, state=STATE, tokens=[11], tensors=big, durable=False)
        restored = client.restore(model=MODEL, state=STATE, tokens=[11])
        assert restored is not None and _same_bytes(restored.tensors["x"], big["x"])
        more = blocks.keys(list(range(1000, 1000 + 4 * BLOCK)))
        assert blocks.put(more, list(pages[:4].unbind(0)), durable=False).stored == 4  # halves again
        assert all(_same_bytes(g, p) for g, p in zip(blocks.get(more), pages[:4].unbind(0), strict=True))


def test_a_restore_on_a_side_stream_is_ordered_before_that_streams_work(proc: Any) -> None:
    tensor = _random(torch.float32, (1 << 22,), 4)  # 16 MiB
    with proc.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[5], tensors={"x": tensor}, durable=False)
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            got = client.restore(model=MODEL, state=STATE, tokens=[5], device="cuda")
            assert got is not None
            # a byte sum queued on the side stream, after skippyd's event (random bits hold NaNs: bytes)
            total = got.tensors["x"].view(torch.uint8).sum(dtype=torch.int64)
        stream.synchronize()
        assert int(total) == int(tensor.view(torch.uint8).sum(dtype=torch.int64))


def test_the_leases_of_copies_in_flight_are_released_once_they_land(proc: Any) -> None:
    with proc.client() as client:
        client.capture(
            model=MODEL, state=STATE, tokens=[6], tensors={"x": torch.ones(1 << 20)}, durable=False
        )
        for _ in range(4):
            assert client.restore(model=MODEL, state=STATE, tokens=[6], device="cuda") is not None
        transfer = _transfer()
        transfer.drain()
        assert transfer.in_flight == 0


def test_skt_restore_to_cuda_gives_the_captured_keys_and_values_from_blocks_and_entry(proc: Any) -> None:
    pytest.importorskip("transformers")
    from hfmodels import build, prompt

    import skippyd.integrations.transformers as skt

    model = build("llama").cuda()
    tokens = prompt(3 * BLOCK + 5)  # three whole blocks and a tail in the entry
    with proc.client() as client:
        _, cache = skt.prefill(model, tokens)
        skt.capture(client, model, cache, tokens=tokens, durable=False, block_tokens=BLOCK)
        # (token ids on the device, as an engine's input_ids: they come to the CPU once)
        hit = skt.restore(client, model, tokens=tokens.cuda(), device="cuda", block_tokens=BLOCK)
        assert hit is not None and hit[1] == len(tokens)
        ours: Any
        theirs: Any
        for ours, theirs in zip(hit[0].layers, cache.layers, strict=True):
            assert ours.keys.device.type == "cuda"
            assert _same_bytes(ours.keys, theirs.keys) and _same_bytes(ours.values, theirs.values)


def test_skt_restore_to_cuda_holds_one_view_a_layer_and_a_recycled_entry_file_registers_nothing(
    proc: Any,
) -> None:
    """Each restored layer holds ONE view of its keys over the blocks' device buffer (not one per block),
    joined bit-exact by the first read; an entry restored into a file the daemon recycled (the same
    pages, the same generation) registers nothing new."""
    pytest.importorskip("transformers")
    from hfmodels import build, prompt

    import skippyd.integrations.transformers as skt

    model = build("llama").cuda()
    tokens = prompt(4 * BLOCK + 5)
    with proc.client() as client:
        _, cache = skt.prefill(model, tokens)
        skt.capture(client, model, cache, tokens=tokens, durable=False, block_tokens=BLOCK)
        # (token ids on the device, as an engine's input_ids: they come to the CPU once)
        hit = skt.restore(client, model, tokens=tokens.cuda(), device="cuda", block_tokens=BLOCK)
        assert hit is not None and hit[1] == len(tokens)
        ours: Any
        theirs: Any
        for ours, theirs in zip(hit[0].layers, cache.layers, strict=True):
            assert isinstance(ours.__dict__["_pieces"][0][0], skt._Stacked)
            assert _same_bytes(ours.keys, theirs.keys) and _same_bytes(ours.values, theirs.values)
        first = {"x": _random(torch.uint8, (4 << 20,), 5)}
        second = {"x": _random(torch.uint8, (4 << 20,), 6)}
        client.capture(model=MODEL, state=STATE, tokens=[9], tensors=first, durable=False)
        got = client.restore(model=MODEL, state=STATE, tokens=[9], device="cuda")
        assert got is not None and _same_bytes(got.tensors["x"], first["x"])
        _transfer().drain()
        client.evict(model=MODEL, state=STATE, tokens=[9])
        reused = client.stats()["l2"]["reused_files"]
        client.capture(model=MODEL, state=STATE, tokens=[10], tensors=second, durable=False)
        registrations = _transfer().book.stats.registrations
        got = client.restore(model=MODEL, state=STATE, tokens=[10], device="cuda")
        assert got is not None and _same_bytes(got.tensors["x"], second["x"])
        if client.stats()["l2"]["reused_files"] > reused:
            assert _transfer().book.stats.registrations == registrations


def test_no_device_error_is_not_raised_where_cuda_exists() -> None:
    from skippyd.client.transfer.device import resolve_device

    assert resolve_device("cuda").type == "cuda"
    with pytest.raises(skippyd.NoDevice):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_get_into_a_vllm_paged_layout_on_cuda_is_bit_exact_in_merged_runs(proc: Any) -> None:
    from paged import same_bytes, vllm_block, vllm_caches

    layers, heads = 4, 8  # a page piece is 16 × 8 × 128 bf16 = 32 KiB; a block 4 MiB
    source = vllm_caches(layers, 48, heads, seed=1, device="cuda")
    engine = vllm_caches(layers, 64, heads, device="cuda")
    held = [list(range(16 * b, 16 * (b + 1))) for b in range(3)]
    into = [list(range(48, 64)), list(range(31, 15, -1)), list(range(16))]
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(3 * 256)))
        assert blocks.put(keys, [vllm_block(source, pages) for pages in held], durable=False).stored == 3
        copies = _transfer().copies
        assert blocks.get_into(keys, [vllm_block(engine, pages) for pages in into]) == 3
        assert _transfer().copies - copies <= 2 * layers * 2 + layers * 2 * 16  # runs of consecutive pages
        for layer in range(layers):  # read on the current stream, no host sync
            for b in range(3):
                for src, dst in zip(held[b], into[b], strict=True):
                    assert same_bytes(engine[layer][:, dst], source[layer][:, src])


def test_get_into_pages_on_cuda_is_bit_exact_through_staging_and_by_dma_and_put_pages_too(proc: Any) -> None:
    from paged import same_bytes, vllm_caches

    layers, heads = 4, 8
    source = vllm_caches(layers, 48, heads, seed=2, device="cuda")
    engine = vllm_caches(layers, 96, heads, device="cuda")
    held = [list(range(16 * b, 16 * (b + 1))) for b in range(3)]
    into = [list(range(48, 64)), list(range(31, 15, -1)), [64 + 2 * i for i in range(16)]]
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(3 * 256)))
        planes = [cache[kv] for cache in source for kv in range(2)]
        assert blocks.put_pages(keys, planes, held, durable=False).stored == 3
        copies = _transfer().copies
        assert blocks.get_into_pages(keys, [cache[kv] for cache in engine for kv in range(2)], into) == 3
        assert _transfer().copies - copies == 1  # 32 KiB rows: the three blocks in one DMA, then scattered
        for layer in range(layers):  # read on the current stream, no host sync
            for b in range(3):
                assert same_bytes(engine[layer][:, into[b]], source[layer][:, held[b]])
        # rows of 1 MiB go straight into their pages, one DMA a page (scattered: none merge)
        pool = torch.zeros((8, 1 << 20), dtype=torch.uint8, device="cuda")
        big = client.blocks(model=MODEL, state="big-pages", block_tokens=BLOCK)
        big_keys = big.keys(list(range(4 * BLOCK)))
        data = [_random(torch.uint8, (1 << 20,), 30 + i) for i in range(4)]
        assert big.put(big_keys, data, durable=False).stored == 4
        copies = _transfer().copies
        assert big.get_into_pages(big_keys, pool, [6, 1, 4, 3]) == 4
        assert _transfer().copies - copies == 4
        assert all(torch.equal(pool[p].cpu(), d) for p, d in zip([6, 1, 4, 3], data, strict=True))


def test_get_into_an_sglang_pool_and_strided_pieces_on_cuda_is_bit_exact(proc: Any) -> None:
    from paged import hf_block, random_like, same_bytes, sglang_block, sglang_pool

    pool = sglang_pool(2, 512, 2, seed=3, device="cuda")
    hf = [
        (
            random_like((1, 2, 512, 128), torch.float16, i, "cuda"),
            random_like((1, 2, 512, 128), torch.float16, 5 + i, "cuda"),
        )
        for i in range(2)
    ]
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(2 * 256)))
        assert (
            blocks.put(
                keys, [sglang_block(pool, [0, 1, 2, 3]), sglang_block(pool, [4, 5, 6, 7])], durable=False
            ).stored
            == 2
        )
        got = sglang_pool(2, 512, 2, device="cuda")
        assert blocks.get_into(keys, [sglang_block(got, [4, 5, 6, 7]), sglang_block(got, [0, 1, 2, 3])]) == 2
        assert same_bytes(got[:, :, :256], pool[:, :, 256:]) and same_bytes(got[:, :, 256:], pool[:, :, :256])
        other = blocks.keys(list(range(7000, 7000 + 2 * 256)))
        assert blocks.put(other, [hf_block(hf, b) for b in range(2)], durable=False).stored == 2
        engine = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in hf]
        assert (
            blocks.get_into(other, [hf_block(engine, b) for b in range(2)]) == 2
        )  # strided: staging + copy_
        assert all(
            same_bytes(e, s) for pe, ps in zip(engine, hf, strict=True) for e, s in zip(pe, ps, strict=True)
        )


def test_async_get_into_and_put_on_a_side_stream_are_ordered_against_that_stream(proc: Any) -> None:
    """The async client copies on a worker thread, whose own current stream is the default one: it must
    order skippyd's copies against the CALLER's stream. A slow kernel queued on the caller's side stream
    writes the destination (get_into) or the source (put) first; reading the old bytes, or writing before
    that kernel ends, shows as wrong bytes."""
    import asyncio

    nbytes = 4 << 20
    data = [_random(torch.uint8, (nbytes,), 70 + i) for i in range(4)]

    async def main() -> None:
        async with skippyd.AsyncClient(str(proc.socket)) as client:
            blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
            keys = blocks.keys(list(range(4 * BLOCK)))
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            source = torch.zeros((4, nbytes), dtype=torch.uint8, device="cuda")
            staged = torch.stack(data).cuda()
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ≈ 0.1 s of GPU time
                source.copy_(staged)  # the bytes, written late on the side stream
                assert (await blocks.put(keys, list(source.unbind(0)), durable=False)).stored == 4
                out = torch.zeros((4, nbytes), dtype=torch.uint8, device="cuda")
                torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
                out.fill_(7)  # skippyd's copy must land after this, on this stream's order
                assert await blocks.get_into(keys, list(out.unbind(0))) == 4
                same = [bool(torch.equal(out[i].cpu(), data[i])) for i in range(4)]
            assert same == [True] * 4

    asyncio.run(main())


def test_an_idle_process_drops_the_registration_of_a_punched_slot_on_its_sweeper_thread(
    make_daemon: Any,
) -> None:
    """The idle sweeper unregisters (a CUDA runtime call, on its own thread, with the last call's device
    current) a slot the daemon punched while the process made no call, and later transfers still work."""
    import time

    proc = make_daemon("--redis-url", "none", "--l2-reserve", "0", budget="16MiB").start()
    transfer = _transfer()
    transfer.idle_sweep = 0.2
    try:
        nbytes = 256 << 10
        with proc.client() as client:
            kept = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
            first, second = kept.keys(list(range(BLOCK))), kept.keys(list(range(7000, 7000 + BLOCK)))
            kept.put(first, [_random(torch.uint8, (nbytes,), 1)], durable=False)
            kept.put(second, [_random(torch.uint8, (nbytes,), 2)], durable=False)
            out = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda")]
            assert kept.get_into(second, out) == 1 and kept.get_into(first, out) == 1
            torch.cuda.synchronize()
            before = transfer.book.stats.registered_bytes
            other = client.blocks(model="cuda-other@sha256:0", state=STATE, block_tokens=BLOCK)
            n = 0
            while kept.contains(second):
                other.put(other.keys(list(range(n * BLOCK, (n + 1) * BLOCK))), [torch.full((nbytes,), n % 251,
                          dtype=torch.uint8)], durable=False)  # fmt: skip
                n += 1
                assert n < 256
            deadline = time.monotonic() + 10
            while transfer.book.stats.registered_bytes >= before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert transfer.book.stats.registered_bytes < before, "the punched slot was unregistered"
            data = _random(torch.uint8, (nbytes,), 3)
            third = kept.keys(list(range(9000, 9000 + BLOCK)))
            kept.put(third, [data], durable=False)
            assert kept.get_into(third, out) == 1
            assert _same_bytes(out[0], data)
    finally:
        transfer.idle_sweep = 1.0


def test_concurrent_restores_through_pinned_buffers_each_get_their_own_bytes(
    proc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AsyncClient's restores run at once on worker threads; those that go through the client's
    DeviceStager (an entry served once, as from L3: forced here) each take a pair of its pinned buffers."""
    import asyncio

    from skippyd.client.transfer import device as dev

    monkeypatch.setattr(dev.DeviceTransfer, "entry_to_device", lambda *_args, **_kwargs: None)
    payloads = {n: {"x": _random(torch.uint8, (96 << 20,), 40 + n)} for n in range(4)}
    with proc.client() as client:
        for n, tensors in payloads.items():
            client.capture(model=MODEL, state=STATE, tokens=[900 + n], tensors=tensors, durable=False)

    async def main() -> list[bool]:
        async with skippyd.AsyncClient(proc.socket) as client:
            got = await asyncio.gather(*[
                client.restore(model=MODEL, state=STATE, tokens=[900 + n], device="cuda") for n in payloads
            ])  # fmt: skip
            torch.cuda.synchronize()
            return [
                r is not None and _same_bytes(r.tensors["x"], payloads[n]["x"]) for n, r in enumerate(got)
            ]

    assert asyncio.run(main()) == [True] * 4


def test_the_gpu_probe_finds_the_data_path_working_on_this_device(proc: Any) -> None:
    """``skippyd doctor --gpu``'s probe on a real device: registration of tmpfs accepted, an entry and
    blocks restored bit-exact through the daemon; nothing failed (a rate below 0.7x pinned is a warning,
    which this does not judge: bench.gpu does)."""
    from skippyd.client.transfer.probe import probe

    findings = probe(str(proc.socket), nbytes=64 << 20)
    assert not [f for f in findings if f["level"] == "fail"], findings
    whats = " | ".join(f["what"] for f in findings)
    assert "a registered tmpfs mapping copies to the device" in whats, findings
    assert "restore of a" in whats and "get_into of" in whats and whats.count("bit-exact") == 2, findings
