"""`skippyd serve` start-up: paths, validation before any I/O, and when the node is announced."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemonutil import TEST_SHM, DaemonProcess, eventually

import skippyd
from skippyd.cluster.coordination import WarmTable


def _serve(
    args: list[str], *, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skippyd", "serve", *args],
        cwd=cwd,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _fill_l2(daemon: DaemonProcess, entries: int, nbytes: int) -> None:
    """Leaves ``entries`` entries on the daemon's tmpfs: the next start verifies them (takes a while)."""
    daemon.start()
    with daemon.client() as client:
        for i in range(entries):
            client.capture(model="m", state="s", tokens=[i], tensors={"x": torch.full((nbytes,), i % 250,
                           dtype=torch.uint8)}, durable=False)  # fmt: skip
    daemon.stop()


def test_serve_runs_the_embedded_default_from_a_relative_state_dir(tmp_short: Path) -> None:
    shm = Path(TEST_SHM) / f"skippyd-rel-{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippyd", "serve", "--state-dir", "relstate", "--socket", "s.sock",
         "--shm-dir", str(shm), "--l2-budget", "64MiB", "--node", "rel"],
        cwd=tmp_short, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert eventually(lambda: (tmp_short / "s.sock").exists() or proc.poll() is not None)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        with skippyd.Client(tmp_short / "s.sock") as client:
            stats = client.stats()
            assert stats["redis"]["configured"] and not stats["redis"]["degraded"]
        assert (tmp_short / "relstate" / "redis" / "redis.sock").exists()
        from click.testing import CliRunner

        from skippyd.cli import main

        old = Path.cwd()
        os.chdir(tmp_short)
        try:
            result = CliRunner().invoke(
                main, ["doctor", "--state-dir", "relstate", "--socket", "s.sock", "--shm-dir", str(shm)]
            )
        finally:
            os.chdir(old)
        assert f"unix://{tmp_short}/relstate/redis/redis.sock" in result.stdout, result.stdout
        assert "not reachable" not in result.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run(["rm", "-rf", str(shm)], check=False)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--metrics-addr", "banana"], "invalid metrics_addr"),
        (["--l2-budget", "10"], "smaller than one entry"),
    ],
)
def test_bad_values_are_refused_before_the_tiers_are_touched(
    make_daemon: Any, args: list[str], needle: str
) -> None:
    daemon = make_daemon()
    _fill_l2(daemon, 8, 1 << 20)
    started = time.monotonic()
    done = _serve([*daemon.args, *args])
    assert done.returncode == 2 and needle in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert time.monotonic() - started < 20
    assert "adopted" not in done.stderr and "L3 at" not in done.stderr, "refused before any tier started"
    assert len(list((daemon.shm_dir / "entries").iterdir())) == 8, "the tmpfs was left as it was"


def test_a_metrics_port_in_use_fails_the_start_before_the_tiers_are_touched(make_daemon: Any) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        daemon = make_daemon()
        done = _serve([*daemon.args, "--metrics-addr", f"127.0.0.1:{taken.getsockname()[1]}"])
        assert done.returncode == 2 and "cannot listen" in done.stderr
        assert "adopted" not in done.stderr and "Traceback" not in done.stderr
    finally:
        taken.close()


def test_a_second_daemon_on_a_live_socket_is_refused_at_once(daemon: DaemonProcess, make_daemon: Any) -> None:
    other = make_daemon()
    args = [*other.args, "--socket", str(daemon.socket)]
    done = _serve(args, timeout=20)
    assert done.returncode == 1 and "a live daemon answers" in done.stderr
    assert "adopted" not in done.stderr


def test_an_l2_budget_larger_than_the_tmpfs_is_a_warning_in_the_log(make_daemon: Any) -> None:
    vfs = os.statvfs(TEST_SHM)
    too_big = vfs.f_blocks * vfs.f_frsize * 2
    daemon = make_daemon(budget=str(too_big)).start()
    assert "is larger than the filesystem" in daemon.log_text()


def test_the_node_is_announced_only_once_its_socket_serves(make_daemon: Any, redis_url: str) -> None:
    daemon = make_daemon("--redis-url", redis_url)
    _fill_l2(daemon, 24, 8 << 20)  # 192 MiB to verify at the next start
    table = WarmTable.from_url(redis_url)
    table.forget("test-node")
    daemon.start(wait=False)
    announced_before_serving = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        registered = any(n.node == "test-node" for n in table.nodes())
        serving = daemon.socket.exists()
        if registered and not serving:
            announced_before_serving += 1
        if registered:
            break
        time.sleep(0.005)
    assert registered, "the node was never announced"
    assert announced_before_serving == 0
    daemon.wait_ready()
    with daemon.client() as client:
        assert client.stats()["l2"]["adopted"] == 24
