"""Promotion observations: the seed's should_promote/promote, atomically in Redis and locally."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from skippyd import Promotions
from skippyd.cluster.coordination import LocalPromotions, PromotionSettings

MiB = 1 << 20
MAX = 64 * MiB


def make(kind: str, url: str, **kwargs: Any) -> Any:
    if kind == "local":
        return LocalPromotions(PromotionSettings(**kwargs))
    return Promotions.from_url(url, scope="test-scope", **kwargs)


@pytest.fixture(params=["redis", "local"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_second_l3_fill_promotes_and_settling_makes_it_terminal(kind: str, any_redis_url: str) -> None:
    """The seed's second_l3_fill_promotes_and_serves_the_located_prefix (promotion half)."""
    p = make(kind, any_redis_url)
    digest = "a" * 64
    assert p.consider(digest, 3, 128) is False
    assert p.consider(digest, 3, 128) is True
    assert p.consider(digest, 3, 128) is True, "eligible until a promotion is attempted"
    p.settle(digest)
    assert p.consider(digest, 3, 128) is False


def test_a_batch_counts_each_item_in_order_as_single_calls_would(kind: str, any_redis_url: str) -> None:
    p = make(kind, any_redis_url)
    items = [("b" * 64, 3, 128), ("c" * 64, 3, 128), ("b" * 64, 3, 128), ("d" * 64, 9999, 1)]
    assert p.consider_many(items) == [False, False, True, True]  # b's second sight within the batch
    assert p.consider_many([("c" * 64, 3, 128), ("e" * 64, 3, 1 << 40)]) == [True, False]
    assert p.consider("e" * 64, 3, 1) is False, "an oversized payload stays refused"
    assert p.consider_many([]) == []


def test_long_prefixes_promote_on_first_fill_but_oversized_payloads_never(
    kind: str, any_redis_url: str
) -> None:
    """The seed's restart_class_prefix_promotes_on_first_fill_but_oversized_payload_does_not."""
    p = make(kind, any_redis_url)
    assert p.consider("restart", 4096, MiB) is True
    assert p.consider("oversized", 4096, MAX + 1) is False
    assert p.consider("oversized", 4096, MAX) is False, "refused once: terminal"
    assert p.consider("exactly", 4096, MAX) is True, "exactly max_bytes is allowed"
    assert p.consider("short", 4095, MiB) is False


def test_observations_expire_after_the_window(kind: str, any_redis_url: str) -> None:
    p = make(kind, any_redis_url, window_s=0.3)
    assert p.consider("k", 1, 1) is False
    p.settle("k")
    time.sleep(0.45)
    assert p.consider("k", 1, 1) is False, "a fresh first sighting, not a terminal one"
    assert p.consider("k", 1, 1) is True


def test_at_most_max_observations_and_the_oldest_goes_first(kind: str, any_redis_url: str) -> None:
    p = make(kind, any_redis_url, max_observations=3)
    for key in ("a", "b", "c"):
        assert p.consider(key, 1, 1) is False
        time.sleep(0.01)
    assert p.consider("d", 1, 1) is False  # evicts a
    assert p.consider("b", 1, 1) is True, "b was kept"
    assert p.consider("a", 1, 1) is False, "a was forgotten: this is its first sighting again"


def test_eviction_ties_on_first_seen_go_to_the_smaller_key(redis_url: str) -> None:
    p = Promotions.from_url(redis_url, scope="s", max_observations=2)
    obs, ages = p._keys
    now = int(p.client.time()[0]) * 1000
    for key in ("y", "x"):  # first seen in the same millisecond (written directly: TIME cannot be frozen)
        p.client.hset(obs, key, f"{now} 1 0")
        p.client.zadd(ages, {key: now})
    p.consider("z", 1, 1)
    assert sorted(k.decode() for k in p.client.hkeys(obs)) == ["y", "z"], "x sorts first among equals"


def test_local_fallback_breaks_first_seen_ties_by_key() -> None:
    clock = [100.0]
    p = LocalPromotions(PromotionSettings(max_observations=2), clock=lambda: clock[0])
    p.consider("y", 1, 1)
    p.consider("x", 1, 1)
    p.consider("z", 1, 1)
    assert p.consider("y", 1, 1) is True and p.consider("x", 1, 1) is False


def test_the_hit_counter_saturates(redis_url: str) -> None:
    p = Promotions.from_url(redis_url, scope="s")
    for _ in range(300):
        p.consider("k", 1, 1)
    record = p.client.hget(p._keys[0], "k").decode().split()
    assert int(record[1]) == 255


def test_a_second_hit_on_another_host_promotes(any_redis_url: str) -> None:
    host_a = Promotions.from_url(any_redis_url, scope="fleet")
    host_b = Promotions.from_url(any_redis_url, scope="fleet")
    other_scope = Promotions.from_url(any_redis_url, scope="elsewhere")
    assert host_a.consider("d", 10, 10) is False
    assert other_scope.consider("d", 10, 10) is False, "scopes count separately"
    assert host_b.consider("d", 10, 10) is True


def _consider_at_once(url: str, start: float, out: Any) -> None:
    p = Promotions.from_url(url, scope="race")
    while time.time() < start:
        pass
    out.put(p.consider("contended", 10, 10))


def test_sixteen_processes_considering_one_key_at_once_get_exactly_fifteen_yes(redis_url: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 3.0
    procs = [ctx.Process(target=_consider_at_once, args=(redis_url, start, out)) for _ in range(16)]
    for proc in procs:
        proc.start()
    answers = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert sorted(answers) == [False] + [True] * 15


def test_redis_time_is_the_clock(redis_url: str) -> None:
    p = Promotions.from_url(redis_url, scope="s")
    p.consider("k", 1, 1)
    first_seen = int(p.client.hget(p._keys[0], "k").split()[0])
    seconds, micros = p.client.time()
    assert abs(seconds * 1000 + micros // 1000 - first_seen) < 5000
