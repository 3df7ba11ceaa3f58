"""Blocks in L3 over a real daemon: packs survive kill -9 and reboots, reads verify, promotion, compaction."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from daemonutil import DaemonProcess, eventually

import skippyd
from skippyd.client.blockspace import MAX_KEYS_PER_REQUEST
from skippyd.errors import NoSpace
from skippyd.l3 import L3Store
from skippyd.l3.packs import BlockItem, PackRecord

MODEL, STATE = "block-model@sha256:1", "paged-kv-v1"
BLOCK = 16
NBYTES = 64 * 1024


def block_data(count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=gen) for _ in range(count)]


def blocks_of(client: skippyd.Client) -> skippyd.BlockSpace:
    return client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)


def reboot(proc: DaemonProcess) -> None:
    """The daemon stopped and the tmpfs wiped, as a reboot leaves them: only L3 is left."""
    shutil.rmtree(proc.shm_dir)
    proc.shm_dir.mkdir()


def packs(proc: DaemonProcess) -> list[Path]:
    return sorted((proc.state_dir / "l3" / "packs").glob("*.pack"))


def test_sync_blocks_come_back_from_l3_after_a_reboot(make_daemon: Any) -> None:
    proc = make_daemon().start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(6 * BLOCK)))
        data = block_data(6, seed=1)
        put = blocks.put(keys, data, durable="sync")
        assert (put.stored, put.durability) == (6, "written")
        assert client.stats()["l3"]["block_count"] == 6
    assert proc.stop() == 0
    reboot(proc)
    proc.start()
    with proc.client() as client:
        blocks = blocks_of(client)
        assert client.stats()["l2"]["block_count"] == 0
        assert blocks.contains(keys) == 6
        got = blocks.get(keys)
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
        out = [torch.empty(NBYTES, dtype=torch.uint8) for _ in keys]
        assert blocks.get_into(keys, out) == 6
        assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))


def test_a_sync_put_of_blocks_l2_already_holds_writes_them_to_l3_before_it_says_written(
    make_daemon: Any,
) -> None:
    """Blocks put first without ``durable`` and then again with ``"sync"`` are present, not stored, the
    second time: the reply still says ``"written"`` only once L3 holds them, so a reboot keeps them."""
    proc = make_daemon().start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=7)
        assert blocks.put(keys, data, durable=False).durability == "none"
        assert client.stats()["l3"]["block_count"] == 0
        again = blocks.put(keys, data, durable="sync")
        assert (again.stored, again.present, again.durability) == (0, 4, "written")
        assert client.stats()["l3"]["block_count"] == 4
    proc.kill9()
    reboot(proc)
    proc.start()
    with proc.client() as client:
        blocks = blocks_of(client)
        assert blocks.contains(keys) == 4
        assert all(torch.equal(a, b) for a, b in zip(blocks.get(keys), data, strict=True))


def test_a_get_of_more_keys_than_one_request_takes_comes_back_whole_from_l3(make_daemon: Any) -> None:
    """A get of more keys than one request takes (8192), read from L3 after a reboot: every reply's
    blocks land in their places while the next request is asked for, and the get asks on to the end."""
    count, nbytes = MAX_KEYS_PER_REQUEST + 300, 1024
    proc = make_daemon().start()
    gen = torch.Generator().manual_seed(17)
    data = torch.randint(0, 256, (count, nbytes), dtype=torch.uint8, generator=gen)
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=1)
        keys = blocks.keys(list(range(count)))
        assert blocks.put(keys, list(data), durable="sync").stored == count
    assert proc.stop() == 0
    reboot(proc)
    proc.start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=1)
        out = torch.zeros_like(data)
        assert blocks.get_into(keys, list(out)) == count
        assert torch.equal(out, data)


def test_after_a_reboot_the_reserve_stocks_the_block_groups_l3_holds_so_reads_fault_no_fresh_slots(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--l2-reserve", "2MiB", budget="16MiB").start()
    keys: list[bytes] = []
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(8 * BLOCK)))
        data = block_data(8, seed=21)
        assert blocks.put(keys, data, durable="sync").durability == "written"
    assert proc.stop() == 0
    reboot(proc)
    proc.start()
    with proc.client() as client:
        # no put since the restart: the reserve goes by what L3 holds (8 blocks of 64 KiB, 2 MiB of reserve)
        eventually(lambda: client.stats()["l2"]["block_free_slots"] >= 8, timeout=10)
        stats = client.stats()["l2"]
        assert stats["block_count"] == 0 and stats["block_prefaulted"] >= 8
        out = [torch.empty(NBYTES, dtype=torch.uint8) for _ in keys]
        assert blocks_of(client).get_into(keys, out) == 8
        assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))
        assert client.stats()["l2"]["block_fresh_slots"] == stats["block_fresh_slots"] == 0


def test_an_l3_hit_is_promoted_into_l2_on_the_second_hit(make_daemon: Any) -> None:
    proc = make_daemon().start()
    with proc.client() as client:
        keys = blocks_of(client).keys(list(range(4 * BLOCK)))
        blocks_of(client).put(keys, block_data(4, seed=2), durable="sync")
    proc.stop()
    reboot(proc)
    proc.start()
    with proc.client() as client:
        blocks = blocks_of(client)
        assert len(blocks.get(keys)) == 4
        assert client.stats()["l2"]["block_count"] == 0  # first hit: served from a one-off memfd
        assert len(blocks.get(keys)) == 4
        stats = client.stats()
        assert stats["l2"]["block_count"] == 4  # second hit within the window: promoted
        assert stats["ops"]["block_promotions"] == 4


def test_plain_durable_blocks_reach_l3_within_seconds_of_a_restart_after_kill_9(make_daemon: Any) -> None:
    proc = make_daemon().start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(32 * BLOCK)))
        put = blocks.put(keys, block_data(32, seed=3))
        # answered before its copy (docs/protocol.md, "Staging halves"): the next request on the
        # connection waits for the commit, whose records ask for the L3 copy: that survives kill -9
        assert put.stored == 32 and put.durability == "pending"
        assert blocks.contains(keys) == 32
    proc.kill9()
    proc.start()
    with proc.client() as client:
        eventually(lambda: client.stats()["l3"]["block_count"] == 32, timeout=20)
    proc.stop()
    reboot(proc)
    proc.start()
    with proc.client() as client:
        assert blocks_of(client).contains(keys) == 32


def test_kill_9_during_batch_puts_serves_no_torn_block_and_keeps_every_acknowledged_sync_block(
    make_daemon: Any,
) -> None:
    proc = make_daemon().start()
    expected: dict[bytes, torch.Tensor] = {}
    acknowledged: list[bytes] = []
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(8 * BLOCK)))
        data = block_data(8, seed=4)
        blocks.put(keys, data, durable="sync")
        acknowledged += keys
        expected.update(zip(keys, data, strict=True))
    stop = threading.Event()

    def writer() -> None:
        with proc.client() as client:
            blocks = blocks_of(client)
            for turn in range(1000):
                if stop.is_set():
                    return
                chain = blocks.keys(list(range(100_000 * (turn + 1), 100_000 * (turn + 1) + 16 * BLOCK)))
                chunk = block_data(16, seed=1000 + turn)
                expected.update(zip(chain, chunk, strict=True))
                try:
                    put = blocks.put(chain, chunk, durable="sync")
                except skippyd.SkippydError:
                    return
                if put.durability == "written":
                    acknowledged.extend(chain)

    thread = threading.Thread(target=writer)
    thread.start()
    eventually(lambda: len(acknowledged) > 8 + 32, timeout=30)
    proc.kill9()
    stop.set()
    thread.join(30)
    proc.start()  # tmpfs kept: L2 adopts what it holds, L3 reconciles its packs
    with proc.client() as client:
        blocks = blocks_of(client)
        held = [key for key in expected if blocks.contains([key]) == 1]
        assert set(acknowledged) <= set(held)
        for key in held:  # every block served has exactly the bytes that were put
            (got,) = blocks.get([key])
            assert torch.equal(got, expected[key])
    proc.stop()
    reboot(proc)
    proc.start()
    with proc.client() as client:
        blocks = blocks_of(client)
        assert all(blocks.contains([key]) == 1 for key in acknowledged)


def test_a_bit_flip_in_a_pack_is_a_miss_and_a_quarantine_never_wrong_bytes(make_daemon: Any) -> None:
    proc = make_daemon().start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=5)
        blocks.put(keys, data, durable="sync")
    proc.stop()
    reboot(proc)
    (pack,) = packs(proc)
    raw = bytearray(pack.read_bytes())
    raw[2 * NBYTES + 100] ^= 0x01  # inside the third block's bytes
    pack.write_bytes(raw)
    proc.start()
    with proc.client() as client:
        blocks = blocks_of(client)
        got = blocks.get(keys)
        assert len(got) <= 2
        assert all(torch.equal(a, b) for a, b in zip(got, data, strict=False))
        stats = client.stats()["l3"]
        assert stats["block_corrupt"] == 1
        assert blocks.contains(keys) == 0  # the pack is out of service
    quarantined = list((proc.state_dir / "l3" / "quarantine").iterdir())
    assert any(p.name.endswith(".why") for p in quarantined)
    assert "Traceback" not in proc.log_text()


def test_evicting_an_identitys_blocks_removes_them_from_both_tiers_for_good(make_daemon: Any) -> None:
    proc = make_daemon().start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(4 * BLOCK)))
        blocks.put(keys, block_data(4, seed=6), durable="sync")
        other = client.blocks(model="other-model", state=STATE, block_tokens=BLOCK)
        other.put(keys, block_data(4, seed=7), durable="sync")
        assert client.evict(model=MODEL, state=STATE, blocks=True) == 4
        assert blocks.contains(keys) == 0 and other.contains(keys) == 4
    proc.kill9()
    proc.start()
    with proc.client() as client:
        assert blocks_of(client).contains(keys) == 0
        assert client.blocks(model="other-model", state=STATE, block_tokens=BLOCK).contains(keys) == 4


def _item(identity: bytes, n: int) -> BlockItem:
    data = bytes([n % 256]) * (5000 + n)
    record = PackRecord(
        key=bytes([n]) * 32, space=bytes(32), identity=identity, block_tokens=BLOCK, parent=None,
        nbytes=len(data), digest=bytes(blake3(data).digest()),
    )  # fmt: skip
    return BlockItem(record, memoryview(data))


def test_a_pack_left_mostly_dead_is_compacted_and_its_live_blocks_kept(tmp_path: Path) -> None:
    a, b = b"a" * 32, b"b" * 32
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        items = [_item(a, n) for n in range(6)] + [_item(b, n) for n in range(6, 8)]
        assert store.blocks.write(items) == 8
        assert store.blocks.compaction_candidate() is None
        with store.lock:
            assert store.blocks.remove_identity(a) == 6
        candidate = store.blocks.compaction_candidate()
        assert candidate is not None and sorted(candidate) == sorted(i.record.key for i in items[6:])
        assert store.stats().block_dead_bytes > 0
        assert store.blocks.compact(candidate)
        stats = store.stats()
        assert (stats.block_count, stats.block_packs, stats.block_dead_bytes) == (2, 1, 0)
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:  # and a restart finds just the new pack
        assert store.stats().block_count == 2
        for item in items[6:]:
            view = memoryview(bytearray(item.record.nbytes))
            assert store.blocks.read_into([item.record.key], [view]) == 1
            assert bytes(view) == bytes(item.data)
        assert not store.blocks.holds(items[0].record.key)


def test_blocks_evicted_while_their_pack_is_compacted_stay_evicted_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction reads a pack's live blocks without the lock, then writes them as a new pack: an
    eviction in between (``evict`` of an identity) must not bring them back in the new pack."""
    from skippyd.l3.packs import L3Blocks

    a, b = b"a" * 32, b"b" * 32
    items = [_item(a, n) for n in range(6)] + [_item(b, n) for n in range(6, 8)]
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        assert store.blocks.write(items) == 8
        with store.lock:
            assert store.blocks.remove([i.record.key for i in items[:5]]) == 5
        candidate = store.blocks.compaction_candidate()
        assert candidate is not None and len(candidate) == 3
        read = L3Blocks.read_into

        def read_then_evict(self: L3Blocks, keys: Any, views: Any) -> int:
            count = read(self, keys, views)
            with store.lock:
                assert store.blocks.remove_identity(b) == 2  # (what evict does on a handler thread)
            return count

        monkeypatch.setattr(L3Blocks, "read_into", read_then_evict)
        assert store.blocks.compact(candidate)
        monkeypatch.setattr(L3Blocks, "read_into", read)
        assert [store.blocks.holds(i.record.key) for i in items[5:]] == [True, False, False]
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        assert [store.blocks.holds(i.record.key) for i in items[5:]] == [True, False, False]
        assert store.stats().block_count == 1


def test_a_new_packs_dead_marks_are_on_disk_before_the_pack_is_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block evicted while its pack was written is dead in the new pack: its mark is fsynced before
    the pack appears, so no crash between the two brings the block back."""
    items = [_item(b"a" * 32, n) for n in range(3)]
    evicted = items[1].record.key
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        real = os.rename
        seen: list[bytes] = []

        def renaming(src: Any, dst: Any) -> None:
            if str(dst).endswith(".pack"):
                dead = Path(str(dst)[: -len(".pack")] + ".dead")
                seen.append(dead.read_bytes() if dead.exists() else b"")
            real(src, dst)

        monkeypatch.setattr(os, "rename", renaming)
        assert store.blocks.write(items, wanted=lambda key: key != evicted) == 2
        monkeypatch.setattr(os, "rename", real)
        assert seen == [(1).to_bytes(4, "little")]
        assert [store.blocks.holds(i.record.key) for i in items] == [True, False, True]
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        assert [store.blocks.holds(i.record.key) for i in items] == [True, False, True]


def test_evicting_blocks_on_a_full_disk_is_no_space_and_keeps_what_it_could_not_record(
    mount_tmpfs: Any,
) -> None:
    """An eviction's dead marks cannot be appended on a full disk: the reply is ``no_space`` (never
    ``internal``) and the blocks stay held, in memory as on disk, instead of leaving the index until the
    next start brings them back; with room again the same eviction holds across a restart."""
    root = Path(mount_tmpfs("1m")) / "l3"
    a, b = b"a" * 32, b"b" * 32
    items = [_item(a, n) for n in range(3)] + [_item(b, n) for n in range(3, 6)]
    with L3Store.open(root, 1 << 30) as store:
        assert store.blocks.write(items) == 6  # one pack: a and b share it
        filler = root.parent / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * 4096)
        os.close(fd)
        with store.lock, pytest.raises(NoSpace):
            store.blocks.remove_identity(a)
        assert all(store.blocks.holds(i.record.key) for i in items)
        filler.unlink()
    with L3Store.open(root, 1 << 30) as store:
        assert all(store.blocks.holds(i.record.key) for i in items)
        with store.lock:
            assert store.blocks.remove_identity(a) == 3
    with L3Store.open(root, 1 << 30) as store:
        assert [store.blocks.holds(i.record.key) for i in items] == [False] * 3 + [True] * 3


def test_removed_blocks_stay_removed_after_a_restart_and_duplicates_resolve_to_the_newest(
    tmp_path: Path,
) -> None:
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        first = [_item(b"a" * 32, n) for n in range(3)]
        store.blocks.write(first)
        with store.lock:
            store.blocks.remove([first[1].record.key])
    with L3Store.open(tmp_path / "l3", 1 << 30) as store:
        assert [store.blocks.holds(i.record.key) for i in first] == [True, False, True]


def test_l3_fsck_verifies_every_block_and_quarantines_a_pack_with_a_flipped_bit(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = tmp_path / "l3"
    with L3Store.open(root, 1 << 30) as store:
        assert store.blocks.write([_item(b"a" * 32, n) for n in range(3)]) == 3

    def fsck() -> tuple[int, dict[str, Any]]:
        done = subprocess.run(
            [sys.executable, "-m", "skippyd", "l3", "fsck", "--l3-dir", str(root), "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.returncode, json.loads(done.stdout)

    code, doc = fsck()
    assert code == 0 and doc["clean"] and doc["blocks"] == 3 and doc["blocks_verified"] == 3
    (pack,) = sorted((root / "packs").glob("*.pack"))
    raw = bytearray(pack.read_bytes())
    raw[10] ^= 0x40  # inside the first block's bytes: the table still holds, only hashing finds it
    pack.write_bytes(raw)
    code, doc = fsck()
    assert code == 1 and doc["block_packs_quarantined"] == 1 and doc["blocks"] == 0
    code, doc = fsck()
    assert code == 0 and doc["blocks"] == 0


def test_an_eviction_stays_in_force_for_a_queued_write_however_many_evictions_follow(
    tmp_path: Path, shm_dir: Path
) -> None:
    from skippyd.blocks import BlockRules
    from skippyd.keys import bind_keys, block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        writer = BlockWriter(l2, l3, Health())  # not started: the queued job waits for us
        rules = BlockRules(l2, l3=l3, writer=writer)
        space = block_space(MODEL, STATE, "", BLOCK)
        data = memoryview(bytes(4096))
        assert rules.put(space, [b"k"], [4096], [0], data).durability == "queued"
        # an eviction that came while the put ran (its block was committed after the eviction swept L2)
        writer.forget(bytes.fromhex(space.identity.digest))
        for n in range(100):  # many evictions of other identities after it
            writer.forget(bytes([n]) * 32)
        job = writer._queue.get_nowait()
        assert job is not None
        writer._write([job])
        assert l2.blocks.held(bind_keys(space, [b"k"])) == 1  # still in L2: the write alone decided
        assert l3.stats().block_count == 0


def test_a_sync_block_write_whose_blocks_left_l2_before_it_ran_says_none_not_written(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A queued block job holds no lease: when L2 evicts its blocks before the writer reaches it, nothing
    can be written, and a sync put's waiter hears ``"none"`` (counted as lost), never ``"written"``."""
    from skippyd.blocks import BlockRules
    from skippyd.keys import bind_keys, block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        writer = BlockWriter(l2, l3, Health())  # not started until L2 has let the blocks go
        rules = BlockRules(l2, l3=l3, writer=writer)
        space = block_space(MODEL, STATE, "", BLOCK)
        raw = [b"k0", b"k1", b"k2"]
        data = memoryview(bytes(range(256)) * 48)
        answer: dict[str, str] = {}
        putter = threading.Thread(
            target=lambda: answer.setdefault(
                "durability",
                rules.put(space, raw, [4096] * 3, [0, 4096, 8192], data, durable="sync").durability,
            )
        )
        putter.start()
        eventually(lambda: writer._queue.qsize() == 1)
        with l2.lock:
            while l2.blocks.evict_oldest():
                pass
        assert l2.blocks.held(bind_keys(space, raw)) == 0
        writer.start()
        putter.join(30)
        assert answer == {"durability": "none"}
        assert l3.stats().block_count == 0
        assert writer.stats().block_writes_lost == 3
        writer.close()


def test_a_sync_put_whose_held_block_left_both_tiers_while_it_copied_says_none(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A block a put found held (present) and that L2 then evicted before the put ended is on no tier:
    the put's reply cannot say ``"written"`` about it."""
    from skippyd.blocks import BlockRules
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        writer = BlockWriter(l2, l3, Health())
        writer.start()
        rules = BlockRules(l2, l3=l3, writer=writer)
        space = block_space(MODEL, STATE, "", BLOCK)
        raw = bytes(range(256)) * 32
        assert rules.put(space, [b"k0"], [4096], [0], memoryview(raw), durable=False).stored == 1
        job = rules.begin_put(space, [b"k0"], [4096], [-1], memoryview(raw), durable="sync")
        assert (len(job.pending), job.present) == (0, 1)  # held: nothing to store, only to make durable
        with l2.lock:
            assert l2.blocks.evict_oldest()  # k0 leaves L2 before the put ends
        outcome = job.finish()
        assert (outcome.stored, outcome.present, outcome.durability) == (0, 1, "none")
        writer.close()


def test_a_put_split_in_parts_is_written_only_when_every_part_naming_blocks_is() -> None:
    from skippyd.client.blockspace import _sum_puts

    def part(durability: str, stored: int = 1, present: int = 0) -> dict[str, Any]:
        return {"stored": stored, "present": present, "nbytes": 4096 * stored, "durability": durability}

    assert _sum_puts([part("written"), part("written")]).durability == "written"
    assert _sum_puts([part("written"), part("none")]).durability == "none"
    assert _sum_puts([part("written"), part("none", stored=0)]).durability == "written"  # named nothing
    assert _sum_puts([part("queued"), part("none")]).durability == "queued"  # (second-put admission)
    assert _sum_puts([part("written"), part("deferred")]).durability == "deferred"
    assert _sum_puts([part("none", stored=0)]).durability == "none"


def test_with_second_put_admission_blocks_reach_l3_only_when_offered_again(make_daemon: Any) -> None:
    proc = make_daemon("--l3-block-admission", "second-put").start()
    with proc.client() as client:
        blocks = blocks_of(client)
        keys = blocks.keys(list(range(6 * BLOCK)))
        data = block_data(6, seed=11)
        first = blocks.put(keys[:4], data[:4])  # (answered before its commit decides about L3)
        assert (first.stored, first.durability) == (4, "pending")
        stats = client.stats()  # the connection's next request sees the commit
        assert stats["ops"]["block_admission_waits"] == 4 and stats["durable"]["block_jobs_queued"] == 0
        second = blocks.put(keys, data)  # the next turn: 4 offered again, 2 new
        assert (second.stored, second.present, second.durability) == (2, 4, "pending")
        eventually(lambda: client.stats()["l3"]["block_count"] == 4, timeout=20)
        stats = client.stats()["ops"]
        assert (stats["block_admissions"], stats["block_admission_waits"]) == (4, 6)
        assert blocks.put(keys[:1], data[:1]).durability == "none"  # already on disk: nothing to count
        synced = client.blocks(model=MODEL, state="other", block_tokens=BLOCK)
        assert synced.put(keys[:2], data[:2], durable="sync").durability == "written"  # sync always writes
    proc.stop()
    reboot(proc)
    proc.start()
    with proc.client() as client:
        assert blocks_of(client).contains(keys) == 4  # the two offered once did not outlive the tmpfs
        got = blocks_of(client).get(keys)
        assert all(torch.equal(a, b) for a, b in zip(got, data[:4], strict=True))


def test_second_put_admission_is_counted_across_daemons_sharing_redis(
    make_daemon: Any, redis_url: str
) -> None:
    shared = ("--l3-block-admission", "second-put", "--redis-url", redis_url, "--promotion-scope", "rack-7")
    one = make_daemon(*shared, "--node", "node-a").start()
    two = make_daemon(*shared, "--node", "node-b").start()
    data = block_data(3, seed=12)
    with one.client() as client:
        keys = blocks_of(client).keys(list(range(3 * BLOCK)))
        assert blocks_of(client).put(keys, data).durability == "pending"
        assert client.stats()["ops"]["block_admission_waits"] == 3  # offered once: L2 only
    with two.client() as client:  # another host offers the same blocks: their second put in the scope
        assert blocks_of(client).put(keys, data).durability == "pending"  # admitted behind the reply
        eventually(lambda: client.stats()["l3"]["block_count"] == 3, timeout=20)
    with one.client() as client:
        assert client.stats()["l3"]["block_count"] == 0


class _Declines:
    """A promotion policy that never promotes: L3 hits are read for the reply alone."""

    def consider(self, manifest_key: str, token_count: int, payload_bytes: int) -> bool:
        return False

    def settle(self, manifest_key: str) -> None:
        pass


def test_l3_block_reads_into_memfds_share_the_fill_budget_and_past_it_serve_a_shorter_run(
    tmp_path: Path, shm_dir: Path
) -> None:
    import os

    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.tiers import Tiers

    space = block_space(MODEL, STATE, "", BLOCK)
    keys = [b"a", b"b", b"c", b"d"]
    data = b"".join(bytes([i + 1]) * NBYTES for i in range(4))
    first = Tiers(L2Tier.open(shm_dir / "before", 16 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30))
    try:
        put = first.blocks.put(space, keys, [NBYTES] * 4, [i * NBYTES for i in range(4)], memoryview(data),
                               durable="sync")  # fmt: skip
        assert put.durability == "written"
    finally:
        first.close()
    # a reboot: a new L2, the same L3; no free pre-faulted slots, so an L3 hit is read into a memfd
    tiers = Tiers(
        L2Tier.open(shm_dir / "after", 16 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30),
        promotions=_Declines(), fill_budget=1 << 20,
    )  # fmt: skip
    assert tiers.fills is not None
    try:
        assert tiers.fills.charge(1 << 20)  # another L3 read holds the whole budget
        served = tiers.blocks.get(space, keys, max_fds=8)
        assert (served.held, served.lease.placements, served.lease.fds) == (4, [], [])
        assert tiers.blocks.stats().block_reads_refused == 1
        assert tiers.fills.stats().fills_refused == 1
        tiers.fills.refund(1 << 20)
        served = tiers.blocks.get(space, keys, max_fds=8)
        try:
            assert len(served.lease.placements) == 4
            for i, (fd_index, offset, nbytes) in enumerate(served.lease.placements):
                got = os.pread(served.lease.fds[fd_index], nbytes, offset)
                assert got == data[i * NBYTES : (i + 1) * NBYTES]
        finally:
            for fd in served.lease.fds:
                os.close(fd)
        assert tiers.fills.stats().fill_bytes == 0  # the read gave its share back
    finally:
        tiers.close()


def test_recovered_block_writes_larger_than_l3s_budget_go_as_packs_it_can_take_not_deferred_forever(
    tmp_path: Path, shm_dir: Path
) -> None:
    """After a restart, every block still asking for its L3 copy is queued again. Those of one identity
    went as one pack: 8 MiB of them against an 8 MiB L3 budget was TooLarge at every retry, for good (and
    each retry read them all out of L2 under its lock). Now they go as packs of at most an eighth of the
    budget, L3 keeps what fits, and nothing is left waiting."""
    from skippyd.blocks import BlockRules
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    count, size = 512, 16 << 10
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 8 << 20) as l3:
        first = BlockWriter(l2, l3, Health())  # never started: the daemon died before it wrote anything
        rules = BlockRules(l2, l3=l3, writer=first)
        space = block_space(MODEL, STATE, "", BLOCK)
        keys = [b"b%d" % i for i in range(count)]
        data = memoryview(bytes(count * size))
        put = rules.put(space, keys, [size] * count, [i * size for i in range(count)], data, durable=True)
        assert put.stored == count
        again = BlockWriter(l2, l3, Health())  # the next daemon's
        assert again.recover() == count
        again.start()
        try:

            def all_written() -> bool:  # (the backlog empties when the writer takes it, before it writes)
                with l2.lock:
                    return again.stats().block_backlog == 0 and not l2.blocks.durable_wanted()

            assert eventually(all_written, timeout=30), again.stats()
            stats = again.stats()
            assert stats.block_write_failures == 0 and stats.block_writes_deferred == 0, stats
            held = l3.stats().block_count
            assert 0 < held < count, held  # (what fits the budget; the oldest packs made room)
        finally:
            again.close()


def test_block_writes_l3_cannot_take_wait_without_being_read_out_of_l2_at_every_retry(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L3 read-only (its disk below the free-space floor): the backlog's blocks are deferred before any of
    them is read out of L2 (each such read is a lease and a view under the L2 lock: 100k blocks stalled
    every request by up to 290 ms at each retry)."""
    from l2util import Calls

    from skippyd.blocks import BlockRules
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.l2.blocks import L2Blocks
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    with (
        L2Tier.open(shm_dir, 64 << 20) as l2,
        L3Store.open(tmp_path / "l3", 1 << 30, min_free_bytes=1 << 60) as l3,
    ):
        assert l3.readonly
        writer = BlockWriter(l2, l3, Health())
        rules = BlockRules(l2, l3=l3, writer=writer)
        reads = Calls(monkeypatch, L2Blocks, "data_of")
        writer.start()
        try:
            space = block_space(MODEL, STATE, "", BLOCK)
            keys = [b"r%d" % i for i in range(64)]
            put = rules.put(
                space, keys, [4096] * 64, [i * 4096 for i in range(64)], memoryview(bytes(64 * 4096))
            )
            assert put.stored == 64
            assert eventually(lambda: writer.stats().block_writes_deferred >= 1, timeout=20)
            assert reads.count == 0 and l3.stats().block_count == 0
        finally:
            writer.close()


def test_l3_evicts_the_least_recently_used_pack_first_and_keeps_that_order_across_a_restart(
    tmp_path: Path,
) -> None:
    """Packs are kept in the order of their last use (a read moves one to the end), so a write that must
    make room evicts the least recently used pack in O(1), not by a scan of every pack per victim
    (11,500 packs stalled every request 1.7 s); the order a restart rebuilds is their files' mtimes."""
    from skippyd.l2.slabs import block_digest
    from skippyd.l3.packs import BlockItem, PackRecord

    def item(name: bytes) -> BlockItem:
        data = memoryview(name * (1 << 20))
        record = PackRecord(name * 32, b"s" * 32, b"i" * 32, 16, None, len(data), block_digest(data))
        return BlockItem(record, data)

    def holds(l3: L3Store, *names: bytes) -> list[bool]:
        return [l3.blocks.holds(name * 32) for name in names]

    directory = tmp_path / "l3"
    with L3Store.open(directory, 4 << 20) as l3:
        for name in (b"A", b"B", b"C"):
            assert l3.blocks.write([item(name)]) == 1
            time.sleep(0.05)  # (past the coarse clock of file times)
        l3.blocks.touch([b"A" * 32])  # A is now the most recently used
        time.sleep(0.05)
        l3.blocks.write([item(b"D")])  # room for D: the least recently used pack goes
        assert holds(l3, b"A", b"B", b"C", b"D") == [True, False, True, True]
        assert l3._trash.drain(10)  # (B's pack went aside under the lock, unlinked after it)
        assert len(list(l3.layout.packs.glob("*.pack"))) == 3 and not list(l3.layout.tmp.iterdir())
        time.sleep(0.05)  # (past the coarse clock of file times)
        l3.blocks.touch([b"C" * 32])
    with L3Store.open(directory, 4 << 20) as l3:  # (close wrote the recency to the packs' mtimes)
        l3.blocks.write([item(b"E")])
        assert holds(l3, b"A", b"C", b"D", b"E") == [False, True, True, True]


def test_the_block_writer_leases_runs_of_consecutive_slots_with_one_lock_each() -> None:
    from skippyd.packer import _runs

    assert _runs([5, 1, 2, 3, 7, 8, 8]) == [(1, 3), (5, 5), (7, 8)]
    assert _runs(list(range(4096))) == [(0, 4095)]
    assert _runs([]) == []


def test_a_sync_put_written_in_several_packs_is_written_even_where_a_later_pack_made_l3_evict_an_earlier(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A batch larger than a pack goes as several packs; with a small L3, writing a later one evicts an
    earlier one (LRU, for room). Every block still went into an fsynced pack: the sync put is "written",
    nothing counts as lost, and no block keeps asking for its L3 copy (a restart would write them all
    again, evicting whatever L3 then holds)."""
    from skippyd.blocks import BlockRules
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    count, size = 512, 16 << 10
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 8 << 20) as l3:
        writer = BlockWriter(l2, l3, Health())
        writer.start()
        try:
            rules = BlockRules(l2, l3=l3, writer=writer)
            space = block_space(MODEL, STATE, "", BLOCK)
            keys = [b"s%d" % i for i in range(count)]
            data = memoryview(bytes(count * size))
            put = rules.put(
                space, keys, [size] * count, [i * size for i in range(count)], data, durable="sync"
            )
            assert put.durability == "written"
            assert writer.stats().block_writes_lost == 0
            assert 0 < l3.stats().block_count < count  # (what the budget keeps)
            with l2.lock:
                assert l2.blocks.durable_wanted() == []
            assert BlockWriter(l2, l3, Health()).recover() == 0
        finally:
            writer.close()


def test_a_batch_whose_identity_is_evicted_after_its_pack_was_written_says_none_evictions_win(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Two puts' jobs written in one batch as two packs; the first one's identity is evicted after its pack
    was fsynced, while the second is written. Neither tier holds its blocks: its outcome is "none" (and
    they count as lost), as for a job evicted before its write: evictions win."""
    from skippyd.blocks import BlockRules
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    count, size = 64, 16 << 10  # 1 MiB a job: a pack each
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 64 << 20) as l3:
        writer = BlockWriter(l2, l3, Health(), batch_bytes=1 << 20)  # not started: its batch is run here
        rules = BlockRules(l2, l3=l3, writer=writer)
        a, b = block_space(MODEL, STATE, "a", BLOCK), block_space(MODEL, STATE, "b", BLOCK)
        for space, prefix in ((a, b"a"), (b, b"b")):
            keys = [prefix + b"%d" % i for i in range(count)]
            data = memoryview(bytes(count * size))
            assert (
                rules.put(space, keys, [size] * count, [i * size for i in range(count)], data).stored == count
            )
        jobs = []
        while not writer._queue.empty():
            job = writer._queue.get_nowait()
            assert job is not None
            jobs.append(job)
        real = l3.blocks.write
        packs: list[int] = []

        def write(items: Any, **options: Any) -> int:
            packs.append(len(items))
            if len(packs) == 2:  # a's pack is fsynced; a is evicted while b's is written
                assert rules.evict_identity(a.identity.digest) == count
            return real(items, **options)

        l3.blocks.write = write  # type: ignore[method-assign]
        writer._write(jobs)
        assert len(packs) == 2
        assert [job.outcome for job in jobs] == ["none", "written"]
        assert writer.stats().block_writes_lost == count


def test_blocks_evicted_while_an_l3_hit_promotes_them_into_l2_stay_evicted(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get promoting a run from L3 reads it outside the lock; an eviction of the identity answered in
    the meantime (it found nothing in L2, and took the blocks out of L3) must not see the promotion's
    commit bring them back."""
    from skippyd.blocks import BlockRules
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        writer = BlockWriter(l2, l3, Health())
        writer.start()
        rules = BlockRules(l2, l3=l3, writer=writer)  # (no promotion policy: every L3 hit is promoted)
        space = block_space(MODEL, STATE, "", BLOCK)
        keys = [b"k%d" % i for i in range(4)]
        raw = bytes(range(256)) * 64
        put = rules.put(space, keys, [4096] * 4, [0, 4096, 8192, 12288], memoryview(raw), durable="sync")
        assert put.durability == "written"
        with l2.lock:  # as after a reboot: only L3 holds them
            assert l2.blocks.remove(l2.blocks.keys_of(None)) == 4
        evicted: list[int] = []
        real = l3.blocks.read_into

        def read_then_evict(wanted: Any, views: Any) -> int:
            done = real(wanted, views)
            evicted.append(rules.evict_identity(space.identity.digest))  # answered before the commit
            return int(done)

        monkeypatch.setattr(l3.blocks, "read_into", read_then_evict)
        served = rules.get(space, keys, max_fds=8)
        for fd in served.lease.fds:
            os.close(fd)
        assert evicted == [4]
        assert rules.contains(space, keys) == 0, "an eviction that answered 4 removed keeps them out"
        with l2.lock:
            assert not l2.blocks.keys_of(None), "nothing of the promotion was committed"
        assert rules.put(space, keys, [4096] * 4, [0, 4096, 8192, 12288], memoryview(raw)).stored == 4
        with l2.lock:
            assert not rules._evict_marks, "the marks go once no put or promotion could read them"
        writer.close()


def _rules_over_l3(l2: Any, l3: Any) -> tuple[Any, Any]:
    from skippyd.blocks import BlockRules
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    writer = BlockWriter(l2, l3, Health())
    writer.start()
    return BlockRules(l2, l3=l3, writer=writer), writer  # (no promotion policy: every L3 hit promotes)


def _eviction_paused_midway(rules: Any, space: Any) -> tuple[threading.Event, threading.Thread, list[int]]:
    """An eviction of ``space``'s identity on a thread, paused once it has marked and emptied L2 (its L3
    removal comes next) until the event returned is set; its answer lands in the list returned."""
    midway, go_on = threading.Event(), threading.Event()
    real = rules._remove_from_l2

    def then_wait(identity: Any) -> int:
        removed = int(real(identity))
        midway.set()
        assert go_on.wait(10)
        return removed

    rules._remove_from_l2 = then_wait
    answer: list[int] = []
    thread = threading.Thread(target=lambda: answer.append(rules.evict_identity(space.identity.digest)))
    thread.start()
    assert midway.wait(10)
    return go_on, thread, answer


def test_a_promotion_that_begins_while_an_eviction_is_removing_the_blocks_does_not_commit(
    tmp_path: Path, shm_dir: Path
) -> None:
    """An eviction marks, empties L2 in steps, then L3: a get between the mark and L3's removal still
    finds the blocks in L3 and its epoch is the mark's, so the mark alone does not cancel it; the
    eviction in progress does."""
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier

    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        rules, writer = _rules_over_l3(l2, l3)
        space = block_space(MODEL, STATE, "", BLOCK)
        keys = [b"k%d" % i for i in range(4)]
        raw = bytes(range(256)) * 64
        assert rules.put(space, keys, [4096] * 4, [0, 4096, 8192, 12288], memoryview(raw), durable="sync")
        with l2.lock:  # only L3 holds them (as after a restart)
            l2.blocks.remove(l2.blocks.keys_of(None))
        go_on, evicting, answer = _eviction_paused_midway(rules, space)
        served = rules.get(space, keys, max_fds=8)  # an L3 hit: promoted into L2, were it not cancelled
        for fd in served.lease.fds:
            os.close(fd)
        go_on.set()
        evicting.join(10)
        assert answer == [4] and rules.contains(space, keys) == 0
        with l2.lock:
            assert not l2.blocks.keys_of(None)
        writer.close()


def test_an_eviction_mark_stays_for_a_put_still_allocating_whatever_ends_meanwhile(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A put reads the epoch when it reserves, allocates its pages outside the lock, and counts its keys
    reserved after: a promotion (or another put) ending meanwhile must not drop the mark of an eviction
    that came in between, or the put commits an identity the eviction answered gone."""
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier

    raw = bytes(range(256)) * 64
    sizes, offsets = [4096] * 4, [0, 4096, 8192, 12288]
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        rules, writer = _rules_over_l3(l2, l3)
        x, y = block_space("model-x", "s", "", BLOCK), block_space("model-y", "s", "", BLOCK)
        ykeys, xkeys = [b"y%d" % i for i in range(4)], [b"x%d" % i for i in range(4)]
        assert rules.put(y, ykeys, sizes, offsets, memoryview(raw), durable="sync").durability == "written"
        with l2.lock:  # y only in L3: its next get promotes
            l2.blocks.remove(l2.blocks.keys_of(None))
        in_alloc, go_on = threading.Event(), threading.Event()
        real = rules._allocate

        def held_allocation(pending: Any) -> Any:
            if threading.current_thread().name == "put-x":
                in_alloc.set()
                assert go_on.wait(10)
            return real(pending)

        rules._allocate = held_allocation
        result: list[Any] = []
        put = threading.Thread(
            target=lambda: result.append(rules.put(x, xkeys, sizes, offsets, memoryview(raw))), name="put-x"
        )
        put.start()
        assert in_alloc.wait(10)  # x's put reserved its slots and is giving them pages
        assert rules.evict_identity(x.identity.digest) == 0
        served = rules.get(y, ykeys, max_fds=8)  # y's promotion begins and ends meanwhile
        for fd in served.lease.fds:
            os.close(fd)
        go_on.set()
        put.join(10)
        assert result[0].stored == 0 and rules.contains(x, xkeys) == 0, "the put begun before it is cancelled"
        assert not rules._evict_marks and not rules._epochs, "the marks go once nothing in flight needs them"
        writer.close()


def test_puts_and_promotions_that_overlap_an_eviction_of_their_identity_never_commit(
    tmp_path: Path, shm_dir: Path
) -> None:
    """What began while an eviction of the identity ran does not commit, whenever it ends: a promotion
    read blocks the eviction was removing (ending after it, it put them back), and a sync put committed
    beside it stayed in L2 while the eviction's L3 removal took its copy ("written", lost at a restart).
    An eviction marks again as it ends."""
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier

    raw = bytes(range(256)) * 64
    sizes, offsets = [4096] * 4, [0, 4096, 8192, 12288]
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        rules, writer = _rules_over_l3(l2, l3)
        space = block_space(MODEL, STATE, "", BLOCK)
        old, new = [b"o%d" % i for i in range(4)], [b"n%d" % i for i in range(4)]
        assert rules.put(space, old, sizes, offsets, memoryview(raw), durable="sync").durability == "written"
        with l2.lock:  # only L3 holds them: a get promotes
            l2.blocks.remove(l2.blocks.keys_of(None))
        go_on, evicting, _ = _eviction_paused_midway(rules, space)
        put = rules.put(space, new, sizes, offsets, memoryview(raw), durable="sync")  # begun and ended within
        assert put.stored == 0 and put.durability == "none"
        real_read = l3.blocks.read_into

        def read_then_let_the_eviction_end(wanted: Any, views: Any) -> int:
            done = int(real_read(wanted, views))  # read while L3 still has them
            go_on.set()
            evicting.join(10)  # the eviction ends before this promotion commits
            return done

        l3.blocks.read_into = read_then_let_the_eviction_end  # type: ignore[method-assign, assignment]
        served = rules.get(space, old, max_fds=8)
        for fd in served.lease.fds:
            os.close(fd)
        evicting.join(10)
        assert rules.contains(space, old) == 0 and rules.contains(space, new) == 0
        with l2.lock:
            assert not l2.blocks.keys_of(None)
        assert l3.stats().block_count == 0
        assert not rules._epochs and not rules._evict_marks
        writer.close()


def test_a_promotion_whose_reservation_fails_gives_its_slots_and_epoch_back(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error reserving a promotion's slots (say EMFILE making a slab) left its epoch in flight for
    good (eviction marks never pruned again) and its slots reserved."""
    from skippyd.keys import block_space
    from skippyd.l2 import L2Tier

    raw = bytes(range(256)) * 64
    with L2Tier.open(shm_dir, 64 << 20) as l2, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        rules, writer = _rules_over_l3(l2, l3)
        space = block_space(MODEL, STATE, "", BLOCK)
        keys = [b"k%d" % i for i in range(4)]
        rules.put(space, keys, [4096] * 4, [0, 4096, 8192, 12288], memoryview(raw), durable="sync")
        with l2.lock:
            l2.blocks.remove(l2.blocks.keys_of(None))
        real = l2.blocks.reserve
        calls: list[int] = []

        def second_fails(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise OSError(24, "Too many open files")
            return real(*args, **kwargs)

        monkeypatch.setattr(l2.blocks, "reserve", second_fails)
        with pytest.raises(OSError):
            rules.get(space, keys, max_fds=8)
        assert not rules._epochs and l2.blocks.pending_bytes == 0
        monkeypatch.setattr(l2.blocks, "reserve", real)
        served = rules.get(space, keys, max_fds=8)
        assert len(served.lease.placements) == 4
        for fd in served.lease.fds:
            os.close(fd)
        writer.close()
