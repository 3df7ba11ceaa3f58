"""The embedded default: a private ``redis-server`` under the state directory.

With no ``--redis-url`` the daemon starts its own Redis on a unix socket in ``<state_dir>/redis`` with
the append-only file on (so the warm table survives restarts of either process), and stops it on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .config import embedded_redis_socket, embedded_redis_url
from .errors import ConfigError, SkippydError

__all__ = ["EmbeddedRedis", "redis_server_binary"]

log = logging.getLogger("skippyd.redis")

INSTALL_HINT = (
    "redis-server is not installed: install it (Debian/Ubuntu: apt-get install redis-server), "
    "point skippyd at a shared Redis with --redis-url, or run without one with --redis-url none"
)


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(INSTALL_HINT)
    return binary


class EmbeddedRedis:
    """Starts and stops one private redis-server; ``url`` is its ``unix://`` address."""

    def __init__(self, state_dir: Path, *, appendonly: bool = True) -> None:
        self.socket = embedded_redis_socket(state_dir)
        self.dir = self.socket.parent
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return embedded_redis_url(self.dir.parent)

    @property
    def pidfile(self) -> Path:
        return self.dir / "redis.pid"

    def start(self, timeout: float = 15.0) -> str:
        binary = redis_server_binary()
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self._stop_orphan()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        args = [
            binary,
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "600",
            "--dir", str(self.dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            "--pidfile", str(self.pidfile),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None:
                tail = _tail(self.dir / "redis.log")
                raise SkippydError(f"the embedded redis-server exited at start: {tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise SkippydError("the embedded redis-server did not open its socket in time")
            time.sleep(0.02)
        log.info("embedded redis-server (pid %d) on %s", self.proc.pid, self.socket)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # redis flushes the AOF on SIGTERM
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _stop_orphan(self) -> None:
        """A redis-server left by a daemon that was killed outright must not share our AOF."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if b"redis-server" not in cmdline:
            return
        log.warning("stopping an embedded redis-server (pid %d) left by an earlier run", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.02)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the daemon dies, even by SIGKILL."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
