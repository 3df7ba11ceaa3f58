"""The Lua scripts live in ``lua/`` (packed into the wheel as ``skippyd/lua/``), one per atomic
operation, each documented in its header."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from skippyd.cluster import coordination
from skippyd.cluster.coordination import lua_source

FILES = sorted(p.name for p in (Path(__file__).resolve().parent.parent / "lua").glob("*.lua"))
LIBRARIES = [name for name in FILES if name.endswith(".lib.lua")]  # code scripts share, included
SCRIPTS = [name for name in FILES if name not in LIBRARIES]


def test_the_scripts_are_package_resources() -> None:
    assert set(SCRIPTS) == {
        "warm_ran.lua", "warm_warmest.lua", "warm_route.lua", "node_heartbeat.lua", "node_list.lua",
        "node_forget.lua", "node_mark.lua", "promo_consider.lua", "promo_settle.lua",
    }  # fmt: skip
    assert LIBRARIES == ["liveness.lib.lua", "prefix_search.lib.lua"]


def test_the_prefix_search_is_written_once_and_included_where_redis_runs_it() -> None:
    library = lua_source("prefix_search.lib.lua")
    for name in ("warm_warmest.lua", "warm_route.lua"):
        text = lua_source(name)
        assert text.count("--! include prefix_search.lib.lua") == 1
        assert "local function boundary" not in text and "local function live" not in text
        sent = coordination.script_text(name)  # what goes to Redis: one script, the library in it
        assert "--! include" not in sent and library.rstrip("\n") in sent
        assert sent.index("local function longest_from_end") > sent.index("local chain = ARGV[1]")


def test_a_library_that_includes_another_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = {"a.lua": "-- a.lua\n--! include b.lib.lua\nreturn 1\n", "b.lib.lua": "--! include c.lib.lua\n"}
    monkeypatch.setattr(coordination, "lua_source", texts.__getitem__)
    coordination.script_text.cache_clear()
    try:
        with pytest.raises(ValueError, match="one level only"):
            coordination.script_text("a.lua")
    finally:
        coordination.script_text.cache_clear()


@pytest.mark.parametrize("name", FILES)
def test_every_script_opens_with_a_header_naming_its_keys_arguments_and_return(name: str) -> None:
    text = lua_source(name)
    header = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        header.append(line)
    head = "\n".join(header)
    assert header[0].startswith(f"-- {name}:"), "the first line names the script and says what it does"
    used_keys = set(re.findall(r"KEYS\[(\d+)\]", text))
    for index in used_keys:
        assert f"KEYS[{index}]" in head, f"KEYS[{index}] is used but not documented"
    used_args = set(re.findall(r"ARGV\[(\d+)\]", text.replace(head, "")))
    for index in used_args:
        assert f"ARGV[{index}]" in head or "ARGV[5…]" in head, f"ARGV[{index}] is used but not documented"
    assert "Returns" in head


@pytest.mark.parametrize("name", FILES)
def test_scripts_touch_only_the_keys_they_are_given(name: str) -> None:
    text = lua_source(name)
    for call in re.findall(r"redis\.call\('(\w+)',\s*([^,)]+)", text):
        command, first = call
        if command in ("TIME",):
            continue
        assert not first.strip().startswith(("'", '"')), f"{command} on a literal key name"
