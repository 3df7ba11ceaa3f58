"""A real ``skippyd serve`` process in a temporary directory, for behaviour tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import skippyd

#: The tmpfs the tests' L2 directories go on: /dev/shm, or SKIPPYD_TEST_SHM (another tmpfs, where /dev/shm
#: is a container's small default, as on the GPU machine).
TEST_SHM = os.environ.get("SKIPPYD_TEST_SHM", "/dev/shm")


class DaemonProcess:
    def __init__(
        self, root: Path, *args: str, env: dict[str, str] | None = None, budget: str = "256MiB"
    ) -> None:
        self.root = root
        self.socket = root / "d.sock"
        self.state_dir = root / "state"
        self.shm_dir = Path(tempfile.mkdtemp(prefix="skippyd-test-l2-", dir=TEST_SHM))
        self.args = [
            "--socket", str(self.socket),
            "--state-dir", str(self.state_dir),
            "--shm-dir", str(self.shm_dir),
            "--l2-budget", budget,
            "--node", "test-node",
            "--l3-min-free", "64MiB",
            *args,
        ]  # fmt: skip
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"

    def start(self, *, wait: bool = True, timeout: float = 30.0) -> DaemonProcess:
        handle = self.log.open("ab")
        self.proc = subprocess.Popen(
            [os.environ.get("SKIPPYD_DAEMON_PYTHON", sys.executable), "-m", "skippyd", "serve", *self.args],
            env=self.env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        handle.close()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if self.socket.exists():
                with skippyd.Client(self.socket, timeout=2.0, connect_timeout=1.0) as client:
                    if client.ping():
                        return
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not become ready:\n{self.log_text()}")

    def client(self, **kwargs: float) -> skippyd.Client:
        return skippyd.Client(self.socket, **kwargs)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def send(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        pidfile = self.state_dir / "redis" / "redis.pid"
        if pidfile.exists():  # normally gone with the daemon; be sure no test leaks a server
            with contextlib.suppress(ValueError, ProcessLookupError, OSError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Polls ``check`` until it returns something truthy (returned) or ``timeout`` passes (last result)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)
