"""Fixtures for the SGLang HiCache storage tests: real SGLang 0.5.23 classes (in their own virtual
environment), a real ``skippyd serve`` (run by the main environment's interpreter,
``SKIPPYD_DAEMON_PYTHON``) and real Redis. scripts/test.sh builds the environment and runs this directory
with it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # daemonutil, redisutil

try:  # these tests run only in SGLang's environment (scripts/test.sh): without SGLang they fail, never skip
    import sglang  # noqa: F401
except ImportError as exc:
    raise pytest.UsageError(
        f"tests_sglang/ runs in SGLang's environment (scripts/sglang-env.sh): {exc}"
    ) from exc

from daemon_fixtures import make_daemon, tmp_short
from daemonutil import DaemonProcess
from engine_fixtures import daemon, daemon_defaults, redis_url

from bench._sglang import make_backend, make_pool

__all__ = ["daemon", "daemon_defaults", "make_daemon", "redis_url", "tmp_short"]


@pytest.fixture
def backends() -> Iterator[Callable[..., Any]]:
    """Builds SkippydStorage backends the way SGLang's cache controller does (factory, then the host
    pool registered); closed afterwards."""
    made: list[Any] = []

    def make(pool: Any, daemon: DaemonProcess, **options: Any) -> Any:
        config = options.pop("config", {})
        backend = make_backend(pool, {"socket": str(daemon.socket), **options}, **config)
        made.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in made:
            backend.close()


@pytest.fixture
def pool() -> Any:
    return make_pool("page_first")
