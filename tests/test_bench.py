"""The benches the team runs in one prepared try on the GPU machine still run: ``bench.gpu --dry`` (tiny
sizes, on the CPU, through the simulated transfer: skippyd.client.transfer.sim) goes through every
section, its bit-exact checks hold, its copies went through the transfer layer, and it prints its table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_the_gpu_bench_dry_run_passes_every_exact_check_and_prints_one_table() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SKIPPYD_SOCKET"}  # (its own daemon)
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--dry", "--watchdog", "0"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    exact = [line for line in table if line.startswith("| exact ")]
    assert len(exact) >= 4 and all("| True " in line or "| all equal " in line for line in exact), exact
    for section in ("restore", "get_into", "put", "ttft"):
        assert any(line.startswith(f"| {section} ") for line in table), f"no {section} rows"
    assert "FAILED" not in done.stdout
    (moved,) = [line for line in table if "copies / calls (batch still in use)" in line]
    copies, calls = (int(x) for x in moved.split("|")[3].split("/"))
    assert copies > 100 and calls > 10 and "| True " in moved, moved  # the dry run's copies, batched


@pytest.mark.timeout(180)
def test_an_interrupted_gpu_bench_still_prints_the_rows_it_has() -> None:
    """A time limit's SIGINT (bench/gpu_check.sh) ends the run with a table of what was measured and a row
    saying it was interrupted, not a traceback and nothing."""
    env = {k: v for k, v in os.environ.items() if k != "SKIPPYD_SOCKET"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu", "--dry", "--watchdog", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # (its first row: the run is inside the part that handles SIGINT)
        seen.append(line)
        if line.startswith("  exact"):
            proc.send_signal(signal.SIGINT)
            break
    out, _ = proc.communicate(timeout=60)
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert proc.returncode == 1, "".join(seen) + out
    assert any(line.startswith("| bench ") and "INTERRUPTED" in line for line in table), out
    assert any(line.startswith("| exact ") for line in table), out


@pytest.mark.timeout(120)
def test_the_stalls_bench_runs_every_scenario_and_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.stalls", "--scale", "0.05"],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "this tree" in line]
    assert len(rows) == 4, done.stdout
