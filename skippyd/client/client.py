"""The engine-side library: ``Client`` and ``AsyncClient``, the only place that makes torch tensors.

A restore to the CPU copies nothing: the daemon sends a read-only descriptor of the entry, and the
tensors are views of a private copy-on-write mapping of it (writing to them never changes the cache).
A restore to ``cuda:N`` is a DMA from the entry's shared memory, registered with CUDA once per file
generation (:mod:`skippyd.client.transfer`), queued on skippyd's stream; the caller's current stream waits for
it. (An entry served once from L3 goes through reusable pinned buffers instead.) A capture writes the
tensors' bytes into shared memory the daemon lent this connection (CUDA tensors by DMA straight into
it); the daemon copies them into memory only it can write and hashes them there.

Errors are the daemon's own :class:`~skippyd.errors.SkippydError` subclasses, rebuilt from their codes.
A broken connection is reopened once per call (every operation is safe to repeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from skippyd import __version__
from skippyd.errors import (
    BadFrame,
    ConnectionLost,
    InvalidArgument,
    ShuttingDown,
    SkippydError,
    Timeout,
    error_from_wire,
)
from skippyd.keys import encode_tokens
from skippyd.locate import DEFAULT_SOCKET, resolve_socket_path
from skippyd.payload import TensorSpec, plan_layout
from skippyd.protocol import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameType,
    encode_frame,
    recv_fds_into,
)

from .blockspace import AsyncBlockSpace, BlockSpace, BlocksPut, finish_in_thread
from .transfer import in_callers_streams, release_host

if TYPE_CHECKING:  # torch loads on the first capture or restore, so pings and stats stay light
    import torch

    from . import tensors as skt

__all__ = [
    "DEFAULT_SOCKET",
    "AsyncBlockSpace",
    "AsyncClient",
    "BlockSpace",
    "BlocksPut",
    "CaptureResult",
    "Client",
    "Hit",
    "Restored",
    "resolve_socket_path",
]


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """What a capture stored. ``l3``: a durable copy is on disk (``durable="sync"``) or queued for it
    (``durable=True``); ``durability`` says which: ``"written"``, ``"queued"``, ``"deferred"`` (L3
    cannot take it now: written later unless evicted first) or ``"none"``. ``blocks_stored``,
    ``blocks_present`` and ``blocks_nbytes``: for a capture that also put whole blocks (the transformers
    integration), the blocks newly written (and their bytes) and those already held; ``nbytes`` is the
    entry's own bytes."""

    digest: str
    token_count: int
    nbytes: int
    l2: bool
    l3: bool
    durability: str = "none"
    blocks_stored: int = 0
    blocks_present: int = 0
    blocks_nbytes: int = 0


Durable = bool | Literal["sync"]


def _check_durable(durable: Any) -> Durable:
    if isinstance(durable, bool) or durable == "sync":
        return durable  # type: ignore[no-any-return]
    raise InvalidArgument('durable must be True, False or "sync"')


def _capture_result(reply: dict[str, Any]) -> CaptureResult:
    return CaptureResult(
        digest=str(reply["digest"]),
        token_count=int(reply["token_count"]),
        nbytes=int(reply["nbytes"]),
        l2=bool(reply["l2"]),
        l3=bool(reply["l3"]),
        durability=str(reply.get("durability", "queued" if reply["l3"] else "none")),
    )


@dataclass(frozen=True, slots=True)
class Hit:
    token_count: int
    source: str
    digest: str
    nbytes: int


@dataclass(slots=True)
class Restored:
    token_count: int
    kind: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    source: str
    digest: str
    timings: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- the sans-I/O core
# Each operation is built once here as a request body and the parser of its reply; Client and AsyncClient
# only move the frames (and the descriptors of capture and restore).

T = TypeVar("T")

#: A call is tried on a fresh connection once more after these (the daemon restarted, a stream was cut);
#: a Timeout is final: waiting twice as long is not what a caller's timeout means.
_RECONNECT = (ConnectionLost, Timeout, BadFrame)
_ATTEMPTS = 2


def _retry_or_raise(exc: SkippydError, attempt: int) -> None:
    if attempt + 1 >= _ATTEMPTS or isinstance(exc, Timeout):
        raise exc


@dataclass(frozen=True, slots=True)
class _Request(Generic[T]):
    body: dict[str, Any]
    parse: Callable[[dict[str, Any]], T]


def _hello() -> dict[str, Any]:
    return {"op": "hello", "versions": [PROTOCOL_VERSION], "client": f"skippyd-py/{__version__}"}


def _identity_body(model: str, state: str, namespace: str, tokens: Any) -> dict[str, Any]:
    return {"model": model, "state": state, "namespace": namespace, "tokens": encode_tokens(tokens)}


def _health_of(reply: dict[str, Any]) -> dict[str, Any]:
    return {
        "healthy": bool(reply.get("healthy", True)),
        "dead_threads": list(reply.get("dead_threads", [])),
        "node": reply.get("node"),
    }


def _hit_of(reply: dict[str, Any]) -> Hit | None:
    if not reply.get("found"):
        return None
    return Hit(int(reply["token_count"]), str(reply["source"]), str(reply["digest"]), int(reply["nbytes"]))


def _ping_request() -> _Request[bool]:
    return _Request({"op": "ping"}, lambda reply: bool(reply.get("pong")))


def _health_request() -> _Request[dict[str, Any]]:
    return _Request({"op": "ping"}, _health_of)


def _lookup_request(model: str, state: str, namespace: str, tokens: Any) -> _Request[Hit | None]:
    return _Request({"op": "lookup", **_identity_body(model, state, namespace, tokens)}, _hit_of)


def _ran_request(model: str, tokens: Any) -> _Request[None]:
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model must be a non-empty string")
    return _Request({"op": "ran", "model": model, "tokens": encode_tokens(tokens)}, lambda _reply: None)


def _stats_request() -> _Request[dict[str, Any]]:
    return _Request({"op": "stats"}, dict)


def _config_request() -> _Request[dict[str, Any]]:
    return _Request({"op": "config"}, dict)


def _ls_request(limit: int, offset: int = 0) -> _Request[tuple[list[dict[str, Any]], int | None]]:
    """One page of ``ls``: its entries and where the next page starts (None: none follows)."""
    return _Request(
        {"op": "ls", "limit": limit, "offset": offset},
        lambda reply: (list(reply["entries"]), reply.get("next")),
    )


def _ls_more(entries: list[dict[str, Any]], limit: int, page: list[dict[str, Any]], after: Any) -> int | None:
    """Adds a page to ``entries``; where the next page starts, or None once ``limit`` (0: all) is met."""
    entries += page
    if not isinstance(after, int) or after <= 0 or not page or (limit and len(entries) >= limit):
        return None
    return after


def _block_summary_request() -> _Request[list[dict[str, Any]]]:
    return _Request({"op": "ls", "blocks": True}, lambda reply: list(reply.get("blocks", [])))


def _evict_request(  # noqa: PLR0917 - the evict() keywords, passed through
    digest: str | None,
    everything: bool,
    model: str | None,
    state: str | None,
    namespace: str,
    tokens: Any,
    blocks: bool = False,
) -> _Request[int]:
    by_key = model is not None or state is not None or tokens is not None
    if sum((digest is not None, everything, by_key)) != 1:
        raise InvalidArgument("evict takes exactly one of digest=, all=True, or model=/state=/tokens=")
    body: dict[str, Any]
    if blocks:
        if model is None or state is None or tokens is not None:
            raise InvalidArgument("evict of blocks takes model= and state= (and namespace=), no tokens")
        body = {"op": "evict", "blocks": True, "model": model, "state": state, "namespace": namespace}
    elif everything:
        body = {"op": "evict", "all": True}
    elif digest is not None:
        body = {"op": "evict", "digest": digest}
    elif model is None or state is None or tokens is None:
        raise InvalidArgument("evict by key needs model=, state= and tokens=")
    else:
        body = {"op": "evict", **_identity_body(model, state, namespace, tokens)}
    return _Request(body, lambda reply: int(reply["removed"]))


def _capture_request(  # noqa: PLR0917 - the capture() keywords, passed through
    model: str,
    state: str,
    namespace: str,
    tokens: Any,
    tensors: Mapping[str, Any],
    kind: str,
    meta: Mapping[str, Any] | None,
    durable: Any,
) -> tuple[_Request[CaptureResult], list[TensorSpec], int]:
    """The capture's request, where each tensor goes in the staging buffer, and how many bytes it needs."""
    table, specs, data_len = _tensor_table(tensors)
    body = {
        "op": "capture",
        **_identity_body(model, state, namespace, tokens),
        "tensors": table,
        "kind": kind,
        "meta": dict(meta or {}),
        "durable": _check_durable(durable),
    }
    return _Request(body, _capture_result), specs, data_len


def _restore_request(model: str, state: str, namespace: str, tokens: Any) -> dict[str, Any]:
    return {"op": "restore", **_identity_body(model, state, namespace, tokens)}


def _skt() -> Any:
    from . import tensors

    return tensors


def _tensor_table(tensors: Mapping[str, Any]) -> tuple[list[Any], list[TensorSpec], int]:
    decls = _skt().declare(tensors)
    specs, data_len = plan_layout(decls)
    return [[d.name, d.dtype, list(d.shape)] for d in decls], specs, data_len


def _device(device: str | torch.device | None) -> torch.device:
    """The target of a restore: a CUDA device this process has none of is :class:`NoDevice`."""
    from .transfer.cuda import resolve_device

    return resolve_device(device)


def _staging_size(current: _Staging | None, needed: int, info: dict[str, Any]) -> int:
    """Grow geometrically (fewer re-stagings), but never past what the daemon lends one connection."""
    want = max(needed, 2 * current.size if current is not None else 0)
    limit = int(info.get("staging_max", want))
    return min(want, limit) if limit >= needed else needed


_HALVES_FEATURE = "staging_halves"  # hello's feature: the daemon takes staged requests in two halves


def _halves(size: int, info: dict[str, Any]) -> bool:
    """Whether a staged request of ``size`` bytes goes in one half of the staging buffer: the daemon
    says it takes halves and two halves of that size fit what it lends (docs/protocol.md, "Staging
    halves"); else the request has the whole buffer and its reply waits for the daemon's copy."""
    if _HALVES_FEATURE not in info.get("features", ()):
        return False
    return 2 * _pages(size) <= int(info.get("staging_max", 1 << 62))


def _pages(size: int) -> int:
    return -(-max(size, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def _staging_need(size: int, info: dict[str, Any]) -> int:
    """The staging buffer a staged request of ``size`` bytes needs: two halves of it, or itself."""
    return 2 * _pages(size) if _halves(size, info) else max(size, 1)


#: The most one staged put request carries where the daemon takes halves: a larger put goes as several
#: requests, the client filling one half while the daemon copies the other out of the half before.
_PUT_CHUNK = 64 << 20


def _staged_limit(info: dict[str, Any]) -> int:
    """The most one staged put request carries: a half of what the daemon lends (at most
    :data:`_PUT_CHUNK`) where it takes halves, else all of it."""
    limit = int(info.get("staging_max", info.get("max_entry", 1 << 30)))
    if _HALVES_FEATURE in info.get("features", ()):
        return min(_PUT_CHUNK, limit // 2 // mmap.PAGESIZE * mmap.PAGESIZE)
    return limit


def _with_half(body: dict[str, Any], half: int | None) -> dict[str, Any]:
    return body if half is None else {**body, "half": half}


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _answered(exc: BaseException) -> bool:
    """True when ``exc`` is the daemon's own error reply: the request is over on its side too.
    ``shutting_down`` is not: daemons before 2026-12 answered it at once, before a copy behind an
    earlier reply may have read its staging half, so the connection (and its staging) is dropped."""
    return isinstance(exc, SkippydError) and not isinstance(
        exc, (Timeout, ConnectionLost, BadFrame, ShuttingDown)
    )


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A request :meth:`Client._send` sent: the connection it went out on, its id and its body."""

    conn: _Conn
    request_id: int
    body: dict[str, Any]


def _drop_reply(task: asyncio.Task[tuple[dict[str, Any], list[int]]]) -> None:
    if not task.cancelled() and task.exception() is None:
        _close_all(task.result()[1])


class _Staging:
    @classmethod
    def from_reply(cls, reply: dict[str, Any], fds: list[int]) -> _Staging:
        if len(fds) != 1:
            _close_all(fds)
            raise BadFrame("a stage reply must carry exactly one descriptor")
        return cls(fds[0], int(reply["size"]))

    def __init__(self, fd: int, size: int) -> None:
        try:
            self.mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.half_len = size // 2 // mmap.PAGESIZE * mmap.PAGESIZE
        # a client dropped without close(): a device copy may have registered the halves, and the mapping
        # must not go before they are unregistered (transfer.release_host)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        self._halves = (base, base + self.half_len) if self.half_len else (base,)  # (each its own range)
        self._dropped = weakref.finalize(self, release_host, self.mapping, self._halves)
        self._dropped.atexit = False  # (the process's end takes the registrations with it)
        self.next_half = 0  # the half the next staged request writes (the other one may still be read)
        # used in halves or whole (None: not yet). One buffer is never used both ways: a device copy
        # registers the region it writes (cudaHostRegister), and a whole-buffer region overlapping a
        # registered second half could not be registered again
        self.halved: bool | None = None

    def fits(self, need: int, halves: bool) -> bool:
        return self.size >= need and self.halved in (None, halves)

    def region(self, length: int) -> memoryview:
        return memoryview(self.mapping)[:length]

    def take(self, length: int, halves: bool) -> tuple[memoryview, int | None]:
        """Where the next staged request of ``length`` bytes is written, and the half it names: the
        half the last reply freed (the daemon answers a staged request only once its copy of the one
        before, which read the other half, has ended), or the whole buffer (None)."""
        self.halved = halves
        if not halves:
            return self.region(length), None
        half = self.next_half
        start = half * self.half_len
        return memoryview(self.mapping)[start : start + length], half

    def answered(self, half: int | None) -> None:
        """The daemon answered the request that wrote ``half``: the next one writes the other half."""
        if half is not None:
            self.next_half = 1 - half

    def close(self) -> None:
        """Unmaps the buffer now where no device copy can have registered it (no CUDA transfer in this
        process); else its registrations go at the transfer's next call or idle sweep, then the mapping,
        in that order, and never waiting here (on an event loop's thread, behind another thread's device
        copy): :func:`~skippyd.client.transfer.release_host`."""
        self._dropped.detach()
        release_host(self.mapping, self._halves)


#: The CUDA simulator only (skippyd.client.transfer.sim): a restore to the CPU goes the way one to CUDA does.
_CPU_AS_DEVICE = False


def _finish_restore(
    reply: dict[str, Any], fds: list[int], device: torch.device, stager: skt.DeviceStager | None
) -> Restored:
    if len(fds) != 1:
        _close_all(fds)
        raise BadFrame("a restore reply must carry exactly one descriptor")
    fd = fds[0]
    started = time.perf_counter()
    skt = _skt()
    try:
        specs = [TensorSpec.from_wire(item) for item in reply["tensors"]]
        offset, length = int(reply["data_offset"]), int(reply["data_len"])
        if device.type == "cpu" and not _CPU_AS_DEVICE:
            tensors = skt.map_entry(fd, offset, length, specs)
        elif device.type in ("cuda", "cpu"):
            tensors = _to_cuda(reply, fd, offset, length, specs, device, stager)
        else:
            tensors = {k: v.to(device) for k, v in skt.copy_entry(fd, offset, length, specs).items()}
    finally:
        os.close(fd)
    timings = {k: float(v) for k, v in dict(reply.get("timings") or {}).items()}
    timings["import_ms"] = (time.perf_counter() - started) * 1e3
    return Restored(
        token_count=int(reply["token_count"]),
        kind=str(reply["kind"]),
        tensors=tensors,
        meta=dict(reply.get("meta") or {}),
        source=str(reply["source"]),
        digest=str(reply["digest"]),
        timings=timings,
    )


def _to_cuda(  # noqa: PLR0917 - the restore's parts, passed through
    reply: dict[str, Any],
    fd: int,
    offset: int,
    length: int,
    specs: list[TensorSpec],
    device: torch.device,
    stager: skt.DeviceStager | None,
) -> dict[str, torch.Tensor]:
    """The entry's tensors on ``device``: one DMA from its registered shared memory, queued (the current
    stream waits for it); an entry served once (generation 0: an L3 read) goes through pinned buffers."""
    from .transfer.device import transfer

    views: dict[str, torch.Tensor]
    if not length:  # (a tail of no tokens: nothing to copy)
        import torch

        views = _skt().device_views(torch.empty(0, dtype=torch.uint8, device=device), specs)
        return views
    data = transfer().entry_to_device(fd, int(reply.get("generation") or 0), offset, length, device)
    if data is not None:
        views = _skt().device_views(data, specs)
        return views
    assert stager is not None
    return stager.to_device(fd, offset, length, specs, device)


class _HoldsStaging:
    """A connection's staging buffer, the part the blocking and the async connections share (their
    ``stage`` request is what differs)."""

    staging: _Staging | None
    info: dict[str, Any]

    def _staging_or_size(self, size: int, halves: bool) -> _Staging | int:
        """The buffer held, where it fits ``size`` bytes used in halves or whole; else the size to ask
        the daemon for, the buffer held closed (smaller, or used the other way)."""
        if self.staging is not None and self.staging.fits(size, halves):
            return self.staging
        want = _staging_size(self.staging, size, self.info)
        self._drop_staging()
        return want

    def _adopt_staging(self, reply: dict[str, Any], fds: list[int]) -> _Staging:
        self.staging = _Staging.from_reply(reply, fds)
        return self.staging

    def _drop_staging(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None


class _Conn(_HoldsStaging):
    """One blocking connection: handshake, request/reply with descriptors, and its staging buffer."""

    def __init__(self, path: str, connect_timeout: float) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(connect_timeout)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ConnectionLost(f"cannot reach skippyd at {path}: {exc.strerror or exc}") from exc
        # Blocking mode with kernel-side timeouts: no poll() before every send and receive.
        self.sock.settimeout(None)
        self._timeout = -1.0
        self.decoder = FrameDecoder(DEFAULT_MAX_FRAME, expect=(FrameType.REPLY, FrameType.ERROR))
        self.ids = itertools.count(1)
        self.staging: _Staging | None = None
        self.info: dict[str, Any] = {}

    def handshake(self, timeout: float) -> None:
        reply, _ = self.request(_hello(), timeout)
        self.info = reply
        self.decoder.max_frame = int(reply.get("max_frame", DEFAULT_MAX_FRAME))

    def _set_timeout(self, timeout: float) -> None:
        if timeout != self._timeout:
            seconds = int(timeout)
            timeval = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            self._timeout = timeout

    def request(self, body: dict[str, Any], timeout: float) -> tuple[dict[str, Any], list[int]]:
        return self.receive(self.send(body, timeout), body, timeout)

    def send(self, body: dict[str, Any], timeout: float) -> int:
        """Sends one request; its id, for :meth:`receive` (0 when the daemon closed the connection before
        it went out: its error frame, e.g. ``permission_denied``, is what :meth:`receive` reads then)."""
        request_id = next(self.ids)
        data = encode_frame(FrameType.REQUEST, request_id, body)
        self._set_timeout(timeout)
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return 0
        except (TimeoutError, BlockingIOError) as exc:
            raise Timeout(f"skippyd did not take {body.get('op')} within {timeout:g}s") from exc
        except OSError as exc:
            raise ConnectionLost(f"connection to skippyd lost: {exc.strerror or exc}") from exc
        return request_id

    def receive(
        self, request_id: int, body: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], list[int]]:
        """The reply to the request :meth:`send` sent as ``request_id`` (replies come in order)."""
        self._set_timeout(timeout)
        try:
            frame = self._read_frame(request_id)
        except (TimeoutError, BlockingIOError) as exc:
            raise Timeout(f"skippyd did not answer {body.get('op')} within {timeout:g}s") from exc
        except OSError as exc:
            raise ConnectionLost(f"connection to skippyd lost: {exc.strerror or exc}") from exc
        if frame.type == FrameType.ERROR:
            _close_all(frame.fds)
            raise error_from_wire(frame.body)
        return frame.body, frame.fds

    def _read_frame(self, request_id: int) -> Frame:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                if frame.request_id in (request_id, 0):
                    return frame
                _close_all(frame.fds)  # a reply to a request we gave up on
                continue
            data, fds = recv_fds_into(self.sock)
            if not data:
                _close_all(fds)
                raise ConnectionLost("skippyd closed the connection")
            self.decoder.feed(data, fds)

    def ensure_staging(self, size: int, timeout: float, halves: bool = False) -> _Staging:
        """A staging buffer of at least ``size`` bytes, to be used in halves or whole (a new one when the
        one held is smaller or was used the other way)."""
        held = self._staging_or_size(size, halves)
        if isinstance(held, _Staging):
            return held
        return self._adopt_staging(*self.request({"op": "stage", "size": held}, timeout))

    def close(self) -> None:
        self._drop_staging()
        self.decoder.close()
        with contextlib.suppress(OSError):
            self.sock.close()


class Client:
    """A blocking client of the local daemon. Thread-safe (one request at a time per client)."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._conn: _Conn | None = None
        self._lock = threading.RLock()
        self._stager: skt.DeviceStager | None = None
        self._closed = False

    # ------------------------------------------------------------- plumbing
    def _connection(self) -> _Conn:
        if self._closed:
            raise ConnectionLost("this client is closed")
        if self._conn is None:
            conn = _Conn(self.socket_path, self.connect_timeout)
            try:
                conn.handshake(self.timeout)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _call(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            for attempt in range(_ATTEMPTS):
                try:
                    return self._connection().request(body, self.timeout)
                except _RECONNECT as exc:
                    self._drop()  # a blocking stream cut mid-reply cannot be resynchronised
                    _retry_or_raise(exc, attempt)
            raise AssertionError("unreachable")

    def _do(self, request: _Request[T]) -> T:
        reply, fds = self._call(request.body)
        _close_all(fds)
        return request.parse(reply)

    # A request sent ahead (a long blocks_get sends its next request before it reads the reply in hand, so
    # the daemon leases the next blocks while the client copies these): the client's lock is held from
    # _send to _receive (or _abandon), so no other thread's request reads its reply.
    def _send(self, body: dict[str, Any]) -> _Ahead:
        self._lock.acquire()
        try:
            for attempt in range(_ATTEMPTS):
                try:
                    conn = self._connection()
                    return _Ahead(conn, conn.send(body, self.timeout), body)
                except _RECONNECT as exc:
                    self._drop()
                    _retry_or_raise(exc, attempt)
            raise AssertionError("unreachable")
        except BaseException:
            self._lock.release()
            raise

    def _receive(self, ahead: _Ahead) -> tuple[dict[str, Any], list[int]]:
        try:
            try:
                if ahead.conn is not self._conn:
                    raise ConnectionLost("connection to skippyd lost")
                return ahead.conn.receive(ahead.request_id, ahead.body, self.timeout)
            except _RECONNECT as exc:
                self._drop()
                _retry_or_raise(exc, 0)
            try:  # once more, on a new connection, as _call would
                return self._connection().request(ahead.body, self.timeout)
            except _RECONNECT:
                self._drop()
                raise
        finally:
            self._lock.release()

    def _abandon(self, ahead: _Ahead) -> None:
        """Reads and drops the reply to a request sent ahead that is no longer wanted (its descriptors
        closed at once, so the daemon's leases end)."""
        try:
            if ahead.conn is self._conn:
                try:
                    _, fds = ahead.conn.receive(ahead.request_id, ahead.body, self.timeout)
                    _close_all(fds)
                except SkippydError as exc:
                    if isinstance(exc, _RECONNECT):
                        self._drop()
        finally:
            self._lock.release()

    @property
    def server_info(self) -> dict[str, Any]:
        """What the daemon said in the handshake (version, node, limits)."""
        with self._lock:
            return dict(self._connection().info)

    # ------------------------------------------------------------- operations
    def ping(self) -> bool:
        """True when the daemon answers; a daemon that cannot be reached is ``False``, not an error."""
        try:
            return self._do(_ping_request())
        except (ConnectionLost, Timeout):
            return False

    def health(self) -> dict[str, Any]:
        """The daemon's own view of itself: ``healthy`` (every background thread runs), ``dead_threads``
        and ``node``. Raises :class:`~skippyd.errors.ConnectionLost` when it cannot be reached."""
        return self._do(_health_request())

    def capture(
        self,
        *,
        model: str,
        state: str,
        namespace: str = "",
        tokens: Any,
        tensors: Mapping[str, torch.Tensor],
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        durable: Durable = True,
    ) -> CaptureResult:
        """Stores the state after exactly ``tokens``; bytes are kept bit-for-bit.

        ``durable=True`` queues a copy on disk (L3) and returns at once; ``"sync"`` returns once that copy
        is fsynced (``.l3`` then says it is); ``False`` keeps it in memory only.
        """
        request, specs, data_len = _capture_request(
            model, state, namespace, tokens, tensors, kind, meta, durable
        )
        reply = self._staged(request.body, data_len, lambda region: _skt().write_into(region, specs, tensors))
        return request.parse(reply)

    def _staged(self, body: dict[str, Any], size: int, write: Callable[[memoryview], None]) -> dict[str, Any]:
        """``write`` into the first ``size`` bytes of this connection's staging buffer, then ``body``."""
        with self._lock:
            for attempt in range(_ATTEMPTS):
                try:
                    conn = self._connection()
                    halves = _halves(size, conn.info)
                    staging = conn.ensure_staging(_staging_need(size, conn.info), self.timeout, halves)
                    region, half = staging.take(size, halves)
                    try:
                        write(region)
                    finally:
                        region.release()
                    try:
                        reply, fds = conn.request(_with_half(body, half), self.timeout)
                    except SkippydError as exc:
                        if _answered(exc):
                            staging.answered(half)
                        raise
                    staging.answered(half)
                    _close_all(fds)
                    return reply
                except _RECONNECT as exc:
                    self._drop()
                    _retry_or_raise(exc, attempt)
                except BaseException as exc:
                    if not _answered(exc):  # e.g. KeyboardInterrupt: see AsyncClient._staged
                        self._drop()
                    raise
            raise AssertionError("unreachable")

    def _staging_max(self) -> int:
        """The most one staged request may carry (half of what the daemon lends, where it takes halves)."""
        with self._lock:
            return _staged_limit(self._connection().info)

    def blocks(self, *, model: str, state: str, namespace: str = "", block_tokens: int) -> BlockSpace:
        """The blocks of one identity and block size (see :class:`~skippyd.client.blockspace.BlockSpace`)."""
        return BlockSpace(
            self._call, self._staged, self._staging_max, ahead=(self._send, self._receive, self._abandon),
            model=model, state=state, namespace=namespace, block_tokens=block_tokens,
        )  # fmt: skip

    def lookup(self, *, model: str, state: str, namespace: str = "", tokens: Any) -> Hit | None:
        """The longest captured prefix of ``tokens``, without restoring it."""
        return self._do(_lookup_request(model, state, namespace, tokens))

    def restore(
        self,
        *,
        model: str,
        state: str,
        namespace: str = "",
        tokens: Any,
        device: str | torch.device | None = "cpu",
    ) -> Restored | None:
        """The longest captured prefix, as tensors on ``device`` (CPU: views of shared memory, no copy)."""
        target = _device(device)
        body = _restore_request(model, state, namespace, tokens)
        started = time.perf_counter()
        reply, fds = self._call(body)
        if not reply.get("found"):
            _close_all(fds)
            return None
        if target.type == "cuda" and self._stager is None:
            self._stager = _skt().DeviceStager()
        restored = _finish_restore(reply, fds, target, self._stager)
        restored.timings["total_ms"] = (time.perf_counter() - started) * 1e3
        return restored

    def ran(self, *, model: str, tokens: Any) -> None:
        """Tells the warm-prefix table that this node ran this prompt."""
        self._do(_ran_request(model, tokens))

    def stats(self) -> dict[str, Any]:
        """Every counter of the daemon, by tier (see docs/protocol.md, ``stats``)."""
        return self._do(_stats_request())

    def config(self) -> dict[str, Any]:
        """The daemon's effective settings: ``values``, their ``sources``, ``derived`` paths, ``pid``."""
        return self._do(_config_request())

    def ls(self, limit: int = 0) -> list[dict[str, Any]]:
        """The entries held, most recently used first (at most ``limit``; 0: all), asked a page at a time
        (the pages are cut from one listing the daemon made for the first)."""
        entries: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            page, after = self._do(_ls_request(limit - len(entries) if limit else 0, offset))
            offset = _ls_more(entries, limit, page, after)
        return entries[:limit] if limit else entries

    def block_summary(self) -> list[dict[str, Any]]:
        """Blocks held per identity: ``identity`` (digest), ``l2_blocks``, ``l2_bytes``, ``l3_blocks``,
        ``l3_bytes``; most blocks first."""
        return self._do(_block_summary_request())

    def evict(
        self,
        *,
        digest: str | None = None,
        all: bool = False,
        model: str | None = None,
        state: str | None = None,
        namespace: str = "",
        tokens: Any = None,
        blocks: bool = False,
    ) -> int:
        """Removes entries: by payload ``digest`` (or a unique prefix of it, at least 8 hex digits), the
        one entry of ``model``/``state``/``namespace``/``tokens`` (its cache key), or every entry and
        block with ``all=True``; returns how many cache keys were removed. With ``blocks=True`` and
        ``model``/``state``/``namespace``: every block of that identity (any block size), counted."""
        return self._do(_evict_request(digest, all, model, state, namespace, tokens, blocks))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AsyncConn(_HoldsStaging):
    """A non-blocking connection with pipelined requests; replies are matched by request id."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.loop = loop
        self.decoder = FrameDecoder(DEFAULT_MAX_FRAME, expect=(FrameType.REPLY, FrameType.ERROR))
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[Frame]] = {}
        self.staging: _Staging | None = None
        self.info: dict[str, Any] = {}
        self.closed = False
        self.sending = asyncio.Lock()  # one frame on the wire at a time: concurrent sends would interleave
        loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            data, fds = recv_fds_into(self.sock)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, SkippydError) as exc:
            self._fail(ConnectionLost(f"connection to skippyd lost: {exc}"))
            return
        if not data:
            _close_all(fds)
            self._fail(ConnectionLost("skippyd closed the connection"))
            return
        self.decoder.feed(data, fds)
        while True:
            try:
                frame = self.decoder.next_frame()
            except SkippydError as exc:
                self._fail(exc)
                return
            if frame is None:
                return
            if frame.request_id == 0:
                self._fail(error_from_wire(frame.body))
                return
            future = self.waiting.pop(frame.request_id, None)
            if future is None or future.done():
                _close_all(frame.fds)
                continue
            future.set_result(frame)

    def _fail(self, exc: SkippydError) -> None:
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(exc)
        self.waiting.clear()
        self.close()

    async def request(self, body: dict[str, Any], timeout: float) -> tuple[dict[str, Any], list[int]]:
        if self.closed:
            raise ConnectionLost("connection to skippyd is closed")
        request_id = next(self.ids)
        wire = encode_frame(FrameType.REQUEST, request_id, body)
        future: asyncio.Future[Frame] = self.loop.create_future()
        self.waiting[request_id] = future
        try:
            try:
                async with asyncio.timeout(timeout):  # the whole request: waiting to send, sending, the reply
                    async with self.sending:
                        if self.closed:
                            raise ConnectionLost("connection to skippyd is closed")
                        try:
                            await self.loop.sock_sendall(self.sock, wire)
                        except BaseException:
                            # cancelled or timed out part-way: a partial frame is on the wire and every
                            # later frame would be misread, so this connection is done (the next call
                            # reconnects)
                            self._fail(ConnectionLost("a request was interrupted while it was being sent"))
                            raise
                    frame = await future
            except BaseException:
                # cancelled or timed out once the reply had come: its descriptors (leases of the daemon's
                # memory) are nobody's but ours to close
                if future.done() and not future.cancelled() and future.exception() is None:
                    _close_all(future.result().fds)
                raise
        except ConnectionLost:
            raise
        except TimeoutError as exc:
            # a late reply to this id is dropped when it comes; the connection stays usable
            raise Timeout(f"skippyd did not answer {body.get('op')} within {timeout:g}s") from exc
        except OSError as exc:
            self._fail(ConnectionLost(str(exc)))
            raise ConnectionLost(f"connection to skippyd lost: {exc}") from exc
        finally:
            self.waiting.pop(request_id, None)
        if frame.type == FrameType.ERROR:
            _close_all(frame.fds)
            raise error_from_wire(frame.body)
        return frame.body, frame.fds

    async def ensure_staging(self, size: int, timeout: float, halves: bool = False) -> _Staging:
        """As :meth:`_Conn.ensure_staging`."""
        held = self._staging_or_size(size, halves)
        if isinstance(held, _Staging):
            return held
        return self._adopt_staging(*await self.request({"op": "stage", "size": held}, timeout))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        self._drop_staging()
        self.decoder.close()
        with contextlib.suppress(OSError):
            self.sock.close()


class AsyncClient:
    """The same operations as :class:`Client`, as coroutines; requests on one client are pipelined."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._conn: _AsyncConn | None = None
        self._connecting = asyncio.Lock()
        self._capture_lock = asyncio.Lock()
        self._stager: skt.DeviceStager | None = None
        self._closed = False

    async def _connection(self) -> _AsyncConn:
        if self._closed:
            raise ConnectionLost("this client is closed")
        async with self._connecting:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            loop = asyncio.get_running_loop()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, self.socket_path), self.connect_timeout)
            except (OSError, TimeoutError) as exc:
                sock.close()
                raise ConnectionLost(f"cannot reach skippyd at {self.socket_path}: {exc}") from exc
            conn = _AsyncConn(sock, loop)
            try:
                reply, _ = await conn.request(_hello(), self.timeout)
            except BaseException:
                conn.close()
                raise
            conn.info = reply
            conn.decoder.max_frame = int(reply.get("max_frame", DEFAULT_MAX_FRAME))
            self._conn = conn
            return conn

    async def _call(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        for attempt in range(_ATTEMPTS):
            try:
                conn = await self._connection()
                return await conn.request(body, self.timeout)
            except _RECONNECT as exc:
                # a lost connection has failed itself; after a timeout it stays usable (a late reply to
                # this id is dropped when it comes), and the timeout is final
                _retry_or_raise(exc, attempt)
        raise AssertionError("unreachable")

    async def _do(self, request: _Request[T]) -> T:
        reply, fds = await self._call(request.body)
        _close_all(fds)
        return request.parse(reply)

    # A request sent ahead (see Client._send): requests on one connection are pipelined already.
    def _send(self, body: dict[str, Any]) -> asyncio.Task[tuple[dict[str, Any], list[int]]]:
        return asyncio.ensure_future(self._call(body))

    async def _receive(
        self, ahead: asyncio.Task[tuple[dict[str, Any], list[int]]]
    ) -> tuple[dict[str, Any], list[int]]:
        return await ahead

    def _abandon(self, ahead: asyncio.Task[tuple[dict[str, Any], list[int]]]) -> None:
        """Closes the reply's descriptors when it comes (an abandoned request is not awaited)."""
        ahead.add_done_callback(_drop_reply)

    async def ping(self) -> bool:
        """As :meth:`Client.ping`."""
        try:
            return await self._do(_ping_request())
        except (ConnectionLost, Timeout):
            return False

    async def health(self) -> dict[str, Any]:
        """As :meth:`Client.health`."""
        return await self._do(_health_request())

    async def capture(
        self,
        *,
        model: str,
        state: str,
        namespace: str = "",
        tokens: Any,
        tensors: Mapping[str, torch.Tensor],
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        durable: Durable = True,
    ) -> CaptureResult:
        """As :meth:`Client.capture`; the copy into the staging buffer runs in a thread."""
        request, specs, data_len = _capture_request(
            model, state, namespace, tokens, tensors, kind, meta, durable
        )
        reply = await self._staged(
            request.body, data_len, lambda region: _skt().write_into(region, specs, tensors)
        )
        return request.parse(reply)

    async def _staged(
        self, body: dict[str, Any], size: int, write: Callable[[memoryview], None]
    ) -> dict[str, Any]:
        """As :meth:`Client._staged`; the copy runs in a thread."""
        async with self._capture_lock:  # the staging buffer is one per connection
            for attempt in range(_ATTEMPTS):
                conn: _AsyncConn | None = None
                try:
                    conn = await self._connection()
                    halves = _halves(size, conn.info)
                    staging = await conn.ensure_staging(_staging_need(size, conn.info), self.timeout, halves)
                    region, half = staging.take(size, halves)
                    try:  # (cancelled mid-copy: the copy ends before the buffer goes)
                        await finish_in_thread(in_callers_streams(write), region)
                    finally:
                        region.release()
                    try:
                        reply, fds = await conn.request(_with_half(body, half), self.timeout)
                    except SkippydError as exc:
                        if _answered(exc):
                            staging.answered(half)
                        raise
                    staging.answered(half)
                    _close_all(fds)
                    return reply
                except (ConnectionLost, BadFrame) as exc:
                    _retry_or_raise(exc, attempt)
                except BaseException as exc:
                    # A request abandoned before the daemon answered (timeout, cancellation) may still
                    # be queued there, reading this connection's staging buffer when it runs: the next
                    # one must not write into that buffer. It asks for a new one instead, and the
                    # daemon runs a connection's requests in order, so the abandoned request has read
                    # the old buffer before the new one is lent (other requests in flight are kept).
                    if conn is not None and not _answered(exc):
                        conn._drop_staging()
                    raise
            raise AssertionError("unreachable")

    async def _staging_max(self) -> int:
        """As :meth:`Client._staging_max`."""
        return _staged_limit((await self._connection()).info)

    def blocks(self, *, model: str, state: str, namespace: str = "", block_tokens: int) -> AsyncBlockSpace:
        """As :meth:`Client.blocks`, with coroutines."""
        return AsyncBlockSpace(
            self._call, self._staged, self._staging_max, ahead=(self._send, self._receive, self._abandon),
            model=model, state=state, namespace=namespace, block_tokens=block_tokens,
        )  # fmt: skip

    async def lookup(self, *, model: str, state: str, namespace: str = "", tokens: Any) -> Hit | None:
        """As :meth:`Client.lookup`."""
        return await self._do(_lookup_request(model, state, namespace, tokens))

    async def restore(
        self,
        *,
        model: str,
        state: str,
        namespace: str = "",
        tokens: Any,
        device: str | torch.device | None = "cpu",
    ) -> Restored | None:
        """As :meth:`Client.restore`; a copy to a device runs in a thread."""
        target = _device(device)
        body = _restore_request(model, state, namespace, tokens)
        started = time.perf_counter()
        reply, fds = await self._call(body)
        if not reply.get("found"):
            _close_all(fds)
            return None
        if target.type == "cuda" and self._stager is None:
            self._stager = _skt().DeviceStager()
        if target.type == "cpu":
            restored = _finish_restore(reply, fds, target, None)
        else:  # on a thread, ordered against the caller's current stream (not the thread's own)
            finish = in_callers_streams(_finish_restore)
            restored = await asyncio.to_thread(finish, reply, fds, target, self._stager)
        restored.timings["total_ms"] = (time.perf_counter() - started) * 1e3
        return restored

    async def ran(self, *, model: str, tokens: Any) -> None:
        """As :meth:`Client.ran`."""
        await self._do(_ran_request(model, tokens))

    async def stats(self) -> dict[str, Any]:
        """As :meth:`Client.stats`."""
        return await self._do(_stats_request())

    async def config(self) -> dict[str, Any]:
        """As :meth:`Client.config`."""
        return await self._do(_config_request())

    async def ls(self, limit: int = 0) -> list[dict[str, Any]]:
        """As :meth:`Client.ls`."""
        entries: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            page, after = await self._do(_ls_request(limit - len(entries) if limit else 0, offset))
            offset = _ls_more(entries, limit, page, after)
        return entries[:limit] if limit else entries

    async def block_summary(self) -> list[dict[str, Any]]:
        """As :meth:`Client.block_summary`."""
        return await self._do(_block_summary_request())

    async def evict(
        self,
        *,
        digest: str | None = None,
        all: bool = False,
        model: str | None = None,
        state: str | None = None,
        namespace: str = "",
        tokens: Any = None,
        blocks: bool = False,
    ) -> int:
        """As :meth:`Client.evict`."""
        return await self._do(_evict_request(digest, all, model, state, namespace, tokens, blocks))

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
