"""The reserve is a quiet neighbour: it keeps ready what the last seconds of puts and captures took, never
more than its cap, gives the rest back once demand stops, and faults pages in no faster than its rate.

In-process, over a real tmpfs tier and real puts (:class:`BlockRules`); the reserve's jobs are run here
one by one (what its thread does on each wake-up), so every step can be checked."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemonutil import eventually
from l2util import Calls, admit_bytes, size_of

from skippyd.blocks import BlockRules
from skippyd.errors import NoSpace
from skippyd.keys import block_space
from skippyd.l2 import L2Tier
from skippyd.l2.blocks import Prefault
from skippyd.l2.reserve import Reserve
from skippyd.workers import Health

MODEL, STATE = "reserve-model@sha256:1", "paged-kv-v1"
SLOT = 64 << 10  # the blocks here are 64 KiB: one slot each
KB = 1024


def put(rules: BlockRules, keys: list[bytes], *, model: str = MODEL) -> None:
    space = block_space(model, STATE, "", 16)
    raw = bytes(len(keys) * SLOT)
    offsets = [i * SLOT for i in range(len(keys))]
    assert rules.put(space, keys, [SLOT] * len(keys), offsets, memoryview(raw), durable=False).stored == len(
        keys
    )


def ready(tier: L2Tier) -> int:
    """Free pre-faulted memory the tier keeps: free block slots and free entry files."""
    stats = tier.stats()
    return stats.block_free_slots * SLOT + stats.free_bytes


def settle(reserve: Reserve, *, limit: int | None = None, jobs: int = 500) -> None:
    """Runs the reserve's jobs as its thread would (waiting out what each asks) until one has nothing
    left to do; with ``limit``, checks after every job that the memory kept ready stays within it."""
    for _ in range(jobs):
        again = reserve.job()
        if limit is not None:
            assert ready(reserve.tier) <= limit
        if again is None:
            return
        time.sleep(again)
    raise AssertionError("the reserve never settled")


def test_the_reserve_keeps_ready_what_the_last_puts_took_and_never_more_than_its_cap(shm_dir: Path) -> None:
    cap = 16 * SLOT
    with L2Tier.open(shm_dir, 256 * SLOT) as tier:
        rules = BlockRules(tier)
        reserve = Reserve(tier, cap, Health(), window=60.0)  # (no demand ages out during the test)
        put(rules, [b"a%d" % i for i in range(4)])
        settle(reserve, limit=cap)
        assert tier.stats().block_free_slots == 4, "four slots taken lately: four kept ready"
        put(rules, [b"b%d" % i for i in range(4)])  # (took the four ready ones: demand is 8 now)
        assert tier.stats().block_fresh_slots == 4
        settle(reserve, limit=cap)
        assert tier.stats().block_free_slots == 8
        put(rules, [b"c%d" % i for i in range(40)])  # demand far beyond the cap: the cap holds
        settle(reserve, limit=cap)
        assert ready(tier) == cap
        put(rules, [b"d%d" % i for i in range(8)], model="another-model")  # a second group shares the cap
        settle(reserve, limit=cap)
        assert ready(tier) <= cap and tier.stats().block_free_slots >= 14
        # removals free 56 more slots: what is beyond the cap is given back
        removed = sum(
            rules.evict_identity(block_space(m, STATE, "", 16).identity.digest)
            for m in (MODEL, "another-model")
        )
        assert removed == 56 and ready(tier) > cap
        settle(reserve, limit=None)
        assert ready(tier) <= cap
        assert tier.stats().reserve_given_back >= 56 * SLOT - cap


def test_the_reserve_decays_to_nothing_a_window_after_demand_stops(shm_dir: Path) -> None:
    cap = 64 * SLOT
    with L2Tier.open(shm_dir, 256 * SLOT) as tier:
        rules = BlockRules(tier)
        reserve = Reserve(tier, cap, Health(), window=1.0)
        admit_bytes(tier, "entry", 60 * KB)  # an entry size class in demand too
        put(rules, [b"a%d" % i for i in range(8)])
        settle(reserve, limit=cap)
        kept = ready(tier)
        assert tier.stats().block_free_slots == 8 and tier.stats().free_files == 1
        assert kept == 8 * SLOT + size_of(60 * KB)
        time.sleep(1.3)  # no put, no capture for longer than the window
        settle(reserve)
        stats = tier.stats()
        assert (stats.block_free_slots, stats.free_files, ready(tier)) == (0, 0, 0)
        assert stats.reserve_given_back == kept
        assert stats.block_count == 8 and stats.entries == 1, "only free memory is given back"


def test_the_reserve_faults_no_faster_than_its_rate(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill of 32 slots (2 MiB) at 8 MiB/s takes 31 slots' worth of time less the pacer's 20 ms burst
    (≈ 222 ms), and no span of it ran ahead of the rate by more than the burst; unpaced, the same fill
    takes a few milliseconds."""
    began: list[float] = []
    real_fault = Prefault.fault

    def timed_fault(self: Prefault) -> None:
        began.append(time.monotonic())
        real_fault(self)

    monkeypatch.setattr(Prefault, "fault", timed_fault)
    rate, burst = 8 << 20, 0.02
    with L2Tier.open(shm_dir, 256 * SLOT) as tier:
        rules = BlockRules(tier)
        put(rules, [b"a%d" % i for i in range(32)])
        time.sleep(0.01)
        reserve = Reserve(tier, 64 * SLOT, Health(), rate=rate)
        assert reserve.pacer.burst == burst
        settle(reserve)
        assert len(began) == 32
        spent = began[-1] - began[0]
        assert spent >= 31 * SLOT / rate - burst - 0.002, (
            f"32 slots faulted in {spent * 1e3:.1f} ms: faster than the rate"
        )
        for i, j in itertools.combinations(range(32), 2):  # every span: within the rate and one burst
            assert (j - i) * SLOT <= rate * (began[j] - began[i] + burst) + SLOT, (i, j)
        # the same fill unpaced, for scale
        began.clear()
        put(rules, [b"b%d" % i for i in range(32)])
        time.sleep(0.01)
        settle(Reserve(tier, 64 * SLOT, Health(), rate=0))
        assert began and began[-1] - began[0] < spent / 2


def test_the_reserve_takes_no_more_than_its_share_of_the_time_and_backs_off_when_faults_slow(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a share of 0.25 the reserve rests three times what each fault took: with faults slowed to 10 ms
    (a loaded machine), 8 slots take at least 7 × 40 ms less the 20 ms burst, where they would take 80 ms;
    no rate cap is involved."""
    began: list[float] = []
    real_fault = Prefault.fault

    def slow_fault(self: Prefault) -> None:
        began.append(time.monotonic())
        time.sleep(0.01)
        real_fault(self)

    monkeypatch.setattr(Prefault, "fault", slow_fault)
    with L2Tier.open(shm_dir, 256 * SLOT) as tier:
        put(BlockRules(tier), [b"a%d" % i for i in range(8)])
        time.sleep(0.01)
        settle(Reserve(tier, 64 * SLOT, Health(), share=0.25))
        assert len(began) == 8
        assert began[-1] - began[0] >= 7 * 0.04 - 0.02
        busy = 8 * 0.01
        assert busy / (began[-1] - began[0] + 0.01) <= 0.25 * 1.2  # (the share, over the whole fill)


def test_the_reserve_waits_out_a_puts_quiet_window_exactly_not_a_poll(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a put ends the reserve finds the quiet window still open: its job asks to run again
    exactly when the window closes, not after its interval (the window is 2 ms; 200 ms here, so that
    a busy machine cannot close it before the job looks)."""
    monkeypatch.setattr("skippyd.l2.blocks._QUIET_S", 0.2)
    with L2Tier.open(shm_dir, 256 * SLOT) as tier:
        rules = BlockRules(tier)
        reserve = Reserve(tier, 64 * SLOT, Health())
        put(rules, [b"a"])
        again = reserve.job()
        assert again is not None and 0 < again <= 0.2
        assert tier.stats().block_free_slots == 0, "nothing faulted inside the window"
        time.sleep(again)
        assert reserve.job() is None and tier.stats().block_free_slots == 1
        with tier.lock:
            tier.blocks.fill_begun()  # a put fills slots: wait for its end, which wakes the thread
        assert reserve.job() is None
        with tier.lock:
            tier.blocks.fill_ended()
        again = reserve.job()
        assert again is not None and 0 < again <= 0.2  # a new window, from this put's end


def test_a_put_in_a_full_tier_waits_for_a_slot_the_reserve_is_faulting_in_instead_of_no_space(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    with L2Tier.open(shm_dir, 2 << 20) as tier:
        rules = BlockRules(tier)
        space = block_space(MODEL, STATE, "", 16)
        raw = bytes(64 * SLOT)
        probe = rules.put(space, [b"p%d" % i for i in range(64)], [SLOT] * 64, [i * SLOT for i in range(64)],
                          memoryview(raw), durable=False)  # fmt: skip
        fits = probe.stored  # every slot the budget holds (the rest found no room)
        assert 0 < fits < 64
        rules.clear()  # every slot given back (and the group with its last slab)
        with tier.lock:
            tier.blocks.expect(bytes.fromhex(space.digest), SLOT)  # the reserve stocks the group again
        time.sleep(0.01)  # the put's quiet window
        go = threading.Event()
        real = Prefault.fault

        def slow_fault(self: Prefault) -> None:
            assert go.wait(30)
            real(self)

        monkeypatch.setattr(Prefault, "fault", slow_fault)
        faulting = threading.Thread(target=tier.prefault_step, args=(1 << 30,))
        faulting.start()
        deadline = time.monotonic() + 10
        while tier._faults_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert tier._faults_in_flight == 1  # one slot charged, neither free nor evictable
        outcome: list[int] = []
        keys = [b"q%d" % i for i in range(fits)]
        offsets = [i * SLOT for i in range(fits)]
        putting = threading.Thread(
            target=lambda: outcome.append(
                rules.put(space, keys, [SLOT] * fits, offsets, memoryview(raw), durable=False).stored
            )
        )
        putting.start()
        putting.join(0.3)
        assert putting.is_alive(), "the put waits for the fault (without it: no_space for the last block)"
        go.set()
        faulting.join(10)
        putting.join(10)
        assert outcome == [fits]


def _fill_to_the_brim(rules: BlockRules) -> int:
    """How many blocks the tier holds at most (a probe put, then everything given back)."""
    probe = rules.put(*_blocks(b"p", 64), durable=False)
    assert 0 < probe.stored < 64
    rules.clear()
    return probe.stored


def _blocks(prefix: bytes, count: int) -> tuple[Any, list[bytes], list[int], list[int], memoryview]:
    """A put's arguments: ``count`` blocks of one slot each, keys ``prefix`` + index."""
    keys = [prefix + b"%d" % i for i in range(count)]
    return (
        block_space(MODEL, STATE, "", 16),
        keys,
        [SLOT] * count,
        [i * SLOT for i in range(count)],
        memoryview(bytes(count * SLOT)),
    )


def test_a_put_in_a_tier_full_of_another_puts_reserved_slots_waits_for_its_commit_instead_of_no_space(
    shm_dir: Path,
) -> None:
    """A put answered before its copy holds its slots charged, neither free nor evictable, until it
    commits: the next put (a tier of two puts' worth or less) waits for that commit, then evicts."""
    with L2Tier.open(shm_dir, 2 << 20) as tier:
        rules = BlockRules(tier)
        fits = _fill_to_the_brim(rules)
        first = rules.begin_put(*_blocks(b"a", fits), durable=False)
        assert first.promised().stored == fits  # every slot of the tier reserved, copy still to come
        outcome: list[int] = []
        second = threading.Thread(
            target=lambda: outcome.append(rules.put(*_blocks(b"b", fits), durable=False).stored)
        )
        second.start()
        second.join(0.3)
        assert second.is_alive(), "the second put waits (without it: no_space at once)"
        assert first.finish().stored == fits
        second.join(10)
        assert outcome == [fits]  # the first put's blocks, committed, were evicted for it
        space, keys, *_ = _blocks(b"b", fits)
        assert rules.contains(space, keys) == fits


def test_two_puts_that_each_wait_for_room_never_wait_on_each_other(shm_dir: Path) -> None:
    """Two puts of more than the tier holds, both waiting for other puts' reserved slots, which come back
    in two steps and are split between them: once nothing but each other's slots is left, neither sits
    out the wait for the other (a fill waits only while some fill that is not waiting itself may free
    room): both are answered within moments, each with what it got."""
    with L2Tier.open(shm_dir, 2 << 20) as tier:
        rules = BlockRules(tier)
        fits = _fill_to_the_brim(rules)
        quarter = max(1, fits // 4)
        first = rules.begin_put(*_blocks(b"h", quarter), durable=False)
        second = rules.begin_put(*_blocks(b"i", quarter), durable=False)
        ended: list[float] = []

        def put(prefix: bytes) -> None:
            with contextlib.suppress(NoSpace):  # an answer too: what is timed is that it comes
                rules.put(*_blocks(prefix, fits + 1), durable=False)
            ended.append(time.monotonic())

        threads = [threading.Thread(target=put, args=(b"x",)), threading.Thread(target=put, args=(b"y",))]
        threads[0].start()
        assert eventually(lambda: tier._fills_waiting == 1)  # x took the rest of the tier and waits
        threads[1].start()
        assert eventually(lambda: tier._fills_waiting == 2)  # y took nothing and waits
        first.abandon()  # x takes these and waits again
        time.sleep(0.2)
        second.abandon()  # y takes these: both hold slots, both want more, only each other's are left
        gone = time.monotonic()
        for thread in threads:
            thread.join(10)
        assert len(ended) == 2 and max(ended) - gone < 2.0, "a put sat out the wait for the other"
        with tier.lock:
            assert tier.blocks.pending_bytes == 0 and tier._fills_waiting == 0


def test_a_commit_that_fails_midway_gives_back_the_slots_it_did_not_reach(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose commit raises after some blocks leaves none of the rest reserved: the tier can be
    filled to the brim again afterwards."""
    with L2Tier.open(shm_dir, 2 << 20) as tier:
        rules = BlockRules(tier)
        fits = _fill_to_the_brim(rules)
        real = type(tier.blocks).commit
        calls = [0]

        def failing(self: Any, pending: Any, digest: bytes | None, *, durable: bool) -> bool:
            calls[0] += 1
            if calls[0] == 2:
                raise OSError("injected")
            return real(self, pending, digest, durable=durable)

        monkeypatch.setattr(type(tier.blocks), "commit", failing)
        with pytest.raises(OSError, match="injected"):
            rules.put(*_blocks(b"f", 4), durable=False)
        monkeypatch.setattr(type(tier.blocks), "commit", real)
        space, keys, *_ = _blocks(b"f", 4)
        assert rules.contains(space, keys) == 1  # the first committed; the rest never will
        # the failing block and the two after it went back: the whole tier takes a put again (the one
        # committed block evicted for it)
        assert rules.put(*_blocks(b"g", fits), durable=False).stored == fits
        with tier.lock:
            assert tier.blocks.pending_bytes == 0


def test_a_put_waiting_for_room_goes_on_once_the_other_puts_blocks_commit_not_when_its_l3_work_ends(
    shm_dir: Path, tmp_path: Path
) -> None:
    """A put's L3 work after its commit (second-put admission, counted in Redis; a sync put's fsync) can
    take long: a put waiting for that put's slots goes on at the commit (the blocks are evictable then)."""
    from skippyd.l3 import L3Store
    from skippyd.packer import BlockWriter
    from skippyd.workers import Health

    admitting = threading.Event()
    release = threading.Event()

    def slow_admission(blocks: Any) -> list[bool]:
        admitting.set()
        assert release.wait(30)
        return [False] * len(blocks)

    with L2Tier.open(shm_dir, 2 << 20) as tier, L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        writer = BlockWriter(tier, l3, Health())  # not started: nothing is written
        rules = BlockRules(tier, l3=l3, writer=writer, admission=slow_admission)
        fits = _fill_to_the_brim(rules)
        first = rules.begin_put(*_blocks(b"a", fits), durable=True)  # L3 on a second put only
        finishing = threading.Thread(target=first.finish)
        outcome: list[int] = []
        second = threading.Thread(
            target=lambda: outcome.append(rules.put(*_blocks(b"b", fits), durable=False).stored)
        )
        second.start()
        assert eventually(lambda: tier._fills_waiting == 1)
        finishing.start()
        assert admitting.wait(10)  # the first put committed and now counts its blocks for admission
        second.join(2.0)
        try:
            assert not second.is_alive(), "the waiting put sat until the other put's admission ended"
            assert outcome == [fits]
        finally:
            release.set()
            finishing.join(10)


def test_reads_wait_for_a_puts_copy_only_while_places_to_wait_are_left(shm_dir: Path) -> None:
    """A read reaching a block whose put has not committed waits for it (acknowledged means visible),
    but at most ``settle_waiters`` reads wait at once (each holds a daemon worker): the next answers at
    once, the block counted as not held, and is counted."""
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        rules = BlockRules(tier, settle_waiters=1)
        space, keys, *_ = _blocks(b"s", 4)
        job = rules.begin_put(*_blocks(b"s", 4), durable=False)
        seen: list[int] = []
        waiting = threading.Thread(target=lambda: seen.append(rules.contains(space, keys)))
        waiting.start()
        assert eventually(lambda: rules._settling == 1)
        started = time.monotonic()
        assert rules.contains(space, keys) == 0  # no place left to wait: a miss, at once
        assert time.monotonic() - started < 1.0 and rules.counters.block_settle_skips == 1
        assert waiting.is_alive()
        assert job.finish().stored == 4
        waiting.join(5)
        assert seen == [4]  # the read that waited saw the put whole


def test_free_slots_still_read_under_a_lease_are_set_aside_not_scanned_again_by_every_block_of_a_put(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client holding views of many blocks that are then evicted leaves as many free slots read under
    its lease. A put looks at each once and sets it aside (looked at again a batch at a time, every few
    ms), instead of scanning every read slot for every block it reserves, under the lock: 4,096 such
    slots made one put take 13 s and stalled every other request as long. Once the reader lets go, the
    slots are free again."""
    from skippyd.l2.slabs import Slab

    with L2Tier.open(shm_dir, 64 << 20) as tier:
        rules = BlockRules(tier)
        count = 400  # a bit under half the budget: the second put has room beside the read slots
        space, keys, sizes, offsets, data = _blocks(b"a", count)
        assert rules.put(space, keys, sizes, offsets, data, durable=False).stored == count
        served = rules.get(space, keys, max_fds=64)
        assert len(served.lease.placements) == count  # the reader's views: a lease on every slot
        try:
            assert rules.evict_identity(space.identity.digest) == count
            with tier.lock:
                assert tier.blocks.free_slots_read()
            looks = Calls(monkeypatch, Slab, "has_readers")
            started = time.monotonic()
            assert rules.put(*_blocks(b"b", count), durable=False).stored == count
            elapsed = time.monotonic() - started
            batches = int(elapsed / 0.005) + 2
            assert looks.count <= count + batches * 256, (
                f"{looks.count} looks at read slots for a put of {count}"
            )
            assert tier.stats().block_free_slots_read == count
        finally:
            served.lease.close()
        monkeypatch.undo()
        assert rules.clear() == count
        stats = tier.stats()
        assert (stats.block_free_slots_read, stats.block_free_slots) == (0, 0), "let go of: given back"


def test_a_look_at_read_slots_is_bounded_across_all_block_spaces_not_per_space(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free slots read under leases in many block spaces: one look at them (every 5 ms while puts take
    slots, under the tier lock) checks at most 256 of all of them together, round robin. A bound per
    space made a look of 16 spaces cost 4,096 fcntls; looks then ran back to back, and the daemon hung."""
    from skippyd.l2.slabs import Slab

    with L2Tier.open(shm_dir, 64 << 20) as tier:
        rules = BlockRules(tier)
        spaces, each, size = 16, 400, 4096
        leases = []
        try:
            for n in range(spaces):
                space = block_space(MODEL, STATE, f"ns{n}", 16)
                keys = [b"r%d-%d" % (n, i) for i in range(each)]
                data = memoryview(bytes(each * size))
                put = rules.put(
                    space, keys, [size] * each, [i * size for i in range(each)], data, durable=False
                )
                assert put.stored == each
                leases.append(rules.get(space, keys, max_fds=64).lease)
                assert rules.evict_identity(space.identity.digest) == each
            with tier.lock:
                assert not tier.blocks.release_free()  # every free slot is read: each looked at, set aside
            assert tier.stats().block_free_slots_read == spaces * each
            looks = Calls(monkeypatch, Slab, "has_readers")
            seen = set()
            for _ in range(spaces):
                looks.count = 0
                with tier.lock:
                    tier.blocks._look_at = 0.0  # (due now)
                    tier.blocks.free_slots_read()
                    seen.add(next(iter(tier.blocks._with_read)))
                assert looks.count == 256, f"one look made {looks.count} fcntls"
            assert len(seen) >= spaces // 2, "the looks go round the spaces, not always the same one"
            with tier.lock:
                before = time.monotonic()
                tier.blocks.free_slots_read()  # not due: the next look is 5 ms after the last one ended
            assert looks.count == 256 and tier.blocks._look_at > before
        finally:
            for lease in leases:
                lease.close()
        monkeypatch.undo()
        rules.clear()
        assert tier.stats().block_free_slots == 0, "let go of: given back"


def test_slots_a_reader_let_go_of_are_taken_again_before_a_put_evicts_live_blocks(shm_dir: Path) -> None:
    """Free slots found read are set aside; once their reader lets go, a put takes them back, all of them
    (a look goes on batch after batch while most of a batch comes back), before it would evict a live
    block for want of room. (Taking back 256 every 5 ms, a put of 480 blocks evicted 80 live ones while
    free slots nobody read sat aside.)"""
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        rules = BlockRules(tier)
        a = block_space(MODEL, STATE, "a", 16)
        b = block_space(MODEL, STATE, "b", 16)

        def put_into(space: Any, keys: list[bytes]) -> int:
            n = len(keys)
            data = memoryview(bytes(n * SLOT))
            put = rules.put(space, keys, [SLOT] * n, [i * SLOT for i in range(n)], data, durable=False)
            return put.stored

        first = [b"a%d" % i for i in range(480)]
        assert put_into(a, first) == 480
        served = rules.get(a, first, max_fds=64)  # a reader's views of them
        assert rules.evict_identity(a.identity.digest) == 480  # their slots: free, still read
        live = [b"b%d" % i for i in range(480)]
        assert put_into(b, live) == 480
        assert put_into(a, [b"x"]) == 1  # finds a's free slots read: they are set aside
        assert tier.stats().block_free_slots_read >= 400
        served.lease.close()  # the reader lets go
        evictions = tier.stats().block_evictions
        assert put_into(a, [b"c%d" % i for i in range(480)]) == 480
        assert sum(rules.held(b, live)) == 480, "live blocks were evicted while free slots sat aside"
        assert tier.stats().block_evictions == evictions


def test_free_files_served_for_one_identity_are_not_the_reserves_stock_for_every_entry(shm_dir: Path) -> None:
    """A file once handed to a client serves only its identity's entries: free ones of identity A are no
    ready stock for B's captures of their size class, so the reserve faults in a file any entry may take
    (and its decay gives back its own stock, not A's)."""
    from l2util import IDENT, get

    from skippyd.keys import Identity
    from skippyd.l2.pool import ANY_OWNER

    other = Identity("model-b", "state-v1", "tenant-b")
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        served = [admit_bytes(tier, f"a{i}", 60 * 1024, fill=1) for i in range(4)]
        for entry in served:
            get(tier, entry.key)  # restored: handed to a client
            tier.remove(entry.key)
        time.sleep(1.1)  # (A's demand leaves the window)
        admit_bytes(tier, "b0", 60 * 1024, fill=2, ident=other)  # B's demand for the class
        size = size_of(60 * 1024)
        assert tier._pool.free_of(size, ANY_OWNER) == 0 and tier._pool.free_of(size) == 4 * size
        added = sum(tier.prefault_step(32 << 20, window=1.0) for _ in range(4))
        assert added == size and tier._pool.free_of(size, ANY_OWNER) == size
        assert sum(tier.give_back_step(32 << 20, window=1.0) for _ in range(4)) == 0
        fresh = tier.stats().fresh_files
        admit_bytes(tier, "b1", 60 * 1024, fill=2, ident=other)
        assert tier.stats().fresh_files == fresh, "B's capture took the reserve's file, none fresh"
        assert {f.owner for files in tier._pool._free.values() for f in files} == {IDENT.digest[:32]}
