"""SkippydTier driven by vLLM 0.33's own classes (TieringOffloadingManager over a CPU primary tier, the
tier built by SecondaryTierFactory from its config dict, and the v1 Scheduler with the
OffloadingConnector) against a real skippyd daemon. No mocks of vLLM or skippyd."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import TIER, Engine, tier_cfg
from daemonutil import DaemonProcess, eventually

import skippyd
from skippyd.integrations.vllm import SkippydTier


def key(i: int, group: int = 0) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return bytes(make_offload_key(hashlib.sha256(b"block %d" % i).digest(), group))


def fill(key: bytes) -> bytes:
    """A chunk's bytes, different for every key (4096 bytes: one primary slot)."""
    return (hashlib.sha256(key).digest() * 128)[:4096]


def test_a_cascaded_chunk_comes_back_bit_exact_after_the_primary_evicted_it(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    engine = engines(tier_cfg(daemon))
    assert isinstance(engine.tier, SkippydTier)
    first = engine.store([key(i) for i in range(4)], fill)
    engine.settle()
    with daemon.client() as client:
        assert client.stats()["l2"]["block_count"] == 4  # the cascade reached skippyd
    engine.store([key(i) for i in range(4, 8)], fill)  # 4 primary slots: the first four leave it
    engine.settle()
    with engine.manager.lock:
        assert engine.primary.lookup(key(1), engine.ctx).name == "MISS"
    assert engine.lookup(key(1)) == "HIT"  # RETRY (asked), HIT_PENDING (promoted), then HIT
    assert engine.load([key(1)]) == [first[key(1)]]
    assert engine.lookup(key(999)) == "MISS"


def test_two_instances_on_one_host_share_skippyds_chunks(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    one = engines(tier_cfg(daemon))
    written = one.store([key(i) for i in range(3)], fill)
    one.settle()
    two = engines(tier_cfg(daemon))  # another engine id, the same layout
    assert two.lookup(key(2)) == "HIT"
    assert two.load([key(2)]) == [written[key(2)]]
    two.store([key(i) for i in range(3)], fill)  # the second instance offers the same chunks
    two.settle()
    with daemon.client() as client:
        stats = client.stats()
        assert stats["l2"]["block_count"] == 3  # held once for both
        assert stats["l2"]["block_bytes"] <= 3 * 8192


@pytest.mark.parametrize(
    "other", [{"model": "org/another-model"}, {"dtype": "bfloat16"}, {"bytes_per_block": 8192}]
)
def test_another_model_or_layout_misses(
    other: dict[str, Any], daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    one = engines(tier_cfg(daemon))
    one.store([key(i) for i in range(2)], fill)
    one.settle()
    stranger = engines(tier_cfg(daemon), **other)
    assert stranger.tier.state != one.tier.state or stranger.tier.model != one.tier.model
    assert stranger.lookup(key(0)) == "MISS"


def test_the_group_index_stays_part_of_the_key_and_each_group_is_its_own_chain(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    engine = engines(tier_cfg(daemon), groups=2, num_chunks=8)
    keys = [key(i, group) for i in range(3) for group in (0, 1)]  # interleaved, as vLLM's jobs are
    written = engine.store(keys, fill)
    engine.settle()
    engine.store([key(100 + i) for i in range(8)], fill)  # evict them all from the primary
    engine.settle()
    assert engine.lookup(key(2, 1)) == "HIT" and engine.lookup(key(2, 0)) == "HIT"
    assert engine.load([key(2, 1)]) == [written[key(2, 1)]]
    assert engine.lookup(key(5, 1)) == "MISS"
    with daemon.client() as client:
        space = client.blocks(
            model=engine.tier.model, state=engine.tier.state, block_tokens=engine.tier.block_tokens
        )
        assert space.contains([key(i, 1) for i in range(3)]) == 3  # group 1's own chain, in order


def test_the_tiers_metrics_reach_vllms_stats_with_the_labels_they_declare(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    engine = engines(tier_cfg(daemon))
    declared = TieringOffloadingSpec.build_metric_definitions(engine.spec.extra_config)
    ours = {name: meta for name, meta in declared.items() if name.startswith("vllm:skippyd_")}
    assert set(ours) == {
        "vllm:skippyd_lookup_chunks", "vllm:skippyd_stored_chunks", "vllm:skippyd_loaded_chunks",
        "vllm:skippyd_not_admitted_chunks", "vllm:skippyd_failed_jobs",
    }  # fmt: skip
    engine.store([key(i) for i in range(4)], fill)
    engine.settle()
    engine.store([key(i) for i in range(4, 8)], fill)
    engine.settle()
    assert engine.lookup(key(1)) == "HIT" and engine.lookup(key(500)) == "MISS"
    engine.load([key(1)])
    with engine.manager.lock:
        stats = engine.manager.get_stats()
    types, values = stats.metric_sections()
    mine = {name: by_label for name, by_label in values.items() if name in ours}
    for name, by_label in mine.items():
        assert types[name] == "counter"
        assert all(len(labels) == len(ours[name].labelnames) for labels in by_label), name
    assert mine["vllm:skippyd_stored_chunks"][()] == 8
    assert mine["vllm:skippyd_loaded_chunks"][()] == 1
    assert (
        mine["vllm:skippyd_lookup_chunks"][("hit",)] >= 1
        and mine["vllm:skippyd_lookup_chunks"][("miss",)] >= 1
    )
    with engine.manager.lock:
        again = engine.manager.get_stats()
    assert again is None or "vllm:skippyd_stored_chunks" not in again.metric_sections()[1]  # reset each time


def test_events_report_what_skippyd_stored(daemon: DaemonProcess, engines: Callable[..., Engine]) -> None:
    engine = engines(tier_cfg(daemon))
    engine.store([key(i) for i in range(2)], fill)
    engine.settle()
    mine = [e for e in engine.events() if e.ownership == engine.tier.tier_type]
    assert mine and not mine[0].removed and sorted(map(bytes, mine[0].keys)) == sorted([key(0), key(1)])


def test_with_the_daemon_down_lookups_miss_within_a_second_jobs_fail_and_nothing_stays_pinned(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    engine = engines(tier_cfg(daemon))
    daemon.stop()
    started = time.monotonic()
    assert engine.lookup(key(7)) == "MISS"
    assert time.monotonic() - started < 1.5
    engine.store([key(i) for i in range(4)], fill)  # the cascade fails: reported, the slots unpinned
    engine.settle()
    with engine.manager.lock:
        assert not engine.manager._jobs  # every job was reported
    engine.store([key(i) for i in range(10, 14)], fill)  # all 4 slots again: none stayed pinned
    engine.settle()
    daemon.start()  # the same tier object reconnects by itself
    engine.store([key(i) for i in range(20, 22)], fill)
    engine.settle()
    with daemon.client() as client:
        assert client.stats()["l2"]["block_count"] == 2


def test_a_stalled_daemon_answers_miss_within_a_second(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    import signal

    engine = engines(tier_cfg(daemon))
    daemon.send(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert engine.lookup(key(3)) == "MISS"
        assert time.monotonic() - started < 2.0
    finally:
        daemon.send(signal.SIGCONT)
    assert engine.lookup(key(4)) == "MISS"  # answered again, by the daemon this time


def test_durable_chunks_reach_l3_and_come_back_after_a_restart_and_a_reboot(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    engine = engines(tier_cfg(daemon))
    written = engine.store([key(i) for i in range(3)], fill)
    engine.settle()
    with daemon.client() as client:
        eventually(lambda: client.stats()["l3"]["block_count"] == 3, timeout=20)
    daemon.stop()
    daemon.start()  # a daemon restart: L2 adopted
    fresh = engines(tier_cfg(daemon))
    assert fresh.lookup(key(1)) == "HIT" and fresh.load([key(1)]) == [written[key(1)]]
    daemon.stop()
    shutil.rmtree(daemon.shm_dir)  # a reboot: the tmpfs is gone, L3 is not
    daemon.shm_dir.mkdir()
    daemon.start()
    after = engines(tier_cfg(daemon))
    assert after.lookup(key(2)) == "HIT" and after.load([key(2)]) == [written[key(2)]]


def test_second_hit_admission_writes_a_chunk_only_once_two_engines_offered_it(
    daemon: DaemonProcess, engines: Callable[..., Engine], redis_url: str
) -> None:
    options = {"redis_url": redis_url, "scope": "rack-1"}
    one = engines(tier_cfg(daemon, **options))
    one.store([key(i) for i in range(2)], fill)
    one.settle()
    with daemon.client() as client:
        assert client.stats()["l2"]["block_count"] == 0  # offered once
    two = engines(tier_cfg(daemon, **options))
    two.store([key(i) for i in range(2)], fill)  # offered again, by another engine of the scope
    two.settle()
    with daemon.client() as client:
        assert client.stats()["l2"]["block_count"] == 2


def test_an_unknown_option_stops_the_engine_at_start_with_one_clear_line(daemon: DaemonProcess) -> None:
    from conftest import make_spec
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    config = {**TIER, "sockt": str(daemon.socket)}
    view = memoryview(bytearray(4 * 4096)).cast(
        "b", (4, 4096)
    )  # the primary tier's slots, as vLLM passes them
    with pytest.raises(ValueError, match=r"unknown option.*sockt"):
        SecondaryTierFactory.create_secondary_tier(config, view, make_spec(config))


def _scheduler(daemon: DaemonProcess, where: Any, *, mamba: bool = False) -> Any:
    """vLLM's real v1 Scheduler (DeviceConfig("cpu")) building the OffloadingConnector with SkippydTier,
    over one full-attention group of 16-token blocks; ``mamba`` adds a Mamba group in vLLM's align
    cache mode (a hybrid model: its state is one chunk per block boundary, group 1 of the keys)."""
    import json

    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )  # fmt: skip
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = where / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
        "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
        "bos_token_id": 1, "eos_token_id": 2,
    }))  # fmt: skip
    init_none_hash(sha256)
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=2048
    )
    extra = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * 8192, "blocks_per_chunk": 1,
        "secondary_tiers": [tier_cfg(daemon)],
    }  # fmt: skip
    cache = {"mamba_cache_mode": "align", "mamba_block_size": BLOCK} if mamba else {}
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048, enable_chunked_prefill=True,
            is_encoder_decoder=model_config.is_encoder_decoder,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True, **cache
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )  # fmt: skip
    groups = [
        KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn"],
            FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32),
        )
    ]
    if mamba:
        state = MambaSpec(
            block_size=BLOCK, shapes=((16, 8), (4, 32)), dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        )  # fmt: skip
        groups.append(KVCacheGroupSpec(["model.layers.1.mixer"], state))
    kv_cache_config = KVCacheConfig(num_blocks=128, kv_cache_tensors=[], kv_cache_groups=groups)
    config.cache_config.num_gpu_blocks = 128
    return Scheduler(
        vllm_config=config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK, log_stats=True,
    )  # fmt: skip


BLOCK = 16


def _request(tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id="r1", prompt_token_ids=list(range(100, 100 + tokens)), sampling_params=params,
        pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256),
    )  # fmt: skip


def _schedule_until_external(scheduler: Any, tier: SkippydTier, request: Any) -> tuple[int, Any]:
    """Schedules ``request`` until the scheduler reports external cached tokens (RETRY while the lookup is
    asked, HIT_PENDING while it is promoted): the count and the last scheduler output."""
    scheduler.add_request(request)
    external, output = 0, None
    for _ in range(30):
        output = scheduler.schedule()
        tier.drain_jobs()
        stats = request.prefill_stats
        external = getattr(stats, "num_external_cached_tokens", 0) if stats is not None else 0
        if external:
            break
        time.sleep(0.02)
    return external, output


def test_the_scheduler_with_the_connector_reports_skippyds_prefix_as_an_external_hit(
    daemon: DaemonProcess, tmp_short: Any
) -> None:
    """vLLM's real Scheduler (DeviceConfig("cpu")) builds the OffloadingConnector with SkippydTier; a
    request whose prefix only skippyd holds gets it as external cached tokens."""
    from vllm.v1.kv_offload.base import make_offload_key

    scheduler = _scheduler(daemon, tmp_short)
    try:
        tier = scheduler.connector.connector_scheduler.manager.secondary_tiers[0]
        assert isinstance(tier, SkippydTier)
        request = _request(4 * BLOCK + 5)  # four whole blocks and a partial one
        keys = [bytes(make_offload_key(h, 0)) for h in request.block_hashes]
        with skippyd.Client(daemon.socket) as client:  # another instance left this prefix in skippyd
            space = client.blocks(model=tier.model, state=tier.state, block_tokens=tier.block_tokens)
            assert (
                space.put(keys, [bytes([i + 1]) * tier.block_size_bytes for i in range(len(keys))]).stored
                == 4
            )
        external, output = _schedule_until_external(scheduler, tier, request)
        assert external == 4 * BLOCK
        assert output.kv_connector_metadata.load_jobs  # the GPU worker is told to load them
    finally:
        scheduler.connector.shutdown()


@pytest.mark.parametrize("state_chunks", [4, 2])
def test_a_hybrid_models_mamba_group_in_align_mode_goes_through_the_tier(
    daemon: DaemonProcess, tmp_short: Any, state_chunks: int
) -> None:
    """A hybrid model (a full-attention group and a Mamba group in vLLM's align cache mode): the Scheduler
    asks skippyd for both groups' chunks, the hit ends where both are held (the Mamba state at the hit's
    last block is what a hybrid needs), and the chunks promoted into the primary tier for the GPU worker
    are exactly the attention blocks of the hit and the Mamba state at its end."""
    from vllm.v1.kv_offload.base import make_offload_key

    scheduler = _scheduler(daemon, tmp_short, mamba=True)
    try:
        manager = scheduler.connector.connector_scheduler.manager
        tier = manager.secondary_tiers[0]
        assert isinstance(tier, SkippydTier)
        request = _request(4 * BLOCK + 5)
        attention = [bytes(make_offload_key(h, 0)) for h in request.block_hashes]
        states = [bytes(make_offload_key(h, 1)) for h in request.block_hashes]
        size = tier.block_size_bytes
        chunk = {k: bytes([1 + i]) * size for i, k in enumerate(attention)}
        chunk |= {k: bytes([101 + i]) * size for i, k in enumerate(states)}
        with skippyd.Client(daemon.socket) as client:  # another instance left the prefix in skippyd
            space = client.blocks(model=tier.model, state=tier.state, block_tokens=tier.block_tokens)
            assert space.put(attention, [chunk[k] for k in attention]).stored == 4
            # the state only at the first ``state_chunks`` boundaries: a hit can end only there
            assert space.put(states[:state_chunks], [chunk[k] for k in states[:state_chunks]]).stored
        external, output = _schedule_until_external(scheduler, tier, request)
        assert external == state_chunks * BLOCK
        (job,) = output.kv_connector_metadata.load_jobs.values()
        region = manager.primary_tier.get_kv_memoryview()  # the tier's own view: not ours to release
        stride, view = region.strides[0], region.cast("B")
        try:
            slots = [int(c) for c in job.src_spec.chunk_ids]
            promoted = sorted(bytes(view[c * stride : c * stride + size]) for c in slots)
        finally:
            view.release()
        expected = [chunk[k] for k in attention[:state_chunks]] + [chunk[states[state_chunks - 1]]]
        assert promoted == sorted(expected)
    finally:
        scheduler.connector.shutdown()


def _load_job(job_id: int, keys: list[bytes], chunks: list[int]) -> Any:
    import numpy as np
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return TransferJob(job_id=job_id, keys=[OffloadKey(k) for k in keys], chunk_ids=np.asarray(chunks),
                       is_promotion=True, req_context=ReqContext(req_id="loads"))  # fmt: skip


def _reported(tier: SkippydTier, count: int, within: float) -> dict[int, bool]:
    found: dict[int, bool] = {}
    deadline = time.monotonic() + within
    while len(found) < count and time.monotonic() < deadline:
        found.update((r.job_id, r.success) for r in tier.get_finished_jobs())
        time.sleep(0.02)
    return found


def test_with_the_daemon_stalled_queued_jobs_fail_within_seconds_not_a_timeout_each(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    import signal

    engine = engines(tier_cfg(daemon), num_chunks=16)
    engine.store([key(i) for i in range(4)], fill)
    engine.settle()
    tier = engine.tier
    daemon.send(signal.SIGSTOP)
    try:
        started = time.monotonic()
        for n in range(4):  # promotions queued as vLLM queues them, behind one another on one thread
            tier.submit_load(_load_job(10 + n, [key(n)], [8 + n]))
        assert _reported(tier, 4, within=8.0) == {10: False, 11: False, 12: False, 13: False}
        assert time.monotonic() - started < 5.0, "one job waits its timeout; those behind it fail at once"
        for n in range(3):
            tier.submit_load(_load_job(20 + n, [key(n)], [8 + n]))
        started = time.monotonic()
        engine.tier.shutdown()  # (queued jobs fail without running: a stalled daemon holds no shutdown)
        assert time.monotonic() - started < 5.0
    finally:
        daemon.send(signal.SIGCONT)
    fresh = engines(tier_cfg(daemon), num_chunks=16)
    fresh.tier.submit_load(_load_job(30, [key(1)], [5]))
    assert _reported(fresh.tier, 1, within=10.0) == {30: True}, "once the daemon answers, loads work"
    assert fresh.slot_bytes(5) == fill(key(1))


def test_a_load_reports_removed_only_the_chunks_skippyd_answered_it_does_not_hold(
    daemon: DaemonProcess, engines: Callable[..., Engine]
) -> None:
    engine = engines(tier_cfg(daemon), num_chunks=16)
    engine.store([key(0)], fill)
    engine.settle()
    engine.store([key(2)], fill)
    engine.settle()
    engine.events()  # (the stored events)
    tier = engine.tier
    tier.submit_load(_load_job(1, [key(0), key(1), key(2)], [8, 9, 10]))  # key(1) was never stored
    assert _reported(tier, 1, within=10.0) == {1: False}
    removed = [bytes(k) for e in engine.events() if e.removed for k in e.keys]
    assert removed == [key(1)], "key(2) is held behind the hole: not removed"
    daemon.stop()
    tier.submit_load(_load_job(2, [key(0)], [11]))  # the daemon is away: it may hold everything
    assert _reported(tier, 1, within=10.0) == {2: False}
    assert not [e for e in engine.events() if e.removed]
    daemon.start()
    with daemon.client() as client:
        space = client.blocks(model=tier.model, state=tier.state, block_tokens=tier.block_tokens)
        assert space.held([key(0), key(2)]) == [True, True]
