"""The daemon fixtures every test suite uses (tests/, tests_vllm/ and tests_sglang/ import them into their
conftest): a short temporary directory and a factory of real ``skippyd serve`` processes in it (the engine
suites add :mod:`engine_fixtures`)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProcess

__all__ = ["daemon_defaults", "make_daemon", "temporary_dir", "tmp_short"]


@contextlib.contextmanager
def temporary_dir(prefix: str, under: str) -> Iterator[Path]:
    """A fresh directory under ``under``, removed with everything in it afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=under))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    """A short temporary directory (unix socket paths must stay under 108 bytes)."""
    with temporary_dir("sk-", "/tmp") as path:
        yield path


@pytest.fixture
def daemon_defaults() -> tuple[str, ...]:
    """Arguments every daemon of :func:`make_daemon` starts with, before its own (a suite may override)."""
    return ()


@pytest.fixture
def make_daemon(tmp_short: Path, daemon_defaults: tuple[str, ...]) -> Iterator[Callable[..., DaemonProcess]]:
    """Builds (not starts) daemons with extra arguments; all are stopped and cleaned afterwards."""
    made: list[DaemonProcess] = []

    def make(*args: str, root: Path | None = None, **kwargs: Any) -> DaemonProcess:
        where = root or tmp_short / f"d{len(made)}"
        where.mkdir(parents=True, exist_ok=True)
        proc = DaemonProcess(where, *daemon_defaults, *args, **kwargs)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.cleanup()
