"""``skippyd``: the daemon and its admin commands (click).

Options follow one precedence everywhere: flags > ``SKIPPYD_<OPTION>`` environment > TOML ``--config``
> defaults. ``--json`` prints one JSON document on stdout; errors go to stderr with a non-zero exit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from . import __version__
from .config import FIELDS, load_config
from .errors import ConfigError, ConnectionLost, SkippydError, Timeout

F = TypeVar("F", bound=Callable[..., Any])

_SERVE_FLAGS = [
    "socket", "state_dir", "shm_dir", "l2_budget", "l3_dir", "l3_budget", "l3_min_free", "redis_url",
    "node", "max_entry", "staging_budget", "workers", "allowed_uids", "allowed_gids", "socket_group",
    "shutdown_timeout", "idle_timeout", "log_level", "log_format", "metrics_addr", "redis_prefix",
    "promotion_scope", "warm_on_capture",
]  # fmt: skip


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"skippyd: error: {message}", err=True)
    sys.exit(code)


def _config_options(names: list[str]) -> Callable[[F], F]:
    """One ``--flag`` per config field, all defaulting to None so precedence is decided by load_config."""

    def decorate(fn: F) -> F:
        for name in reversed(names):
            spec = FIELDS[name]
            flag = "--" + name.replace("_", "-")
            if name == "warm_on_capture":
                fn = click.option(
                    "--warm-on-capture/--no-warm-on-capture", "warm_on_capture", default=None, help=spec.help
                )(fn)
            elif name in ("allowed_uids", "allowed_gids"):
                fn = click.option(flag, name, default=None, help=spec.help + " (comma-separated)")(fn)
            else:
                fn = click.option(flag, name, default=None, help=f"{spec.help} [env {spec.env}]")(fn)
        return fn

    return decorate


def _socket_options(fn: F) -> F:
    fn = click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")(
        fn
    )
    return click.option("--socket", "socket", default=None, help="daemon socket [env SKIPPYD_SOCKET]")(fn)


def _client(socket: str | None, config_file: str | None, timeout: float = 10.0) -> Any:
    try:
        loaded = load_config({"socket": socket}, config_file=config_file)
    except ConfigError as exc:
        _fail(str(exc), 2)
    from .client import Client

    return Client(loaded.config.socket, timeout=timeout, connect_timeout=min(timeout, 5.0))


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="skippyd")
def main() -> None:
    """skippyd: a KV-cache daemon for LLM serving hosts."""


@main.command()
@click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")
@_config_options(_SERVE_FLAGS)
def serve(config_file: str | None, **flags: Any) -> None:
    """Run the daemon in the foreground (systemd: Type=notify)."""
    from .daemon import run

    try:
        loaded = load_config(flags, config_file=config_file)
        code = run(loaded.config)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except SkippydError as exc:
        _fail(str(exc), 1)
    sys.exit(code)


@main.command()
@_socket_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@click.option("--check", is_flag=True, help="exit 0 only if the daemon answers; print nothing")
def status(socket: str | None, config_file: str | None, as_json: bool, check: bool) -> None:
    """Is the daemon up, and how is it doing."""
    client = _client(socket, config_file, timeout=5.0)
    with client:
        if check:
            sys.exit(0 if client.ping() else 1)
        try:
            info = client.server_info
            stats = client.stats()
        except (ConnectionLost, Timeout) as exc:
            if as_json:
                click.echo(json.dumps({"up": False, "socket": client.socket_path, "error": str(exc)}))
            else:
                click.echo(f"skippyd is not answering on {client.socket_path}: {exc}", err=True)
            sys.exit(1)
    doc = {"up": True, "socket": client.socket_path, "server": info.get("server"), "node": stats["node"],
           "uptime_s": stats["uptime_s"], "l2": stats["l2"], "redis": stats.get("redis", {}),
           "connections": stats["server"].get("connections", 0)}  # fmt: skip
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    l2 = stats["l2"]
    redis = stats.get("redis", {})
    click.echo(
        f"skippyd {info.get('server', '?')} on {client.socket_path}: up {human_age(stats['uptime_s'])}"
    )
    click.echo(f"  node       {stats['node']}")
    click.echo(
        f"  L2         {l2['entries']} entries, {human_size(l2['bytes'])} of {human_size(l2['budget_bytes'])}"
        f", {l2['hits']} hits / {l2['misses']} misses"
    )
    if redis.get("configured") is False:
        click.echo("  redis      not configured")
    elif redis:
        state = "degraded: " + str(redis.get("cause")) if redis.get("degraded") else "ok"
        click.echo(f"  redis      {state}")
    click.echo(f"  clients    {doc['connections']} connected")


@main.command()
@_socket_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def stats(socket: str | None, config_file: str | None, as_json: bool) -> None:
    """Counters of every tier and operation."""
    with _client(socket, config_file) as client:
        try:
            data = client.stats()
        except SkippydError as exc:
            _fail(str(exc))
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    for section in ("l2", "l3", "ops", "server", "redis"):
        values = data.get(section)
        if not isinstance(values, dict):
            continue
        click.echo(f"[{section}]")
        for key, value in sorted(values.items()):
            shown = value
            if isinstance(value, dict):
                shown = ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
            elif isinstance(value, int) and key.endswith("bytes"):
                shown = f"{value} ({human_size(value)})"
            click.echo(f"  {key:22} {shown}")


@main.command(name="ls")
@_socket_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@click.option("--limit", default=0, show_default=True, help="at most this many entries (0: all)")
def ls_command(socket: str | None, config_file: str | None, as_json: bool, limit: int) -> None:
    """Cached entries, most recently used first."""
    with _client(socket, config_file) as client:
        try:
            entries = client.ls(limit)
        except SkippydError as exc:
            _fail(str(exc))
    if as_json:
        click.echo(json.dumps(entries, indent=2, sort_keys=True))
        return
    if not entries:
        click.echo("no entries")
        return
    click.echo(
        f"{'TIER':4}  {'DIGEST':16}  {'TOKENS':>8}  {'KIND':14}  {'SIZE':>10}  {'AGE':>8}  {'IDLE':>8}"
    )
    for e in entries:
        click.echo(
            f"{e['tier']:4}  {e['digest'][:16]}  {e['token_count']:>8}  {e['kind']:14}  "
            f"{human_size(e['nbytes']):>10}  {human_age(e['age_s']):>8}  {human_age(e['idle_s']):>8}"
        )


@main.command()
@_socket_options
@click.option("--digest", default=None, help="remove every entry with this payload digest")
@click.option("--all", "everything", is_flag=True, help="remove every entry")
def evict(socket: str | None, config_file: str | None, digest: str | None, everything: bool) -> None:
    """Remove entries by payload digest, or all of them."""
    if (digest is None) == (not everything):
        _fail("give exactly one of --digest D or --all", 2)
    with _client(socket, config_file) as client:
        try:
            removed = client.evict(digest=digest) if digest else client.evict(all=True)
        except SkippydError as exc:
            _fail(str(exc))
    click.echo(f"removed {removed} entr{'y' if removed == 1 else 'ies'}")
