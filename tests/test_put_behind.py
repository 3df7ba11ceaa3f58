"""Puts answered before the daemon's copy out of staging (docs/protocol.md, "Staging halves"), over a real
daemon: the reply comes first, every later read (on any connection) waits for the copy and sees the
blocks whole, the client's next write goes to the other half, disconnects, evictions, stops.

The daemon's test hook (``SKIPPYD_TEST_COPY_GATE``) holds every copy behind a reply while a file exists,
so "the reply came before the copy" is a fact the test arranges, not a race it hopes to win."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from blake3 import blake3
from daemonutil import DaemonProcess, eventually

import skippyd
from skippyd.blocks import SETTLE_SECONDS
from skippyd.handlers import COPY_GATE_ENV

MODEL, STATE = "behind-model@sha256:0", "paged-kv-v1"
BLOCK = 16
BLOCK_BYTES = 64 * 1024
_STILL = 0.5  # how long a call held at the gate is watched to stay held (the gate holds for a minute)


def block_data(count: int, seed: int, nbytes: int = BLOCK_BYTES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(count)]


def space(client: skippyd.Client, **overrides: Any) -> skippyd.BlockSpace:
    args = {"model": MODEL, "state": STATE, "namespace": "", "block_tokens": BLOCK, **overrides}
    return client.blocks(**args)


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def without_halves(client: skippyd.Client) -> skippyd.Client:
    """The client as one that predates staging halves (its requests name none)."""
    info = client._connection().info
    info["features"] = [f for f in info["features"] if f != "staging_halves"]
    return client


class Background:
    """A call on a thread whose result (or error) is kept."""

    def __init__(self, call: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Any) -> None:
        try:
            self.result = call()
        except BaseException as exc:
            self.error = exc

    def held(self) -> bool:
        self.thread.join(_STILL)
        return self.thread.is_alive()

    def value(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def gate(tmp_short: Path) -> Path:
    path = tmp_short / "copy-gate"
    path.touch()
    return path


@pytest.fixture
def gated(make_daemon: Any, gate: Path) -> DaemonProcess:
    proc: DaemonProcess = make_daemon(env={COPY_GATE_ENV: str(gate)}).start()
    return proc


def test_a_put_is_answered_before_its_copy_and_every_later_read_waits_for_it(
    gated: DaemonProcess, gate: Path
) -> None:
    with gated.client() as writer, gated.client() as other, gated.client() as third:
        blocks = space(writer)
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=1)
        put = blocks.put(keys, data)  # answered while its copy waits at the gate
        assert (put.stored, put.present, put.nbytes, put.durability) == (4, 0, 4 * BLOCK_BYTES, "pending")
        stats = other.stats()
        assert stats["l2"]["block_count"] == 0 and stats["server"]["copies_behind"] == 1  # not committed
        # acknowledged means visible: the writer's own next request, and reads on other connections
        # (the event loop stays free: they wait on workers), see the put once its copy committed
        own = Background(lambda: blocks.contains(keys))
        counted = Background(lambda: space(other).contains(keys))
        got = Background(lambda: space(third).get(keys))
        assert own.held() and counted.held() and got.held()
        with gated.client() as fresh:  # the event loop is free: a new connection is answered meanwhile
            assert fresh.ping()
        gate.unlink()
        assert own.value() == 4 and counted.value() == 4
        assert same(got.value(), data)
        assert other.stats()["server"]["copies_behind"] == 0


def test_reads_waiting_for_a_copy_hold_no_worker_thread(make_daemon: Any, gate: Path) -> None:
    """Reads parked on a put's copy hold no thread: with two worker threads, eight readers wait for one
    copy while a put from yet another connection (a worker's job) is served; the copy then answers all."""
    proc: DaemonProcess = make_daemon(env={COPY_GATE_ENV: str(gate), "SKIPPYD_WORKERS": "2"}).start()
    with proc.client() as writer:
        keys = space(writer).keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=15)
        assert space(writer).put(keys, data).stored == 4  # its copy held at the gate
        readers = [proc.client() for _ in range(8)]
        try:
            waiting = [Background(lambda r=reader: space(r).contains(keys)) for reader in readers]
            assert waiting[0].held() and all(w.thread.is_alive() for w in waiting)  # (well within 5 s)
            with proc.client() as other:  # a put answered after its copy (no halves): a worker serves it
                mine = space(without_halves(other), namespace="other")
                other_keys = mine.keys(list(range(2 * BLOCK)))
                assert mine.put(other_keys, block_data(2, seed=16), durable=False).stored == 2
            assert all(w.thread.is_alive() for w in waiting)
            gate.unlink()
            assert [w.value() for w in waiting] == [4] * 8
        finally:
            for reader in readers:
                reader.close()


def test_reads_run_on_a_worker_because_a_tier_lock_was_held_park_without_a_thread_too(
    make_daemon: Any, gate: Path, tmp_short: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that finds a tier's lock held goes to a worker; if it then reaches a put's copy it is handed
    back to the event loop to wait, holding no thread. (Waiting on the worker, four such reads took both
    workers, and a worker's request of another client waited 3 s for the copy.) A test hook in the daemon
    holds the L2 lock 300 ms at a time while the readers ask."""
    import sys

    hold = tmp_short / "hold"
    wrapper = tmp_short / "python"
    wrapper.write_text(
        f'#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name("lock_holder.py")} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("SKIPPYD_DAEMON_PYTHON", str(wrapper))
    env = {COPY_GATE_ENV: str(gate), "SKIPPYD_WORKERS": "2", "SKIPPYD_TEST_HOLD_FILE": str(hold)}
    proc: DaemonProcess = make_daemon(env=env).start()
    with proc.client() as writer:
        keys = space(writer).keys(list(range(4 * BLOCK)))
        assert space(writer).put(keys, block_data(4, seed=15)).stored == 4  # its copy held at the gate
        readers = [proc.client() for _ in range(4)]
        try:
            for reader in readers:
                reader.ping()
            hold.touch()  # the L2 lock held 300 ms at a time: the reads go to workers
            time.sleep(0.05)
            waiting = [Background(lambda r=reader: space(r).contains(keys)) for reader in readers]
            time.sleep(0.8)
            hold.unlink()
            time.sleep(0.4)
            assert all(w.thread.is_alive() for w in waiting)  # still waiting for the copy
            with proc.client() as other:  # a worker's request from another connection
                started = time.monotonic()
                other.ls()
                took = time.monotonic() - started
            assert took < 1.0, f"ls waited {took:.2f} s: the worker threads were parked on a copy"
            gate.unlink()
            assert [w.value() for w in waiting] == [4] * 4
        finally:
            hold.unlink(missing_ok=True)
            for reader in readers:
                reader.close()


def test_a_read_waits_for_a_copy_that_does_not_come_at_most_the_settle_time(
    gated: DaemonProcess, gate: Path
) -> None:
    with gated.client() as writer, gated.client() as other:
        keys = space(writer).keys(list(range(2 * BLOCK)))
        assert space(writer).put(keys, block_data(2, seed=9)).stored == 2  # its copy held at the gate
        started = time.monotonic()
        assert space(other).contains(keys) == 0  # the copy never came: not held, as if never put
        waited = time.monotonic() - started
        assert SETTLE_SECONDS - 0.1 <= waited < SETTLE_SECONDS + 5
        assert other.health()["healthy"]
        gate.unlink()
        assert space(writer).contains(keys) == 2


def test_another_connection_never_sees_a_block_partial(daemon: DaemonProcess) -> None:
    batches = 24
    keys_of: list[list[bytes]] = []
    data_of: list[list[torch.Tensor]] = []
    with daemon.client() as writer, daemon.client() as reader:
        blocks, look = space(writer), space(reader)
        tokens: list[int] = []
        for batch in range(batches):
            tokens += list(range(batch * 1000, batch * 1000 + 4 * BLOCK))
            keys_of.append(blocks.keys(tokens)[-4:])
            data_of.append(block_data(4, seed=100 + batch))
        want = {k: d for ks, ds in zip(keys_of, data_of, strict=True) for k, d in zip(ks, ds, strict=True)}
        every = [k for ks in keys_of for k in ks]
        done = threading.Event()
        checked = [0]

        def read() -> None:
            while not done.is_set():
                got = look.get(every)
                for key, tensor in zip(every, got, strict=False):
                    assert torch.equal(tensor, want[key]), "a block served before its copy ended"
                checked[0] += len(got)

        reading = Background(read)
        for batch in range(batches):
            parent = keys_of[batch - 1][-1] if batch else None
            assert blocks.put(keys_of[batch], data_of[batch], parent=parent).stored == 4
        done.set()
        reading.value()
        assert same(look.get(every), [want[k] for k in every])


def test_the_half_the_reply_frees_may_be_rewritten_and_the_next_staged_reply_waits_for_the_copy(
    gated: DaemonProcess, gate: Path
) -> None:
    with gated.client() as writer, gated.client() as other:
        blocks = space(writer)
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=2)
        blocks.put(keys[:3], data[:3])  # half 0; its copy waits at the gate
        staging = writer._connection().staging
        assert staging is not None and staging.next_half == 1
        free, half = staging.take(staging.half_len, True)
        assert half == 1
        np.frombuffer(free, dtype=np.uint8)[:] = 0xFF  # the protocol lets the client write half 1 now
        free.release()
        # the next staged put (one block: no contains first) writes half 1; its reply waits for the copy
        # of half 0, so the client cannot write half 0 again before the daemon has read it
        nxt = Background(lambda: blocks.put(keys[3:], data[3:], parent=keys[2]))
        assert nxt.held()
        gate.unlink()
        assert nxt.value().stored == 1
        assert staging.next_half == 0
        assert blocks.contains(keys) == 4  # (returns once this connection's copies committed)
        assert same(space(other).get(keys), data)


def test_a_client_that_writes_the_half_being_copied_breaks_only_its_own_blocks(
    gated: DaemonProcess, gate: Path
) -> None:
    with gated.client() as writer, gated.client() as other:
        blocks = space(writer)
        keys = blocks.keys(list(range(2 * BLOCK)))
        blocks.put(keys, block_data(2, seed=3))
        staging = writer._connection().staging
        assert staging is not None
        busy = staging.region(staging.half_len)  # half 0, which the daemon is still to copy: misbehaving
        np.frombuffer(busy, dtype=np.uint8)[:] = 7
        busy.release()
        gate.unlink()
        assert eventually(lambda: space(other).contains(keys) == 2)
        got = space(other).get(keys)
        assert len(got) == 2 and all(bool((t == 7).all()) for t in got)  # what was there when copied
        assert other.ping() and other.health()["healthy"]


def test_a_client_gone_during_its_copy_leaves_whole_blocks_and_a_healthy_daemon(
    gated: DaemonProcess, gate: Path
) -> None:
    data = block_data(6, seed=4)
    with gated.client() as writer:
        keys = space(writer).keys(list(range(6 * BLOCK)))
        assert space(writer).put(keys, data).stored == 6
    # the writer is gone (its staging buffer with it, on its side); the daemon's mapping stays for the copy
    gate.unlink()
    with gated.client() as other:
        assert eventually(lambda: space(other).contains(keys) == 6)
        assert same(space(other).get(keys), data)
        assert other.health()["healthy"]
        # (the staging goes once the event loop hears the copy ended: a moment after the commit shows)
        assert eventually(lambda: other.stats()["staging_bytes"] == 0)
    assert "Traceback" not in gated.log_text()


def test_an_eviction_during_a_copy_keeps_the_put_out_and_never_hands_its_slots_to_another(
    gated: DaemonProcess, gate: Path
) -> None:
    with gated.client() as writer, gated.client() as admin:
        blocks = space(writer)
        keys = blocks.keys(list(range(8 * BLOCK)))
        assert blocks.put(keys, block_data(8, seed=5), durable=False).stored == 8  # its copy is held
        assert admin.evict(all=True) == 0  # nothing committed yet, the put's slots are reserved
        mine = space(without_halves(admin), namespace="admin")  # answered after its copy: not gated
        other_keys = mine.keys(list(range(8 * BLOCK)))
        other_data = block_data(8, seed=6)
        assert mine.put(other_keys, other_data, durable=False).stored == 8
        gate.unlink()
        assert blocks.contains(keys) == 0  # an eviction after the reservation: the put never commits
        assert same(mine.get(other_keys), other_data)  # its slots were never the held put's
        stats = admin.stats()["l2"]
        assert stats["block_count"] == 8 and stats["block_bytes"] == 8 * BLOCK_BYTES
        assert blocks.put(keys, block_data(8, seed=5), durable=False).stored == 8  # and it can come again


def test_one_key_put_by_two_connections_at_once_is_stored_once(gated: DaemonProcess, gate: Path) -> None:
    data = block_data(4, seed=7)
    with gated.client() as one, gated.client() as two:
        keys = space(one).keys(list(range(4 * BLOCK)))
        assert space(one).put(keys, data).stored == 4
        assert space(two).put(keys, data).stored == 4  # neither is committed: both reserve
        gate.unlink()
        assert space(one).contains(keys) == 4 and space(two).contains(keys) == 4
        stats = one.stats()
        assert stats["l2"]["block_count"] == 4 and stats["l2"]["block_bytes"] == 4 * BLOCK_BYTES
        assert stats["ops"]["block_put_stored"] == 4 and stats["ops"]["block_put_present"] == 4
        assert same(space(two).get(keys), data)


def test_a_client_without_halves_is_answered_after_its_copy(gated: DaemonProcess) -> None:
    with gated.client() as old, gated.client() as other:
        blocks = space(without_halves(old))
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=8)
        put = blocks.put(keys, data)  # the gate holds only copies behind replies: this one is not
        assert (put.stored, put.durability) == (4, "queued")
        assert same(space(other).get(keys), data)  # committed before the reply


def test_a_block_larger_than_a_half_is_staged_whole_and_one_past_the_staging_limit_is_too_large(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--staging-budget", "1MiB").start()  # halves of 512 KiB
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(3 * BLOCK)))
        small, big = block_data(1, seed=20), block_data(1, seed=21, nbytes=768 << 10)
        put = blocks.put(keys[:2], small + big)  # the big block goes alone, in the whole buffer
        assert (put.stored, put.nbytes) == (2, BLOCK_BYTES + (768 << 10))
        assert same(blocks.get(keys[:2]), small + big)
        with pytest.raises(skippyd.errors.TooLarge):
            blocks.put(keys[2:], block_data(1, seed=22, nbytes=2 << 20), parent=keys[1])
        assert blocks.contains(keys) == 2


def test_a_put_larger_than_a_half_goes_as_one_request_per_half(make_daemon: Any) -> None:
    proc = make_daemon("--staging-budget", "1MiB").start()  # halves of 512 KiB: 8 blocks each
    with proc.client() as client, proc.client() as other:
        blocks = space(client)
        keys = blocks.keys(list(range(40 * BLOCK)))
        data = block_data(40, seed=9)
        put = blocks.put(keys, data)
        assert (put.stored, put.nbytes) == (40, 40 * BLOCK_BYTES)
        assert client.stats()["ops"]["block_puts"] == 5  # (stats waits for this connection's copies)
        assert same(space(other).get(keys), data)


def test_a_stage_that_grows_the_buffer_waits_for_the_copy_reading_the_old_one(
    gated: DaemonProcess, gate: Path
) -> None:
    with gated.client() as writer, gated.client() as other:
        blocks = space(writer)
        keys = blocks.keys(list(range(2 * BLOCK)))
        small, large = block_data(1, seed=10, nbytes=4096), block_data(1, seed=11, nbytes=4 << 20)
        blocks.put(keys[:1], small)
        before = writer._connection().staging
        grow = Background(lambda: blocks.put(keys[1:], large, parent=keys[0]))  # needs a larger buffer
        assert grow.held()  # its stage waits for the copy out of the old buffer
        gate.unlink()
        assert grow.value().stored == 1
        assert writer._connection().staging is not before
        assert blocks.contains(keys) == 2  # (returns once this connection's copies committed)
        assert same(space(other).get(keys), small + large)


def test_a_clean_stop_right_after_puts_keeps_every_acknowledged_block(
    gated: DaemonProcess, gate: Path
) -> None:
    data = block_data(32, seed=12)
    with gated.client() as writer:
        blocks = space(writer)
        keys = blocks.keys(list(range(32 * BLOCK)))
        gate.unlink()
        for start in range(0, 32, 4):
            if start == 28:
                assert blocks.contains(keys[:28]) == 28  # (returns once the copies so far committed)
                gate.touch()
            parent = keys[start - 1] if start else None
            blocks.put(keys[start : start + 4], data[start : start + 4], durable=False, parent=parent)
        # the last put's copy waits at the gate: stop the daemon now
        gated.send(15)  # SIGTERM
        threading.Timer(_STILL, gate.unlink).start()
        assert gated.proc is not None and gated.proc.wait(30) == 0
        gated.proc = None
    gated.start()
    with gated.client() as client:
        assert space(client).contains(keys) == 32
        assert same(space(client).get(keys), data)


def test_kill_9_during_copies_behind_replies_leaves_only_whole_blocks_and_the_keys_can_come_again(
    gated: DaemonProcess, gate: Path
) -> None:
    """A power cut of the daemon while a put's copy waits behind its reply (its slots reserved, no byte
    copied yet): after the restart the committed blocks are there, whole, the reserved slots were not
    adopted as blocks (a slot's record is written after its bytes: adoption takes only recorded ones),
    and the lost blocks can be put again."""
    data = block_data(8, seed=14)
    with gated.client() as writer:
        blocks = space(writer)
        keys = blocks.keys(list(range(8 * BLOCK)))
        gate.unlink()
        assert blocks.put(keys[:4], data[:4], durable=False).stored == 4
        assert blocks.contains(keys[:4]) == 4  # committed (the connection's next request waits for it)
        gate.touch()
        assert blocks.put(keys[4:], data[4:], durable=False, parent=keys[3]).stored == 4  # held at the gate
    gated.kill9()
    gate.unlink()
    gated.start()
    with gated.client() as client:
        blocks = space(client)
        held = blocks.contains(keys)
        assert held == 4  # the committed run; the copy behind the last reply never ran
        assert same(blocks.get(keys), data[:4])
        stats = client.stats()["l2"]  # the lost put's slots were not adopted as blocks
        assert stats["block_count"] == 4 and stats["block_bytes"] == 4 * BLOCK_BYTES
        assert blocks.put(keys, data, durable=False).stored == 4  # the lost four, again
        assert same(blocks.get(keys), data)
        assert client.health()["healthy"]


def test_a_sync_put_survives_kill_9_right_after_its_reply(make_daemon: Any) -> None:
    proc = make_daemon().start()
    data = block_data(6, seed=13)
    with proc.client() as client:
        keys = space(client).keys(list(range(6 * BLOCK)))
        put = space(client).put(keys, data, durable="sync")
        assert (put.stored, put.durability) == (6, "written")
    proc.kill9()
    shutil.rmtree(proc.shm_dir)  # and a reboot: only L3 is left
    proc.shm_dir.mkdir()
    proc.start()
    with proc.client() as client:
        assert space(client).contains(keys) == 6
        assert same(space(client).get(keys), data)


def test_async_puts_alternate_halves_and_see_their_own_blocks(daemon: DaemonProcess) -> None:
    async def run() -> None:
        async with skippyd.AsyncClient(daemon.socket) as client:
            blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
            keys = blocks.keys(list(range(12 * BLOCK)))
            data = block_data(12, seed=14)
            for start in range(0, 12, 3):
                parent = keys[start - 1] if start else None
                assert (
                    await blocks.put(keys[start : start + 3], data[start : start + 3], parent=parent)
                ).stored == 3
            assert await blocks.contains(keys) == 12
            assert same(await blocks.get(keys), data)

    asyncio.run(run())


def test_a_capture_digest_is_blake3_of_what_a_restore_returns(daemon: DaemonProcess) -> None:
    tensors = {"k": torch.randn(3, 1000), "v": torch.arange(5000, dtype=torch.int64)}
    with daemon.client() as client:
        for tokens in ([1, 2, 3], [1, 2, 3, 4]):  # two staged captures: two halves
            result = client.capture(model=MODEL, state=STATE, tokens=tokens, tensors=tensors)
            restored = client.restore(model=MODEL, state=STATE, tokens=tokens)
            assert restored is not None
            hasher = blake3()
            for name in ("k", "v"):
                hasher.update(restored.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
            assert hasher.hexdigest() == result.digest


def test_a_client_scribbling_over_its_staging_during_captures_never_gets_an_entry_that_misses_its_digest(
    daemon: DaemonProcess,
) -> None:
    tensors = {"x": torch.zeros(24 << 20, dtype=torch.uint8)}  # copied and hashed overlapped, in chunks
    with daemon.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[9], tensors=tensors)  # the staging buffer exists
        staging = client._connection().staging
        assert staging is not None
        region = np.frombuffer(staging.region(staging.size), dtype=np.uint8)
        stop = threading.Event()

        def scribble() -> None:
            value = 0
            while not stop.is_set():
                value = (value + 1) % 251
                region[:] = value

        scribbler = Background(scribble)
        try:
            digests = [
                client.capture(model=MODEL, state=STATE, tokens=[10, n], tensors=tensors).digest
                for n in range(4)
            ]
        finally:
            stop.set()
            scribbler.value()
        for n, digest in enumerate(digests):
            restored = client.restore(model=MODEL, state=STATE, tokens=[10, n])
            assert restored is not None and restored.digest == digest
            data = restored.tensors["x"].numpy()
            assert blake3(data.tobytes()).hexdigest() == digest


def test_a_capture_too_large_for_a_half_gets_a_buffer_of_its_own_and_puts_go_back_to_halves(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--staging-budget", "1MiB").start()  # halves of 512 KiB
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(2 * BLOCK)))
        data = block_data(2, seed=15)
        blocks.put(keys[:1], data[:1])
        halved = client._connection().staging
        assert halved is not None and halved.halved is True
        big = {"x": torch.arange(768 * 1024 // 8, dtype=torch.int64)}  # 768 KiB: only whole fits
        result = client.capture(model=MODEL, state=STATE, tokens=[1, 2], tensors=big)
        whole = client._connection().staging
        assert whole is not halved and whole is not None and whole.halved is False
        blocks.put(keys[1:], data[1:], parent=keys[0])
        assert client._connection().staging is not whole  # used one way only: halves again
        restored = client.restore(model=MODEL, state=STATE, tokens=[1, 2])
        assert restored is not None and restored.digest == result.digest
        assert torch.equal(restored.tensors["x"], big["x"])
        assert same(blocks.get(keys), data)


class _Raw:
    """The protocol by hand: requests pipelined on one connection, replies read when the test says."""

    def __init__(self, path: Path) -> None:
        import socket

        from skippyd.protocol import FrameDecoder, FrameType

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))
        self.request_id = 0

    def send(self, body: dict[str, Any]) -> int:
        from skippyd.protocol import FrameType, encode_frame

        self.request_id += 1
        self.sock.sendall(encode_frame(FrameType.REQUEST, self.request_id, body))
        return self.request_id

    def answer(self, timeout: float = 30.0) -> Any:
        """The next reply or error frame, or None if none comes within ``timeout``."""
        from skippyd.protocol import recv_fds_into

        self.sock.settimeout(timeout)
        while (frame := self.decoder.next_frame()) is None:
            try:
                data, fds = recv_fds_into(self.sock)
            except TimeoutError:
                return None
            assert data, "the daemon closed the connection"
            self.decoder.feed(data, fds)
        return frame

    def close(self) -> None:
        self.decoder.close()
        self.sock.close()


def test_an_error_for_a_request_naming_a_half_waits_for_the_copy_reading_the_other_half(
    make_daemon: Any, gate: Path
) -> None:
    """At a clean stop a queued put naming half 0 is answered ``shutting_down``: that answer frees half 1
    for the client, so it comes only once the copy of the put before, which reads half 1, has ended.
    Before, it came at once, and a client writing half 1 then changed an acknowledged put's bytes."""
    import mmap
    import signal

    from skippyd.protocol import FrameType

    proc: DaemonProcess = make_daemon(env={COPY_GATE_ENV: str(gate)}).start()
    raw = _Raw(proc.socket)
    ident = {"op": "blocks_put", "model": MODEL, "state": STATE, "namespace": "", "block_tokens": BLOCK}

    def put(key: bytes, half: int) -> dict[str, Any]:
        one = {"keys": [key], "sizes": [BLOCK_BYTES], "offsets": [0]}
        return {**ident, **one, "half": half, "durable": False}

    try:
        raw.send({"op": "hello", "versions": [1]})
        assert raw.answer().type == FrameType.REPLY
        raw.send({"op": "stage", "size": 2 * BLOCK_BYTES})
        staged = raw.answer()
        assert staged.type == FrameType.REPLY
        (fd,) = staged.fds
        region = mmap.mmap(fd, staged.body["size"], flags=mmap.MAP_SHARED)
        half = staged.body["size"] // 2
        region[:BLOCK_BYTES] = b"a" * BLOCK_BYTES
        raw.send(
            {**ident, "keys": [b"A"], "sizes": [BLOCK_BYTES], "offsets": [0], "half": 0, "durable": False}
        )
        assert raw.answer().body["stored"] == 1  # A's copy (of half 0) waits at the gate
        region[half : half + BLOCK_BYTES] = b"b" * BLOCK_BYTES
        raw.send(
            {**ident, "keys": [b"B"], "sizes": [BLOCK_BYTES], "offsets": [0], "half": 1, "durable": False}
        )
        raw.send(
            {**ident, "keys": [b"C"], "sizes": [BLOCK_BYTES], "offsets": [0], "half": 0, "durable": False}
        )
        assert raw.answer(_STILL) is None  # B's reply waits for A's copy; C is queued behind B
        proc.send(signal.SIGTERM)  # C will be answered shutting_down
        time.sleep(_STILL)
        gate.write_text("1")  # A's copy passes the gate, B's (of half 1) waits at it
        b_reply = raw.answer()
        assert b_reply.type == FrameType.REPLY and b_reply.body["stored"] == 1
        assert raw.answer(_STILL) is None, "C was answered while B's copy had still to read half 1"
        gate.unlink()
        c_error = raw.answer()
        assert c_error.type == FrameType.ERROR and c_error.body["code"] == "shutting_down"
        region[half : half + BLOCK_BYTES] = b"X" * BLOCK_BYTES  # the answer let the client write half 1
        region.close()
        os.close(fd)
    finally:
        raw.close()
    assert proc.proc is not None and proc.proc.wait(30) == 0
    proc.proc = None
    proc.env.pop(COPY_GATE_ENV)
    proc.start()
    with proc.client() as client:
        (got,) = space(client).get([b"B"])  # adopted from the tmpfs: what B's copy read, not the X's
        assert bytes(got.numpy()) == b"b" * BLOCK_BYTES
