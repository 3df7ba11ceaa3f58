"""``skippyd``: the daemon and its admin commands (click).

Options follow one precedence everywhere: flags > ``SKIPPYD_<OPTION>`` environment > TOML ``--config``
> defaults. ``--json`` prints one JSON document on stdout; errors go to stderr with a non-zero exit.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from . import __version__
from .config import (
    FIELDS,
    Config,
    LoadedConfig,
    config_from_values,
    config_values,
    derived_settings,
    embedded_redis_url,
    human_size,
    load_config,
    parse_size,
)
from .display import human_age, human_us, plural
from .errors import ConfigError, ConnectionLost, NotFound, SkippydError, StoreLocked, Timeout
from .locate import local_state_dir, resolve_socket_path

F = TypeVar("F", bound=Callable[..., Any])

_SERVE_FLAGS = list(FIELDS)  # every configuration key is a flag of serve


TOKENS_HELP = (
    "token ids: a file of integers separated by white space or commas, or a JSON array; - is standard input"
)


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
                    "--warm-on-capture/--no-warm-on-capture", "warm_on_capture", default=None,
                    help=f"{spec.help} [default: on; env {spec.env}]",
                )(fn)  # fmt: skip
            elif name in ("allowed_uids", "allowed_gids"):
                fn = click.option(
                    flag, name, default=None, help=f"{spec.help}, comma-separated [env {spec.env}]"
                )(fn)
            else:
                says = "(default" in spec.help or "by default" in spec.help
                default = "" if says else f"default: {_default_text(spec.default)}; "
                fn = click.option(flag, name, default=None, help=f"{spec.help} [{default}env {spec.env}]")(fn)
        return fn

    return decorate


def _default_text(default: Any) -> str:
    if default in ("", (), None):
        return "unset"
    return str(default)


def _socket_options(fn: F) -> F:
    fn = click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")(
        fn
    )
    return click.option("--socket", "socket", default=None, help="daemon socket [env SKIPPYD_SOCKET]")(fn)


def _socket_of(loaded: LoadedConfig) -> str:
    """The socket a command talks to: the one it was given (flag, env, file), else the daemon of the
    checkout it runs in, else the system's (see :mod:`skippyd.locate`)."""
    if loaded.sources.get("socket", "default") != "default":
        return loaded.config.socket
    return resolve_socket_path(None)


def _client(socket: str | None, config_file: str | None, timeout: float = 10.0) -> Any:
    try:
        loaded = load_config({"socket": socket}, config_file=config_file)
    except ConfigError as exc:
        _fail(str(exc), 2)
    from .client import Client

    return Client(_socket_of(loaded), timeout=timeout, connect_timeout=min(timeout, 5.0))


@dataclass(frozen=True)
class _Settings:
    config: Config
    sources: dict[str, str]
    daemon: str | None  # the socket of the daemon whose settings these are, or None (this command's own)
    socket: str


def _settings(flags: dict[str, Any], config_file: str | None, *, local: bool = False) -> _Settings:
    """The settings a command works with: those of the daemon answering on the socket (flags given on
    this command line still win), or, with no daemon there or with ``local``, this command's own
    (flags > environment > file > defaults). Says which on stderr."""
    try:
        loaded = load_config(flags, config_file=config_file)
    except ConfigError as exc:
        _fail(str(exc), 2)
    socket = _socket_of(loaded)
    reply: dict[str, Any] | None = None
    if not local:
        from .client import Client

        try:
            with Client(socket, timeout=3.0, connect_timeout=1.0) as client:
                reply = client.config()
        except SkippydError:
            reply = None
    if reply is None:
        if not local:
            click.echo(f"skippyd: no daemon answers on {socket}: using this command's own settings", err=True)
        return _Settings(loaded.config, dict(loaded.sources), None, socket)
    values = dict(reply.get("values", {}))
    sources = {name: f"daemon: {source}" for name, source in dict(reply.get("sources", {})).items()}
    for name, source in loaded.sources.items():
        if source == "flag":  # what this command line says explicitly wins over the daemon
            values[name] = config_values(loaded.config)[name]
            sources[name] = "flag"
    try:
        config = config_from_values(values)
    except (TypeError, ValueError) as exc:
        _fail(f"the daemon on {socket} sent settings this version cannot read: {exc}", 1)
    pid = reply.get("pid", "?")
    click.echo(f"skippyd: using the settings of the daemon on {socket} (pid {pid})", err=True)
    return _Settings(config, sources, socket, socket)


def _version_of(server: Any) -> str:
    """``skippyd/0.1.0`` (what hello says) as ``0.1.0``."""
    return str(server or "?").removeprefix("skippyd/")


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
        code = run(loaded.config, sources=loaded.sources)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except SkippydError as exc:
        _fail(f"{exc} [{exc.code}]", 1)
    except OSError as exc:  # a directory it may not create, a file it may not read: one line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}", 1)
    sys.exit(code)


# ``status`` exits (every form): 0 answers and is healthy; 1 answers but is unhealthy (a background
# thread died: restart it), or refuses this user; 3 does not answer (no daemon there, as
# ``systemctl is-active`` exits for a unit that is not running); 4 answers and serves but is degraded
# (its configured Redis is unreachable: a restart would not help). 2 is a usage error, as everywhere.
STATUS_EXIT = {"healthy": 0, "unhealthy": 1, "degraded": 4}
STATUS_NOT_ANSWERING = 3


@main.command(
    epilog="Exit status: 0 answers and healthy; 1 unhealthy (a background thread died: restart it) or "
    "refused; 3 not answering; 4 degraded (serves, but its configured Redis is unreachable)."
)
@_socket_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@click.option(
    "--check",
    is_flag=True,
    help="print nothing when healthy, else one line on stderr; the exit status says which (below)",
)
def status(socket: str | None, config_file: str | None, as_json: bool, check: bool) -> None:
    """Is the daemon up, and how is it doing."""
    client = _client(socket, config_file, timeout=5.0)
    with client:
        try:
            info = client.server_info
            stats = client.stats()
        except SkippydError as exc:
            answering = not isinstance(exc, (ConnectionLost, Timeout))
            code = 1 if answering else STATUS_NOT_ANSWERING
            if as_json and not check:
                doc = {"up": False, "socket": client.socket_path, "error": str(exc), "code": exc.code}
                click.echo(json.dumps(doc))
            elif not answering:  # (one line, as every command's errors: the cause names the socket)
                said = str(exc)
                where = "" if client.socket_path in said else f" on {client.socket_path}"
                local = local_state_dir() if socket is None and not os.environ.get("SKIPPYD_SOCKET") else None
                also = f" (nor is this checkout's daemon: {local} names none running)" if local else ""
                click.echo(f"skippyd: error: skippyd is not answering{where}: {said}{also}", err=True)
            else:
                click.echo(f"skippyd on {client.socket_path} refused: {exc} [{exc.code}]", err=True)
            sys.exit(code)
    from .stats import Snapshot, redis_summary

    snap = Snapshot.from_wire(stats)
    condition = snap.condition()
    code = STATUS_EXIT[condition.state]
    if check:
        if condition.problems:
            click.echo(f"skippyd on {client.socket_path} is {condition.state}: "
                       f"{'; '.join(condition.problems)}", err=True)  # fmt: skip
        sys.exit(code)
    if as_json:
        doc = {
            "up": True,
            "socket": client.socket_path,
            "server": info.get("server"),
            "node": snap.node,
            "uptime_s": snap.uptime_s,
            "healthy": condition.state == "healthy",
            "state": condition.state,
            "problems": list(condition.problems),
            "l2": stats["l2"],
            "l3": stats.get("l3"),
            "redis": stats.get("redis", {}),
            "connections": snap.server.connections,
        }
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        sys.exit(code)
    l2 = snap.l2
    version, uptime = _version_of(info.get("server")), human_age(snap.uptime_s)
    click.echo(f"skippyd {version} on {client.socket_path}: up {uptime}")
    click.echo(f"  node       {snap.node}")
    hits, misses = plural(l2.hits, "hit"), plural(l2.misses, "miss", "misses")
    click.echo(
        f"  L2         {plural(l2.entries, 'entry')}, {plural(l2.block_count, 'block')}, "
        f"{human_size(l2.used_bytes)} used of {human_size(l2.budget_bytes)} "
        f"(+ {human_size(l2.reserve_bytes)} pre-faulted reserve), {hits} / {misses}"
    )
    l3 = snap.l3
    if l3 is not None:
        flags = " READ-ONLY (disk below its free-space floor)" if l3.readonly else ""
        used = f"{human_size(l3.bytes)} of {human_size(l3.budget_bytes)}"
        durable = snap.durable
        waiting = durable.queue_depth + durable.backlog if durable is not None else 0
        click.echo(
            f"  L3         {plural(l3.entries, 'entry')}, {plural(l3.block_count, 'block')}, {used}, "
            f"{l3.corrupt + l3.block_corrupt} quarantined, "
            f"{plural(waiting, 'write')} waiting{flags}"
        )
    else:
        click.echo("  L3         off")
    click.echo(f"  redis      {redis_summary(snap.redis)}")
    click.echo(f"  clients    {snap.server.connections} connected")
    if condition.state != "healthy":
        click.echo(f"  {condition.state.upper():10} {'; '.join(condition.problems)}")
    sys.exit(code)


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
    sections = [(name, data[name]) for name in _STATS_SECTIONS if isinstance(data.get(name), dict)]
    width = max([len(str(key)) for _, values in sections for key in values] + [len(op) for op in latency],
                default=0)  # fmt: skip
    for section, values in sections:
        click.echo(f"[{section}]")
        for key, value in sorted(values.items()):
            click.echo(f"  {key:{width}} {_stat(key, value)}")
    if latency:
        click.echo("[latency]")
        for op, summary in sorted(latency.items()):
            click.echo(
                f"  {op:{width}} count={summary['count']} p50={human_us(summary['p50_us'])} "
                f"p99={human_us(summary['p99_us'])} mean={human_us(summary['mean_us'])}"
            )


_STATS_SECTIONS = ("l2", "l3", "durable", "ops", "server", "redis", "threads")


def _stat(key: str, value: Any) -> str:
    """One counter as ``stats`` prints it: byte counts in binary units, maps as ``k=v`` pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={_stat(str(k), v)}" for k, v in sorted(value.items()))
    sized = key == "bytes" or key.endswith(("_bytes", "_budget")) or key.startswith("bytes_")
    if sized and isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        return f"{value} ({human_size(value)})"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


@main.command(name="ls")
@_socket_options
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='print one JSON document: {"blocks": [...], "entries": [...]} (with --blocks: the blocks list)',
)
@click.option("--limit", default=0, show_default=True, help="at most this many entries (0: all)")
@click.option("--blocks", "only_blocks", is_flag=True, help="only the blocks held per identity")
def ls_command(
    socket: str | None, config_file: str | None, as_json: bool, limit: int, only_blocks: bool
) -> None:
    """Cached entries, most recently used first, after the blocks held per identity."""
    with _client(socket, config_file) as client:
        entries = [] if only_blocks else client.ls(limit)
        blocks = client.block_summary()
    if as_json:
        doc: Any = blocks if only_blocks else {"blocks": blocks, "entries": entries}
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    if blocks:
        click.echo(f"{'BLOCKS OF':16}  {'L2':>8}  {'L2 SIZE':>9}  {'L3':>8}  {'L3 SIZE':>9}")
        for b in blocks:
            click.echo(
                f"{b['identity'][:16]}  {b['l2_blocks']:>8}  {human_size(b['l2_bytes']):>9}  "
                f"{b['l3_blocks']:>8}  {human_size(b['l3_bytes']):>9}"
            )
        if entries:
            click.echo("")
    if not entries:
        if not only_blocks:
            click.echo("no entries" if not blocks else "no entries (only blocks)")
        elif not blocks:
            click.echo("no blocks")
        return
    click.echo(
        f"{'DIGEST':16}  {'IDENTITY':8}  {'TOKENS':>8}  {'KIND':14}  {'TIER':5}  {'SIZE':>9}  {'AGE':>7}"
    )
    for e in entries:
        click.echo(
            f"{e['digest'][:16]}  {str(e.get('identity', ''))[:8]:8}  {e['token_count']:>8}  {e['kind']:14}  "
            f"{e['tier']:5}  {human_size(e['nbytes']):>9}  {human_age(e['age_s']):>7}"
        )


@main.command()
@_socket_options
@click.option(
    "--digest", default=None, help="remove every entry with this payload digest (or a unique prefix: 8+ hex)"
)
@click.option("--all", "everything", is_flag=True, help="remove every entry and every block")
@click.option("--model", default=None, help="with --state and --tokens: remove the entry of this key")
@click.option("--state", default=None, help="the entry's state (with --model)")
@click.option("--namespace", default="", help="the entry's namespace (with --model)")
@click.option("--tokens", "tokens_file", default=None, help="with --model: " + TOKENS_HELP)
@click.option(
    "--blocks", "of_blocks", is_flag=True, help="with --model and --state: every block of that identity"
)
def evict(
    *,
    socket: str | None,
    config_file: str | None,
    digest: str | None,
    everything: bool,
    model: str | None,
    state: str | None,
    namespace: str,
    tokens_file: str | None,
    of_blocks: bool,
) -> None:
    """Remove entries: by payload digest (a prefix of at least 8 hex digits, as `ls` prints, will do),
    by key (--model, --state, [--namespace,] --tokens), an identity's blocks (--blocks --model --state
    [--namespace]), or all entries and blocks.

    Exit status 0 when the daemon holds none of what was named afterwards, whether this removed it or it
    was not there ("removed 0 entries"; like `rm -f`, so scripts can evict idempotently); 1 when the
    daemon could not do it (not answering, a digest prefix more than one entry has); 2 for a usage error."""
    by_key = model is not None or state is not None or tokens_file is not None
    if sum((digest is not None, everything, by_key)) != 1:
        _fail("give exactly one of --digest D, --all, or --model M --state S --tokens FILE (or --blocks)", 2)
    if of_blocks:
        if model is None or state is None or tokens_file is not None:
            _fail("evicting blocks needs --model and --state (and no --tokens)", 2)
        with _client(socket, config_file) as client:
            removed = client.evict(model=model, state=state, namespace=namespace, blocks=True)
        click.echo(f"removed {plural(removed, 'block')}")
        return
    if by_key and (model is None or state is None or tokens_file is None):
        _fail("evicting by key needs --model, --state and --tokens", 2)
    tokens = read_tokens(tokens_file) if tokens_file is not None else None
    if tokens is not None and not tokens:
        _fail(f"{tokens_file}: no tokens: an entry's key needs at least one", 2)
    if digest is not None and not (
        8 <= len(digest) <= 64 and all(c in "0123456789abcdef" for c in digest.lower())
    ):
        _fail(
            f"--digest {digest!r}: expected 8 to 64 hex digits (a payload digest or a prefix, as ls prints)",
            2,
        )
    with _client(socket, config_file) as client:
        if everything:
            removed = client.evict(all=True)
        elif digest is not None:
            try:
                removed = client.evict(digest=digest.lower())
            except NotFound as exc:  # nothing has it: already gone, as an evict of an unknown key
                click.echo(f"skippyd: {exc}", err=True)
                removed = 0
        else:
            removed = client.evict(model=model, state=state, namespace=namespace, tokens=tokens)
    click.echo(f"removed {plural(removed, 'entry')}" + (" and every block" if everything else ""))


# ----------------------------------------------------------------------------- Redis-side commands


def _redis_options(fn: F) -> F:
    for option in reversed(
        [
            click.option("--redis-url", default=None, help="Redis URL [env SKIPPYD_REDIS_URL]"),
            click.option("--socket", default=None, help="the daemon whose Redis to use [env SKIPPYD_SOCKET]"),
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
           socket: str | None = None, **table: Any) -> Any:  # fmt: skip
    """The warm table of the Redis the daemon on the socket uses (or of these flags, with none there)."""
    flags = {"redis_url": redis_url, "state_dir": state_dir, "redis_prefix": redis_prefix, "socket": socket}
    config = _settings(flags, config_file).config
    url = config.redis_url or embedded_redis_url(config.state_dir)
    if url == "none":
        _fail("this configuration runs without Redis (redis_url = none)", 2)
    from .cluster.coordination import WarmTable

    return WarmTable.from_url(url, prefix=config.redis_prefix, timeout=5.0, **table)


def read_tokens(source: str) -> list[int]:
    """Integers separated by white space or commas, or a JSON array; ``-`` is standard input.

    A missing file, a directory or bad content is one clear line and exit 2 (naming the file and the
    first token that is not a token id)."""
    name = "standard input" if source == "-" else source
    if source == "-":
        if sys.stdin.isatty():
            click.echo("skippyd: reading token ids from standard input (end with Ctrl-D)", err=True)
        text = sys.stdin.read()
    else:
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            _fail(f"--tokens: {source}: no such file", 2)
        except IsADirectoryError:
            _fail(f"--tokens: {source} is a directory, not a token file", 2)
        except UnicodeDecodeError:
            _fail(f"--tokens: {source} is not a text file of token ids", 2)
        except OSError as exc:
            _fail(f"--tokens: {source}: {exc.strerror}", 2)
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except ValueError as exc:
            _fail(f"--tokens: {name} is not a JSON array of token ids: {exc}", 2)
        if not isinstance(values, list):
            _fail(f"--tokens: {name} is not a JSON array of token ids", 2)
        items: list[Any] = values
    else:
        items = text.replace(",", " ").split()
    tokens: list[int] = []
    for position, item in enumerate(items, start=1):
        value = item
        if isinstance(item, str):
            try:
                value = int(item, 10)
            except ValueError:
                value = None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 32:
            shown = item if isinstance(item, str) else json.dumps(item)
            problem = f"token {position} is {shown[:40]!r}"
            _fail(f"--tokens: {name}: {problem}; token ids are integers, 0 to 2**32-1", 2)
        tokens.append(value)
    return tokens


@main.group()
def warm() -> None:
    """The warm-prefix table: which node last ran each prompt prefix."""


@warm.command(name="ran")
@_redis_options
@click.option("--model", required=True, help="model identity")
@click.option("--node", required=True, help="the node that ran the prompt")
@click.option("--tokens", "tokens_file", default="-", show_default=True, help=TOKENS_HELP)
@click.option("--block", default=64, show_default=True, help="tokens per block")
def warm_ran(model: str, node: str, tokens_file: str, block: int, **redis: Any) -> None:
    """Record that NODE ran this prompt."""
    tokens = read_tokens(tokens_file)
    _table(**redis, block=block).ran(model, tokens, node)
    click.echo(f"recorded {len(tokens) // block} block(s) for {node}")


@warm.command(name="warmest")
@_redis_options
@click.option("--model", required=True, help="model identity")
@click.option("--tokens", "tokens_file", default="-", show_default=True, help=TOKENS_HELP)
@click.option("--block", default=64, show_default=True, help="tokens per block")
@click.option("--min-blocks", default=2, show_default=True, help="shorter answers are no answer")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def warm_warmest(
    model: str, tokens_file: str, block: int, min_blocks: int, as_json: bool, **redis: Any
) -> None:
    """The node that ran the longest remembered prefix of this prompt, and its length in tokens (whole
    blocks of --block tokens).

    A node whose heartbeat expired, or that `warm forget` removed, is stepped over (a shorter prefix
    another node ran can be the answer). A node that never registered (named only by `warm ran`, as a
    static setup feeds the table) counts as live: it can be the answer."""
    tokens = read_tokens(tokens_file)
    found = _table(**redis, block=block, min_blocks=min_blocks).warmest(model, tokens)
    if as_json:
        doc = {"node": found[0], "tokens": found[1]} if found else {"node": None, "tokens": 0}
        click.echo(json.dumps(doc))
    elif found:
        click.echo(f"{found[0]} {found[1]}")
    else:
        click.echo("no warm prefix")


def _parse_loads(pairs: tuple[str, ...]) -> dict[str, float] | None:
    if not pairs:
        return None
    loads: dict[str, float] = {}
    for pair in pairs:
        node, sep, value = pair.partition("=")
        try:
            loads[node] = float(value) if sep else float("nan")
        except ValueError:
            loads[node] = float("nan")
        if not sep or not 0 <= loads[node] < float("inf"):
            _fail(f"--load {pair!r}: expected NODE=LOAD with LOAD a number >= 0 (e.g. gpu-3=12)", 2)
    return loads


@warm.command(name="route")
@_redis_options
@click.option("--model", required=True, help="model identity")
@click.option("--tokens", "tokens_file", default="-", show_default=True, help=TOKENS_HELP)
@click.option(
    "--node", "candidates", multiple=True, help="a candidate node (repeat; default: every live node)"
)
@click.option("--load", "load_pairs", multiple=True, help="NODE=LOAD, e.g. running requests (repeat)")
@click.option("--block", default=64, show_default=True, help="tokens per block")
@click.option("--min-blocks", default=2, show_default=True, help="shorter prefixes count as none")
@click.option("--balance-abs", default=8.0, show_default=True, help="load gap that may overrule warmth")
@click.option("--balance-rel", default=1.5, show_default=True, help="load ratio that may overrule warmth")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def warm_route(
    *,
    model: str, tokens_file: str, candidates: tuple[str, ...], load_pairs: tuple[str, ...], block: int,
    min_blocks: int, balance_abs: float, balance_rel: float, as_json: bool, **redis: Any,
) -> None:  # fmt: skip
    """Where a router should run this prompt: the warmest live node unless it is overloaded."""
    tokens = read_tokens(tokens_file)
    loads = _parse_loads(load_pairs)
    table = _table(**redis, block=block, min_blocks=min_blocks, balance_abs=balance_abs,
                   balance_rel=balance_rel)  # fmt: skip
    route = table.route(model, tokens, list(candidates) or None, loads=loads)
    if as_json:
        click.echo(
            json.dumps({"node": route.node, "prefix_tokens": route.prefix_tokens, "reason": route.reason})
        )
    else:
        click.echo(f"{route.node} {route.prefix_tokens} {route.reason}")


@warm.command(name="script")
@click.argument("which", type=click.Choice(["route", "warmest"]))
@click.option("--sha", is_flag=True, help="print only its SHA1 (the name EVALSHA takes)")
def warm_script(which: str, sha: bool) -> None:
    """Print the Lua script Redis runs for `warm route` or `warm warmest` (for a router in another
    language: its header names the keys and arguments; load it once with SCRIPT LOAD, then EVALSHA)."""
    import hashlib

    from .cluster.coordination import script_text

    text = script_text(f"warm_{which}.lua")
    click.echo(hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest() if sha else text, nl=sha)


@warm.command(name="migrate")
@_redis_options
def warm_migrate(**redis: Any) -> None:
    """Move a table of schema version 1 (one hash slot) to the sharded layout."""
    report = _table(**redis).migrate_legacy()
    click.echo(
        f"migrated: {report.nodes_copied} node registration(s) copied, {report.prefixes_dropped} "
        f"version-1 prefix(es) dropped (the table refills as nodes run prompts), "
        f"{report.keys_removed} old key(s) removed"
    )


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
    "block_packs_quarantined",
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
@click.option(
    "--state-dir",
    default=None,
    help="its default parent (default: the nearest ./.skippyd, else /var/lib/skippyd) "
    "[env SKIPPYD_STATE_DIR]",
)
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
        loaded = load_config({"l3_dir": l3_dir, "state_dir": state_dir}, config_file=config_file)
    except ConfigError as exc:
        _fail(str(exc), 2)
    config = loaded.config
    if all(loaded.sources.get(name) == "default" for name in ("l3_dir", "state_dir")):
        local = local_state_dir()  # in a checkout: the store of the daemon scripts/run.sh runs there
        if local is not None:
            config = replace(config, state_dir=str(local))
            if not as_json:
                click.echo(f"skippyd: the store of this checkout's daemon ({local})", err=True)
    path = config.l3_path
    if path is None:
        _fail("L3 is turned off in this configuration (l3_dir = off)", 2)
    if not path.exists():
        _fail(f"{path} does not exist", 2)
    from rich.progress import Progress

    from .l3 import L3Store

    try:
        store = L3Store(path, config.l3_budget, min_free_bytes=0)
    except StoreLocked as exc:
        _fail(f"{exc}; stop the daemon first (or read `skippyd stats` for the live store)", 1)
    except (SkippydError, OSError) as exc:
        _fail(f"{path}: {exc}", 1)
    with store, Progress(transient=True, disable=as_json or not sys.stderr.isatty()) as progress:
        task = progress.add_task("verifying objects" if verify else "reconciling", total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        try:
            report = store.reconcile(verify_objects=verify, progress=advance)  # once, with or without hashing
        except OSError as exc:
            _fail(f"{path}: {exc}", 1)
    doc = report.as_dict()
    repairs = [k for k in _REPAIRS if doc[k]]
    clean = not report.problems and not repairs
    if as_json:
        click.echo(json.dumps({"clean": clean, **doc}, indent=2))
    else:
        click.echo(
            f"{path}: {plural(report.manifests, 'entry')}, {plural(report.objects, 'object')}, "
            f"{report.verified} verified; {plural(report.blocks, 'block')}, {report.blocks_verified} verified"
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


_SIZES = frozenset(name for name, spec in FIELDS.items() if spec.parse is parse_size)
_RATES = ("l2_reserve_rate",)


def _shown(name: str, value: Any) -> str:
    if name in _SIZES and value:  # every size the same way: bytes, then in units
        return f"{value} ({human_size(value)})"
    if name in _RATES and value:
        return f"{value} ({human_size(value)}/s)"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "(none)"
    if value == "":
        return "(unset)"
    return str(value)


@config_group.command(name="show")
@click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@click.option(
    "--local", is_flag=True, help="what `skippyd serve` would use with these flags, not the running daemon's"
)
@_config_options(_SERVE_FLAGS)
def config_show(config_file: str | None, as_json: bool, local: bool, **flags: Any) -> None:
    """Every setting and where it came from: the running daemon's when one answers on the socket (flags
    given here still win), else what `skippyd serve` would use with these flags (--local: always that)."""
    settings = _settings(flags, config_file, local=local)
    config = settings.config
    derived = derived_settings(config)
    if as_json:
        doc = {
            "values": config_values(config),
            "sources": settings.sources,
            "derived": derived,
            "daemon": settings.daemon,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(
        f"# the daemon on {settings.daemon}" if settings.daemon else "# what `skippyd serve` would use here"
    )
    width = max(len(name) for name in FIELDS)
    for name in FIELDS:
        value = _shown(name, getattr(config, name))
        click.echo(f"{name:<{width}}  {value:<28}  # {settings.sources.get(name, 'default')}")
    for name, value in derived.items():
        click.echo(f"# {name} (effective): {value}")


@main.command()
@click.option("--config", "config_file", default=None, help="TOML config file [env SKIPPYD_CONFIG]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
@click.option(
    "--gpu", is_flag=True,
    help="also check the GPU data path: torch and its device, cudaHostRegister of tmpfs, restores "
    "through the daemon to the device (bit-exact, rate beside a pinned copy)",
)  # fmt: skip
@click.option(
    "--python", "python", default=sys.executable, show_default="this Python",
    help="with --gpu: the engine's Python (with torch and skippyd), where the probe runs",
)  # fmt: skip
@click.option("--gpu-mib", default=256, show_default=True, type=click.IntRange(1, 1 << 16),
              help="with --gpu: MiB each timed copy moves")  # fmt: skip
@_config_options(_SERVE_FLAGS)
def doctor(
    config_file: str | None, as_json: bool, gpu: bool, python: str, gpu_mib: int, **flags: Any
) -> None:
    """Check this host's setup; one line per finding, with the fix. Exit 1 if anything is wrong.

    With a daemon answering on the socket, its own settings are checked (flags given here still win).
    """
    from .doctor import FAIL, check_gpu, diagnose

    settings = _settings(flags, config_file)
    config = replace(settings.config, socket=settings.socket)
    from .client import Client

    daemon = None
    with Client(config.socket, timeout=5.0, connect_timeout=2.0) as client:
        try:
            from .stats import Snapshot

            daemon = Snapshot.from_wire(client.stats())
        except (ConnectionLost, Timeout):
            daemon = None
        except SkippydError as exc:
            click.echo(f"skippyd: the daemon answered with an error: {exc}", err=True)
    findings = diagnose(config, daemon)
    if gpu:
        findings += check_gpu(python, str(config.socket), mib=gpu_mib)
    if as_json:
        click.echo(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for finding in findings:
            click.echo(finding.line())
    sys.exit(1 if any(f.level == FAIL for f in findings) else 0)


_MIN_INTERVAL = 0.1


def _interval(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    if not math.isfinite(value) or value < _MIN_INTERVAL:
        raise click.BadParameter(f"{value} is not a refresh interval: give seconds, at least {_MIN_INTERVAL}")
    return value


@main.command()
@_socket_options
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    callback=_interval,
    help=f"seconds between refreshes (at least {_MIN_INTERVAL})",
)
@click.option("--once", is_flag=True, help="print one view and exit")
def top(socket: str | None, config_file: str | None, interval: float, once: bool) -> None:
    """A live view of hit rates, bytes and latencies, refreshed every second (--interval).

    On a terminal the view is redrawn in place; when the output is piped or redirected, one view is
    printed after another, each after a blank line, until interrupted."""
    from rich.console import Console
    from rich.live import Live

    from .stats import Snapshot
    from .top import render

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # (rich would exit 1) the reader left: stop quietly, below
            self.quiet = True
            raise BrokenPipeError

    client = _client(socket, config_file, timeout=5.0)
    console = _Console()
    with client:
        current = Snapshot.from_wire(client.stats())
        if once:
            console.print(render(current, None, interval))
            return
        try:
            if not console.is_terminal:  # a pipe or a file: plain views, one after another
                console.print(render(current, None, interval))
                sys.stdout.flush()
                while True:
                    time.sleep(interval)
                    previous, current = current, Snapshot.from_wire(client.stats())
                    console.print()
                    console.print(render(current, previous, interval))
                    sys.stdout.flush()
            with Live(render(current, None, interval), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    previous, current = current, Snapshot.from_wire(client.stats())
                    live.update(render(current, previous, interval))
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `skippyd top | head`: the reader is gone, so is the view
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except SkippydError as exc:
            _fail(str(exc))


# Options that select what a destructive command destroys are never taken from the environment, nor
# a router's candidates and loads (SKIPPYD_NODE names a daemon host's own node).
_NO_ENV = {("evict", "everything"), ("evict", "digest"), ("route", "candidates"), ("route", "load_pairs")}


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
