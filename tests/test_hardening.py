"""Durable means durable, and no one job's failure stops a background thread.

Real daemons killed with SIGKILL, real tmpfs files, real L3 directories; where a failure must happen at
one exact system call, the call is made to fail in-process (``os.pwrite`` raising ENOSPC).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemonutil import DaemonProcess, eventually

from skippyd.errors import InvalidArgument, NoSpace
from skippyd.keys import Identity, cache_key, encode_tokens
from skippyd.l2 import L2Tier
from skippyd.l3 import L3Store
from skippyd.payload import TensorDecl, plan_layout
from skippyd.tiers import PROMOTER, Tiers
from skippyd.workers import Health

MODEL, STATE = "m", "kv-v1"
IDENT = Identity(MODEL, STATE)


def staged(fill: int, n: int) -> tuple[list[TensorDecl], memoryview]:
    decls = [TensorDecl("x", "uint8", (n,))]
    specs, length = plan_layout(decls)
    buf = bytearray(max(length, 1))
    buf[specs[0].offset : specs[0].offset + n] = bytes([fill]) * n
    return decls, memoryview(buf)


@pytest.fixture
def tiers(shm_dir: Path, tmp_path: Path) -> Iterator[Tiers]:
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30))
    try:
        yield t
    finally:
        t.close()


def durable_count(client: Any) -> int:
    return int(client.stats()["l3"]["entries"])


# ------------------------------------------------------------------------------- entries without bytes


def test_an_entry_without_bytes_is_stored_and_restored_from_both_tiers_and_the_writer_goes_on(
    daemon: DaemonProcess,
) -> None:
    captures: dict[int, dict[str, torch.Tensor]] = {
        1: {},
        2: {"e": torch.empty(0, 4)},
        3: {"e": torch.empty(0, 4, dtype=torch.bfloat16), "x": torch.ones(3)},
    }
    with daemon.client() as client:
        for token, tensors in captures.items():
            result = client.capture(model=MODEL, state=STATE, tokens=[token], tensors=tensors)
            assert result.l3 and result.durability == "queued"
        after = client.capture(model=MODEL, state=STATE, tokens=[9], tensors={"x": torch.arange(10.0)})
        assert eventually(lambda: durable_count(client) == 4), "the writer kept writing after empty entries"
        assert all(t["alive"] and not t["errors"] for t in client.stats()["threads"].values())
        for token, tensors in captures.items():
            hit = client.restore(model=MODEL, state=STATE, tokens=[token, 0])
            assert hit is not None and hit.source == "l2" and set(hit.tensors) == set(tensors)
            for name, tensor in tensors.items():
                assert hit.tensors[name].shape == tensor.shape and hit.tensors[name].dtype == tensor.dtype
                assert torch.equal(hit.tensors[name], tensor)
    daemon.stop()
    shutil.rmtree(daemon.shm_dir)
    daemon.shm_dir.mkdir()  # a reboot: tmpfs is empty, L3 is what is left
    daemon.start()
    with daemon.client() as client:
        for token, tensors in captures.items():
            hit = client.restore(model=MODEL, state=STATE, tokens=[token])
            assert hit is not None and hit.source == "l3" and set(hit.tensors) == set(tensors)
            assert all(torch.equal(hit.tensors[n], t) for n, t in tensors.items())
        hit = client.restore(model=MODEL, state=STATE, tokens=[9])
        assert hit is not None and hit.digest == after.digest


# ------------------------------------------------------------------------------- meta


def test_meta_nested_deeper_than_the_limit_is_an_invalid_argument_with_no_traceback(
    daemon: DaemonProcess,
) -> None:
    meta: dict[str, Any] = {}
    inner = meta
    for _ in range(1000):
        inner["a"] = {}
        inner = inner["a"]
    ok: dict[str, Any] = {}
    inner = ok
    for _ in range(31):
        inner["a"] = {}
        inner = inner["a"]
    with daemon.client() as client:
        with pytest.raises(InvalidArgument, match="deeper than 32"):
            client.capture(model=MODEL, state=STATE, tokens=[1], tensors={"x": torch.ones(2)}, meta=meta)
        client.capture(model=MODEL, state=STATE, tokens=[2], tensors={"x": torch.ones(2)}, meta=ok)
        hit = client.restore(model=MODEL, state=STATE, tokens=[2])
        assert hit is not None and hit.meta == ok
    assert "Traceback" not in daemon.log_text()


# ------------------------------------------------------------------------------- durable across crashes


def test_a_durable_capture_acknowledged_just_before_kill_9_reaches_l3_after_the_restart(
    make_daemon: Any,
) -> None:
    """A 64 MiB capture, kill -9 right after its reply: the restarted daemon finds the intent on tmpfs
    and writes it. Repeated until at least one kill came before the write was done."""
    proc = make_daemon()
    data = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    crashed_before_the_write = 0
    for attempt in range(6):
        proc.start()
        with proc.client() as client:
            result = client.capture(model=MODEL, state=STATE, tokens=[attempt, 7], tensors={"x": data})
            assert result.l3 and result.durability == "queued"
        proc.kill9()
        proc.start()
        with proc.client() as client:
            crashed_before_the_write += client.stats()["durable"]["recovered"]
            want = attempt + 1
            assert eventually(lambda: client.stats()["l3"]["entries"] == want, timeout=30)  # noqa: B023
            listing = [e for e in client.ls() if e["digest"] == result.digest]
            assert {e["tier"] for e in listing} == {"l2+l3"}
        proc.stop()
        if crashed_before_the_write:
            break
    assert crashed_before_the_write, "no kill -9 landed before the durable write finished"
    shutil.rmtree(proc.shm_dir)
    proc.shm_dir.mkdir()  # and a reboot afterwards: the entry comes back from L3
    proc.start()
    with proc.client() as client:
        hit = client.restore(model=MODEL, state=STATE, tokens=[attempt, 7])
        assert hit is not None and hit.source == "l3" and torch.equal(hit.tensors["x"], data)


def test_a_sync_durable_capture_survives_kill_9_and_a_reboot(make_daemon: Any) -> None:
    proc = make_daemon().start()
    tensors = {"k": torch.randn(1 << 20), "v": torch.randn(3, 1000, dtype=torch.float64)}
    with proc.client() as client:
        result = client.capture(model=MODEL, state=STATE, tokens=[1, 2, 3], tensors=tensors, durable="sync")
        assert result.l3 and result.durability == "written"
        assert client.stats()["l3"]["entries"] == 1, "on disk before the reply"
    proc.kill9()
    shutil.rmtree(proc.shm_dir)
    proc.shm_dir.mkdir()
    proc.start()
    with proc.client() as client:
        hit = client.restore(model=MODEL, state=STATE, tokens=[1, 2, 3, 4])
        assert hit is not None and hit.source == "l3" and hit.digest == result.digest
        assert all(torch.equal(hit.tensors[n], t) for n, t in tensors.items())


def test_durable_must_be_true_false_or_sync(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        with pytest.raises(InvalidArgument):
            client.capture(model=MODEL, state=STATE, tokens=[1], tensors={}, durable="yes")  # type: ignore[arg-type]
        result = client.capture(model=MODEL, state=STATE, tokens=[1], tensors={}, durable=False)
        assert not result.l3 and result.durability == "none"


def test_a_read_only_l3_defers_durable_writes_and_writes_them_once_it_has_room(
    make_daemon: Any, mount_tmpfs: Any
) -> None:
    disk = Path(mount_tmpfs("8m"))
    filler = disk / "filler"
    proc = make_daemon("--l3-dir", str(disk / "l3"), "--l3-min-free", "2MiB").start()
    with filler.open("wb") as handle:
        handle.truncate(0)
        os.posix_fallocate(handle.fileno(), 0, 6 << 20)  # below the floor: L3 is read-only
    with proc.client() as client:
        assert eventually(lambda: client.stats()["l3"]["readonly"])
        result = client.capture(model=MODEL, state=STATE, tokens=[5], tensors={"x": torch.ones(1000)})
        assert not result.l3 and result.durability == "deferred"
        sync = client.capture(
            model=MODEL, state=STATE, tokens=[6], tensors={"x": torch.zeros(1000)}, durable="sync"
        )
        assert not sync.l3 and sync.durability == "deferred"
        assert client.stats()["durable"]["backlog"] == 2
        filler.unlink()  # room again: the deferred writes happen without anyone asking
        assert eventually(lambda: client.stats()["l3"]["entries"] == 2, timeout=30)
        assert client.stats()["durable"]["backlog"] == 0


# ------------------------------------------------------------------------------- threads survive


def test_a_disk_that_fills_during_an_l3_write_fails_that_write_and_the_writer_goes_on(
    tiers: Tiers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from pwrite in the middle of the object: before the fix, the traceback kept a view of the
    L2 mapping alive, closing it raised BufferError and the writer thread died."""
    real = os.pwrite
    full = threading.Event()
    full.set()

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if full.is_set() and len(data) > 4096:
            real(fd, bytes(data[:4096]), offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    decls, source = staged(3, 1 << 20)
    first = tiers.capture(identity=IDENT, tokens=encode_tokens([1]), tensors=decls, source=source)
    assert first.durability == "queued"
    assert tiers.writer is not None
    assert eventually(lambda: tiers.writer is not None and tiers.writer.stats().failed == 1)
    assert tiers.health.healthy and tiers.writer.alive
    assert tiers.l3 is not None and tiers.l3.get(cache_key(IDENT, encode_tokens([1]))) is None
    assert not any((tiers.l3.directory / "tmp").iterdir()), "nothing torn is left behind"
    full.clear()  # room again: the deferred write is retried, a new one goes straight through
    second = tiers.capture(identity=IDENT, tokens=encode_tokens([2]), tensors=decls, source=source)
    assert second.durability == "queued"
    assert eventually(lambda: tiers.l3 is not None and tiers.l3.get(cache_key(IDENT, encode_tokens([2]))))
    # the write that succeeded shows L3 has room again: the failed one is retried at once, not later
    assert eventually(lambda: tiers.l3 is not None and tiers.l3.get(cache_key(IDENT, encode_tokens([1]))))
    assert tiers.writer.stats().backlog == 0 and tiers.writer.stats().written == 2
    assert tiers.health.snapshot()["skippyd-l3-writer"].errors == 1


class _Raising:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.calls = 0

    def consider(self, digest: str, token_count: int, payload_bytes: int) -> bool:
        self.calls += 1
        raise self.exc

    def settle(self, digest: str) -> None:
        raise AssertionError("never promoted")


def _fill(t: Tiers, times: int, policy: _Raising) -> None:
    """L3 fills of one entry, each after the promoter has decided the one before."""
    for i in range(times):
        t.l2.clear()
        opened = t.open_restore(IDENT, encode_tokens([1, 2]))
        assert opened is not None and opened.source == "l3"
        os.close(opened.fd)
        fills = t.fills
        assert fills is not None
        assert eventually(lambda i=i, f=fills: policy.calls > i and not f.in_flight, timeout=10)  # type: ignore[misc]


def _tiers_with(shm_dir: Path, tmp_path: Path, policy: _Raising) -> Tiers:
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30), promotions=policy)
    decls, source = staged(9, 50_000)
    t.capture(identity=IDENT, tokens=encode_tokens([1, 2]), tensors=decls, source=source, durable="sync")
    return t


def test_a_promotion_policy_that_raises_is_counted_and_the_promoter_goes_on(
    shm_dir: Path, tmp_path: Path
) -> None:
    policy = _Raising(RuntimeError("boom"))
    t = _tiers_with(shm_dir, tmp_path, policy)
    try:
        _fill(t, 2, policy)
        assert eventually(lambda: t.health.snapshot()[PROMOTER].errors == 2)
        # the error is counted as the check fails; the fill is resolved (its work ended) just after
        assert eventually(lambda: t.clock.outstanding == 0)
        assert t.health.healthy
    finally:
        t.close()


def test_a_background_thread_that_dies_anyway_makes_the_daemon_unhealthy(
    shm_dir: Path, tmp_path: Path
) -> None:
    policy = _Raising(SystemExit(3))  # not an Exception: it ends the thread
    t = _tiers_with(shm_dir, tmp_path, policy)
    try:
        _fill(t, 1, policy)
        assert eventually(lambda: not t.health.healthy)
        assert t.health.dead() == [PROMOTER]
        snapshot = t.health.snapshot()[PROMOTER]
        assert not snapshot.alive and "SystemExit" in snapshot.last_error
    finally:
        t.close()


def test_health_counts_each_failure_and_tells_a_stopped_thread_from_a_dead_one() -> None:
    health = Health()
    stop = threading.Event()

    def loop() -> None:
        for _ in range(3):
            with health.guard("t", "a job failed"):
                raise NoSpace("full")
        stop.wait(10)

    thread = health.start("t", loop)
    assert eventually(lambda: health.snapshot()["t"].errors == 3)
    assert health.healthy
    stop.set()
    thread.join()
    assert health.healthy, "a thread that returned was stopped, not dead"
    assert not health.snapshot()["t"].alive


def test_closing_the_tiers_never_waits_long_for_a_writer_that_is_gone(shm_dir: Path, tmp_path: Path) -> None:
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30), l3_queue=2)
    decls, source = staged(1, 4096)
    for i in range(8):
        t.capture(identity=IDENT, tokens=encode_tokens([i]), tensors=decls, source=source)
    started = time.monotonic()
    t.close(timeout=2.0)
    assert time.monotonic() - started < 5.0


def test_writes_left_at_shutdown_keep_their_intent_for_the_next_start(shm_dir: Path, tmp_path: Path) -> None:
    gate = threading.Event()
    l3 = L3Store.open(tmp_path / "l3", 1 << 30)
    real = l3.write

    def slow(*args: Any, **kwargs: Any) -> bool:
        gate.wait(10)
        return real(*args, **kwargs)

    l3.write = slow  # type: ignore[method-assign]
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=l3)
    decls, source = staged(1, 4096)
    for i in range(3):
        t.capture(identity=IDENT, tokens=encode_tokens([i]), tensors=decls, source=source)
    assert t.writer is not None
    old_thread = t.writer._thread
    t.close(timeout=0.2)  # the first write is stuck on the disk, two more are queued
    marks = sorted(p.name for p in (shm_dir / "pending").iterdir())
    assert len(marks) == 3, "unwritten durable writes keep their markers"
    gate.set()
    assert old_thread is not None
    old_thread.join(10)  # the stuck write finishes (a real shutdown would just exit)
    again = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30))
    try:
        assert again.writer is not None and again.writer.stats().recovered >= 2
        assert again.writer.wait_idle()
        assert again.l3 is not None
        assert all(again.l3.get(cache_key(IDENT, encode_tokens([i]))) is not None for i in range(3))
        assert not any((shm_dir / "pending").iterdir())
    finally:
        again.close()


def test_an_l3_write_mapping_is_released_even_when_the_write_fails(tmp_path: Path, shm_dir: Path) -> None:
    """The writer maps an entry's bytes and closes the mapping after the write; it must be closable."""
    store = L3Store.open(tmp_path / "l3", 1 << 30)
    tier = L2Tier.open(shm_dir, 64 << 20)
    try:
        decls, source = staged(5, 100_000)
        with tier.reserve(key=cache_key(IDENT, b"\x01\x00\x00\x00"), identity=IDENT, token_count=1,
                          tensors=decls) as reservation:  # fmt: skip
            reservation.data[: len(source)] = source[: len(reservation.data)]
            entry = reservation.commit()
        held = tier.hold(entry.key, hit=False)
        assert held is not None
        fd = held.fd
        mapping = mmap.mmap(fd, entry.data_len, prot=mmap.PROT_READ, offset=held.data_offset)
        view = memoryview(mapping)
        real = os.pwrite

        def failing(*args: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.pwrite = failing
        try:
            with pytest.raises(NoSpace):
                store.write(entry, view)
        finally:
            os.pwrite = real
        view.release()
        mapping.close()  # BufferError before the fix
        os.close(fd)
    finally:
        tier.close()
        store.close()


# ------------------------------------------------------------------------------- full filesystems


def _keep_full(directory: Path, stop: threading.Event, made: list[Path]) -> None:
    """Keeps ``directory``'s filesystem full until ``stop``: 64 KiB files, taking any room that frees up.

    Only ever writes on the small mount it was started on (the same device, at most that mount's size),
    so a test that fails and unmounts it never turns this into a filler of the real disk."""
    chunk = os.urandom(64 << 10)
    device = os.stat(directory).st_dev
    limit = os.statvfs(directory).f_blocks * os.statvfs(directory).f_frsize
    written = 0
    while not stop.is_set() and written <= limit:
        if os.stat(directory).st_dev != device:
            return
        path = directory / f"filler-{len(made)}"
        try:
            with path.open("wb") as handle:
                handle.write(chunk)
                handle.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                return
            path.unlink(missing_ok=True)
            time.sleep(0.0005)
            continue
        written += len(chunk)
        made.append(path)


@pytest.mark.slow
def test_l2_and_l3_filling_up_mid_write_leave_every_thread_alive_and_captures_recover(
    make_daemon: Any, mount_tmpfs: Any
) -> None:
    l2_fs, l3_fs = Path(mount_tmpfs("64m")), Path(mount_tmpfs("24m"))
    (l2_fs / "l2").mkdir(mode=0o700)
    proc = make_daemon(
        "--shm-dir", str(l2_fs / "l2"), "--l3-dir", str(l3_fs / "l3"), "--l3-min-free", "0",
        "--l3-budget", "16MiB", budget="40MiB",
    ).start()  # fmt: skip
    fillers: list[Path] = []
    stored: dict[int, tuple[str, torch.Tensor]] = {}
    refused = 0

    def capture_while_filling(client: Any, fs: Path, tokens: range, sizes: int) -> None:
        """Captures of ``sizes`` different sizes (a size class L2 has not recycled needs fresh pages)."""
        nonlocal refused
        stop = threading.Event()
        filler = threading.Thread(target=_keep_full, args=(fs, stop, fillers), daemon=True)
        filler.start()
        try:
            for i in tokens:
                data = torch.randint(0, 255, ((1 + i % sizes) << 20,), dtype=torch.uint8)
                try:
                    result = client.capture(model=MODEL, state=STATE, tokens=[i, 1], tensors={"x": data})
                except NoSpace:
                    refused += 1
                    continue
                stored[i] = (result.digest, data)
        finally:
            stop.set()
            filler.join()

    with proc.client(timeout=30.0) as client:
        capture_while_filling(client, l3_fs, range(40), 1)  # the disk fills under the L3 writer
        assert eventually(lambda: client.stats()["durable"]["queue_depth"] == 0, timeout=30)
        stats = client.stats()
        assert stats["durable"]["failed"] + stats["l3"]["refused_writes"] > 0, "L3 filled up mid-write"
        capture_while_filling(client, l2_fs, range(40, 80), 3)  # then the tmpfs under L2
        assert refused > 0 and stored, "the tmpfs filled up: captures were refused, others stored"
        health = client.stats()["threads"]
        assert all(t["alive"] for t in health.values()), health
        for path in fillers:  # room again
            path.unlink(missing_ok=True)
        for i, (digest, data) in stored.items():  # never wrong bytes: a hit is the captured one
            hit = client.restore(model=MODEL, state=STATE, tokens=[i, 1])
            if hit is not None:
                assert hit.digest == digest and torch.equal(hit.tensors["x"], data)
        fresh = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        again = client.capture(model=MODEL, state=STATE, tokens=[999], tensors={"x": fresh}, durable="sync")
        assert again.l3 and again.durability == "written", "captures and durable writes work again"
        assert eventually(lambda: client.stats()["durable"]["backlog"] == 0, timeout=120)
        assert all(t["alive"] for t in client.stats()["threads"].values())
        assert client.health()["healthy"]
    proc.stop()
    assert not any((l3_fs / "l3" / "tmp").iterdir()), "no torn write left behind"
    with L3Store.open(l3_fs / "l3", 1 << 30) as store:
        report = store.last_reconciliation
        assert report.manifests_quarantined == 0 and report.orphans_collected == 0, report


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_client_that_pipelines_gets_and_never_reads_holds_a_bounded_number_of_descriptors(
    daemon: DaemonProcess,
) -> None:
    """Each ``blocks_get`` reply carries slab descriptors; replies a client does not read wait in the
    daemon with theirs. A client sending gets without end and reading nothing holds at most a few dozen
    of the daemon's descriptors (its later requests wait), and every other client is served as before."""
    import select
    import socket

    from skippyd.protocol import FrameType, encode_frame

    assert daemon.proc is not None
    pid = daemon.proc.pid
    with daemon.client() as client:
        blocks = client.blocks(model="m", state="s", block_tokens=16)
        keys = blocks.keys(list(range(16 * 8)))
        # eight size classes: eight slabs, so each get reply carries eight descriptors
        data = [torch.full((4096 << i,), i, dtype=torch.uint8) for i in range(8)]
        assert blocks.put(keys, data, durable=False).stored == 8
        assert blocks.contains(keys) == 8
        before = _open_fds(pid)
        hostile = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hostile.connect(str(daemon.socket))
        hostile.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
        get = {
            "op": "blocks_get",
            "model": "m",
            "state": "s",
            "namespace": "",
            "block_tokens": 16,
            "keys": keys,
        }
        frames = encode_frame(FrameType.REQUEST, 2, get) * 500
        hostile.setblocking(False)
        pending = memoryview(frames)
        deadline = time.monotonic() + 3
        most = before
        while time.monotonic() < deadline:
            try:
                sent = hostile.send(pending)
                pending = pending[sent:] if sent < len(pending) else memoryview(frames)
            except BlockingIOError:
                select.select([], [hostile], [], 0.1)
            most = max(most, _open_fds(pid))
        try:
            assert most - before <= 96, f"the daemon went from {before} to {most} descriptors"
            # and at most a bounded number sent into its socket (the kernel counts those against the
            # daemon's user: past its open-files limit it would pass no descriptor to anyone)
            unread = client.stats()["server"]["fds_unread"]
            assert unread <= 256 + 8, f"{unread} descriptors sit unread in the client's socket"
            other = client.blocks(model="m", state="s", block_tokens=16)
            got = other.get(keys)
            assert [int(t[0]) for t in got] == list(range(8))
            assert client.ping()
        finally:
            hostile.close()
    assert eventually(lambda: _open_fds(pid) <= before + 8)


def test_a_connection_closed_while_its_client_holds_unread_descriptors_lingers_until_it_reads_or_closes(
    daemon: DaemonProcess,
) -> None:
    """Descriptors sent in replies stay in the client's socket, counted against the daemon's user, whatever
    the daemon does with its own end. A connection the daemon closes (here: a bad frame after a get it
    never read) keeps its socket, and its place among its uid's connections, until the client has read
    them or closed; so reconnecting cannot pile up descriptors the daemon no longer counts."""
    import socket

    from skippyd.protocol import FrameType, encode_frame, recv_fds_into

    with daemon.client() as client:
        blocks = client.blocks(model="m", state="s", block_tokens=16)
        keys = blocks.keys(list(range(16 * 8)))
        data = [torch.full((4096 << i,), i, dtype=torch.uint8) for i in range(8)]  # 8 slabs a get
        assert blocks.put(keys, data, durable=False).stored == 8
        space = {"model": "m", "state": "s", "namespace": "", "block_tokens": 16}
        for read_them in (True, False):
            hostile = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            hostile.settimeout(10)
            hostile.connect(str(daemon.socket))
            hostile.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
            hostile.sendall(encode_frame(FrameType.REQUEST, 2, {"op": "blocks_get", **space, "keys": keys}))
            assert eventually(lambda: client.stats()["server"]["fds_unread"] >= 8)
            hostile.sendall(b"NOT A FRAME" * 8)  # a protocol error: the daemon closes its end
            assert eventually(lambda: client.stats()["server"]["lingering"] == 1)
            assert client.stats()["server"]["fds_unread"] >= 8
            if read_them:
                received: list[int] = []
                with contextlib.suppress(OSError):
                    while True:
                        data_, fds = recv_fds_into(hostile)
                        received += fds
                        if not data_:
                            break
                for fd in received:
                    os.close(fd)
                assert len(received) == 8
            hostile.close()
            assert eventually(lambda: client.stats()["server"]["lingering"] == 0, timeout=5)
            assert client.stats()["server"]["fds_unread"] == 0
        assert client.ping()


def test_the_daemon_raises_its_open_files_limit_to_the_hard_limit() -> None:
    """Started from a shell whose soft limit is low, the daemon serves with its hard limit (bounded)."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from skippyd.daemon import raise_open_files_limit\n"
        "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    returned, now, hard = (int(x) for x in out.stdout.split())
    want = 1 << 20 if hard < 0 else min(hard, 1 << 20)
    assert returned == now == want > 256


@pytest.mark.parametrize("op", [{"a": 1}, [1, 2], None, 7])
def test_an_op_that_is_not_a_string_is_an_invalid_argument_even_with_a_half(
    daemon: DaemonProcess, op: object
) -> None:
    import socket

    from skippyd.protocol import FrameDecoder, FrameType, encode_frame, recv_fds_into

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket))
        sock.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
        sock.sendall(encode_frame(FrameType.REQUEST, 2, {"op": op, "half": 0}))
        decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))
        frames: list[Any] = []
        while len(frames) < 2:
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
            if len(frames) < 2:
                data, fds = recv_fds_into(sock)
                assert data, "the daemon closed the connection"
                decoder.feed(data, fds)
        decoder.close()
    assert frames[1].type == FrameType.ERROR and frames[1].body["code"] == "invalid_argument"
    with daemon.client() as client:
        assert client.ping()


def test_a_sparse_file_left_in_l2_is_given_its_pages_or_dropped_at_start_never_a_sigbus(
    mount_tmpfs: Any, monkeypatch: pytest.MonkeyPatch, tmp_short: Path
) -> None:
    """A free file of the right size but with no pages (copied with ``cp --sparse``, or made by hand)
    would be reused for a capture and written through a mapping: on a full tmpfs, SIGBUS. Adoption gives
    it its pages, or, where the tmpfs has none to give, drops it: the capture is ``no_space`` and the
    daemon stays up."""
    import daemonutil

    import skippyd

    monkeypatch.setattr(daemonutil, "TEST_SHM", str(mount_tmpfs("64m")))
    proc = DaemonProcess(tmp_short, "--l2-reserve", "0", "--redis-url", "none", budget="48MiB")
    tensor = torch.ones(1 << 20, dtype=torch.float32)  # 4 MiB
    try:
        proc.start()
        with proc.client() as client:
            client.capture(model="m", state="s", tokens=[1], tensors={"t": tensor}, durable=False)
        size = next((proc.shm_dir / "entries").iterdir()).stat().st_size
        proc.stop()
        sparse = proc.shm_dir / "free" / "0123456789abcdef.any.free"
        with sparse.open("wb") as f:
            f.truncate(size)  # the right size class, no pages
        assert sparse.stat().st_blocks == 0
        filler = proc.shm_dir.parent / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * (1 << 20))
        os.close(fd)
        proc.start()
        assert not sparse.exists(), "a sparse free file the full tmpfs cannot fill is dropped at start"
        with proc.client() as client, pytest.raises(skippyd.NoSpace):
            client.capture(model="m", state="s", tokens=[2], tensors={"t": tensor}, durable=False)
        assert proc.proc is not None and proc.proc.poll() is None
        filler.unlink()
        with proc.client() as client:
            client.capture(model="m", state="s", tokens=[3], tensors={"t": tensor}, durable=False)
            assert client.restore(model="m", state="s", tokens=[3]) is not None
    finally:
        proc.cleanup()


def test_past_max_buffered_the_connections_holding_the_most_are_shed_not_the_next_small_request(
    make_daemon: Any,
) -> None:
    """Half-sent frames fill the daemon's request buffers to just under ``max_buffered``; a small hello
    from another client then crosses the line. The client holding the most is shed (``busy``), never the
    innocent one."""
    import socket

    from skippyd.protocol import HEADER, MAGIC, FrameDecoder, FrameType, encode_frame, recv_fds_into

    proc: DaemonProcess = make_daemon(env={"SKIPPYD_MAX_BUFFERED": "4MiB"}).start()
    limit = 4 << 20

    def answer(sock: socket.socket) -> Any:
        decoder = FrameDecoder(expect=(FrameType.REPLY, FrameType.ERROR))
        while (frame := decoder.next_frame()) is None:
            data, fds = recv_fds_into(sock)
            if not data:
                return None
            decoder.feed(data, fds)
        decoder.close()
        return frame

    hogs = []
    try:
        for part in (limit // 2, limit - limit // 2 - 1):  # together one byte under the limit
            hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            hog.settimeout(10)
            hog.connect(str(proc.socket))
            hog.sendall(HEADER.pack(MAGIC, 1, FrameType.REQUEST, 0, 0, part + 1000, 0, 99) + b"\0" * part)
            hogs.append(hog)
        time.sleep(0.3)
        for _ in range(3):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as innocent:
                innocent.settimeout(10)
                innocent.connect(str(proc.socket))
                innocent.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
                frame = answer(innocent)
                assert frame is not None and frame.type == FrameType.REPLY, frame
        shed = answer(hogs[0])  # the largest: told busy, then closed
        assert shed is not None and shed.type == FrameType.ERROR and shed.body["code"] == "busy"
    finally:
        for hog in hogs:
            hog.close()
    with proc.client() as client:
        assert client.ping()


@pytest.mark.parametrize("exempt", [True, False], ids=["root", "without-cap-sys-resource"])
def test_clients_that_never_read_cannot_take_every_descriptor_and_running_out_is_busy(
    tmp_short: Path, monkeypatch: pytest.MonkeyPatch, exempt: bool
) -> None:
    """A daemon allowed only 160 descriptors, six connections pipelining gets they never read: together
    they hold at most a quarter of the limit (about; each waits once it holds some past that), so an
    innocent client's get is served; and where descriptors run out anyway, the answer is ``busy``.

    Without CAP_SYS_RESOURCE (a daemon run as its own user, as systemd does), the kernel also counts the
    descriptors sitting in the sockets of clients that have not read them against the daemon's limit,
    and refuses to pass more past it (ETOOMANYREFS) to anyone: those count toward the same share, so the
    innocent client is served, not disconnected."""
    import shutil
    import socket
    import sys

    import skippyd
    from skippyd.protocol import FrameType, encode_frame

    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("needs prlimit (util-linux)")
    wrapper = tmp_short / "python"
    setpriv = shutil.which("setpriv")
    if not exempt and (setpriv is None or os.geteuid() != 0):
        pytest.skip("needs root and setpriv (util-linux) to drop the capabilities")
    drop = (
        ""
        if exempt
        else f"{setpriv} --bounding-set=-sys_admin,-sys_resource --inh-caps=-sys_admin,-sys_resource "
    )
    wrapper.write_text(f'#!/bin/sh\nexec {drop}{prlimit} --nofile=160:160 -- {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("SKIPPYD_DAEMON_PYTHON", str(wrapper))
    proc = DaemonProcess(tmp_short, "--redis-url", "none")
    hostile: list[socket.socket] = []
    try:
        proc.start()
        assert proc.proc is not None
        with proc.client() as client:
            blocks = client.blocks(model="m", state="s", block_tokens=16)
            keys = blocks.keys(list(range(16 * 8)))
            data = [torch.full((4096 << i,), i, dtype=torch.uint8) for i in range(8)]  # 8 slabs a get
            blocks.put(keys, data, durable=False)
            assert blocks.contains(keys) == 8
            space = {"model": "m", "state": "s", "namespace": "", "block_tokens": 16}
            gets = encode_frame(FrameType.REQUEST, 2, {"op": "blocks_get", **space, "keys": keys}) * 3000
            for _ in range(6):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(str(proc.socket))
                sock.settimeout(2)
                sock.sendall(encode_frame(FrameType.REQUEST, 1, {"op": "hello", "versions": [1]}))
                with contextlib.suppress(TimeoutError):
                    sock.sendall(gets)  # (stops once the daemon stops reading it)
                # (the server's share: a quarter of 160, at least 64; each connection may pass it by a reply)
                assert client.stats()["server"]["fds_unread"] <= 64 + 8 * (len(hostile) + 1)
                hostile.append(sock)
            assert _open_fds(proc.proc.pid) < 150
            got = blocks.get(keys)
            assert [int(t[0]) for t in got] == list(range(8))
            del got
            for sock in hostile:
                sock.close()
            hostile.clear()
            # descriptors run out anyway (idle connections, one each): a get that needs more is busy
            pid = proc.proc.pid
            while _open_fds(pid) < 157:
                idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                idle.connect(str(proc.socket))
                hostile.append(idle)
                time.sleep(0.01)
            with pytest.raises(skippyd.Busy):
                blocks.get(keys)
            for sock in hostile:
                sock.close()
            hostile.clear()
            assert eventually(lambda: _open_fds(pid) < 100)
            assert len(blocks.get(keys)) == 8
            assert "internal" not in proc.log_text()
    finally:
        for sock in hostile:
            sock.close()
        proc.cleanup()
