"""The daemon's Redis link (Coordinator) against real redis-server processes: batching, timeouts,
outages. Its thread is started in one test only (a server known down and back); the others drive
``_tick`` themselves, so every outcome is exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from daemonutil import eventually
from redisutil import RedisServer

from skippyd.cluster import coordination
from skippyd.cluster.coordination import Coordinator
from skippyd.cluster.rediskeys import WARM_SHARDS, RedisKeys
from skippyd.errors import CoordinationTimeout, CoordinationUnavailable
from skippyd.keys import encode_tokens

# about a second of Lua work on the server (it handles nothing else meanwhile)
BUSY_LUA = "local x = 0 for i = 1, 150000000 do x = x + i end return 1"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    try:
        yield s
    finally:
        s.cleanup()


def make(server: RedisServer, **kwargs: float) -> Coordinator:
    c = Coordinator(server.url, node="n1", scope="s", timeout=0.25, **kwargs)  # type: ignore[arg-type]
    c._last_heartbeat = time.monotonic() + 3600  # no heartbeat in these ticks: only batches
    return c


def clock(server: RedisServer) -> int:
    """Prompts recorded: the sum of every warm-table shard's clock."""
    keys = RedisKeys()
    return sum(int(server.client().get(keys.warm_shard(i).clock) or 0) for i in range(WARM_SHARDS))


def test_warm_updates_go_in_batches_bounded_by_bytes(server: RedisServer) -> None:
    c = make(server)
    try:
        long_prompt = encode_tokens(list(range(64 * 4096)))  # 4096 blocks: a 32 KiB chain
        for _ in range(5):
            c.ran("m", long_prompt)
        batch = c._take_batch()
        assert len(batch) == 2, "two 32 KiB chains fill a 64 KiB batch"
        c._retry = (coordination.new_batch_id(), batch)  # as a failed call leaves it
        c._tick()
        assert c.counters["batches"] == 3 and c.counters["ran_sent"] == 5
        assert clock(server) == 5, "one tick of the table per prompt"
    finally:
        c.close()


def test_a_warm_batch_whose_answer_timed_out_is_sent_again_and_applied_once(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script runs after all (once Redis is free again) but its answer came too late; the re-send
    carries the same batch id, so Redis applies it once."""
    monkeypatch.setattr(coordination, "BATCH_TIMEOUT_S", 0.3)
    c = make(server)
    try:
        c.ran("m", encode_tokens(list(range(256))))
        c._tick()  # (loads the script into Redis)
        assert clock(server) == 1
        c.ran("m", encode_tokens(list(range(256))))
        busy = threading.Thread(target=server.client().eval, args=(BUSY_LUA, 0))
        busy.start()  # Redis is busy for about a second; our batch waits in its socket buffer
        time.sleep(0.1)
        with pytest.raises(CoordinationTimeout):
            c._tick()
        assert c.status().buffered == 1, "kept to be sent again"
        busy.join(timeout=30)
        time.sleep(0.2)
        assert clock(server) == 2, "the timed-out call did run, once Redis came back to it"
        c._tick()
        assert c.counters["batches_resent"] == 1 and c.counters["batches_applied_before"] == 1
        assert clock(server) == 2, "the re-send changed nothing"
        assert c.status().buffered == 0
    finally:
        c.close()


def test_a_warm_batch_that_never_reached_redis_is_kept_and_sent_later(server: RedisServer) -> None:
    c = make(server)
    try:
        c.ran("m", encode_tokens(list(range(256))))
        server.kill()
        with pytest.raises(CoordinationUnavailable) as caught:
            c._tick()
        assert not isinstance(caught.value, CoordinationTimeout)
        assert c.status().buffered == 1
        server.start()
        c._tick()
        assert c.status().buffered == 0 and clock(server) == 1
        assert c.counters["batches_resent"] == 1 and c.counters["batches_applied_before"] == 0
    finally:
        c.close()


def test_a_server_known_down_counts_promotions_locally_and_its_return_flushes_the_buffer(
    server: RedisServer,
) -> None:
    """What the embedded server's supervisor tells the coordinator (this test runs its thread)."""
    c = make(server, heartbeat_s=60.0)
    c.start()
    try:
        server.kill()
        c.server_down("the embedded redis-server (pid 1) was killed by SIGKILL")
        assert c.status().degraded, "degraded at once, not at the next call"
        assert [c.consider("a" * 64, 10, 100), c.consider("a" * 64, 10, 100)] == [False, True], (
            "the second hit promotes, counted locally"
        )
        assert c.counters["promotions_local"] == 2 and c.counters["promotions_redis"] == 0
        c.ran("m", encode_tokens(list(range(256))))
        time.sleep(0.5)  # the thread tried, and failed
        status = c.status()
        assert status.degraded and status.buffered == 1 and status.failures >= 2
        assert status.cause == "the embedded redis-server (pid 1) was killed by SIGKILL", "not 'refused'"
        server.start()
        c.server_up()
        assert eventually(lambda: not c.status().degraded, timeout=10)
        assert eventually(lambda: c.status().buffered == 0) and clock(server) == 1, "flushed"
        assert c.consider("b" * 64, 10, 100) is False and c.counters["promotions_redis"] == 1
    finally:
        c.close()


def test_a_tick_that_went_through_as_the_server_died_does_not_clear_the_degraded_state(
    server: RedisServer,
) -> None:
    """The supervisor's server_down lands while a heartbeat is in flight and answered: the coordinator
    stays degraded (with the server's cause) until server_up, not "recovered" over a dead server."""
    c = make(server, heartbeat_s=0.2)
    real = c.table.heartbeat
    died = threading.Event()

    def heartbeat_then_the_server_dies(*args: object, **kwargs: object) -> bool:
        answer = real(*args, **kwargs)  # type: ignore[arg-type]
        if not died.is_set():
            died.set()
            c.server_down("the embedded redis-server (pid 1) was killed by SIGKILL")
        return answer

    c.table.heartbeat = heartbeat_then_the_server_dies  # type: ignore[method-assign]
    c._last_heartbeat = 0.0  # make() holds heartbeats back; this test is about one
    c.start()
    try:
        assert died.wait(10)
        time.sleep(0.5)  # ticks go through meanwhile (this server is up): none may clear the state
        status = c.status()
        assert status.degraded and status.cause.endswith("killed by SIGKILL")
        c.server_up()
        assert eventually(lambda: not c.status().degraded, timeout=10)
    finally:
        c.close()


def test_while_redis_is_away_captures_do_not_cut_the_reconnect_backoff_short(server: RedisServer) -> None:
    """Every ``ran`` (one a capture) wakes the background thread; its backoff waits must not end there,
    or a busy daemon retries a Redis that is coming back once per capture."""
    coord = Coordinator(server.url, node="n1", scope="s", timeout=0.25, heartbeat_s=2.0, ttl_s=10.0)
    coord.start()
    try:
        eventually(lambda: coord.counters["heartbeats"] >= 1, timeout=10)
        server.kill()
        before = coord.counters["failures"]
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < 3.0:
            i += 1
            coord.ran("m", encode_tokens(list(range(i, i + 256))))
            time.sleep(0.002)
        tries = coord.counters["failures"] - before
        assert coord.degraded and 1 <= tries <= 8, f"{tries} tries in 3 s (backoff 0.1 s doubling: ~5)"
    finally:
        coord.close(flush_timeout=0.1)


def test_a_redis_cluster_that_is_away_at_start_degrades_the_daemons_link_and_typed_errors_reach_callers() -> (
    None
):
    """redis-py's cluster errors are no RedisError: they escaped as untyped errors, and a daemon whose
    cluster was away at start could not start (a single Redis away starts degraded)."""
    from redisutil import RedisCluster, _free_port

    from skippyd import Promotions, WarmTable

    away = f"redis+cluster://127.0.0.1:{_free_port()}"
    coord = Coordinator(away, node="n1", scope="s", timeout=0.25)  # built: the client is made at first use
    try:
        assert not coord.consider("ab" * 32, 10, 100), "counted locally (first sight)"
        assert coord.degraded and "Cluster" in coord.status().cause
        coord.ran("m", encode_tokens(list(range(256))))  # buffered, as with a single Redis away
        assert coord.status().buffered == 1
    finally:
        coord.close(flush_timeout=0.1)
    with pytest.raises(CoordinationUnavailable):
        WarmTable.from_url(away, timeout=0.25)
    cluster = RedisCluster().start()
    try:
        table = WarmTable.from_url(cluster.url, timeout=0.25)
        promotions = Promotions.from_url(cluster.url, scope="s", timeout=0.25)
        assert table.heartbeat("n1", 1, 10)
        for proc in cluster.procs:
            proc.kill()
            proc.wait()
        for _ in range(3):  # (redis-py refreshes its view of the cluster on the way: each call typed)
            time.sleep(0.5)
            with pytest.raises((CoordinationUnavailable, CoordinationTimeout)):
                table.route("m", list(range(256)))
            with pytest.raises((CoordinationUnavailable, CoordinationTimeout)):
                promotions.consider("ab" * 32, 10, 100)
    finally:
        cluster.cleanup()


def test_a_busy_redis_answering_within_its_timeout_holds_no_request_for_long(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promotion and admission counts run on a request's worker: a Redis busy with another client's
    work (so never degraded) made every put wait its turn. A request-path call gives up after 100 ms,
    and one answered slower than 20 ms sends the next few seconds of them to local counting."""
    import signal

    monkeypatch.setattr(coordination, "SLOW_PAUSE_S", 0.5)
    # (a long --redis-timeout: the request path keeps its own 100 ms)
    c = Coordinator(server.url, node="n1", scope="s", timeout=2.0)
    try:
        items = [("c" * 64, 10, 100)]
        assert c.admit(items) == [False] and c.counters["slow_calls"] == 0
        busy = threading.Thread(target=lambda: server.client().eval(BUSY_LUA, 0))
        busy.start()  # about a second of another client's Lua: every call waits for it
        time.sleep(0.05)
        started = time.monotonic()
        assert c.admit(items) == [False], "counted locally (its first sight here)"
        assert time.monotonic() - started < 0.5, "gave up after its own timeout"
        assert not c.status().degraded and c.counters["slow_calls"] == 1, "slow, not down: the link is fine"
        busy.join()
        time.sleep(0.6)  # (the pause the slow call began)
        c.counters["slow_calls"] = 0
        real = c.admissions.consider_many
        calls: list[float] = []

        def slow(found: Any) -> list[bool]:
            calls.append(time.monotonic())
            time.sleep(0.03)  # answered, within every timeout, but slowly
            return list(real(found))

        monkeypatch.setattr(c.admissions, "consider_many", slow)
        c.admit([("d" * 64, 10, 100)])
        assert c.counters["slow_calls"] == 1 and not c.status().degraded
        for _ in range(5):
            c.admit([("d" * 64, 10, 100)])
        assert len(calls) == 1, "the next calls count locally, without asking Redis"
        time.sleep(0.6)
        c.admit([("d" * 64, 10, 100)])
        assert len(calls) == 2, "Redis is asked again after the pause"
        server.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            monkeypatch.setattr(c.admissions, "consider_many", real)
            time.sleep(0.6)
            started = time.monotonic()
            c.admit([("e" * 64, 10, 100)])
            assert time.monotonic() - started < 0.5, "a frozen Redis costs one request-path timeout"
        finally:
            server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    finally:
        c.close()


def test_a_busy_redis_cluster_counts_as_slow_on_the_request_path_not_as_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py's cluster client refreshes its slot map after a timeout, and wraps a timeout of that
    refresh in RedisClusterUnreachableError: taken as "down", a busy cluster degraded the link from the
    request path (as a single busy Redis did before)."""
    import signal

    from redisutil import RedisCluster

    monkeypatch.setattr(coordination, "SLOW_PAUSE_S", 0.3)
    cluster = RedisCluster().start()
    c = Coordinator(cluster.url, node="n1", scope="s", timeout=2.0)  # (not started: no background ticks)
    try:
        c.admit([("c" * 64, 10, 100)])
        for proc in cluster.procs:
            proc.send_signal(signal.SIGSTOP)  # every node busy for a moment
        try:
            for _ in range(4):  # a request-path count each time the pause is over
                c.admit([("c" * 64, 10, 100)])
                time.sleep(0.35)
            assert not c.status().degraded and c.counters["slow_calls"] >= 2
        finally:
            for proc in cluster.procs:
                proc.send_signal(signal.SIGCONT)
    finally:
        c.close()
        cluster.cleanup()
