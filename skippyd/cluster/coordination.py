"""The cluster's shared facts in Redis: the warm-prefix table, node liveness and promotion counts.

The only module that imports ``redis``. Each fact changes through one Lua script (``skippyd/lua/``),
so it is atomic on a single Redis, a shared one and a Redis Cluster alike (every script's keys share a
hash slot; key names come from :mod:`skippyd.cluster.rediskeys`). Redis errors become
:class:`~skippyd.errors.CoordinationUnavailable` here, at the boundary.

* :class:`WarmTable` — the seed's ``Warm`` (superfluid ``fleet_warm``): which node last ran each prompt
  prefix, sharded over hash slots by each prompt's model and first block; ``warmest`` and ``route`` (the
  warmest live candidate unless the router's loads make it overloaded, :func:`choose_route`) are one
  round trip and a binary search inside Redis (docs/routing.md).
* :class:`Promotions` — the seed's ``should_promote``/``promote``, counted in Redis on Redis's clock
  by every process that shares a scope; :class:`LocalPromotions` is the same rules in-process.
* :class:`Coordinator` — the daemon's side: registers its node and heartbeats, sends ``ran`` updates in
  batches from a background thread, and falls back to local promotion counting while Redis is away,
  so no request ever waits on Redis.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import redis
import redis.cluster
import redis.exceptions
from blake3 import blake3
from redis.backoff import NoBackoff
from redis.retry import Retry

from skippyd.config import valid_node_name, valid_redis_url
from skippyd.errors import (
    CoordinationTimeout,
    CoordinationUnavailable,
    InvalidArgument,
    NotFound,
    SkippydError,
)
from skippyd.keys import WARM_HASH_BYTES, encode_tokens, warm_chain
from skippyd.workers import Health

from .rediskeys import MAX_WARM_SHARDS, WARM_SHARDS, RedisKeys, WarmShard

__all__ = [
    "DEFAULT_PROMOTION",
    "Coordinator",
    "LocalPromotions",
    "MigrationReport",
    "NodeInfo",
    "PromotionSettings",
    "Promotions",
    "Route",
    "WarmTable",
    "choose_route",
    "connect",
    "lua_source",
    "script_text",
    "server_version",
]

log = logging.getLogger("skippyd.cluster.coordination")

THREAD = "skippyd-coordination"

BATCH_BYTES = 64 << 10  # chain bytes per warm-table batch: ~0.1 ms of Redis time per 64 KB of argument
BATCH_TIMEOUT_S = 2.0  # a batch's own timeout (single calls keep --redis-timeout)
#: Calls a client request makes (promotion and admission counts, on the request's worker) give up after
#: this (or --redis-timeout, if shorter), and one slower than SLOW_CALL_S sends those of the next
#: SLOW_PAUSE_S to local counting: a Redis busy with others' work (but answering within its timeout, so
#: never degraded) made every put wait for it, each in turn.
REQUEST_TIMEOUT_S = 0.1
SLOW_CALL_S = 0.02
SLOW_PAUSE_S = 5.0
BATCH_MARKER_S = 600.0  # how long Redis remembers an applied batch id (a re-send within it is a no-op)
RedisClient = Any  # redis.Redis | redis.cluster.RedisCluster


def new_batch_id() -> str:
    """A fresh id for one ``ran`` batch (the marker that makes sending it again harmless)."""
    return os.urandom(16).hex()


def _check_node(node: str) -> str:
    if not valid_node_name(node):
        raise InvalidArgument(f"node names are 1-128 letters, digits, '.', '_' or '-'; got {node!r}")
    return node


#: What redis-py raises: its cluster errors (RedisClusterException, RedisClusterUnreachableError) are no
#: RedisError, and would otherwise escape as untyped errors (and stop a daemon at start).
_REDIS_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)


def connect(url: str, *, timeout: float = 1.0, lazy: bool = False) -> RedisClient:
    """A redis-py client for ``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://host:port``.

    A cluster client reads the cluster's topology when it is made: with ``lazy`` (the daemon's) it is
    made at its first use, and again at each use until that works, so a daemon whose cluster is away
    starts degraded and serves, as it does when a single Redis is away (that client connects lazily)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry_on_timeout": False,
    }
    try:
        if url.startswith("redis+cluster://"):
            # No retries inside redis-py (it would re-send a call after a timeout, and take several
            # timeouts to give up): the coordinator retries with backoff, its batches carry ids, and a
            # redirection (MOVED/ASK) is followed regardless of this setting.
            def make() -> Any:
                return redis.cluster.RedisCluster.from_url(
                    "redis://" + url.removeprefix("redis+cluster://"), retry=Retry(NoBackoff(), 0), **options
                )

            return _LazyCluster(make) if lazy else make()
        if not valid_redis_url(url):
            raise InvalidArgument(f"unsupported Redis URL {url!r}")
        return redis.Redis.from_url(url, **options)
    except _REDIS_ERRORS as exc:
        raise CoordinationUnavailable(f"cannot reach Redis at {url}: {exc}") from exc


class _LazyCluster:
    """A Redis Cluster client made at its first use (see :func:`connect`); until it can be made, every
    use raises what making it raised (inside the callers' :func:`_redis_errors`: a typed error)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()

    def made(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.made(), name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def server_version(url: str, timeout: float = 2.0) -> str:
    """The version a Redis reports (``INFO server``); unreachable is :class:`CoordinationUnavailable`."""
    client = connect(url, timeout=timeout)
    try:
        with _redis_errors(f"Redis at {url} did not answer"):
            return str(client.info("server").get("redis_version", "0"))
    finally:
        with contextlib.suppress(Exception):
            client.close()


def lua_source(name: str) -> str:
    """The text of one script of ``lua/``: packed into the wheel as ``skippyd/lua/``, read from the
    checkout's top-level ``lua/`` when running from source."""
    packed = resources.files("skippyd").joinpath("lua", name)
    if packed.is_file():
        return packed.read_text()
    return (Path(__file__).resolve().parents[2] / "lua" / name).read_text()


class _Scripts:
    """The scripts one client runs, registered with redis-py (sent by SHA, reloaded on NOSCRIPT, on
    every primary of a cluster)."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._scripts: dict[str, Any] = {}

    def _script(self, name: str) -> Any:
        registered = self._scripts.get(name)
        if registered is None:
            registered = self._scripts[name] = self._client.register_script(script_text(name))
        return registered

    def __call__(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self._script(name)(keys=list(keys), args=list(args))

    def many(self, name: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        """One script over several key sets (shards) in one pipeline: one round trip on a single Redis,
        one per primary on a cluster. A call answered NOSCRIPT did not run; it is sent again by itself
        (which loads the script). Any other error is raised after the pipeline.

        Not atomic: an error leaves some shards applied and others not. That is safe to retry: a ``ran``
        batch carries its id as a per-shard marker (applied once per shard), and node_mark.lua sets a
        record, so sending the same calls again converges."""
        if len(calls) == 1:
            keys, args = calls[0]
            return [self(name, keys, args)]
        script = self._script(name)
        pipe = self._client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        answers = list(pipe.execute(raise_on_error=False))
        for i, answer in enumerate(answers):
            if isinstance(answer, redis.exceptions.NoScriptError):
                keys, args = calls[i]
                answers[i] = self(name, keys, args)
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        return answers


_INCLUDE = re.compile(r"^--! include (\S+\.lib\.lua)$", re.MULTILINE)


@functools.cache
def script_text(name: str) -> str:
    """What Redis runs for script ``name``: its text with each ``--! include <x>.lib.lua`` line replaced
    by that library's text (code two scripts share, kept once; a library includes nothing itself)."""

    def included(match: re.Match[str]) -> str:
        text = lua_source(match.group(1))
        if _INCLUDE.search(text):
            raise ValueError(f"{match.group(1)} includes another library (one level only)")
        return text.rstrip("\n")

    return _INCLUDE.sub(included, lua_source(name))


@contextlib.contextmanager
def _redis_errors(what: str) -> Any:
    try:
        yield
    except _REDIS_ERRORS as exc:
        if _timed_out(exc):  # (redis-py's cluster client wraps a timeout refreshing its slots map, too)
            raise CoordinationTimeout(f"{what}: Redis did not answer in time ({exc})") from exc
        raise CoordinationUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


def _timed_out(exc: BaseException) -> bool:
    """Whether a timeout is what ``exc`` came of (its causes, a few deep)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, (redis.exceptions.TimeoutError, TimeoutError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class NodeInfo:
    """A registered node as Redis sees it (times are Redis's clock, in ms)."""

    node: str
    incarnation: int
    last_heartbeat_ms: int
    ttl_ms: int
    alive: bool
    state: str
    last_heartbeat_age_ms: int


@dataclass(frozen=True, slots=True)
class Route:
    """Where :meth:`WarmTable.route` sends a prompt.

    ``node``: the chosen node. ``prefix_tokens``: how many leading tokens of the prompt that node ran
    last (whole blocks; 0 when none, or fewer than ``min_blocks`` blocks). ``reason``: ``"warm"`` (the
    warmest candidate, not overloaded), ``"balance"`` (the warmest was overloaded against the least
    loaded, which got it instead) or ``"cold"`` (no candidate holds a warm prefix: the least loaded).
    """

    node: str
    prefix_tokens: int
    reason: str


@dataclass(frozen=True, slots=True)
class MigrationReport:
    """What ``WarmTable.migrate_legacy`` (``skippyd warm migrate``) did."""

    nodes_copied: int
    prefixes_dropped: int
    keys_removed: int


DEFAULT_BALANCE_ABS = 8.0  # the warmest must run this many more requests than the least loaded …
DEFAULT_BALANCE_REL = 1.5  # … and more than this many times as many, before the least loaded gets it
DEFAULT_MAX_RUNS = 64  # runs of a chain (one ran() each) route() steps through looking for candidates


def _route_rank(first_hash: bytes, node: str) -> bytes:
    """Rendezvous order of ``node`` for a prompt family: ties between equally loaded candidates go to
    the same node for every prompt with this first block (as consistent hashing would place it)."""
    return blake3(first_hash + node.encode()).digest(8)


def choose_route(
    candidates: Sequence[tuple[str, int]],
    loads: Mapping[str, float] | None,
    *,
    block: int,
    first_hash: bytes = b"",
    balance_abs: float = DEFAULT_BALANCE_ABS,
    balance_rel: float = DEFAULT_BALANCE_REL,
) -> Route:
    """The routing rule, on what Redis answered: ``candidates`` are the live candidates with the blocks
    each ran of the prompt (0: none). The warmest wins unless ``loads`` say it is overloaded against the
    least loaded: ``load(warmest) - load(least) > balance_abs`` and ``load(warmest) > balance_rel *
    load(least)`` (SGLang's router's balance rule, applied to the warmest candidate), when the least
    loaded wins; with nothing warm, the least loaded. Ties: warmest by lower load, least loaded by
    longer prefix, then the prompt family's rendezvous order. A candidate missing from ``loads`` has
    load 0."""
    if not candidates:
        raise NotFound("no live node among the candidates")

    def load(node: str) -> float:
        return float(loads.get(node, 0.0)) if loads else 0.0

    rank = {node: (load(node), _route_rank(first_hash, node)) for node, _ in candidates}  # each hashed once
    warm = min(candidates, key=lambda c: (-c[1], *rank[c[0]]))
    least = min(candidates, key=lambda c: (rank[c[0]][0], -c[1], rank[c[0]][1]))
    if warm[1] == 0:
        return Route(least[0], 0, "cold")
    if loads is not None:
        busy, idle = load(warm[0]), load(least[0])
        if busy - idle > balance_abs and busy > balance_rel * idle:
            return Route(least[0], least[1] * block, "balance")
    return Route(warm[0], warm[1] * block, "warm")


def _check_loads(loads: Mapping[str, float] | None) -> Mapping[str, float] | None:
    if loads is None:
        return None
    if not isinstance(loads, Mapping):
        raise InvalidArgument("loads must map node names to numbers (e.g. running requests)")
    for node, value in loads.items():
        if not isinstance(node, str):
            raise InvalidArgument(f"loads are keyed by node name, got {node!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise InvalidArgument(f"load of {node!r} must be a finite number >= 0, got {value!r}")
    return loads


class WarmTable:
    """Which node last ran each prompt prefix (matched in whole ``block``-token blocks).

    The table is split into ``shards`` Redis Cluster hash slots by the first hash of each prompt's
    chain (model and first block: every prefix of a prompt is in its shard). ``max_prefixes`` and the
    seed's oldest-eighth eviction hold per shard, so the table remembers at most ``shards *
    max_prefixes`` prefixes; with ``shards=1`` it is the seed's single table exactly. Every writer and
    reader of one table must use the same ``shards`` (daemons use the default).
    ``balance_abs``/``balance_rel`` are :meth:`route`'s load thresholds (:func:`choose_route`).
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        block: int = 64,
        min_blocks: int = 2,
        max_prefixes: int = 65536,
        prefix: str = "skippyd",
        max_dead_runs: int = 8,
        shards: int = WARM_SHARDS,
        balance_abs: float = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
        max_runs: int = DEFAULT_MAX_RUNS,
    ) -> None:
        if min_blocks < 1 or max_prefixes < 8:
            raise InvalidArgument("min_blocks must be at least 1 and max_prefixes at least 8")
        if not isinstance(shards, int) or not 1 <= shards <= MAX_WARM_SHARDS:
            raise InvalidArgument(f"shards must be 1 to {MAX_WARM_SHARDS}")
        if not (balance_abs >= 0 and balance_rel >= 1):
            raise InvalidArgument("balance_abs must be >= 0 and balance_rel >= 1")
        if max_runs < 1:
            raise InvalidArgument("max_runs must be at least 1")
        warm_chain("validate", b"", block)  # checks the block size
        self.client = client
        self._run = _Scripts(client)
        self.block = block
        self.min_blocks = min_blocks
        self.max_prefixes = max_prefixes
        self.keys = RedisKeys(prefix)
        self.max_dead_runs = max_dead_runs
        self.shards = shards
        self._shards = tuple(self.keys.warm_shard(i, shards) for i in range(shards))  # built once
        self.balance_abs = float(balance_abs)
        self.balance_rel = float(balance_rel)
        self.max_runs = max_runs

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        block: int = 64,
        min_blocks: int = 2,
        max_prefixes: int = 65536,
        prefix: str = "skippyd",
        timeout: float = 1.0,
        shards: int = WARM_SHARDS,
        balance_abs: float = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
    ) -> WarmTable:
        return cls(connect(url, timeout=timeout), block=block, min_blocks=min_blocks,
                   max_prefixes=max_prefixes, prefix=prefix, shards=shards, balance_abs=balance_abs,
                   balance_rel=balance_rel)  # fmt: skip

    def chain(self, model: str, tokens: Any) -> bytes:
        """The prompt's block chain (8 bytes a whole block), as sent to Redis."""
        return warm_chain(model, tokens if isinstance(tokens, bytes) else encode_tokens(tokens), self.block)

    def shard_of(self, chain: bytes) -> WarmShard:
        """The shard holding every prefix of this chain (shard 0 for a chain shorter than one block,
        which holds no prefix; any shard answers liveness)."""
        return self._shards[self.keys.warm_shard_index(chain, self.shards) if chain else 0]

    def all_shards(self) -> list[WarmShard]:
        return list(self._shards)

    # ------------------------------------------------------------- the seed's operations
    def ran(self, model: str, tokens: Any, node: str) -> None:
        """``node`` ran this prompt: every whole-block prefix of it now points at ``node``."""
        self.ran_chains([self.chain(model, tokens)], node)

    def ran_chains(self, chains: Sequence[bytes], node: str, batch_id: str | None = None) -> int:
        """Several prompts' chains, one script call per shard they fall in, pipelined (each prompt gets
        its own tick in its shard, as in the seed). Returns the prefixes written.

        A call sent again with the same ``batch_id`` (say its answer timed out) within
        :data:`BATCH_MARKER_S` changes nothing: each shard keeps the batch's marker, so a shard that
        applied it skips it; -1 when every shard had.
        """
        _check_node(node)
        batch_id = batch_id or new_batch_id()
        by_shard: dict[int, list[bytes]] = {}
        for chain in chains:
            if len(chain) >= WARM_HASH_BYTES:
                by_shard.setdefault(self.keys.warm_shard_index(chain, self.shards), []).append(chain)
        if not by_shard:
            return 0
        calls = []
        for index, group in sorted(by_shard.items()):
            shard = self._shards[index]
            calls.append(
                (
                    [shard.prefixes, shard.ages, shard.clock, shard.batch(batch_id)],
                    [node, self.max_prefixes, WARM_HASH_BYTES, int(BATCH_MARKER_S * 1000), *group],
                )
            )
        with _redis_errors("warm table update failed"):
            answers = [int(a) for a in self._run.many("warm_ran.lua", calls)]
        if all(a < 0 for a in answers):
            return -1
        return sum(a for a in answers if a > 0)

    def warmest(self, model: str, tokens: Any) -> tuple[str, int] | None:
        """The live node that ran the longest remembered prefix of ``tokens``, and its length in tokens."""
        return self.warmest_chain(self.chain(model, tokens))

    def warmest_chain(self, chain: bytes) -> tuple[str, int] | None:
        if len(chain) // WARM_HASH_BYTES < self.min_blocks:
            return None
        shard = self.shard_of(chain)
        with _redis_errors("warm table lookup failed"):
            found = self._run(
                "warm_warmest.lua",
                [shard.prefixes, shard.nodes],
                [chain, WARM_HASH_BYTES, self.min_blocks, self.max_dead_runs],
            )
        if not found:
            return None
        return _text(found[0]), int(found[1]) * self.block

    # ------------------------------------------------------------- routing
    def route(
        self,
        model: str,
        tokens: Any,
        nodes: Sequence[str] | None = None,
        *,
        loads: Mapping[str, float] | None = None,
    ) -> Route:
        """Where to run this prompt: the warmest live candidate unless it is overloaded against the least
        loaded (see :func:`choose_route`; thresholds ``balance_abs``/``balance_rel``), else the least
        loaded. Candidates are ``nodes`` (default: every live registered node); a node whose heartbeat
        expired or that was forgotten is never chosen, a node that never registered counts as live.
        One Redis round trip (``warm_route.lua`` on the prompt's shard). :class:`NotFound` when no
        candidate is live."""
        return self.route_chain(self.chain(model, tokens), nodes, loads=loads)

    def warm_candidates(self, chain: bytes, nodes: Sequence[str] | None = None) -> list[tuple[str, int]]:
        """Every live candidate and the blocks of this chain it ran last (0: none, or fewer than
        ``min_blocks``), in one round trip: a full search (route() stops as soon as its rule is
        decided)."""
        return self._candidates(chain, nodes, "all", None)

    def _candidates(
        self, chain: bytes, nodes: Sequence[str] | None, mode: str, loads: Mapping[str, float] | None
    ) -> list[tuple[str, int]]:
        names = [] if nodes is None else [_check_node(n) for n in nodes]
        if nodes is not None and not names:
            raise InvalidArgument("nodes, when given, must name at least one candidate")
        pairs: list[Any] = []
        for node, value in (loads or {}).items():
            pairs += [node, repr(float(value))]
        shard = self.shard_of(chain)
        with _redis_errors("warm table route failed"):
            raw = self._run(
                "warm_route.lua",
                [shard.prefixes, shard.nodes],
                [chain, WARM_HASH_BYTES, self.min_blocks, self.max_runs, mode, repr(self.balance_abs),
                 repr(self.balance_rel), len(pairs) // 2, *pairs, *names],
            )  # fmt: skip
        out = []
        for name, live, blocks in zip(raw[0::3], raw[1::3], raw[2::3], strict=True):
            if int(live):
                out.append((_text(name), int(blocks)))
        return out

    def route_chain(
        self, chain: bytes, nodes: Sequence[str] | None = None, *, loads: Mapping[str, float] | None = None
    ) -> Route:
        loads = _check_loads(loads)
        candidates = self._candidates(chain, nodes, "warmest" if loads is None else "balance", loads)
        if not candidates:
            asked = "the registered nodes" if nodes is None else f"{list(nodes)!r}"
            raise NotFound(f"no live node to route to among {asked}")
        return choose_route(
            candidates, loads, block=self.block, first_hash=chain[:WARM_HASH_BYTES],
            balance_abs=self.balance_abs, balance_rel=self.balance_rel,
        )  # fmt: skip

    # ------------------------------------------------------------- node liveness
    def heartbeat(self, node: str, incarnation: int, ttl_s: float) -> bool:
        """Registers or renews ``node``; False when a newer incarnation of it holds the name. The record
        is then copied into every shard (one pipeline), where lookups read liveness."""
        _check_node(node)
        ttl_ms = int(ttl_s * 1000)
        with _redis_errors("node heartbeat failed"):
            ok, _current = self._run(
                "node_heartbeat.lua", [self.keys.nodes], [node, int(incarnation), ttl_ms]
            )
            if not int(ok):
                return False
            self._mark_shards(node, int(incarnation), ttl_ms, "up")
        return True

    def _mark_shards(self, node: str, incarnation: int, ttl_ms: int, what: str, *extra: str) -> None:
        calls = [([s.nodes], [node, incarnation, ttl_ms, what, *extra]) for s in self.all_shards()]
        self._run.many("node_mark.lua", calls)

    def nodes(self, *, include_gone: bool = False) -> list[NodeInfo]:
        """Registered nodes (live ones only unless ``include_gone``), with incarnation and last heartbeat."""
        with _redis_errors("node listing failed"):
            raw = self._run("node_list.lua", [self.keys.nodes], [])
        now = int(raw[0])
        out = []
        for name, record in zip(raw[1::2], raw[2::2], strict=True):
            inc, last, ttl, state = _text(record).split()
            alive = state == "up" and now - int(last) <= int(ttl)
            if alive or include_gone:
                out.append(
                    NodeInfo(_text(name), int(inc), int(last), int(ttl), alive, state, now - int(last))
                )
        return sorted(out, key=lambda n: n.node)

    def forget(self, node: str, *, step: int = 1000) -> int:
        """Removes ``node`` and every prefix it holds, ``step`` table fields per script call. Lookups
        stop answering it before the first prefix goes; each shard keeps a "forgotten" record of it
        until it heartbeats again."""
        _check_node(node)
        with _redis_errors("forget failed"):
            # the shards before the registry, the reverse of a heartbeat's order (registry, then shards):
            # a heartbeat racing this either lands on the registry after its "forgotten" mark, and its
            # shard copies then land after ours (registry and shards say up), or before it, and the
            # forget wins (the registry drops it) -- never a registry that says up over shards that
            # say forgotten, which would hide a live node from lookups until its next heartbeat
            self._mark_shards(node, 0, 0, "forgotten")
            self._run("node_mark.lua", [self.keys.nodes], [node, 0, 0, "forgotten"])
        removed = 0
        for shard in self.all_shards():
            cursor = "0"
            while True:
                with _redis_errors("forget failed"):
                    cursor_raw, count = self._run(
                        "node_forget.lua", [shard.prefixes, shard.ages], [node, cursor, step]
                    )
                removed += int(count)
                cursor = _text(cursor_raw)
                if cursor == "0":
                    break
        with _redis_errors("forget failed"):
            self._run("node_mark.lua", [self.keys.nodes], [node, 0, 0, "drop"])
        return removed

    def migrate_legacy(self) -> MigrationReport:
        """Moves a schema-version-1 table (one slot, ``{<prefix>:v1:warm}``) to this layout: its node
        registrations are copied (where this table has none), its prefixes are dropped (version 1 kept
        no chain with them, so their shard cannot be known; the table refills as nodes run prompts) and
        its keys removed. Safe to run again; a no-op when there is nothing of version 1."""
        legacy = self.keys.legacy_warm
        copied = 0
        with _redis_errors("migration failed"):
            records = self.client.hgetall(legacy.nodes)
            for name, record in records.items():
                node, text = _text(name), _text(record)
                if not valid_node_name(node) or len(text.split()) != 4:
                    continue
                copied += int(self._run("node_mark.lua", [self.keys.nodes], [node, 0, 0, "copy", text]))
                self._mark_shards(node, 0, 0, "copy", text)
            dropped = int(self.client.hlen(legacy.prefixes))
            removed = 0
            for key in (legacy.prefixes, legacy.ages, legacy.clock, legacy.nodes):
                removed += int(self.client.unlink(key))
        return MigrationReport(copied, dropped, removed)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


@dataclass(frozen=True, slots=True)
class PromotionSettings:
    """The second-hit rules (the seed's constants), one place: a daemon reads them from its
    configuration (``promotion_window``, ``promotion_max_bytes``, ``promotion_worth_tokens``,
    ``promotion_max_observations``)."""

    window_s: float = 600.0  # observations older than this are forgotten
    max_bytes: int = 64 * 2**20  # larger payloads are never promoted
    worth_tokens: int = 4096  # entries this long promote on their first fill
    max_observations: int = 4096  # past this many, the oldest observation makes room


DEFAULT_PROMOTION = PromotionSettings()


class LocalPromotions:
    """The second-hit rules counted in this process (the fallback while Redis is away)."""

    def __init__(
        self, settings: PromotionSettings = DEFAULT_PROMOTION, *, clock: Any = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._obs: dict[str, list[Any]] = {}  # digest -> [first_seen, hits, terminal]

    def consider(self, digest: str, token_count: int, payload_bytes: int, /) -> bool:
        return self.consider_many([(digest, token_count, payload_bytes)])[0]

    def consider_many(self, items: Sequence[tuple[str, int, int]], /) -> list[bool]:
        """:meth:`consider` for each ``(key, token_count, payload_bytes)``, in order, under one lock."""
        rules = self.settings
        now = self._clock()
        with self._lock:
            obs = self._obs
            for key in [k for k, o in obs.items() if now - o[0] > rules.window_s]:
                del obs[key]
            return [self._consider(obs, now, key, tokens, size) for key, tokens, size in items]

    def _consider(
        self, obs: dict[str, list[Any]], now: float, digest: str, token_count: int, size: int
    ) -> bool:
        rules = self.settings
        if len(obs) >= rules.max_observations and digest not in obs and obs:
            oldest = min(obs.items(), key=lambda item: (item[1][0], item[0]))[0]
            del obs[oldest]
        entry = obs.setdefault(digest, [now, 0, False])
        if entry[2]:
            return False
        entry[1] = min(entry[1] + 1, 255)
        if size > rules.max_bytes:
            entry[2] = True
            return False
        return token_count >= rules.worth_tokens or entry[1] >= 2

    def settle(self, digest: str, /) -> None:
        with self._lock:
            entry = self._obs.get(digest)
            if entry is not None:
                entry[2] = True


class Promotions:
    """Second-hit counting before an L3 entry is promoted into L2, shared by everyone in ``scope``.

    Every call is one script in Redis on Redis's clock, so every process and host sharing ``scope``
    counts together: a fill is promoted on its second hit within ``window_s`` (on its first when it is
    at least ``worth_tokens`` long), never when larger than ``max_bytes``, and once a promotion was
    attempted (:meth:`settle`) not again within the window.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        scope: str,
        window_s: float = DEFAULT_PROMOTION.window_s,
        max_bytes: int = DEFAULT_PROMOTION.max_bytes,
        worth_tokens: int = DEFAULT_PROMOTION.worth_tokens,
        max_observations: int = DEFAULT_PROMOTION.max_observations,
        prefix: str = "skippyd",
    ) -> None:
        if not isinstance(scope, str) or not scope:
            raise InvalidArgument("scope must be a non-empty string")
        self.client = client
        self._run = _Scripts(client)
        self.scope = scope
        self.settings = PromotionSettings(window_s, max_bytes, worth_tokens, max_observations)
        keys = RedisKeys(prefix)
        self._keys = [keys.promo_obs(scope), keys.promo_ages(scope)]

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        scope: str,
        window_s: float = DEFAULT_PROMOTION.window_s,
        max_bytes: int = DEFAULT_PROMOTION.max_bytes,
        worth_tokens: int = DEFAULT_PROMOTION.worth_tokens,
        max_observations: int = DEFAULT_PROMOTION.max_observations,
        prefix: str = "skippyd",
        timeout: float = 1.0,
    ) -> Promotions:
        return cls(connect(url, timeout=timeout), scope=scope, window_s=window_s, max_bytes=max_bytes,
                   worth_tokens=worth_tokens, max_observations=max_observations, prefix=prefix)  # fmt: skip

    def consider(self, manifest_key: str, token_count: int, payload_bytes: int) -> bool:
        """True when this L3 fill should be promoted into L2. ``manifest_key`` is the entry's payload
        digest (the contract's name for it: the promotion is decided per content, whatever the key)."""
        if not isinstance(manifest_key, str) or not manifest_key:
            raise InvalidArgument("manifest_key (the payload digest) must be a non-empty string")
        return self.consider_many([(manifest_key, token_count, payload_bytes)])[0]

    def consider_many(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        """:meth:`consider` for each ``(key, token_count, payload_bytes)`` in one script call, in order
        (how the daemon counts a block put's blocks toward L3 admission)."""
        listed = list(items)
        for key, _, _ in listed:
            if not isinstance(key, str) or not key:
                raise InvalidArgument("every observed key must be a non-empty string")
        if not listed:
            return []
        rules = self.settings
        argv: list[Any] = [int(rules.window_s * 1000), int(rules.max_bytes), int(rules.worth_tokens),
                           int(rules.max_observations)]  # fmt: skip
        for key, tokens, size in listed:
            argv += [key, int(tokens), int(size)]
        with _redis_errors("promotion count failed"):
            answers = self._run("promo_consider.lua", self._keys, argv)
        if not isinstance(answers, list) or len(answers) != len(listed):
            raise CoordinationUnavailable(f"promo_consider.lua answered {answers!r} for {len(listed)} items")
        return [bool(int(a)) for a in answers]

    def settle(self, manifest_key: str) -> None:
        """A promotion was attempted: the observation is terminal (no more promotions in the window)."""
        with _redis_errors("promotion settle failed"):
            self._run("promo_settle.lua", self._keys[:1], [manifest_key])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


@dataclass(slots=True)
class RedisStatus:
    """The daemon's Redis link as ``stats`` reports it."""

    configured: bool = False
    degraded: bool = False
    cause: str = ""
    degraded_for_s: float = 0.0
    node: str = ""
    incarnation: int = 0
    buffered: int = 0
    last_heartbeat_age_s: float | None = None
    ran_sent: int = 0
    ran_dropped: int = 0
    batches: int = 0
    batches_resent: int = 0
    batches_applied_before: int = 0
    failures: int = 0
    heartbeats: int = 0
    promotions_local: int = 0
    promotions_redis: int = 0
    superseded: int = 0
    slow_calls: int = 0  # request-path counts Redis answered slowly (each sends the next few seconds local)
    # the embedded redis-server (``--redis-url`` empty): its pid (0 while down), how often it was
    # restarted after dying, how the last one went, how long it has been down, since its last restart
    embedded: bool = False
    server_pid: int = 0
    server_restarts: int = 0
    server_last_exit: str = ""
    server_down_for_s: float | None = None
    server_last_restart_age_s: float | None = None


class Coordinator:
    """The daemon's link to Redis; a client request waits on Redis for one short call at most.

    A background thread registers the node, heartbeats, and sends buffered ``ran`` updates in batches.
    While Redis is down or slow the tiers keep serving: ``ran`` updates wait in a bounded buffer (and are
    dropped, counted, once it is full), promotions are counted locally by the same rules, and the thread
    reconnects with exponential backoff. A promotion or admission count asked on a request's behalf
    gives up after :data:`REQUEST_TIMEOUT_S`, and a slow answer sends those of the next seconds to local
    counting (:data:`SLOW_CALL_S`). :meth:`status` says whether it is degraded and why.
    """

    def __init__(
        self,
        url: str,
        *,
        node: str,
        scope: str,
        prefix: str = "skippyd",
        timeout: float = 0.25,
        heartbeat_s: float = 2.0,
        ttl_s: float = 10.0,
        buffer: int = 10000,
        block: int = 64,
        promotion: PromotionSettings = DEFAULT_PROMOTION,
    ) -> None:
        self.url = url
        self.node = _check_node(node)
        self.incarnation = time.time_ns() // 1000
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.client = connect(url, timeout=timeout, lazy=True)  # (a cluster away: start degraded)
        self.table = WarmTable(self.client, block=block, prefix=prefix)
        # batches of ``ran`` updates run longer than a single call: their own connection and timeout
        self._batch_client = connect(url, timeout=max(timeout, BATCH_TIMEOUT_S), lazy=True)
        self._batch_table = WarmTable(self._batch_client, block=block, prefix=prefix)
        # calls made on a client request's behalf: a connection of their own, with a short timeout
        self._request_client = connect(url, timeout=min(timeout, REQUEST_TIMEOUT_S), lazy=True)
        self._slow_until = 0.0  # request-path calls count locally until then (Redis answered slowly)
        self.promotions = Promotions(
            self._request_client, scope=scope, prefix=prefix, window_s=promotion.window_s,
            max_bytes=promotion.max_bytes, worth_tokens=promotion.worth_tokens,
            max_observations=promotion.max_observations,
        )  # fmt: skip
        self.local = LocalPromotions(promotion)
        # blocks' L3 admission: the same second-hit rules, counted in a scope of their own
        self.admissions = Promotions(
            self._request_client, scope=f"{scope}/l3-admission", prefix=prefix, window_s=promotion.window_s,
            max_bytes=promotion.max_bytes, worth_tokens=promotion.worth_tokens,
            max_observations=promotion.max_observations,
        )  # fmt: skip
        self.local_admissions = LocalPromotions(promotion)
        self._buffer: collections.deque[bytes] = collections.deque()
        # a batch whose call failed, kept with its id and sent again first: Redis applies an id once, so
        # this is safe whether or not the failed call ran (a timeout cannot tell)
        self._retry: tuple[str, list[bytes]] | None = None
        self._buffer_limit = buffer
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.degraded = False
        self.cause = ""
        self.degraded_since = 0.0
        self.counters = {"ran_sent": 0, "ran_dropped": 0, "batches": 0, "batches_resent": 0,
                         "batches_applied_before": 0, "failures": 0, "heartbeats": 0,
                         "promotions_local": 0, "promotions_redis": 0, "superseded": 0,
                         "slow_calls": 0}  # fmt: skip
        self._last_heartbeat = 0.0
        self._health = Health()
        self._woken = False  # Redis is known to be back (say the embedded server restarted): retry now
        self._server_down = ""  # why the server is known to be gone, while it is (the degraded cause)
        self.server_status: Callable[[], dict[str, Any]] | None = None  # the embedded server's, if any

    # ------------------------------------------------------------- request side (never blocks on Redis)
    def ran(self, model: str, tokens: bytes) -> None:
        """Queues a warm-table update (the chain is computed here, on the caller's worker thread)."""
        chain = warm_chain(model, tokens, self.table.block)
        if len(chain) < WARM_HASH_BYTES:
            return
        with self._cond:
            if len(self._buffer) >= self._buffer_limit:
                self.counters["ran_dropped"] += 1
                return
            self._buffer.append(chain)
            self._cond.notify()

    def _in_redis(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, call())`` while Redis answers; ``(False, None)`` while it is away (a failure degrades
        the link: counting goes local until the background thread has Redis back) or answered the last
        such call slowly (local for :data:`SLOW_PAUSE_S`: a request never waits on a busy Redis for long)."""
        if self.degraded or time.monotonic() < self._slow_until:
            return False, None
        started = time.monotonic()
        answered, answer = True, None
        try:
            answer = call()
        except CoordinationTimeout:  # slow past the request path's own timeout: slow, not down (the
            answered = False  # background link, with its longer timeout, says whether Redis is down)
        except SkippydError as exc:
            self._degrade(str(exc))
            return False, None
        took = time.monotonic() - started
        if took > SLOW_CALL_S:
            if self._slow_until == 0.0 or started > self._slow_until + 60:  # (one line a minute at most)
                log.warning("Redis answered a request's count in %.0f ms: counting locally for %gs at a time",
                            took * 1e3, SLOW_PAUSE_S)  # fmt: skip
            self._slow_until = time.monotonic() + SLOW_PAUSE_S
            self.counters["slow_calls"] += 1
        return answered, answer

    def consider(self, digest: str, token_count: int, payload_bytes: int, /) -> bool:
        """The promotion decision, counted in Redis, or locally by the same rules while Redis is away."""
        shared, answer = self._in_redis(lambda: self.promotions.consider(digest, token_count, payload_bytes))
        self.counters["promotions_redis" if shared else "promotions_local"] += 1
        return bool(answer) if shared else self.local.consider(digest, token_count, payload_bytes)

    def admit(self, items: Sequence[tuple[str, int, int]], /) -> list[bool]:
        """Counts block puts toward L3 admission (:data:`skippyd.blocks.Admission`), in Redis across the
        scope, or locally by the same rules while Redis is away."""
        shared, answers = self._in_redis(lambda: self.admissions.consider_many(items))
        return list(answers) if shared else self.local_admissions.consider_many(items)

    def settle(self, digest: str, /) -> None:
        self.local.settle(digest)
        self._in_redis(lambda: self.promotions.settle(digest))

    def status(self) -> RedisStatus:
        with self._cond:
            retry = self._retry
            buffered = len(self._buffer) + (len(retry[1]) if retry is not None else 0)
        more: dict[str, Any] = {**self.counters, **(self.server_status() if self.server_status else {})}
        return RedisStatus(
            configured=True,
            degraded=self.degraded,
            cause=self.cause,
            degraded_for_s=time.monotonic() - self.degraded_since if self.degraded else 0.0,
            node=self.node,
            incarnation=self.incarnation,
            buffered=buffered,
            last_heartbeat_age_s=time.monotonic() - self._last_heartbeat if self._last_heartbeat else None,
            **more,
        )

    def server_down(self, cause: str) -> None:
        """The Redis server is known to be gone (the embedded one died): degraded now, not at the next
        call; ``ran`` updates wait in the buffer and promotions are counted locally until it is back."""
        with self._cond:  # one step with _recover's check: a tick that went through can't undo this
            self._server_down = cause
            self._degrade(cause)

    def server_up(self) -> None:
        """The Redis server is back: reconnect and send what the buffer holds now, not after the backoff."""
        with self._cond:
            self._server_down = ""
            self._woken = True
            self._cond.notify()

    # ------------------------------------------------------------- background side
    def start(self, health: Health | None = None) -> None:
        """Starts the background thread: heartbeats, then batches (call once the node serves)."""
        self._health = health or Health()
        self._thread = self._health.start(THREAD, self._run)

    def close(self, flush_timeout: float = 2.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=flush_timeout + 5)
        self.table.close()
        self._batch_table.close()
        self.promotions.close()

    def _degrade(self, cause: str) -> None:
        if not self.degraded:
            log.warning("coordination degraded: %s (serving continues; retrying in the background)", cause)
            self.degraded_since = time.monotonic()
        self.degraded = True
        self.cause = self._server_down or cause  # "the server died" says more than "connection refused"
        self.counters["failures"] += 1

    def _recover(self) -> bool:
        """Clears the degraded state after a tick that went through; False (still degraded) while the
        server is known down: that tick was in flight when the supervisor said the server died."""
        with self._cond:
            if self._server_down:
                return False
            if self.degraded:
                log.info("coordination recovered after %.1fs", time.monotonic() - self.degraded_since)
            self.degraded = False
            self.cause = ""
        return True

    def _take_batch(self, limit: int = 256, max_bytes: int = BATCH_BYTES) -> list[bytes]:
        """Up to ``limit`` chains and about ``max_bytes`` of them (Redis hashes every argument byte of a
        script call, so a batch's run time follows its bytes); always at least one chain."""
        with self._cond:
            batch: list[bytes] = []
            size = 0
            while self._buffer and len(batch) < limit:
                if batch and size + len(self._buffer[0]) > max_bytes:
                    break
                chain = self._buffer.popleft()
                batch.append(chain)
                size += len(chain)
            return batch

    def _run(self) -> None:
        backoff = 0.1
        while True:
            with self._cond:
                final = self._stop
                idle = not self._buffer and self._retry is None and not self._woken and not self.degraded
                if not final and idle:
                    due = self._last_heartbeat + self.heartbeat_s - time.monotonic()
                    if due > 0:
                        self._cond.wait(timeout=due)
                    final = self._stop
                self._woken = False
            try:
                self._tick()
            except Exception as exc:  # Redis trouble or a bug: degrade, count, back off, go on
                self._degrade(str(exc) if isinstance(exc, SkippydError) else f"{type(exc).__name__}: {exc}")
                if not isinstance(exc, SkippydError):
                    self._health.failed(THREAD, "the Redis link failed", exc)
                if final:
                    return
                woken = self._back_off(backoff)
                backoff = 0.1 if woken else min(backoff * 2, 5.0)
                continue
            if not self._recover():  # the server died under a tick that went through: wait for server_up
                if final:
                    return
                self._back_off(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            if final:
                return

    def _back_off(self, seconds: float) -> bool:
        """Waits ``seconds`` before the next try, however many ``ran`` updates come meanwhile (each one
        notifies: under load they cut every wait short, and a Redis coming back got a reconnect per
        capture); a stop or :meth:`server_up` ends it. Whether ``server_up`` did."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._stop and not self._woken:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            woken, self._woken = self._woken, False
        return woken

    def _tick(self) -> None:
        """Heartbeat when due (and first thing while degraded: the link recovers only once Redis answered),
        then send what the buffer holds (a few batches at most per tick)."""
        if self.degraded or time.monotonic() - self._last_heartbeat >= self.heartbeat_s:
            if not self.table.heartbeat(self.node, self.incarnation, self.ttl_s):
                self.counters["superseded"] += 1
                log.error("another daemon with a newer incarnation claims node %s", self.node)
            self._last_heartbeat = time.monotonic()
            self.counters["heartbeats"] += 1
        for _ in range(16):
            with self._cond:
                retry, self._retry = self._retry, None
            if retry is not None:
                batch_id, batch = retry
                self.counters["batches_resent"] += 1
            else:
                batch = self._take_batch()
                if not batch:
                    return
                batch_id = new_batch_id()
            try:
                written = self._batch_table.ran_chains(batch, self.node, batch_id)
            except SkippydError:
                with self._cond:
                    self._retry = (batch_id, batch)
                raise
            except Exception:
                self.counters["ran_dropped"] += len(batch)  # not Redis being away: never sent again
                raise
            if written < 0:  # an earlier try ran it; only its answer was lost
                self.counters["batches_applied_before"] += 1
            self.counters["ran_sent"] += len(batch)
            self.counters["batches"] += 1
