"""The transfer layer's CPU side: run planning, the registration book with generations (through a hook
that records the calls), the daemon's generations, and the typed error where CUDA is asked for and
there is none. The CUDA copies themselves are in tests/test_cuda.py (marked ``cuda``)."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from daemonutil import DaemonProcess

import skippyd
from skippyd.client.transfer import RegistrationBook, Run, plan, plan_runs, sim, split_runs
from skippyd.client.transfer.device import FileMaps, resolve_device
from skippyd.client.transfer.plan import page_spans
from skippyd.errors import NoDevice

MODEL, STATE = "transfer-model@sha256:0", "paged-kv-v1"
BLOCK = 16
BLOCK_BYTES = 64 * 1024
NO_CUDA = not torch.cuda.is_available()


class Recorder(sim.Recorder):
    """The simulator's recording register/unregister hooks, with a book over them."""

    def book(self, limit: int = 1 << 40) -> RegistrationBook:
        return RegistrationBook(self.register, self.unregister, limit_bytes=limit)


# ---------------------------------------------------------------- planning


def test_pieces_that_continue_each_other_on_both_sides_become_one_run() -> None:
    pieces = [("slab", 4096 * i, "kv", 8192 + 4096 * i, 4096) for i in range(8)]
    assert plan_runs(pieces) == [Run("slab", 0, "kv", 8192, 8 * 4096)]


def test_a_gap_on_either_side_or_another_buffer_starts_a_new_run() -> None:
    pieces = [
        ("slab", 0, "kv", 0, 100),
        ("slab", 100, "kv", 200, 100),  # contiguous in the slab, not in the cache
        ("slab", 300, "kv", 300, 100),  # contiguous in the cache, not in the slab
        ("other", 400, "kv", 400, 100),
        ("slab", 0, "kv", 0, 0),  # empty: dropped
    ]
    runs = plan_runs(pieces, sort=False)
    assert [(r.src, r.src_offset, r.dst_offset, r.nbytes) for r in runs] == [
        ("slab", 0, 0, 100), ("slab", 100, 200, 100), ("slab", 300, 300, 100), ("other", 400, 400, 100),
    ]  # fmt: skip


def test_pieces_given_out_of_order_still_merge_and_a_block_of_several_pieces_is_more_pieces() -> None:
    # block 1's two pieces (issue 25: a block as a list of pieces) come first, then block 0's
    pieces = [("s", 1000, "d", 1000, 600), ("s", 1600, "d", 1600, 400), ("s", 0, "d", 0, 1000)]
    assert plan_runs(pieces) == [Run("s", 0, "d", 0, 2000)]
    assert len(plan_runs(pieces, sort=False)) == 2


def test_runs_are_cut_at_registration_boundaries_on_the_host_side() -> None:
    runs = [Run("s", 0, "d", 100, 10_000), Run("x", 0, "d", 50_000, 10)]
    cut = split_runs(runs, {"s": [0, 4096, 8192, 12288]})
    assert [(r.src_offset, r.dst_offset, r.nbytes) for r in cut[:3]] == [
        (0, 100, 4096), (4096, 4196, 4096), (8192, 8292, 10_000 - 8192),
    ]  # fmt: skip
    assert cut[3] == runs[1]
    by_dst = split_runs([Run("dev", 0, "h", 4000, 200)], {"h": [4096]}, side="dst")
    assert [(r.src_offset, r.dst_offset, r.nbytes) for r in by_dst] == [(0, 4000, 96), (96, 4096, 104)]


def test_a_negative_offset_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        plan_runs([("s", -1, "d", 0, 10)])


# ---------------------------------------------------------------- the registration book


def test_memory_is_registered_once_read_only_and_a_longer_need_registers_only_the_rest() -> None:
    rec = Recorder()
    book = rec.book()
    cuts = book.ensure("slab", 5, 1 << 30, [(8192, 8192 + 100)], readonly=True)
    assert rec.calls == [("register", (1 << 30) + 8192, 4096, 8)]  # page-aligned, flag 8
    assert cuts == [8192, 12288]
    rec.calls.clear()
    assert book.ensure("slab", 5, 1 << 30, [(8192, 12288)], readonly=True) == [8192, 12288]
    assert rec.calls == []  # already registered: nothing to do
    cuts = book.ensure("slab", 5, 1 << 30, [(4096, 20480)], readonly=True)
    assert rec.calls == [
        ("register", (1 << 30) + 4096, 4096, 8), ("register", (1 << 30) + 12288, 8192, 8),
    ]  # fmt: skip
    assert cuts == [4096, 8192, 12288, 20480]
    assert book.ranges("slab") == [(4096, 8192), (8192, 12288), (12288, 20480)]
    assert book.stats.registered_bytes == 16384


def test_a_new_generation_unregisters_every_range_of_the_file_before_registering_again() -> None:
    rec = Recorder()
    book = rec.book()
    book.ensure("slab", 1, 0x10000, [(0, 4096), (8192, 12288)], readonly=True)
    rec.calls.clear()
    book.ensure("slab", 2, 0x10000, [(0, 4096)], readonly=True)
    assert rec.calls == [
        ("unregister", 0x10000), ("unregister", 0x10000 + 8192), ("register", 0x10000, 4096, 8),
    ]  # fmt: skip
    assert book.generation("slab") == 2 and book.stats.generation_changes == 1


def test_a_slot_generation_change_reregisters_only_the_ranges_that_hold_that_slot() -> None:
    rec = Recorder()
    book = rec.book()
    base = 0x100000
    book.ensure("slab", 1, base, [(0, 4096)], readonly=True, span_generations=[10])
    book.ensure("slab", 1, base, [(4096, 8192)], readonly=True, span_generations=[11])
    assert book.ranges("slab") == [(0, 4096), (4096, 8192)]
    rec.calls.clear()
    # the slab's file generation moved (another slot was punched): slots 0 and 1 did not, nothing happens
    cuts = book.ensure("slab", 2, base, [(0, 100), (4096, 8192)], readonly=True, span_generations=[10, 11])
    assert rec.calls == [] and cuts == [0, 4096, 8192]
    # slot 1 was punched and filled again: only its range goes and comes back
    book.ensure("slab", 3, base, [(0, 100), (4096, 8192)], readonly=True, span_generations=[10, 12])
    assert rec.calls == [("unregister", base + 4096), ("register", base + 4096, 4096, 8)]
    assert book.parts("slab") == [(0, 4096, 10), (4096, 8192, 12)]
    assert book.stats.generation_changes == 1 and book.stats.registered_bytes == 8192


def test_a_range_over_several_slots_goes_when_one_slot_changed_and_only_what_is_wanted_comes_back() -> None:
    rec = Recorder()
    book = rec.book()
    base = 0x200000
    spans = [(0, 4096), (4096, 8192), (8192, 12288)]
    book.ensure("slab", 1, base, spans, readonly=True, span_generations=[10, 11, 12])
    assert rec.calls == [("register", base, 12288, 8)]  # one registration for the three slots
    rec.calls.clear()
    book.ensure("slab", 1, base, [(8192, 12288)], readonly=True, span_generations=[13])
    assert rec.calls == [("unregister", base), ("register", base + 8192, 4096, 8)]
    rec.calls.clear()
    # an unwanted span is never registered (its slot may be a hole); asked again, it is
    book.ensure("slab", 1, base, [(0, 4096)], readonly=True, span_generations=[10])
    assert rec.calls == [("register", base, 4096, 8)]
    assert book.registration_at("slab", 100) == base and book.registration_at("slab", 5000) is None


def _slot_map(start: int, size: int, generations: list[int]) -> tuple[int, int, bytes]:
    return start, size, b"".join(g.to_bytes(8, "little") for g in generations)


def test_a_reply_whose_slot_map_shows_a_punched_slot_drops_its_registration_though_it_is_not_read() -> None:
    rec = Recorder()
    book = rec.book()
    base, start, size = 0x400000, 8192, 4096
    book.ensure("slab", 1, base, [(start, start + 2 * size)], readonly=True, span_generations=[10],
                slot_map=_slot_map(start, size, [10, 10, 10, 10]))  # fmt: skip
    book.ensure("slab", 1, base, [(start + 3 * size, start + 4 * size)], readonly=True, span_generations=[10],
                slot_map=_slot_map(start, size, [10, 10, 10, 10]))  # fmt: skip
    assert book.ranges("slab") == [(start, start + 2 * size), (start + 3 * size, start + 4 * size)]
    rec.calls.clear()
    # slot 3 was punched (the file's generation moved); the reply reads slot 0 only: slot 3's range goes,
    # the range of slots 0-1 stays
    book.ensure("slab", 2, base, [(start, start + size)], readonly=True, span_generations=[10],
                slot_map=_slot_map(start, size, [10, 10, 10, 11]))  # fmt: skip
    assert rec.calls == [("unregister", base + start + 3 * size)]
    assert book.ranges("slab") == [(start, start + 2 * size)] and book.stats.registered_bytes == 2 * size
    # slot 1 punched: the range it shares with slot 0 goes whole, and slot 0 comes back
    rec.calls.clear()
    book.ensure("slab", 3, base, [(start, start + size)], readonly=True, span_generations=[10],
                slot_map=_slot_map(start, size, [10, 12, 10, 11]))  # fmt: skip
    assert rec.calls == [("unregister", base + start), ("register", base + start, size, 8)]


def test_a_slot_map_is_read_only_when_the_files_generation_moved_and_never_for_pages_a_slot_shares() -> None:
    rec = Recorder()
    book = rec.book()
    base, start = 0x800000, 4096
    book.ensure("slab", 5, base, [(start, start + 4096)], readonly=True, span_generations=[10],
                slot_map=_slot_map(start, 4096, [10, 10]))  # fmt: skip
    rec.calls.clear()
    # the same file generation: the map is not compared (a reply of the same moment as the last)
    book.ensure("slab", 5, base, [(start + 4096, start + 8192)], readonly=True, span_generations=[10],
                slot_map=_slot_map(start, 4096, [99, 10]))  # fmt: skip
    assert rec.calls == [("register", base + start + 4096, 4096, 8)]
    # slots of 3000 bytes: a punch gives back only the pages wholly inside a slot; slot 0 (bytes
    # 4096-7096) has none, so its registration of the page it shares with slot 1 stays
    small = rec.book()
    rec.calls.clear()
    small.ensure("s", 1, base, [(start, start + 3000)], readonly=True, span_generations=[10],
                 slot_map=_slot_map(start, 3000, [10, 10, 10]))  # fmt: skip
    small.ensure("s", 2, base, [(start + 6000, start + 9000)], readonly=True, span_generations=[10],
                 slot_map=_slot_map(start, 3000, [11, 10, 10]))  # fmt: skip
    assert [c[0] for c in rec.calls] == ["register", "register"]


def test_a_reply_without_a_map_or_answered_late_does_not_hide_a_punch_or_drop_a_fresh_registration() -> None:
    rec = Recorder()
    book = rec.book()
    base, start, size = 0x400000, 8192, 4096
    slot0, slot2 = [(start, start + size)], [(start + 2 * size, start + 3 * size)]
    book.ensure("slab", 1, base, slot0 + slot2, readonly=True, span_generations=[10, 10],
                slot_map=_slot_map(start, size, [10, 10, 10]))  # fmt: skip
    rec.calls.clear()
    # slot 2 is punched (file generation 2); a reply that carries no map reads slot 0: nothing compared
    book.ensure("slab", 2, base, slot0, readonly=True, span_generations=[10])
    assert rec.calls == []
    # the next reply of generation 2 with its map: slot 2's registration goes
    book.ensure("slab", 2, base, slot0, readonly=True, span_generations=[10],
                slot_map=_slot_map(start, size, [10, 10, 11]))  # fmt: skip
    assert rec.calls == [("unregister", base + slot2[0][0])]
    book.ensure("slab", 2, base, slot2, readonly=True, span_generations=[11],
                slot_map=_slot_map(start, size, [10, 10, 11]))  # fmt: skip
    rec.calls.clear()
    # a reply of generation 1 answered late, its map from before the punch: slot 2's new registration stays
    book.ensure("slab", 1, base, slot0, readonly=True, span_generations=[10],
                slot_map=_slot_map(start, size, [10, 10, 10]))  # fmt: skip
    assert rec.calls == [] and book.ranges("slab") == slot0 + slot2


@pytest.mark.parametrize("few", [0, 32])  # numpy for any number of ranges; a loop for up to 32
@pytest.mark.parametrize("slot_size", [4096, 8192, 6000, 300])
def test_spans_joined_per_generation_before_the_book_register_exactly_what_one_span_a_block_would(
    slot_size: int, few: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """page_spans hands the book one span per run of consecutive slots of one generation instead of one
    per block: over random replies (random slots, sizes, punched slots) both books make the same calls,
    keep the same ranges and report the same boundaries."""
    monkeypatch.setattr(plan, "_FEW", few)
    rng = random.Random(slot_size)
    raw, joined = Recorder(), Recorder()
    books = raw.book(), joined.book()
    base, start = 0x10000000, 4096
    generation = [1] * 64
    fewer = 0
    for _ in range(300):
        for slot in rng.sample(range(64), rng.randrange(0, 3)):  # punched and filled again
            generation[slot] += 1
        first = rng.randrange(64)
        slots = sorted({min(63, first + rng.randrange(12)) for _ in range(rng.randrange(1, 16))})
        spans = [
            (start + i * slot_size, start + i * slot_size + rng.randrange(1, slot_size + 1)) for i in slots
        ]
        gens = [generation[i] for i in slots]
        cuts_raw = books[0].ensure("slab", 1, base, spans, readonly=True, span_generations=gens)
        merged, merged_gens = page_spans([a for a, _ in spans], [b for _, b in spans], gens)
        assert len(merged) <= len(spans)
        fewer += len(merged) < len(spans)
        cuts_joined = books[1].ensure("slab", 1, base, merged, readonly=True, span_generations=merged_gens)
        assert joined.calls == raw.calls
        assert books[1].ranges("slab") == books[0].ranges("slab")
        assert cuts_joined == cuts_raw
    assert fewer  # (some replies were joined: the comparison covers joins)


@pytest.mark.parametrize("slot_size", [4096, 8192, 6000, 300])
def test_spans_of_several_sources_at_once_are_each_sources_own_spans(slot_size: int) -> None:
    """page_spans_of (a reply's slabs in one pass) gives every source exactly what page_spans gives
    for that source's ranges alone: joins, generations, shared pages left as they are."""
    rng = random.Random(slot_size + 1)
    for _ in range(200):
        count = rng.randrange(0, 60)
        sources = [rng.randrange(8) for _ in range(count)]
        slots = [rng.randrange(40) for _ in range(count)]
        length = [rng.randrange(0, slot_size + 1) for _ in range(40)]  # a slot's block and generation
        generation = [rng.choice([5, 5, 5, 6]) for _ in range(40)]
        starts = [4096 + i * slot_size for i in slots]
        ends = [4096 + i * slot_size + length[i] for i in slots]
        gens = [generation[i] for i in slots]
        both = plan.page_spans_of(sources, starts, ends, gens)
        for source in set(sources):
            mine = [n for n in range(count) if sources[n] == source]
            alone = page_spans([starts[n] for n in mine], [ends[n] for n in mine], [gens[n] for n in mine])
            assert both.get(source, ([], [])) == alone
        assert set(both) <= set(sources)


def test_an_entry_file_keeps_one_generation_for_the_whole_file() -> None:
    rec = Recorder()
    book = rec.book()
    book.ensure("entry", 1, 0x10000, [(0, 4096)], readonly=True)
    book.ensure("entry", 1, 0x10000, [(8192, 12288)], readonly=True)
    rec.calls.clear()
    book.ensure("entry", 2, 0x10000, [(8192, 12288)], readonly=True)
    assert rec.calls == [
        ("unregister", 0x10000), ("unregister", 0x10000 + 8192), ("register", 0x10000 + 8192, 4096, 8),
    ]  # fmt: skip


def test_writable_memory_is_registered_without_the_read_only_flag_and_dropped_before_unmapping() -> None:
    rec = Recorder()
    book = rec.book()
    book.ensure(("host", 0x20000), 1, 0x20000, [(0, 100)], readonly=False)
    assert rec.calls == [("register", 0x20000, 4096, 0)]
    book.drop(("host", 0x20000))
    assert rec.calls[-1] == ("unregister", 0x20000)
    assert ("host", 0x20000) not in book and book.stats.registered_bytes == 0


def test_the_book_stays_under_its_limit_by_dropping_the_least_recently_used_files() -> None:
    rec = Recorder()
    book = rec.book(limit=3 * 4096)
    for name in ("a", "b", "c"):
        book.ensure(name, 1, hash(name) & ~0xFFF, [(0, 4096)], readonly=True)
    book.ensure("a", 1, hash("a") & ~0xFFF, [(0, 4096)], readonly=True)  # a is used again: b is oldest
    book.ensure("d", 1, 0x40000, [(0, 4096)], readonly=True)
    assert "b" not in book and all(name in book for name in ("a", "c", "d"))
    assert book.stats.registered_bytes == 3 * 4096


def test_room_for_one_source_of_a_transfer_is_never_made_by_dropping_another_of_the_same_transfer() -> None:
    """A transfer registers its sources one after another and has planned its copies against each one's
    registrations: making room for a later source drops the least recently used files outside it, and
    passes the limit rather than unpin an earlier one of its own (its copies would then run unpinned)."""
    rec = Recorder()
    book = rec.book(limit=3 * 4096)
    book.ensure("old", 1, 0x10000, [(0, 4096)], readonly=True)
    this = ["a", "b", "c"]
    for index, name in enumerate(this):
        book.ensure(name, 1, 0x20000 + 0x10000 * index, [(0, 4096)], readonly=True, keep=this)
    assert "old" not in book and all(name in book for name in this)
    book.ensure("d", 1, 0x60000, [(0, 4096)], readonly=True, keep=["d", *this])
    assert all(name in book for name in [*this, "d"]), "none of the transfer's own went"
    assert book.stats.registered_bytes == 4 * 4096  # (past the limit, until the next transfer)
    book.ensure("e", 1, 0x70000, [(0, 4096)], readonly=True)
    assert "e" in book and book.stats.registered_bytes <= 3 * 4096


def test_memory_that_cannot_be_registered_is_copied_unpinned_and_never_retried() -> None:
    rec = Recorder(refuse=True)
    book = rec.book()
    assert book.ensure("memfd", 1, 0x50000, [(0, 4096)], readonly=True) is None
    assert book.ensure("memfd", 1, 0x50000, [(0, 8192)], readonly=True) is None
    assert [c[0] for c in rec.calls] == ["register"] and book.stats.failures == 1


def test_a_registration_that_fails_for_another_reason_is_copied_unpinned_once_and_asked_again() -> None:
    """cudaHostRegister may answer an error an earlier asynchronous launch left: not a refusal of the
    memory, so that file is not marked unregistrable for good (which would copy it at pageable speed for
    the rest of the process): the next transfer asks again."""
    rec = Recorder(fail=True)
    book = rec.book()
    assert book.ensure("slab", 1, 0x50000, [(0, 4096)], readonly=True) is None
    assert book.stats.failures == 1
    rec.fail = False
    assert book.ensure("slab", 1, 0x50000, [(0, 4096)], readonly=True) == [0, 4096]
    assert rec.count("register") == 2 and book.stats.registrations == 1


# ---------------------------------------------------------------- generations from the daemon


def _space(client: skippyd.Client) -> skippyd.BlockSpace:
    return client.blocks(model=MODEL, state=STATE, namespace="", block_tokens=BLOCK)


def _raw_get(client: skippyd.Client, blocks: skippyd.BlockSpace, keys: list[bytes]) -> tuple[Any, list[int]]:
    return client._call(blocks._body("blocks_get", keys))


def _data(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen)]


def test_a_slab_whose_slot_was_punched_and_filled_again_shows_a_new_generation_and_the_book_reregisters(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--l2-reserve", "0", budget="16MiB").start()
    rec = Recorder()
    book = rec.book()
    maps = FileMaps(book.drop)
    with proc.client() as client:
        blocks = _space(client)
        first, second, third = (blocks.keys(list(range(i * 1000, i * 1000 + BLOCK))) for i in (1, 2, 3))
        blocks.put(first, _data(1), durable=False)
        reply, fds = _raw_get(client, blocks, first)
        try:
            assert len(reply["generations"]) == len(fds) == 1 and reply["generations"][0] > 0
            key, mapped = maps.get(fds[0], reply["blocks"][0][1] + BLOCK_BYTES)  # type: ignore[misc]
            _, offset, nbytes = reply["blocks"][0]
            book.ensure(key, reply["generations"][0], mapped.base, [(offset, offset + nbytes)], readonly=True)
            before = (os.fstat(fds[0]).st_ino, reply["generations"][0])
        finally:
            for fd in fds:
                os.close(fd)
        assert [c[0] for c in rec.calls] == ["register"]
        # a second block in the same slab stays leased (so the slab stays), the first one's slot is punched
        blocks.put(second, _data(2), durable=False)
        held = blocks.get(second)
        client.evict(all=True)
        blocks.put(third, _data(3), durable=False)
        reply, fds = _raw_get(client, blocks, third)
        try:
            after = (os.fstat(fds[0]).st_ino, reply["generations"][0])
            assert after[0] == before[0]  # the same slab file...
            assert after[1] != before[1]  # ...whose memory changed under any old registration
            found = maps.get(fds[0], reply["blocks"][0][1] + BLOCK_BYTES)
            assert found is not None and found[0] == key  # the kept mapping is the same file's
            _, offset, nbytes = reply["blocks"][0]
            rec.calls.clear()
            book.ensure(key, after[1], mapped.base, [(offset, offset + nbytes)], readonly=True)
            assert [c[0] for c in rec.calls] == ["unregister", "register"]
            got = bytes(mapped.mapping[offset : offset + nbytes])
            assert got == _data(3)[0].numpy().tobytes()  # the kept mapping shows the new bytes
        finally:
            for fd in fds:
                os.close(fd)
        del held
    maps.close()
    assert rec.calls[-1][0] == "unregister" and book.stats.registered_bytes == 0


def test_a_get_that_asks_for_slot_maps_gets_every_slot_of_each_slab_and_its_blocks_generations_agree(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--l2-reserve", "0", budget="16MiB").start()
    with proc.client() as client:
        blocks = _space(client)
        keys = blocks.keys(list(range(3 * BLOCK)))
        blocks.put(keys, _data(1) * 3, durable=False)
        plain, fds = _raw_get(client, blocks, keys)
        for fd in fds:
            os.close(fd)
        assert "slot_maps" not in plain  # only when asked: a CPU get has no use for them
        reply, fds = client._call(blocks._body("blocks_get", keys, slot_maps=True))
        for fd in fds:
            os.close(fd)
        assert len(reply["slot_maps"]) == len(fds) == len(reply["generations"])
        served = zip(reply["blocks"], reply["slot_generations"], strict=True)
        for (index, offset, _), slot_generation in served:
            start, size, table = reply["slot_maps"][index]
            assert len(table) % 8 == 0 and len(table) // 8 * size + start >= offset + BLOCK_BYTES
            slot = (offset - start) // size
            assert int.from_bytes(table[8 * slot : 8 * slot + 8], "little") == slot_generation
        with pytest.raises(skippyd.InvalidArgument, match="slot_maps must be true or false"):
            client._call(blocks._body("blocks_get", keys, slot_maps="yes"))
        assert blocks.contains(keys) == 3  # the daemon answered on


def test_an_entry_file_recycled_for_a_new_entry_keeps_its_generation_and_a_new_file_gets_another(
    make_daemon: Any,
) -> None:
    """A recycled file is renamed and rewritten through the same pages (never punched or truncated): a
    client's registration of it stays good, so its generation stays. A file made anew gets a new one."""
    # no reserve: its decay or a file it faults in could otherwise take the evicted file's place
    proc = make_daemon("--l2-reserve", "0", budget="64MiB").start()
    tensor = torch.ones(1 << 20, dtype=torch.float32)  # 4 MiB
    with proc.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1], tensors={"kv": tensor}, durable=False)
        reply, fds = client._call({"op": "restore", **_ident([1])})
        first = (os.fstat(fds[0]).st_ino, reply["generation"])
        for fd in fds:
            os.close(fd)
        assert first[1] > 0
        client.evict(model=MODEL, state=STATE, tokens=[1])
        client.capture(model=MODEL, state=STATE, tokens=[2], tensors={"kv": tensor * 2}, durable=False)
        assert client.stats()["l2"]["reused_files"] >= 1
        reply, fds = client._call({"op": "restore", **_ident([2])})
        second = (os.fstat(fds[0]).st_ino, reply["generation"])
        for fd in fds:
            os.close(fd)
        assert second == first  # the same file, the same pages: the same generation
        # a file of another size class is a new file: a generation never given before
        client.capture(model=MODEL, state=STATE, tokens=[3], tensors={"kv": tensor[:1000]}, durable=False)
        reply, fds = client._call({"op": "restore", **_ident([3])})
        third = (os.fstat(fds[0]).st_ino, reply["generation"])
        for fd in fds:
            os.close(fd)
        assert third[0] != first[0] and third[1] not in (0, first[1])


def _ident(tokens: list[int]) -> dict[str, Any]:
    from skippyd.keys import encode_tokens

    return {"model": MODEL, "state": STATE, "namespace": "", "tokens": encode_tokens(tokens)}


def test_kept_mappings_hold_no_lease_and_are_dropped_once_the_file_is_removed(shm_dir: Path) -> None:
    import fcntl
    import struct

    path = shm_dir / "f.slab"
    path.write_bytes(b"x" * 8192)
    rec = Recorder()
    book = rec.book()
    maps = FileMaps(book.drop)
    fd = os.open(path, os.O_RDONLY)
    lock = struct.pack("hh4xqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 0, 8192, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    found = maps.get(fd, 8192)
    assert found is not None
    book.ensure(found[0], 1, found[1].base, [(0, 8192)], readonly=True)
    os.close(fd)  # the reply's lease ends here: the kept mapping must not hold it
    probe = os.open(path, os.O_RDWR)
    try:
        fcntl.fcntl(
            probe, fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 8192, 0)
        )
    finally:
        os.close(probe)
    os.unlink(path)
    maps.sweep()
    assert len(maps) == 0 and rec.calls[-1][0] == "unregister"


def test_past_256_kept_files_a_sweep_looks_for_removed_ones_only_every_so_often(shm_dir: Path) -> None:
    dropped: list[Any] = []
    maps = FileMaps(dropped.append, limit=1000)
    fds = []
    try:
        for n in range(300):
            (shm_dir / f"f{n}").write_bytes(b"x" * 4096)
            fds.append(os.open(shm_dir / f"f{n}", os.O_RDONLY))
            assert maps.get(fds[-1], 4096) is not None
        maps.sweep()  # looks at all 300 (the first look)
        os.unlink(shm_dir / "f0")
        maps.sweep()  # the next look is 0.1 s × 300 / 256 after the last: not yet
        assert dropped == [] and len(maps) == 300
        maps._swept -= 0.2
        maps.sweep()
        assert len(dropped) == 1 and len(maps) == 299
    finally:
        for fd in fds:
            os.close(fd)
        maps.close()


def test_the_kept_files_and_registered_bytes_are_256_and_64_gib_unless_set() -> None:
    from skippyd.client.transfer.limits import kept_files, pin_limit

    assert (kept_files({}), pin_limit({})) == (256, 64 << 30)
    assert kept_files({"SKIPPYD_KEPT_FILES": " 4096 "}) == 4096
    assert pin_limit({"SKIPPYD_PIN_LIMIT": "256GiB"}) == 256 << 30


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("SKIPPYD_KEPT_FILES", "many", "SKIPPYD_KEPT_FILES='many' is not a whole number"),
        ("SKIPPYD_KEPT_FILES", "8", "SKIPPYD_KEPT_FILES=8 is below 16"),
        ("SKIPPYD_PIN_LIMIT", "lots", "SKIPPYD_PIN_LIMIT: 'lots' is not a size (try 512MiB or 8GiB)"),
        ("SKIPPYD_PIN_LIMIT", "1KiB", "SKIPPYD_PIN_LIMIT=1KiB is below 1MiB"),
    ],
)
def test_a_limit_set_wrong_is_a_config_error_naming_its_variable(
    name: str, value: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd.client.transfer.device import DeviceTransfer

    monkeypatch.setenv(name, value)
    with pytest.raises(skippyd.ConfigError) as raised:
        DeviceTransfer(register=lambda *_: True, unregister=lambda _: None)
    assert str(raised.value) == says and "\n" not in str(raised.value)


def test_the_device_transfer_takes_its_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from skippyd.client.transfer.device import DeviceTransfer

    monkeypatch.setenv("SKIPPYD_KEPT_FILES", "4096")
    monkeypatch.setenv("SKIPPYD_PIN_LIMIT", "3GiB")
    made = DeviceTransfer(register=lambda *_: True, unregister=lambda _: None)
    try:
        assert (made.maps.limit, made.book.limit_bytes) == (4096, 3 << 30)
    finally:
        made.close()


def test_a_slabs_records_carry_its_slots_generations_where_a_client_reads_them_and_old_records_still_hold(
    shm_dir: Path,
) -> None:
    import numpy as np

    from skippyd.client.transfer import filemaps
    from skippyd.l2 import slabs
    from skippyd.shm import PAGE

    assert (filemaps._SLAB_MAGIC, filemaps._SLAB_VERSION, filemaps._RECORDS_AT, filemaps._RECORD_BYTES) == (
        slabs.SLAB_MAGIC, slabs.SLAB_VERSION, PAGE, slabs.RECORD_SIZE,
    )  # fmt: skip
    assert (filemaps._GENERATION_AT, filemaps._MAX_SLOTS) == (slabs.GENERATION_AT, slabs.MAX_SLOTS)
    made = slabs.Slab.create(shm_dir, 8192, 4)

    def read(slab: slabs.Slab) -> Any:
        return filemaps.slab_slot_map(np.frombuffer(bytes(slab.mapping), dtype=np.uint8))

    try:
        assert read(made) == (made.data_start, 8192, made.slot_map())
        record = slabs.SlotRecord(key=b"k" * 32, space=b"s" * 32, identity=b"i" * 32, block_tokens=16,
                                  parent=None, nbytes=10, digest=b"d" * 32)  # fmt: skip
        made.allocate(1)
        made.punch(2)
        made.write_record(1, record)
        assert read(made) == (made.data_start, 8192, made.slot_map())
        generations = np.frombuffer(made.slot_map(), dtype="<u8")
        assert generations[2] > generations[1] == generations[0] == generations[3]
        assert made.record(1) == record
        # a record of a slab made before the field (zero there) still holds
        at = PAGE + slabs.RECORD_SIZE + slabs.GENERATION_AT
        made.mapping[at : at + 8] = bytes(8)
        assert made.record(1) == record
        assert read(made) is None  # (generations an older daemon did not write: none read)
        adopted = slabs.Slab.open(made.path)  # a restart: new numbers, in the file too
        try:
            assert adopted.record(1) == record
            assert read(adopted) == (made.data_start, 8192, adopted.slot_map())
            assert adopted.slot_map() != made.slot_map()
        finally:
            adopted.close()
    finally:
        made.close()
    assert filemaps.slab_slot_map(np.zeros(8192, dtype=np.uint8)) is None  # not a slab


# ---------------------------------------------------------------- no CUDA here


@pytest.mark.skipif(not NO_CUDA, reason="proves the error where there is no CUDA device")
def test_asking_for_cuda_where_there_is_none_is_a_typed_error_with_one_line() -> None:
    for device in ("cuda", "cuda:0", torch.device("cuda", 3)):
        with pytest.raises(NoDevice) as caught:
            resolve_device(device)
        assert caught.value.code == "no_device" and "\n" not in str(caught.value)
        assert "cuda" in str(caught.value)
    assert resolve_device(None) == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(skippyd.InvalidArgument):
        resolve_device("not-a-device")


@pytest.mark.skipif(not NO_CUDA, reason="proves the error where there is no CUDA device")
def test_restore_to_cuda_without_cuda_raises_no_device_and_the_entry_stays(daemon: DaemonProcess) -> None:
    tensors = {"k": torch.arange(64, dtype=torch.float32)}
    with daemon.client() as client:
        client.capture(model=MODEL, state=STATE, tokens=[1, 2], tensors=tensors, durable=False)
        with pytest.raises(NoDevice, match="cuda:0"):
            client.restore(model=MODEL, state=STATE, tokens=[1, 2], device="cuda:0")
        restored = client.restore(model=MODEL, state=STATE, tokens=[1, 2])
        assert restored is not None and torch.equal(restored.tensors["k"], tensors["k"])

    async def run() -> None:
        async with skippyd.AsyncClient(daemon.socket) as client:
            with pytest.raises(NoDevice):
                await client.restore(model=MODEL, state=STATE, tokens=[1, 2], device="cuda")

    asyncio.run(run())


def test_cpu_gets_puts_captures_and_restores_never_make_a_device_transfer(daemon: DaemonProcess) -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, skippyd\n"
        f"c = skippyd.Client({str(daemon.socket)!r})\n"
        "b = c.blocks(model='m', state='s', block_tokens=16)\n"
        "keys = b.keys(list(range(32)))\n"
        "b.put(keys, [torch.ones(4096, dtype=torch.uint8)] * 2, durable=False)\n"
        "out = [torch.empty(4096, dtype=torch.uint8) for _ in keys]\n"
        "assert b.get_into(keys, out) == 2 and all(o.sum() == 4096 for o in out)\n"
        "c.capture(model='m', state='s', tokens=[1], tensors={'k': torch.ones(3)}, durable=False)\n"
        "assert c.restore(model='m', state='s', tokens=[1]) is not None\n"
        "import skippyd.client.transfer.device as d\n"
        "assert not d._transfer, 'the CPU path made a device transfer'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(not NO_CUDA, reason="proves the error where there is no CUDA device")
def test_skt_restore_to_cuda_without_cuda_raises_no_device(
    daemon: DaemonProcess,
) -> None:
    pytest.importorskip("transformers")
    from hfmodels import build, prompt

    import skippyd.integrations.transformers as skt

    model = build("llama")
    tokens = prompt(3 * BLOCK)
    with daemon.client() as client, pytest.raises(NoDevice, match="cuda"):
        skt.restore(client, model, tokens=tokens, device="cuda")


def test_the_callers_streams_wrapper_is_the_function_itself_where_cuda_was_never_initialised() -> None:
    """On a CPU-only host (or before any CUDA use) the async client's worker threads run the work as it
    is: nothing to carry, and torch's CUDA state is not touched."""
    from skippyd.client.transfer import in_callers_streams

    def work(x: int) -> int:
        return x + 1

    assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    assert in_callers_streams(work) is work
    assert in_callers_streams(work)(1) == 2


class _FakeCudaRuntime:
    """torch.cuda as in_callers_streams uses it, for 4 devices, with per-thread current device and streams,
    recording which devices got a context (made current: ``cudaSetDevice``). Pure logic: what a real
    multi-GPU host shows is left to the ``cuda`` tests."""

    def __init__(self, contexts: set[int]) -> None:
        import threading
        from types import SimpleNamespace

        self.contexts = set(contexts)
        self._local = threading.local()
        self.defaults = [SimpleNamespace(device_index=i, name=f"default{i}") for i in range(4)]

    def _state(self) -> Any:
        if not hasattr(self._local, "device"):
            self._local.device, self._local.streams = 0, list(self.defaults)  # (a new thread: device 0)
        return self._local

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 4

    def current_device(self) -> int:
        return int(self._state().device)

    def set_device(self, index: int) -> None:
        self.contexts.add(index)
        self._state().device = index

    def _maybe_exchange_device(self, index: int) -> int:
        before = self._state().device
        self._state().device = index  # (made current where it has a context, else only remembered)
        return int(before)

    def current_stream(self, index: int) -> Any:
        return self._state().streams[index]

    def default_stream(self, index: int) -> Any:
        return self.defaults[index]

    def set_stream(self, stream: Any) -> None:
        self.set_device(stream.device_index)  # (THCPModule_setStream_wrap: cudaSetDevice where it differs)
        self._state().streams[stream.device_index] = stream


def test_the_callers_streams_reach_a_worker_thread_without_a_context_on_any_other_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine on cuda:2 of a 4-GPU host (it sees all four) with a side stream there, and a stream of its
    own on cuda:3: the async client's worker runs on cuda:2 with both streams, and neither cuda:0 (a new
    thread's device) nor cuda:1 ever becomes current, which would give each a CUDA context (hundreds of
    MiB of that GPU's memory, in every rank's process)."""
    import sys
    import threading
    from types import SimpleNamespace

    from skippyd.client.transfer import in_callers_streams

    fake = _FakeCudaRuntime(contexts={2, 3})
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=fake))
    side, other = SimpleNamespace(device_index=2, name="side"), SimpleNamespace(device_index=3, name="mine")
    fake.set_device(3)
    fake.set_stream(other)
    fake.set_stream(side)
    fake.set_device(2)
    seen: dict[str, Any] = {}

    def work() -> None:
        seen["device"] = fake.current_device()
        seen["streams"] = [fake.current_stream(i).name for i in range(4)]

    wrapped = in_callers_streams(work)
    after: dict[str, Any] = {}

    def worker() -> None:
        wrapped()
        after["device"] = fake.current_device()
        after["streams"] = [fake.current_stream(i).name for i in range(4)]

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"device": 2, "streams": ["default0", "default1", "side", "mine"]}
    assert after == {"device": 0, "streams": ["default0", "default1", "default2", "default3"]}
    assert fake.contexts == {2, 3}, "no device the caller does not use was made current"


def test_registrations_ask_to_be_portable_and_a_driver_that_refuses_only_that_is_not_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cudaHostRegisterPortable (1) pins a range for every device's context, not only the registering
    thread's; where a driver refuses that flag but takes the registration without it, registrations go on
    without it, and a range no flags can register is copied unpinned. Pure logic: a recording cudart."""
    from types import SimpleNamespace

    from skippyd.client.transfer import cuda

    calls: list[tuple[int, int, int]] = []
    refuse: set[int] = set()

    def register(address: int, nbytes: int, flags: int) -> int:
        calls.append((address, nbytes, flags))
        return 1 if flags in refuse else 0  # (cudaErrorInvalidValue, or cudaSuccess)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=register))
    monkeypatch.setattr(cuda, "_portable", [True])
    assert cuda._cuda_register(4096, 8192, 8)  # (cudaHostRegisterReadOnly)
    assert calls == [(4096, 8192, 9)]  # read-only and portable, in one call
    refuse.update({1, 9})
    calls.clear()
    assert cuda._cuda_register(4096, 8192, 0) and cuda._cuda_register(8192, 4096, 8)
    assert calls == [(4096, 8192, 1), (4096, 8192, 0), (8192, 4096, 8)]  # asked once, then never again
    refuse.add(8)
    assert not cuda._cuda_register(8192, 4096, 8)


def test_a_failed_registration_clears_its_error_in_torchs_own_runtime_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed cudaHostRegister leaves its error for the next cudaGetLastError of the runtime library
    it went through, torch's (libcudart.so.<major>), which torch would raise at an unrelated kernel
    launch; cuda-bindings links its own runtime statically, so clearing there clears nothing of torch's.
    Pure logic: a recording loader and cudart."""
    import ctypes
    import os
    from types import SimpleNamespace

    from skippyd.client.transfer import cuda

    class Call:
        def __init__(self) -> None:
            self.count, self.restype = 0, None

        def __call__(self) -> int:
            self.count += 1
            return 0

    loaded: list[tuple[str, int]] = []
    runtime = SimpleNamespace(cudaGetLastError=Call())

    def load(name: str, mode: int = 0) -> Any:
        loaded.append((name, mode))
        if name != "libcudart.so.13":
            raise OSError(f"{name}: not loaded")
        return runtime

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(ctypes, "CDLL", load)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=lambda *_: 1))
    monkeypatch.setattr(cuda, "_portable", [True])
    cuda._torch_runtime.cache_clear()
    try:
        assert not cuda._cuda_register(4096, 4096, 8)  # refused with and without the portable flag
        assert loaded[0] == ("libcudart.so.13", os.RTLD_NOLOAD | os.RTLD_LAZY)  # (never loads a new one)
        assert runtime.cudaGetLastError.count == 2  # each failed call's error cleared where it was left
    finally:
        cuda._torch_runtime.cache_clear()


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_device_stager_runs_as_many_copies_at_once_as_it_has_pairs_of_buffers_each_its_own(
    pairs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeviceStager copy writes one pair of pinned buffers while its DMAs read them: restores at once (an
    AsyncClient's, each on a worker thread) each take a pair of their own, at most ``pairs`` at once (the
    rest wait for one to come back), and a pair is made once and reused. Pure logic: the copy is a
    stand-in that notes how many run at once and which pair each has, the pinned buffers CPU tensors."""
    import threading
    import time

    from skippyd.client.tensors import DeviceStager

    running, most, made = [0], [0], [0]
    held: set[int] = set()
    count = threading.Lock()
    empty = torch.empty
    together = threading.Barrier(pairs, timeout=10)  # (copies of one round meet: none ends alone first)

    def pinned(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert kwargs.pop("pin_memory", False)
        with count:
            made[0] += 1
        return empty(*args, **kwargs)

    def copy(pair: list[torch.Tensor], *_args: Any) -> dict[str, torch.Tensor]:
        with count:
            assert id(pair) not in held, "two copies on one pair"
            held.add(id(pair))
            running[0] += 1
            most[0] = max(most[0], running[0])
        together.wait()
        time.sleep(0.01)
        with count:
            running[0] -= 1
            held.discard(id(pair))
        return {}

    stager = DeviceStager(chunk_bytes=4096, pairs=pairs)
    monkeypatch.setattr(stager, "_to_device", copy)
    monkeypatch.setattr(torch, "empty", pinned)
    threads = [
        threading.Thread(target=stager.to_device, args=(-1, 0, 4096, [], torch.device("cuda", 0)))
        for _ in range(3 * pairs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == [pairs] and made == [2 * pairs]


def test_a_device_stager_whose_pinned_buffers_cannot_be_made_gives_its_place_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from skippyd.client.tensors import DeviceStager

    def refuse(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    stager = DeviceStager(pairs=1)
    monkeypatch.setattr(torch, "empty", refuse)
    for _ in range(2):  # (the second would wait for ever had the first kept its place)
        with pytest.raises(RuntimeError, match="out of memory"):
            stager.to_device(-1, 0, 4096, [], torch.device("cuda", 0))


def test_the_leases_thread_waits_for_each_copy_with_that_copys_device_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread that gives leases back waits on each copy's event: a CUDA runtime call, which on a
    thread with no device made current would create a context on device 0 (hundreds of MiB of a GPU the
    process may not use). It makes the copy's device current first, once per change. Pure logic: stand-in
    events and streams, a recording set_device."""
    from types import SimpleNamespace

    from skippyd.client.transfer import leases as leases_module

    made: list[int] = []
    seen: list[list[int]] = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)

    class Event:
        def synchronize(self) -> None:
            seen.append(list(made))

    leases = leases_module._Leases()
    for index in (3, 3, 1):
        leases.hold(Event(), [], None, SimpleNamespace(device=torch.device("cuda", index)))
    leases.hold(Event(), [], None, None)  # (the simulator's: no device)
    leases.drain()
    assert made == [3, 1] and seen == [[3], [3], [3, 1], [3, 1]]


def test_copies_in_flight_hold_at_most_a_quarter_of_the_open_files_limit_in_descriptors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply may carry 64 descriptors and 256 copies may be in flight: their duplicates would pass an
    engine's open-files limit (then every dup and open of the process fails). A new copy waits until
    the copies before it leave room; one copy alone always goes. Pure logic: stand-in events."""
    import resource

    from skippyd.client.transfer import leases as leases_module

    monkeypatch.setattr(resource, "getrlimit", lambda _: (400, 4096))
    leases = leases_module._Leases()
    assert leases._fd_budget == 100
    gates = [threading.Event() for _ in range(3)]

    class Event:
        def __init__(self, gate: threading.Event) -> None:
            self.gate = gate

        def synchronize(self) -> None:
            assert self.gate.wait(10)

    def fds(count: int) -> list[int]:
        return [os.open("/dev/null", os.O_RDONLY) for _ in range(count)]

    leases.hold(Event(gates[0]), fds(64), None, None)
    leases.hold(Event(gates[1]), fds(30), None, None)  # 94 held: within 100
    waited = threading.Event()

    def third() -> None:
        leases.room(64)  # 94 + 64 > 100: waits for the first copy to land
        waited.set()
        leases.hold(Event(gates[2]), fds(64), None, None)

    thread = threading.Thread(target=third)
    thread.start()
    assert not waited.wait(0.2), "no room until the copies before it landed"
    gates[0].set()
    assert waited.wait(5)
    thread.join(5)
    assert leases._fds == 94
    for gate in gates:
        gate.set()
    leases.drain()
    assert leases._fds == 0 and len(leases) == 0
    lone = leases_module._Leases()
    lone._fd_budget = 10
    lone.hold(Event(gates[0]), fds(64), None, None)  # one copy alone, whatever it holds
    lone.drain()


def test_a_transfers_pieces_merge_within_one_registration_and_one_across_a_boundary_is_cut_there() -> None:
    """The planning of a get_into's copies as arrays: pieces that continue each other merge into one run,
    never across a registration boundary (a piece that crosses one is cut there), never into another
    destination buffer, and a span picks the same bytes of every block."""
    from types import SimpleNamespace

    from skippyd.client.transfer.device import DeviceTransfer

    rec = Recorder()
    transfer = DeviceTransfer(register=rec.register, unregister=rec.unregister)
    hosts: Any = {"slab": SimpleNamespace(base=1 << 30)}
    pages, other = torch.zeros(4 * 8192, dtype=torch.uint8), torch.zeros(8192, dtype=torch.uint8)
    dests: Any = {"pages": pages, "other": other}
    # four 8 KiB blocks in consecutive slots into consecutive pages; a fifth into another buffer
    pieces = [("slab", 8192 * i, "pages", 8192 * i, 8192, 0) for i in range(4)]
    pieces.append(("slab", 4 * 8192, "other", 0, 8192, 0))
    both: list[Any] = [{"slab": [0, 5 * 8192]}, {"slab": [0, 8192 + 4096, 5 * 8192]}]  # one registration; two
    for cuts in both:
        flat, _, _ = transfer._flatten(pieces, hosts, dests, cuts)
        src, _, size, _, _ = flat.runs()
        got = sorted(zip((src - (1 << 30)).tolist(), size.tolist(), strict=True))
        if len(cuts["slab"]) == 2:
            assert got == [(0, 4 * 8192), (4 * 8192, 8192)]  # the pages merge; the other buffer apart
            assert transfer._flatten_arrays(pieces, hosts, dests, cuts) is not None
        else:  # block 1 crosses the boundary at 12 KiB: cut there, and no run spans it
            assert got == [(0, 8192 + 4096), (8192 + 4096, 3 * 8192 - 4096), (4 * 8192, 8192)]
            assert transfer._flatten_arrays(pieces, hosts, dests, cuts) is None
        src, _, size, _, _ = flat.runs(0, 4096)  # the first 4 KiB of every block
        assert sorted((src - (1 << 30)).tolist()) == [0, 8192, 16384, 24576, 32768]
        assert set(size.tolist()) == {4096}
    transfer.close()


def test_the_idle_sweep_makes_the_last_calls_device_current_on_its_own_thread_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unregistering is a CUDA runtime call: on the sweeper's thread, which no device was made current
    on, it would create a context on device 0. The sweep makes the device of the last call current
    there, once (not at every look), and on no other thread. Pure logic: a recording set_device."""
    import mmap
    import threading

    from skippyd.client.transfer.device import DeviceTransfer

    made: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: made.append((threading.current_thread().name, i)))
    rec = Recorder()
    transfer = DeviceTransfer(register=rec.register, unregister=rec.unregister)
    transfer._device_index = 2  # (the last call's device)
    transfer._sweeper = threading.Thread(target=lambda: None)  # (as after a first call: releases queue)

    def sweep_twice() -> None:
        for _ in range(2):
            mapping = mmap.mmap(-1, 4096)
            transfer.release_later(mapping, [])  # (something for the sweep to do)
            transfer.sweep_idle()
            assert mapping.closed

    sweeper = threading.Thread(target=sweep_twice, name="sweeper")
    sweeper.start()
    sweeper.join()
    assert made == [("sweeper", 2)]
    transfer._sweeper = None
    transfer.close()


def _closed(mapping: Any) -> bool:
    return bool(mapping.closed)  # (a call, so that mypy does not narrow it between two looks)


def test_a_staging_buffer_released_before_any_call_of_the_transfer_closes_at_once() -> None:
    """A process whose transfer has begun no call (its device restores so far were entries served once,
    say) has registered nothing and runs no idle sweeper: a staging buffer released then is unmapped at
    once, not queued for a call that may never come; one a copy still holds a view of is queued."""
    import mmap

    from skippyd.client.transfer.device import DeviceTransfer

    rec = Recorder()
    transfer = DeviceTransfer(register=rec.register, unregister=rec.unregister)
    free = mmap.mmap(-1, 8192)
    transfer.release_later(free, [1 << 20])
    assert _closed(free) and not transfer._released
    held = mmap.mmap(-1, 8192)
    view = memoryview(held)  # (a copy into it on its way)
    transfer.release_later(held, [2 << 20])
    assert not _closed(held) and len(transfer._released) == 1
    view.release()
    transfer.sweep_idle()
    assert _closed(held) and not transfer._released and rec.calls == []
    transfer.close()


def test_an_idle_sweep_that_cannot_make_its_device_current_still_unmaps_what_holds_no_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unregistering needs the device made current; unmapping a staging buffer nothing registered does
    not: where set_device fails, those still go, a registered one stays (never unmapped while
    registered), and the failure is raised for the sweeper to log."""
    import mmap
    import threading

    from skippyd.client.transfer import cuda
    from skippyd.client.transfer import device as dev

    def refuse(_index: int) -> None:
        raise RuntimeError("CUDA error: no device")

    rec = Recorder()
    transfer = dev.DeviceTransfer(register=rec.register, unregister=rec.unregister)
    transfer._sweeper = threading.Thread(target=lambda: None)  # (as after a first call: releases queue)
    transfer._device_index = 5
    plain, registered = mmap.mmap(-1, 8192), mmap.mmap(-1, 8192)
    assert transfer.book.ensure(("host", 4 << 20), 1, 4 << 20, [(0, 8192)], readonly=False) is not None
    transfer.release_later(plain, [3 << 20])
    transfer.release_later(registered, [4 << 20])
    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    with pytest.raises(RuntimeError, match="no device"):
        transfer.sweep_idle()
    assert _closed(plain) and not _closed(registered) and rec.count("unregister") == 0
    monkeypatch.setattr(torch.cuda, "set_device", lambda _index: None)
    transfer.sweep_idle()
    assert _closed(registered) and rec.count("unregister") == 1
    transfer._sweeper = None
    transfer.close()
    cuda._thread_device.__dict__.pop("index", None)  # (this thread's note of cuda:5, made by the stand-in)


def test_a_batch_call_takes_address_columns_given_as_read_only_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch call's arguments are ctypes arrays over numpy buffers; a caller's columns may be read-only
    arrays (views of a plan's), which ctypes cannot take as they are: the call gets writable copies and
    the columns' values. Pure logic: a batch stand-in that records what it was given."""
    import numpy as np

    from skippyd.client.transfer import cuda
    from skippyd.client.transfer.device import DeviceTransfer

    got: list[list[int]] = []

    def batch(dsts: Any, srcs: Any, sizes: Any, count: int, *_rest: Any) -> int:
        got.extend([list(dsts[:count]), list(srcs[:count]), list(sizes[:count])])
        return 0

    monkeypatch.setattr(cuda, "_batch", [batch])
    columns = [np.array(values, dtype=np.uint64) for values in ([8192, 16384], [4096, 12288], [100, 200])]
    for column in columns:
        column.flags.writeable = False
    rec = Recorder()
    transfer = DeviceTransfer(register=rec.register, unregister=rec.unregister)
    assert transfer._issue_batch(columns[0], columns[1], columns[2], sim.FakeStream())  # type: ignore[arg-type]
    assert got == [[8192, 16384], [4096, 12288], [100, 200]]
    transfer.close()
