"""Fixtures for the vLLM tier tests: real vLLM 0.33 classes (in their own virtual environment), a real
``skippyd serve`` (run by the main environment's interpreter, ``SKIPPYD_DAEMON_PYTHON``) and real
Redis. scripts/test.sh builds the environment and runs this directory with it."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # daemonutil, redisutil

try:  # these tests run only in vLLM's environment (scripts/test.sh): without vLLM they fail, never skip
    import vllm  # noqa: F401
except ImportError as exc:
    raise pytest.UsageError(f"tests_vllm/ runs in vLLM's environment (scripts/vllm-env.sh): {exc}") from exc

from daemonutil import DaemonProcess
from redisutil import RedisServer

from bench._vllm import Engine, make_spec

__all__ = ["TIER", "Engine", "make_spec", "tier_cfg"]

TIER = {"type": "SkippydTier", "module_path": "skippyd.integrations.vllm"}


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="skv-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_daemon(tmp_short: Path) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(*args: str) -> DaemonProcess:
        where = tmp_short / f"d{len(made)}"
        where.mkdir()
        proc = DaemonProcess(where, "--redis-url", "none", *args)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.cleanup()


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


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(tier_cfg: dict[str, Any], **spec_args: Any) -> Engine:
        engine = Engine(tier_cfg, **spec_args)
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.close()


def tier_cfg(daemon: DaemonProcess, **options: Any) -> dict[str, Any]:
    return {**TIER, "socket": str(daemon.socket), **options}


os.environ.setdefault("HF_HUB_OFFLINE", "1")
