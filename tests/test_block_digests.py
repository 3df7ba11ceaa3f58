"""Block digests off the request path: a put answers once its blocks are copied and committed; their
BLAKE3 digests follow in the background (the digester), before any L3 copy (the durable writer hashes
what the digester has not reached), at a clean stop, or at adoption after a kill. Whatever path gave a
block its digest, it is the digest of the bytes the daemon holds, and adoption still drops a block
whose bytes changed after it was hashed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from daemonutil import DaemonProcess, eventually
from test_blocks_l3 import BLOCK, MODEL, NBYTES, STATE, block_data, blocks_of

from skippyd.blocks import BlockRules
from skippyd.keys import bind_keys, block_space
from skippyd.l2 import L2Tier
from skippyd.l2.digests import Digester
from skippyd.l2.slabs import Slab
from skippyd.l3 import L3Store
from skippyd.packer import BlockWriter
from skippyd.workers import Health


def slot_records(blocks_dir: Path) -> dict[bytes, tuple[Any, bytes]]:
    """Every committed slot on the tmpfs: its record and its bytes, by bound key (daemon stopped)."""
    found = {}
    for path in sorted(blocks_dir.glob("*.slab")):
        slab = Slab.open(path)
        try:
            for index in range(slab.slots):
                record = slab.record(index)
                if record is not None:
                    found[record.key] = (record, bytes(slab.data(index, record.nbytes)))
        finally:
            slab.close()
    return found


def flip_block(blocks_dir: Path, key: bytes) -> None:
    """Flips one bit in the middle of the bytes of the block ``key`` (bound), in its slab file."""
    for path in sorted(blocks_dir.glob("*.slab")):
        slab = Slab.open(path)
        try:
            for index in range(slab.slots):
                record = slab.record(index)
                if record is not None and record.key == key:
                    slab.mapping[slab.offset(index) + record.nbytes // 2] ^= 0x10
                    return
        finally:
            slab.close()
    raise AssertionError("no such block on the tmpfs")


def put_then_stop(proc: DaemonProcess, count: int, seed: int) -> tuple[list[bytes], list[torch.Tensor]]:
    """Puts ``count`` blocks (after each put: the digester hashes them soon, and the bytes read back as
    put), then stops the daemon cleanly; the keys and the data."""
    proc.start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(count * BLOCK)))
        data = block_data(count, seed=seed)
        assert blocks.put(keys, data, durable=False).stored == count
        assert client.stats()["l2"]["block_deferred_digests"] == count
        eventually(lambda: client.stats()["l2"]["block_unhashed"] == 0, timeout=10)  # the digester, running
        assert client.stats()["l2"]["block_unhashed_bytes"] == 0
        assert all(torch.equal(a, b) for a, b in zip(blocks.get(keys), data, strict=True))
    assert proc.stop() == 0  # a clean stop leaves every block with its digest
    return keys, data


def test_a_put_answers_before_hashing_and_every_block_gets_the_digest_of_its_bytes_soon_after(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--l3-dir", "off")
    keys, data = put_then_stop(proc, 8, seed=1)
    bound = bind_keys(block_space(MODEL, STATE, "", BLOCK), keys)
    held = slot_records(proc.shm_dir / "blocks")
    assert sorted(held) == sorted(bound)
    for key, block in zip(bound, data, strict=True):
        record, raw = held[key]
        assert record.hashed and raw == block.numpy().tobytes()
        assert record.digest == blake3(raw).digest()


def test_a_block_changed_on_the_tmpfs_while_the_daemon_was_stopped_is_dropped_never_served(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--l3-dir", "off")
    keys, data = put_then_stop(proc, 4, seed=2)
    flip_block(proc.shm_dir / "blocks", bind_keys(block_space(MODEL, STATE, "", BLOCK), keys)[2])
    proc.start()
    with proc.client() as client:
        stats = client.stats()["l2"]
        assert (stats["block_adopt_dropped"], stats["block_adopted"]) == (1, 3)
        assert blocks_of(client).contains(keys) == 2
        got = blocks_of(client).get(keys)
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, data, strict=False))


def _put(rules: BlockRules, keys: list[bytes], seed: int, durable: bool | str = False) -> Any:
    space = block_space(MODEL, STATE, "", BLOCK)
    raw = b"".join(t.numpy().tobytes() for t in block_data(len(keys), seed))
    offsets = [i * NBYTES for i in range(len(keys))]
    return rules.put(space, keys, [NBYTES] * len(keys), offsets, memoryview(raw), durable=durable), raw


def test_blocks_committed_unhashed_when_the_daemon_dies_are_hashed_at_adoption(shm_dir: Path) -> None:
    keys = [b"a", b"b", b"c"]
    l2 = L2Tier.open(shm_dir, 64 << 20)
    digester = Digester(l2, 16 << 20, Health())  # never started: nothing hashes in the background
    rules = BlockRules(l2, digester=digester)
    put, raw = _put(rules, keys, seed=3)
    assert put.stored == 3 and l2.stats().block_unhashed == 3
    l2.close()  # the process dies here: no digester drain, no clean stop
    with L2Tier.open(shm_dir, 64 << 20) as again:
        stats = again.stats()
        assert (stats.block_adopted, stats.block_adopt_dropped, stats.block_unhashed) == (3, 0, 0)
    held = slot_records(shm_dir / "blocks")
    for i, key in enumerate(bind_keys(block_space(MODEL, STATE, "", BLOCK), keys)):
        record, got = held[key]
        assert record.hashed and got == raw[i * NBYTES : (i + 1) * NBYTES]
        assert record.digest == blake3(got).digest()


def test_past_the_backlog_a_put_hashes_its_own_blocks_and_the_drain_catches_up(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 64 << 20) as l2:
        digester = Digester(l2, 2 * NBYTES, Health())
        rules = BlockRules(l2, digester=digester)
        _put(rules, [b"a", b"b", b"c"], seed=4)  # more than the backlog: hashed before the answer
        assert (l2.stats().block_deferred_digests, l2.stats().block_unhashed) == (0, 0)
        _put(rules, [b"d", b"e"], seed=5)  # fits: left to the digester
        assert (l2.stats().block_deferred_digests, l2.stats().block_unhashed) == (2, 2)
        _put(rules, [b"f"], seed=6)  # the backlog is full: hashed now
        assert l2.stats().block_unhashed == 2
        assert digester.drain(wait_idle=False) == 2  # (drain() would wait for the puts to go quiet)
        assert l2.stats().block_unhashed_bytes == 0
        with l2.lock:
            assert all(r is not None and r.hashed for r in map(l2.blocks.record, l2.blocks._blocks))


def test_the_durable_writer_hashes_what_the_digester_has_not_reached_and_l3_verifies_it(
    tmp_path: Path, shm_dir: Path
) -> None:
    space = block_space(MODEL, STATE, "", BLOCK)
    keys = [b"a", b"b"]
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        writer = BlockWriter(l2, l3, Health())  # not started: its job runs when we say
        rules = BlockRules(l2, l3=l3, writer=writer, digester=Digester(l2, 16 << 20, Health()))
        put, raw = _put(rules, keys, seed=7, durable=True)
        assert put.durability == "queued" and l2.stats().block_unhashed == 2
        job = writer._queue.get_nowait()
        assert job is not None
        writer._write([job])
        assert l2.stats().block_unhashed == 0  # the L2 records got the digests the packs carry
        bound = bind_keys(space, keys)
        views = [memoryview(bytearray(NBYTES)) for _ in keys]
        assert l3.blocks.read_into(bound, views) == 2  # each block read back passes its digest
        assert b"".join(bytes(v) for v in views) == raw


@pytest.mark.parametrize("backlog", ["0", "64KiB"])
def test_a_digest_backlog_of_zero_or_less_than_a_put_hashes_every_put_before_it_answers(
    make_daemon: Any, backlog: str
) -> None:
    proc = make_daemon("--l3-dir", "off", "--l2-digest-backlog", backlog).start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(2 * BLOCK)))
        assert blocks.put(keys, block_data(2, seed=8), durable=False).stored == 2
        stats = client.stats()["l2"]
        assert (stats["block_deferred_digests"], stats["block_unhashed"]) == (0, 0)


def test_a_block_one_hasher_has_taken_is_not_hashed_again_by_the_other(shm_dir: Path) -> None:
    """The block writer takes the unhashed blocks it packs; the digester skips them (and the reverse)."""
    with L2Tier.open(shm_dir, 64 << 20) as l2:
        rules = BlockRules(l2, digester=Digester(l2, 16 << 20, Health()))
        _put(rules, [b"a", b"b"], seed=9)
        bound = bind_keys(block_space(MODEL, STATE, "", BLOCK), [b"a", b"b"])
        with l2.lock:
            l2.blocks.hashing_begun(bound[:1])  # as the block writer does before it hashes them
            job = l2.blocks.digest_take(1 << 30)
            assert job is not None and [key for key, _, _, _ in job.items] == bound[1:]
            assert l2.blocks.digest_take(1 << 30) is None  # the digester's own step is taken too
            l2.blocks.hashing_ended(bound[:1])
            job.close()
            l2.blocks.hashing_ended(bound[1:])
            again = l2.blocks.digest_take(1 << 30)
            assert again is not None and len(again.items) == 2
            again.close()


def test_the_digester_starts_on_a_puts_blocks_as_its_quiet_window_closes_not_at_the_next_poll(
    shm_dir: Path,
) -> None:
    """A put's end wakes the digester inside the put's quiet window (2 ms); it must then wait out the rest
    of that window and hash, not sleep until its poll interval. With the interval set to 30 s, a lost
    wake-up shows as a 30 s wait, so the bound below holds on any machine, however busy; the latency itself
    (≈ 3-6 ms here, ≈ 50 ms at the old 50 ms poll) is bench.blocks' to measure."""
    with L2Tier.open(shm_dir, 256 << 20) as l2:
        digester = Digester(l2, 128 << 20, Health(), interval=30.0)
        rules = BlockRules(l2, digester=digester)
        digester.start()
        try:
            latencies = []
            for n in range(12):
                _put(rules, [b"%d-%d" % (n, i) for i in range(64)], seed=n)
                began = time.monotonic()
                assert l2.blocks.unhashed_bytes > 0, "the put left its blocks to the digester"
                while l2.blocks.unhashed_bytes and time.monotonic() - began < 10:
                    time.sleep(0.0002)
                latencies.append(time.monotonic() - began)
                time.sleep(0.01)
        finally:
            digester.close()
        assert l2.stats().block_unhashed == 0
        assert max(latencies) < 5, [f"{s * 1e3:.1f} ms" for s in latencies]


def test_the_digester_never_hashes_while_a_put_fills_slots_beyond_the_block_in_hand(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts that begin while the digester works on a backlog find it gone after the block it was hashing
    (it looks before each block): at most one of its blocks per put begins while a put fills slots (a
    16 MiB step hashed whole would put dozens of blocks under each)."""
    from skippyd.l2.digests import THREAD
    from skippyd.l2.slabs import block_digest as real

    during: list[bool] = []  # one per block the digester hashes: whether a put was filling as it began

    def watched(data: memoryview | bytes) -> bytes:
        if threading.current_thread().name == THREAD:
            during.append(l2.blocks.filling)
        return real(data)

    monkeypatch.setattr("skippyd.l2.blocks.block_digest", watched)  # (what DigestJob.hash calls)
    puts = 20
    with L2Tier.open(shm_dir, 512 << 20) as l2:
        digester = Digester(l2, 256 << 20, Health())
        rules = BlockRules(l2, digester=digester)
        digester.start()
        try:
            _put(rules, [b"backlog-%d" % i for i in range(1024)], seed=99)  # 64 MiB: tens of ms to hash
            for n in range(puts):  # 2 MiB each, 3 ms apart: the digester is mid-backlog as each begins
                time.sleep(0.003)
                _put(rules, [b"%d-%d" % (n, i) for i in range(32)], seed=n)
            eventually(lambda: l2.blocks.unhashed_bytes == 0, timeout=10)
        finally:
            digester.close()
    assert len(during) == 1024 + puts * 32, "the digester hashed every block (none was left to the stop)"
    assert sum(during) <= puts
