"""Shared fixtures: real tmpfs directories, real files, and (in later modules) real Redis servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from daemon_fixtures import daemon_defaults, make_daemon, temporary_dir, tmp_short

__all__ = ["daemon_defaults", "make_daemon", "tmp_short"]  # fixtures shared with tests_vllm/

if TYPE_CHECKING:
    from daemonutil import DaemonProcess
    from redisutil import RedisCluster, RedisServer


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    from daemonutil import TEST_SHM

    with temporary_dir("skippyd-test-", TEST_SHM) as path:
        yield path


@pytest.fixture
def daemon(tmp_short: Path) -> Iterator[DaemonProcess]:
    """A running ``skippyd serve`` (embedded Redis) in a temporary directory."""
    from daemonutil import DaemonProcess

    proc = DaemonProcess(tmp_short).start()
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    """One real redis-server (unix socket, no persistence) for the whole run."""
    from redisutil import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_url(redis_session: RedisServer) -> str:
    """The session's redis-server, flushed for this test (scripts flushed too)."""
    client = redis_session.client()
    client.flushall()
    client.script_flush()
    client.close()
    return str(redis_session.url)


@pytest.fixture(scope="session")
def redis_cluster_session() -> Iterator[RedisCluster]:
    """A real three-master Redis Cluster, started once, on first use."""
    from redisutil import RedisCluster

    cluster = RedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture(params=["single", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Runs a test against the single server and against the three-master cluster."""
    if request.param == "single":
        return str(request.getfixturevalue("redis_url"))
    cluster = request.getfixturevalue("redis_cluster_session")
    cluster.flush()
    return str(cluster.url)


@pytest.fixture
def mount_tmpfs(tmp_short: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts small tmpfs filesystems for tests about full disks; skips where mounting is not allowed."""
    import subprocess

    mounted: list[Path] = []

    def mount(size: str) -> Path:
        point = tmp_short / f"fs{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in mounted:
            subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture(scope="module")
def hf_daemon() -> Iterator[DaemonProcess]:
    """One daemon (no Redis) for a transformers test module; each test keeps to its own namespace."""
    from daemonutil import DaemonProcess

    with temporary_dir("sk-hf-", "/tmp") as root:
        proc = DaemonProcess(root, "--redis-url", "none").start()
        try:
            yield proc
        finally:
            proc.cleanup()


@pytest.fixture(scope="module")
def built() -> Callable[[str], Any]:
    """Builds each test model of tests/hfmodels.py once per module."""
    import hfmodels

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = hfmodels.build(name)
        return cache[name]

    return get
