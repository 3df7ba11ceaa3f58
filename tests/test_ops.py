"""Operations: systemd notification, Prometheus metrics, JSON logs, config show, doctor and top."""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from daemonutil import DaemonProcess

from skippyd.cli import main


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_tells_systemd_ready_watchdog_and_stopping(make_daemon: Any, tmp_short: Path) -> None:
    path = tmp_short / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(20)
    proc = make_daemon(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"}).start()
    messages: list[str] = []
    deadline = time.monotonic() + 10
    while sum("WATCHDOG=1" in m for m in messages) < 3 and time.monotonic() < deadline:
        messages.append(listener.recv(4096).decode())
    assert any("READY=1" in m for m in messages)
    assert sum("WATCHDOG=1" in m for m in messages) >= 3, "pings every half of WatchdogSec"
    proc.stop()
    listener.settimeout(2)
    tail = []
    try:
        while True:
            tail.append(listener.recv(4096).decode())
    except TimeoutError:
        pass
    assert any("STOPPING=1" in m for m in tail)
    listener.close()


def test_metrics_scraped_over_http_after_a_workload_show_the_right_counts(make_daemon: Any) -> None:
    port = free_port()
    proc = make_daemon("--metrics-addr", f"127.0.0.1:{port}").start()
    with proc.client() as client:
        for i in range(5):
            client.capture(
                model="secret-model-name", state="s", tokens=[i, 1, 2], tensors={"x": torch.ones(8)}
            )
        for i in range(3):
            assert client.restore(model="secret-model-name", state="s", tokens=[i, 1, 2]) is not None
        for _ in range(4):
            assert client.lookup(model="secret-model-name", state="s", tokens=[99, 98]) is None
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
        assert match, f"{name} missing"
        return float(match.group(1))

    assert value("skippyd_l2_inserts_total") == 5
    assert value("skippyd_l2_entries") == 5
    assert value("skippyd_l2_hits_total") == 3
    assert value('skippyd_requests_total{op="capture"}') == 5
    assert value('skippyd_requests_total{op="lookup"}') == 4
    assert value('skippyd_request_duration_seconds_count{op="restore"}') == 3
    assert value('skippyd_request_duration_seconds_bucket{le="+Inf",op="capture"}') == 5
    assert value("skippyd_l2_budget_bytes") == 256 << 20
    assert "skippyd_l3_queue_depth" in text and "skippyd_redis_degraded" in text
    assert value('skippyd_background_thread_up{thread="skippyd-l3-writer"}') == 1
    assert value('skippyd_background_errors_total{thread="skippyd-promoter"}') == 0
    assert value("skippyd_l3_queued_writes_total") == 5
    assert "secret-model-name" not in text, "no model names in labels"
    assert not re.search(r"[0-9a-f]{32}", text), "no keys or digests in labels"


def test_every_metric_reads_a_field_of_its_stats_type_and_names_are_unique() -> None:
    import dataclasses

    from skippyd.metrics import TABLES

    names: list[str] = []
    for table, (stats_type, prefix, rows) in TABLES.items():
        fields = {f.name for f in dataclasses.fields(stats_type)}
        for row in rows:
            assert row.attr in fields, f"{table}: {row.attr} is not a field of {stats_type.__name__}"
            names.append(prefix + row.suffix)
    assert len(names) == len(set(names)), "two rows export the same metric"
    assert all(re.fullmatch(r"skippyd_[a-z0-9_]+", n) for n in names)


def test_json_logs_are_one_object_per_line(make_daemon: Any) -> None:
    proc = make_daemon("--log-format", "json").start()
    proc.stop()
    lines = [line for line in proc.log_text().splitlines() if line.strip()]
    docs = [json.loads(line) for line in lines]
    assert any("serving on" in d["msg"] for d in docs)
    assert all({"ts", "level", "logger", "msg"} <= set(d) for d in docs)


def test_config_show_prints_every_value_and_where_it_came_from(tmp_path: Path) -> None:
    config = tmp_path / "skippyd.toml"
    config.write_text('l2_budget = "2GiB"\nnode = "from-file"\n')
    env = {"SKIPPYD_L3_BUDGET": "10GiB", "SKIPPYD_NODE": ""}
    code, out, _ = run("config", "show", "--config", str(config), "--redis-url", "none", env=env)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith("#")}
    assert "# flag" in lines["redis_url"]
    assert "# env SKIPPYD_L3_BUDGET" in lines["l3_budget"] and "10.0 GiB" in lines["l3_budget"]
    assert f"# file {config}" in lines["l2_budget"] and "2.0 GiB" in lines["l2_budget"]
    assert "# default" in lines["heartbeat"]
    code, out, _ = run("config", "show", "--config", str(config), "--json", env=env)
    doc = json.loads(out)
    assert doc["values"]["node"] == "from-file" and doc["derived"]["shm_dir"] == "/dev/shm/skippyd-from-file"
    code, _, err = run("config", "show", "--l2-budget", "plenty")
    assert code == 2 and "l2_budget" in err


def doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    code, out, _ = run("doctor", *args, env=env)
    return code, out.splitlines()


def _fails(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("FAIL")]


def test_doctor_passes_a_healthy_host(daemon: DaemonProcess) -> None:
    code, lines = doctor(*daemon.args)
    assert code == 0, lines
    assert any(line.startswith("OK") and "socket" in line for line in lines)
    assert any("Redis 7" in line or "Redis 6" in line for line in lines)
    assert any("daemon" in line and "answers" in line for line in lines)


def test_doctor_gpu_says_a_host_without_cuda_has_no_gpu_path_and_is_not_a_failure(
    daemon: DaemonProcess,
) -> None:
    code, lines = doctor(*daemon.args, "--gpu")
    gpu = [line for line in lines if "gpu:" in line]
    if torch.cuda.is_available():  # pragma: no cover - a GPU host: tests/test_cuda.py checks the probe
        pytest.skip("a CUDA device is visible: this checks the CPU-only answer")
    assert code == 0, lines
    assert len(gpu) == 1 and gpu[0].startswith("WARN") and "sees no CUDA device" in gpu[0], gpu
    assert "CPU build" in gpu[0] and "→" in gpu[0]


def test_doctor_gpu_reports_a_python_that_is_missing_or_whose_probe_fails_as_one_clear_line(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    code, lines = doctor(*daemon.args, "--gpu", "--python", str(tmp_path / "no-such-python"))
    assert code == 1 and [line for line in lines if "gpu:" in line] == [
        f"FAIL  gpu: no Python at {tmp_path / 'no-such-python'}  →  --python PATH: the engine's interpreter"
    ]
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'not json'\necho 'Traceback: it broke' >&2\nexit 3\n")
    broken.chmod(0o755)
    code, lines = doctor(*daemon.args, "--gpu", "--python", str(broken))
    (gpu,) = [line for line in lines if "gpu:" in line]
    assert (
        code == 1
        and gpu.startswith("FAIL  gpu: the probe failed: Traceback: it broke")
        and "run it alone" in gpu
    )


def test_the_gpu_probe_restores_an_entry_and_blocks_bit_exact_through_the_simulated_transfer(
    daemon: DaemonProcess,
) -> None:
    """``--simulate``: the probe's own steps on the CPU through the transfer layer's stand-ins for CUDA
    (the same code a GPU run takes, but CUDA itself): bit-exact, and nothing of it is left in the daemon."""
    from skippyd.client.transfer.probe import probe

    findings = probe(str(daemon.socket), nbytes=8 << 20, simulate=True)
    whats = [f["what"] for f in findings]
    assert [f["level"] for f in findings] == ["info", "info", "info"], findings
    assert "restore of a 8 MiB entry to cpu: bit-exact" in whats[1]
    assert "get_into of 8 blocks of 1 MiB into cpu: bit-exact" in whats[2]
    with daemon.client() as client:
        stats = client.stats()
        assert stats["l2"]["entries"] == 0 and stats["l2"]["block_count"] == 0, "the probe evicted its own"


def test_doctor_knows_the_block_slabs_and_finds_a_damaged_one(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = client.blocks(model="m", state="s", block_tokens=16)
        keys = blocks.keys(list(range(64)))
        blocks.put(keys, [torch.full((40_000,), i, dtype=torch.uint8) for i in range(4)], durable=False)
        # the put is answered before its copy commits; the connection's next request runs after it, so
        # the daemon's stats below count the blocks (on a loaded machine they might not have yet)
        assert blocks.contains(keys[:4]) == 4
    code, lines = doctor(*daemon.args)
    assert code == 0, lines
    assert any(
        line.startswith("OK") and "L2 block slabs: 1 slab" in line and "4 blocks" in line for line in lines
    )
    assert any("daemon holds 4 blocks in L2" in line for line in lines), lines
    daemon.stop()
    (slab,) = (daemon.shm_dir / "blocks").glob("*.slab")
    with slab.open("r+b") as f:
        f.write(b"garbage!")
    _, lines = doctor(*daemon.args)
    assert any(line.startswith("WARN") and slab.name in line and "damaged" in line for line in lines), lines


def test_doctor_tries_the_acl_that_gives_allowed_ids_read_access_on_the_l2_tmpfs(make_daemon: Any) -> None:
    """With allowed_uids/allowed_gids, the files clients are handed carry a POSIX ACL for those ids; doctor
    tries that ACL on an unnamed file in the L2 dir (nothing left behind) and says it holds."""
    proc = make_daemon("--allowed-uids", "65534", "--allowed-gids", "65533").start()
    before = sorted(p.name for p in proc.shm_dir.rglob("*"))
    code, lines = doctor(*proc.args)
    assert code == 0, lines
    assert any(
        line.startswith("OK") and "uid 65534, gid 65533 read access (a POSIX ACL" in line for line in lines
    ), lines
    assert sorted(p.name for p in proc.shm_dir.rglob("*")) == before
    proc.stop()
    _, lines = doctor(
        *[a for a in proc.args if a not in ("--allowed-uids", "--allowed-gids", "65534", "65533")]
    )
    assert not any("POSIX ACL" in line for line in lines), "no allowed ids: nothing to try"


def test_doctor_warns_where_the_l2_filesystem_refuses_posix_acls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without POSIX ACLs (EOPNOTSUPP) still serves clients allowed by id alone, a copy a call:
    a warning with its fix. Pure logic: the refusal is injected."""
    import errno

    from skippyd import doctor as doc
    from skippyd.config import Config

    def refuse(*_args: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "setxattr", refuse)
    config = Config(shm_dir=str(tmp_path), allowed_uids=(65534,))
    (finding,) = doc.check_sharing(config)
    assert finding.level == doc.WARN and "no POSIX ACLs" in finding.what and "--socket-group" in finding.fix


def test_doctor_finds_a_loosened_socket_mode(daemon: DaemonProcess) -> None:
    os.chmod(daemon.socket, 0o666)
    code, lines = doctor(*daemon.args)
    assert code == 1 and any("mode 666" in line and "→" in line for line in _fails(lines))


def test_doctor_finds_a_stale_socket(daemon: DaemonProcess) -> None:
    daemon.kill9()
    code, lines = doctor(*daemon.args)
    assert code == 1 and any("nothing answers" in line for line in _fails(lines))


def test_doctor_finds_an_open_l3_dir(daemon: DaemonProcess) -> None:
    os.chmod(daemon.state_dir / "l3", 0o755)
    code, lines = doctor(*daemon.args)
    assert code == 1 and any("L3 dir" in line and "chmod 700" in line for line in _fails(lines))


def test_doctor_finds_an_l2_budget_the_tmpfs_or_ram_cannot_hold(tmp_short: Path) -> None:
    code, lines = doctor(
        "--socket",
        str(tmp_short / "s.sock"),
        "--state-dir",
        str(tmp_short / "st"),
        "--shm-dir",
        str(tmp_short / "shm-not-tmpfs"),
        "--l2-budget",
        "1TiB",
    )
    fails = _fails(lines)
    assert code == 1
    assert any("not tmpfs" in line for line in fails)
    code, lines = doctor(
        "--socket", str(tmp_short / "s.sock"), "--state-dir", str(tmp_short / "st"), "--l2-budget", "1TiB"
    )
    assert any("l2_budget" in line and ("tmpfs" in line or "RAM" in line) for line in _fails(lines))


def test_doctor_finds_unreachable_redis_and_a_missing_redis_server(tmp_short: Path) -> None:
    base = ["--socket", str(tmp_short / "s.sock"), "--state-dir", str(tmp_short / "st")]
    code, lines = doctor(*base, "--redis-url", f"unix://{tmp_short}/nobody.sock")
    assert code == 1 and any("not reachable" in line for line in _fails(lines))
    empty = tmp_short / "empty-bin"
    empty.mkdir()
    code, lines = doctor(*base, env={"PATH": str(empty)})
    assert code == 1 and any("redis-server is not installed" in line for line in _fails(lines))


def test_doctor_finds_l3_below_its_free_space_floor(tmp_short: Path) -> None:
    code, lines = doctor(
        "--socket",
        str(tmp_short / "s.sock"),
        "--state-dir",
        str(tmp_short / "st"),
        "--redis-url",
        "none",
        "--l3-min-free",
        "1000TiB",
    )
    assert code == 1 and any("read-only" in line for line in _fails(lines))


def test_top_prints_a_view_of_the_daemon(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        client.capture(model="m", state="s", tokens=[1], tensors={"x": torch.ones(2)})
        client.restore(model="m", state="s", tokens=[1])
    code, out, _ = run("top", "--once", "--socket", str(daemon.socket), env={"COLUMNS": "80"})
    assert code == 0
    assert "L2" in out and "L3" in out and "capture" in out and "restore" in out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out, out
    assert "≤" not in out and re.search(r"\d (µs|ms|s)\b", out), "latencies read as numbers"


def test_python_m_skippyd_and_the_console_script_are_the_same_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "skippyd", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("skippyd, version")
    script = Path(sys.executable).with_name("skippyd")
    if not script.exists():
        pytest.skip("no console script next to this interpreter")
    assert (
        subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True).stdout
        == done.stdout
    )


def test_doctor_reports_what_l3_reconciliation_repaired_at_start(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        client.capture(model="m", state="s", tokens=[1, 2], tensors={"x": torch.ones(4)})
    daemon.stop()
    (daemon.state_dir / "l3" / "tmp" / "torn-write.tmp").write_bytes(b"x" * 100)
    daemon.start()
    code, lines = doctor(*daemon.args)
    assert any(line.startswith("WARN") and "temporary removed 1" in line for line in lines), lines
    assert code == 0


def test_the_watchdog_is_fed_only_while_every_background_thread_lives(tmp_short: Path) -> None:
    import asyncio
    import socket as socketlib
    import threading
    from types import SimpleNamespace

    from skippyd.config import Config
    from skippyd.server import Server
    from skippyd.stats import ServerState
    from skippyd.workers import Health

    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    listener.bind(str(tmp_short / "notify.sock"))
    listener.settimeout(5)
    health = Health()
    release = threading.Event()

    def work() -> None:
        release.wait(10)
        raise SystemExit(1)  # not an Exception: nothing catches it, the thread dies

    health.start("skippyd-test-worker", work)
    server = Server(Config(), SimpleNamespace(), health=health, state=ServerState())  # type: ignore[arg-type]

    async def watch() -> None:
        task = asyncio.create_task(server._watchdog(0.05))
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.wait_for(task, 5)  # the watchdog task gives up, so systemd restarts the daemon

    old = os.environ.get("NOTIFY_SOCKET")
    os.environ["NOTIFY_SOCKET"] = str(tmp_short / "notify.sock")
    try:
        asyncio.run(watch())
    finally:
        if old is None:
            del os.environ["NOTIFY_SOCKET"]
        else:
            os.environ["NOTIFY_SOCKET"] = old
    messages = []
    listener.settimeout(0.2)
    with contextlib.suppress(TimeoutError):
        while True:
            messages.append(listener.recv(4096).decode())
    listener.close()
    assert messages.count("WATCHDOG=1") >= 2
    assert messages[-1].startswith("STATUS=unhealthy") and "skippyd-test-worker" in messages[-1]


def test_doctor_tries_the_acl_on_a_file_it_removes_at_once_where_the_filesystem_has_no_o_tmpfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems refuse O_TMPFILE but take POSIX ACLs: doctor tries the ACL on a named file instead,
    removed at once, and still answers (nothing left in the directory). Pure logic: the refusal is
    injected."""
    import errno

    from skippyd import doctor as doc
    from skippyd.config import Config

    real_open = os.open

    def no_tmpfile(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_tmpfile)
    tried: list[int] = []
    monkeypatch.setattr(os, "setxattr", lambda fd, *_args: tried.append(fd))
    (finding,) = doc.check_sharing(Config(shm_dir=str(tmp_path), allowed_gids=(65533,)))
    assert finding.level == doc.OK and "gid 65533 read access" in finding.what and len(tried) == 1
    assert list(tmp_path.iterdir()) == []
