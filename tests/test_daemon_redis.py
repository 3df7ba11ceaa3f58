"""The daemon's side of Redis: node registration, warm-table feeding, and serving through outages."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from daemonutil import TEST_SHM, DaemonProcess, eventually
from redisutil import RedisServer

from skippyd import WarmTable
from skippyd.cli import main
from skippyd.cluster.coordination import connect
from skippyd.cluster.redis_embedded import EmbeddedRedis
from skippyd.cluster.rediskeys import RedisKeys
from skippyd.errors import NotConfigured
from skippyd.files import lock_holder

MODEL, STATE = "m", "kv-v1"


def embedded_url(daemon: DaemonProcess) -> str:
    return f"unix://{daemon.state_dir}/redis/redis.sock"


def test_the_daemon_registers_its_node_and_keeps_heartbeating(daemon: DaemonProcess) -> None:
    table = WarmTable.from_url(embedded_url(daemon))
    nodes = eventually(table.nodes)
    assert [n.node for n in nodes] == ["test-node"]
    first = nodes[0]
    time.sleep(2.5)
    later = table.nodes()[0]
    assert later.alive and later.incarnation == first.incarnation
    assert later.last_heartbeat_ms > first.last_heartbeat_ms


def test_client_ran_feeds_the_warm_table(daemon: DaemonProcess) -> None:
    prompt = list(range(64 * 5 + 10))
    with daemon.client() as client:
        client.ran(model=MODEL, tokens=prompt)
    table = WarmTable.from_url(embedded_url(daemon))
    assert eventually(lambda: table.warmest(MODEL, prompt)) == ("test-node", 320)


def test_every_capture_feeds_the_warm_table_unless_turned_off(make_daemon: Any) -> None:
    on = make_daemon().start()
    off = make_daemon("--no-warm-on-capture").start()
    prompt = list(range(64 * 3))
    for proc in (on, off):
        with proc.client() as client:
            client.capture(model=MODEL, state=STATE, tokens=prompt, tensors={"x": torch.ones(4)})
    assert eventually(lambda: WarmTable.from_url(embedded_url(on)).warmest(MODEL, prompt)) == (
        "test-node",
        192,
    )
    time.sleep(0.5)
    assert WarmTable.from_url(embedded_url(off)).warmest(MODEL, prompt) is None


def test_without_redis_ran_is_not_configured_and_everything_else_works(make_daemon: Any) -> None:
    proc = make_daemon("--redis-url", "none").start()
    with proc.client() as client:
        with pytest.raises(NotConfigured):
            client.ran(model=MODEL, tokens=[1, 2, 3])
        client.capture(model=MODEL, state=STATE, tokens=[1, 2, 3], tensors={"x": torch.ones(4)})
        assert client.restore(model=MODEL, state=STATE, tokens=[1, 2, 3]) is not None
        assert client.stats()["redis"] == {"configured": False}


def test_redis_killed_and_restarted_under_load_costs_clients_nothing(make_daemon: Any) -> None:
    server = RedisServer().start()
    proc = make_daemon("--redis-url", server.url, "--redis-timeout", "100ms").start()
    errors: list[str] = []
    done = threading.Event()
    served = [0]

    def load(index: int) -> None:
        with proc.client() as client:
            n = 0
            while not done.is_set():
                n += 1
                tokens = [index, n, *range(64 * 2)]
                try:
                    client.capture(
                        model=MODEL, state=STATE, tokens=tokens, tensors={"x": torch.full((8,), n)}
                    )
                    restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
                    assert restored is not None and int(restored.tensors["x"][0]) == n
                    client.ran(model=MODEL, tokens=tokens)
                    served[0] += 1
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        server.kill()
        outage_prompt = list(range(7000, 7000 + 64 * 4))
        with proc.client() as client:
            client.ran(model=MODEL, tokens=outage_prompt)  # buffered while Redis is away
            redis_state = eventually(lambda: client.stats()["redis"]["degraded"] and client.stats()["redis"])
            assert redis_state["degraded"] and redis_state["cause"]
            before = served[0]
            time.sleep(1.0)
            assert served[0] > before, "requests keep being served while Redis is down"
            status = CliRunner().invoke(main, ["status", "--json", "--socket", str(proc.socket)])
            assert json.loads(status.stdout)["redis"]["degraded"] is True
        server.start()
        with proc.client() as client:
            assert eventually(lambda: not client.stats()["redis"]["degraded"], timeout=20)
        table = WarmTable.from_url(server.url)
        assert eventually(lambda: table.warmest(MODEL, outage_prompt)) == ("test-node", 256)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
        server.cleanup()
    assert not errors, errors[:3]


def redis_pid(daemon: DaemonProcess) -> int:
    return int((daemon.state_dir / "redis" / "redis.pid").read_text().strip())


def running(pid: int) -> bool:
    """Alive and not a zombie (a server someone else stopped lingers as <defunct> until reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # (reaped between the open and the read: ESRCH)
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skippyd", "serve", "--node", "test-node", "--l2-budget", "64MiB", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def push_out_of_l2(client: Any, tokens: list[int]) -> None:
    """Non-durable captures until the entry of ``tokens`` is only in L3 (LRU, a 64 MiB L2)."""
    for n in range(40):
        client.capture(model=MODEL, state=STATE, tokens=[1, n, 7], tensors={"x": torch.ones(1 << 20)},
                       durable=False)  # fmt: skip
        hit = client.lookup(model=MODEL, state=STATE, tokens=tokens)
        if hit is not None and hit.source == "l3":
            return
    raise AssertionError("the entry never left L2")


def test_a_second_serve_on_a_live_daemons_directories_is_refused_and_touches_nothing(
    make_daemon: Any,
) -> None:
    live = make_daemon(budget="64MiB").start()
    table = WarmTable.from_url(embedded_url(live))
    assert eventually(table.nodes)
    pid = redis_pid(live)
    other_shm = Path(tempfile.mkdtemp(prefix="skippyd-test-l2-", dir=TEST_SHM))
    other_state = live.root / "other-state"
    second = live.root / "second.sock"
    try:
        for args, what in (
            (["--state-dir", str(live.state_dir), "--shm-dir", str(other_shm)], "state directory"),
            (["--state-dir", str(other_state), "--shm-dir", str(live.shm_dir)], "L2 directory"),
        ):
            done = serve("--socket", str(second), *args)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1, done.stderr
            assert lines[0].endswith("[store_locked]") and f"another skippyd uses this {what}" in lines[0]
            assert "redis-server" not in done.stderr
        assert list(other_shm.iterdir()) == [], "refused before anything under its L2 directory was made"
        assert [p.name for p in other_state.iterdir()] == [".lock"], "no redis-server of its own started"
        assert not second.exists()
    finally:
        shutil.rmtree(other_shm, ignore_errors=True)
    assert redis_pid(live) == pid and running(pid), "the live daemon's redis-server is untouched"
    prompt = list(range(3000, 3000 + 64 * 4))
    with live.client() as client:
        client.ran(model=MODEL, tokens=prompt)
        assert eventually(lambda: table.warmest(MODEL, prompt)) == ("test-node", 256)
        tokens = list(range(100))
        entry = client.capture(model=MODEL, state=STATE, tokens=tokens, tensors={"x": torch.ones(1 << 20)})
        assert eventually(lambda: client.stats()["l3"]["writes"] >= 1)
        push_out_of_l2(client, tokens)
        restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
        assert restored is not None and restored.source == "l3"
        assert eventually(lambda: client.stats()["redis"]["promotions_redis"] >= 1), "counted in Redis"
        redis = client.stats()["redis"]
        assert not redis["degraded"] and redis["server_pid"] == pid and redis["server_restarts"] == 0
    store = connect(embedded_url(live))
    assert store.hexists(RedisKeys().promo_obs("node:test-node"), entry.digest)
    store.close()


def test_one_directory_given_for_state_and_l3_or_state_and_l2_serves_and_restarts(make_daemon: Any) -> None:
    """The daemon shares its own owner lock between its state, L2 and L3 directories (it never refuses
    itself), and gives it back on stop: the same daemon starts again on the same directories."""
    with_l3 = make_daemon()
    with_l2 = make_daemon()
    configs = (
        (with_l3, ["--l3-dir", str(with_l3.state_dir)], with_l3.state_dir),
        (with_l2, ["--state-dir", str(with_l2.shm_dir)], with_l2.shm_dir),
    )
    for daemon, args, shared in configs:
        daemon.args += args  # the last of a repeated option wins
        daemon.start()
        tokens = [11, 12, 13]
        with daemon.client() as client:
            client.capture(model=MODEL, state=STATE, tokens=tokens, tensors={"x": torch.ones(4)})
            assert client.lookup(model=MODEL, state=STATE, tokens=tokens) is not None
        assert daemon.proc is not None and lock_holder(shared) == daemon.proc.pid
        assert daemon.stop() == 0
        assert lock_holder(shared) is None, "every holder gave the shared lock back"
        daemon.start()  # the same directories again, now with something in them
        with daemon.client() as client:
            assert client.lookup(model=MODEL, state=STATE, tokens=tokens) is not None
            assert not client.stats()["redis"]["degraded"]
        assert daemon.stop() == 0


def test_a_killed_embedded_redis_server_is_restarted_and_what_ran_meanwhile_reaches_it(
    daemon: DaemonProcess,
) -> None:
    table = WarmTable.from_url(embedded_url(daemon))
    assert eventually(table.nodes)
    before = list(range(5000, 5000 + 64 * 3))
    gap = [list(range(9000 + 1000 * i, 9000 + 1000 * i + 64 * 4)) for i in range(5)]
    with daemon.client() as client:
        client.ran(model=MODEL, tokens=before)
        assert eventually(lambda: table.warmest(MODEL, before)) == ("test-node", 192)
        time.sleep(1.5)  # the append-only file is written to disk once a second
        pid = redis_pid(daemon)
        os.kill(pid, signal.SIGKILL)  # what the OOM killer does
        for prompt in gap:  # right away: the supervisor waits 0.5 s before a restart
            client.ran(model=MODEL, tokens=prompt)
        assert eventually(lambda: client.stats()["redis"]["server_restarts"] == 1, timeout=10)
        assert eventually(lambda: not client.stats()["redis"]["degraded"], timeout=10)
        redis = client.stats()["redis"]
        assert redis["server_pid"] == redis_pid(daemon) != pid and running(redis["server_pid"])
        assert redis["server_last_exit"] == "was killed by SIGKILL" and redis["failures"] >= 1
        assert redis["ran_dropped"] == 0
        assert eventually(lambda: all(table.warmest(MODEL, p) == ("test-node", 256) for p in gap))
        assert table.warmest(MODEL, before) == ("test-node", 192), "reloaded from the append-only file"
        assert [n.node for n in table.nodes()] == ["test-node"], "registered again"
    code, out, _ = cli("status", "--socket", str(daemon.socket))
    assert code == 0 and "embedded redis-server restarted 1 time" in out and "SIGKILL" in out
    _, out, _ = cli("doctor", "--socket", str(daemon.socket))
    assert "the embedded redis-server died and was restarted 1 time" in out


def test_a_restarted_embedded_server_that_lost_its_append_only_file_gets_the_node_in_every_shard_again(
    daemon: DaemonProcess,
) -> None:
    table = WarmTable.from_url(embedded_url(daemon))
    assert eventually(table.nodes)
    before = list(range(7000, 7000 + 64 * 3))
    with daemon.client() as client:
        client.ran(model=MODEL, tokens=before)
        assert eventually(lambda: table.warmest(MODEL, before)) == ("test-node", 192)
        pid = redis_pid(daemon)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 0.3  # the supervisor waits 0.5 s before it starts a new server
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        for lost in ("appendonlydir", "appendonly.aof"):  # Redis 7's directory, or older Redis's file
            shutil.rmtree(daemon.state_dir / "redis" / lost, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                (daemon.state_dir / "redis" / lost).unlink()
        assert eventually(lambda: client.stats()["redis"]["server_restarts"] == 1, timeout=10)
        assert eventually(lambda: not client.stats()["redis"]["degraded"], timeout=10)
    assert table.warmest(MODEL, before) is None, "the append-only file really was lost"
    assert eventually(lambda: [n.node for n in table.nodes()] == ["test-node"]), "registered again"
    for shard in table.all_shards():
        record = table.client.hget(shard.nodes, "test-node")
        assert record is not None and record.decode().endswith(" up"), (shard.nodes, record)
    after = list(range(8000, 8000 + 64 * 2))
    with daemon.client() as client:
        client.ran(model=MODEL, tokens=after)
    assert eventually(lambda: table.warmest(MODEL, after)) == ("test-node", 128), "lookups answer it"
    route = table.route(MODEL, after)
    assert (route.node, route.prefix_tokens) == ("test-node", 128)


def test_status_exits_4_while_the_configured_redis_is_down_and_0_once_it_is_back(make_daemon: Any) -> None:
    server = RedisServer().start()
    proc = make_daemon("--redis-url", server.url, "--redis-timeout", "100ms", "--heartbeat", "200ms").start()
    sock = str(proc.socket)
    try:
        assert cli("status", "--check", "--socket", sock) == (0, "", "")
        server.kill()
        assert eventually(lambda: cli("status", "--check", "--socket", sock)[0] == 4)
        code, out, err = cli("status", "--check", "--socket", sock)
        assert out == "" and len(err.strip().splitlines()) == 1 and "is degraded: redis degraded since" in err
        code, out, _ = cli("status", "--json", "--socket", sock)
        doc = json.loads(out)
        assert code == 4 and doc["up"] and doc["healthy"] is False and doc["state"] == "degraded"
        assert len(doc["problems"]) == 1 and doc["problems"][0].startswith("redis degraded since")
        code, out, _ = cli("status", "--socket", sock)
        assert code == 4 and "DEGRADED" in out
        server.start()
        assert eventually(lambda: cli("status", "--check", "--socket", sock)[0] == 0)
        assert json.loads(cli("status", "--json", "--socket", sock)[1])["healthy"] is True
    finally:
        server.cleanup()
    proc.stop()
    assert cli("status", "--check", "--socket", sock)[0] == 3


@pytest.mark.parametrize("title", ["", "{title} {port}"], ids=["title-names-the-socket", "bare-title"])
def test_a_leftover_redis_server_is_stopped_once_the_lock_shows_its_daemon_is_gone(
    make_daemon: Any, title: str
) -> None:
    """Recognised by the socket in its process title (Redis 7's default) or by its working directory."""
    proc = make_daemon()
    where = proc.state_dir / "redis"
    where.mkdir(parents=True)
    leftover = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", "0",
         "--unixsocket", str(where / "redis.sock"), "--dir", str(where),
         "--pidfile", str(where / "redis.pid"), "--save", "", "--appendonly", "no",
         *(["--proc-title-template", title] if title else [])],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert eventually(lambda: (where / "redis.pid").exists() and (where / "redis.sock").exists())
        proc.start()
        assert leftover.wait(timeout=10) == 0, "stopped with SIGTERM (its AOF flushed)"
        assert (
            f"stopping an embedded redis-server (pid {leftover.pid}) left by an earlier run"
            in proc.log_text()
        )
        assert redis_pid(proc) != leftover.pid and running(redis_pid(proc))
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()


def test_the_supervisor_restarts_a_dead_server_with_callbacks_and_stop_ends_it_for_good(
    tmp_short: Path,
) -> None:
    state = tmp_short / "state"
    embedded = EmbeddedRedis(state, appendonly=False)
    downs: list[str] = []
    ups: list[int] = []
    embedded.start()
    assert lock_holder(state) == os.getpid(), "the state directory's lock is taken by whoever starts it"
    embedded.supervise(on_down=downs.append, on_up=lambda: ups.append(1))
    try:
        assert embedded.proc is not None
        first = embedded.proc.pid
        os.kill(first, signal.SIGKILL)
        assert eventually(lambda: ups == [1], timeout=10)
        assert downs == [f"the embedded redis-server (pid {first}) was killed by SIGKILL"]
        status = embedded.status()
        assert status["server_restarts"] == 1 and status["server_last_exit"] == "was killed by SIGKILL"
        assert status["server_pid"] not in (0, first) and running(status["server_pid"])
        assert status["server_down_for_s"] is None and status["server_last_restart_age_s"] >= 0
        assert connect(embedded.url).ping()
        second = status["server_pid"]
    finally:
        embedded.stop()
    assert not running(second) and lock_holder(state) is None
    time.sleep(1.0)
    assert ups == [1] and embedded.proc is None, "a stopped server is not started again"


def test_a_callback_that_raises_costs_the_supervisor_nothing(tmp_short: Path) -> None:
    """on_down and on_up raising: logged, and the server is still restarted, again and again."""
    state = tmp_short / "state"
    embedded = EmbeddedRedis(state, appendonly=False)
    calls: list[str] = []

    def down(cause: str) -> None:
        calls.append("down")
        raise RuntimeError("on_down broke")

    def up() -> None:
        calls.append("up")
        raise RuntimeError("on_up broke")

    embedded.start()
    embedded.supervise(on_down=down, on_up=up)
    try:
        for n in (1, 2):
            assert embedded.proc is not None
            pid = embedded.proc.pid
            os.kill(pid, signal.SIGKILL)

            def restarted(want: int = n) -> bool:
                return bool(embedded.status()["server_restarts"] == want and calls == ["down", "up"] * want)

            assert eventually(restarted, timeout=15)
            new = embedded.status()["server_pid"]
            assert new not in (0, pid) and running(new) and connect(embedded.url).ping()
        assert embedded._thread is not None and embedded._thread.is_alive()
    finally:
        embedded.stop()


def test_a_server_that_cannot_start_again_stays_down_and_is_retried_until_it_can(tmp_short: Path) -> None:
    state = tmp_short / "state"
    embedded = EmbeddedRedis(state)
    ups: list[int] = []
    embedded.start()
    embedded.supervise(on_up=lambda: ups.append(1))
    aof = embedded.dir / "appendonlydir"
    try:
        assert embedded.proc is not None
        os.kill(embedded.proc.pid, signal.SIGKILL)
        aof.rename(embedded.dir / "aof-aside")
        aof.touch()  # redis-server exits at start: "Can't open or create append-only dir"
        assert eventually(lambda: (embedded.status()["server_down_for_s"] or 0) > 2.0, timeout=10)
        status = embedded.status()
        assert status["server_pid"] == 0 and status["server_restarts"] == 0 and ups == []
        aof.unlink()
        (embedded.dir / "aof-aside").rename(aof)
        assert eventually(lambda: ups == [1], timeout=20), "retried with backoff until it starts"
        status = embedded.status()
        assert status["server_restarts"] == 1 and status["server_down_for_s"] is None
        assert connect(embedded.url).ping()
    finally:
        embedded.stop()


def test_the_condition_status_reports_is_unhealthy_over_degraded_over_healthy() -> None:
    from skippyd.stats import Condition, RedisStatus, Snapshot
    from skippyd.workers import ThreadHealth

    assert Snapshot(redis=RedisStatus(configured=True)).condition() == Condition("healthy")
    assert Snapshot().condition() == Condition("healthy"), "no Redis configured: nothing to miss"
    away = RedisStatus(configured=True, degraded=True, cause="Connection refused", degraded_for_s=3.0)
    degraded = Snapshot(redis=away).condition()
    assert degraded.state == "degraded" and len(degraded.problems) == 1
    assert degraded.problems[0].startswith("redis degraded since ")
    assert degraded.problems[0].endswith("(3s): Connection refused")
    dead = Snapshot(healthy=False, threads={"skippyd-promoter": ThreadHealth(alive=False)}, redis=away)
    unhealthy = dead.condition()
    assert unhealthy.state == "unhealthy" and len(unhealthy.problems) == 2
    assert unhealthy.problems[0] == "background thread(s) skippyd-promoter died: restart the daemon"
