"""Real redis-server processes for tests: a single server on a short unix socket, and a cluster."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class RedisServer:
    """One redis-server on a unix socket; persistence only when asked for (``appendonly``)."""

    def __init__(self, *, appendonly: bool = False, directory: Path | None = None) -> None:
        self.dir = directory or Path(tempfile.mkdtemp(prefix="skr-", dir="/tmp"))
        self.socket = self.dir / "r.sock"
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> RedisServer:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
             "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.socket.exists():
                try:
                    redis.Redis(unix_socket_path=str(self.socket)).ping()
                    return self
                except redis.exceptions.ConnectionError:
                    pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # redis flushes its AOF on SIGTERM
            self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisCluster:
    """Three masters, no replicas, created with ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="skc-", dir="/tmp"))
        self.ports = [_free_port() for _ in range(masters)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> RedisCluster:
        for port in self.ports:
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            self.procs.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "5000",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(node_dir),
                        "--logfile",
                        str(node_dir / "redis.log"),
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
        for port in self.ports:
            _wait_ping(port)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        create = ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [redis.Redis(port=p).cluster("info") for p in self.ports]
            if all(s.get("cluster_state") == "ok" for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not become ready")

    def flush(self) -> None:
        for port in self.ports:
            redis.Redis(port=port).flushall()

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait_ping(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            redis.Redis(port=port).ping()
            return
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError(f"redis on port {port} did not start")
