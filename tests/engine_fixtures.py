"""Fixtures the engine suites share (tests_vllm/ and tests_sglang/ import them into their conftest, beside
:mod:`daemon_fixtures`): daemons without Redis unless a test starts one, one started daemon, and a real
redis-server for the tests of second-hit admission."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from daemonutil import DaemonProcess
from redisutil import RedisServer

__all__ = ["daemon", "daemon_defaults", "redis_url"]


@pytest.fixture
def daemon_defaults() -> tuple[str, ...]:
    return ("--redis-url", "none")  # no Redis unless a test starts one


@pytest.fixture
def daemon(make_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return make_daemon().start()


@pytest.fixture
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()
