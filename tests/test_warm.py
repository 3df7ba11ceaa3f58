"""The warm-prefix table against real Redis (single server and a three-master cluster)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redisutil import RedisServer

from skippyd import WarmTable
from skippyd.errors import CoordinationUnavailable, InvalidArgument
from skippyd.keys import WARM_HASH_BYTES, encode_tokens, warm_chain


class SeedWarm:
    """The seed's ``Warm`` (superfluid fleet_warm.rs) line for line, over skippyd's block chain."""

    def __init__(self, block: int = 64, min_blocks: int = 2, max_prefixes: int = 1 << 16) -> None:
        self.block, self.min_blocks, self.max = block, min_blocks, max_prefixes
        self.by_prefix: dict[bytes, tuple[str, int]] = {}
        self.clock = 0

    def chain(self, model: str, tokens: list[int]) -> list[bytes]:
        raw = warm_chain(model, encode_tokens(tokens), self.block)
        return [raw[i : i + WARM_HASH_BYTES] for i in range(0, len(raw), WARM_HASH_BYTES)]

    def warmest(self, model: str, tokens: list[int]) -> tuple[str, int] | None:
        best = None
        for n, h in enumerate(self.chain(model, tokens)):
            found = self.by_prefix.get(h)
            if found is None:
                break
            best = (found[0], (n + 1) * self.block)
        return best if best is not None and best[1] >= self.min_blocks * self.block else None

    def ran(self, model: str, tokens: list[int], node: str) -> None:
        self.clock += 1
        for h in self.chain(model, tokens):
            self.by_prefix[h] = (node, self.clock)
        if len(self.by_prefix) > self.max:
            ages = sorted(at for _, at in self.by_prefix.values())
            cut = ages[self.max // 8]
            self.by_prefix = {h: v for h, v in self.by_prefix.items() if v[1] > cut}


def test_the_longest_prefix_a_node_ran_wins_and_is_kept_across_a_restart(any_redis_url: str) -> None:
    """The seed's own test."""
    turn1 = list(range(300))
    turn2 = [*turn1, *range(1000, 1200)]
    warm = WarmTable.from_url(any_redis_url)
    warm.ran("m", turn1, "a")
    warm.ran("m", turn2[:400], "b")
    assert warm.warmest("m", turn2) == ("b", 384), "b ran more of it"
    assert warm.warmest("m", turn1) == ("b", 256), "b ran the same first blocks last"
    assert warm.warmest("other", turn2) is None, "another model's prefix is its own"
    assert warm.warmest("m", list(range(5000, 5300))) is None
    assert warm.warmest("m", turn1[:100]) is None, "one block is too short to matter"
    warm.close()
    again = WarmTable.from_url(any_redis_url)  # a new client: the table lives in Redis
    assert again.warmest("m", turn2) == ("b", 384)
    again.close()


def test_the_table_survives_a_redis_restart_with_the_append_only_file_on() -> None:
    server = RedisServer(appendonly=True).start()
    try:
        warm = WarmTable.from_url(server.url)
        warm.ran("m", list(range(512)), "node-a")
        warm.close()
        server.stop()
        server.start()
        again = WarmTable.from_url(server.url)
        assert again.warmest("m", list(range(600))) == ("node-a", 512)
        again.close()
    finally:
        server.cleanup()


def test_past_max_prefixes_the_oldest_eighth_goes(any_redis_url: str) -> None:
    warm = WarmTable.from_url(any_redis_url, max_prefixes=16)
    seed = SeedWarm(max_prefixes=16)
    prompts = [[i * 1000 + j for j in range(64 * 3)] for i in range(8)]  # three blocks each
    for i, prompt in enumerate(prompts):
        warm.ran("m", prompt, f"n{i}")
        seed.ran("m", prompt, f"n{i}")
    for prompt in prompts:
        assert warm.warmest("m", prompt) == seed.warmest("m", prompt)
    assert warm.warmest("m", prompts[0]) is None, "the first prompts were evicted"
    assert warm.warmest("m", prompts[-1]) == ("n7", 192)
    stored = len(warm.client.hkeys(warm.keys.warm_prefixes))
    assert stored == len(seed.by_prefix) <= 16


def test_models_never_share_prefixes(any_redis_url: str) -> None:
    warm = WarmTable.from_url(any_redis_url)
    prompt = list(range(256))
    warm.ran("model-a", prompt, "a")
    assert warm.warmest("model-b", prompt) is None
    assert warm.warmest("model-a", prompt) == ("a", 256)


history = st.lists(
    st.tuples(
        st.sampled_from(["m1", "m2"]),  # model
        st.integers(0, 3),  # which of a few shared stems the prompt starts from
        st.integers(1, 6),  # stem blocks kept
        st.integers(0, 3),  # extra blocks of its own
        st.sampled_from(["a", "b", "c"]),  # node
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=history, max_prefixes=st.sampled_from([16, 40, 65536]))
def test_the_binary_search_agrees_with_the_seeds_linear_scan_on_random_histories(
    redis_url: str, events: list[tuple[str, int, int, int, str]], max_prefixes: int
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    warm = WarmTable(client, max_prefixes=max_prefixes)
    seed = SeedWarm(max_prefixes=max_prefixes)
    stems = [[s * 100000 + j for j in range(64 * 6)] for s in range(4)]
    prompts = []
    for n, (model, stem, keep, extra, node) in enumerate(events):
        prompt = stems[stem][: keep * 64] + [n * 7919 + j for j in range(extra * 64 + 5)]
        prompts.append((model, prompt))
        warm.ran(model, prompt, node)
        seed.ran(model, prompt, node)
    queries = prompts + [(m, s) for m in ("m1", "m2") for s in stems]
    for model, prompt in queries:
        assert warm.warmest(model, prompt) == seed.warmest(model, prompt)
    warm.close()


long_history = st.lists(
    st.tuples(
        st.integers(0, 2),  # stem
        st.integers(1, 300),  # stem blocks kept
        st.integers(0, 40),  # extra blocks of its own
        st.sampled_from("abcd"),  # node
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=long_history,
    dead=st.sets(st.sampled_from("abcd"), max_size=3),
    max_prefixes=st.sampled_from([400, 65536]),
)
def test_warmest_agrees_with_a_linear_scan_over_live_nodes_on_long_random_histories(
    redis_url: str, events: list[tuple[int, int, int, str]], dead: set[str], max_prefixes: int
) -> None:
    """Hundreds of blocks per prompt (several fan-out rounds) and gone nodes (the dead-run search)."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    warm = WarmTable(client, max_prefixes=max_prefixes, max_dead_runs=10_000)
    stems = [[s * 1_000_003 + j for j in range(64 * 300)] for s in range(3)]
    prompts = []
    for n, (stem, keep, extra, node) in enumerate(events):
        prompt = stems[stem][: keep * 64] + [10**8 + n * 7919 + j for j in range(extra * 64 + 5)]
        prompts.append(prompt)
        warm.ran("m", prompt, node)
    for node in "abcd":
        warm.heartbeat(node, 1, ttl_s=0.001 if node in dead else 60)
    time.sleep(0.01)

    def linear(prompt: list[int]) -> tuple[str, int] | None:
        chain = warm.chain("m", prompt)
        owners = []
        for k in range(len(chain) // WARM_HASH_BYTES):
            value = client.hget(
                warm.keys.warm_prefixes, chain[k * WARM_HASH_BYTES : (k + 1) * WARM_HASH_BYTES]
            )
            if value is None:
                break  # the longest remembered prefix ends here (the seed's scan)
            text = value.decode() if isinstance(value, bytes) else str(value)
            owners.append(text.split(" ", 1)[1])
        for k in range(len(owners), warm.min_blocks - 1, -1):
            if owners[k - 1] not in dead:
                return owners[k - 1], k * 64
        return None

    for prompt in prompts + stems + [stems[0][: 64 * 150]]:
        assert warm.warmest("m", prompt) == linear(prompt)
    warm.close()


def test_warmest_never_answers_a_node_whose_heartbeat_expired(any_redis_url: str) -> None:
    warm = WarmTable.from_url(any_redis_url)
    base = list(range(64 * 4))
    warm.heartbeat("long-gone", 1, ttl_s=0.3)
    warm.heartbeat("alive", 1, ttl_s=60)
    warm.ran("m", base, "long-gone")  # 4 blocks
    warm.ran("m", base[: 64 * 2], "alive")  # the first 2 blocks, later
    assert warm.warmest("m", base) == ("long-gone", 256)
    time.sleep(0.5)
    assert warm.warmest("m", base) == ("alive", 128), "the longest prefix held by a live node wins"
    warm.heartbeat("long-gone", 1, ttl_s=60)
    assert warm.warmest("m", base) == ("long-gone", 256), "back once it heartbeats again"


def test_nodes_lists_live_nodes_with_incarnation_and_heartbeat(any_redis_url: str) -> None:
    warm = WarmTable.from_url(any_redis_url)
    assert warm.heartbeat("a", 10, ttl_s=60)
    assert warm.heartbeat("b", 3, ttl_s=0.2)
    time.sleep(0.3)
    live = warm.nodes()
    assert [n.node for n in live] == ["a"]
    assert live[0].incarnation == 10 and live[0].alive and live[0].last_heartbeat_age_ms < 5000
    assert {n.node for n in warm.nodes(include_gone=True)} == {"a", "b"}
    assert not warm.heartbeat("a", 9, ttl_s=60), "an older incarnation cannot take the name back"
    assert warm.heartbeat("a", 11, ttl_s=60), "a newer one (a restart) can"
    assert warm.nodes()[0].incarnation == 11


def test_forget_removes_a_nodes_prefixes_in_bounded_steps(any_redis_url: str) -> None:
    warm = WarmTable.from_url(any_redis_url)
    warm.heartbeat("retired", 1, ttl_s=60)
    for i in range(30):
        warm.ran("m", [i * 10000 + j for j in range(64 * 5)], "retired")
    keep = list(range(900000, 900000 + 64 * 3))
    warm.ran("m", keep, "stays")
    removed = warm.forget("retired", step=16)
    assert removed == 150
    assert warm.warmest("m", [10000 + j for j in range(64 * 5)]) is None
    assert warm.warmest("m", keep) == ("stays", 192)
    assert [n.node for n in warm.nodes(include_gone=True)] == []
    assert len(warm.client.hkeys(warm.keys.warm_prefixes)) == 3


def test_scripts_are_reloaded_after_script_flush(redis_url: str) -> None:
    warm = WarmTable.from_url(redis_url)
    warm.ran("m", list(range(256)), "a")
    warm.client.script_flush()
    assert warm.warmest("m", list(range(256))) == ("a", 256)
    warm.client.script_flush()
    warm.ran("m", list(range(128)), "b")
    assert warm.warmest("m", list(range(128))) == ("b", 128)
    assert warm.warmest("m", list(range(256))) == ("a", 256), "a still holds the longest prefix"


def test_scripts_are_reloaded_after_a_script_flush(redis_url: str) -> None:
    warm = WarmTable.from_url(redis_url)
    warm.ran("m", list(range(256)), "a")
    warm.client.script_flush()
    warm.ran("m", list(range(512)), "b")
    assert int(warm.client.get(warm.keys.warm_clock)) == 2, (
        "the non-idempotent script ran exactly once per call"
    )
    assert warm.warmest("m", list(range(512))) == ("b", 512)


def test_every_key_of_a_script_shares_one_cluster_slot() -> None:
    from redis.crc import key_slot

    from skippyd.rediskeys import RedisKeys

    keys = RedisKeys("prod")
    warm = [keys.warm_prefixes, keys.warm_ages, keys.warm_clock, keys.nodes, keys.warm_batch("ab" * 16)]
    assert len({key_slot(k.encode()) for k in warm}) == 1
    promo = [keys.promo_obs("node:a"), keys.promo_ages("node:a")]
    assert len({key_slot(k.encode()) for k in promo}) == 1
    assert all(k.startswith("{prod:v1:") for k in warm + promo)


def test_bad_node_names_and_unreachable_redis_are_typed_errors(tmp_short: Any) -> None:
    with pytest.raises(InvalidArgument):
        WarmTable.from_url(f"unix://{tmp_short}/none.sock").ran("m", list(range(128)), "bad node")
    table = WarmTable.from_url(f"unix://{tmp_short}/none.sock", timeout=0.2)
    with pytest.raises(CoordinationUnavailable):
        table.warmest("m", list(range(256)))


def test_a_ran_batch_sent_twice_with_one_id_is_applied_once(redis_url: str) -> None:
    warm = WarmTable.from_url(redis_url)
    chain = warm.chain("m", list(range(256)))
    batch_id = "5" * 32
    assert warm.ran_chains([chain], "a", batch_id) == 4
    assert warm.ran_chains([chain], "b", batch_id) == -1, "the same batch again changes nothing"
    assert int(warm.client.get(warm.keys.warm_clock)) == 1
    assert warm.warmest("m", list(range(256))) == ("a", 256)
    assert warm.ran_chains([chain], "b") == 4, "a new batch applies"
    assert warm.warmest("m", list(range(256))) == ("b", 256)
    ttl = warm.client.pttl(warm.keys.warm_batch(batch_id))
    assert 0 < ttl <= 600_000, "the marker expires"


def test_every_lua_header_names_the_keys_python_passes(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KEYS lines of each script's header are the key layout (documented where the script is read);
    they must name exactly the keys rediskeys builds and the caller passes, in order."""
    import re

    from blake3 import blake3

    from skippyd import Promotions
    from skippyd.coordination import _Scripts, lua_source

    passed: dict[str, list[str]] = {}
    real_call = _Scripts.__call__

    def recording(self: _Scripts, name: str, keys: Any, args: Any) -> Any:
        passed[name] = list(keys)
        return real_call(self, name, keys, args)

    monkeypatch.setattr(_Scripts, "__call__", recording)
    warm = WarmTable.from_url(redis_url, prefix="hdr")
    warm.heartbeat("a", 1, 60.0)
    warm.ran("m", list(range(256)), "a")
    warm.warmest("m", list(range(256)))
    warm.nodes()
    warm.forget("a")
    promotions = Promotions.from_url(redis_url, scope="node:a", prefix="hdr")
    promotions.consider("ab" * 32, 10, 100)
    promotions.settle("ab" * 32)

    scope = blake3(b"node:a").hexdigest()[:32]
    for name, keys in passed.items():
        header = [
            line.split()[2] for line in lua_source(name).splitlines() if re.match(r"^-- KEYS\[\d+\]", line)
        ]
        expected = []
        for i, pattern in enumerate(header):
            name_ = pattern.replace("<prefix>", "hdr").replace("<scope>", scope)
            if name_.endswith("<id>") and i < len(keys):
                name_ = name_[: -len("<id>")] + keys[i].rsplit(":", 1)[-1]
            expected.append(name_)
        assert expected == keys, name
    lua_files = {p.name for p in (Path(__file__).resolve().parent.parent / "lua").glob("*.lua")}
    assert set(passed) == lua_files, "every script was exercised"
