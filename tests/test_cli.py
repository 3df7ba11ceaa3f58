"""The command line: status/stats/ls/evict against a real daemon, serve's start-up errors, config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from daemonutil import DaemonProcess, eventually
from l2util import admit, borrow

from skippyd.cli import main


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_status_check_exits_zero_when_healthy_and_three_when_nothing_answers(
    daemon: DaemonProcess, tmp_short: Path
) -> None:
    assert run("status", "--check", "--socket", str(daemon.socket)) == (0, "", "")
    code, out, err = run("status", "--check", "--socket", str(tmp_short / "nothing.sock"))
    assert code == 3 and out == "", "3: not answering, as systemctl is-active exits for a stopped unit"
    assert len(err.strip().splitlines()) == 1 and "not answering" in err
    for form in ([], ["--json"]):
        assert run("status", *form, "--socket", str(tmp_short / "nothing.sock"))[0] == 3, form


def test_status_json_is_one_document(daemon: DaemonProcess) -> None:
    code, out, _ = run("status", "--json", "--socket", str(daemon.socket))
    doc = json.loads(out)
    assert code == 0 and doc["up"] is True and doc["node"] == "test-node"
    assert doc["healthy"] is True and doc["state"] == "healthy" and doc["problems"] == []
    assert doc["l2"]["budget_bytes"] == 256 << 20


def test_status_reads_the_socket_from_the_environment_and_the_config_file(
    daemon: DaemonProcess, tmp_short: Path
) -> None:
    assert run("status", "--check", env={"SKIPPYD_SOCKET": str(daemon.socket)})[0] == 0
    config = tmp_short / "skippyd.toml"
    config.write_text(f'socket = "{daemon.socket}"\n')
    assert run("status", "--check", "--config", str(config), env={"SKIPPYD_SOCKET": ""})[0] == 0
    bogus = str(tmp_short / "nope.sock")
    assert run("status", "--check", "--config", str(config), env={"SKIPPYD_SOCKET": bogus})[0] == 3, (
        "the environment wins over the file"
    )


def test_ls_stats_and_evict_show_and_remove_entries(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        first = client.capture(model="m", state="s", tokens=[1, 2, 3], tensors={"x": torch.ones(1000)})
        client.capture(model="m", state="s", tokens=[4, 5], tensors={"x": torch.zeros(10)})
    sock = str(daemon.socket)
    code, out, _ = run("ls", "--socket", sock)
    assert code == 0 and first.digest[:16] in out and "3.9 KiB" in out
    code, out, _ = run("ls", "--json", "--socket", sock)
    entries = json.loads(out)["entries"]
    assert {e["digest"] for e in entries} >= {first.digest} and len(entries) == 2
    code, out, _ = run("stats", "--json", "--socket", sock)
    assert json.loads(out)["l2"]["entries"] == 2
    code, out, _ = run("stats", "--socket", sock)
    assert "[l2]" in out and "entries" in out
    assert run("evict", "--digest", first.digest, "--socket", sock)[1].strip() == "removed 1 entry"
    assert run("evict", "--all", "--socket", sock)[1].strip() == "removed 1 entry and every block"
    code, _, err = run("evict", "--socket", sock)
    assert code == 2 and "exactly one" in err


def test_ls_of_more_entries_than_one_reply_lists_is_asked_page_by_page(make_daemon: Any) -> None:
    """A reply lists at most a page (20,000 entries: the whole list of a big cache would pass the frame
    limit, and ls failed with frame_too_large at 100k entries); the client asks page after page. Here
    the page is 3 entries (a test hook)."""
    import asyncio

    import skippyd

    proc = make_daemon(env={"SKIPPYD_TEST_LS_PAGE": "3"}).start()
    with proc.client() as client:
        digests = {
            client.capture(model="m", state="s", tokens=[i], tensors={"x": torch.full((10,), i)}).digest
            for i in range(8)
        }
        listed = client.ls()
        assert len(listed) == 8 and {e["digest"] for e in listed} == digests
        assert len(client.ls(5)) == 5 and len(client.ls(2)) == 2
        raw = client._call({"op": "ls", "limit": 0, "offset": 6})[0]
        assert (len(raw["entries"]), raw["total"], raw["next"]) == (2, 8, None)
        raw = client._call({"op": "ls", "limit": 0, "offset": 0})[0]
        assert (len(raw["entries"]), raw["next"]) == (3, 3)
        # the next pages are cut from the same listing (built once), whatever changed since
        client.evict(digest=raw["entries"][1]["digest"])  # (a rebuilt list would shift by one)
        pages = [raw["entries"]]
        while raw["next"] is not None:
            raw = client._call({"op": "ls", "limit": 0, "offset": raw["next"]})[0]
            pages.append(raw["entries"])
        seen = [e["digest"] for page in pages for e in page]
        assert len(seen) == 8 and set(seen) == digests, "one snapshot: no entry twice, none missed"
        assert len(client.ls()) == 7, "a new listing sees the eviction"

    async def listed_async() -> int:
        async with skippyd.AsyncClient(str(proc.socket)) as aclient:
            return len(await aclient.ls())

    assert asyncio.run(listed_async()) == 7
    code, out, _ = run("ls", "--json", "--socket", str(proc.socket))
    assert code == 0 and len(json.loads(out)["entries"]) == 7


def test_commands_fail_with_one_line_on_stderr_when_the_daemon_is_down(tmp_short: Path) -> None:
    code, out, err = run("stats", "--socket", str(tmp_short / "down.sock"))
    assert code == 1 and out == ""
    assert err.startswith("skippyd: error:") and "cannot reach skippyd" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as another user")
def test_a_refused_user_gets_one_line_and_exit_1_from_every_client_command(make_daemon: Any) -> None:
    proc = make_daemon("--allowed-uids", "4242").start()
    os.chmod(proc.socket, 0o666)
    for parent in (proc.socket.parent, proc.socket.parent.parent):
        os.chmod(parent, 0o711)
    commands = [["status"], ["status", "--check"], ["stats"], ["ls"], ["evict", "--all"]]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: as nobody, run each command in-process
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            outcomes = []
            for args in commands:
                try:
                    result = CliRunner().invoke(main, [*args, "--socket", str(proc.socket)])
                    outcomes.append([result.exit_code, result.stdout, result.stderr, repr(result.exception)])
                except BaseException as exc:
                    outcomes.append([-1, "", repr(exc), ""])
            os.write(write_end, json.dumps(outcomes).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        outcomes = json.loads(pipe.read())
    for args, (code, out, err, error) in zip(commands, outcomes, strict=True):
        assert code == 1, (args, code, out, err, error)
        assert "Traceback" not in err and "Traceback" not in out, args
        if args != ["status", "--check"]:
            assert "not allowed" in err and len(err.strip().splitlines()) == 1, (args, err)


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skippyd", "serve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _places(tmp_short: Path, shm_dir: Path) -> list[str]:
    """A serve's state dir, socket and L2 dir, all removed after the test."""
    state, socket_path = str(tmp_short / "s"), str(tmp_short / "x.sock")
    return ["--state-dir", state, "--socket", socket_path, "--shm-dir", str(shm_dir)]


def test_serve_without_redis_server_says_how_to_install_it_in_one_line(
    tmp_short: Path, shm_dir: Path
) -> None:
    bare = tmp_short / "bin"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    done = _serve(_places(tmp_short, shm_dir), env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "apt-get install redis-server" in lines[0] and "--redis-url" in lines[0]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--l2-budget", "lots"], "l2_budget"),
        (["--node", "bad name!"], "node"),
        (["--shutdown-timeout", "soon"], "shutdown_timeout"),
        (["--redis-url", "http://x"], "redis_url"),
        (["--socket-group", "no-such-group-here", "--redis-url", "none"], "socket_group"),
    ],
)
def test_serve_rejects_bad_values_naming_the_key(
    tmp_short: Path, shm_dir: Path, args: list[str], names: str
) -> None:
    done = _serve([*_places(tmp_short, shm_dir), *args], dict(os.environ))
    assert done.returncode == 2
    assert names in done.stderr and "skippyd: error:" in done.stderr


def test_help_lists_every_contract_command() -> None:
    _, out, _ = run("--help")
    for command in ("serve", "status", "stats", "ls", "evict", "warm", "nodes"):
        assert command in out
    _, out, _ = run("serve", "--help")
    for flag in ("--socket", "--state-dir", "--shm-dir", "--l2-budget", "--l3-dir", "--l3-budget",
                 "--redis-url", "--node", "--config"):  # fmt: skip
        assert flag in out


def test_warm_ran_and_warmest_from_the_command_line(redis_url: str, tmp_short: Path) -> None:
    tokens = tmp_short / "tokens.txt"
    tokens.write_text(", ".join(str(i) for i in range(300)))
    code, out, _ = run(
        "warm", "ran", "--model", "m", "--node", "gpu-1", "--tokens", str(tokens), "--redis-url", redis_url
    )
    assert code == 0 and "4 block(s)" in out
    as_json = tmp_short / "tokens.json"
    as_json.write_text(json.dumps(list(range(400))))
    code, out, _ = run(
        "warm", "warmest", "--model", "m", "--tokens", str(as_json), "--json", "--redis-url", redis_url
    )
    assert json.loads(out) == {"node": "gpu-1", "tokens": 256}
    result = CliRunner().invoke(main, ["warm", "warmest", "--model", "m", "--redis-url", redis_url],
                                input=" ".join(str(i) for i in range(300)))  # fmt: skip
    assert result.stdout.strip() == "gpu-1 256"
    code, out, _ = run(
        "warm", "warmest", "--model", "other", "--tokens", str(tokens), "--redis-url", redis_url
    )
    assert out.strip() == "no warm prefix"


def test_nodes_and_warm_forget_from_the_command_line(redis_url: str) -> None:
    from skippyd import WarmTable

    table = WarmTable.from_url(redis_url)
    table.heartbeat("gpu-1", 7, ttl_s=60)
    table.ran("m", list(range(256)), "gpu-1")
    code, out, _ = run("nodes", "--json", "--redis-url", redis_url)
    assert code == 0 and json.loads(out)[0]["node"] == "gpu-1" and json.loads(out)[0]["incarnation"] == 7
    code, out, _ = run("nodes", "--redis-url", redis_url)
    assert "gpu-1" in out and "up" in out
    code, out, _ = run("warm", "forget", "--node", "gpu-1", "--redis-url", redis_url)
    assert code == 0 and "4 prefix(es) removed" in out
    assert run("nodes", "--redis-url", redis_url)[1].strip() == "no nodes"


def test_warm_commands_default_to_the_embedded_redis_of_the_state_dir(
    daemon: DaemonProcess, tmp_short: Path
) -> None:
    tokens = tmp_short / "t.txt"
    tokens.write_text(" ".join(str(i) for i in range(128)))
    state = str(daemon.state_dir)
    assert (
        run("warm", "ran", "--model", "m", "--node", "n", "--tokens", str(tokens), "--state-dir", state)[0]
        == 0
    )
    # (the daemon's first heartbeat may come after its socket is up: a loaded machine took that long)
    assert eventually(lambda: "test-node" in run("nodes", "--state-dir", state)[1], timeout=10)
    assert (
        run("warm", "warmest", "--model", "m", "--tokens", str(tokens), "--state-dir", state)[1].strip()
        == "n 128"
    )


def test_bad_token_files_are_rejected_with_a_usage_error(tmp_short: Path, redis_url: str) -> None:
    bad = tmp_short / "bad.txt"
    bad.write_text("1 2 three")
    code, _, err = run("warm", "warmest", "--model", "m", "--tokens", str(bad), "--redis-url", redis_url)
    assert code == 2 and "integers" in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "no such file"),
        ("dir", "is a directory"),
        ("1, 2, 3\n4 5 x7 8", "token 6 is 'x7'"),
        ("[1, 2, -3]", "token 3 is '-3'"),
        ("[1, 2.5]", "token 2 is '2.5'"),
        ("1 4294967296", "token 2 is '4294967296'"),
        ("[1, 2", "not a JSON array"),
    ],
)
def test_a_token_file_that_cannot_be_read_is_one_line_naming_the_file_and_the_first_bad_token(
    tmp_short: Path, redis_url: str, content: str | None, needle: str
) -> None:
    path = tmp_short / "tokens.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    for args in (["warm", "warmest", "--model", "m"], ["evict", "--model", "m", "--state", "s"]):
        code, out, err = (
            run(*args, "--tokens", str(path), "--redis-url", redis_url)
            if args[0] == "warm"
            else run(*args, "--tokens", str(path), "--socket", str(tmp_short / "none.sock"))
        )
        assert code == 2 and out == "", (args, err)
        assert len(err.strip().splitlines()) == 1 and needle in err and str(path) in err, err
        assert "Traceback" not in err


def test_token_files_hold_white_space_or_comma_separated_integers_or_a_json_array(
    tmp_short: Path, redis_url: str
) -> None:
    from skippyd.cli import read_tokens

    (tmp_short / "a").write_text("1, 2,3\n 4\t5  \n")
    (tmp_short / "b").write_text("[1, 2, 3, 4, 5]")
    assert read_tokens(str(tmp_short / "a")) == read_tokens(str(tmp_short / "b")) == [1, 2, 3, 4, 5]
    _, out, _ = run("warm", "ran", "--help")
    assert "white space or commas" in " ".join(out.split()) and "JSON array" in out


def test_l3_fsck_reports_a_clean_store_and_repairs_a_damaged_one(tmp_path: Path) -> None:
    from l2util import IDENT, key_of

    from skippyd.l2 import L2Tier
    from skippyd.l3 import L3Store
    from skippyd.payload import TensorDecl

    root = tmp_path / "l3"
    with L2Tier.open(tmp_path / "shm", 64 << 20) as tier, L3Store.open(root, 1 << 30) as store:
        for i, name in enumerate(["a", "bb"]):
            table = [TensorDecl("x", "uint8", (5000,))]
            entry = admit(
                tier,
                key=key_of(name),
                identity=IDENT,
                token_count=i + 1,
                tensors=table,
                data=[bytes([i]) * 5000],
            )
            with borrow(tier, entry.key) as (e, view):
                store.write(e, view)
    code, out, _ = run("l3", "fsck", "--l3-dir", str(root), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["clean"] and doc["manifests"] == 2 and doc["verified"] == 2
    obj = next((root / "objects").rglob("*.obj"))
    obj.write_bytes(b"\xff" * obj.stat().st_size)  # same size, wrong bytes: only hashing finds it
    (root / "tmp" / "leftover.tmp").write_bytes(b"x")
    code, out, _ = run("l3", "fsck", "--l3-dir", str(root))
    assert code == 1 and "repaired" in out and "temporary removed: 1" in out
    assert "objects quarantined: 1" in out
    code, out, _ = run("l3", "fsck", "--l3-dir", str(root), "--json")
    assert code == 0 and json.loads(out)["manifests"] == 1


def test_l3_fsck_refuses_a_store_the_daemon_owns(daemon: DaemonProcess) -> None:
    code, _, err = run("l3", "fsck", "--state-dir", str(daemon.state_dir))
    assert code == 1 and "stop the daemon first" in err


def test_ls_shows_digest_identity_tokens_kind_tier_size_and_age_in_80_columns(daemon: DaemonProcess) -> None:
    from skippyd.keys import Identity

    with daemon.client() as client:
        one = client.capture(model="m", state="s", tokens=[1, 2, 3], tensors={"x": torch.ones(1000)})
        client.capture(model="m", state="other", tokens=[4], tensors={"x": torch.ones(10)}, kind="full-state")
    code, out, _ = run("ls", "--socket", str(daemon.socket))
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["DIGEST", "IDENTITY", "TOKENS", "KIND", "TIER", "SIZE", "AGE"]
    row = next(line for line in lines if line.startswith(one.digest[:16]))
    assert Identity("m", "s").digest[:8] in row and " 3 " in row and "kv" in row and "3.9 KiB" in row
    assert any("full-state" in line for line in lines)
    assert max(len(line) for line in lines) <= 80
    doc = json.loads(run("ls", "--json", "--socket", str(daemon.socket))[1])["entries"]
    assert {e["identity"] for e in doc} == {Identity("m", "s").digest, Identity("m", "other").digest}


def test_evict_takes_a_unique_digest_prefix_or_a_key(daemon: DaemonProcess, tmp_short: Path) -> None:
    with daemon.client() as client:
        one = client.capture(model="m", state="s", tokens=[1, 2], tensors={"x": torch.ones(100)})
        two = client.capture(model="m", state="s", tokens=[3, 4], tensors={"x": torch.zeros(100)})
        client.capture(model="m", state="s", tokens=[5], tensors={"x": torch.zeros(100)})  # two's bytes
    sock = str(daemon.socket)
    code, _, err = run("evict", "--digest", one.digest[:7], "--socket", sock)
    assert code == 2 and "8 to 64" in err, "shorter than 8 hex digits is a usage error"
    assert run("evict", "--digest", one.digest[:16], "--socket", sock)[1].strip() == "removed 1 entry"
    code, out, err = run("evict", "--digest", "0123456789abcdef", "--socket", sock)
    assert (code, out.strip()) == (0, "removed 0 entries") and "no entry" in err, "already gone: exit 0"
    tokens = tmp_short / "t.txt"
    tokens.write_text("3 4")
    code, out, _ = run("evict", "--model", "m", "--state", "s", "--tokens", str(tokens), "--socket", sock)
    assert code == 0 and out.strip() == "removed 1 entry"
    with daemon.client() as client:
        assert client.lookup(model="m", state="s", tokens=[3, 4]) is None
        hit = client.lookup(model="m", state="s", tokens=[5])
        assert hit is not None and hit.digest == two.digest, "the same bytes under another key stay"
    code, _, err = run("evict", "--model", "m", "--socket", sock)
    assert code == 2 and "--state" in err


def test_status_names_the_version_once_and_counts_in_words(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        client.capture(model="m", state="s", tokens=[1], tensors={"x": torch.ones(3)})
    code, out, _ = run("status", "--socket", str(daemon.socket))
    first = out.splitlines()[0]
    assert code == 0 and first.startswith("skippyd 0.1.0 on ") and "skippyd/" not in first
    assert "1 entry," in out and "1 entries" not in out


def test_stats_prints_byte_counts_in_units_and_latencies_as_durations(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        client.capture(model="m", state="s", tokens=[1], tensors={"x": torch.ones(1 << 18)})
        client.restore(model="m", state="s", tokens=[1])
    code, out, _ = run("stats", "--socket", str(daemon.socket))
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert code == 0 and "GiB)" in lines["budget_bytes"] and "(1.0 MiB)" in lines["capture_bytes"]
    restore = lines["restore"]
    assert re.search(r"p50=\d+(\.\d+)? (µs|ms|s) ", restore), restore
    assert "<=" not in out


def test_serve_help_shows_the_default_of_every_option() -> None:
    _, out, _ = run("serve", "--help")
    text = " ".join(out.split())
    for needle in ("[default: 4GiB;", "[default: 64GiB;", "[default: /var/lib/skippyd;", "[default: 250ms;"):
        assert needle in text, needle


def test_an_ls_whose_last_page_was_given_keeps_no_listing_for_its_connection() -> None:
    """The listing is kept for the pages still to come, never once a reply said none follows (a
    limit met on the first page included): one per connection would pin a whole cache's list."""
    from skippyd.handlers import Handlers, Session
    from skippyd.workers import Health

    class Item:
        def __init__(self, i: int) -> None:
            self.i = i

        def to_wire(self) -> dict[str, str]:
            return {"digest": f"{self.i:064x}"}

    class Blocks:
        def summary(self) -> list[Any]:
            return []

    class Tiers:
        health = Health()
        blocks = Blocks()

        def entries(self) -> list[Item]:
            return [Item(i) for i in range(1000)]

    handlers = Handlers(None, Tiers(), health=Health())  # type: ignore[arg-type]
    handlers._ls_page = 400
    session = Session(id=1)

    def page(body: dict[str, Any]) -> tuple[Any, bool]:  # the reply's next, and whether a listing is kept
        return handlers.op_ls(session, body).body["next"], session.listing is not None

    assert page({"limit": 1}) == (None, False)
    assert page({}) == (400, True)
    assert page({"offset": 400}) == (800, True)
    assert page({"offset": 800}) == (None, False)
