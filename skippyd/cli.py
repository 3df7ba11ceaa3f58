"""``skippyd``: the daemon and its admin commands (click).

Options follow one precedence everywhere: flags > ``SKIPPYD_<OPTION>`` environment > TOML ``--config``
> defaults. ``--json`` prints one JSON document on stdout; errors go to stderr with a non-zero exit.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from . import __version__
from .config import FIELDS, human_size, load_config
from .errors import ConfigError, ConnectionLost, SkippydError, Timeout

F = TypeVar("F", bound=Callable[..., Any])

_SERVE_FLAGS = list(FIELDS)  # every configuration key is a flag of serve


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


def human_age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


class _Main(click.Group):
    """Any skippyd error a command did not handle itself is one line on stderr and exit 1, never a
    traceback (a refused peer, a daemon that went away mid-command, ...)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SkippydError as exc:
            _fail(f"{exc} [{exc.code}]")


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
        _fail(f"{exc} [{exc.code}]", 1)
    except OSError as exc:  # a directory it may not create, a file it may not read: one line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}", 1)
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
            try:
                health = client.health()
            except SkippydError:
                sys.exit(1)
            if not health["healthy"]:
                dead = ", ".join(health["dead_threads"])
                click.echo(f"skippyd on {client.socket_path} is unhealthy: {dead} died", err=True)
                sys.exit(1)
            sys.exit(0)
        try:
            info = client.server_info
            stats = client.stats()
        except SkippydError as exc:
            if as_json:
                doc = {"up": False, "socket": client.socket_path, "error": str(exc), "code": exc.code}
                click.echo(json.dumps(doc))
            elif isinstance(exc, (ConnectionLost, Timeout)):
                click.echo(f"skippyd is not answering on {client.socket_path}: {exc}", err=True)
            else:
                click.echo(f"skippyd on {client.socket_path} refused: {exc} [{exc.code}]", err=True)
            sys.exit(1)
    doc = {
        "up": True,
        "socket": client.socket_path,
        "server": info.get("server"),
        "node": stats["node"],
        "uptime_s": stats["uptime_s"],
        "l2": stats["l2"],
        "l3": stats.get("l3"),
        "redis": stats.get("redis", {}),
        "connections": stats["server"].get("connections", 0),
    }
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
    l3 = stats.get("l3")
    if l3:
        flags = " READ-ONLY (disk below its free-space floor)" if l3["readonly"] else ""
        used = f"{human_size(l3['bytes'])} of {human_size(l3['budget_bytes'])}"
        click.echo(
            f"  L3         {l3['entries']} entries, {used}, {l3['corrupt']} quarantined, "
            f"queue {stats.get('durable', {}).get('queue_depth', 0)}{flags}"
        )
    else:
        click.echo("  L3         off")
    if redis.get("configured") is False:
        click.echo("  redis      not configured")
    elif redis:
        state = "degraded: " + str(redis.get("cause")) if redis.get("degraded") else "ok"
        click.echo(f"  redis      {state}")
    click.echo(f"  clients    {doc['connections']} connected")
    died = sorted(name for name, t in (stats.get("threads") or {}).items() if not t.get("alive", True))
    if died:
        click.echo(f"  UNHEALTHY  background thread(s) {', '.join(died)} died: restart the daemon")


@main.command()
@_socket_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def stats(socket: str | None, config_file: str | None, as_json: bool) -> None:
    """Counters of every tier and operation."""
    with _client(socket, config_file) as client:
        data = client.stats()
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    latency = data.get("server", {}).pop("latency", {})
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
    if latency:
        click.echo("[latency]")
        for op, summary in sorted(latency.items()):
            click.echo(
                f"  {op:22} count={summary['count']} p50<={summary['p50_us']:.0f}us "
                f"p99<={summary['p99_us']:.0f}us mean={summary['mean_us']:.0f}us"
            )


@main.command(name="ls")
@_socket_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@click.option("--limit", default=0, show_default=True, help="at most this many entries (0: all)")
def ls_command(socket: str | None, config_file: str | None, as_json: bool, limit: int) -> None:
    """Cached entries, most recently used first."""
    with _client(socket, config_file) as client:
        entries = client.ls(limit)
    if as_json:
        click.echo(json.dumps(entries, indent=2, sort_keys=True))
        return
    if not entries:
        click.echo("no entries")
        return
    click.echo(
        f"{'TIER':5}  {'DIGEST':16}  {'TOKENS':>8}  {'KIND':14}  {'SIZE':>10}  {'AGE':>8}  {'IDLE':>8}"
    )
    for e in entries:
        click.echo(
            f"{e['tier']:5}  {e['digest'][:16]}  {e['token_count']:>8}  {e['kind']:14}  "
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
        removed = client.evict(digest=digest) if digest else client.evict(all=True)
    click.echo(f"removed {removed} entr{'y' if removed == 1 else 'ies'}")


# ----------------------------------------------------------------------------- Redis-side commands


def _redis_options(fn: F) -> F:
    for option in reversed(
        [
            click.option("--redis-url", default=None, help="Redis URL [env SKIPPYD_REDIS_URL]"),
            click.option(
                "--state-dir", default=None, help="where the embedded Redis lives [env SKIPPYD_STATE_DIR]"
            ),
            click.option("--redis-prefix", default=None, help="key prefix [env SKIPPYD_REDIS_PREFIX]"),
            click.option(
                "--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]"
            ),
        ]
    ):
        fn = option(fn)
    return fn


def _table(redis_url: str | None, state_dir: str | None, redis_prefix: str | None, config_file: str | None,
           **table: Any) -> Any:  # fmt: skip
    try:
        config = load_config(
            {"redis_url": redis_url, "state_dir": state_dir, "redis_prefix": redis_prefix},
            config_file=config_file,
        ).config
    except ConfigError as exc:
        _fail(str(exc), 2)
    url = config.redis_url or f"unix://{config.state_dir}/redis/redis.sock"
    if url == "none":
        _fail("this configuration runs without Redis (redis_url = none)", 2)
    from .coordination import WarmTable

    return WarmTable.from_url(url, prefix=config.redis_prefix, timeout=5.0, **table)


def read_tokens(source: str) -> list[int]:
    """Integers separated by white space or commas, or a JSON array; ``-`` is standard input."""
    text = (sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")).strip()
    try:
        values = (
            json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
        )
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {exc}", param_hint="--tokens") from exc
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise click.BadParameter("tokens must be integers", param_hint="--tokens")
    return list(values)


@main.group()
def warm() -> None:
    """The warm-prefix table: which node last ran each prompt prefix."""


@warm.command(name="ran")
@_redis_options
@click.option("--model", required=True, help="model identity")
@click.option("--node", required=True, help="the node that ran the prompt")
@click.option("--tokens", "tokens_file", default="-", show_default=True, help="token file, or - for stdin")
@click.option("--block", default=64, show_default=True, help="tokens per block")
def warm_ran(model: str, node: str, tokens_file: str, block: int, **redis: Any) -> None:
    """Record that NODE ran this prompt."""
    tokens = read_tokens(tokens_file)
    _table(**redis, block=block).ran(model, tokens, node)
    click.echo(f"recorded {len(tokens) // block} block(s) for {node}")


@warm.command(name="warmest")
@_redis_options
@click.option("--model", required=True, help="model identity")
@click.option("--tokens", "tokens_file", default="-", show_default=True, help="token file, or - for stdin")
@click.option("--block", default=64, show_default=True, help="tokens per block")
@click.option("--min-blocks", default=2, show_default=True, help="shorter answers are no answer")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def warm_warmest(
    model: str, tokens_file: str, block: int, min_blocks: int, as_json: bool, **redis: Any
) -> None:
    """The live node that ran the longest remembered prefix of this prompt."""
    tokens = read_tokens(tokens_file)
    found = _table(**redis, block=block, min_blocks=min_blocks).warmest(model, tokens)
    if as_json:
        doc = {"node": found[0], "tokens": found[1]} if found else {"node": None, "tokens": 0}
        click.echo(json.dumps(doc))
    elif found:
        click.echo(f"{found[0]} {found[1]}")
    else:
        click.echo("no warm prefix")


@warm.command(name="forget")
@_redis_options
@click.option("--node", required=True, help="the node to remove with every prefix it holds")
def warm_forget(node: str, **redis: Any) -> None:
    """Remove a node and its prefixes (in bounded steps)."""
    removed = _table(**redis).forget(node)
    click.echo(f"forgot {node}: {removed} prefix(es) removed")


@main.command()
@_redis_options
@click.option("--all", "include_gone", is_flag=True, help="include nodes whose heartbeat expired")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def nodes(include_gone: bool, as_json: bool, **redis: Any) -> None:
    """Nodes registered in Redis, with incarnation and last heartbeat."""
    found = _table(**redis).nodes(include_gone=include_gone)
    if as_json:
        click.echo(json.dumps([n.__dict__ for n in found], indent=2))
        return
    if not found:
        click.echo("no nodes")
        return
    click.echo(f"{'NODE':24}  {'STATE':10}  {'INCARNATION':>20}  {'HEARTBEAT':>10}")
    for n in found:
        state = "up" if n.alive else ("forgotten" if n.state == "forgotten" else "gone")
        click.echo(
            f"{n.node:24}  {state:10}  {n.incarnation:>20}  {human_age(n.last_heartbeat_age_ms / 1000):>10}"
        )


# ----------------------------------------------------------------------------- L3 maintenance


_REPAIRS = (
    "temporary_removed",
    "manifests_quarantined",
    "objects_quarantined",
    "dangling_links_dropped",
    "links_restored",
    "orphans_collected",
    "objects_renamed",
)


@main.group()
def l3() -> None:
    """The durable disk tier."""


@l3.command(name="fsck")
@click.option("--l3-dir", default=None, help="the L3 directory [env SKIPPYD_L3_DIR]")
@click.option("--state-dir", default=None, help="its default parent [env SKIPPYD_STATE_DIR]")
@click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")
@click.option("--verify/--no-verify", default=True, show_default=True, help="hash every stored byte")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def l3_fsck(
    l3_dir: str | None, state_dir: str | None, config_file: str | None, verify: bool, as_json: bool
) -> None:
    """Check and repair the L3 store (the daemon must be stopped: it owns the store).

    Removes temporary files, quarantines manifests that do not check out, drops dangling links, restores
    missing ones, collects orphaned objects and, with --verify, re-hashes every segment of every object.
    Exit status 0 when the store was clean, 1 when something was repaired or quarantined.
    """
    try:
        config = load_config({"l3_dir": l3_dir, "state_dir": state_dir}, config_file=config_file).config
    except ConfigError as exc:
        _fail(str(exc), 2)
    path = config.l3_path
    if path is None:
        _fail("L3 is turned off in this configuration (l3_dir = off)", 2)
    if not path.exists():
        _fail(f"{path} does not exist", 2)
    from rich.progress import Progress

    from .l3 import L3Store

    try:
        store = L3Store(path, config.l3_budget, min_free_bytes=0)
    except SkippydError as exc:
        _fail(f"{exc}; stop the daemon first (or read `skippyd stats` for the live store)", 1)
    with store:
        report = store.last_reconciliation
        if verify:
            with Progress(transient=True, disable=as_json or not sys.stderr.isatty()) as progress:
                task = progress.add_task("verifying objects", total=None)

                def advance(done: int, total: int) -> None:
                    progress.update(task, completed=done, total=total)

                verified = store.reconcile(verify_objects=True, progress=advance)
            report.verified = verified.verified
            report.objects_quarantined = verified.objects_quarantined
            report.problems.extend(verified.problems)
    doc = report.as_dict()
    repairs = [k for k in _REPAIRS if doc[k]]
    clean = not report.problems and not repairs
    if as_json:
        click.echo(json.dumps({"clean": clean, **doc}, indent=2))
    else:
        click.echo(
            f"{path}: {report.manifests} entries, {report.objects} objects, {report.verified} verified"
        )
        for key in repairs:
            click.echo(f"  {key.replace('_', ' ')}: {doc[key]}")
        for problem in report.problems:
            click.echo(f"  problem: {problem}")
        click.echo("clean" if clean else "repaired")
    sys.exit(0 if clean else 1)


# ----------------------------------------------------------------------------- configuration & health


@main.group(name="config")
def config_group() -> None:
    """The effective configuration."""


_SIZES = ("l2_budget", "l3_budget", "l3_min_free", "max_entry", "staging_budget", "fill_budget", "max_frame")


def _shown(name: str, value: Any) -> str:
    if name in _SIZES and value:
        return f"{value} ({human_size(value)})"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "(none)"
    if value == "":
        return "(unset)"
    return str(value)


@config_group.command(name="show")
@click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@_config_options(_SERVE_FLAGS)
def config_show(config_file: str | None, as_json: bool, **flags: Any) -> None:
    """Print every setting `skippyd serve` would use with these flags, and where each came from."""
    try:
        loaded = load_config(flags, config_file=config_file)
    except ConfigError as exc:
        _fail(str(exc), 2)
    config = loaded.config
    derived = {
        "node (effective)": config.node_name,
        "shm_dir (effective)": str(config.shm_path),
        "l3_dir (effective)": str(config.l3_path) if config.l3_path else "off",
        "promotion scope (effective)": config.scope,
    }
    if as_json:
        values = {name: getattr(config, name) for name in FIELDS}
        click.echo(
            json.dumps({"values": values, "sources": dict(loaded.sources), "derived": derived}, indent=2)
        )
        return
    width = max(len(name) for name in FIELDS)
    for name in FIELDS:
        value = _shown(name, getattr(config, name))
        click.echo(f"{name:<{width}}  {value:<28}  # {loaded.sources[name]}")
    for name, value in derived.items():
        click.echo(f"# {name}: {value}")


@main.command()
@click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@_config_options(_SERVE_FLAGS)
def doctor(config_file: str | None, as_json: bool, **flags: Any) -> None:
    """Check this host's setup; one line per finding, with the fix. Exit 1 if anything is wrong."""
    from .doctor import FAIL, diagnose

    try:
        config = load_config(flags, config_file=config_file).config
    except ConfigError as exc:
        _fail(str(exc), 2)
    from .client import Client

    daemon = None
    with Client(config.socket, timeout=5.0, connect_timeout=2.0) as client:
        try:
            daemon = client.stats()
        except (ConnectionLost, Timeout):
            daemon = None
        except SkippydError as exc:
            click.echo(f"skippyd: the daemon answered with an error: {exc}", err=True)
    findings = diagnose(config, daemon)
    if as_json:
        click.echo(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for finding in findings:
            click.echo(finding.line())
    sys.exit(1 if any(f.level == FAIL for f in findings) else 0)


@main.command()
@_socket_options
@click.option("--interval", default=1.0, show_default=True, help="seconds between refreshes")
@click.option("--once", is_flag=True, help="print one view and exit")
def top(socket: str | None, config_file: str | None, interval: float, once: bool) -> None:
    """A live view of hit rates, bytes and latencies, refreshed every second."""
    from rich.console import Console
    from rich.live import Live

    from .top import render

    client = _client(socket, config_file, timeout=5.0)
    console = Console()
    previous: dict[str, Any] | None = None
    with client:
        current = client.stats()
        if once:
            console.print(render(current, None, interval))
            return
        with Live(render(current, None, interval), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval)
                    previous, current = current, client.stats()
                    live.update(render(current, previous, interval))
            except KeyboardInterrupt:
                pass
            except SkippydError as exc:
                _fail(str(exc))


# Options that select what a destructive command destroys are never taken from the environment.
_NO_ENV = {("evict", "everything"), ("evict", "digest")}


def _environment_everywhere(group: click.Group, path: tuple[str, ...] = ()) -> None:
    """Every option not already resolved through the configuration reads ``SKIPPYD_<OPTION>``."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            _environment_everywhere(command, (*path, name))
            continue
        for param in command.params:
            if not isinstance(param, click.Option) or param.envvar or param.name is None:
                continue
            if param.name in FIELDS or param.name == "config_file" or (name, param.name) in _NO_ENV:
                continue
            flag = max(param.opts, key=len).lstrip("-")
            param.envvar = "SKIPPYD_" + flag.replace("-", "_").upper()
            param.help = f"{param.help} [env {param.envvar}]" if param.help else f"[env {param.envvar}]"


_environment_everywhere(main)
