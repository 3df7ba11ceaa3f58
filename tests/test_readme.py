"""The README, tried as a new user would: `scripts/run.sh`, then its "Try it" lines, verbatim.

The daemon is started by the real `scripts/run.sh` (its state directory pointed into a scratch
"checkout" that links this checkout's `.venv` and `examples/`), and every line of the README's "Try it"
block runs there through bash, with no `SKIPPYD_*` variable and no extra flag: the commands must find
the daemon on their own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import eventually

import skippyd

ROOT = Path(__file__).resolve().parent.parent


def try_it_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Try it") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the README has a Try it block"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture
def checkout(tmp_short: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A scratch checkout with the daemon that `scripts/run.sh` starts for it."""
    for name in (".venv", "examples"):
        (tmp_short / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPYD_")}
    env["SKIPPYD_STATE_DIR"] = str(tmp_short / ".skippyd")
    log = (tmp_short / "run.log").open("wb")
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "run.sh"), "--l2-budget", "256MiB"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    shm: str | None = None
    try:
        sock = tmp_short / ".skippyd" / "skippyd.sock"
        started = eventually(
            lambda: (tmp_short / ".skippyd" / "daemon.json").exists() or proc.poll() is not None, timeout=120
        )
        assert started, (tmp_short / "run.log").read_text()
        assert proc.poll() is None, (tmp_short / "run.log").read_text()
        with skippyd.Client(sock) as client:
            shm = client.config()["derived"]["shm_dir"]
        yield tmp_short, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)


def test_run_sh_says_how_to_reach_the_daemon(checkout: tuple[Path, subprocess.Popen[bytes]]) -> None:
    root, _ = checkout
    printed = (root / "run.log").read_text()
    assert ".venv/bin/skippyd status" in printed and "SKIPPYD_SOCKET=" in printed


def test_the_readme_command_lines_work_verbatim_after_run_sh(
    checkout: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    root, _ = checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPYD_")}
    outputs: dict[str, str] = {}
    for line in try_it_lines():
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", line], cwd=root, env=env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        assert "Traceback" not in done.stdout + done.stderr, line
        outputs[line] = done.stdout
    status = next(out for line, out in outputs.items() if line.endswith("skippyd status"))
    assert status.startswith("skippyd 0.1.0 on ") and str(root / ".skippyd" / "skippyd.sock") in status
    warmest = next(out for line, out in outputs.items() if "warm warmest" in line)
    with skippyd.Client(root / ".skippyd" / "skippyd.sock") as client:
        node = client.health()["node"]
    assert warmest.split() == [node, "960"], "the quickstart's capture fed the warm table"
    shown = next(out for line, out in outputs.items() if line.endswith("config show"))
    assert "# the daemon on" in shown and "256.0 MiB" in shown, "config show reads the running daemon's"
    budget = next(line for line in shown.splitlines() if line.startswith("l2_budget"))
    assert budget.endswith("# daemon: flag"), "and says where each of its settings came from"
    listing = next(out for line, out in outputs.items() if line.endswith("skippyd ls"))
    assert len(listing.splitlines()) == 2, listing


def test_a_python_program_next_to_a_clone_named_skippyd_imports_the_package(tmp_short: Path) -> None:
    clone = tmp_short / "skippyd"
    clone.mkdir()
    (clone / "README.md").write_text("a checkout of skippyd\n")
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-c", "import skippyd; print(skippyd.Client.__name__)"],
        cwd=tmp_short, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "Client", done.stderr
