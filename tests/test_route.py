"""WarmTable.route: the warmest live candidate unless it is overloaded, against real Redis (a single
server and a three-master cluster), and the sharded table underneath it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
import redis.cluster
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from skippyd import Route, WarmTable
from skippyd.cli import main
from skippyd.cluster.coordination import choose_route
from skippyd.cluster.rediskeys import RedisKeys
from skippyd.errors import InvalidArgument, NotFound
from skippyd.keys import WARM_HASH_BYTES


def prompt(first: int, blocks: int, tail: int = 0) -> list[int]:
    """``blocks`` whole blocks whose first block is picked by ``first`` (so its shard), plus a tail."""
    return [first * 1_000_003 + j for j in range(64 * blocks + tail)]


def live(table: WarmTable, *nodes: str, ttl_s: float = 60.0) -> None:
    for node in nodes:
        assert table.heartbeat(node, 1, ttl_s)


def test_the_warmest_candidate_wins_while_loads_are_within_the_thresholds(any_redis_url: str) -> None:
    table = WarmTable.from_url(any_redis_url)  # defaults: balance_abs 8, balance_rel 1.5
    live(table, "a", "b", "c")
    p = prompt(1, 6)
    table.ran("m", p, "a")
    assert table.route("m", p) == Route("a", 384, "warm"), "no loads: the warmest"
    assert table.route("m", p, loads={"a": 9, "b": 1, "c": 2}) == Route("a", 384, "warm"), (
        "a runs 8 more than the least loaded: not more than balance_abs"
    )
    assert table.route("m", p, loads={"a": 100, "b": 80, "c": 90}) == Route("a", 384, "warm"), (
        "20 more, but not 1.5 times as many"
    )


def test_an_overloaded_warmest_node_yields_to_the_least_loaded(any_redis_url: str) -> None:
    table = WarmTable.from_url(any_redis_url)
    live(table, "a", "b", "c")
    p = prompt(2, 6)
    table.ran("m", p, "a")
    table.ran("m", p[: 64 * 3], "c")  # c ran the first three blocks last
    assert table.route("m", p, loads={"a": 12, "b": 1, "c": 3}) == Route("b", 0, "balance")
    assert table.route("m", p, loads={"a": 12, "b": 3, "c": 3}) == Route("c", 192, "balance"), (
        "equally loaded: the one with the longer prefix"
    )
    assert table.route("m", p, loads={"a": 12}) == Route("c", 192, "balance"), "unlisted nodes are idle"
    tight = WarmTable.from_url(any_redis_url, balance_abs=1, balance_rel=1.2)
    assert tight.route("m", p, loads={"a": 3, "b": 1, "c": 2}) == Route("b", 0, "balance")
    assert tight.route("m", p, loads={"a": 2, "b": 1, "c": 2}) == Route("a", 384, "warm")


def test_with_no_warm_prefix_the_least_loaded_gets_it(any_redis_url: str) -> None:
    table = WarmTable.from_url(any_redis_url)
    live(table, "a", "b", "c")
    cold = prompt(3, 4)
    assert table.route("m", cold, loads={"a": 2, "b": 0, "c": 5}) == Route("b", 0, "cold")
    table.ran("m", cold[:64], "a")  # one block: shorter than min_blocks is no prefix
    assert table.route("m", cold, loads={"a": 2, "b": 0, "c": 5}).reason == "cold"
    assert table.route("m", list(range(10)), loads={"a": 0, "b": 1, "c": 1}) == Route("a", 0, "cold"), (
        "a prompt shorter than one block is routed too"
    )
    first = {table.route("m", prompt(3, 4, tail=t)).node for t in range(5)}
    assert len(first) == 1, "with no loads, one prompt family keeps to one node (rendezvous order)"
    spread = {table.route("m", prompt(f, 4)).node for f in range(100, 140)}
    assert spread == {"a", "b", "c"}, "and different families spread"


def test_dead_and_forgotten_nodes_are_never_chosen(any_redis_url: str) -> None:
    table = WarmTable.from_url(any_redis_url)
    live(table, "a", "b", "c")
    live(table, "dying", ttl_s=0.3)
    p = prompt(4, 6)
    table.ran("m", p, "dying")
    assert table.route("m", p) == Route("dying", 384, "warm")
    time.sleep(0.45)
    table.ran("m", p[: 64 * 2], "b")
    for loads in (None, {"dying": 0, "a": 5, "b": 5, "c": 5}):
        chosen = table.route("m", p, loads=loads)
        assert chosen.node != "dying" and chosen == Route("b", 128, "warm")
        assert table.route("m", p, ["dying", "c"], loads=loads).node == "c", "not even when named"
    table.forget("b")
    assert table.route("m", p, ["b", "c"], loads={"b": 0, "c": 50}).node == "c", "b was forgotten"
    assert {table.route("m", prompt(f, 3)).node for f in range(200, 230)} == {"a", "c"}
    with pytest.raises(NotFound):
        table.route("m", p, ["b", "dying"])
    assert table.heartbeat("b", 2, 60)
    assert table.route("m", p, ["b"]) == Route("b", 0, "cold"), "b is back once it heartbeats"
    assert table.route("m", p, ["static-1"]) == Route("static-1", 0, "cold"), (
        "a node that never registered is taken as live (static setups)"
    )


def test_bad_candidates_and_loads_are_typed_errors(redis_url: str) -> None:
    table = WarmTable.from_url(redis_url)
    live(table, "a")
    for nodes, loads in ((["bad node"], None), ([], None), (None, {"a": -1}), (None, {"a": float("nan")}),
                         (None, {"a": "3"}), (None, [("a", 1)])):  # fmt: skip
        with pytest.raises(InvalidArgument):
            table.route("m", prompt(5, 3), nodes, loads=loads)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        WarmTable.from_url(redis_url, balance_rel=0.5)
    with pytest.raises(InvalidArgument):
        WarmTable.from_url(redis_url, shards=0)


def test_the_rule_on_its_own() -> None:
    cands = [("a", 6), ("b", 0), ("c", 3)]
    assert choose_route(cands, None, block=64) == Route("a", 384, "warm")
    assert choose_route(cands, {"a": 20, "b": 2, "c": 2}, block=64) == Route("c", 192, "balance")
    assert choose_route(cands, {"a": 10, "b": 2, "c": 2}, block=64) == Route("a", 384, "warm"), "8 is not > 8"
    assert choose_route(cands, {"a": 9}, block=64, balance_abs=8) == Route("c", 192, "balance"), (
        "9 > 0 + 8 and 9 > 1.5 * 0"
    )
    assert choose_route([("a", 6), ("c", 6)], {"a": 1, "c": 0}, block=64) == Route("c", 384, "warm"), (
        "equally warm: the less loaded"
    )
    with pytest.raises(NotFound):
        choose_route([], None, block=64)


def test_prompts_of_different_first_blocks_spread_over_cluster_slots_and_still_answer(
    redis_cluster_session: Any,
) -> None:
    cluster = redis_cluster_session
    cluster.flush()
    table = WarmTable.from_url(cluster.url)
    live(table, "a", "b", "c", "d")
    prompts = {f: prompt(f, 4 + f % 5, tail=7) for f in range(48)}
    owner = {f: "abcd"[f % 4] for f in prompts}
    table.ran_chains([table.chain("m", prompts[f]) for f in prompts if owner[f] == "a"], "a")  # one batch
    for f, p in prompts.items():
        if owner[f] != "a":
            table.ran("m", p, owner[f])
    slots = {key_slot(table.shard_of(table.chain("m", p)).prefixes.encode()) for p in prompts.values()}
    assert len(slots) == table.shards, "48 first blocks filled every one of the 16 shards"
    held = []
    for port in cluster.ports:
        client = redis.Redis(port=port)
        held.append(sum(1 for _ in client.scan_iter(match="{skippyd:v2:warm:*}:prefixes")))
    assert sum(held) == table.shards and sum(1 for h in held if h) >= 2, f"shards on masters: {held}"
    for f, p in prompts.items():
        blocks = 4 + f % 5
        assert table.warmest("m", p) == (owner[f], blocks * 64)
        assert table.route("m", p) == Route(owner[f], blocks * 64, "warm")
        assert table.route("m", p, loads={owner[f]: 50}).reason == "balance"
    chains = [table.chain("m", p) for p in prompts.values()]
    batch = "7" * 32
    assert table.ran_chains(chains, "e", batch) > 0
    assert table.ran_chains(chains, "e", batch) == -1, "a batch over many shards is applied once"


ROUTER = """
import json, sys
from skippyd import WarmTable
url, queries = sys.argv[1], json.loads(sys.stdin.read())
table = WarmTable.from_url(url)
out = []
for q in queries:
    r = table.route("m", q["tokens"], q["nodes"], loads=q["loads"])
    out.append([r.node, r.prefix_tokens, r.reason, table.warmest("m", q["tokens"])])
print(json.dumps(out))
"""


def test_a_router_replica_in_another_process_sees_the_same_answers(any_redis_url: str) -> None:
    table = WarmTable.from_url(any_redis_url)
    live(table, "a", "b", "c")
    live(table, "gone", ttl_s=0.2)
    queries: list[dict[str, Any]] = []
    for f in range(12):
        p = prompt(f + 300, 3 + f % 4)
        table.ran("m", p, "abc"[f % 3] if f % 4 else "gone")
        table.ran("m", p[: 64 * 2], "abc"[(f + 1) % 3])
        loads = [None, {"a": 20, "b": 20, "c": 0}, {"a": 1, "b": 1, "c": 1}][f % 3]
        nodes = None if f % 2 else ["a", "b", "gone"]
        queries.append({"tokens": p, "nodes": nodes, "loads": loads})
    time.sleep(0.3)
    mine = []
    for q in queries:
        r = table.route("m", q["tokens"], q["nodes"], loads=q["loads"])
        found = table.warmest("m", q["tokens"])
        mine.append([r.node, r.prefix_tokens, r.reason, list(found) if found else None])
    proc = subprocess.run([sys.executable, "-c", ROUTER, any_redis_url], input=json.dumps(queries),
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert json.loads(proc.stdout) == mine
    assert {m[2] for m in mine} >= {"warm", "balance"} and all(m[0] != "gone" for m in mine)


history = st.lists(
    st.tuples(
        st.integers(0, 2),  # stem (and so the shard)
        st.integers(1, 60),  # stem blocks kept
        st.integers(0, 6),  # blocks of its own
        st.sampled_from("abcde"),  # node
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=history,
    dead=st.sets(st.sampled_from("abcde"), max_size=2),
    loads=st.none() | st.dictionaries(st.sampled_from("abcde"), st.integers(0, 12)),
)
def test_each_candidates_warm_prefix_agrees_with_a_linear_scan(
    redis_url: str, events: list[tuple[int, int, int, str]], dead: set[str], loads: dict[str, int] | None
) -> None:
    """A candidate's prefix is the longest remembered prefix whose last runner it is (the seed's scan,
    per node), for every live candidate, over random histories that interleave nodes; route(), which
    stops searching once its rule is decided, answers what the rule answers on the full search."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    table = WarmTable(client, max_runs=10_000)
    stems = [prompt(s + 500, 60) for s in range(3)]
    prompts = []
    for n, (stem, keep, extra, node) in enumerate(events):
        p = stems[stem][: keep * 64] + [10**8 + n * 7919 + j for j in range(extra * 64 + 5)]
        prompts.append(p)
        table.ran("m", p, node)
    for node in "abcde":
        table.heartbeat(node, 1, ttl_s=0.001 if node in dead else 60)
    time.sleep(0.01)

    def linear(p: list[int]) -> dict[str, int]:
        chain = table.chain("m", p)
        best: dict[str, int] = {}
        for k in range(len(chain) // WARM_HASH_BYTES):
            value = client.hget(table.shard_of(chain).prefixes, chain[k * 8 : (k + 1) * 8])
            if value is None:
                break
            node = str(value.decode() if isinstance(value, bytes) else value).split(" ", 1)[1]
            if k + 1 >= table.min_blocks:
                best[node] = k + 1
        return {n: best.get(n, 0) for n in "abcde" if n not in dead}

    for p in prompts + stems:
        chain = table.chain("m", p)
        full = table.warm_candidates(chain, list("abcde"))
        assert dict(full) == linear(p)
        tight = WarmTable(client, max_runs=10_000, balance_abs=2, balance_rel=1.2)
        for t in (table, tight):
            rule = choose_route(full, loads, block=64, first_hash=chain[:8], balance_abs=t.balance_abs,
                                balance_rel=t.balance_rel)  # fmt: skip
            assert t.route_chain(chain, list("abcde"), loads=loads) == rule
            assert t.route_chain(chain, loads=loads) == rule, "default candidates: the registered ones"
        found = table.warmest_chain(chain)
        expected = max(linear(p).items(), key=lambda kv: kv[1], default=("", 0))
        assert (found[1] // 64 if found else 0) == expected[1]


def test_a_version_1_table_is_migrated_by_a_command(any_redis_url: str) -> None:
    redis_url = any_redis_url
    client = WarmTable.from_url(redis_url).client  # a cluster client on a cluster
    legacy = RedisKeys().legacy_warm
    client.hset(legacy.nodes, mapping={"old-gpu": "41 1700000000000 600000000000000 up", "x": "bad"})
    client.hset(legacy.prefixes, mapping={b"12345678": "1 old-gpu", b"abcdefgh": "2 old-gpu"})
    client.zadd(legacy.ages, {b"12345678": 1, b"abcdefgh": 2})
    client.set(legacy.clock, 2)
    result = CliRunner().invoke(main, ["warm", "migrate", "--redis-url", redis_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "1 node registration(s) copied, 2 version-1 prefix(es) dropped" in result.stdout
    assert not any(client.exists(k) for k in (legacy.nodes, legacy.prefixes, legacy.ages, legacy.clock))
    table = WarmTable.from_url(redis_url)
    assert [(n.node, n.incarnation) for n in table.nodes()] == [("old-gpu", 41)]
    assert table.route("m", prompt(9, 3)).node == "old-gpu", "its shards know it too"
    again = CliRunner().invoke(main, ["warm", "migrate", "--redis-url", redis_url], catch_exceptions=False)
    assert "0 node registration(s) copied, 0 version-1 prefix(es) dropped" in again.stdout


def test_route_from_the_command_line(redis_url: str, tmp_short: Any) -> None:
    table = WarmTable.from_url(redis_url)
    live(table, "gpu-1", "gpu-2")
    tokens = tmp_short / "t.json"
    tokens.write_text(json.dumps(prompt(11, 4)))
    table.ran("m", prompt(11, 4), "gpu-1")
    args = ["warm", "route", "--model", "m", "--tokens", str(tokens), "--redis-url", redis_url]
    out = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False).stdout
    assert json.loads(out) == {"node": "gpu-1", "prefix_tokens": 256, "reason": "warm"}
    out = CliRunner().invoke(main, [*args, "--load", "gpu-1=20", "--load", "gpu-2=1"]).stdout
    assert out.strip() == "gpu-2 0 balance"
    bad = CliRunner().invoke(main, [*args, "--load", "gpu-1"])
    assert bad.exit_code == 2 and "NODE=LOAD" in bad.stderr
    pinned = CliRunner().invoke(main, [*args, "--json"], env={"SKIPPYD_NODE": "gpu-2"})
    assert json.loads(pinned.stdout)["node"] == "gpu-1", "a daemon host's SKIPPYD_NODE is no candidate list"
    none = CliRunner().invoke(main, [*args, "--node", "gone-1"])
    assert none.exit_code == 0, "an unregistered node is taken as live"
    table.forget("gpu-1")
    table.forget("gpu-2")
    empty = CliRunner().invoke(main, args)
    assert empty.exit_code == 1 and "no live node" in empty.stderr and "Traceback" not in empty.output


def test_pipelined_calls_over_shards_reload_scripts_after_a_script_flush(any_redis_url: str) -> None:
    table = WarmTable.from_url(any_redis_url)
    live(table, "a")
    chains = [table.chain("m", prompt(f + 700, 3)) for f in range(20)]
    assert table.ran_chains(chains, "a") == 60

    def flush() -> None:
        if isinstance(table.client, redis.cluster.RedisCluster):
            for node in table.client.get_primaries():  # type: ignore[no-untyped-call]
                redis.Redis(host=node.host, port=node.port).script_flush()
        else:
            table.client.script_flush()

    flush()
    assert table.ran_chains(chains, "b") == 60, "every shard's call ran once, after a reload"
    flush()
    assert table.heartbeat("b", 1, 60)
    assert all(table.route("m", prompt(f + 700, 3)) == Route("b", 192, "warm") for f in range(20))
    assert sum(int(table.client.get(s.clock) or 0) for s in table.all_shards()) == 40


def test_the_printed_route_script_loaded_by_another_router_answers_as_warm_candidates(redis_url: str) -> None:
    table = WarmTable.from_url(redis_url)
    live(table, "a", "b")
    p = prompt(31, 9)
    table.ran("m", p, "a")
    table.ran("m", p[: 64 * 4], "b")
    printed = CliRunner().invoke(main, ["warm", "script", "route"], catch_exceptions=False).stdout
    sha = CliRunner().invoke(main, ["warm", "script", "route", "--sha"], catch_exceptions=False).stdout
    assert "--! include" not in printed, "the text Redis runs: the shared search is in it"
    other = redis.Redis.from_url(redis_url)  # a router in another language: SCRIPT LOAD, then EVALSHA
    other.script_flush()
    assert other.script_load(printed) == sha.strip()
    chain = table.chain("m", p)
    shard = table.shard_of(chain)
    raw = other.evalsha(sha.strip(), 2, shard.prefixes, shard.nodes,
                        chain, WARM_HASH_BYTES, 2, 64, "all", "8.0", "1.5", 0)  # fmt: skip
    answered = {raw[i].decode(): int(raw[i + 2]) for i in range(0, len(raw), 3) if int(raw[i + 1])}
    assert answered == dict(table.warm_candidates(chain)) == {"a": 9, "b": 4}
    warmest = CliRunner().invoke(main, ["warm", "script", "warmest"], catch_exceptions=False).stdout
    found = other.eval(warmest, 2, shard.prefixes, shard.nodes, chain, WARM_HASH_BYTES, 2, 4)
    assert [found[0].decode(), int(found[1])] == ["a", 9]
