"""Fixtures for the vLLM tier tests: real vLLM 0.33 classes (in their own virtual environment), a real
``skippyd serve`` (run by the main environment's interpreter, ``SKIPPYD_DAEMON_PYTHON``) and real
Redis. scripts/test.sh builds the environment and runs this directory with it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # daemonutil, redisutil

try:  # these tests run only in vLLM's environment (scripts/test.sh): without vLLM they fail, never skip
    import vllm  # noqa: F401
except ImportError as exc:
    raise pytest.UsageError(f"tests_vllm/ runs in vLLM's environment (scripts/vllm-env.sh): {exc}") from exc

from daemon_fixtures import make_daemon, tmp_short
from daemonutil import DaemonProcess
from engine_fixtures import daemon, daemon_defaults, redis_url

from bench._vllm import Engine, make_spec

__all__ = [
    "TIER", "Engine", "daemon", "daemon_defaults", "make_daemon", "make_spec", "redis_url", "tier_cfg",
    "tmp_short",
]  # fmt: skip

TIER = {"type": "SkippydTier", "module_path": "skippyd.integrations.vllm"}


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
