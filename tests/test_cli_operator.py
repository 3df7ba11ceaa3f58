"""What an operator meets at the command line (issue 21): wrong input is one clear line, every command
finds the checkout's store, every view reads L2's usage the same way, a clean stop gives the reserve
back, and the smaller promises of ``config show``, ``stats``, ``ls``, ``evict``, ``fsck`` and ``warm``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from daemonutil import DaemonProcess, eventually

import skippyd
from skippyd.cli import main
from skippyd.config import FIELDS, human_size, parse_size

BLOCK, BLOCK_BYTES = 16, 64 << 10


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def fill(client: skippyd.Client, *, blocks: int = 8) -> None:
    """One 1 MiB entry and ``blocks`` blocks of 64 KiB."""
    client.capture(model="m", state="s", tokens=[1, 2, 3], tensors={"x": torch.ones(1 << 18)}, durable=False)
    space = client.blocks(model="m", state="kv", namespace="", block_tokens=BLOCK)
    keys = space.keys(list(range(blocks * BLOCK)))
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen) for _ in keys]
    space.put(keys, data, durable=False)


def settled(client: skippyd.Client, reserve_at_least: int) -> dict[str, Any]:
    """L2's counters once the reserve has filled to at least ``reserve_at_least`` and stopped moving."""

    def steady() -> dict[str, Any] | None:
        first = client.stats()["l2"]
        time.sleep(0.3)
        second = client.stats()["l2"]
        ok = first == second and second["reserve_bytes"] >= reserve_at_least
        return second if ok else None

    stats = eventually(steady, timeout=20)
    assert stats, client.stats()["l2"]
    return dict(stats)


def shm_bytes(directory: Path) -> int:
    """The memory the files under ``directory`` hold (allocated pages, not their apparent size)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- 2: top's interval


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "inf"])
def test_top_refuses_an_interval_that_is_not_a_positive_number_of_seconds_in_one_usage_error(
    interval: str, tmp_short: Path
) -> None:
    code, out, err = run("top", "--interval", interval, "--socket", str(tmp_short / "none.sock"))
    assert code == 2 and out == ""
    assert "Invalid value for '--interval'" in err and "at least 0.1" in err
    assert "Traceback" not in err and "sleep length" not in err


# ----------------------------------------------------------------------------- 4 and 10: sizes refused


@pytest.mark.parametrize(
    ("args", "says", "never"),
    [
        (["--l2-budget", "0"], "give a size such as 4GiB", "0GiB"),
        (["--l2-budget", "1KiB"], "give a size such as 4GiB", "1024GiB"),
        (["--l2-budget", "8"], "did you mean 8GiB?", "such as"),
        (["--staging-budget", "0"], "give a size such as 2GiB", "0GiB"),
        (["--l3-budget", "100"], "did you mean 100GiB?", "such as"),
    ],
)
def test_a_budget_too_small_for_one_entry_gets_a_hint_that_makes_sense(
    args: list[str], says: str, never: str, tmp_short: Path
) -> None:
    code, out, err = run("serve", "--state-dir", str(tmp_short / "st"), *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("skippyd: error: invalid ") and says in err and never not in err


def test_serve_refuses_an_entry_limit_the_l2_budget_could_never_hold(tmp_short: Path) -> None:
    state = tmp_short / "st"
    code, out, err = run("serve", "--state-dir", str(state), "--max-entry", "8GiB", "--l2-budget", "1GiB")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "invalid max_entry: 8.0 GiB is larger than the L2 budget (1.0 GiB)" in err
    assert not state.exists(), "refused before anything was touched"
    assert run("serve", "--state-dir", str(state), "--max-entry", "1GiB", "--l2-budget", "1KiB")[0] == 2


def test_serve_refuses_one_directory_for_l2_and_l3(tmp_short: Path) -> None:
    state, shared = tmp_short / "st", tmp_short / "both"
    args = ("--state-dir", str(state), "--shm-dir", str(shared), "--l3-dir", str(shared))
    code, out, err = run("serve", *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"invalid l3_dir: {shared} is the L2 directory too" in err
    assert not state.exists() and not shared.exists(), "refused before anything was touched"


# ----------------------------------------------------------------------------- 5: fsck in a checkout


def test_l3_fsck_in_a_checkout_checks_the_store_of_its_dot_skippyd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd.l3 import L3Store

    checkout = tmp_path / "clone"
    store = checkout / ".skippyd" / "l3"
    with L3Store.open(store, 1 << 30):
        pass
    (checkout / "docs").mkdir()
    monkeypatch.chdir(checkout / "docs")  # anywhere in the checkout, like every other command
    unset = {"SKIPPYD_STATE_DIR": "", "SKIPPYD_L3_DIR": "", "SKIPPYD_CONFIG": ""}
    code, out, err = run("l3", "fsck", env=unset)
    assert code == 0, (out, err)
    assert out.startswith(f"{store}: 0 entries") and "/var/lib/skippyd" not in out + err
    assert str(checkout / ".skippyd") in err
    code, out, _ = run("l3", "fsck", "--l3-dir", str(tmp_path / "elsewhere"), env=unset)
    assert code == 2, "a directory given explicitly still wins"


# ----------------------------------------------------------------------------- 6: one reading of L2 usage


def test_l2_used_and_reserve_read_the_same_in_status_top_stats_metrics_and_doctor(make_daemon: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # a window that outlasts the test: the reserve must not decay between the five readings
    args = ("--l2-reserve", "4MiB", "--l2-reserve-window", "120s", "--metrics-addr", f"127.0.0.1:{port}")
    proc = make_daemon(*args, budget="64MiB").start()
    with proc.client() as client:
        fill(client)
        l2 = settled(client, reserve_at_least=1 << 20)
    used, reserve = l2["used_bytes"], l2["reserve_bytes"]
    assert used == l2["bytes"] + l2["block_bytes"] and used >= (1 << 20) + 8 * BLOCK_BYTES
    assert reserve == l2["free_bytes"] + l2["block_free_bytes"] > 0
    sock = str(proc.socket)

    _, status, _ = run("status", "--socket", sock)
    line = next(x for x in status.splitlines() if x.strip().startswith("L2"))
    assert "1 entry, 8 blocks" in line
    assert f"{human_size(used)} used of 64.0 MiB (+ {human_size(reserve)} pre-faulted reserve)" in line

    _, top, _ = run("top", "--once", "--socket", sock, env={"COLUMNS": "80"})
    row = next(x for x in top.splitlines() if x.startswith("L2"))
    assert human_size(used) in row and f"+{human_size(reserve)} reserve" in row and "free" not in row

    _, stats, _ = run("stats", "--socket", sock)
    assert re.search(rf"^  used_bytes +{used} ", stats, re.M) and re.search(
        rf"^  reserve_bytes +{reserve} ", stats, re.M
    )

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def metric(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        assert found is not None, name
        return float(found.group(1))

    assert (metric("skippyd_l2_used_bytes"), metric("skippyd_l2_reserve_bytes")) == (used, reserve)

    _, doctor, _ = run("doctor", *proc.args)
    assert any(
        f"{human_size(used)} used of 64.0 MiB (+ {human_size(reserve)} pre-faulted reserve)" in x
        for x in doctor.splitlines()
    ), doctor


# ----------------------------------------------------------------------------- 7: a clean stop


def test_a_clean_stop_gives_the_reserve_back_and_keeps_the_cached_data(make_daemon: Any) -> None:
    # the reserve keeps ready what puts took within its window (64 blocks: 4 MiB), up to l2_reserve; a
    # long window, so that it does not decay while the test reads it
    args = ("--l2-reserve", "8MiB", "--l2-reserve-window", "120s", "--l3-dir", "off", "--redis-url", "none")
    proc = make_daemon(*args, budget="64MiB")
    proc.start()
    with proc.client() as client:
        fill(client, blocks=64)
        l2 = settled(client, reserve_at_least=4 << 20)
    held = shm_bytes(proc.shm_dir)
    assert held >= l2["used_bytes"] + (4 << 20), "the reserve's pages are faulted in while it runs"
    assert proc.stop(signal.SIGINT) == 0  # Ctrl-C
    after = shm_bytes(proc.shm_dir)
    slack = 1 << 20  # slab headers and records, directory metadata
    assert l2["used_bytes"] <= after <= l2["used_bytes"] + slack, (after, l2)
    proc.start()
    with proc.client() as client:
        again = client.stats()["l2"]
        assert (again["entries"], again["block_count"]) == (1, 64), "the data survived the restart"
        assert again["used_bytes"] == l2["used_bytes"]
        hit = client.restore(model="m", state="s", tokens=[1, 2, 3])
        assert hit is not None and torch.equal(hit.tensors["x"], torch.ones(1 << 18))
    proc.stop()
    log = proc.log_text()
    assert "1 entry adopted (0 dropped), 64 blocks adopted (0 dropped)" in log, log
    assert "1 entries" not in log


# ----------------------------------------------------------------------------- 9: top into a pipe


def test_top_prints_one_view_after_another_when_its_output_is_piped(daemon: DaemonProcess) -> None:
    # (-X faulthandler: a top that does not stop is made to say where it was, below)
    args = [sys.executable, "-X", "faulthandler", "-m", "skippyd", "top", "--interval", "0.2",
            "--socket", str(daemon.socket)]  # fmt: skip
    # top gets Ctrl-C's default whatever this process inherited (a run started in the background by a
    # shell without job control ignores SIGINT, and so would its children): a handled signal is reset
    # at exec, an ignored one is not
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        assert proc.stdout is not None
        headers = 0
        deadline = time.monotonic() + 30
        seen: list[str] = []
        while headers < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            headers += line.startswith("skippyd 0.1.0  node test-node")
        assert headers == 3, "".join(seen)
        assert any(line.startswith("L2") for line in seen)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # (faulthandler prints every thread's stack)
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"top did not stop within 10 s of SIGINT; where it was:\n{err[-6000:]}")
    assert proc.returncode == 0 and "Traceback" not in err
    head = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # `skippyd top | head -1`
    assert head.stdout is not None and head.stdout.readline().startswith(b"skippyd 0.1.0")
    head.stdout.close()
    _, head_err = head.communicate(timeout=10)
    assert head.returncode == 0 and head_err == b"", "the reader left: top stops quietly"


# ----------------------------------------------------------------------------- 10: the smaller ones


def test_config_show_prints_every_size_in_bytes_and_in_units(tmp_short: Path) -> None:
    code, out, _ = run("config", "show", "--local", "--state-dir", str(tmp_short), "--l2-budget", "1GiB")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith("#")}
    sizes = [name for name, spec in FIELDS.items() if spec.parse is parse_size]
    assert {"l2_reserve", "l2_digest_backlog", "max_buffered", "promotion_max_bytes"} <= set(sizes)
    for name in sizes:
        value = parse_size(FIELDS[name].default) if name != "l2_budget" else 1 << 30
        shown = f"{value} ({human_size(value)})" if value else "0"
        assert lines[name].split("#")[0].split(None, 1)[1].strip() == shown, lines[name]
    assert "268435456 (256.0 MiB)" in lines["l2_reserve"]


def test_stats_prints_every_counter_in_one_aligned_column(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        fill(client, blocks=2)
        client.restore(model="m", state="s", tokens=[1, 2, 3])
    code, out, _ = run("stats", "--socket", str(daemon.socket))
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    assert code == 0 and any(row.split()[0] == "block_cascade_evictions" for row in rows)
    starts = {m.end() for row in rows if (m := re.match(r"  \S+ +(?=\S)", row))}
    assert len(starts) == 1, sorted(starts)  # every value starts in the same column


def test_fsck_counts_in_words(tmp_path: Path) -> None:
    from l2util import IDENT, admit, borrow, key_of

    from skippyd.l2 import L2Tier
    from skippyd.l3 import L3Store
    from skippyd.payload import TensorDecl

    root = tmp_path / "l3"
    with L2Tier.open(tmp_path / "shm", 64 << 20) as tier, L3Store.open(root, 1 << 30) as store:
        table = [TensorDecl("x", "uint8", (5000,))]
        entry = admit(tier, key=key_of("a"), identity=IDENT, token_count=1, tensors=table, data=[b"a" * 5000])
        with borrow(tier, entry.key) as (e, view):
            store.write(e, view)
    code, out, _ = run("l3", "fsck", "--l3-dir", str(root))
    assert code == 0 and f"{root}: 1 entry, 1 object, 1 verified; 0 blocks, 0 verified" in out
    assert "1 entries" not in out and "1 objects" not in out


def test_ls_json_holds_the_blocks_beside_the_entries(daemon: DaemonProcess) -> None:
    from skippyd.keys import Identity

    with daemon.client() as client:
        fill(client, blocks=3)
    code, out, _ = run("ls", "--json", "--socket", str(daemon.socket))
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"blocks", "entries"}
    assert [e["token_count"] for e in doc["entries"]] == [3]
    (blocks,) = doc["blocks"]
    assert blocks["identity"] == Identity("m", "kv").digest and blocks["l2_blocks"] == 3
    only = json.loads(run("ls", "--json", "--blocks", "--socket", str(daemon.socket))[1])
    assert only == doc["blocks"]


def test_evict_exits_zero_whenever_nothing_named_is_left_and_says_how_many_it_removed(
    daemon: DaemonProcess, tmp_short: Path
) -> None:
    sock = str(daemon.socket)
    tokens = tmp_short / "t.txt"
    tokens.write_text("7 8 9")
    by_key = ("evict", "--model", "m", "--state", "s", "--tokens", str(tokens), "--socket", sock)
    assert run(*by_key)[:2] == (0, "removed 0 entries\n")
    code, out, err = run("evict", "--digest", "deadbeef", "--socket", sock)
    assert (code, out) == (0, "removed 0 entries\n") and "no entry's digest starts with deadbeef" in err
    assert run("evict", "--digest", "ab" * 32, "--socket", sock)[:2] == (0, "removed 0 entries\n")
    assert run("evict", "--all", "--socket", sock)[:2] == (0, "removed 0 entries and every block\n")
    code, _, err = run("evict", "--digest", "xyz", "--socket", sock)
    assert code == 2 and len(err.strip().splitlines()) == 1, "a malformed digest is a usage error"
    assert run("evict", "--digest", "deadbeef", "--socket", str(tmp_short / "down.sock"))[0] == 1


def test_warm_warmest_help_says_a_node_that_never_registered_can_be_the_answer(
    redis_url: str, tmp_short: Path
) -> None:
    _, help_text, _ = run("warm", "warmest", "--help")
    text = " ".join(help_text.split())
    assert "never registered" in text and "live node" not in text
    tokens = tmp_short / "t.txt"
    tokens.write_text(" ".join(str(i) for i in range(256)))
    common = ("--model", "m", "--tokens", str(tokens), "--redis-url", redis_url)
    assert run("warm", "ran", "--node", "static-gpu", *common)[0] == 0  # never heartbeats
    assert run("warm", "warmest", *common)[1].strip() == "static-gpu 256", "what the help says"


def test_the_transformers_floor_pyproject_declares_is_the_one_the_integration_checks_and_ci_tests() -> None:
    from skippyd.integrations.transformers import MIN_TRANSFORMERS

    root = Path(__file__).resolve().parent.parent
    floor = re.search(r'"transformers>=([0-9.]+),<6"', (root / "pyproject.toml").read_text())
    assert floor is not None
    assert tuple(int(part) for part in floor.group(1).split(".")[:2]) == MIN_TRANSFORMERS
    script = root / "scripts" / "transformers-floor-env.sh"
    assert os.access(script, os.X_OK) and "pyproject.toml" in script.read_text()
    test_sh = (root / "scripts" / "test.sh").read_text()
    assert "scripts/transformers-floor-env.sh" in test_sh and "tests/test_transformers.py" in test_sh


def test_a_transformers_older_than_the_floor_is_one_clear_error_not_a_failure_deep_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transformers = pytest.importorskip("transformers")
    from skippyd.errors import InvalidArgument
    from skippyd.integrations import transformers as skt

    monkeypatch.setattr(transformers, "__version__", "5.16.1")
    with pytest.raises(InvalidArgument, match=r"transformers 5\.16\.1 is older than 5\.17") as raised:
        skt.profile(torch.nn.Linear(2, 2))
    assert "pip install 'transformers>=5.17,<6'" in str(raised.value)
