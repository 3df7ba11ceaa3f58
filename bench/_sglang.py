"""SGLang's HiCache side without a GPU, for the storage backend's tests and bench: SGLang's real host pools
(``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) built on the CPU over CPU "device" buffers, the
``HiCacheStorageConfig`` its cache controller makes, and the backend ``StorageBackendFactory`` loads
from its module path (run in SGLang's own environment, scripts/sglang-env.sh)."""

from __future__ import annotations

import hashlib
from typing import Any

BACKEND = {
    "backend_name": "skippyd",
    "module_path": "skippyd.integrations.sglang",
    "class_name": "SkippydStorage",
    "interface_v1": 1,
}


def make_pool(
    layout: str = "page_first",
    *,
    mla: bool = False,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    page_size: int = 16,
    pages: int = 8,
    dtype: Any = None,
) -> Any:
    """One of SGLang's host pools, as its cache controller holds it (``pin_memory`` off: no CUDA here)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    device = torch.device("cpu")
    tokens = page_size  # the "device" pool: its buffers only describe the geometry here

    def pointers(tensors: tuple[Any, ...]) -> Any:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

    common: dict[str, Any] = {
        "pin_memory": False, "device": "cpu", "device_capacity_tokens": tokens, "start_layer": 0,
        "end_layer": layers, "host_token_capacity": pages * page_size,
    }  # fmt: skip
    if mla:
        width = head_dim * heads
        rows = tuple(torch.zeros(tokens, 1, width, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(
            buffers=rows, data_ptrs=pointers(rows), layer_indices=tuple(range(layers)),
            device_layer_num=layers, page_size=page_size, kv_lora_rank=width - width // 4,
            qk_rope_head_dim=width // 4, kv_cache_dim=width, dtype=dtype, device=device,
        )  # fmt: skip
        return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, target_layer_num=layers, **common)
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(
        buffers=buffers, page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, **common)


def storage_config(extra_config: dict[str, Any], **overrides: Any) -> Any:
    """The ``HiCacheStorageConfig`` SGLang's cache controller makes for one worker."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = {
        "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
        "is_mla_model": False, "enable_storage_metrics": True, "is_page_first_layout": True,
        "model_name": "org/tiny-model",
    }  # fmt: skip
    fields.update(overrides)
    return HiCacheStorageConfig(**fields, extra_config=dict(extra_config))


def make_backend(pool: Any, extra_config: dict[str, Any], **config: Any) -> Any:
    """What SGLang's cache controller does at attach: the factory builds the backend named by the extra
    config (``dynamic``: by module path), then registers the host pool with it."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    page_first = pool.layout == "page_first"
    cfg = storage_config({**BACKEND, **extra_config}, is_page_first_layout=page_first, **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_hashes(count: int, seed: int = 0, page_size: int = 16) -> list[str]:
    """SGLang's own page hashes (``get_hash_str``, chained) of ``count`` pages of tokens."""
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = [(seed * 7919 + i) % 32000 for i in range(count * page_size)]
    hashes = get_hash_str(tokens, None, page_size=page_size)
    assert isinstance(hashes, list) and len(hashes) == count
    return [str(h) for h in hashes]


def host_indices(pool: Any, pages: list[int]) -> Any:
    """The token indices of whole host pages, as the controller passes them (page after page)."""
    import torch

    size = int(pool.page_size)
    return torch.cat([torch.arange(p * size, (p + 1) * size, dtype=torch.int64) for p in pages])


def fill_pages(pool: Any, pages: list[int], seed: int) -> list[bytes]:
    """Writes distinct bytes into host pages (through SGLang's own ``set_from_flat_data_page``) and
    returns each page's flat bytes, as ``get_data_page`` gives them."""
    import torch

    out = []
    for page in pages:
        flat = pool.get_dummy_flat_data_page()
        raw = flat.view(torch.uint8)
        digest = hashlib.sha256(b"%d:%d" % (seed, page)).digest()
        pattern = torch.frombuffer(bytearray(digest * (raw.numel() // 32 + 1)), dtype=torch.uint8)
        raw.copy_(pattern[: raw.numel()])
        pool.set_from_flat_data_page(page * int(pool.page_size), flat)
        out.append(page_bytes(pool, page))
    return out


def page_bytes(pool: Any, page: int) -> bytes:
    """A host page's flat bytes (SGLang's ``get_data_page``)."""
    import torch

    flat = pool.get_data_page(page * int(pool.page_size), flat=True).contiguous()
    return bytes(flat.view(torch.uint8).numpy())
