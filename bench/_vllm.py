"""vLLM's offloading side without a GPU, for the tier's tests and bench: a real TieringOffloadingSpec, the
CPU primary tier and vLLM's TieringOffloadingManager over it, with the tier vLLM's SecondaryTierFactory
builds from its config dict (run in vLLM's own environment, scripts/vllm-env.sh)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any


def make_spec(
    tier_cfg: dict[str, Any] | None,
    *,
    num_chunks: int = 4,
    bytes_per_block: int = 4096,
    model: str = "org/tiny-model",
    dtype: str = "float16",
    groups: int = 1,
    events: bool = True,
) -> Any:
    """A real TieringOffloadingSpec from an OffloadingConfig, as OffloadingConnector builds it."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"layer.{g}",), group_id=g)
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config={
            "cpu_bytes_to_use": num_chunks * bytes_per_block,
            "blocks_per_chunk": 1,
            "secondary_tiers": [tier_cfg] if tier_cfg else [],
        },
        engine_id=f"engine-{uuid.uuid4().hex[:8]}",  # every instance has its own: never in the identity
        model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True,
        ),
    )  # fmt: skip
    return TieringOffloadingSpec(cfg)


class Engine:
    """One vLLM instance's offloading side: its CPU primary tier and vLLM's TieringOffloadingManager over
    it, with the SkippydTier vLLM's SecondaryTierFactory builds from the tier's config dict."""

    def __init__(self, tier_cfg: dict[str, Any], **spec_args: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.manager import (
            CPUPrimaryTierOffloadingManager,
            TieringOffloadingManager,
        )

        spec = make_spec(tier_cfg, **spec_args)
        self.spec = spec
        self.region = SharedOffloadRegion(
            engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=None,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk, cpu_page_size=spec.cpu_page_size_per_worker,
        )  # fmt: skip
        self.primary = CPUPrimaryTierOffloadingManager(
            num_chunks=spec.num_chunks, mmap_region=self.region, cache_policy="lru",
            enable_events=spec.config.enable_kv_cache_events, info=spec.cpu_info,
        )  # fmt: skip
        view = self.primary.get_kv_memoryview()
        self.flat = view.cast("B")
        self.slot = view.strides[0]
        self.tier = SecondaryTierFactory.create_secondary_tier(tier_cfg, view, spec)
        self.manager = TieringOffloadingManager(primary_tier=self.primary, secondary_tiers=[self.tier])
        self.ctx = ReqContext(req_id=f"req-{uuid.uuid4().hex[:6]}")
        with self.manager.lock:
            self.manager.on_new_request(self.ctx)

    def end_step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def slot_bytes(self, chunk: int) -> bytes:
        return bytes(self.flat[chunk * self.slot : (chunk + 1) * self.slot])

    def store(self, keys: list[bytes], fill: Callable[[bytes], bytes]) -> dict[bytes, bytes]:
        """What the GPU worker and the connector do: chunks written into primary slots, the store
        completed (which cascades into the tier); returns each key's bytes."""
        with self.manager.lock:
            out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None, "the primary tier is full of pinned chunks"
        written = {}
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            data = fill(bytes(key))
            self.flat[int(chunk) * self.slot : (int(chunk) + 1) * self.slot] = data
            written[bytes(key)] = data
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, self.ctx)
        self.end_step()
        return written

    def settle(self) -> None:
        """Lets every tier job finish and the manager take the results (as the next steps would)."""
        self.tier.drain_jobs()
        self.end_step()

    def lookup(self, key: bytes, *, steps: int = 100) -> str:
        """The manager's answer after as many steps as it takes to stop saying RETRY / HIT_PENDING."""
        from vllm.v1.kv_offload.base import LookupResult

        result = LookupResult.RETRY
        for _ in range(steps):
            with self.manager.lock:
                result = self.manager.lookup(key, self.ctx)
            if result not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                return str(result.name)
            self.end_step()
            self.tier.drain_jobs()
            time.sleep(0.03)  # the lookup thread answers between steps
        return str(result.name)

    def load(self, keys: list[bytes]) -> list[bytes]:
        """``prepare_load`` of keys the manager reports HIT: the bytes of the primary slots they are in."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, self.ctx)
        out = [self.slot_bytes(int(c)) for c in spec.chunk_ids]
        with self.manager.lock:
            self.manager.complete_load(keys, self.ctx)
        return out

    def events(self) -> list[Any]:
        with self.manager.lock:
            return list(self.manager.take_events())

    def close(self) -> None:
        import gc

        gc.collect()
        self.flat.release()
        with self.manager.lock:
            self.manager.on_request_finished(self.ctx)
        self.manager.shutdown()
