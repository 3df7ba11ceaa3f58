"""Configuration: one precedence (flags > env > TOML > defaults), units, and errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippyd.config import derived_settings, load_config, parse_duration, parse_size
from skippyd.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value"),
    [("512MiB", 512 << 20), ("8GiB", 8 << 30), ("1.5GB", 1_500_000_000), ("4096", 4096), (123, 123),
     ("2 k", 2048), ("1TiB", 1 << 40), ("10mb", 10_000_000)],
)  # fmt: skip
def test_sizes_take_bytes_or_units(text: object, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "-1", "1.5 parsecs", "", True])
def test_bad_sizes_are_rejected(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "value"), [("500ms", 0.5), ("30s", 30.0), ("10m", 600.0), ("2h", 7200.0), ("1.5", 1.5), (3, 3.0)]
)
def test_durations_take_units(text: object, value: float) -> None:
    assert parse_duration(text) == value


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    config = tmp_path / "skippyd.toml"
    config.write_text('l2_budget = "1GiB"\nnode = "from-file"\nl3_budget = 12345\nlog_level = "debug"\n')
    env = {"SKIPPYD_NODE": "from-env", "SKIPPYD_L3_BUDGET": "2GiB"}
    loaded = load_config({"l3_budget": "3GiB", "node": None}, env=env, config_file=config)
    cfg, sources = loaded.config, loaded.sources
    assert cfg.l3_budget == 3 << 30 and sources["l3_budget"] == "flag"
    assert cfg.node == "from-env" and sources["node"] == "env SKIPPYD_NODE"
    assert cfg.l2_budget == 1 << 30 and sources["l2_budget"] == f"file {config}"
    assert cfg.log_level == "debug"
    assert cfg.redis_timeout == 0.25 and sources["redis_timeout"] == "default"


def test_the_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[skippyd]\nl2_budget = "64MiB"\n')
    loaded = load_config({}, env={"SKIPPYD_CONFIG": str(config)})
    assert loaded.config.l2_budget == 64 << 20 and loaded.config_file == config


@pytest.mark.parametrize(
    ("flags", "env", "toml", "needle"),
    [
        ({"l2_budget": "huge"}, {}, "", "l2_budget (from flag)"),
        ({}, {"SKIPPYD_HEARTBEAT": "often"}, "", "heartbeat (from env SKIPPYD_HEARTBEAT)"),
        ({}, {}, "workers = -3\n", "workers (from file"),
        ({}, {}, "l2_budgett = 5\n", "unknown key(s) l2_budgett"),
        ({}, {}, "l2_budget = [\n", "not valid TOML"),
        ({"log_format": "xml"}, {}, "", "log_format"),
        ({"socket": "/tmp/" + "x" * 120}, {}, "", "socket"),
        ({"heartbeat": "10s", "node_ttl": "5s"}, {}, "", "node_ttl"),
        ({}, {"SKIPPYD_L2_RESERVE_SHARE": "1.5"}, "", "l2_reserve_share (from env SKIPPYD_L2_RESERVE_SHARE)"),
        ({"l2_reserve_share": "lots"}, {}, "", "l2_reserve_share (from flag)"),
        ({"l2_reserve_rate": "fast/s"}, {}, "", "l2_reserve_rate (from flag)"),
    ],
)
def test_bad_values_fail_naming_the_key_and_where_it_came_from(
    tmp_path: Path, flags: dict[str, str], env: dict[str, str], toml: str, needle: str
) -> None:
    path = None
    if toml:
        path = tmp_path / "c.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(flags, env=env, config_file=path)
    assert needle in str(info.value)


def test_the_reserves_pacing_takes_a_rate_per_second_and_a_share_as_a_fraction_or_percent() -> None:
    defaults = load_config({}, env={}).config
    assert (defaults.l2_reserve_rate, defaults.l2_reserve_share, defaults.l2_reserve_window) == (
        256 << 20,
        0.25,
        10.0,
    )
    flags = {"l2_reserve_rate": "64MiB/s", "l2_reserve_share": "10%", "l2_reserve_window": "2s"}
    config = load_config(flags, env={}).config
    assert (config.l2_reserve_rate, config.l2_reserve_share, config.l2_reserve_window) == (64 << 20, 0.1, 2.0)
    config = load_config({}, env={"SKIPPYD_L2_RESERVE_RATE": "0", "SKIPPYD_L2_RESERVE_SHARE": "0"}).config
    assert (config.l2_reserve_rate, config.l2_reserve_share) == (0, 0.0)


def test_copy_threads_default_to_half_the_cpus_between_two_and_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for cpus, want in ((1, 2), (2, 2), (6, 3), (16, 8), (128, 8)):  # the CPUs it may run on, not the host's
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, cpus=cpus: set(range(cpus)))
        assert load_config({}, env={}).config.copy_thread_count == want
    assert load_config({}, env={"SKIPPYD_COPY_THREADS": "5"}).config.copy_thread_count == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(12)))
    assert derived_settings(load_config({}, env={}).config)["copy_threads"] == "6"


def test_derived_paths_follow_the_node_and_state_dir() -> None:
    cfg = load_config({"node": "gpu-7", "state_dir": "/srv/sk"}, env={}).config
    assert str(cfg.shm_path).startswith("/dev/shm/skippyd-gpu-7-")
    assert str(cfg.l3_path) == "/srv/sk/l3"
    system = load_config({"node": "gpu-7"}, env={}).config
    assert str(system.shm_path) == "/dev/shm/skippyd-gpu-7", "the system-wide state dir keeps its name"
    assert load_config({"l3_dir": "off"}, env={}).config.l3_path is None
    assert cfg.scope == "node:gpu-7"


def test_two_state_dirs_on_one_host_never_share_a_tmpfs_directory() -> None:
    one = load_config({"node": "n", "state_dir": "/work/a/.skippyd"}, env={}).config
    two = load_config({"node": "n", "state_dir": "/work/b/.skippyd"}, env={}).config
    assert one.shm_path != two.shm_path
    assert one.shm_path == load_config({"node": "n", "state_dir": "/work/a/.skippyd"}, env={}).config.shm_path


def test_relative_paths_are_made_absolute_once_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        {"state_dir": "relstate", "socket": "s.sock", "shm_dir": "shm", "l3_dir": "../l3"}, env={}
    ).config
    assert cfg.state_dir == str(tmp_path / "relstate")
    assert cfg.socket == str(tmp_path / "s.sock")
    assert cfg.shm_dir == str(tmp_path / "shm")
    assert cfg.l3_dir == str(tmp_path.parent / "l3")
    assert load_config({"l3_dir": "OFF"}, env={}).config.l3_path is None
    home = load_config({"state_dir": "~/sk"}, env={"HOME": "/home/x"}).config
    assert home.state_dir.endswith("/sk") and not home.state_dir.startswith("~")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"metrics_addr": "banana"}, "invalid metrics_addr"),
        ({"metrics_addr": "127.0.0.1:99999"}, "out of range"),
        ({"l2_budget": "10"}, "smaller than one entry"),
        ({"l3_budget": "1KiB"}, "invalid l3_budget"),
        ({"staging_budget": "0"}, "invalid staging_budget"),
    ],
)
def test_values_that_cannot_work_are_refused_when_the_configuration_loads(
    flags: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(flags, env={})
    assert load_config({"metrics_addr": "127.0.0.1:9400"}, env={}).config.metrics_addr == "127.0.0.1:9400"
