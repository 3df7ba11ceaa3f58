"""``skippyd serve`` as a real process: capture/restore over the socket, restarts, signals, bad clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemonutil import DaemonProcess

import skippyd
from skippyd.errors import InvalidArgument, PermissionDenied, StoreLocked, Timeout, TooLarge
from skippyd.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    FrameDecoder,
    FrameType,
    encode_frame,
    recv_fds_into,
)

MODEL, STATE = "test-model@sha256:0", "kv-v1"


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def odd_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def bits(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                             dtype=torch.uint8).view(dtype)  # fmt: skip

    base = torch.randn(6, 10, 4, generator=g)
    tensors: dict[str, torch.Tensor] = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "bf16_bits": bits(33, torch.bfloat16),  # every bit pattern, NaN payloads included
        "f32_bits": bits(17, torch.float32),
        "e4m3": bits(19, torch.float8_e4m3fn),
        "e5m2": bits(23, torch.float8_e5m2),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "i16": torch.randint(-(2**15), 2**15 - 1, (9,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (9,), dtype=torch.int32, generator=g),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1]),
        "u8": torch.randint(0, 255, (5, 3), dtype=torch.uint8, generator=g),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "transposed": base[:, :, 0].t(),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "offset_view": base.view(-1)[17:57].view(5, 8),
        "strided": base[::2, 1::3, :],
        "neg_zero": torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan")]),
    }
    return tensors


def test_capture_and_restore_are_bit_exact_for_every_contract_dtype_and_odd_shape(
    daemon: DaemonProcess,
) -> None:
    tensors = odd_tensors()
    tokens = list(range(100, 400))
    with daemon.client() as client:
        result = client.capture(
            model=MODEL, state=STATE, tokens=tokens, tensors=tensors, kind="kv", meta={"x": 1}
        )
        assert result.l2 and result.token_count == 300
        assert result.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
        restored = client.restore(model=MODEL, state=STATE, tokens=[*tokens, 1, 2, 3])
    assert restored is not None
    assert restored.token_count == 300 and restored.kind == "kv" and restored.meta == {"x": 1}
    assert restored.digest == result.digest and restored.source == "l2"
    assert list(restored.tensors) == list(tensors)
    for name, original in tensors.items():
        got = restored.tensors[name]
        assert got.dtype == original.dtype, name
        assert got.shape == original.shape, name
        assert raw_bytes(got) == raw_bytes(original), name


def test_a_cpu_restore_is_a_view_of_shared_memory_and_writing_to_it_never_changes_the_entry(
    daemon: DaemonProcess,
) -> None:
    tensors = {"k": torch.arange(4096, dtype=torch.float32), "v": torch.ones(100, dtype=torch.int64)}
    with daemon.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1, 2, 3], tensors=tensors)
        first = client.restore(model=MODEL, state=STATE, tokens=[1, 2, 3])
        assert first is not None
        storage = {t.untyped_storage().data_ptr() for t in first.tensors.values()}
        assert len(storage) == 1, "both tensors view one mapping: nothing was copied per tensor"
        first.tensors["k"].fill_(-1)
        first.tensors["v"][0] = 99
        second = client.restore(model=MODEL, state=STATE, tokens=[1, 2, 3])
        assert second is not None
        assert torch.equal(second.tensors["k"], tensors["k"])
        assert torch.equal(second.tensors["v"], tensors["v"])


def test_lookup_reports_the_longest_prefix_and_misses_other_identities(daemon: DaemonProcess) -> None:
    prompt = list(range(1000))
    with daemon.client() as client:
        for n in (128, 512):
            client.capture(model=MODEL, state=STATE, tokens=prompt[:n], tensors={"x": torch.full((n,), n)})
        hit = client.lookup(model=MODEL, state=STATE, tokens=prompt)
        assert hit is not None and hit.token_count == 512 and hit.source == "l2"
        assert client.lookup(model=MODEL, state=STATE, namespace="other", tokens=prompt) is None
        assert client.lookup(model="other", state=STATE, tokens=prompt) is None
        assert client.lookup(model=MODEL, state="kv-v2", tokens=prompt) is None
        partial = client.restore(model=MODEL, state=STATE, tokens=[*prompt[:300], 7])
        assert partial is not None and partial.token_count == 128
        assert torch.equal(partial.tensors["x"], torch.full((128,), 128))


def test_errors_come_back_as_the_same_classes(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        with pytest.raises(InvalidArgument):
            client.evict(digest="nope")
        with pytest.raises(TooLarge):
            client.capture(
                model=MODEL, state=STATE, tokens=[1], tensors={"x": torch.zeros(300 << 20, dtype=torch.uint8)}
            )
        with pytest.raises(ValueError, match="32 bits"):
            client.lookup(model=MODEL, state=STATE, tokens=[-1])
        assert client.ping(), "the connection still works after errors"


def test_thirty_two_clients_mixing_operations_for_twenty_seconds_always_get_the_right_bytes(
    daemon: DaemonProcess,
) -> None:
    from blake3 import blake3

    stop = time.monotonic() + 20.0
    failures: list[str] = []
    counts = [0] * 32

    def worker(index: int) -> None:
        rng = torch.Generator().manual_seed(index)
        with daemon.client(timeout=30.0) as client:
            while time.monotonic() < stop:
                n = int(torch.randint(1, 64, (1,), generator=rng)) * 7
                tokens = [index, *range(n)]
                payload = {"x": torch.randint(0, 255, (n * 97,), dtype=torch.uint8, generator=rng)}
                want = blake3(raw_bytes(payload["x"])).hexdigest()
                try:
                    result = client.capture(model=MODEL, state=STATE, tokens=tokens, tensors=payload)
                    if result.digest != want:
                        failures.append(f"capture digest {result.digest} != {want}")
                    hit = client.lookup(model=MODEL, state=STATE, tokens=tokens)
                    restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
                except skippyd.SkippydError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                if restored is None or hit is None:
                    continue  # evicted by another client's capture in between: allowed
                got = blake3(raw_bytes(restored.tensors["x"])).hexdigest()
                if got != restored.digest:
                    failures.append(f"restored bytes hash to {got}, entry says {restored.digest}")
                if restored.token_count == len(tokens) and got != want and restored.digest == want:
                    failures.append("wrong bytes for the captured prompt")
                counts[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:5]
    assert all(c > 0 for c in counts), counts
    with daemon.client() as client:
        assert client.stats()["server"]["errors"] == 0


def test_after_kill_9_and_a_restart_every_committed_entry_restores(daemon: DaemonProcess) -> None:
    captured = {}
    with daemon.client() as client:
        for i in range(20):
            tensors = {"k": torch.full((1000 + i,), float(i)), "b": torch.tensor([i % 2 == 0])}
            result = client.capture(model=MODEL, state=STATE, tokens=[i, i + 1, i + 2], tensors=tensors)
            captured[i] = (result.digest, tensors)
    daemon.kill9()
    daemon.start()
    with daemon.client() as client:
        for i, (digest, tensors) in captured.items():
            restored = client.restore(model=MODEL, state=STATE, tokens=[i, i + 1, i + 2])
            assert restored is not None and restored.digest == digest
            assert torch.equal(restored.tensors["k"], tensors["k"])
            assert torch.equal(restored.tensors["b"], tensors["b"])
        assert client.stats()["l2"]["adopted"] == 20


def _raw_connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def _read_frames(sock: socket.socket) -> list[Any]:
    decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))
    frames = []
    try:
        while True:
            data, fds = recv_fds_into(sock)
            if not data:
                break
            decoder.feed(data, fds)
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
    except (TimeoutError, ConnectionResetError):
        pass
    return frames


BAD_INPUTS = {
    "http": b"GET / HTTP/1.1\r\nHost: skippyd\r\n\r\n",
    "random": os.urandom(4096),
    "oversize": HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.REQUEST, 0, 0, 1 << 30, 0, 1),
    "version": HEADER.pack(MAGIC, 99, FrameType.REQUEST, 0, 0, 1, 0, 1) + b"\x80",
    "not_a_map": HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.REQUEST, 0, 0, 1, 0, 1) + b"\x01",
    "reply_type": encode_frame(FrameType.REPLY, 1, {"op": "ping"}),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_malformed_frames_get_an_error_and_a_closed_connection_while_others_are_served(
    daemon: DaemonProcess, name: str
) -> None:
    with daemon.client() as good:
        good.capture(model=MODEL, state=STATE, tokens=[1], tensors={"x": torch.ones(10)})
        bad = _raw_connect(daemon.socket)
        bad.sendall(BAD_INPUTS[name])
        frames = _read_frames(bad)
        bad.close()
        assert frames and frames[-1].type == FrameType.ERROR
        assert frames[-1].body["code"] in ("bad_frame", "frame_too_large", "version_mismatch")
        restored = good.restore(model=MODEL, state=STATE, tokens=[1])
        assert restored is not None and torch.equal(restored.tensors["x"], torch.ones(10))


def test_bad_requests_get_typed_errors_and_the_connection_stays_usable(daemon: DaemonProcess) -> None:
    sock = _raw_connect(daemon.socket)
    decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))

    def ask(rid: int, body: dict[str, Any]) -> Any:
        sock.sendall(encode_frame(FrameType.REQUEST, rid, body))
        while True:
            frame = decoder.next_frame()
            if frame is not None:
                return frame
            data, fds = recv_fds_into(sock)
            assert data
            decoder.feed(data, fds)

    assert ask(1, {"op": "ping"}).body["code"] == "invalid_argument", "hello comes first"
    assert ask(2, {"op": "hello", "versions": [1]}).type == FrameType.REPLY
    cases: list[dict[str, Any]] = [
        {"op": "nope"},
        {"op": "lookup", "model": 1, "state": "s", "tokens": b""},
        {"op": "lookup", "model": "m", "state": "s", "tokens": b"\x01\x02\x03"},
        {"op": "lookup", "model": "m", "state": "s", "tokens": [1, 2]},
        {
            "op": "capture",
            "model": "m",
            "state": "s",
            "tokens": b"\x01\x00\x00\x00",
            "tensors": [["x", "f99", [1]]],
        },
        {
            "op": "capture",
            "model": "m",
            "state": "s",
            "tokens": b"\x01\x00\x00\x00",
            "tensors": [["x", "uint8", [4]]],
        },
        {"op": "stage", "size": -5},
        {"op": "stage", "size": 1 << 40},
        {"op": "evict"},
        {"op": "ls", "limit": "all"},
    ]
    for rid, body in enumerate(cases, start=10):
        frame = ask(rid, body)
        assert frame.type == FrameType.ERROR, body
        assert frame.request_id == rid
        assert frame.body["code"] in ("invalid_argument", "unsupported_dtype", "too_large"), frame.body
    assert ask(97, {"op": "stage", "size": 0}).body["code"] == "invalid_argument"  # (not too_large)
    space = {"model": "m", "state": "s", "namespace": "", "block_tokens": 16}
    nothing = {"op": "blocks_put", **space, "keys": [b"k"], "sizes": [4096], "offsets": [-1]}
    put = ask(98, nothing).body  # its only block not sent and not held: stored nothing, durable nothing
    assert (put["stored"], put["present"], put["skipped"], put["durability"]) == (0, 0, 1, "none")
    pong = ask(99, {"op": "ping"}).body
    assert pong["pong"] is True and pong["node"] == "test-node" and pong["healthy"] is True
    sock.close()


def test_a_stalled_half_frame_does_not_hold_up_other_clients(daemon: DaemonProcess) -> None:
    staller = _raw_connect(daemon.socket)
    frame = encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]})
    staller.sendall(frame[:10])
    with daemon.client() as client:
        started = time.monotonic()
        for _ in range(50):
            assert client.ping()
        assert time.monotonic() - started < 5
    staller.close()


def test_the_socket_is_published_with_mode_0660(daemon: DaemonProcess) -> None:
    st = os.stat(daemon.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_a_second_daemon_on_the_same_socket_refuses_to_start(daemon: DaemonProcess, make_daemon: Any) -> None:
    second = make_daemon("--socket", str(daemon.socket))
    second.start(wait=False)
    assert second.proc is not None
    assert second.proc.wait(timeout=30) != 0
    assert "refusing" in second.log_text() or "another skippyd" in second.log_text()
    assert daemon.client().ping()


def test_a_stale_socket_is_replaced(make_daemon: Any, tmp_short: Path) -> None:
    proc = make_daemon(root=tmp_short / "stale")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(proc.socket))
    stale.close()  # a socket file nobody listens on, as a crashed daemon leaves it
    assert proc.socket.exists()
    proc.start()
    assert proc.client().ping()


def test_publish_socket_refuses_to_replace_a_regular_file(tmp_short: Path) -> None:
    from skippyd.server import publish_socket

    target = tmp_short / "not-a-socket"
    target.write_text("precious")
    with pytest.raises(StoreLocked, match="not a socket"):
        publish_socket(target)
    assert target.read_text() == "precious"


def test_sigterm_finishes_in_flight_work_and_exits_cleanly(make_daemon: Any) -> None:
    daemon = make_daemon(budget="1GiB").start()
    big = {"x": torch.randint(0, 255, (384 << 20,), dtype=torch.uint8)}
    result: dict[str, Any] = {}

    def capture() -> None:
        with daemon.client(timeout=60.0) as client:
            result["r"] = client.capture(model=MODEL, state=STATE, tokens=[5], tensors=big)

    thread = threading.Thread(target=capture)
    thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait until the capture request is running in the daemon
        with daemon.client() as probe:
            server = probe.stats()["server"]
            if server["ops"].get("capture") and server["inflight"] > 0:
                break
        time.sleep(0.01)
    daemon.send(signal.SIGTERM)
    thread.join(timeout=60)
    assert daemon.proc is not None and daemon.proc.wait(timeout=60) == 0
    assert "r" in result, "the in-flight capture completed before exit"
    assert not daemon.socket.exists()
    daemon.start()
    with daemon.client() as client:
        assert client.lookup(model=MODEL, state=STATE, tokens=[5]) is not None


def test_a_second_signal_forces_exit(make_daemon: Any) -> None:
    proc = make_daemon("--shutdown-timeout", "120s").start()
    # A client that sends requests and never reads the replies keeps its connection busy, so the
    # first SIGTERM waits for it (up to the shutdown timeout).
    staller = _raw_connect(proc.socket)
    staller.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
    staller.sendall(b"".join(encode_frame(FrameType.REQUEST, i, {"op": "stats"}) for i in range(2, 3000)))
    time.sleep(0.5)
    proc.send(signal.SIGTERM)
    time.sleep(0.05)
    proc.send(signal.SIGTERM)  # the same one delivered twice (a wrapper forwarding its group's): one
    time.sleep(1.0)
    assert proc.proc is not None and proc.proc.poll() is None, "still draining the busy connection"
    started = time.monotonic()
    proc.send(signal.SIGTERM)
    code = proc.proc.wait(timeout=20)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5
    staller.close()


def test_a_client_offering_other_protocol_versions_is_told_which_in_one_line(daemon: DaemonProcess) -> None:
    sock = _raw_connect(daemon.socket)
    try:
        sock.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [7, 9]}))
        decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))
        while (frame := decoder.next_frame()) is None:
            data, fds = recv_fds_into(sock)
            assert data, "the daemon answers before it closes"
            decoder.feed(data, fds)
    finally:
        sock.close()
    assert frame.type == FrameType.ERROR and frame.body["code"] == "version_mismatch"
    assert "speaks protocol 1; the client offers [7, 9]" in frame.body["message"]


def test_systemd_notify_socket_receives_ready_and_stopping(make_daemon: Any, tmp_short: Path) -> None:
    path = tmp_short / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(30)
    proc = make_daemon(env={"NOTIFY_SOCKET": str(path)}).start()
    ready = listener.recv(4096).decode()
    assert "READY=1" in ready and f"MAINPID={proc.proc.pid}" in ready
    proc.stop()
    messages = [listener.recv(4096).decode()]
    assert any("STOPPING=1" in m for m in messages)
    listener.close()


def test_peers_outside_the_allowed_users_are_refused_even_if_the_socket_is_opened_up(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--allowed-uids", "4242").start()
    os.chmod(proc.socket, 0o666)  # as if someone loosened the mode by hand
    for parent in (proc.socket.parent, proc.socket.parent.parent):
        os.chmod(parent, 0o711)
    nobody = 65534
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, try to talk to the daemon
        try:
            os.close(read_end)
            os.setgid(nobody)
            os.setuid(nobody)
            code = b"?"
            try:
                with skippyd.Client(proc.socket, timeout=5.0) as client:
                    client.stats()
                code = b"allowed"
            except PermissionDenied:
                code = b"denied"
            except Exception as exc:
                code = type(exc).__name__.encode()
            os.write(write_end, code)
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    outcome = os.read(read_end, 100)
    os.close(read_end)
    assert outcome == b"denied"
    assert proc.client().ping(), "root (and the daemon's own user) stay allowed"


def _as_user(uid: int, socket_path: Path) -> bytes:
    """Runs a stats call as ``uid`` (gid the same, no supplementary groups) in a forked child."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                with skippyd.Client(socket_path, timeout=5.0) as client:
                    client.stats()
                code = b"allowed"
            except PermissionDenied:
                code = b"denied"
            except Exception as exc:
                code = type(exc).__name__.encode()
            os.write(write_end, code)
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    outcome = os.read(read_end, 100)
    os.close(read_end)
    return outcome


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_a_uid_in_allowed_uids_connects_without_being_in_the_sockets_group(make_daemon: Any) -> None:
    proc = make_daemon("--allowed-uids", "4242").start()
    assert stat.S_IMODE(os.lstat(proc.socket).st_mode) == 0o666, "access is decided by the credentials"
    for parent in (proc.socket.parent, proc.socket.parent.parent):
        os.chmod(parent, 0o711)
    assert _as_user(4242, proc.socket) == b"allowed"
    assert _as_user(4243, proc.socket) == b"denied"
    plain = make_daemon().start()
    assert stat.S_IMODE(os.lstat(plain.socket).st_mode) == 0o660, "without the lists: owner and group"


def test_the_client_reconnects_after_the_daemon_restarts(daemon: DaemonProcess) -> None:
    client = daemon.client()
    client.capture(model=MODEL, state=STATE, tokens=[9], tensors={"x": torch.ones(3)})
    daemon.stop()
    daemon.start()
    restored = client.restore(model=MODEL, state=STATE, tokens=[9])
    assert restored is not None and torch.equal(restored.tensors["x"], torch.ones(3))
    client.capture(model=MODEL, state=STATE, tokens=[10], tensors={"x": torch.zeros(3)})
    client.close()


def test_a_daemon_that_does_not_answer_times_out(daemon: DaemonProcess) -> None:
    client = daemon.client(timeout=0.5)
    assert client.ping()
    daemon.send(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(Timeout):
            client.stats()
        assert time.monotonic() - started < 5
    finally:
        daemon.send(signal.SIGCONT)
    assert client.ping()
    client.close()


def test_async_requests_too_big_for_one_write_never_interleave_on_the_wire(daemon: DaemonProcess) -> None:
    """Each lookup frame (~1.2 MB of tokens) takes many socket writes; concurrent coroutines must not
    interleave them, and a request cancelled part-way through its send must not poison later ones."""
    n = 300_000
    prompts = [[i] * n for i in range(6)]

    async def scenario() -> None:
        async with skippyd.AsyncClient(daemon.socket, timeout=60.0) as client:
            for i, prompt in enumerate(prompts):
                await client.capture(
                    model=MODEL, state=STATE, tokens=prompt[:1000], tensors={"x": torch.full((8,), i)}
                )
            for _ in range(2):
                hits = await asyncio.gather(
                    *(client.lookup(model=MODEL, state=STATE, tokens=p) for p in prompts)
                )
                assert [h.token_count if h else None for h in hits] == [1000] * len(prompts)
            # cancel a big request while it is on the wire, then keep going
            task = asyncio.ensure_future(client.lookup(model=MODEL, state=STATE, tokens=prompts[0] * 6))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, skippyd.SkippydError):
                await task
            hit = await client.lookup(model=MODEL, state=STATE, tokens=prompts[1])
            assert hit is not None and hit.token_count == 1000
            assert await client.ping()

    asyncio.run(scenario())


def test_async_capture_abandoned_before_its_answer_never_lends_its_staging_to_the_next(
    daemon: DaemonProcess,
) -> None:
    """A capture that times out may still be queued in the daemon, reading the connection's staging
    buffer when it runs; the next capture must write elsewhere, so neither entry gets the other's bytes."""
    first = torch.full((16 << 20,), 1.0)  # 64 MiB: the daemon is still copying it when the next one writes
    second = torch.full((16 << 20,), 2.0)

    async def scenario() -> None:
        async with skippyd.AsyncClient(daemon.socket, timeout=60.0) as client:
            await client.capture(model=MODEL, state=STATE, tokens=[9], tensors={"x": torch.zeros(16 << 20)})
            conn = client._conn
            client.timeout = 1e-9
            with pytest.raises(skippyd.Timeout):
                await client.capture(model=MODEL, state=STATE, tokens=[1, 1], tensors={"x": first})
            assert conn is not None and conn.staging is None, "the abandoned capture's buffer is retired"
            client.timeout = 60.0
            await client.capture(model=MODEL, state=STATE, tokens=[2, 2], tensors={"x": second})
            for _ in range(100):  # the abandoned capture may land late, or not at all
                late = await client.restore(model=MODEL, state=STATE, tokens=[1, 1])
                if late is not None:
                    assert torch.equal(late.tensors["x"], first), "the abandoned capture kept its own bytes"
                    break
                await asyncio.sleep(0.02)
            other = await client.restore(model=MODEL, state=STATE, tokens=[2, 2])
            assert other is not None and torch.equal(other.tensors["x"], second)

    asyncio.run(scenario())


def test_a_cancelled_async_get_into_returns_only_once_its_copy_has_ended(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's buffers are its own again when the cancellation reaches it: no copy still writes
    them, and the reply's descriptors (the daemon's read leases) were not closed under that copy."""
    from skippyd.client import blockspace

    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    real = blockspace._read_blocks

    def held_copy(*args: Any) -> int:
        started.set()
        assert release.wait(10)
        try:
            return int(real(*args))
        finally:
            ended.set()

    async def scenario() -> None:
        async with skippyd.AsyncClient(daemon.socket) as client:
            space = client.blocks(model=MODEL, state=STATE, block_tokens=16)
            keys = space.keys(list(range(64)))
            await space.put(keys, [bytes([i + 1]) * 4096 for i in range(4)], durable=False)
            monkeypatch.setattr(blockspace, "_read_blocks", held_copy)
            out = [bytearray(4096) for _ in keys]
            task = asyncio.ensure_future(space.get_into(keys, out))
            while not started.is_set():
                await asyncio.sleep(0.001)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done(), "the cancellation waits for the copy in flight"
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ended.is_set(), "the copy ended before the caller heard of the cancellation"
            monkeypatch.setattr(blockspace, "_read_blocks", real)
            again = [bytearray(4096) for _ in keys]
            assert await space.get_into(keys, again) == 4 and again[3] == bytes([4]) * 4096

    asyncio.run(scenario())


def test_an_async_request_cancelled_after_its_reply_came_closes_the_replys_descriptors(
    daemon: DaemonProcess,
) -> None:
    """A reply that lands just before its task is cancelled carries the daemon's leases: they are
    closed, not left open for the life of the process."""

    def slab_fds() -> int:
        found = 0
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found += os.readlink(f"/proc/self/fd/{name}").endswith(".slab")
        return found

    async def scenario() -> None:
        async with skippyd.AsyncClient(daemon.socket, timeout=10) as client:
            space = client.blocks(model=MODEL, state=STATE, block_tokens=16)
            keys = space.keys(list(range(64)))
            await space.put(keys, [bytes([i + 1]) * 4096 for i in range(4)], durable=False)
            await space.get_into(keys, [bytearray(4096) for _ in keys])  # (the slab's kept mapping made)
            before = slab_fds()
            loop = asyncio.get_running_loop()
            tasks: list[asyncio.Task[int]] = []
            for _ in range(10):
                tasks.append(asyncio.ensure_future(space.get_into(keys, [bytearray(4096) for _ in keys])))
                for _ in range(5):  # the blocks_get goes out
                    await asyncio.sleep(0)
                loop.call_later(0, tasks[-1].cancel)  # (runs right after the reply's I/O callback)
                time.sleep(0.2)  # the reply waits in the socket
                with contextlib.suppress(asyncio.CancelledError):
                    await tasks[-1]
            await asyncio.sleep(0.2)
            assert slab_fds() == before
            out = [bytearray(4096) for _ in keys]
            assert await space.get_into(keys, out) == 4 and out[0] == bytes([1]) * 4096

    asyncio.run(scenario())


def test_an_async_capture_that_cannot_connect_raises_that_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout (or a cancellation) while connecting reaches the caller as itself."""

    async def scenario() -> None:
        client = skippyd.AsyncClient(tmp_path / "none.sock")

        async def slow_hello() -> Any:
            raise skippyd.Timeout("skippyd did not answer hello")

        monkeypatch.setattr(client, "_connection", slow_hello)
        with pytest.raises(skippyd.Timeout):
            await client.capture(model=MODEL, state=STATE, tokens=[1], tensors={"x": torch.zeros(4)})

    asyncio.run(scenario())


def test_async_client_pipelines_operations(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with skippyd.AsyncClient(daemon.socket) as client:
            assert await client.ping()
            results = await asyncio.gather(
                *(
                    client.capture(
                        model=MODEL, state=STATE, tokens=[i, 1, 2], tensors={"x": torch.full((64,), i)}
                    )
                    for i in range(10)
                )
            )
            assert len({r.digest for r in results}) == 10
            hits = await asyncio.gather(
                *(client.lookup(model=MODEL, state=STATE, tokens=[i, 1, 2]) for i in range(10))
            )
            assert all(h is not None and h.token_count == 3 for h in hits)
            restored = await asyncio.gather(
                *(client.restore(model=MODEL, state=STATE, tokens=[i, 1, 2, 3]) for i in range(10))
            )
            for i, r in enumerate(restored):
                assert r is not None and torch.equal(r.tensors["x"], torch.full((64,), i))
            stats = await client.stats()
            assert stats["l2"]["entries"] == 10
            assert await client.evict(all=True) == 10

    asyncio.run(scenario())


def test_the_async_client_offers_every_operation_of_the_blocking_one_with_the_same_signature() -> None:
    import inspect

    def operations(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(member)
            for name, member in vars(cls).items()
            if not name.startswith("_") and inspect.isfunction(member) and name != "close"
        }

    for sync_cls, async_cls in (
        (skippyd.Client, skippyd.AsyncClient),
        (skippyd.BlockSpace, skippyd.AsyncBlockSpace),
    ):
        blocking, asynchronous = operations(sync_cls), operations(async_cls)
        assert blocking.keys() == asynchronous.keys()
        for name, signature in blocking.items():
            if name in ("blocks", "keys"):  # not I/O: the async client's factory makes the async space
                assert signature.parameters == asynchronous[name].parameters, name
                continue
            assert signature == asynchronous[name], name
            assert inspect.iscoroutinefunction(getattr(async_cls, name)), name


def test_async_and_blocking_clients_answer_alike(daemon: DaemonProcess) -> None:
    with skippyd.Client(daemon.socket) as client:
        client.capture(model=MODEL, state=STATE, tokens=[7, 8, 9], tensors={"x": torch.ones(4)})
        blocking = (
            client.health(),
            client.config()["pid"],
            client.lookup(model=MODEL, state=STATE, tokens=[7, 8, 9]),
        )

    async def scenario() -> tuple[Any, ...]:
        async with skippyd.AsyncClient(daemon.socket) as client:
            return (
                await client.health(),
                (await client.config())["pid"],
                await client.lookup(model=MODEL, state=STATE, tokens=[7, 8, 9]),
            )

    assert asyncio.run(scenario()) == blocking
    assert blocking[0]["healthy"] and blocking[2] is not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restore_to_a_cuda_device_lands_the_bytes_there(daemon: DaemonProcess) -> None:
    tensors = odd_tensors()
    with daemon.client() as client:
        client.capture(
            model=MODEL, state=STATE, tokens=[1, 2], tensors={k: v.cuda() for k, v in tensors.items()}
        )
        restored = client.restore(model=MODEL, state=STATE, tokens=[1, 2], device="cuda:0")
    assert restored is not None
    for name, original in tensors.items():
        assert restored.tensors[name].device.type == "cuda"
        assert raw_bytes(restored.tensors[name]) == raw_bytes(original), name


def test_peer_credentials_are_read_for_every_connection() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    from skippyd.server import peer_credentials

    pid, uid, gid, _groups = peer_credentials(left)
    assert (pid, uid, gid) == (os.getpid(), os.geteuid(), os.getegid())
    left.close()
    right.close()
    assert struct.calcsize("3i") == 12


def test_a_frame_trickled_a_byte_at_a_time_is_cut_off_at_the_frame_timeout(make_daemon: Any) -> None:
    """Each byte is activity, but the clock runs from the frame's first byte (no slowloris)."""
    proc = make_daemon("--frame-timeout", "1s").start()
    slow = _raw_connect(proc.socket)
    slow.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
    frame = encode_frame(FrameType.REQUEST, 2, {"op": "ping", "pad": "x" * 200})
    started = time.monotonic()
    closed_after = None
    for i in range(len(frame)):
        try:
            slow.sendall(frame[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
            break
        time.sleep(0.1)
    slow.close()
    assert closed_after is not None and closed_after < 6, "closed within the timeout plus a sweep"
    with proc.client() as client:
        assert client.ping()


def test_clients_holding_half_sent_frames_are_shed_before_they_exhaust_memory(make_daemon: Any) -> None:
    proc = make_daemon("--max-buffered", "1MiB").start()
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.REQUEST, 0, 0, 4 << 20, 0, 7)
    hogs = []
    for _ in range(3):
        hog = _raw_connect(proc.socket)
        hog.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
        with contextlib.suppress(BrokenPipeError):  # shed while sending: its error reply is still readable
            hog.sendall(header + b"\x00" * (600 << 10))  # a 4 MiB frame, 600 KiB of it sent
        hog.settimeout(1.5)
        hogs.append(hog)
        time.sleep(0.2)
    shed = []
    for hog in hogs:
        frames = _read_frames(hog)
        errors = [f.body["code"] for f in frames if f.type == FrameType.ERROR]
        shed.append("busy" in errors)
        hog.close()
    # 600 KiB each against 1 MiB: at most one may stay (which one is the largest when the line is
    # crossed; test_hardening has the innocent small request that crosses it)
    assert shed.count(False) <= 1, shed
    with proc.client() as client:
        assert client.ping()
