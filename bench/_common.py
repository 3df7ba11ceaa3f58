"""Shared bench plumbing: timing, a private redis-server, machine facts and the docs table writer."""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skippyd.cluster.redis_embedded import EmbeddedRedis
from skippyd.keys import Identity
from skippyd.l2 import L2Tier, copy_into
from skippyd.payload import Entry, TensorDecl

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


def admit(tier: L2Tier, key: str, identity: Identity, decls: list[TensorDecl], data: list[Any]) -> Entry:
    """What a capture does to L2 (reserve, copy each tensor in, hash and commit), without the socket."""
    with tier.reserve(key=key, identity=identity, token_count=1, tensors=decls) as reservation:
        for spec, source in zip(reservation.tensors, data, strict=True):
            copy_into(reservation.data, spec.offset, spec.nbytes, source, threads=2)
        return reservation.commit()


@contextlib.contextmanager
def borrow(tier: L2Tier, key: str) -> Iterator[tuple[Entry, memoryview]]:
    """A leased read-only view of an entry's data region for the duration of the block."""
    held = tier.hold(key, hit=False)
    assert held is not None
    try:
        mapping = mmap.mmap(held.fd, held.data_offset + held.entry.data_len, prot=mmap.PROT_READ)
    finally:
        os.close(held.fd)
    view = memoryview(mapping)[held.data_offset :]
    try:
        yield held.entry, view
    finally:
        view.release()
        mapping.close()


def timed(fn: Callable[[], object], *, reps: int, setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call for ``reps`` calls (after one warm-up), ``setup`` run untimed before each."""
    if setup is not None:
        setup()
    fn()
    samples = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def percentile(samples: list[float], pct: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    return (
        f"{cpu}, {os.cpu_count()} CPUs{mem}, Linux {platform.release()}, Python {platform.python_version()}"
    )


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private, persistence-free redis-server on a unix socket (the daemon's own embedded Redis, AOF
    off); yields its unix:// URL."""
    workdir = Path(tempfile.mkdtemp(prefix="skb-", dir="/tmp"))
    server = EmbeddedRedis(workdir, appendonly=False)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def write_section(name: str, text: str) -> None:
    """Replaces the ``<!-- bench:name -->`` section of docs/benchmarks.md with ``text``."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    current = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    updated = (
        pattern.sub(lambda _m: block, current)
        if pattern.search(current)
        else current.rstrip() + "\n\n" + block + "\n"
    )
    DOCS.write_text(updated)


class BenchDaemon:
    """A private ``skippyd serve`` in ``workdir`` with its own tmpfs directory (no Redis unless given)."""

    def __init__(self, workdir: Path, *args: str, budget: str = "2GiB", redis_url: str = "none") -> None:
        self.socket = workdir / "d.sock"
        self.shm = Path(tempfile.mkdtemp(prefix="skippyd-bench-", dir="/dev/shm"))
        self.args = [
            "--socket", str(self.socket), "--state-dir", str(workdir / "state"), "--shm-dir", str(self.shm),
            "--l2-budget", budget, "--redis-url", redis_url, "--log-level", "warning", *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BenchDaemon:
        import skippyd

        python = os.environ.get("SKIPPYD_DAEMON_PYTHON", sys.executable)  # vLLM's venv runs .venv's daemon
        self.proc = subprocess.Popen([python, "-m", "skippyd", "serve", *self.args])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.socket.exists() and skippyd.Client(self.socket, timeout=2).ping():
                return self
            time.sleep(0.05)
        raise RuntimeError("the daemon did not start")

    def stop(self, *, wipe_tmpfs: bool = False) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
            self.proc = None
        if wipe_tmpfs:
            shutil.rmtree(self.shm)
            self.shm.mkdir()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.shm, ignore_errors=True)


def alternate(module: str, before: str, args: list[str], runs: int = 5) -> dict[str, list[str]]:
    """Runs ``python -m bench.<module> --one *args`` from the checkout ``before`` and from this one, one
    after the other, ``runs`` times each; the last line each printed, by ``before``/``after``. (The other
    checkout needs its own copy of the module, and its C extension built in place.)"""
    here = str(Path(__file__).resolve().parents[1])
    out: dict[str, list[str]] = {"before": [], "after": []}
    for _ in range(runs):
        for name, tree in (("before", before), ("after", here)):
            done = subprocess.run(
                [sys.executable, "-m", f"bench.{module}", "--one", *args],
                cwd=tree, env={**os.environ, "PYTHONPATH": tree}, check=True, capture_output=True, text=True,
            )  # fmt: skip
            out[name].append(done.stdout.strip().splitlines()[-1])
    return out
