"""One function per operation, and one table that says which runs where.

A request map comes in, a :class:`Reply` (a map and descriptors to send) goes out; no sockets here.
Every field of every request is validated here, so a malformed request is an ``invalid_argument``
error naming the field, never an exception deeper down.

:data:`OPERATIONS` is the only list of operations: the dispatcher, the ``hello`` reply's features and
docs/protocol.md follow it. Each says where it runs:

* ``inline``: on the event loop (cheap and bounded: no disk, no payload-sized work);
* ``worker``: on a worker thread (copies, hashing of payloads, disk);
* ``by_prompt``: inline, unless the prompt is long enough that hashing it would hold the loop up.

An inline handler that finds it needs the disk after all (a restore whose longest prefix is only in
L3) returns :class:`Deferred`: the server runs its continuation on a worker thread, and that
continuation goes on from where the handler stopped, with what it already resolved.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeGuard

from . import __version__
from .blocks import PutOutcome, Served
from .config import FIELDS, Config, config_values, derived_settings
from .errors import Busy, InvalidArgument, NotConfigured, TooLarge, VersionMismatch, describe
from .fills import FillStats
from .keys import MAX_BLOCK_KEY_BYTES, BlockSpaceId, Identity, block_space, cache_key, identity
from .payload import MAX_TENSORS, check_decl, check_kind
from .protocol import (
    DEFAULT_REPLY_FDS,
    MAX_BLOCK_BYTES,
    MAX_BLOCKS_PER_REQUEST,
    MAX_FDS,
    PROTOCOL_VERSION,
)
from .shm import PAGE, memfd
from .stats import RedisStatus, ServerState, Snapshot
from .tiers import Opened, Tiers
from .workers import Health

LS_PAGE = 20_000  # entries an ls reply lists at most (each well under 400 bytes encoded: under 8 MiB)
LS_PAGE_ENV = "SKIPPYD_TEST_LS_PAGE"  # a test hook: a smaller page, to page through a few entries

__all__ = [
    "COPY_GATE_ENV",
    "INLINE",
    "OPERATIONS",
    "WORKER",
    "Behind",
    "Deferred",
    "Handlers",
    "Operation",
    "Reply",
    "Session",
    "Staging",
    "WarmFeed",
]

_MAX_TOKENS_BYTES = 8 << 20  # 2M tokens
_INLINE_TOKEN_BYTES = 32 * 1024  # prompts above 8k tokens are hashed off the event loop

INLINE, WORKER, BY_PROMPT = "inline", "worker", "by_prompt"
_LOCK_FREE = frozenset({"hello", "ping", "config"})  # inline operations that take no tier's lock

#: TEST HOOK, not a setting: while the file this environment variable names exists, every copy that runs
#: behind a put's reply waits before it starts (at most a minute), so a test can hold a copy in flight.
#: A number written into the file lets that many waiting copies through, one at a time (each takes one).
COPY_GATE_ENV = "SKIPPYD_TEST_COPY_GATE"
_COPY_GATE_MAX_S = 60.0
_LISTING_KEPT_S = 60.0  # how long an `ls` listing is kept for its next page

#: Operations whose request may name a staging half (``"half": 0 | 1``), see docs/protocol.md.
STAGED_OPS = frozenset({"blocks_put", "capture"})

#: In hello's features: this daemon understands staging halves (and answers a put before its copy).
HALVES_FEATURE = "staging_halves"


@dataclass(frozen=True, slots=True)
class Operation:
    name: str
    runs: str  # INLINE, WORKER or BY_PROMPT
    advertised: bool = True  # named in hello's features (hello itself is not)


#: Every operation of protocol version 1, and where it runs.
OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation("hello", INLINE, advertised=False),
        Operation("ping", INLINE),
        Operation("stage", WORKER),
        Operation("capture", WORKER),
        Operation("lookup", BY_PROMPT),
        Operation("restore", BY_PROMPT),
        Operation("ran", WORKER),
        Operation("stats", INLINE),
        Operation("ls", WORKER),
        Operation("evict", WORKER),
        Operation("config", INLINE),
        Operation("blocks_put", WORKER),
        Operation("blocks_contains", INLINE),
        Operation("blocks_get", INLINE),
    )
}


class WarmFeed(Protocol):
    """What the handlers need from the daemon's Redis link
    (:class:`skippyd.cluster.coordination.Coordinator`)."""

    def ran(self, model: str, tokens: bytes) -> None: ...

    def status(self) -> RedisStatus: ...


@dataclass(slots=True)
class Staging:
    """Shared memory lent to one connection for captures: a sealed memfd mapped by both sides."""

    mapping: mmap.mmap
    size: int

    def view(self, length: int) -> memoryview:
        return memoryview(self.mapping)[:length]

    def half(self, half: int | None) -> memoryview:
        """The whole buffer (``half`` None), or one of its two halves (each ``size // 2`` rounded down
        to pages: a request naming a half reads only there, see docs/protocol.md, "Staging halves")."""
        if half is None:
            return self.view(self.size)
        length = self.size // 2 // PAGE * PAGE
        if not length:
            raise InvalidArgument(f"a staging buffer of {self.size} bytes has no halves; stage more")
        return memoryview(self.mapping)[half * length : (half + 1) * length]

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.mapping.close()


@dataclass(slots=True)
class Session:
    """What the daemon knows about one connection (its requests run one at a time, in order)."""

    id: int
    pid: int = 0
    uid: int = -1
    gid: int = -1
    handshaken: bool = False
    staging: Staging | None = None
    # ``ls`` paging: the listing its first page was cut from, and when, kept for the pages that follow
    # (one snapshot, built once: each page used to rebuild the whole list of a big cache)
    listing: tuple[float, list[Any]] | None = None


@dataclass(slots=True)
class Behind:
    """The rest of a request that its reply does not wait for: the copy of a staged put out of its
    staging half into the slots it reserved, and the commit (``run``, on a copy thread), or, when it
    never gets to run (its connection's daemon stopping), giving those slots back (``abandon``)."""

    run: Callable[[], object]
    abandon: Callable[[], None]


@dataclass(slots=True)
class Reply:
    body: dict[str, Any]
    fds: list[int] = field(default_factory=list)
    behind: Behind | None = None  # sent before this work ends (the server runs it, in order, per connection)


#: Parks a request until it can run without waiting: registers a wake-up (called from any thread) and
#: returns a function that forgets it.
Park = Callable[[Callable[[], None]], Callable[[], None]]


@dataclass(slots=True)
class Deferred:
    """The rest of a request, to run on a worker thread; it returns the reply. With ``park``, the request
    waits first, holding no thread, until ``park`` wakes it or :data:`~skippyd.blocks.SETTLE_SECONDS`
    pass (a read that reached a put's copy in flight)."""

    work: Callable[[], Reply]
    park: Park | None = None


Handler = Callable[[Session, dict[str, Any]], "Reply | Deferred"]


class Handlers:
    def __init__(
        self,
        config: Config,
        tiers: Tiers,
        coordinator: WarmFeed | None = None,
        *,
        health: Health | None = None,
        sources: Mapping[str, str] | None = None,
        server: ServerState | None = None,
    ) -> None:
        self.config = config
        self.sources = dict(sources or {})
        self.tiers = tiers
        self.coordinator = coordinator
        self.health = health or tiers.health
        self.server = server or ServerState()
        self.started = time.time()
        self._staging_lock = threading.Lock()
        self._staging_bytes = 0
        self._handlers: dict[str, Handler] = {name: getattr(self, f"op_{name}") for name in OPERATIONS}
        self._copy_gate = os.environ.get(COPY_GATE_ENV) or None  # a test hook (see COPY_GATE_ENV)
        self._ls_page = max(1, int(os.environ.get(LS_PAGE_ENV) or LS_PAGE))

    # ----------------------------------------------------------------- dispatch
    def route(self, session: Session, body: dict[str, Any]) -> tuple[str, Handler, bool]:
        """The operation a request names, its handler, and whether it starts on a worker thread."""
        op = body.get("op")
        operation = OPERATIONS.get(op) if isinstance(op, str) else None
        if operation is None:
            raise InvalidArgument(f"unknown operation {describe(op)}")
        if not session.handshaken and operation.name != "hello":
            raise InvalidArgument("the first request on a connection must be hello")
        pooled = operation.runs == WORKER
        if operation.runs == BY_PROMPT:
            tokens = body.get("tokens")
            pooled = isinstance(tokens, bytes) and len(tokens) > _INLINE_TOKEN_BYTES
        if not pooled and operation.name not in _LOCK_FREE and self.tiers.busy():
            pooled = True  # a tier's lock is held right now: wait for it on a worker, not on the event loop
        return operation.name, self._handlers[operation.name], pooled

    def close_session(self, session: Session) -> None:
        staging, session.staging = session.staging, None
        if staging is not None:
            staging.close()
            with self._staging_lock:
                self._staging_bytes -= staging.size

    # ----------------------------------------------------------------- operations
    def op_hello(self, session: Session, body: dict[str, Any]) -> Reply:
        versions = body.get("versions", [PROTOCOL_VERSION])
        if not isinstance(versions, list) or PROTOCOL_VERSION not in versions:
            raise VersionMismatch(
                f"this daemon speaks protocol {PROTOCOL_VERSION}; the client offers {describe(versions)}"
            )
        session.handshaken = True
        return Reply(
            {
                "version": PROTOCOL_VERSION,
                "server": f"skippyd/{__version__}",
                "node": self.config.node_name,
                "max_frame": self.config.max_frame,
                "max_entry": self.config.entry_limit,
                "staging_max": min(self.config.entry_limit, self.config.staging_budget),
                "align": 4096,
                "features": [op.name for op in OPERATIONS.values() if op.advertised] + [HALVES_FEATURE],
            }
        )

    def op_ping(self, session: Session, body: dict[str, Any]) -> Reply:
        dead = self.health.dead()
        return Reply({"pong": True, "node": self.config.node_name, "healthy": not dead, "dead_threads": dead})

    def op_stage(self, session: Session, body: dict[str, Any]) -> Reply:
        want = _uint(body, "size")
        limit = min(self.config.entry_limit, self.config.staging_budget)
        if want == 0:
            raise InvalidArgument(f"staging of 0 bytes: size must be between 1 and {limit}")
        if want > limit:
            raise TooLarge(f"staging of {want} bytes: must be between 1 and {limit}")
        size = (want + PAGE - 1) // PAGE * PAGE
        old = session.staging
        with self._staging_lock:
            freed = old.size if old is not None else 0
            if self._staging_bytes - freed + size > self.config.staging_budget:
                raise Busy("the daemon's staging memory is all lent out; retry shortly")
            self._staging_bytes += size - freed
        session.staging = None
        if old is not None:
            old.close()
        try:
            fd = memfd("skippyd-staging", size)
            try:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            with self._staging_lock:
                self._staging_bytes -= size
            raise
        session.staging = Staging(mapping, size)
        return Reply({"size": size}, [fd])

    def op_capture(self, session: Session, body: dict[str, Any]) -> Reply:
        ident = _identity(body)
        tokens = _tokens(body)
        raw_tensors = body.get("tensors")
        if not isinstance(raw_tensors, list) or len(raw_tensors) > MAX_TENSORS:
            raise InvalidArgument("tensors must be a list of [name, dtype, shape]")
        decls = []
        for item in raw_tensors:
            if not isinstance(item, list) or len(item) != 3:
                raise InvalidArgument("each tensor is [name, dtype, shape]")
            decls.append(check_decl(item[0], item[1], item[2]))
        kind = check_kind(body.get("kind", "kv"))
        meta = body.get("meta")
        durable = _durable(body)
        staging = session.staging
        if staging is None:
            raise InvalidArgument("no staging buffer on this connection: send stage first")
        source = staging.half(_half(body))
        try:
            outcome = self.tiers.capture(
                identity=ident, tokens=tokens, tensors=decls, source=source, kind=kind, meta=meta,
                durable=durable,
            )  # fmt: skip
        finally:
            source.release()
        return Reply(
            {
                "digest": outcome.digest,
                "token_count": outcome.token_count,
                "nbytes": outcome.nbytes,
                "l2": outcome.l2,
                "l3": outcome.l3,
                "durability": outcome.durability,
            }
        )

    def op_lookup(self, session: Session, body: dict[str, Any]) -> Reply:
        found = self.tiers.lookup(_identity(body), _tokens(body))
        if found is None:
            return Reply({"found": False})
        return Reply(
            {
                "found": True,
                "token_count": found.token_count,
                "source": found.source,
                "digest": found.digest,
                "nbytes": found.nbytes,
            }
        )

    def op_restore(self, session: Session, body: dict[str, Any]) -> Reply | Deferred:
        plan = self.tiers.plan_restore(_identity(body), _tokens(body))
        opened = self.tiers.restore(plan, may_fill=False)
        if plan.needs_disk:  # the longest prefix is only in L3: the worker goes on with this plan
            return Deferred(lambda: _restore_reply(self.tiers.restore(plan)))
        return _restore_reply(opened)

    def op_ran(self, session: Session, body: dict[str, Any]) -> Reply:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgument("model must be a non-empty string")
        tokens = _tokens(body)
        if self.coordinator is None:
            raise NotConfigured("this daemon runs without Redis, so it keeps no warm-prefix table")
        self.coordinator.ran(model, tokens)
        return Reply({})

    def op_stats(self, session: Session, body: dict[str, Any]) -> Reply:
        return Reply(self.snapshot().to_wire())

    def snapshot(self) -> Snapshot:
        """Every counter the daemon keeps (what ``stats`` answers and the metrics endpoint exports)."""
        tiers = self.tiers.stats()
        return Snapshot(
            node=self.config.node_name,
            version=__version__,
            uptime_s=time.time() - self.started,
            healthy=self.health.healthy,
            staging_bytes=self._staging_bytes,
            l2=tiers.l2,
            ops=tiers.ops,
            fills=tiers.fills or FillStats(),
            blocks=tiers.blocks,
            l3=tiers.l3,
            durable=tiers.durable,
            block_writer=tiers.block_writer,
            reconciliation=tiers.reconciliation,
            server=self.server.stats(),
            redis=self.coordinator.status() if self.coordinator is not None else RedisStatus(),
            threads=self.health.snapshot(),
        )

    def op_config(self, session: Session, body: dict[str, Any]) -> Reply:
        """The daemon's effective settings, where each came from, and what follows from them."""
        return Reply(
            {
                "values": config_values(self.config),
                "sources": {name: self.sources.get(name, "default") for name in FIELDS},
                "derived": derived_settings(self.config),
                "pid": os.getpid(),
            }
        )

    # ----------------------------------------------------------------- blocks
    def op_blocks_contains(self, session: Session, body: dict[str, Any]) -> Reply | Deferred:
        """How many leading keys are held; with ``each``, also which keys are (one byte per key). A put's
        copy still writing a block asked for is waited for on a worker (acknowledged means visible)."""
        space, keys = _space(body), _block_keys(body)
        blocks = self.tiers.blocks
        if _bool(body, "each", False):

            def each(held: list[bool]) -> Reply:
                count = held.index(False) if False in held else len(held)
                return Reply({"count": count, "held": bytes(held)})

            now = blocks.held_now(space, keys)
            if now is None:
                return Deferred(
                    lambda: each(blocks.held_as_is(space, keys)), park=self._park(space, keys, each=True)
                )
            return each(now)
        count = blocks.contains_now(space, keys)
        if count is None:  # parked until the copy commits, then answered as things are
            return Deferred(
                lambda: Reply({"count": blocks.contains_as_is(space, keys)}), park=self._park(space, keys)
            )
        return Reply({"count": count})

    def op_blocks_get(self, session: Session, body: dict[str, Any]) -> Reply | Deferred:
        space, keys = _space(body), _block_keys(body)
        maps = body.get("slot_maps", False)
        if not isinstance(maps, bool):
            raise InvalidArgument("slot_maps must be true or false")
        # (a client from before max_fds reads 8 a frame; fewer is not offered: a run partly read from L3
        # brings up to 4 descriptors of its own beside at least one slab's)
        max_fds = body.get("max_fds", DEFAULT_REPLY_FDS)
        if type(max_fds) is not int or not DEFAULT_REPLY_FDS <= max_fds <= MAX_FDS:
            raise InvalidArgument(f"max_fds must be an integer from {DEFAULT_REPLY_FDS} to {MAX_FDS}")
        get = functools.partial(self.tiers.blocks.get, space, keys, max_fds=max_fds, slot_maps=maps)
        served = get(may_read=False)
        if served.copying:  # parked until the copy commits, then served on a worker (it may read L3)
            return Deferred(lambda: _blocks_reply(get(may_wait=False)), park=self._park(space, keys))
        if served.needs_worker:  # the run needs L3 (read and verified): on a worker
            return Deferred(lambda: _blocks_reply(get()))
        return _blocks_reply(served)

    def _park(self, space: BlockSpaceId, keys: list[bytes], *, each: bool = False) -> Park:
        blocks = self.tiers.blocks
        return lambda wake: blocks.when_copied(space, keys, wake, each=each)

    def op_blocks_put(self, session: Session, body: dict[str, Any]) -> Reply:
        space, keys = _space(body), _block_keys(body)
        sizes, offsets = body.get("sizes"), body.get("offsets")
        if (
            not isinstance(sizes, list)
            or not isinstance(offsets, list)
            or not len(sizes) == len(offsets) == len(keys)
        ):
            raise InvalidArgument("sizes and offsets must be lists as long as keys")
        for size, offset in zip(sizes, offsets, strict=True):
            if not _is_int(size) or size < 0 or not _is_int(offset) or offset < -1:
                raise InvalidArgument("each size is a non-negative integer, each offset one too or -1")
            if size > MAX_BLOCK_BYTES:
                raise TooLarge(f"a block of {size} bytes is larger than a block may be ({MAX_BLOCK_BYTES})")
        parent = body.get("parent")
        if parent is not None and (
            not isinstance(parent, bytes) or not 1 <= len(parent) <= MAX_BLOCK_KEY_BYTES
        ):
            raise InvalidArgument(f"parent must be a block key of 1 to {MAX_BLOCK_KEY_BYTES} bytes")
        durable = _durable(body)
        half = _half(body)
        staging = session.staging
        if staging is None and any(offset >= 0 for offset in offsets):
            raise InvalidArgument("no staging buffer on this connection: send stage first")
        source = staging.half(half) if staging is not None else memoryview(b"")
        try:
            job = self.tiers.blocks.begin_put(
                space, keys, sizes, offsets, source, parent=parent, durable=durable
            )
        except BaseException:
            source.release()
            raise
        if half is None or durable == "sync" or not job.pending:  # answered once stored, as before halves
            return _put_reply(job.finish())
        try:
            run = (
                job.finish
                if self._copy_gate is None
                else functools.partial(_gated, self._copy_gate, job.finish)
            )
            return Reply(_put_reply(job.promised()).body, behind=Behind(run, job.abandon))
        except BaseException:
            job.abandon()  # (never left reserved: reads reaching its keys would wait for it)
            raise

    def op_ls(self, session: Session, body: dict[str, Any]) -> Reply:
        if _bool(body, "blocks", False):  # the blocks held per identity instead of the entries
            return Reply({"blocks": self.tiers.blocks.summary()})
        limit, offset = body.get("limit", 0), body.get("offset", 0)
        for name, value in (("limit", limit), ("offset", offset)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"{name} must be a non-negative integer")
        # a page at a time: the whole list of a big cache would not fit one frame (100k entries: 24 MB);
        # the pages after the first are cut from the listing the first was (one consistent snapshot)
        kept, session.listing = session.listing, None
        if offset and kept is not None and time.monotonic() - kept[0] < _LISTING_KEPT_S:
            made, entries = kept
        else:
            made, entries = time.monotonic(), self.tiers.entries()
        total = len(entries)
        stop = min(total, offset + (min(limit, self._ls_page) if limit else self._ls_page))
        page = entries[offset:stop]
        after = stop if stop < total and (not limit or limit > len(page)) else None
        if after is not None:  # (kept only while a next page is to come, 60 s from the first at most)
            session.listing = (made, entries)
        return Reply(
            {
                "entries": [item.to_wire() for item in page],
                "total": total,
                "next": after,
                "blocks": self.tiers.blocks.summary(),
            }
        )

    def op_evict(self, session: Session, body: dict[str, Any]) -> Reply:
        """By payload digest (or a unique prefix of one, at least 8 hex digits), by cache key (identity +
        tokens), or everything."""
        if _bool(body, "all", False):
            return Reply({"removed": self.tiers.evict_all()})
        if _bool(body, "blocks", False):
            return Reply({"removed": self.tiers.blocks.evict_identity(_identity(body).digest)})
        digest = body.get("digest")
        if digest is not None:
            if not isinstance(digest, str) or not 8 <= len(digest) <= 64 or not _is_hex(digest):
                raise InvalidArgument("digest must be 8 to 64 lowercase hex digits (a digest or its prefix)")
            full = digest if len(digest) == 64 else self.tiers.resolve_digest(digest)
            return Reply({"removed": self.tiers.evict_digest(full), "digest": full})
        if "tokens" in body:
            ident = _identity(body)
            tokens = _tokens(body)
            if not tokens:
                raise InvalidArgument("tokens must hold at least one token")
            return Reply({"removed": self.tiers.evict_key(cache_key(ident, tokens))})
        raise InvalidArgument("evict takes a digest (or a prefix of at least 8 hex digits), a key "
                              "(model, state, namespace, tokens), an identity's blocks (model, state, "
                              "namespace, blocks=true), or all=true")  # fmt: skip


def _put_reply(outcome: PutOutcome) -> Reply:
    return Reply(
        {
            "stored": outcome.stored,
            "present": outcome.present,
            "skipped": outcome.skipped,
            "nbytes": outcome.nbytes,
            "durability": outcome.durability,
        }
    )


_GATE_PASSES = threading.Lock()


def _gated(path: str, run: Callable[[], object]) -> object:
    """The test hook of :data:`COPY_GATE_ENV`: waits while ``path`` exists (at most a minute) and holds
    no pass for this copy, then runs."""
    deadline = time.monotonic() + _COPY_GATE_MAX_S
    while os.path.exists(path) and time.monotonic() < deadline and not _take_pass(path):
        time.sleep(0.005)
    return run()


def _take_pass(path: str) -> bool:
    with _GATE_PASSES:
        try:
            passes = int(Path(path).read_text() or 0)
        except (OSError, ValueError):
            return False
        if passes <= 0:
            return False
        Path(path).write_text(str(passes - 1))
        return True


def _blocks_reply(served: Served) -> Reply:
    lease = served.lease
    body: dict[str, Any] = {
        "held": served.held,
        "blocks": lease.placements,
        "generations": lease.generations,
        "slot_generations": lease.slot_generations,
    }
    if lease.slot_maps is not None:
        body["slot_maps"] = lease.slot_maps
    return Reply(body, lease.fds)


def _restore_reply(opened: Opened | None) -> Reply:
    if opened is None:
        return Reply({"found": False})
    entry = opened.entry
    return Reply(
        {
            "found": True,
            "token_count": entry.token_count,
            "kind": entry.kind,
            "digest": entry.digest,
            "meta": dict(entry.meta),
            "tensors": [spec.to_wire() for spec in entry.tensors],
            "data_offset": opened.data_offset,
            "data_len": entry.data_len,
            "source": opened.source,
            "generation": opened.generation,
            "timings": opened.timings,
        },
        [opened.fd],
    )


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _identity(body: dict[str, Any]) -> Identity:
    model, state, namespace = body.get("model"), body.get("state"), body.get("namespace", "")
    if not isinstance(model, str) or not isinstance(state, str) or not isinstance(namespace, str):
        raise InvalidArgument("model, state and namespace must be strings")
    return identity(model, state, namespace)


def _tokens(body: dict[str, Any]) -> bytes:
    tokens = body.get("tokens")
    if not isinstance(tokens, bytes):
        raise InvalidArgument("tokens must be little-endian uint32 bytes (msgpack bin)")
    if len(tokens) % 4 or len(tokens) > _MAX_TOKENS_BYTES:
        raise InvalidArgument(f"tokens must be whole uint32 values, at most {_MAX_TOKENS_BYTES // 4}")
    return tokens


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _space(body: dict[str, Any]) -> BlockSpaceId:
    ident = _identity(body)
    block_tokens = body.get("block_tokens")
    if not _is_int(block_tokens):
        raise InvalidArgument("block_tokens must be an integer")
    return block_space(ident.model, ident.state, ident.namespace, block_tokens)


def _block_keys(body: dict[str, Any]) -> list[bytes]:
    """The request's keys as a list of at most ``MAX_BLOCKS_PER_REQUEST``. Each key is checked where it is
    bound to its space, the first thing every block operation does (``keys.bind_keys``: in C, the check
    and the BLAKE3 of each key in one pass; a bad one is named there, ``invalid_argument``), not twice."""
    keys = body.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"keys must be a list of at most {MAX_BLOCKS_PER_REQUEST} block keys")
    return keys


def _half(body: dict[str, Any]) -> int | None:
    """The staging half a request reads (None: the whole buffer, a client that knows no halves)."""
    half = body.get("half")
    if half is None:
        return None
    if not _is_int(half) or half not in (0, 1):
        raise InvalidArgument("half must be 0 or 1")
    return half


def _uint(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not _is_int(value) or value < 0:
        raise InvalidArgument(f"{name} must be a non-negative integer")
    return value


def _durable(body: dict[str, Any]) -> bool | str:
    value = body.get("durable", True)
    if isinstance(value, bool) or value == "sync":
        return value  # type: ignore[no-any-return]
    raise InvalidArgument('durable must be true, false or "sync"')


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false")
    return value
