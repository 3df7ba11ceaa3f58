"""The embedded default: a private ``redis-server`` under the state directory, kept running.

With no ``--redis-url`` the daemon starts its own Redis on a unix socket in ``<state_dir>/redis`` with
the append-only file on (so the warm table survives restarts of either process), and stops it on exit.

Ownership: the state directory's owner lock (:func:`skippyd.files.take_owner_lock`) says whose server it
is. :meth:`EmbeddedRedis.start` runs only in the lock's holder (it takes the lock itself when the caller
does not hold it), so a redis-server left by an earlier run is stopped only once the lock proves that
run is gone; a second daemon pointed at a live daemon's state directory is refused before it touches
anything there.

Supervision: :meth:`EmbeddedRedis.supervise` watches the server from a thread; when it dies (killed,
OOM, crashed) it is started again after a pause that doubles with each quick death (0.5 s up to 10 s,
back to 0.5 s once a server has run a minute), and the callbacks tell the coordinator it went away and
came back (the coordinator buffers ``ran`` updates meanwhile and flushes them on reconnecting).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import socket as socketlib
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skippyd.config import embedded_redis_socket, embedded_redis_url
from skippyd.errors import ConfigError, SkippydError, StoreLocked
from skippyd.files import lock_holder, release_owner_lock, take_owner_lock
from skippyd.workers import Health

__all__ = ["EmbeddedRedis", "redis_server_binary"]

log = logging.getLogger("skippyd.redis")

THREAD = "skippyd-redis-supervisor"

INSTALL_HINT = (
    "redis-server is not installed: install it (Debian/Ubuntu: apt-get install redis-server), "
    "point skippyd at a shared Redis with --redis-url, or run without one with --redis-url none"
)

RESTART_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 10.0)  # seconds before each restart after a quick death
STABLE_AFTER_S = 60.0  # a server that ran this long died "for the first time" again: the pauses restart


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(INSTALL_HINT)
    return binary


class EmbeddedRedis:
    """Starts, supervises and stops one private redis-server; ``url`` is its ``unix://`` address."""

    def __init__(self, state_dir: Path, *, appendonly: bool = True) -> None:
        self.state_dir = Path(state_dir)
        self.socket = embedded_redis_socket(state_dir)
        self.dir = self.socket.parent
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._lock_fd: int | None = None  # the state directory's lock, when this object took it
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self.restarts = 0
        self.last_exit = ""  # how the last server that died went ("killed by SIGKILL")
        self.last_restart = 0.0  # monotonic time of the last restart (0: never)
        self.down_since = 0.0  # monotonic time the server died, while it is down (0: up)

    @property
    def url(self) -> str:
        return embedded_redis_url(self.dir.parent)

    @property
    def pidfile(self) -> Path:
        return self.dir / "redis.pid"

    def start(self, timeout: float = 15.0) -> str:
        """Starts the server (once the state directory's lock is this process's); returns its URL.

        :class:`~skippyd.errors.StoreLocked` when another live process holds the state directory. One
        object per state directory and process: a lock this process holds counts as this object's."""
        binary = redis_server_binary()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if lock_holder(self.state_dir) != os.getpid():
            self._lock_fd = take_owner_lock(self.state_dir, "state directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
            self._stop_orphan()
            self._spawn(binary, timeout)
        except BaseException:
            self._release()
            raise
        return self.url

    def supervise(
        self,
        *,
        on_down: Callable[[str], None] | None = None,
        on_up: Callable[[], None] | None = None,
        health: Health | None = None,
    ) -> None:
        """Restarts the server whenever it dies, until :meth:`stop`. ``on_down(cause)`` runs when it died,
        ``on_up()`` once a new one answers; ``health`` (a :class:`~skippyd.workers.Health`) watches the
        thread."""

        def run() -> None:
            self._supervise(on_down or _ignore, on_up or (lambda: None))

        if health is not None:
            self._thread = health.start(THREAD, run)
        else:
            self._thread = threading.Thread(target=run, name=THREAD, daemon=True)
            self._thread.start()

    def status(self) -> dict[str, Any]:
        """The server as ``stats`` reports it (``server_*`` fields of the Redis section)."""
        now = time.monotonic()
        with self._lock:
            proc, down_since, last_restart = self.proc, self.down_since, self.last_restart
        return {
            "embedded": True,
            "server_pid": proc.pid if proc is not None and not down_since else 0,
            "server_restarts": self.restarts,
            "server_last_exit": self.last_exit,
            "server_down_for_s": now - down_since if down_since else None,
            "server_last_restart_age_s": now - last_restart if last_restart else None,
        }

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping.set()
            proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # redis flushes the AOF on SIGTERM
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=timeout + 20)
        finally:
            self._release()

    # ----------------------------------------------------------------- inside
    def _spawn(self, binary: str, timeout: float) -> None:
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
        with self._lock:
            if self._stopping.is_set():
                raise SkippydError("the daemon is stopping")
            proc = self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, _prctl()),  # noqa: PLW1509
            )
        deadline = time.monotonic() + timeout
        while True:  # started means answering: it opens its socket before it has read its AOF
            answer = _ping(self.socket)
            if answer == "PONG":
                break
            if answer == "LOADING":  # reading a large append-only file: give it time
                deadline = max(deadline, time.monotonic() + 5)
            if proc.poll() is not None:
                tail = _tail(self.dir / "redis.log")
                raise SkippydError(f"the embedded redis-server exited at start: {tail}")
            if time.monotonic() > deadline:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()
                raise SkippydError("the embedded redis-server did not answer on its socket in time")
            time.sleep(0.02)
        self._started_at = time.monotonic()
        log.info("embedded redis-server (pid %d) on %s", proc.pid, self.socket)

    def _supervise(self, on_down: Callable[[str], None], on_up: Callable[[], None]) -> None:
        """The supervisor thread. It starts every replacement server itself, so the server's
        parent-death signal (``PR_SET_PDEATHSIG``, bound to the thread that forked it) stays tied to a
        thread that lives as long as supervision does."""
        quick_deaths = 0
        while not self._stopping.is_set():
            proc = self.proc
            if proc is None:
                return
            code = proc.wait()
            if self._stopping.is_set():
                return
            ran_for = time.monotonic() - self._started_at
            quick_deaths = 0 if ran_for >= STABLE_AFTER_S else quick_deaths
            cause = f"the embedded redis-server (pid {proc.pid}) {_how(code)}"
            with self._lock:
                self.last_exit = _how(code)
                self.down_since = time.monotonic()
            delay = RESTART_DELAYS[min(quick_deaths, len(RESTART_DELAYS) - 1)]
            log.error("%s; starting a new one in %.1fs (see %s)", cause, delay, self.dir / "redis.log")
            _tell("on_down", on_down, cause)
            while True:
                if self._stopping.wait(delay):
                    return
                quick_deaths += 1
                try:
                    self._spawn(redis_server_binary(), 15.0)
                    break
                except (SkippydError, OSError) as exc:  # no binary, no memory to fork: try again later
                    if self._stopping.is_set():
                        return
                    delay = RESTART_DELAYS[min(quick_deaths, len(RESTART_DELAYS) - 1)]
                    log.error("restarting the embedded redis-server failed: %s; next in %.1fs", exc, delay)
            with self._lock:
                self.restarts += 1
                self.last_restart = time.monotonic()
                self.down_since = 0.0
            log.warning("embedded redis-server restarted (restart %d)", self.restarts)
            _tell("on_up", on_up)

    def _stop_orphan(self) -> None:
        """A redis-server left by a daemon that was killed outright must not share our AOF.

        Only ever called by the holder of the state directory's lock: the lock proves whoever started
        that server is gone. The pid must still run redis-server on our socket (a pid can be reused)."""
        if lock_holder(self.state_dir) != os.getpid():  # never: start() holds it; refuse to guess
            raise StoreLocked(f"{self.state_dir} is not locked by this process")
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if b"redis-server" not in cmdline or not self._ours(pid, cmdline):
            return
        log.warning("stopping an embedded redis-server (pid %d) left by an earlier run", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.02)

    def _ours(self, pid: int, cmdline: bytes) -> bool:
        """Whether redis-server ``pid`` serves this directory: its title names our socket (Redis 7), or
        it works in our directory (it changes into ``--dir`` at start, in every version)."""
        if os.fsencode(str(self.socket)) in cmdline:
            return True
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd")) == self.dir.resolve()
        except OSError:
            return False

    def _release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            release_owner_lock(fd)


def _ignore(cause: str) -> None:
    pass


def _how(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _tell(what: str, callback: Callable[..., None], *args: str) -> None:
    """Runs a supervision callback; one that raises is logged in one line and supervision goes on (a dead
    supervisor thread would take its server with it: the parent-death signal is bound to that thread)."""
    try:
        callback(*args)
    except Exception as exc:
        log.error("the embedded redis-server's %s callback failed: %s: %s", what, type(exc).__name__, exc)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once in the parent: loading a library (dlopen) in the child of a threaded
    process can deadlock on the loader's lock, so the child only calls it."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent(prctl: Callable[..., int] | None) -> None:
    """In the child, before exec: get SIGTERM when the daemon dies, even by SIGKILL."""
    pr_set_pdeathsig = 1
    if prctl is not None:
        with contextlib.suppress(Exception):
            prctl(pr_set_pdeathsig, signal.SIGTERM)


def _ping(path: Path) -> str:
    """``PONG``, ``LOADING`` or ``""`` (no answer yet): one PING over the unix socket, without redis-py
    (only :mod:`skippyd.cluster.coordination` speaks Redis's client protocol for real)."""
    try:
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(os.fspath(path))
            conn.sendall(b"PING\r\n")
            reply = conn.recv(256)
    except OSError:
        return ""
    if reply.startswith(b"+PONG"):
        return "PONG"
    return "LOADING" if reply.startswith(b"-LOADING") else ""


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
