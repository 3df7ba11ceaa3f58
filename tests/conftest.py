"""Shared fixtures: real tmpfs directories, real files, and (in later modules) real Redis servers."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="skippyd-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    """A short temporary directory (unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="sk-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
