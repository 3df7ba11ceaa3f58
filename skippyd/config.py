"""The daemon's configuration: one frozen dataclass, one precedence.

flags > ``SKIPPYD_<OPTION>`` environment > TOML ``--config`` file > defaults. Every value remembers where
it came from (``skippyd config show``), and a bad value fails at start with a message naming its key and
its source. Sizes take bytes or units (``512MiB``, ``8GiB``, ``1.5GB``); durations take ``500ms``,
``30s``, ``10m``, ``2h`` or plain seconds.
"""

from __future__ import annotations

import os
import re
import socket as _socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from blake3 import blake3

from .errors import ConfigError
from .locate import DEFAULT_SOCKET

__all__ = [
    "FIELDS",
    "Config",
    "ConfigField",
    "LoadedConfig",
    "human_size",
    "load_config",
    "parse_addr",
    "parse_duration",
    "parse_size",
]

ENV_PREFIX = "SKIPPYD_"
DEFAULT_STATE_DIR = "/var/lib/skippyd"
#: The smallest budget that holds one entry: its header page and one page of data.
MIN_BUDGET = 8 << 10
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: The Redis URL schemes skippyd speaks (``redis+cluster://`` is a Redis Cluster seed node).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")


def valid_node_name(name: object) -> bool:
    """A node name: 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    return isinstance(name, str) and bool(_NODE_RE.match(name))


def valid_redis_url(url: object) -> bool:
    return isinstance(url, str) and url.startswith(REDIS_SCHEMES)


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATIONS = {"ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def human_size(n: float) -> str:
    """Bytes for people: binary units, one decimal (what ``ls``, ``doctor``, ``top`` and ``config show``
    print; :func:`parse_size` reads it back)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(value: Any) -> int:
    """Bytes from an int or a string with a unit (KiB/MiB/GiB/TiB binary, KB/MB/GB/TB decimal)."""
    if isinstance(value, bool):
        raise ValueError("a size is not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size (try 512MiB or 8GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as ``500ms``, ``30s``, ``10m``, ``2h``."""
    if isinstance(value, bool):
        raise ValueError("a duration is not a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    match = _DURATION_RE.match(str(value).lower())
    if not match or match.group(2) not in _DURATIONS:
        raise ValueError(f"{value!r} is not a duration (try 30s or 10m)")
    return float(match.group(1)) * _DURATIONS[match.group(2)]


def _parse_rate(value: Any) -> int:
    """Bytes per second from a size, optionally written with ``/s`` (``256MiB/s``)."""
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.lower().endswith("/s"):
        text = text[:-2]
    return parse_size(text)


def _parse_share(value: Any) -> float:
    """A fraction from 0 to 1 (``0.25``, or ``25%``)."""
    text = str(value).strip()
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a share (try 0.25 or 25%)") from None
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{value!r} is not a share from 0 to 1")
    return share


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{value!r} is not a boolean")


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("not an integer")
    result = int(value)
    if result < 0:
        raise ValueError("must not be negative")
    return result


def _parse_ids(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list | tuple) else [v for v in re.split(r"[,\s]+", str(value)) if v]
    return tuple(_parse_int(v) for v in items)


def _parse_str(value: Any) -> str:
    if not isinstance(value, str | int):
        raise ValueError(f"{value!r} is not text")
    return str(value)


def _parse_path(value: Any) -> str:
    """An absolute path (``~`` expanded, relative paths taken from the working directory once, here):
    the daemon, its redis-server and a URL built from the path all agree on what it names."""
    text = _parse_str(value)
    return os.path.abspath(os.path.expanduser(text)) if text else ""


def _parse_dir_or_off(value: Any) -> str:
    text = _parse_str(value)
    return "off" if text.strip().lower() == "off" else _parse_path(text)


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:9400``, ``:9400`` for every address) for the metrics endpoint."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{addr!r} is not host:port (try 127.0.0.1:9400)")
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"{addr!r}: port {number} is out of range")
    return (host.strip("[]") or "0.0.0.0"), number  # noqa: S104 - the operator chose to expose it


def _parse_addr(value: Any) -> str:
    text = _parse_str(value).strip()
    if text:
        parse_addr(text)
    return text


def _parse_choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return text

    return parse


def _parse_node(value: Any) -> str:
    text = _parse_str(value)
    if text and not valid_node_name(text):
        raise ValueError(f"{text!r}: node names are letters, digits, '.', '_' and '-' (at most 128)")
    return text


@dataclass(frozen=True)
class ConfigField:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def _option(parse: Callable[[Any], Any], default: Any, help_text: str) -> Any:
    """A setting: its parser, its default as a user would write it, its help. The dataclass field's
    default is that text parsed, so the two can never disagree."""
    return field(default=parse(default), metadata={"parse": parse, "default": default, "help": help_text})


@dataclass(frozen=True)
class Config:
    """Every setting of the daemon (``skippyd serve --help`` lists them; :data:`FIELDS` is derived)."""

    socket: str = _option(_parse_path, DEFAULT_SOCKET, "Unix socket the daemon listens on")
    state_dir: str = _option(_parse_path, DEFAULT_STATE_DIR, "embedded Redis data, default L3 dir")
    shm_dir: str = _option(
        _parse_path, "", "L2 tmpfs directory (default: under /dev/shm, by node and state dir)"
    )
    l2_budget: int = _option(parse_size, "4GiB", "bytes the L2 tier may hold in tmpfs")
    max_entry: int = _option(parse_size, 0, "largest entry accepted (0: the L2 budget)")
    l2_reserve: int = _option(
        parse_size,
        "256MiB",
        "cap on the free pre-faulted L2 memory kept ready for puts and captures (at most a quarter of the "
        "budget; 0: no reserve thread)",
    )
    l2_reserve_window: float = _option(
        parse_duration,
        "10s",
        "the reserve keeps ready what puts and captures took in this window (within l2_reserve) and gives "
        "the rest back: it decays to nothing this long after demand stops",
    )
    l2_reserve_rate: int = _option(
        _parse_rate,
        "256MiB/s",
        "bytes per second the reserve faults in at most (faulting costs ≈ 1 s of a core per GB; 0: no cap)",
    )
    l2_reserve_share: float = _option(
        _parse_share,
        "0.25",
        "share of the time the reserve may spend faulting (it rests 3× what each fault took at 0.25, so it "
        "backs off when a loaded machine makes faults slow; 0: no cap)",
    )
    l2_digest_backlog: int = _option(
        parse_size,
        "256MiB",
        "block bytes a put may commit before their BLAKE3 digest, hashed in the background (0: every put "
        "hashes its blocks before it answers)",
    )
    staging_budget: int = _option(parse_size, "2GiB", "shared memory lent to clients for captures")
    fill_budget: int = _option(parse_size, "2GiB", "memory for L3 restores while L2 has no free room (memfd)")
    l3_dir: str = _option(_parse_dir_or_off, "", "L3 disk directory (default <state_dir>/l3; 'off' disables)")
    l3_budget: int = _option(parse_size, "64GiB", "hard cap on bytes L3 keeps on disk")
    l3_min_free: int = _option(parse_size, "2GiB", "L3 goes read-only below this much free disk")
    l3_queue: int = _option(_parse_int, 64, "durable writes holding L2 memory (more wait as keys)")
    l3_block_admission: str = _option(
        _parse_choice("always", "second-put"),
        "always",
        "blocks of durable puts go to L3 always, or on a second put within promotion_window (SSD wear)",
    )
    sync_timeout: float = _option(
        parse_duration, "20s", 'how long a durable="sync" capture waits for its fsync'
    )
    redis_url: str = _option(_parse_str, "", "shared Redis (redis://, rediss://, unix://, redis+cluster://)")
    redis_prefix: str = _option(_parse_str, "skippyd", "prefix of every Redis key")
    redis_timeout: float = _option(parse_duration, "250ms", "coordination calls give up after this")
    node: str = _option(_parse_node, "", "this daemon's stable name (default the host name)")
    heartbeat: float = _option(parse_duration, "2s", "how often the node heartbeats to Redis")
    node_ttl: float = _option(parse_duration, "10s", "a node missing heartbeats this long is gone")
    warm_on_capture: bool = _option(_parse_bool, True, "every capture also feeds the warm-prefix table")
    ran_buffer: int = _option(_parse_int, 10000, "warm-table updates kept while Redis is down")
    promotion_scope: str = _option(_parse_str, "", "scope promotions are counted in (default the node)")
    promotion_window: float = _option(
        parse_duration, "10m", "a second L3 hit within this long promotes into L2"
    )
    promotion_max_bytes: int = _option(
        parse_size, "64MiB", "larger entries are never promoted from L3 into L2"
    )
    promotion_worth_tokens: int = _option(_parse_int, 4096, "entries this long promote on their first L3 hit")
    promotion_max_observations: int = _option(_parse_int, 4096, "promotion observations kept per scope")
    max_frame: int = _option(parse_size, "16MiB", "largest protocol frame accepted")
    max_buffered: int = _option(
        parse_size, "512MiB", "request bytes buffered (half-sent or queued), all clients"
    )
    workers: int = _option(
        _parse_int, 0, "threads serving requests that copy, hash or read the disk (0: auto)"
    )
    copy_threads: int = _option(
        _parse_int, 0, "threads one large copy or hash is split over (0: auto, half the CPUs, 2 to 8)"
    )
    allowed_uids: tuple[int, ...] = _option(
        _parse_ids, (), "peer uids allowed (default: owner, root, socket group)"
    )
    allowed_gids: tuple[int, ...] = _option(
        _parse_ids, (), "peer gids allowed (default: owner, root, socket group)"
    )
    socket_group: str = _option(_parse_str, "", "group the socket is handed to (mode 0660)")
    shutdown_timeout: float = _option(parse_duration, "10s", "time in-flight requests get at shutdown")
    idle_timeout: float = _option(parse_duration, 0, "close connections idle this long (0: never)")
    frame_timeout: float = _option(parse_duration, "30s", "a request must arrive whole within this long")
    log_level: str = _option(_parse_choice("debug", "info", "warning", "error"), "info", "log level")
    log_format: str = _option(_parse_choice("human", "json"), "human", "log line format")
    metrics_addr: str = _option(_parse_addr, "", "host:port for Prometheus metrics (off by default)")

    # ------------------------------------------------------------ derived values
    @property
    def node_name(self) -> str:
        return self.node or _default_node()

    @property
    def shm_path(self) -> Path:
        """The L2 directory: ``shm_dir``, else one under /dev/shm derived from the node and the state
        directory, so two daemons with their own state directories never share a tmpfs directory (the
        system-wide state directory keeps the plain ``skippyd-<node>``)."""
        if self.shm_dir:
            return Path(self.shm_dir)
        name = f"skippyd-{self.node_name}"
        if self.state_dir != DEFAULT_STATE_DIR:
            name += "-" + blake3(os.fsencode(self.state_dir)).hexdigest()[:8]
        return Path("/dev/shm") / name  # noqa: S108

    @property
    def l3_path(self) -> Path | None:
        if self.l3_dir == "off":
            return None
        return Path(self.l3_dir) if self.l3_dir else Path(self.state_dir) / "l3"

    @property
    def socket_mode(self) -> int:
        """0660 (owner and the socket's group), or 0666 when ``allowed_uids``/``allowed_gids`` name who
        may connect: the kernel then lets any local user reach the socket, and the daemon serves only
        the peers those lists allow (and root and its own user), by their credentials (SO_PEERCRED)."""
        return 0o666 if self.allowed_uids or self.allowed_gids else 0o660

    @property
    def entry_limit(self) -> int:
        return min(self.max_entry or self.l2_budget, self.l2_budget)

    @property
    def worker_threads(self) -> int:
        return self.workers or min(32, (os.cpu_count() or 2) * 4)

    @property
    def copy_thread_count(self) -> int:
        """``copy_threads``, or half the CPUs this process may use (2 to 8): a put's or capture's copy out
        of staging and its BLAKE3 are what bound them from a GPU (one core copies ≈ 5 GB/s on the GPU
        hosts measured, the PCIe link moves 53), and the CPUs of a GPU host are otherwise the engine's."""
        return self.copy_threads or max(2, min(8, _usable_cpus() // 2))

    @property
    def scope(self) -> str:
        return self.promotion_scope or f"node:{self.node_name}"


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a systemd unit's CPU set)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 2


FIELDS: dict[str, ConfigField] = {
    f.name: ConfigField(f.name, f.metadata["parse"], f.metadata["default"], f.metadata["help"])
    for f in fields(Config)
}


def _default_node() -> str:
    name = _socket.gethostname().split(".")[0] or "localhost"
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", name)[:128]
    return cleaned if valid_node_name(cleaned) else "localhost"


@dataclass(frozen=True)
class LoadedConfig:
    config: Config
    sources: Mapping[str, str]  # name -> "flag", "env SKIPPYD_X", "file PATH" or "default"
    config_file: Path | None


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    table = data.get("skippyd", data) if isinstance(data.get("skippyd"), dict) else data
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}")
    return dict(table)


def load_config(
    flags: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> LoadedConfig:
    """Resolves every field by precedence and validates it; raises :class:`ConfigError` naming the key."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    env = os.environ if env is None else env
    unknown_flags = sorted(set(flags) - set(FIELDS))
    if unknown_flags:
        raise ConfigError(f"unknown option(s): {', '.join(unknown_flags)}")
    file_path = config_file if config_file is not None else env.get(ENV_PREFIX + "CONFIG") or None
    path = Path(file_path) if file_path else None
    file_values = _load_toml(path) if path is not None else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    raws: dict[str, Any] = {}
    for name, spec in FIELDS.items():
        if name in flags:
            raw, source = flags[name], "flag"
        elif env.get(spec.env, ""):  # an empty variable counts as unset
            raw, source = env[spec.env], f"env {spec.env}"
        elif name in file_values:
            raw, source = file_values[name], f"file {path}"
        else:
            raw, source = spec.default, "default"
        raws[name] = raw
        try:
            values[name] = spec.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"invalid {name} (from {source}): {exc}") from exc
        sources[name] = source
    config = Config(**values)
    _check(config, raw=raws)
    return LoadedConfig(config, sources, path)


_BUDGETS = ("l2_budget", "l3_budget", "staging_budget")


def _check(config: Config, raw: Mapping[str, Any] | None = None) -> None:
    """What no single value says wrong: budgets too small to hold one entry, an entry limit no budget
    could hold, timings that contradict each other. ``raw`` holds the budgets as they were written
    (a bare number like ``8`` most likely meant ``8GiB``: the hint says so)."""
    for name in _BUDGETS:
        value = getattr(config, name)
        if value < MIN_BUDGET:
            written = str((raw or {}).get(name, "")).strip()
            if 0 < value <= 1024 and written.isdigit():
                hint = f"sizes take units: did you mean {value}GiB?"
            else:
                hint = f"give a size such as {FIELDS[name].default}"
            shown = "0 bytes" if value == 0 else human_size(value)
            raise ConfigError(
                f"invalid {name}: {shown} is smaller than one entry ({human_size(MIN_BUDGET)}); {hint}"
            )
    if config.max_entry > config.l2_budget:
        raise ConfigError(
            f"invalid max_entry: {human_size(config.max_entry)} is larger than the L2 budget "
            f"({human_size(config.l2_budget)}), which could never hold such an entry; "
            "set --max-entry at most --l2-budget (0: the L2 budget)"
        )
    l3 = config.l3_path
    if l3 is not None and os.path.abspath(l3) == os.path.abspath(config.shm_path):
        raise ConfigError(
            f"invalid l3_dir: {l3} is the L2 directory too; L3 is the durable tier and belongs on a disk "
            "(give --l3-dir a directory of its own, or off)"
        )
    if config.max_frame < 64 * 1024:
        raise ConfigError("invalid max_frame: must be at least 64KiB")
    if len(os.fsencode(config.socket)) >= 108:
        raise ConfigError(f"invalid socket: {config.socket!r} is longer than a unix socket path may be")
    if config.frame_timeout <= 0:
        raise ConfigError("invalid frame_timeout: must be positive")
    if config.heartbeat <= 0 or config.node_ttl <= config.heartbeat:
        raise ConfigError("invalid node_ttl: must be longer than heartbeat")
    if config.redis_url not in ("", "none") and not valid_redis_url(config.redis_url):
        raise ConfigError("invalid redis_url: use redis://, rediss://, unix://, redis+cluster:// or none")


def as_dict(config: Config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def config_values(config: Config) -> dict[str, Any]:
    """Every setting as plain JSON/msgpack values (what the daemon's ``config`` request answers)."""
    return {name: list(v) if isinstance(v := getattr(config, name), tuple) else v for name in FIELDS}


def config_from_values(values: Mapping[str, Any]) -> Config:
    """A :class:`Config` from :func:`config_values` (a daemon's answer), checked like any other."""
    known = {name: values[name] for name in FIELDS if name in values}
    for name in ("allowed_uids", "allowed_gids"):
        if name in known:
            known[name] = tuple(known[name])
    return Config(**known)


def embedded_redis_socket(state_dir: str | os.PathLike[str]) -> Path:
    """Where the embedded redis-server of a state directory listens (the one place this is built)."""
    return Path(state_dir) / "redis" / "redis.sock"


def embedded_redis_url(state_dir: str | os.PathLike[str]) -> str:
    """The unix:// URL of the embedded redis-server of a state directory."""
    return f"unix://{embedded_redis_socket(state_dir)}"


def derived_settings(config: Config) -> dict[str, str]:
    """What the settings imply: the node, the directories and the Redis actually used."""
    return {
        "node": config.node_name,
        "shm_dir": str(config.shm_path),
        "l3_dir": str(config.l3_path) if config.l3_path else "off",
        "redis_url": config.redis_url or embedded_redis_url(config.state_dir),
        "promotion_scope": config.scope,
        "copy_threads": str(config.copy_thread_count),
    }
