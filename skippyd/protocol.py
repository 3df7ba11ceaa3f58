"""The wire protocol: fixed frame headers, msgpack bodies with explicit limits, fd passing.

Everything a client in another language needs is in docs/protocol.md; this module is its reference
implementation and knows nothing about tiers or handlers.

Frame (little-endian)::

    0   4  magic        b"SKPD"
    4   1  version      PROTOCOL_VERSION
    5   1  type         1 request, 2 reply, 3 error
    6   1  flags        reserved, 0
    7   1  nfds         file descriptors sent with this frame (SCM_RIGHTS, on its first byte)
    8   4  length       body length in bytes, at most the negotiated max frame
    12  4  reserved     0
    16  8  request_id   chosen by the client, echoed in the reply
    24  …  body         msgpack map
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import BadFrame, FrameTooLarge, VersionMismatch

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFAULT_REPLY_FDS",
    "HEADER",
    "MAGIC",
    "MAX_BLOCK_BYTES",
    "MAX_FDS",
    "MAX_REQUEST_ITEMS",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "decode_body",
    "encode_body",
    "encode_frame",
    "recv_fds_into",
    "send_frame",
]

MAGIC = b"SKPD"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBBBII Q")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 24
DEFAULT_MAX_FRAME = 16 << 20
#: The most descriptors one frame may carry (a receiver's control buffer holds this many). A
#: ``blocks_get`` reply carries at most what its request's ``max_fds`` asks, :data:`DEFAULT_REPLY_FDS`
#: where it asks nothing (clients from before ``max_fds`` read at most 8 a frame).
MAX_FDS = 64
DEFAULT_REPLY_FDS = 8
MAX_BLOCK_BYTES = 64 << 20  # one block's size: a blocks_put naming a larger one is too_large
MAX_BLOCKS_PER_REQUEST = 8192  # keys one blocks_* request may name (clients split longer calls)


class FrameType:
    REQUEST = 1
    REPLY = 2
    ERROR = 3


_TYPES = (FrameType.REQUEST, FrameType.REPLY, FrameType.ERROR)


@dataclass(slots=True)
class Frame:
    type: int
    request_id: int
    body: dict[str, Any]
    fds: list[int] = field(default_factory=list)
    size: int = 0  # what it holds in memory: body bytes on the wire, plus its decoded arrays and maps


def encode_body(body: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


MAX_REQUEST_ITEMS = 1 << 18  # elements of all arrays and maps of one request body, together


#: What a decoded container and one of its elements take in Python, about (a list or dict object; a
#: pointer and the element's own object: a short str or bytes is ~40 bytes, a small int is shared): a
#: queued request is counted at its wire size plus these, so buffers bound memory, not only wire bytes.
_CONTAINER_COST, _SLOT_COST = 64, 48


class _ItemBudget:
    """Counts the elements of every container as msgpack builds it: a small frame of nested empty
    arrays would otherwise become millions of Python objects (tens of bytes each per wire byte). It
    also bounds the containers by the body's length (an empty array is one wire byte and a Python
    object of 56), and says what the decoded body costs."""

    __slots__ = ("containers", "elements", "left", "most_containers")

    def __init__(self, items: int, length: int) -> None:
        self.left = items
        self.containers = self.elements = 0
        self.most_containers = _MIN_CONTAINERS + length // 3  # (a tensor table takes ~4.5 bytes one)

    def spend(self, container: Any) -> Any:
        self.left -= len(container) + 1
        self.containers += 1
        self.elements += len(container)
        if self.left < 0:
            raise ValueError("too many array/map elements in one body")
        if self.containers > self.most_containers:
            raise ValueError("too many arrays and maps for the body's size")
        return container

    @property
    def cost(self) -> int:
        return self.containers * _CONTAINER_COST + self.elements * _SLOT_COST


_MIN_CONTAINERS = 4096


def decode_body(
    raw: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME, *, max_items: int | None = None
) -> dict[str, Any]:
    """Unpacks a msgpack map with every container and string bounded by the frame size.

    ``max_items`` (the daemon's side: :data:`MAX_REQUEST_ITEMS`) also bounds the elements of all
    containers together, and the containers by the body's length, so the decoded body's memory stays
    proportional to what a request needs.
    """
    return decode_counted(raw, max_frame, max_items=max_items)[0]


def decode_counted(
    raw: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME, *, max_items: int | None = None
) -> tuple[dict[str, Any], int]:
    """:func:`decode_body`, and about what its arrays and maps take in memory beyond the wire bytes
    (0 without ``max_items``)."""
    options: dict[str, Any] = {}
    budget: _ItemBudget | None = None
    if max_items is not None:
        budget = _ItemBudget(max_items, len(raw))
        options.update(list_hook=budget.spend, object_hook=budget.spend)
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=max_frame,
            max_str_len=min(max_frame, 1 << 20),
            max_array_len=1 << 16 if max_items is None else min(1 << 16, max_items),
            max_map_len=1 << 12,
            max_ext_len=0,
            **options,
        )
    except Exception as exc:  # msgpack raises ValueError/TypeError subclasses and a few of its own
        raise BadFrame(f"body is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise BadFrame(f"body must be a map, not {type(body).__name__}")
    return body, budget.cost if budget is not None else 0


def encode_frame(frame_type: int, request_id: int, body: dict[str, Any], nfds: int = 0) -> bytes:
    payload = encode_body(body)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, frame_type, 0, nfds, len(payload), 0, request_id) + payload


@dataclass(slots=True)
class _Pending:
    type: int
    request_id: int
    length: int
    nfds: int


class FrameDecoder:
    """Incremental decoder: feed bytes (and any received fds), take whole frames out.

    The declared length is checked against ``max_frame`` as soon as the 24-byte header is in, before any
    of the body is buffered, so a peer can never make this side hold more than one maximal frame.
    """

    def __init__(
        self,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        expect: tuple[int, ...] = _TYPES,
        max_items: int | None = None,
    ) -> None:
        self.max_frame = max_frame
        self.max_items = max_items
        self._expect = expect
        self._buffer = bytearray()
        self._pos = 0  # bytes of the buffer already consumed (compacted lazily)
        self._fds: list[int] = []
        self._pending: _Pending | None = None

    @property
    def buffered(self) -> int:
        return len(self._buffer) - self._pos

    @property
    def mid_frame(self) -> bool:
        return len(self._buffer) > self._pos or self._pending is not None

    def feed(self, data: bytes | memoryview, fds: list[int] | None = None) -> None:
        self._buffer += data
        if fds:
            self._fds.extend(fds)

    def take_fds(self) -> list[int]:
        fds, self._fds = self._fds, []
        return fds

    def next_frame(self) -> Frame | None:
        """The next whole frame, or None when more bytes are needed. Raises on malformed input."""
        buffer = self._buffer
        pos = self._pos
        pending = self._pending
        if pending is None:
            if len(buffer) - pos < HEADER_SIZE:
                return None
            magic, version, ftype, _flags, nfds, length, _reserved, request_id = HEADER.unpack_from(
                buffer, pos
            )
            if magic != MAGIC:
                raise BadFrame("bad magic: not a skippyd frame")
            if version != PROTOCOL_VERSION:
                raise VersionMismatch(f"frame version {version}; this side speaks {PROTOCOL_VERSION}")
            if ftype not in self._expect:
                raise BadFrame(f"unexpected frame type {ftype}")
            if length > self.max_frame:
                raise FrameTooLarge(f"frame body of {length} bytes exceeds the limit of {self.max_frame}")
            if nfds > MAX_FDS:
                raise BadFrame(f"frame announces {nfds} descriptors; at most {MAX_FDS}")
            pos += HEADER_SIZE
            pending = _Pending(ftype, request_id, length, nfds)
        end = pos + pending.length
        if len(buffer) < end:
            self._pos, self._pending = pos, pending
            return None
        view = memoryview(buffer)
        raw = view[pos:end]
        error: BadFrame | None = None
        cost = 0
        try:
            body, cost = decode_counted(raw, self.max_frame, max_items=self.max_items)
        except BadFrame as exc:
            error = exc
        finally:
            raw.release()
            view.release()
        self._pending = None
        if end == len(buffer):
            buffer.clear()
            self._pos = 0
        elif end > 1 << 16:
            del buffer[:end]
            self._pos = 0
        else:
            self._pos = end
        fds = self._claim_fds(pending.nfds)
        if error is not None:
            for fd in fds:
                _close_quietly(fd)
            raise error
        return Frame(pending.type, pending.request_id, body, fds, pending.length + cost)

    def _claim_fds(self, count: int) -> list[int]:
        if not count:
            return []
        if len(self._fds) < count:
            for fd in self._fds:
                _close_quietly(fd)
            self._fds = []
            raise BadFrame(f"frame announced {count} descriptors but fewer arrived")
        fds, self._fds = self._fds[:count], self._fds[count:]
        return fds

    def close(self) -> None:
        for fd in self._fds:
            _close_quietly(fd)
        self._fds = []
        self._buffer.clear()
        self._pos = 0


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def send_frame(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> int:
    """Sends ``data`` with ``fds`` attached to its first byte; returns the bytes the kernel took."""
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        return sock.sendmsg([data], ancillary)
    return sock.send(data)


_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)


def recv_fds_into(sock: socket.socket, size: int = 256 * 1024) -> tuple[bytes, list[int]]:
    """One ``recvmsg``: the bytes and any descriptors that arrived with them (closed-on-exec)."""
    data, ancillary, flags, _addr = sock.recvmsg(size, _FD_SPACE, _MSG_CMSG_CLOEXEC)
    if not ancillary:
        return data, []
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(array.array("i", payload[:usable]))
    if flags & _MSG_CTRUNC:
        for fd in fds:
            _close_quietly(fd)
        raise BadFrame("descriptors were truncated in transit")
    return data, fds
