"""SkippydStorage driven through SGLang 0.5.23's own classes (StorageBackendFactory loading it by module
path, HiCacheStorageConfig, the MHA and MLA host pools built on the CPU, SGLang's page hashes) against
real skippyd daemons. No mocks of SGLang or skippyd."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from daemonutil import DaemonProcess, eventually

from bench._sglang import (
    BACKEND,
    fill_pages,
    host_indices,
    make_pool,
    page_bytes,
    page_hashes,
    storage_config,
)
from skippyd.integrations.sglang import SkippydStorage

Backends = Callable[..., Any]

LAYOUTS = [
    pytest.param("page_first", False, id="mha-page_first"),
    pytest.param("layer_first", False, id="mha-layer_first"),
    pytest.param("page_first_direct", False, id="mha-page_first_direct"),
    pytest.param("page_head", False, id="mha-page_head"),
    pytest.param("page_first", True, id="mla-page_first"),
    pytest.param("layer_first", True, id="mla-layer_first"),
]


def held_blocks(daemon: DaemonProcess) -> int:
    with daemon.client() as client:
        return int(client.stats()["l2"]["block_count"])


def holds_blocks(daemon: DaemonProcess, count: int) -> bool:
    """Whether L2 comes to hold ``count`` blocks: a put is answered before its copy commits (docs/protocol.md,
    "Staging halves"), and ``stats`` on another connection does not wait for it."""
    return bool(eventually(lambda: held_blocks(daemon) == count, timeout=10))


def test_the_factory_builds_the_backend_from_its_module_path_and_binds_the_worker_identity(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    sglangs_own = {"hicache_storage_pass_prefix_keys": True, "prefetch_threshold": 256}  # not refused
    backend = backends(pool, daemon, **sglangs_own)
    assert isinstance(backend, SkippydStorage)
    assert backend.model == "org/tiny-model"
    assert backend.state.startswith("sglang-kv-v1:")
    assert backend.block_tokens == pool.page_size == 16
    assert backend.page_bytes == len(page_bytes(pool, 0)) == 2 * 16 * 4 * 2 * 8 * 2


def test_an_unknown_option_stops_the_engine_at_start_with_one_clear_line(daemon: DaemonProcess) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = storage_config({**BACKEND, "sockt": str(daemon.socket)})
    with pytest.raises(ValueError, match=r"SkippydStorage: unknown option\(s\) sockt; it takes socket"):
        StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.mark.parametrize(("layout", "mla"), LAYOUTS)
def test_batch_set_v1_then_batch_get_v1_moves_host_pages_bit_exact_between_two_workers(
    layout: str, mla: bool, daemon: DaemonProcess, backends: Backends
) -> None:
    config = {"is_mla_model": mla}
    source = make_pool(layout, mla=mla)
    keys = page_hashes(3, seed=1)
    written = fill_pages(source, [1, 3, 4], seed=1)
    one = backends(source, daemon, config=config)
    assert one.batch_set_v1(keys, host_indices(source, [1, 3, 4])) == [True] * 3
    assert holds_blocks(daemon, 3)

    target = make_pool(layout, mla=mla)  # another worker of the same layout, its own host pool
    two = backends(target, daemon, config=config)
    assert two.state == one.state
    assert two.batch_exists(keys) == 3
    assert two.batch_get_v1(keys, host_indices(target, [6, 0, 2])) == [True] * 3
    assert [page_bytes(target, p) for p in (6, 0, 2)] == written
    untouched = bytes(len(written[0]))
    assert all(page_bytes(target, p) == untouched for p in (1, 3, 4, 5, 7))


@pytest.mark.parametrize(("layout", "mla"), LAYOUTS)
def test_the_host_pool_seen_as_page_planes_is_every_pages_own_pieces(layout: str, mla: bool) -> None:
    """``page_planes`` (what ``batch_get_v1`` hands ``get_into_pages``) names exactly the memory of each
    page's pieces, in their order, for every page of each of SGLang's layouts."""
    from skippyd.integrations.sglang import page_pieces, page_planes

    pool = make_pool(layout, mla=mla)
    planes = page_planes(pool)
    assert planes is not None
    pages = pool.size // pool.page_size
    for page in range(pages):
        pieces = page_pieces(pool.get_data_page(page * pool.page_size, flat=False))
        assert [(plane[page].data_ptr(), plane[page].nbytes) for plane in planes] == [
            (piece.data_ptr(), piece.nbytes) for piece in pieces
        ]
    assert all(plane.shape[0] == pages for plane in planes)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_batch_get_v1_reads_by_page_numbers_and_falls_back_to_pieces_for_a_page_off_its_boundary(
    layout: str, daemon: DaemonProcess, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd.client.blockspace import BlockSpace

    calls: list[str] = []
    for name in ("get_into", "get_into_pages"):
        original = getattr(BlockSpace, name)

        def spy(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(BlockSpace, name, spy)
    source, target = make_pool(layout), make_pool(layout)
    keys = page_hashes(3, seed=11)
    written = fill_pages(source, [0, 2, 5], seed=11)
    one, two = backends(source, daemon), backends(target, daemon)
    assert one.batch_set_v1(keys, host_indices(source, [0, 2, 5])) == [True] * 3
    assert two.batch_get_v1(keys, host_indices(target, [7, 1, 3])) == [True] * 3
    assert calls == ["get_into_pages"]
    assert [page_bytes(target, p) for p in (7, 1, 3)] == written
    # a page that does not start on a page boundary (SGLang never asks for one): each page's pieces
    calls.clear()
    shifted = host_indices(target, [4]) + 1
    assert two.batch_get_v1(keys[:1], shifted) == [True]
    assert calls == ["get_into"]
    flat = target.get_data_page(4 * target.page_size + 1).contiguous().view(torch.uint8).numpy().tobytes()
    assert flat == written[0]


def test_a_load_before_the_host_pool_is_bound_or_into_pages_past_the_pool_misses_and_never_raises(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    keys = page_hashes(2, seed=13)
    written = fill_pages(pool, [0, 1], seed=13)
    backend = backends(pool, daemon)
    assert backend.batch_set_v1(keys, host_indices(pool, [0, 1])) == [True, True]
    unbound = SkippydStorage(storage_config({"socket": str(daemon.socket)}))
    try:
        assert unbound.batch_get_v1(keys, host_indices(pool, [0, 1])) == [False, False]
    finally:
        unbound.close()
    pages = int(pool.size) // int(pool.page_size)
    assert backend.batch_get_v1(keys, host_indices(pool, [pages, pages + 1])) == [False, False]
    assert backend.batch_get_v1(keys, host_indices(pool, [3, 4])) == [True, True], "the backend goes on"
    assert [page_bytes(pool, p) for p in (3, 4)] == written


def test_the_generic_path_and_the_zero_copy_path_share_pages(
    daemon: DaemonProcess, backends: Backends
) -> None:
    """What SGLang's ``_generic_page_set`` hands ``batch_set`` (flat pages from ``get_data_page``) is read
    by ``batch_get_v1``, and the other way round through ``batch_get`` into SGLang's dummy flat pages."""
    source, target = make_pool(), make_pool()
    one, two = backends(source, daemon), backends(target, daemon)
    first, second = page_hashes(2, seed=2), page_hashes(2, seed=3)
    written = fill_pages(source, [0, 1, 2, 3], seed=2)
    flat = [source.get_data_page(p * source.page_size) for p in (0, 1)]
    assert one.batch_set(first, flat) is True
    assert two.batch_get_v1(first, host_indices(target, [4, 5])) == [True, True]
    assert [page_bytes(target, p) for p in (4, 5)] == written[:2]

    assert one.batch_set_v1(second, host_indices(source, [2, 3])) == [True, True]
    dummies = [target.get_dummy_flat_data_page() for _ in range(3)]
    got = two.batch_get([*second, page_hashes(1, seed=99)[0]], dummies)
    assert got[2] is None and got[0] is dummies[0]
    assert [bytes(t.view(torch.uint8).numpy()) for t in got[:2]] == written[2:]
    assert two.get(second[1]) is not None and two.exists(second[0]) and not two.exists("ab" * 32)
    assert one.set("cd" * 32, source.get_data_page(0)) is True
    assert bytes(two.get("cd" * 32).view(torch.uint8).numpy()) == written[0]


def test_batch_exists_answers_the_leading_run_and_loads_stop_at_the_first_miss(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    backend = backends(pool, daemon)
    keys = page_hashes(5, seed=4)
    fill_pages(pool, [0, 1, 2, 3, 4], seed=4)
    for i in (0, 1, 3):
        assert backend.batch_set_v1([keys[i]], host_indices(pool, [i])) == [True]
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    other = make_pool()
    assert backends(other, daemon).batch_get_v1(keys, host_indices(other, [0, 1, 2, 3, 4])) == [
        True, True, False, False, False,
    ]  # fmt: skip
    assert page_bytes(other, 2) == bytes(len(page_bytes(other, 2)))


def test_two_workers_offering_the_same_pages_leave_them_held_once(
    daemon: DaemonProcess, backends: Backends
) -> None:
    keys = page_hashes(4, seed=5)
    for _ in range(2):  # two workers of one layout write the same prefix
        pool = make_pool()
        fill_pages(pool, [0, 1, 2, 3], seed=5)
        assert backends(pool, daemon).batch_set_v1(keys, host_indices(pool, [0, 1, 2, 3])) == [True] * 4
    with daemon.client() as client:
        stats = client.stats()["l2"]
        assert stats["block_count"] == 4
        assert stats["block_bytes"] <= 4 * 2 * 4096


@pytest.mark.parametrize(
    ("pool_args", "config"),
    [
        pytest.param({"layout": "layer_first"}, {}, id="another-layout"),
        pytest.param({}, {"model_name": "org/another-model"}, id="another-model"),
        pytest.param({"dtype": torch.float16}, {}, id="another-dtype"),
        pytest.param({"page_size": 32, "pages": 4}, {}, id="another-page-size"),
        pytest.param({}, {"tp_rank": 1, "tp_size": 2}, id="another-tp-rank"),
        pytest.param({}, {"pp_rank": 1, "pp_size": 2}, id="another-pp-stage"),
        pytest.param({"mla": True}, {"is_mla_model": True}, id="mla"),
    ],
)
def test_another_layout_model_or_rank_misses(
    pool_args: dict[str, Any], config: dict[str, Any], daemon: DaemonProcess, backends: Backends
) -> None:
    pool = make_pool()
    keys = page_hashes(2, seed=6)
    fill_pages(pool, [0, 1], seed=6)
    one = backends(pool, daemon)
    assert one.batch_set_v1(keys, host_indices(pool, [0, 1])) == [True, True]
    other_pool = make_pool(**pool_args)
    stranger = backends(other_pool, daemon, config=config)
    assert (stranger.model, stranger.state) != (one.model, one.state)
    assert stranger.batch_exists(keys) == 0
    assert stranger.batch_get_v1(keys, host_indices(other_pool, [0, 1])) == [False, False]


def test_mla_ranks_hold_the_same_kv_and_share_its_pages(daemon: DaemonProcess, backends: Backends) -> None:
    mla = {"is_mla_model": True, "tp_size": 2}
    writer_pool, reader_pool = make_pool(mla=True), make_pool(mla=True)
    keys = page_hashes(2, seed=7)
    written = fill_pages(writer_pool, [0, 1], seed=7)
    writer = backends(writer_pool, daemon, config={**mla, "tp_rank": 0})
    assert writer.batch_set_v1(keys, host_indices(writer_pool, [0, 1])) == [True, True]
    reader = backends(reader_pool, daemon, config={**mla, "tp_rank": 1})
    assert reader.batch_get_v1(keys, host_indices(reader_pool, [3, 2])) == [True, True]
    assert [page_bytes(reader_pool, p) for p in (3, 2)] == written


def test_pages_survive_a_kill_9_and_a_wiped_tmpfs_through_l3_and_the_live_backend_reconnects(
    daemon: DaemonProcess, backends: Backends
) -> None:
    source = make_pool()
    keys = page_hashes(4, seed=8)
    written = fill_pages(source, [0, 1, 2, 3], seed=8)
    live = backends(source, daemon)  # durable by default: the pages reach L3 within seconds
    assert live.batch_set_v1(keys, host_indices(source, [0, 1, 2, 3])) == [True] * 4
    with daemon.client() as client:
        assert eventually(lambda: client.stats()["l3"]["block_count"] == 4, timeout=20)
    daemon.kill9()
    shutil.rmtree(daemon.shm_dir)  # a reboot: the tmpfs is gone, L3 is not
    daemon.shm_dir.mkdir()
    daemon.start()
    target = make_pool()
    live.register_mem_pool_host(target)  # the same backend object, a fresh pool: it reconnects by itself
    assert live.batch_exists(keys) == 4
    assert live.batch_get_v1(keys, host_indices(target, [7, 6, 5, 4])) == [True] * 4
    assert [page_bytes(target, p) for p in (7, 6, 5, 4)] == written


def test_with_the_daemon_stopped_every_call_misses_or_fails_within_a_second_and_then_reconnects(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    backend = backends(pool, daemon)
    keys = page_hashes(3, seed=9)
    written = fill_pages(pool, [0, 1, 2], seed=9)
    daemon.stop()
    calls: list[tuple[Callable[[], Any], Any]] = [
        (lambda: backend.batch_exists(keys), 0),
        (lambda: backend.exists(keys[0]), False),
        (lambda: backend.batch_get_v1(keys, host_indices(pool, [3, 4, 5])), [False] * 3),
        (lambda: backend.batch_set_v1(keys, host_indices(pool, [0, 1, 2])), [False] * 3),
        (lambda: backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]), [None] * 3),
        (lambda: backend.batch_set(keys, [pool.get_data_page(0)] * 3), False),
        (lambda: backend.get(keys[0]), None),
        (lambda: backend.set(keys[0], pool.get_data_page(0)), False),
    ]
    for call, answer in calls:
        started = time.monotonic()
        assert call() == answer
        assert time.monotonic() - started < 1.0
    backend.clear()  # nothing to clear while it is away: no error either
    daemon.start()  # the same backend reconnects by itself
    assert backend.batch_set_v1(keys, host_indices(pool, [0, 1, 2])) == [True] * 3
    assert backend.batch_get_v1(keys, host_indices(pool, [5, 6, 7])) == [True] * 3
    assert [page_bytes(pool, p) for p in (5, 6, 7)] == written


def test_a_stalled_daemon_answers_misses_and_false_within_a_second(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    backend = backends(pool, daemon)
    keys = page_hashes(2, seed=10)
    fill_pages(pool, [0, 1], seed=10)
    assert backend.batch_set_v1(keys[:1], host_indices(pool, [0])) == [True]
    daemon.send(signal.SIGSTOP)
    try:
        for call, answer in [
            (lambda: backend.batch_exists(keys), 0),
            (lambda: backend.batch_get_v1(keys, host_indices(pool, [4, 5])), [False, False]),
            (lambda: backend.batch_set_v1(keys, host_indices(pool, [0, 1])), [False, False]),
        ]:
            started = time.monotonic()
            assert call() == answer
            assert time.monotonic() - started < 1.5  # the 1 s timeout, on a machine shared with others
    finally:
        daemon.send(signal.SIGCONT)
    assert backend.batch_exists(keys) == 1  # answered again by the daemon


def test_a_corrupt_page_in_l3_is_a_miss_never_wrong_kv(make_daemon: Any, backends: Backends) -> None:
    daemon = make_daemon().start()
    source = make_pool()
    keys = page_hashes(4, seed=11)
    written = fill_pages(source, [0, 1, 2, 3], seed=11)
    backend = backends(source, daemon, durable="sync")
    assert backend.batch_set_v1(keys, host_indices(source, [0, 1, 2, 3])) == [True] * 4
    daemon.stop()
    shutil.rmtree(daemon.shm_dir)  # only L3 is left
    daemon.shm_dir.mkdir()
    (pack,) = sorted((daemon.state_dir / "l3" / "packs").glob("*.pack"))
    raw = bytearray(pack.read_bytes())
    raw[2 * backend.page_bytes + 100] ^= 0x01  # inside the third page's bytes
    pack.write_bytes(raw)
    daemon.start()
    target = make_pool()
    reader = backends(target, daemon)
    got = reader.batch_get_v1(keys, host_indices(target, [4, 5, 6, 7]))
    loaded = got.index(False)
    assert loaded <= 2 and not any(got[loaded:])
    assert [page_bytes(target, p) for p in (4, 5, 6, 7)[:loaded]] == written[:loaded]
    assert all(page_bytes(target, p) == bytes(backend.page_bytes) for p in (4, 5, 6, 7)[loaded:])


def test_second_hit_admission_writes_a_page_only_once_two_workers_offered_it(
    daemon: DaemonProcess, backends: Backends, redis_url: str
) -> None:
    options = {"redis_url": redis_url, "scope": "rack-1"}
    keys = page_hashes(3, seed=12)
    first, second = make_pool(), make_pool()
    fill_pages(first, [0, 1, 2], seed=12)
    fill_pages(second, [0, 1, 2], seed=12)
    one = backends(first, daemon, **options)
    assert one.batch_set_v1(keys, host_indices(first, [0, 1, 2])) == [True] * 3  # accepted, not kept
    assert held_blocks(daemon) == 0
    two = backends(second, daemon, **options)
    assert two.batch_set_v1(keys, host_indices(second, [0, 1, 2])) == [True] * 3  # offered again
    assert holds_blocks(daemon, 3)
    stranger = backends(make_pool(layout="layer_first"), daemon, **options)  # another layout counts alone
    assert stranger.batch_set_v1(keys[:1], host_indices(stranger.mem_pool_host, [0])) == [True]
    assert held_blocks(daemon) == 3


def test_clear_drops_this_identitys_pages_and_leaves_other_layouts(
    daemon: DaemonProcess, backends: Backends
) -> None:
    keys = page_hashes(2, seed=13)
    mine, theirs = make_pool(), make_pool("layer_first")
    fill_pages(mine, [0, 1], seed=13)
    fill_pages(theirs, [0, 1], seed=13)
    one, other = backends(mine, daemon), backends(theirs, daemon)
    assert one.batch_set_v1(keys, host_indices(mine, [0, 1])) == [True, True]
    assert other.batch_set_v1(keys, host_indices(theirs, [0, 1])) == [True, True]
    one.clear()
    assert one.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 2


def test_get_stats_reports_each_transfers_pages_and_bandwidth_once(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    backend = backends(pool, daemon)
    keys = page_hashes(3, seed=14)
    fill_pages(pool, [0, 1, 2], seed=14)
    backend.batch_set_v1(keys, host_indices(pool, [0, 1, 2]))
    backend.batch_get_v1(keys[:2], host_indices(pool, [3, 4]))
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert (stats.backup_pgs, stats.prefetch_pgs) == ([3], [2])
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    again = backend.get_stats()
    assert (again.backup_pgs, again.prefetch_pgs) == ([], [])


def test_a_batch_after_its_prefix_is_stored_as_the_chains_continuation(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    """With ``hicache_storage_pass_prefix_keys`` SGLang passes each batch the page hashes before it: the
    last is the batch's parent in skippyd's chain, held or not."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    backend = backends(pool, daemon)
    keys = page_hashes(6, seed=15)
    written = fill_pages(pool, [0, 1, 2, 3, 4, 5], seed=15)
    assert backend.batch_set_v1(keys[:2], host_indices(pool, [0, 1])) == [True, True]
    after = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
    assert backend.batch_set_v1(keys[2:4], host_indices(pool, [2, 3]), after) == [True, True]
    unheld = HiCacheStorageExtraInfo(prefix_keys=page_hashes(2, seed=16))  # a prefix skippyd never held
    assert backend.batch_set_v1(keys[4:], host_indices(pool, [4, 5]), unheld) == [True, True]
    assert backend.batch_exists(keys) == 6
    other = make_pool()
    assert backends(other, daemon).batch_get_v1(keys, host_indices(other, [7, 6, 5, 4, 3, 2])) == [True] * 6
    assert [page_bytes(other, p) for p in (7, 6, 5, 4, 3, 2)] == written


def test_a_page_key_that_is_not_text_is_a_miss_or_a_failed_write_never_an_exception_into_sglang(
    daemon: DaemonProcess, backends: Backends, pool: Any
) -> None:
    backend = backends(pool, daemon)
    keys = page_hashes(2, seed=9)
    fill_pages(pool, [0, 1], seed=9)
    for bad in (b"\x01" * 32, 7, None):
        mixed: list[Any] = [keys[0], bad]
        assert backend.batch_exists(mixed) == 0
        assert not backend.exists(bad)
        assert backend.batch_set_v1(mixed, host_indices(pool, [0, 1])) == [False, False]
        assert backend.batch_get_v1(mixed, host_indices(pool, [0, 1])) == [False, False]
    assert held_blocks(daemon) == 0, "nothing was written"
    assert backend.batch_set_v1(keys, host_indices(pool, [0, 1])) == [True, True], "the backend goes on"
    assert backend.batch_exists(keys) == 2
