"""Destinations named as page pools and page numbers (``get_into_pages``, ``put_pages``) over a real daemon,
on the CPU: the same bytes as ``get_into`` with the pages as pieces, planned as arrays; partial blocks,
blocks read from L3 after a reboot, and every way to name pages wrongly (a typed error, nothing copied
that a later call could not overwrite, the client usable after)."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from paged import VLLM_PAGE, vllm_block, vllm_caches

import skippyd
from skippyd.errors import InvalidArgument, Mismatch

MODEL, STATE = "pages-model@sha256:0", "paged-kv-v1"
LAYERS, HEADS = 3, 2


def planes_of(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's pools as planes: each layer's keys, then its values (pages on the first axis)."""
    return [cache[kv] for cache in caches for kv in range(2)]


def space(client: skippyd.Client) -> skippyd.BlockSpace:
    return client.blocks(model=MODEL, state=STATE, block_tokens=256)


HELD = [list(range(16)), list(range(16, 32)), list(range(32, 48))]
INTO = [list(range(48, 64)), list(range(15, -1, -1)), [64 + 2 * i for i in range(16)]]


def test_get_into_pages_gives_the_bytes_get_into_gives_the_same_pages_as_pieces(make_daemon: Any) -> None:
    source = vllm_caches(LAYERS, 48, HEADS, seed=21)
    by_pages, by_pieces = vllm_caches(LAYERS, 96, HEADS), vllm_caches(LAYERS, 96, HEADS)
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(3 * 256)))
        assert blocks.put_pages(keys, planes_of(source), HELD, durable=False).stored == 3
        assert blocks.get_into_pages(keys, planes_of(by_pages), INTO) == 3
        assert blocks.get_into(keys, [vllm_block(by_pieces, pages) for pages in INTO]) == 3
        # and put_pages stored exactly what a put of the same pages as pieces stores
        again = client.blocks(model=MODEL, state="other", block_tokens=256)
        assert again.put(keys, [vllm_block(source, pages) for pages in HELD], durable=False).stored == 3
        assert [t.numpy().tobytes() for t in again.get(keys)] == [
            t.numpy().tobytes() for t in blocks.get(keys)
        ]
    for a, b in zip(by_pages, by_pieces, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for layer in range(LAYERS):
        for held, into in zip(HELD, INTO, strict=True):
            assert torch.equal(
                by_pages[layer][:, into].view(torch.uint8), source[layer][:, held].view(torch.uint8)
            )
    untouched = sorted(set(range(96)) - {p for pages in INTO for p in pages})
    assert not any(cache[:, untouched].view(torch.uint8).any() for cache in by_pages)


def test_one_page_a_block_in_one_pool_and_a_short_block_fills_only_its_first_bytes(make_daemon: Any) -> None:
    pool = torch.zeros(64, 4096, dtype=torch.uint8)
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state="one-pool", block_tokens=16)
        keys = blocks.keys(list(range(4 * 16)))
        data = [torch.full((4096,), i + 1, dtype=torch.uint8) for i in range(3)] + [
            torch.full((1000,), 9, dtype=torch.uint8)
        ]
        assert blocks.put(keys, data, durable=False).stored == 4
        assert blocks.get_into_pages(keys, pool, torch.tensor([7, 3, 60, 0])) == 4
    assert [int(pool[p, 0]) for p in (7, 3, 60)] == [1, 2, 3]
    assert bool((pool[0, :1000] == 9).all()) and not pool[0, 1000:].any()  # the short block: its bytes only
    assert not pool[[p for p in range(64) if p not in (7, 3, 60, 0)]].any()


def test_pages_named_wrongly_are_refused_with_one_line_and_the_client_goes_on(make_daemon: Any) -> None:
    pool = torch.zeros(8, 4096, dtype=torch.uint8)
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state="wrong", block_tokens=16)
        keys = blocks.keys(list(range(2 * 16)))
        assert blocks.put(keys, [torch.full((4096,), 5, dtype=torch.uint8)] * 2, durable=False).stored == 2
        for planes, pages, error, words in [
            (pool, [1, 1], InvalidArgument, "named twice"),
            (pool, [1, 8], InvalidArgument, "outside"),
            (pool, [-1, 2], InvalidArgument, "outside"),
            (pool, [1], InvalidArgument, "pages for only 1"),
            (pool, [1.5, 2.0], InvalidArgument, "integers"),
            (pool, ["a", "b"], InvalidArgument, "integers"),
            (pool.t(), [1, 2], InvalidArgument, "contiguous"),
            (torch.zeros(4096, dtype=torch.uint8).expand(8, 4096), [1, 2], InvalidArgument, "overlap"),
            ([], [1, 2], InvalidArgument, "at least one"),
            ([pool, "x"], [1, 2], InvalidArgument, "must be a tensor"),
            (torch.zeros(8, 100, dtype=torch.uint8), [1, 2], Mismatch, "4096 bytes; its pages hold 100"),
        ]:
            with pytest.raises(error, match=words) as caught:
                blocks.get_into_pages(keys, planes, pages)
            assert "\n" not in str(caught.value)
        assert not pool.any()
        assert blocks.get_into_pages(keys, pool, [2, 5]) == 2
        assert bool((pool[[2, 5]] == 5).all()) and not pool[[0, 1, 3, 4, 6, 7]].any()


def test_pages_read_from_l3_after_a_reboot_come_back_whole_async_too(make_daemon: Any) -> None:
    source = vllm_caches(LAYERS, 48, HEADS, seed=22)
    proc = make_daemon().start()
    with proc.client() as client:
        keys = space(client).keys(list(range(3 * 256)))
        assert space(client).put_pages(keys, planes_of(source), np.asarray(HELD), durable="sync").stored == 3
    assert proc.stop() == 0
    shutil.rmtree(proc.shm_dir)
    proc.shm_dir.mkdir()
    proc.start()
    target = vllm_caches(LAYERS, 96, HEADS)

    async def main() -> int:
        async with skippyd.AsyncClient(proc.socket) as client:
            blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
            return await blocks.get_into_pages(keys, planes_of(target), INTO)

    assert asyncio.run(main()) == 3  # read from L3 into a memfd: the pages are filled as pieces
    with proc.client() as client:
        assert client.stats()["l2"]["block_count"] in (0, 3)
    for layer in range(LAYERS):
        for held, into in zip(HELD, INTO, strict=True):
            assert torch.equal(
                target[layer][:, into].view(torch.uint8), source[layer][:, held].view(torch.uint8)
            )
    assert VLLM_PAGE * 16 == 256
