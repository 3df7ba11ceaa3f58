"""Engines' paged KV layouts and the pieces one skippyd block of 256 tokens is made of in them (shared by
the tests of ``get_into`` with pieces, on the CPU, through the device-transfer simulator and on CUDA).

* vLLM: one tensor per layer, ``(2, num_pages, 16, heads, 128)`` (K and V, pages of 16 tokens); a block
  is 16 pages × every layer × K and V: ``[cache[kv, page] for layer for kv for page]``.
* SGLang's layer-first host pool: one tensor ``(2, layers, tokens, heads, 128)``; a block is its 256 token
  slots (pages of 64 tokens) of every layer, K and V.
* HF transformers' dynamic cache: ``(batch, heads, tokens, 128)`` per layer, K and V; a block's slice of it
  is a strided view (the pieces of a block are not contiguous)."""

from __future__ import annotations

from typing import Any

import torch

BLOCK_TOKENS = 256
VLLM_PAGE = 16
SGLANG_PAGE = 64
HEAD_DIM = 128


def random_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: Any = "cpu") -> torch.Tensor:
    """Random bytes (every bit pattern, NaNs included) as a tensor of ``dtype``."""
    size = torch.tensor([], dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def vllm_caches(
    layers: int, pages: int, heads: int, *, seed: int | None = None, device: Any = "cpu"
) -> list[torch.Tensor]:
    """One bf16 tensor ``(2, pages, 16, heads, 128)`` per layer: random, or zeros without a seed."""
    shape = (2, pages, VLLM_PAGE, heads, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    return [random_like(shape, torch.bfloat16, seed * 1000 + layer, device) for layer in range(layers)]


def vllm_block(caches: list[torch.Tensor], pages: list[int]) -> list[torch.Tensor]:
    """The pieces of one block held in ``pages`` (16 of them): layer by layer, K then V, page by page."""
    assert len(pages) * VLLM_PAGE == BLOCK_TOKENS
    return [cache[kv, page] for cache in caches for kv in range(2) for page in pages]


def sglang_pool(
    layers: int, tokens: int, heads: int, *, seed: int | None = None, device: Any = "cpu"
) -> torch.Tensor:
    """SGLang's layer-first host pool, ``(2, layers, tokens, heads, 128)`` in bf16."""
    shape = (2, layers, tokens, heads, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return random_like(shape, torch.bfloat16, seed, device)


def sglang_block(pool: torch.Tensor, pages: list[int]) -> list[torch.Tensor]:
    """The pieces of one block held in token pages ``pages`` (of 64 tokens): layer by layer, K then V."""
    assert len(pages) * SGLANG_PAGE == BLOCK_TOKENS
    return [
        pool[kv, layer, page * SGLANG_PAGE : (page + 1) * SGLANG_PAGE]
        for layer in range(pool.shape[1])
        for kv in range(2)
        for page in pages
    ]


def hf_layers(
    layers: int, tokens: int, *, seed: int | None = None, device: Any = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """HF dynamic-cache layers (keys, values), fp16 ``(1, 2, tokens, 128)`` each: random, or zeros without
    a seed."""
    shape = (1, 2, tokens, HEAD_DIM)
    if seed is None:
        zeros = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(2 * layers)]
        return list(zip(zeros[::2], zeros[1::2], strict=True))
    return [
        (
            random_like(shape, torch.float16, seed + 2 * i, device),
            random_like(shape, torch.float16, seed + 2 * i + 1, device),
        )
        for i in range(layers)
    ]


def hf_block(layers: list[tuple[torch.Tensor, torch.Tensor]], block: int) -> list[torch.Tensor]:
    """A block of HF dynamic-cache layers ``(1, heads, tokens, 128)``: strided views, K then V per layer."""
    span = slice(block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS)
    return [kv[:, :, span] for pair in layers for kv in pair]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (NaN patterns included), wherever the tensors are and however they are laid out."""
    return bool(
        torch.equal(
            a.cpu().contiguous().reshape(-1).view(torch.uint8),
            b.cpu().contiguous().reshape(-1).view(torch.uint8),
        )
    )
