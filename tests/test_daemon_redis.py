"""The daemon's side of Redis: node registration, warm-table feeding, and serving through outages."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from daemonutil import DaemonProcess, eventually
from redisutil import RedisServer

from skippyd import WarmTable
from skippyd.cli import main
from skippyd.errors import NotConfigured

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
