"""Seeded fuzzing of the wire protocol against a real daemon: no client input is ever an internal error.

At least 20,000 frames per run, from a seeded generator (the seed is printed on failure, and
``SKIPPYD_FUZZ_SEED`` replays it): well-formed frames whose bodies are mutations of every operation's
request (wrong types, out-of-range numbers, nested containers, deep ``meta``, bad tensor tables), and
malformed frames (bad magic, version, type, length, descriptor count, msgpack, truncation). Every reply
must be a typed error other than ``internal`` (or a success); afterwards the log holds no traceback,
the daemon's memory has not grown without bound, and a real capture and restore still work.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections import Counter
from typing import Any

import msgpack
import pytest
import torch
from daemonutil import DaemonProcess

from skippyd.protocol import HEADER, MAGIC, FrameDecoder, FrameType, encode_frame, recv_fds_into

FRAMES = 20_000
OPS = ["hello", "ping", "stage", "capture", "lookup", "restore", "ran", "stats", "ls", "evict", "config",
       "blocks_put", "blocks_contains", "blocks_get", "nope", "", "CAPTURE"]  # fmt: skip
DTYPES = ["float32", "bfloat16", "uint8", "bool", "float8_e4m3fn", "complex128", "f99", "", "torch.float32"]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def scalar(self) -> Any:
        r = self.rng
        choices: list[Any] = [None, True, False, 0, 1, -1, 7, 4096, 1 << 31, 1 << 40, (1 << 64) - 1]
        choices += [-(1 << 63), 0.5, -2.5, float("inf"), float("nan"), "", "m", "x" * r.randint(1, 300)]
        choices += ["\u00e9\u4e2d", b"", os.urandom(r.randint(1, 64))]
        return r.choice(choices)

    def value(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if depth < 4 and r < 0.12:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 6))]
        if depth < 4 and r < 0.22:
            return {self.rng.choice(["a", "model", "x", ""]): self.value(depth + 1) for _ in range(3)}
        return self.scalar()

    def deep(self, depth: int, as_map: bool) -> Any:
        inner: Any = {} if as_map else []
        for _ in range(depth):
            inner = {"a": inner} if as_map else [inner]
        return inner

    def tokens(self) -> Any:
        r = self.rng
        choice = r.random()
        if choice < 0.7:
            return (
                struct.pack(
                    f"<{r.randint(0, 40)}I", *[r.randrange(1 << 32) for _ in range(40)][: r.randint(0, 40)]
                )
                if False
                else os.urandom(4 * r.randint(0, 40))
            )
        if choice < 0.85:
            return os.urandom(r.randint(1, 13))  # ragged
        return self.value()

    def tensors(self) -> Any:
        r = self.rng
        if r.random() < 0.2:
            return self.value()
        table = []
        for i in range(r.randint(0, 4)):
            name = r.choice([f"t{i}", "", "x" * 300, self.scalar()])
            shape: Any = [r.choice([0, 1, 3, 1024, 1 << 39, -1, 2.5, "7"]) for _ in range(r.randint(0, 4))]
            if r.random() < 0.1:
                shape = self.value()
            table.append(r.choice([[name, r.choice(DTYPES), shape], [name, r.choice(DTYPES)], self.value()]))
        return table

    def valid(self, op: str) -> dict[str, Any]:
        """A request of ``op`` that would succeed (captures fit the 64 KiB staging buffer)."""
        r = self.rng
        count = r.randint(1, 40)
        tokens = struct.pack(f"<{count}I", *(r.randrange(1 << 32) for _ in range(count)))
        ident = {
            "model": r.choice(["m", "model-b"]),
            "state": "s",
            "namespace": r.choice(["", "n"]),
            "tokens": tokens,
        }
        if op == "capture":
            table = [[f"t{i}", r.choice(DTYPES[:6]), [r.randint(0, 16), r.randint(0, 16)]] for i in range(3)]
            return {"op": op, **ident, "tensors": table, "kind": "kv", "meta": {"a": [1, "x"]},
                    "durable": r.choice([True, False, "sync"])}  # fmt: skip
        if op in ("lookup", "restore"):
            return {"op": op, **ident}
        if op.startswith("blocks_"):
            keys = [os.urandom(r.choice([1, 32, 64])) for _ in range(r.randint(0, 5))]
            space = {k: ident[k] for k in ("model", "state", "namespace")}
            body = {"op": op, **space, "block_tokens": r.choice([16, 256]), "keys": keys}
            if op == "blocks_put":
                body["sizes"] = [r.randint(0, 4096) for _ in keys]
                body["offsets"] = [r.choice([-1, 0, 4096]) for _ in keys]
                body["durable"] = r.choice([True, False, "sync"])
                if r.random() < 0.5:  # a staging half (the copy then runs behind the reply)
                    body["half"] = r.choice([0, 1])
                if r.random() < 0.3:
                    body["parent"] = os.urandom(r.choice([1, 32]))
            if op == "blocks_contains":
                body["each"] = r.choice([True, False])
            return body
        if op == "ran":
            return {"op": op, "model": "m", "tokens": ident["tokens"]}
        if op == "stage":
            return {"op": op, "size": 1 << 16}
        if op == "ls":
            return {"op": op, "limit": r.randint(0, 3)}
        if op == "evict":
            return r.choice([{"op": op, "digest": os.urandom(32).hex()}, {"op": op, **ident}])
        if op == "hello":
            return {"op": op, "versions": [1]}
        return {"op": op}

    def hostile(self, name: str) -> Any:
        r = self.rng
        table: dict[str, Any] = {
            "op": lambda: r.choice([*OPS, self.value()]),
            "model": lambda: r.choice(["", "x" * 5000, self.scalar()]),
            "state": lambda: r.choice(["", self.scalar()]),
            "namespace": lambda: r.choice(["x" * 5000, self.scalar()]),
            "tokens": self.tokens,
            "tensors": self.tensors,
            "kind": lambda: r.choice(["nope", self.scalar(), self.value()]),
            "meta": lambda: r.choice(
                [
                    self.deep(r.choice([40, 500, 995, 1005]), r.random() < 0.7),
                    self.value(),
                    {"k": "v" * 70000},
                    {"x": float("nan")},
                    [1, 2],
                ]
            ),
            "durable": lambda: r.choice(["yes", 1, 0, None, self.value()]),
            "size": lambda: r.choice([0, 1 << 40, -1, self.scalar()]),
            "limit": lambda: r.choice([-1, "all", self.scalar()]),
            "digest": lambda: r.choice(["ab" * 3, "Z" * 64, "0" * 65, "abcdef01", self.scalar()]),
            "all": lambda: r.choice(["yes", 1, self.scalar()]),
            "versions": lambda: r.choice([[2], [], self.deep(r.randint(1, 500), False), self.value()]),
            "keys": lambda: r.choice([[b""], [bytes(65)], [self.scalar()], self.value(), [b"k"] * 9000]),
            "sizes": lambda: r.choice([[-1], [1 << 40], [self.scalar()], self.value()]),
            "offsets": lambda: r.choice([[-2], [1 << 40], [self.scalar()], self.value()]),
            "block_tokens": lambda: r.choice([0, -1, 1 << 20, True, self.scalar()]),
            "parent": lambda: r.choice([b"", bytes(65), self.scalar()]),
            "each": lambda: r.choice(["yes", 1, self.scalar()]),
            "half": lambda: r.choice([2, -1, "0", 1.5, True, self.scalar()]),
            "blocks": lambda: r.choice(["yes", 1, self.scalar()]),
        }
        return table.get(name, self.value)()

    def body(self) -> dict[str, Any]:
        """A valid request of a random operation with 0 to 3 of its fields (or new ones) made hostile."""
        r = self.rng
        body = self.valid(r.choice(OPS))
        names = [*body, "meta", "durable", "tensors", "kind", "all", "digest", "limit", "size", "versions",
                 "keys", "sizes", "offsets", "block_tokens", "parent", "each", "blocks", "half"]  # fmt: skip
        for _ in range(r.choice([0, 1, 1, 1, 2, 2, 3])):
            name = r.choice(names)
            if r.random() < 0.1:
                body.pop(name, None)
            else:
                body[name] = self.hostile(name)
        return body

    def malformed(self, rid: int) -> bytes:
        r = self.rng
        raw = os.urandom(r.randint(0, 48))
        kind = r.randrange(7)
        if kind == 0:
            return os.urandom(24) + raw
        if kind == 1:
            return HEADER.pack(MAGIC, 9, FrameType.REQUEST, 0, 0, len(raw), 0, rid) + raw
        if kind == 2:
            return HEADER.pack(MAGIC, 1, r.choice([0, 2, 3, 200]), 0, 0, len(raw), 0, rid) + raw
        if kind == 3:
            return HEADER.pack(MAGIC, 1, FrameType.REQUEST, 0, r.choice([1, 9, 255]), len(raw), 0, rid) + raw
        if kind == 4:
            return HEADER.pack(MAGIC, 1, FrameType.REQUEST, 0, 0, 1 << 30, 0, rid)
        if kind == 5:  # a body that is not a map, or not msgpack at all
            bodies: list[bytes] = [
                msgpack.packb([1, 2]),
                msgpack.packb("x"),
                b"\xc1",
                b"\x81\xa1a" + b"\x91" * 3000,
            ]
            body = r.choice(bodies)
            return HEADER.pack(MAGIC, 1, FrameType.REQUEST, 0, 0, len(body), 0, rid) + body
        return HEADER.pack(MAGIC, 1, FrameType.REQUEST, 0, 0, len(raw) + 10, 0, rid) + raw  # truncated


class Conn:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> Any:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                for fd in frame.fds:
                    os.close(fd)
                return frame
            data, fds = recv_fds_into(self.sock)
            if not data:
                return None
            self.decoder.feed(data, fds)

    def close(self) -> None:
        self.decoder.close()
        self.sock.close()


def _hello(path: str) -> Conn:
    """A handshaken connection with a staging buffer (so captures get as far as they can)."""
    conn = Conn(path)
    conn.send(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
    conn.send(encode_frame(FrameType.REQUEST, 2, {"op": "stage", "size": 1 << 16}))
    assert conn.read().type == FrameType.REPLY and conn.read().type == FrameType.REPLY
    return conn


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_thousand_malformed_frames_get_typed_errors_and_leave_the_daemon_well(
    daemon: DaemonProcess,
) -> None:
    seed = int(os.environ.get("SKIPPYD_FUZZ_SEED", str(int(time.time()))))
    fuzz = Fuzzer(seed)
    path = str(daemon.socket)
    assert daemon.proc is not None
    rss_before = _rss_kib(daemon.proc.pid)
    codes: Counter[str] = Counter()
    internal: list[Any] = []
    conn = _hello(path)
    rid = 10
    sent = 0
    while sent < FRAMES:
        rid += 1
        roll = fuzz.rng.random()
        if roll < 0.9:
            try:
                wire = encode_frame(FrameType.REQUEST, rid, fuzz.body())
            except (TypeError, ValueError, OverflowError):
                continue
            conn.send(wire)
            sent += 1
            frame = conn.read()
            if frame is None:
                internal.append(("closed", rid))
                conn.close()
                conn = _hello(path)
                continue
            code = frame.body.get("code", "ok") if frame.type == FrameType.ERROR else "ok"
            if frame.request_id == 0 or code == "version_mismatch":  # the daemon closes these connections
                conn.close()
                conn = _hello(path)
        else:
            junk = fuzz.malformed(rid)
            conn.close()
            conn = Conn(path)
            conn.send(junk)
            sent += 1
            if junk[16:24] and struct.unpack_from("<I", junk, 8)[0] > len(junk) - 24 and junk[:4] == MAGIC:
                conn.close()  # truncated or oversize: hang up without waiting (the daemon must cope)
                conn = _hello(path)
                continue
            frame = conn.read()
            code = "closed" if frame is None else frame.body.get("code", "ok")
            conn.close()
            conn = _hello(path)
        codes[code] += 1
        if code == "internal":
            internal.append((frame.body if frame is not None else None, seed))
    conn.close()
    if os.environ.get("SKIPPYD_FUZZ_SEED"):
        print(f"seed {seed}: {dict(codes)}")
    assert not internal, f"seed {seed}: {internal[:5]}"
    assert codes["ok"] > 100 and codes["invalid_argument"] > 1000, codes
    log = daemon.log_text()
    assert "Traceback" not in log, f"seed {seed}: {log[log.index('Traceback') - 500 :][:3000]}"
    rss_after = _rss_kib(daemon.proc.pid)
    assert rss_after - rss_before < 96 * 1024, f"RSS grew from {rss_before} to {rss_after} KiB"
    with daemon.client() as client:
        tensors = {"k": torch.randn(64, 64), "b": torch.ones(3, dtype=torch.bool)}
        result = client.capture(model="m", state="s", tokens=[1, 2, 3], tensors=tensors)
        hit = client.restore(model="m", state="s", tokens=[1, 2, 3, 4])
        assert hit is not None and hit.digest == result.digest
        assert all(torch.equal(hit.tensors[n], t) for n, t in tensors.items())
        assert client.health()["healthy"]
