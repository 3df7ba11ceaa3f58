"""The daemon with its durable tier: restarts with an empty tmpfs, corruption, promotion, single flight."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from daemonutil import DaemonProcess, eventually
from l2util import admit

import skippyd

MODEL, STATE = "m", "kv-v1"


def durable(client: skippyd.Client, n: int) -> bool:
    return bool(client.stats()["l3"]["writes"] >= n)


def restart_with_empty_tmpfs(daemon: DaemonProcess) -> None:
    daemon.stop()
    shutil.rmtree(daemon.shm_dir)
    daemon.shm_dir.mkdir()
    daemon.start()


def test_a_capture_is_served_from_l3_after_a_restart_with_an_empty_tmpfs(daemon: DaemonProcess) -> None:
    tensors = {"k": torch.randn(4, 1000), "flags": torch.tensor([True, False, True])}
    tokens = list(range(500))
    with daemon.client() as client:
        result = client.capture(model=MODEL, state=STATE, tokens=tokens, tensors=tensors)
        assert result.l2 and result.l3
        assert eventually(lambda: durable(client, 1))
    restart_with_empty_tmpfs(daemon)
    with daemon.client() as client:
        assert client.stats()["l2"]["entries"] == 0
        hit = client.lookup(model=MODEL, state=STATE, tokens=[*tokens, 1])
        assert hit is not None and hit.source == "l3" and hit.digest == result.digest
        restored = client.restore(model=MODEL, state=STATE, tokens=[*tokens, 1])
        assert restored is not None and restored.source == "l3" and restored.token_count == 500
        assert "fill_ms" in restored.timings
        assert torch.equal(restored.tensors["k"], tensors["k"])
        assert torch.equal(restored.tensors["flags"], tensors["flags"])


def test_a_non_durable_capture_stays_out_of_l3(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        result = client.capture(
            model=MODEL, state=STATE, tokens=[1, 2], tensors={"x": torch.ones(3)}, durable=False
        )
        assert result.l2 and not result.l3
        time.sleep(0.3)
        assert client.stats()["l3"]["entries"] == 0


def _corrupt_object(daemon: DaemonProcess, digest: str) -> None:
    from skippyd.l3.manifest import decode_manifest

    found = (daemon.state_dir / "l3" / "manifests").rglob("*.man")
    manifests = [decode_manifest(p.read_bytes()) for p in found]
    name = next(m.object for m in manifests if m.entry.digest == digest)
    obj = next((daemon.state_dir / "l3" / "objects").rglob(f"{name}.obj"))
    with open(obj, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_corrupt_l3_entry_falls_back_to_a_shorter_prefix_and_is_never_served(daemon: DaemonProcess) -> None:
    prompt = list(range(800))
    with daemon.client() as client:
        short = client.capture(
            model=MODEL, state=STATE, tokens=prompt[:200], tensors={"x": torch.full((64,), 2.0)}
        )
        long = client.capture(
            model=MODEL, state=STATE, tokens=prompt[:600], tensors={"x": torch.full((64,), 6.0)}
        )
        assert eventually(lambda: durable(client, 2))
    restart_with_empty_tmpfs(daemon)
    _corrupt_object(daemon, long.digest)
    with daemon.client() as client:
        restored = client.restore(model=MODEL, state=STATE, tokens=prompt)
        assert restored is not None
        assert restored.token_count == 200 and restored.digest == short.digest
        assert torch.equal(restored.tensors["x"], torch.full((64,), 2.0))
        stats = client.stats()
        assert stats["l3"]["corrupt"] == 1 and stats["ops"]["corrupt_fallbacks"] == 1
        assert client.lookup(model=MODEL, state=STATE, tokens=prompt).token_count == 200  # type: ignore[union-attr]
    assert any((daemon.state_dir / "l3" / "quarantine").iterdir())


def test_an_l2_entry_that_disagrees_with_l3_is_removed_not_served(daemon: DaemonProcess) -> None:
    tokens = list(range(300))
    with daemon.client() as client:
        old = client.capture(model=MODEL, state=STATE, tokens=tokens, tensors={"x": torch.zeros(8)})
        assert eventually(lambda: durable(client, 1))
    daemon.stop()
    # Put a different, internally consistent L2 entry under the same key behind the daemon's back, as a
    # stale tmpfs from another deployment could: L3 is the authority and must win.
    from skippyd.keys import Identity, cache_key, encode_tokens
    from skippyd.l2 import L2Tier
    from skippyd.payload import TensorDecl

    ident = Identity(MODEL, STATE)
    with L2Tier.open(daemon.shm_dir, 256 << 20) as tier:
        admit(tier,
            key=cache_key(ident, encode_tokens(tokens)), identity=ident, token_count=300,
            tensors=[TensorDecl("x", "float32", (8,))], data=[torch.ones(8).numpy().tobytes()],
        )  # fmt: skip
    daemon.start()
    with daemon.client() as client:
        restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
        assert restored is not None and restored.source == "l3" and restored.digest == old.digest
        assert torch.equal(restored.tensors["x"], torch.zeros(8))
        assert client.stats()["ops"]["l2_mismatches_removed"] == 1


def test_a_second_fill_promotes_into_l2_and_long_prefixes_promote_on_the_first(daemon: DaemonProcess) -> None:
    short_tokens, long_tokens = list(range(100)), list(range(10000, 10000 + 4096))
    with daemon.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=short_tokens, tensors={"x": torch.ones(16)})
        client.capture(model=MODEL, state=STATE, tokens=long_tokens, tensors={"x": torch.ones(16) * 2})
        assert eventually(lambda: durable(client, 2))
    restart_with_empty_tmpfs(daemon)
    with daemon.client() as client:

        def source(tokens: list[int]) -> str:
            restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
            assert restored is not None
            return restored.source

        assert source(short_tokens) == "l3"
        time.sleep(0.3)
        assert source(short_tokens) == "l3"  # the second fill: promoted after serving
        assert eventually(lambda: client.stats()["ops"]["promotions"] >= 1)
        assert source(short_tokens) == "l2"
        assert source(long_tokens) == "l3"  # 4096 tokens: worth promoting on first sight
        assert eventually(lambda: client.stats()["ops"]["promotions"] >= 2)
        assert source(long_tokens) == "l2"
        assert client.stats()["l2"]["entries"] == 2


@pytest.fixture
def shared_redis() -> Iterator[str]:
    from redisutil import RedisServer

    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.cleanup()


def test_two_daemons_sharing_a_scope_promote_on_the_second_fill_across_hosts(
    make_daemon: Any, shared_redis: str
) -> None:
    args = ("--redis-url", shared_redis, "--promotion-scope", "fleet")
    a = make_daemon(*args, "--node", "host-a").start()
    b = make_daemon(*args, "--node", "host-b").start()
    tensors = {"x": torch.arange(32, dtype=torch.float32)}
    tokens = list(range(64))
    for proc in (a, b):
        with proc.client() as client:
            client.capture(model=MODEL, state=STATE, tokens=tokens, tensors=tensors)
            assert eventually(partial(durable, client, 1))
        restart_with_empty_tmpfs(proc)
    with a.client() as client:
        assert client.restore(model=MODEL, state=STATE, tokens=tokens).source == "l3"
        time.sleep(0.3)
        assert client.stats()["ops"]["promotions"] == 0, "one fill in the scope so far"
    with b.client() as client:
        assert client.restore(model=MODEL, state=STATE, tokens=tokens).source == "l3"
        assert eventually(lambda: client.stats()["ops"]["promotions"] == 1), (
            "the second fill, on another host"
        )
        assert client.restore(model=MODEL, state=STATE, tokens=tokens).source == "l2"


def test_concurrent_restores_of_one_cold_entry_load_it_once(make_daemon: Any) -> None:
    proc = make_daemon(budget="1GiB").start()
    big = {"x": torch.randint(0, 255, (192 << 20,), dtype=torch.uint8)}
    tokens = list(range(32))
    with proc.client(timeout=60.0) as client:
        client.capture(model=MODEL, state=STATE, tokens=tokens, tensors=big)
        assert eventually(lambda: durable(client, 1), timeout=60)
    restart_with_empty_tmpfs(proc)
    barrier = threading.Barrier(8)
    results: list[Any] = []

    def restore() -> None:
        with proc.client(timeout=60.0) as client:
            client.ping()
            barrier.wait()
            restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
            results.append(restored and (restored.source, bool(torch.equal(restored.tensors["x"], big["x"]))))

    threads = [threading.Thread(target=restore) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [("l3", True)] * 8
    with proc.client() as client:
        ops = client.stats()["ops"]
        assert ops["fills"] == 1 and ops["fill_waits"] == 7
        assert client.stats()["l3"]["fills"] == 1


def test_a_small_l3_budget_drops_writes_it_cannot_hold_and_serving_goes_on(make_daemon: Any) -> None:
    proc = make_daemon("--l3-budget", "2MiB").start()
    with proc.client() as client:
        huge = client.capture(
            model=MODEL, state=STATE, tokens=[1], tensors={"x": torch.zeros(4 << 20, dtype=torch.uint8)}
        )
        assert huge.l2
        assert eventually(lambda: client.stats()["durable"]["failed"] == 1)
        for i in range(8):
            distinct = {
                "x": torch.full((300_000,), i, dtype=torch.uint8)
            }  # distinct content, distinct objects
            client.capture(model=MODEL, state=STATE, tokens=[2, i], tensors=distinct)
        assert eventually(lambda: durable(client, 8))
        stats = client.stats()["l3"]
        assert stats["bytes"] <= 2 << 20 and stats["evictions"] > 0
        assert client.restore(model=MODEL, state=STATE, tokens=[1]) is not None, "L2 still serves it"


@pytest.fixture
def small_disk(mount_tmpfs: Any) -> Path:
    return Path(mount_tmpfs("3m"))


def test_a_nearly_full_disk_makes_l3_refuse_writes_cleanly(make_daemon: Any, small_disk: Path) -> None:
    proc = make_daemon("--l3-dir", str(small_disk / "l3"), "--l3-min-free", "1MiB").start()
    with proc.client() as client:
        first = client.capture(
            model=MODEL, state=STATE, tokens=[1], tensors={"x": torch.zeros(1 << 20, dtype=torch.uint8)}
        )
        assert first.l3 and eventually(lambda: durable(client, 1))
        second = client.capture(
            model=MODEL, state=STATE, tokens=[2], tensors={"x": torch.ones(1 << 20, dtype=torch.uint8)}
        )
        assert second.l2
        assert second.durability in ("queued", "deferred")
        assert eventually(lambda: client.stats()["durable"]["failed"] >= 1)
        stats = client.stats()["l3"]
        assert stats["entries"] == 1 and stats["refused_writes"] >= 1, "it would have gone below the floor"
        assert client.restore(model=MODEL, state=STATE, tokens=[2]) is not None
    assert not any((small_disk / "l3" / "tmp").iterdir())
    proc.stop()
    floor = make_daemon("--l3-dir", str(small_disk / "l3"), "--l3-min-free", "64MiB", root=proc.root).start()
    with floor.client() as client:
        assert client.stats()["l3"]["readonly"] is True, "below its floor, L3 says it is read-only"
