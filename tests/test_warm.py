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
from skippyd.cluster.rediskeys import RedisKeys
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


class ShardedSeed:
    """The seed's ``Warm`` per shard: a prompt's shard follows from its chain's first hash, and each
    shard is a seed table of its own (``max_prefixes`` and the oldest eighth hold per shard)."""

    def __init__(self, shards: int, **seed: Any) -> None:
        self.shards = [SeedWarm(**seed) for _ in range(shards)]

    def _of(self, model: str, tokens: list[int]) -> SeedWarm:
        first = self.shards[0].chain(model, tokens)[:1]
        return self.shards[RedisKeys.warm_shard_index(first[0], len(self.shards)) if first else 0]

    def ran(self, model: str, tokens: list[int], node: str) -> None:
        self._of(model, tokens).ran(model, tokens, node)

    def warmest(self, model: str, tokens: list[int]) -> tuple[str, int] | None:
        return self._of(model, tokens).warmest(model, tokens)


def stored(warm: WarmTable) -> int:
    """Prefixes the table holds over all its shards."""
    return sum(int(warm.client.hlen(s.prefixes)) for s in warm.all_shards())


def clocks(warm: WarmTable) -> int:
    return sum(int(warm.client.get(s.clock) or 0) for s in warm.all_shards())


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
    """With one shard the table is the seed's exactly."""
    warm = WarmTable.from_url(any_redis_url, max_prefixes=16, shards=1)
    seed = SeedWarm(max_prefixes=16)
    prompts = [[i * 1000 + j for j in range(64 * 3)] for i in range(8)]  # three blocks each
    for i, prompt in enumerate(prompts):
        warm.ran("m", prompt, f"n{i}")
        seed.ran("m", prompt, f"n{i}")
    for prompt in prompts:
        assert warm.warmest("m", prompt) == seed.warmest("m", prompt)
    assert warm.warmest("m", prompts[0]) is None, "the first prompts were evicted"
    assert warm.warmest("m", prompts[-1]) == ("n7", 192)
    assert stored(warm) == len(seed.by_prefix) <= 16


def test_past_max_prefixes_a_shard_drops_its_own_oldest_eighth(any_redis_url: str) -> None:
    """Sharded, each shard is a seed table of ``max_prefixes``: a shard that fills drops its oldest
    eighth and leaves the other shards' prefixes alone."""
    warm = WarmTable.from_url(any_redis_url, max_prefixes=16, shards=4)
    seed = ShardedSeed(4, max_prefixes=16)
    prompts = [[i * 1000 + j for j in range(64 * 3)] for i in range(40)]
    for i, prompt in enumerate(prompts):
        warm.ran("m", prompt, f"n{i}")
        seed.ran("m", prompt, f"n{i}")
    for prompt in prompts:
        assert warm.warmest("m", prompt) == seed.warmest("m", prompt)
    per_shard = [int(warm.client.hlen(s.prefixes)) for s in warm.all_shards()]
    assert per_shard == [len(s.by_prefix) for s in seed.shards]
    assert all(0 < n <= 16 for n in per_shard), "every shard got prompts and none holds more than 16"
    assert warm.warmest("m", prompts[-1]) == ("n39", 192), "the newest prompt is remembered"
    assert sum(warm.warmest("m", p) is None for p in prompts) > 0, "full shards evicted their oldest"


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
@given(events=history, max_prefixes=st.sampled_from([16, 40, 65536]), shards=st.sampled_from([1, 3, 16]))
def test_the_binary_search_agrees_with_the_seeds_linear_scan_on_random_histories(
    redis_url: str, events: list[tuple[str, int, int, int, str]], max_prefixes: int, shards: int
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    warm = WarmTable(client, max_prefixes=max_prefixes, shards=shards)
    seed = ShardedSeed(shards, max_prefixes=max_prefixes)
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
                warm.shard_of(chain).prefixes, chain[k * WARM_HASH_BYTES : (k + 1) * WARM_HASH_BYTES]
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
    assert stored(warm) == 3


def test_a_heartbeat_racing_forget_never_leaves_a_live_node_hidden_by_its_shards(any_redis_url: str) -> None:
    """A heartbeat that lands on Redis right after forget's first "forgotten" mark (whichever copy that
    mark is) must not end with the registry saying up and the shards saying forgotten."""
    warm = WarmTable.from_url(any_redis_url)
    node = WarmTable.from_url(any_redis_url)  # the node's own daemon, heartbeating meanwhile
    warm.heartbeat("busy", 1, ttl_s=60)
    warm.ran("m", list(range(64 * 3)), "busy")
    real = warm._run
    raced: list[bool] = []

    class Racing:
        def _after(self, args: Any) -> None:
            if not raced and "forgotten" in [str(a) for a in args]:
                raced.append(node.heartbeat("busy", 1, ttl_s=60))

        def __call__(self, name: str, keys: Any, args: Any) -> Any:
            answer = real(name, keys, args)
            self._after(args)
            return answer

        def many(self, name: str, calls: Any) -> Any:
            answers = real.many(name, calls)
            self._after(calls[0][1])
            return answers

    warm._run = Racing()  # type: ignore[assignment]
    warm.forget("busy")
    warm._run = real
    assert raced == [True]
    prompt = list(range(500000, 500000 + 64 * 2))
    warm.ran("m", prompt, "busy")  # the live node runs a prompt after the forget
    assert warm.warmest("m", prompt) == ("busy", 128), "lookups answer the node that heartbeated"
    for shard in warm.all_shards():
        record = warm.client.hget(shard.nodes, "busy")
        assert record is not None and record.decode().endswith(" up"), record
    warm.heartbeat("busy", 1, ttl_s=60)
    assert [n.node for n in warm.nodes()] == ["busy"], "registered again at its next heartbeat"


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
    assert clocks(warm) == 2, "the non-idempotent script ran exactly once per call"
    assert warm.warmest("m", list(range(512))) == ("b", 512)


def test_every_key_of_a_script_shares_one_cluster_slot_and_the_shards_spread_over_slots() -> None:
    from redis.crc import key_slot

    from skippyd.cluster.rediskeys import WARM_SHARDS

    keys = RedisKeys("prod")
    slots = set()
    for i in range(WARM_SHARDS):
        shard = keys.warm_shard(i)
        one = {key_slot(k.encode()) for k in
               [shard.prefixes, shard.ages, shard.clock, shard.nodes, shard.batch("ab" * 16)]}  # fmt: skip
        assert len(one) == 1, "one script's keys share one slot"
        slots |= one
    assert len(slots) == WARM_SHARDS, "every shard is a slot of its own"
    assert key_slot(keys.nodes.encode()) not in slots, "the registry is a slot of its own"
    promo = [keys.promo_obs("node:a"), keys.promo_ages("node:a")]
    assert len({key_slot(k.encode()) for k in promo}) == 1
    assert all(k.startswith("{prod:v2:") for k in [keys.nodes, keys.warm_shard(3).prefixes])
    assert all(k.startswith("{prod:v1:promo:") for k in promo), "promotion scopes keep their layout"


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
    assert clocks(warm) == 1
    assert warm.warmest("m", list(range(256))) == ("a", 256)
    assert warm.ran_chains([chain], "b") == 4, "a new batch applies"
    assert warm.warmest("m", list(range(256))) == ("b", 256)
    ttl = warm.client.pttl(warm.shard_of(chain).batch(batch_id))
    assert 0 < ttl <= 600_000, "the marker expires"


def test_every_lua_header_names_the_keys_python_passes(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KEYS lines of each script's header are the key layout (documented where the script is read);
    they must name exactly the keys rediskeys builds and the caller passes, in order."""
    import re

    from blake3 import blake3

    from skippyd import Promotions
    from skippyd.cluster.coordination import _Scripts, lua_source

    passed: dict[str, list[list[str]]] = {}
    real_call, real_many = _Scripts.__call__, _Scripts.many

    def recording(self: _Scripts, name: str, keys: Any, args: Any) -> Any:
        passed.setdefault(name, []).append(list(keys))
        return real_call(self, name, keys, args)

    def recording_many(self: _Scripts, name: str, calls: Any) -> Any:
        for keys, _ in calls:
            passed.setdefault(name, []).append(list(keys))
        return real_many(self, name, calls)

    monkeypatch.setattr(_Scripts, "__call__", recording)
    monkeypatch.setattr(_Scripts, "many", recording_many)
    legacy = RedisKeys("hdr").legacy_warm
    redis.Redis.from_url(redis_url).hset(legacy.nodes, "old", "5 1 10000 up")
    warm = WarmTable.from_url(redis_url, prefix="hdr")
    warm.migrate_legacy()
    warm.heartbeat("a", 1, 60.0)
    warm.ran("m", list(range(256)), "a")
    warm.ran_chains([warm.chain("m", list(range(256))), warm.chain("m", list(range(9000, 9256)))], "a")
    warm.warmest("m", list(range(256)))
    warm.route("m", list(range(256)))
    warm.nodes()
    warm.forget("a")
    promotions = Promotions.from_url(redis_url, scope="node:a", prefix="hdr")
    promotions.consider("ab" * 32, 10, 100)
    promotions.settle("ab" * 32)

    scope = blake3(b"node:a").hexdigest()[:32]
    for name, calls in passed.items():
        # each KEYS[i] line (and its continuation lines) names the key, or the keys, that index takes
        choices: list[list[str]] = []
        for line in lua_source(name).splitlines():
            if re.match(r"^-- KEYS\[\d+\]", line):
                choices.append([])
            elif not re.match(r"^--\s{6,}", line) or not choices:
                if choices and not line.startswith("--  "):
                    break
                continue
            choices[-1] += re.findall(r"\{<prefix>[^ ,)]*", line)
        for keys in calls:
            assert len(keys) == len(choices), name
            for key, patterns in zip(keys, choices, strict=True):
                regexes = [
                    re.escape(p.replace("<prefix>", "hdr").replace("<scope>", scope))
                    .replace(re.escape("<shard>"), r"\d+")
                    .replace(re.escape("<id>"), "[0-9a-f]{32}")
                    for p in patterns
                ]
                assert any(re.fullmatch(r, key) for r in regexes), (name, key, patterns)
    lua_files = {p.name for p in (Path(__file__).resolve().parent.parent / "lua").glob("*.lua")}
    scripts = {name for name in lua_files if not name.endswith(".lib.lua")}  # (libraries: included)
    assert set(passed) == scripts, "every script was exercised"


def test_a_newer_incarnation_whose_heartbeat_expired_does_not_lock_an_older_one_out(
    any_redis_url: str,
) -> None:
    """Incarnations are start times of the host that ran the node: a name that moves to a host whose clock
    is behind (or a stepped-back clock) starts with a smaller one. A newer record that nobody renews any
    more must not refuse it for good; a live newer one still does."""
    warm = WarmTable.from_url(any_redis_url)
    assert warm.heartbeat("moved", 2_000_000, ttl_s=0.2)
    assert not warm.heartbeat("moved", 1_000_000, ttl_s=60), "the newer incarnation is live"
    time.sleep(0.3)  # its heartbeat expires: the old host is gone
    assert warm.heartbeat("moved", 1_000_000, ttl_s=60), "the name is taken back by the node that runs now"
    warm.ran("m", list(range(256)), "moved")
    assert warm.route("m", list(range(256))).node == "moved"
    assert [n.incarnation for n in warm.nodes()] == [1_000_000]
