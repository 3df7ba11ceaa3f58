"""A put's fresh slots get their pages outside the tier's lock, several slabs at once on the copy threads;
a tmpfs that fills part way through a put keeps the blocks before the first slot that got no pages and
gives every later slot back (a hole again where it has no pages: never a free slot a later put would write
into and die of SIGBUS)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from skippyd.blocks import BlockRules
from skippyd.errors import NoSpace
from skippyd.keys import block_space
from skippyd.l2 import L2Tier
from skippyd.l2.slabs import Slab

MODEL, STATE = "allocation-model@sha256:0", "paged-kv-v1"
BLOCK_BYTES = 256 << 10


def test_a_put_gives_its_fresh_slots_their_pages_without_holding_the_tiers_lock(
    shm_dir: Path, monkeypatch: Any
) -> None:
    with L2Tier.open(shm_dir, 64 << 20) as tier:  # slabs of 4 MiB: 40 blocks of 256 KiB span three
        rules = BlockRules(tier, copy_threads=2)
        space = block_space(MODEL, STATE, "", 16)
        allocating, go = threading.Event(), threading.Event()
        real = Slab.allocate

        def held(self: Slab, index: int, count: int = 1, *, populate: bool = True) -> None:
            allocating.set()
            assert go.wait(30)
            real(self, index, count, populate=populate)

        monkeypatch.setattr(Slab, "allocate", held)
        keys = [b"k%d" % i for i in range(40)]
        raw = bytes(torch.randint(0, 256, (40 * BLOCK_BYTES,), dtype=torch.uint8).numpy())
        done: list[int] = []
        offsets = [i * BLOCK_BYTES for i in range(40)]

        def put() -> None:
            sizes = [BLOCK_BYTES] * 40
            stored = rules.put(space, keys, sizes, offsets, memoryview(raw), durable=False).stored
            done.append(stored)

        putting = threading.Thread(target=put)
        putting.start()
        try:
            assert allocating.wait(10)
            # the pages are being given while another caller takes the lock (before: the whole put's
            # faults happened under it, and every get, contains and put of the daemon waited)
            assert tier.lock.acquire(timeout=2), "the tier's lock is held while slots get their pages"
            tier.lock.release()
        finally:
            go.set()
            putting.join(30)
        assert done == [40]
        assert rules.contains(space, keys) == 40
        assert tier.stats().block_slabs == 3  # (the slabs got their pages on two threads at once)


def test_a_put_is_never_promised_a_child_of_a_block_another_put_then_cannot_store(
    shm_dir: Path, monkeypatch: Any
) -> None:
    """Put A's slots get their pages outside the lock; put B, whose parent is A's last block, asks
    meanwhile. If the tmpfs then fails A, B's reply must not have counted B's blocks as stored (its
    children of a block that never came): A's keys count as reserved only once their slots have pages."""
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        rules = BlockRules(tier, copy_threads=1)
        space = block_space(MODEL, STATE, "", 16)
        allocating, go = threading.Event(), threading.Event()
        real = Slab.allocate

        def full_for_a(self: Slab, index: int, count: int = 1, *, populate: bool = True) -> None:
            if threading.current_thread().name == "put-a":
                allocating.set()
                assert go.wait(30)
                raise NoSpace("the tmpfs is full (as if another process took the rest)")
            real(self, index, count, populate=populate)

        monkeypatch.setattr(Slab, "allocate", full_for_a)
        a_keys, b_keys = [b"a%d" % i for i in range(4)], [b"b%d" % i for i in range(4)]
        raw, sizes, offsets = (
            memoryview(bytes(4 * BLOCK_BYTES)),
            [BLOCK_BYTES] * 4,
            [i * BLOCK_BYTES for i in range(4)],
        )
        failed: list[BaseException] = []

        def put_a() -> None:
            try:
                rules.put(space, a_keys, sizes, offsets, raw, durable=False)
            except NoSpace as exc:
                failed.append(exc)

        putting = threading.Thread(target=put_a, name="put-a")
        putting.start()
        try:
            assert allocating.wait(10)
            job = rules.begin_put(space, b_keys, sizes, offsets, raw, parent=a_keys[-1], durable=False)
        finally:
            go.set()
            putting.join(30)
        promised = job.promised()
        outcome = job.finish()
        assert len(failed) == 1, "A found the tmpfs full and stored nothing"
        assert promised.stored == outcome.stored == 0 and promised.skipped == 4, (promised, outcome)
        assert rules.contains(space, a_keys) == 0


def test_a_tmpfs_full_part_way_through_a_put_keeps_the_leading_blocks_and_no_slot_without_pages_is_reused(
    make_daemon: Any, mount_tmpfs: Any
) -> None:
    fs = Path(mount_tmpfs("4m"))
    (fs / "l2").mkdir(mode=0o700)
    proc = make_daemon(
        "--shm-dir", str(fs / "l2"), "--l3-dir", "off", "--l2-reserve", "0", "--copy-threads", "4",
        budget="64MiB",
    ).start()  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen) for _ in range(40)]
    with proc.client(timeout=30.0) as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=16)
        keys = [b"a%d" % i for i in range(40)]
        first = blocks.put(keys, data)  # 10 MiB into 4: the tmpfs fills in the second or third slab
        assert 0 < first.stored < 40, first
        assert blocks.contains(keys) == first.stored
        out = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(40)]
        assert blocks.get_into(keys, out) == first.stored
        assert all(torch.equal(out[i], data[i]) for i in range(first.stored))
        # every free slot has its pages: what the tmpfs holds covers the stored blocks and the free slots
        l2 = client.stats()["l2"]
        used = _used(fs)
        assert used >= (first.stored + l2["block_free_slots"]) * BLOCK_BYTES, (used, l2)
        # a second put takes the free slots first; had a slot without pages been freed, its copy would
        # write into a page the full tmpfs cannot give (SIGBUS: the daemon dies)
        others = [b"b%d" % i for i in range(24)]
        try:
            second = blocks.put(others, data[:24]).stored
        except NoSpace:
            second = 0
        assert client.ping()
        assert blocks.contains(others) == second
        got = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(24)]
        assert blocks.get_into(others, got) == second
        assert all(torch.equal(got[i], data[i]) for i in range(second))
        assert all(t["alive"] for t in client.stats()["threads"].values())
    with proc.client(timeout=30.0) as client:
        # the blocks go (their slots free for the next put, which stores whole again)
        client.evict(model=MODEL, state=STATE, blocks=True)
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=16)
        again = blocks.put(keys[:8], data[:8])
        assert again.stored == 8
        assert blocks.get_into(keys[:8], out[:8]) == 8
        assert all(torch.equal(out[i], data[i]) for i in range(8))


def _used(fs: Path) -> int:
    st = os.statvfs(fs)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
