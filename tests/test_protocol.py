"""Framing on its own: round trips, truncation, oversize, garbage, wrong versions, fd passing."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest

from skippyd.errors import BadFrame, FrameTooLarge, VersionMismatch
from skippyd.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    FrameDecoder,
    FrameType,
    encode_frame,
    recv_fds_into,
    send_frame,
)


def test_a_frame_round_trips_whole_or_fed_one_byte_at_a_time() -> None:
    body = {"op": "restore", "tokens": b"\x01\x00\x00\x00" * 10, "nested": {"a": [1, 2.5, None, "x"]}}
    data = encode_frame(FrameType.REQUEST, 77, body) + encode_frame(FrameType.REQUEST, 78, {"op": "ping"})
    whole = FrameDecoder()
    whole.feed(data)
    first, second = whole.next_frame(), whole.next_frame()
    assert first is not None and second is not None
    assert (first.request_id, first.body) == (77, body)
    assert (second.request_id, second.body) == (78, {"op": "ping"})
    assert whole.next_frame() is None
    trickle = FrameDecoder()
    frames = []
    for i in range(len(data)):
        trickle.feed(data[i : i + 1])
        frame = trickle.next_frame()
        if frame is not None:
            frames.append(frame.body)
    assert frames == [body, {"op": "ping"}]


def test_a_truncated_frame_is_never_returned() -> None:
    data = encode_frame(FrameType.REQUEST, 1, {"op": "ping", "pad": "x" * 100})
    for cut in range(len(data)):
        decoder = FrameDecoder()
        decoder.feed(data[:cut])
        assert decoder.next_frame() is None
        assert decoder.mid_frame or cut == 0


def test_an_oversized_frame_is_refused_from_its_header_before_the_body_is_read() -> None:
    decoder = FrameDecoder(max_frame=1024)
    decoder.feed(HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.REQUEST, 0, 0, 1025, 0, 1))
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()
    assert decoder.buffered <= HEADER.size


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x00" * 24,
        os.urandom(24),
        b"SKPX" + b"\x01" * 20,
    ],
)
def test_garbage_is_a_bad_frame(garbage: bytes) -> None:
    decoder = FrameDecoder()
    decoder.feed(garbage)
    with pytest.raises(BadFrame):
        decoder.next_frame()


def test_a_wrong_version_is_a_version_mismatch() -> None:
    decoder = FrameDecoder()
    decoder.feed(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, FrameType.REQUEST, 0, 0, 1, 0, 1) + b"\x80")
    with pytest.raises(VersionMismatch):
        decoder.next_frame()


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({1: "int key"}),
        msgpack.packb({"a": 1}) + b"\x01",  # trailing bytes
        b"\x91" * 5000 + b"\x01",  # deeply nested arrays
        b"\xdb\xff\xff\xff\xff",  # a 4 GiB string that is not there
    ],
)
def test_bodies_that_are_not_bounded_msgpack_maps_are_bad_frames(body: bytes) -> None:
    decoder = FrameDecoder()
    decoder.feed(HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.REQUEST, 0, 0, len(body), 0, 1) + body)
    with pytest.raises(BadFrame):
        decoder.next_frame()


def test_unexpected_frame_types_and_fd_counts_are_rejected() -> None:
    decoder = FrameDecoder(expect=(FrameType.REQUEST,))
    decoder.feed(encode_frame(FrameType.REPLY, 1, {}))
    with pytest.raises(BadFrame, match="type"):
        decoder.next_frame()
    decoder = FrameDecoder()
    decoder.feed(HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.REPLY, 0, 200, 1, 0, 1) + b"\x80")
    with pytest.raises(BadFrame, match="descriptors"):
        decoder.next_frame()


def test_descriptors_travel_with_their_frame_over_a_real_socket(tmp_short: Path) -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    path = tmp_short / "payload"
    path.write_bytes(b"shared bytes")
    fd = os.open(path, os.O_RDONLY)
    try:
        send_frame(left, encode_frame(FrameType.REPLY, 5, {"ok": True}, nfds=1), [fd])
        send_frame(left, encode_frame(FrameType.REPLY, 6, {"ok": False}))
        decoder = FrameDecoder()
        frames: list[Any] = []
        while len(frames) < 2:
            data, fds = recv_fds_into(right)
            decoder.feed(data, fds)
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
        assert [f.request_id for f in frames] == [5, 6]
        assert len(frames[0].fds) == 1 and frames[1].fds == []
        assert os.pread(frames[0].fds[0], 100, 0) == b"shared bytes"
        os.close(frames[0].fds[0])
    finally:
        os.close(fd)
        left.close()
        right.close()


def test_a_frame_announcing_descriptors_that_never_came_is_rejected() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(FrameType.REPLY, 1, {"x": 1}, nfds=1))
    with pytest.raises(BadFrame, match="fewer arrived"):
        decoder.next_frame()


def test_header_layout_is_the_documented_24_bytes() -> None:
    frame = encode_frame(FrameType.ERROR, 0x0102030405060708, {"code": "x", "message": "y"})
    magic, version, ftype, flags, nfds, length, reserved, rid = struct.unpack("<4sBBBBIIQ", frame[:24])
    assert (magic, version, ftype, flags, nfds, reserved, rid) == (
        b"SKPD",
        1,
        3,
        0,
        0,
        0,
        0x0102030405060708,
    )
    assert length == len(frame) - 24


def test_a_small_request_cannot_expand_into_millions_of_objects() -> None:
    """~300 KB of nested empty arrays would be 300k Python lists: the daemon's decoder refuses it."""
    from skippyd.errors import BadFrame
    from skippyd.protocol import MAX_REQUEST_ITEMS, decode_body, encode_body

    body = encode_body({"op": "lookup", "x": [[[] for _ in range(60000)] for _ in range(5)]})
    assert len(body) < 400_000
    with pytest.raises(BadFrame, match="too many"):
        decode_body(body, max_items=MAX_REQUEST_ITEMS)
    assert len(decode_body(body)["x"]) == 5, "replies (the client's side) are not bounded this way"
    fine = encode_body(
        {"op": "capture", "tensors": [{"name": f"t{i}", "shape": [2, 3]} for i in range(4096)]}
    )
    assert len(decode_body(fine, max_items=MAX_REQUEST_ITEMS)["tensors"]) == 4096


def test_containers_are_bounded_by_the_bodys_size_and_a_queued_frame_counts_what_it_decodes_to() -> None:
    """An empty array is one wire byte and a Python list of ~56: 100 KB of them (100k lists) is refused
    though under the element budget, while the largest real table (16,384 tensors, scalar shapes, the
    shortest distinct names) decodes; and a frame's ``size`` counts its arrays, so the daemon's
    buffer limits bound memory rather than wire bytes."""
    from skippyd.errors import BadFrame
    from skippyd.payload import MAX_TENSORS
    from skippyd.protocol import MAX_REQUEST_ITEMS, FrameDecoder, FrameType, decode_body, encode_body

    bomb = encode_body({"op": "lookup", "x": [[[] for _ in range(50_000)] for _ in range(2)]})
    assert len(bomb) < 110_000 and MAX_REQUEST_ITEMS > 100_000
    with pytest.raises(BadFrame, match="for the body's size"):
        decode_body(bomb, max_items=MAX_REQUEST_ITEMS)
    table = [[f"{i:x}", "bool", []] for i in range(MAX_TENSORS)]
    assert (
        len(
            decode_body(encode_body({"op": "capture", "tensors": table}), max_items=MAX_REQUEST_ITEMS)[
                "tensors"
            ]
        )
        == MAX_TENSORS
    )
    decoder = FrameDecoder(expect=(FrameType.REQUEST,), max_items=MAX_REQUEST_ITEMS)
    wire = encode_frame(FrameType.REQUEST, 1, {"op": "capture", "tensors": table})
    decoder.feed(wire)
    frame = decoder.next_frame()
    assert frame is not None and frame.size >= len(wire) - 24 + 2 * MAX_TENSORS * 64
