"""The small state machines under the tier rules, driven directly: the eviction clock, the prefix index,
durable writes (their intent markers and the writer against a real L2 tier and L3 store) and L3 fills.

Everything here is a real object over real files; the only stand-ins are a promotion policy (a protocol
the fill table takes) and a :class:`Health` whose threads wait at a gate before their loop begins, so
work can be queued behind a writer that is alive but has not yet looked at its queue.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from l2util import IDENT, admit_bytes, borrow, key_of

from skippyd.durable import THREAD as WRITER
from skippyd.durable import DurableWriter, PendingMarks
from skippyd.errors import Busy
from skippyd.evictions import EvictionClock
from skippyd.fills import PROMOTER, FillTable, Loaded
from skippyd.index import Lengths, PrefixIndex
from skippyd.l2 import L2Tier, copy_into
from skippyd.l3 import L3Ref, L3Store
from skippyd.payload import Entry, TensorDecl
from skippyd.workers import Health

HUGE = 1 << 62  # a free-space floor no disk reaches: L3 is read-only under it


def until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Polls ``check`` until it holds or ``timeout`` passes; returns its last answer."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return check()
        time.sleep(0.005)
    return True


# ====================================================================== the eviction clock


@pytest.mark.parametrize("scope", ["digest", "key", "all"])
def test_an_eviction_during_a_write_cancels_it(scope: str) -> None:
    clock = EvictionClock()
    seq = clock.begin()
    assert not clock.cancelled("d1", seq, "k1")
    if scope == "digest":
        clock.evict("d1")
    elif scope == "key":
        clock.evict(None, key="k1")
    else:
        clock.evict(None)
    assert clock.cancelled("d1", seq, "k1")
    clock.end(seq)


def test_an_eviction_of_another_digest_or_key_does_not_cancel_a_write() -> None:
    clock = EvictionClock()
    seq = clock.begin()
    clock.evict("d2")
    clock.evict(None, key="k2")
    assert not clock.cancelled("d1", seq, "k1")
    assert clock.cancelled("d2", seq, "k1") and clock.cancelled("d1", seq, "k2")
    clock.end(seq)


def test_a_key_eviction_cancels_only_work_that_names_the_key() -> None:
    clock = EvictionClock()
    seq = clock.begin()
    clock.evict("ignored-digest", key="k1")  # a key eviction marks the key, not the digest
    assert clock.cancelled("d1", seq, "k1")
    assert not clock.cancelled("d1", seq), "work asking without a key is not covered by a key eviction"
    assert not clock.cancelled("ignored-digest", seq)
    clock.end(seq)


@pytest.mark.parametrize("scope", ["digest", "key", "all"])
def test_an_eviction_before_a_write_began_does_not_cancel_it(scope: str) -> None:
    clock = EvictionClock()
    if scope == "digest":
        clock.evict("d1")
    elif scope == "key":
        clock.evict(None, key="k1")
    else:
        clock.evict(None)
    seq = clock.begin()
    assert not clock.cancelled("d1", seq, "k1")
    clock.end(seq)


def test_work_continuing_earlier_work_is_cancelled_by_evictions_since_the_earlier_began() -> None:
    clock = EvictionClock()
    capture = clock.begin()
    clock.evict("d1")
    write = clock.begin(since=capture)  # the capture's durable write, queued after the eviction
    clock.end(capture)
    assert clock.cancelled("d1", write), "the eviction came while the capture ran: its write is void"
    assert clock.marks == 1, "the write still runs under the capture's number: the mark is kept"
    clock.end(write)
    assert clock.marks == 0


def test_outstanding_counts_begun_work_and_an_unbalanced_end_never_goes_negative() -> None:
    clock = EvictionClock()
    a, b = clock.begin(), clock.begin()
    assert clock.outstanding == 2
    clock.end(a)
    clock.end(b)
    clock.end(b)  # one too many
    clock.end(12345)  # a number nothing began under
    assert clock.outstanding == 0
    c = clock.begin()
    assert clock.outstanding == 1, "the extra end did not bank a credit"
    clock.end(c)


def test_marks_are_forgotten_once_no_write_older_than_them_is_outstanding() -> None:
    clock = EvictionClock()
    first, second = clock.begin(), clock.begin()
    clock.evict("d1")
    clock.evict(None, key="k1")
    assert clock.marks == 2
    clock.end(first)
    assert clock.marks == 2, "the second write still began before the marks"
    assert clock.cancelled("d1", second) and clock.cancelled("d0", first, "k1")
    clock.end(second)
    assert clock.marks == 0 and clock.outstanding == 0


def test_an_evict_all_keeps_cancelling_until_the_work_that_predates_it_ends() -> None:
    clock = EvictionClock()
    seq = clock.begin()
    clock.evict(None)
    other = clock.begin()
    clock.end(other)  # an unrelated unit of work ends; the first one is still running
    assert clock.cancelled("any", seq)
    assert not clock.cancelled("any", other)
    clock.end(seq)


def test_a_mark_is_forgotten_once_only_work_newer_than_it_is_outstanding() -> None:
    clock = EvictionClock()
    old = clock.begin()  # the old write
    for n in range(100):
        clock.evict(f"d{n}")
        newer = clock.begin()  # a newer write begins before the older one ends: one always runs
        clock.end(old)  # the oldest outstanding write ends; only work newer than every mark is left
        assert clock.marks == 0, "no outstanding work predates the mark"
        assert not clock.cancelled(f"d{n}", newer)
        old = newer
    assert clock.outstanding == 1
    clock.end(old)


def test_concurrent_evictions_lose_no_marks() -> None:
    clock = EvictionClock()
    holder = clock.begin()  # outstanding throughout: no mark may be pruned
    threads, rounds = 8, 300
    barrier = threading.Barrier(threads)

    def evictor(t: int) -> None:
        barrier.wait()
        for i in range(rounds):
            seq = clock.begin()
            clock.evict(f"d-{t}-{i}")
            clock.evict(None, key=f"k-{t}-{i}")
            assert clock.cancelled(f"d-{t}-{i}", seq)
            clock.end(seq)

    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(evictor, t) for t in range(threads)]:
            done.result(timeout=30)
    assert clock.marks == 2 * threads * rounds
    assert clock.outstanding == 1
    assert all(
        clock.cancelled(f"d-{t}-{i}", holder) and clock.cancelled("x", holder, f"k-{t}-{i}")
        for t in range(threads)
        for i in range(rounds)
    )
    later = clock.begin()
    assert not any(
        clock.cancelled(f"d-{t}-{i}", later, f"k-{t}-{i}") for t in range(threads) for i in range(rounds)
    )
    clock.end(later)
    clock.end(holder)
    assert clock.marks == 0 and clock.outstanding == 0


def test_concurrent_begin_and_end_keep_outstanding_balanced() -> None:
    clock = EvictionClock()
    threads, rounds = 8, 2000
    barrier = threading.Barrier(threads)

    def worker() -> None:
        barrier.wait()
        for _ in range(rounds):
            clock.end(clock.begin())

    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(worker) for _ in range(threads)]:
            done.result(timeout=30)
    assert clock.outstanding == 0


# ====================================================================== the prefix index


@dataclass(frozen=True, slots=True)
class Item:
    key: str
    identity: str
    token_count: int
    digest: str


@dataclass(frozen=True, slots=True, eq=False)  # compared by identity: the index must return these objects
class Rec:
    entry: Item


def rec(key: str, identity: str = "id-a", count: int = 1, digest: str | None = None) -> Rec:
    return Rec(Item(key, identity, count, digest or f"dg-{key}"))


def keys_in_order(index: PrefixIndex[Rec]) -> list[str]:
    return [r.entry.key for r in index]


def test_lengths_count_duplicates_and_keep_the_distinct_counts_sorted() -> None:
    lengths = Lengths()
    for n in (5, 2, 9, 5, 2):
        lengths.add(n)
    assert lengths.sorted == [2, 5, 9]
    assert lengths.upto(5) == [2, 5] and lengths.upto(1) == [] and lengths.upto(100) == [2, 5, 9]
    lengths.discard(5)
    assert lengths.sorted == [2, 5, 9], "one of the two entries of length 5 is left"
    lengths.discard(5)
    assert lengths.sorted == [2, 9] and 5 not in lengths.counts


def test_lengths_discarding_an_unknown_count_changes_nothing() -> None:
    lengths = Lengths()
    lengths.add(3)
    lengths.discard(7)
    lengths.discard(7)
    assert lengths.sorted == [3] and lengths.counts == {3: 1}


def test_the_index_keeps_least_recently_used_first_and_touch_moves_a_record_last() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    a, b, c = rec("a"), rec("b"), rec("c")
    for r in (a, b, c):
        assert index.add(r) is None
    assert keys_in_order(index) == ["a", "b", "c"] and index.oldest() is a
    assert index.touch("a") is a
    assert keys_in_order(index) == ["b", "c", "a"] and index.oldest() is b
    assert index.touch("missing") is None
    assert keys_in_order(index) == ["b", "c", "a"]
    assert len(index) == 3 and "c" in index and "missing" not in index and index.get("c") is c


def test_insert_oldest_puts_a_record_before_every_other() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    index.add(rec("a"))
    index.add(rec("b"))
    old = rec("z")
    index.insert_oldest(old)
    assert keys_in_order(index) == ["z", "a", "b"] and index.oldest() is old
    again = rec("b", count=4)
    index.insert_oldest(again)  # an existing key: replaced and moved first
    assert keys_in_order(index) == ["b", "z", "a"] and index.get("b") is again
    assert index.lengths("id-a", 10) == [1, 4]


def test_an_empty_index_has_no_oldest_no_lengths_and_no_keys() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    assert index.oldest() is None and index.remove("a") is None and index.touch("a") is None
    assert index.lengths("id-a", 100) == [] and index.keys_of("dg") == [] and index.digests() == []


def test_replacing_a_record_under_its_key_moves_its_digest_and_its_length() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    first = rec("a", count=3, digest="d1")
    index.add(first)
    index.add(rec("b"))
    second = rec("a", count=7, digest="d2")
    assert index.add(second) is first
    assert len(index) == 2 and index.get("a") is second
    assert keys_in_order(index) == ["b", "a"], "the replacement is the most recently used"
    assert index.keys_of("d1") == [] and index.keys_of("d2") == ["a"]
    assert "d1" not in index.digests()
    assert index.lengths("id-a", 100) == [1, 7], "the old length 3 went with the old record"


def test_replacing_a_record_with_another_identity_moves_its_length_there() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    index.add(rec("a", identity="id-a", count=3))
    index.add(rec("a", identity="id-b", count=3))
    assert index.lengths("id-a", 10) == [] and index.lengths("id-b", 10) == [3]


def test_keys_sharing_one_digest_are_all_found_and_leave_it_one_by_one() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    for key in ("c", "a", "b"):
        index.add(rec(key, digest="shared"))
    index.add(rec("x", digest="alone"))
    assert index.keys_of("shared") == ["a", "b", "c"]
    assert sorted(index.digests()) == ["alone", "shared"]
    assert index.remove("b") is not None
    assert index.keys_of("shared") == ["a", "c"]
    assert index.remove("a") is not None
    assert index.keys_of("shared") == ["c"]
    index.add(rec("d", digest="shared"))  # back to two after collapsing to one
    assert index.keys_of("shared") == ["c", "d"]
    index.remove("c")
    index.remove("d")
    assert index.keys_of("shared") == [] and index.digests() == ["alone"]


def test_removing_one_of_two_records_of_a_length_keeps_the_length() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    index.add(rec("a", count=4))
    index.add(rec("b", count=4))
    index.add(rec("c", count=9))
    index.remove("a")
    assert index.lengths("id-a", 100) == [4, 9]
    index.remove("b")
    assert index.lengths("id-a", 100) == [9] and index.lengths("id-a", 8) == []
    index.remove("c")
    assert index.lengths("id-a", 100) == []


def test_clear_returns_the_records_least_recently_used_first_and_forgets_everything() -> None:
    index: PrefixIndex[Rec] = PrefixIndex()
    records = [rec("a", count=2, digest="d"), rec("b", count=5, digest="d"), rec("c", identity="id-b")]
    for r in records:
        index.add(r)
    index.touch("a")
    cleared = index.clear()
    assert [r.entry.key for r in cleared] == ["b", "c", "a"]
    assert all(x is y for x, y in zip(cleared, [records[1], records[2], records[0]], strict=True))
    assert len(index) == 0 and index.oldest() is None and list(index) == []
    assert index.lengths("id-a", 100) == [] and index.lengths("id-b", 100) == []
    assert index.keys_of("d") == [] and index.digests() == []
    index.add(rec("a", count=2, digest="d"))  # usable afterwards
    assert index.keys_of("d") == ["a"] and index.lengths("id-a", 100) == [2]


KEYS = [f"k{n}" for n in range(12)]
IDENTITIES = ["id-a", "id-b", "id-c"]
DIGESTS = ["d0", "d1", "d2", "d3"]


@dataclass
class IndexModel:
    """The reference: records by key and the keys in least-recently-used order, nothing clever."""

    records: dict[str, Rec] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def put(self, record: Rec, *, oldest: bool = False) -> Rec | None:
        key = record.entry.key
        old = self.records.get(key)
        if key in self.order:
            self.order.remove(key)
        self.order.insert(0, key) if oldest else self.order.append(key)
        self.records[key] = record
        return old

    def remove(self, key: str) -> Rec | None:
        if key in self.order:
            self.order.remove(key)
        return self.records.pop(key, None)


def check_against(index: PrefixIndex[Rec], model: IndexModel, rng: random.Random) -> None:
    expected = [model.records[k] for k in model.order]
    got = list(index)
    assert len(got) == len(expected) == len(index)
    assert all(x is y for x, y in zip(got, expected, strict=True)), (keys_in_order(index), model.order)
    assert index.oldest() is (expected[0] if expected else None)
    for key in KEYS:
        assert (key in index) == (key in model.records)
        assert index.get(key) is model.records.get(key)
    for identity in IDENTITIES:
        upto = rng.randint(0, 10)
        want = sorted(
            {r.entry.token_count for r in model.records.values() if r.entry.identity == identity}
            & set(range(upto + 1))
        )
        assert index.lengths(identity, upto) == want, (identity, upto)
    for digest in DIGESTS:
        assert index.keys_of(digest) == sorted(
            k for k, r in model.records.items() if r.entry.digest == digest
        )
    digests = index.digests()
    assert len(digests) == len(set(digests))
    assert set(digests) == {r.entry.digest for r in model.records.values()}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_operations_on_the_index_match_a_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    index: PrefixIndex[Rec] = PrefixIndex()
    model = IndexModel()
    for _ in range(3000):
        op = rng.random()
        key = rng.choice(KEYS)
        if op < 0.35:
            record = Rec(Item(key, rng.choice(IDENTITIES), rng.randint(1, 8), rng.choice(DIGESTS)))
            assert index.add(record) is model.put(record)
        elif op < 0.45:
            record = Rec(Item(key, rng.choice(IDENTITIES), rng.randint(1, 8), rng.choice(DIGESTS)))
            model.put(record, oldest=True)
            index.insert_oldest(record)
        elif op < 0.7:
            assert index.remove(key) is model.remove(key)
        elif op < 0.95:
            want = model.records.get(key)
            if want is not None:
                model.order.remove(key)
                model.order.append(key)
            assert index.touch(key) is want
        elif op < 0.99:
            victim = index.oldest()
            if victim is not None:  # what an LRU eviction does
                assert victim.entry.key == model.order[0]
                assert index.remove(victim.entry.key) is model.remove(victim.entry.key)
        else:
            expected = [model.records[k] for k in model.order]
            cleared = index.clear()
            assert len(cleared) == len(expected)
            assert all(x is y for x, y in zip(cleared, expected, strict=True))
            model = IndexModel()
        check_against(index, model, rng)


# ====================================================================== intent markers

D1, D2 = "1" * 64, "2" * 64


def test_a_marker_is_created_listed_and_removed(tmp_path: Path) -> None:
    marks = PendingMarks(tmp_path / "l2" / "pending")
    assert (tmp_path / "l2" / "pending").is_dir()
    assert oct((tmp_path / "l2" / "pending").stat().st_mode & 0o777) == oct(0o700)
    k1, k2 = key_of("one"), key_of("two")
    marks.mark(k1, D1)
    marks.mark(k2, D2)
    assert marks.load() == {k1: D1, k2: D2}
    assert (marks.directory / k1).read_text() == D1
    marks.clear(k1)
    assert marks.load() == {k2: D2}
    marks.clear(k1)  # already gone: fine
    assert not [p for p in marks.directory.iterdir() if p.name != k2], "no temporary file is left behind"


def test_a_marker_is_rewritten_by_a_newer_digest_and_cleared_only_by_the_digest_it_names(
    tmp_path: Path,
) -> None:
    marks = PendingMarks(tmp_path / "pending")
    key = key_of("k")
    marks.mark(key, D1)
    marks.mark(key, D2)
    assert marks.load() == {key: D2}
    marks.clear(key, D1)  # an older write finishing must not drop the newer intent
    assert marks.load() == {key: D2}
    marks.clear(key, D2)
    assert marks.load() == {}


def test_markers_survive_a_new_instance_over_the_same_directory(tmp_path: Path) -> None:
    directory = tmp_path / "l2" / "pending"
    first = PendingMarks(directory)
    first.mark(key_of("a"), D1)
    first.mark(key_of("b"), D2)
    second = PendingMarks(directory)
    assert second.load(clean=True) == {key_of("a"): D1, key_of("b"): D2}
    second.clear(key_of("a"))
    assert first.load() == {key_of("b"): D2}


def test_junk_in_the_marker_directory_is_ignored_and_cleaned_at_start(tmp_path: Path) -> None:
    marks = PendingMarks(tmp_path / "pending")
    good = key_of("good")
    marks.mark(good, D1)
    d = marks.directory
    (d / "not-a-key").write_text(D1)  # a name that is no key
    (d / key_of("junk")).write_text("not a digest")  # a key naming no digest
    (d / key_of("empty")).write_bytes(b"")
    (d / key_of("upper")).write_text(D1.upper().replace("1", "A"))  # not lowercase hex
    (d / "0123abcd.tmp").write_text(D2)  # a marker whose rename a crash prevented
    (d / key_of("link")).symlink_to(d / good)  # never followed
    (d / "subdir").mkdir()
    (d / "subdir" / "x").write_text("x")
    assert marks.load() == {good: D1}
    assert len(list(d.iterdir())) == 8, "load() without clean removes nothing"
    assert marks.load(clean=True) == {good: D1}
    assert [p.name for p in d.iterdir()] == [good]
    marks.clear(key_of("junk"), D1)  # clearing a key that no longer exists is fine
    assert marks.load() == {good: D1}


def test_a_directory_named_like_a_key_in_the_marker_directory_is_cleaned_not_fatal(tmp_path: Path) -> None:
    marks = PendingMarks(tmp_path / "pending")
    good = key_of("good")
    marks.mark(good, D1)
    (marks.directory / key_of("a-directory")).mkdir()
    assert marks.load(clean=True) == {good: D1}
    assert [p.name for p in marks.directory.iterdir()] == [good]


# ====================================================================== the durable writer


class GatedHealth(Health):
    """A real :class:`Health` whose threads wait for :attr:`gate` before running their loop."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def start(self, name: str, target: Callable[[], None]) -> threading.Thread:
        def gated() -> None:
            self.gate.wait(timeout=30)
            target()

        return super().start(name, gated)


@dataclass
class Rig:
    l2: L2Tier
    l3: L3Store
    clock: EvictionClock
    health: GatedHealth
    writer: DurableWriter

    def capture(
        self, name: str, fill: int, *, nbytes: int = 4096, durable: bool = True, sync: bool = False
    ) -> tuple[Entry, str]:
        """What :meth:`skippyd.tiers.Tiers.capture` does around the writer: a number on the clock, the
        intent recorded before the entry is visible, the write submitted once it is committed."""
        seq = self.clock.begin()
        try:
            entry = self.commit(name, fill, nbytes=nbytes, durable=durable)
            if not durable:
                return entry, "none"
            return entry, self.writer.submit(entry, seq, sync=sync, timeout=5.0)
        finally:
            self.clock.end(seq)

    def commit(self, name: str, fill: int, *, nbytes: int = 4096, durable: bool = True) -> Entry:
        """The entry committed into L2, its intent recorded right before it becomes visible."""
        key = key_of(name)
        with self.l2.reserve(
            key=key, identity=IDENT, token_count=len(name), tensors=[TensorDecl("x", "uint8", (nbytes,))]
        ) as reservation:
            spec = reservation.tensors[0]
            copy_into(reservation.data, spec.offset, spec.nbytes, bytes([fill]) * nbytes)
            return reservation.commit(
                before_publish=lambda digest: self.writer.intend(key, digest, durable=durable)
            )

    def l3_payload(self, key: str) -> bytes:
        manifest = self.l3.manifest(key)
        buf = bytearray(manifest.entry.data_len)
        self.l3.load_into(key, memoryview(buf))
        spec = manifest.entry.tensors[0]
        return bytes(buf[spec.offset : spec.offset + spec.nbytes])

    def l3_digest(self, key: str) -> str | None:
        ref = self.l3.get(key)
        return ref.entry.digest if ref is not None else None


RigFactory = Callable[..., Rig]


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[RigFactory]:
    made: list[Rig] = []

    def make(
        *,
        queue_size: int = 64,
        l3_budget: int = 1 << 30,
        min_free: int = 0,
        start: bool = True,
        gate_open: bool = True,
    ) -> Rig:
        n = len(made)
        l2 = L2Tier.open(tmp_path / f"l2-{n}", 64 << 20)
        l3 = L3Store.open(tmp_path / f"l3-{n}", l3_budget, min_free_bytes=min_free)
        health = GatedHealth()
        if gate_open:
            health.gate.set()
        clock = EvictionClock()
        rig = Rig(l2, l3, clock, health, DurableWriter(l2, l3, clock, health, queue_size=queue_size))
        made.append(rig)
        if start:
            rig.writer.start()
        return rig

    try:
        yield make
    finally:
        for rig in made:
            rig.health.gate.set()
            rig.writer.close(timeout=2.0)
            rig.l3.close()
            rig.l2.close()


def test_a_queued_write_lands_in_l3_with_the_entrys_bytes(make_rig: RigFactory) -> None:
    rig = make_rig()
    entry, durability = rig.capture("alpha", fill=0x5A, nbytes=10000)
    assert durability == "queued"
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(entry.key) == entry.digest
    assert rig.l3_payload(entry.key) == bytes([0x5A]) * 10000
    stats = rig.writer.stats()
    assert (stats.queued, stats.written, stats.skipped, stats.failed) == (1, 1, 0, 0)
    assert rig.writer.marks.load() == {}, "the marker goes once the write is done"
    assert rig.clock.outstanding == 0


def test_a_capture_whose_bytes_l3_already_holds_under_its_key_is_written_at_once(
    make_rig: RigFactory,
) -> None:
    rig = make_rig()
    rig.capture("alpha", fill=1)
    assert rig.writer.wait_idle(timeout=5)
    entry, durability = rig.capture("alpha", fill=1)  # the same bytes again
    assert durability == "written"
    assert rig.writer.stats().queued == 1 and rig.writer.marks.load() == {}
    assert rig.l3_digest(entry.key) == entry.digest


def test_a_sync_write_returns_once_it_is_in_l3_and_its_marker_is_gone(make_rig: RigFactory) -> None:
    rig = make_rig()
    entry, durability = rig.capture("alpha", fill=3, sync=True)
    assert durability == "written"
    # nothing waited for: by the time the reply is made, the manifest is in place and the intent done
    assert rig.l3_digest(entry.key) == entry.digest
    assert rig.l3.layout.manifest_path(entry.key).is_file()
    assert rig.writer.marks.load() == {}
    stats = rig.writer.stats()
    assert stats.sync_waits == 1 and stats.sync_timeouts == 0 and stats.written == 1


def test_a_sync_write_the_writer_does_not_reach_in_time_is_reported_queued_and_still_written(
    make_rig: RigFactory,
) -> None:
    rig = make_rig(gate_open=False)  # alive, but not yet at its queue
    key = key_of("alpha")
    seq = rig.clock.begin()
    try:
        entry = rig.commit("alpha", 1, nbytes=64)
        began = time.monotonic()
        assert rig.writer.submit(entry, seq, sync=True, timeout=0.2) == "queued"
        assert time.monotonic() - began < 2.0
    finally:
        rig.clock.end(seq)
    assert rig.writer.stats().sync_timeouts == 1
    assert rig.writer.marks.load() == {key: entry.digest}, "the intent is kept while the write waits"
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(key) == entry.digest and rig.writer.marks.load() == {}


def test_a_write_superseded_by_a_newer_durable_capture_writes_only_the_newest(make_rig: RigFactory) -> None:
    rig = make_rig(gate_open=False)
    old, first = rig.capture("alpha", fill=1)
    new, second = rig.capture("alpha", fill=2)
    assert (first, second) == ("queued", "queued") and old.key == new.key and old.digest != new.digest
    assert rig.writer.marks.load() == {new.key: new.digest}
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(new.key) == new.digest
    assert rig.l3_payload(new.key) == bytes([2]) * 4096
    stats = rig.writer.stats()
    assert stats.written == 1 and stats.skipped == 1
    assert rig.l3.stats().writes == 1, "the older bytes never went to disk"
    assert rig.writer.marks.load() == {}


def test_a_write_superseded_by_a_newer_non_durable_capture_writes_nothing(make_rig: RigFactory) -> None:
    rig = make_rig(gate_open=False)
    old, durability = rig.capture("alpha", fill=1)
    assert durability == "queued"
    new, _ = rig.capture("alpha", fill=2, durable=False)
    assert rig.writer.marks.load() == {}, "a non-durable capture withdraws the older intent"
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3.get(old.key) is None
    assert rig.writer.stats().skipped == 1 and rig.l3.stats().writes == 0
    current = rig.l2.peek(new.key)
    assert current is not None and current.digest == new.digest


@pytest.mark.parametrize("scope", ["digest", "key", "all"])
def test_an_eviction_while_a_write_is_queued_cancels_it(make_rig: RigFactory, scope: str) -> None:
    rig = make_rig(gate_open=False)
    entry, durability = rig.capture("alpha", fill=4)
    kept, _ = rig.capture("bravo", fill=5)  # another digest and key
    assert durability == "queued"
    digest = entry.digest if scope == "digest" else None
    key = entry.key if scope == "key" else None
    rig.clock.evict(digest, key=key)  # what Tiers._mark_evicted does
    rig.writer.forget(digest, key=key)
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3.get(entry.key) is None
    if scope == "all":
        assert rig.l3.get(kept.key) is None
        assert rig.writer.stats().skipped == 2
    else:
        assert rig.l3_digest(kept.key) == kept.digest, "the eviction named only the other entry"
        assert rig.writer.stats().skipped == 1
    assert rig.writer.marks.load() == {}


@pytest.mark.parametrize("scope", ["digest", "key", "all"])
def test_an_eviction_before_a_capture_began_does_not_cancel_its_write(
    make_rig: RigFactory, scope: str
) -> None:
    rig = make_rig(gate_open=False)
    probe, _ = rig.capture("probe", fill=4, durable=False)  # the same bytes: the digest to come
    digest = probe.digest if scope == "digest" else None
    key = key_of("alpha") if scope == "key" else None
    rig.clock.evict(digest, key=key)
    rig.writer.forget(digest, key=key)
    entry, durability = rig.capture("alpha", fill=4)
    assert durability == "queued" and entry.digest == probe.digest
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(entry.key) == entry.digest


def test_a_write_deferred_by_a_full_queue_is_written_once_the_writer_gets_to_it(make_rig: RigFactory) -> None:
    rig = make_rig(queue_size=1, gate_open=False)
    a, first = rig.capture("alpha", fill=1)
    b, second = rig.capture("bravo", fill=2)
    assert (first, second) == ("queued", "deferred")
    stats = rig.writer.stats()
    assert stats.queue_depth == 1 and stats.backlog == 1
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(a.key) == a.digest and rig.l3_digest(b.key) == b.digest
    assert rig.l3_payload(b.key) == bytes([2]) * 4096
    stats = rig.writer.stats()
    assert (stats.queued, stats.deferred, stats.written, stats.lost, stats.backlog) == (1, 1, 2, 0, 0)
    assert rig.writer.marks.load() == {}


def test_a_deferred_write_whose_entry_left_l2_first_is_counted_lost_and_not_written(
    make_rig: RigFactory,
) -> None:
    rig = make_rig(queue_size=1, gate_open=False)
    a, _ = rig.capture("alpha", fill=1)
    b, durability = rig.capture("bravo", fill=2)
    assert durability == "deferred"
    assert rig.l2.remove(b.key)  # LRU or an operator: the backlog holds no lease on its bytes
    rig.health.gate.set()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3.get(b.key) is None
    assert rig.l3_digest(a.key) == a.digest
    stats = rig.writer.stats()
    assert stats.lost == 1 and stats.written == 1 and stats.backlog == 0
    assert rig.writer.marks.load() == {}, "a lost write leaves no intent behind"


def test_a_deferred_write_whose_lease_cannot_be_had_now_waits_and_the_writer_lives(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a deferred write takes a lease on its entry; when the tier cannot give one right now (it
    raises), the write goes back to the backlog and is tried again: it never took the writer thread down
    (a client's flock once made every lease of a file fail, and the L3 writer died of it)."""
    from skippyd.errors import Busy

    rig = make_rig(start=False)
    entry, durability = rig.capture("alpha", fill=3)
    assert durability == "deferred"
    real = rig.l2.hold
    refusals = [Busy("could not take a read lease")]

    def hold(key: str, **kwargs: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return real(key, **kwargs)

    monkeypatch.setattr(rig.l2, "hold", hold)
    rig.writer.start()
    assert rig.writer.wait_idle(timeout=10)
    assert not refusals and rig.writer.alive
    assert rig.l3_digest(entry.key) == entry.digest
    stats = rig.writer.stats()
    assert (stats.written, stats.lost, stats.backlog, stats.failed) == (1, 0, 0, 0)


def test_a_deferred_write_whose_key_was_captured_again_writes_only_the_newest(
    make_rig: RigFactory,
) -> None:
    rig = make_rig(start=False)  # the writer is down: every durable write is deferred
    old, durability = rig.capture("alpha", fill=1)
    assert durability == "deferred"
    new, again = rig.capture("alpha", fill=2)
    assert again == "deferred"
    assert rig.writer.stats().backlog == 1, "the newer intent replaced the older one in the backlog"
    rig.writer.start()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(new.key) == new.digest != old.digest
    assert rig.l3.stats().writes == 1 and rig.writer.stats().lost == 0


def test_an_eviction_drops_a_deferred_write_and_its_marker(make_rig: RigFactory) -> None:
    rig = make_rig(start=False)
    a, _ = rig.capture("alpha", fill=1)
    b, _ = rig.capture("bravo", fill=2)
    assert rig.writer.stats().backlog == 2
    rig.clock.evict(b.digest)
    rig.writer.forget(b.digest)
    assert rig.writer.stats().backlog == 1
    assert rig.writer.marks.load() == {a.key: a.digest}
    rig.writer.start()
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3.get(b.key) is None and rig.l3_digest(a.key) == a.digest
    assert rig.writer.stats().lost == 0


def test_a_read_only_l3_defers_a_write_until_it_has_room_again(make_rig: RigFactory) -> None:
    rig = make_rig(min_free=HUGE)
    assert rig.l3.readonly
    entry, durability = rig.capture("alpha", fill=6)
    assert durability == "deferred"
    time.sleep(0.05)  # the writer sees L3 read-only and leaves the backlog be
    assert rig.l3.get(entry.key) is None and rig.writer.stats().backlog == 1
    assert rig.writer.marks.load() == {entry.key: entry.digest}, "the intent is kept"
    rig.l3.min_free_bytes = 0  # room again
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(entry.key) == entry.digest
    assert rig.writer.stats().written == 1 and rig.writer.marks.load() == {}


def test_l3_turning_read_only_under_a_queued_write_defers_it_and_the_next_write_releases_it(
    make_rig: RigFactory,
) -> None:
    """A write refused for room (NoSpace) goes back to the backlog with its intent, and waits; a write that
    succeeds shows L3 has room again and the backlog need not wait any longer."""
    rig = make_rig(gate_open=False)
    first, durability = rig.capture("alpha", fill=7)
    assert durability == "queued"
    rig.l3.min_free_bytes = HUGE
    rig.health.gate.set()
    assert until(lambda: rig.writer.stats().failed == 1)
    assert until(lambda: rig.writer.stats().backlog == 1 and rig.writer.stats().queue_depth == 0)
    assert rig.l3.get(first.key) is None
    assert rig.writer.marks.load() == {first.key: first.digest}
    assert rig.health.snapshot()[WRITER].errors == 1 and rig.writer.alive
    rig.l3.min_free_bytes = 0
    second, again = rig.capture("bravo", fill=8)
    assert again == "queued"
    assert rig.writer.wait_idle(timeout=3)
    assert rig.l3_digest(first.key) == first.digest and rig.l3_digest(second.key) == second.digest
    assert rig.writer.marks.load() == {}


def test_a_write_too_large_for_l3_fails_once_drops_its_intent_and_the_writer_goes_on(
    make_rig: RigFactory,
) -> None:
    rig = make_rig(l3_budget=16 << 10)
    big, durability = rig.capture("alpha", fill=1, nbytes=32 << 10)
    assert durability == "queued"
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3.get(big.key) is None
    assert rig.writer.stats().failed == 1
    assert rig.health.snapshot()[WRITER].errors == 1
    assert rig.writer.marks.load() == {}, "L3 can never hold it: the intent is void"
    small, _ = rig.capture("bravo", fill=2, nbytes=64)
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(small.key) == small.digest
    assert rig.writer.alive and rig.health.healthy


def test_writes_left_undone_by_an_earlier_run_are_recovered_and_stale_markers_dropped(
    make_rig: RigFactory, tmp_path: Path
) -> None:
    directory = tmp_path / "l2-crashed"
    with L2Tier.open(directory, 64 << 20) as before:
        undone = admit_bytes(before, "undone", 3000, fill=1)
        other = admit_bytes(before, "other", 3000, fill=2)
        marks = PendingMarks(directory / "pending")
        marks.mark(undone.key, undone.digest)
        marks.mark(other.key, D1)  # names bytes L2 no longer holds under the key
        marks.mark(key_of("gone"), D2)  # its entry did not survive
    rig = make_rig(start=False)
    l2 = L2Tier.open(directory, 64 << 20)  # the next start re-adopts the entries
    try:
        writer = DurableWriter(l2, rig.l3, rig.clock, rig.health)
        assert writer.recover() == 1
        assert writer.stats().recovered == 1 and writer.stats().backlog == 1
        assert writer.marks.load() == {undone.key: undone.digest}, "stale markers were dropped"
        writer.start()
        try:
            assert writer.wait_idle(timeout=5)
            assert rig.l3_digest(undone.key) == undone.digest
            assert rig.l3_payload(undone.key) == bytes([1]) * 3000
            assert rig.l3.get(other.key) is None
            assert writer.marks.load() == {}
            writer.marks.mark(undone.key, undone.digest)  # a marker of bytes L3 already holds
            assert writer.recover() == 0 and writer.marks.load() == {}
        finally:
            writer.close(timeout=2.0)
    finally:
        l2.close()


def test_a_sync_write_of_bytes_an_earlier_queued_write_put_in_l3_reports_written(
    make_rig: RigFactory,
) -> None:
    rig = make_rig(gate_open=False)
    entry, durability = rig.capture("alpha", fill=9)
    assert durability == "queued"
    with ThreadPoolExecutor(1) as pool:
        again = pool.submit(rig.capture, "alpha", 9, sync=True)
        assert until(lambda: rig.writer.stats().queue_depth == 2)
        rig.health.gate.set()
        _, reply = again.result(timeout=5)
    assert rig.l3_digest(entry.key) == entry.digest
    assert reply == "written"


def test_an_entry_evicted_from_l2_before_its_write_was_queued_leaves_no_marker(make_rig: RigFactory) -> None:
    rig = make_rig()
    key = key_of("alpha")
    seq = rig.clock.begin()
    try:
        entry = rig.commit("alpha", 1, nbytes=64)
        assert rig.l2.remove(key)  # LRU took it between the commit and the submit
        assert rig.writer.submit(entry, seq) == "none"
    finally:
        rig.clock.end(seq)
    assert rig.writer.marks.load() == {}


# ====================================================================== L3 fills


class Policy:
    """A promotion policy answering ``answer``; it can hold the promoter, or raise, while it decides."""

    def __init__(self, answer: bool = True, *, hold: threading.Event | None = None) -> None:
        self.answer = answer
        self.hold = hold
        self.fail_consider = False
        self.fail_settle = False
        self.asked: list[str] = []
        self.settled: list[str] = []
        self.asking = threading.Event()

    def consider(self, digest: str, token_count: int, payload_bytes: int, /) -> bool:
        self.asked.append(digest)
        self.asking.set()
        if self.hold is not None:
            self.hold.wait(timeout=10)
        if self.fail_consider:
            raise RuntimeError("the policy's store is unreachable")
        return self.answer

    def settle(self, digest: str, /) -> None:
        if self.fail_settle:
            raise RuntimeError("settling failed")
        self.settled.append(digest)


@dataclass
class FillRig:
    staging: L2Tier  # where test entries are made before they are written into L3
    l2: L2Tier
    l3: L3Store
    clock: EvictionClock
    health: Health
    fills: FillTable
    policy: Policy

    def stage(self, name: str, fill: int, nbytes: int = 16384) -> L3Ref:
        """An entry that only L3 holds."""
        entry = admit_bytes(self.staging, name, nbytes, fill)
        with borrow(self.staging, entry.key) as (held, view):
            assert self.l3.write(held, view)
        self.staging.remove(entry.key)
        ref = self.l3.get(entry.key)
        assert ref is not None and ref.entry.digest == entry.digest
        return ref

    def restore(self, ref: L3Ref) -> Loaded:
        seq = self.clock.begin()
        try:
            return self.fills.open(ref, seq)
        finally:
            self.clock.end(seq)

    def settled(self) -> bool:
        """No fill in flight and none of their clock numbers outstanding: every decision carried out."""
        return self.fills.in_flight == 0 and self.clock.outstanding == 0


def payload(loaded: Loaded) -> bytes:
    spec = loaded.manifest.entry.tensors[0]
    return os.pread(loaded.fd, spec.nbytes, loaded.data_offset + spec.offset)


FillFactory = Callable[..., FillRig]


@pytest.fixture
def make_fills(tmp_path: Path) -> Iterator[FillFactory]:
    made: list[FillRig] = []

    def make(
        policy: Policy, *, l2_budget: int = 64 << 20, fill_budget: int = 2 << 30, queue_size: int = 16
    ) -> FillRig:
        n = len(made)
        staging = L2Tier.open(tmp_path / f"staging-{n}", 64 << 20)
        l2 = L2Tier.open(tmp_path / f"l2-{n}", l2_budget)
        l3 = L3Store.open(tmp_path / f"l3-{n}", 1 << 30)
        clock, health = EvictionClock(), Health()
        fills = FillTable(l2, l3, clock, health, promotions=policy, budget=fill_budget, queue_size=queue_size)
        rig = FillRig(staging, l2, l3, clock, health, fills, policy)
        made.append(rig)
        return rig

    try:
        yield make
    finally:
        for rig in made:
            if rig.policy.hold is not None:
                rig.policy.hold.set()
            rig.fills.close(timeout=2.0)
            rig.l3.close()
            rig.l2.close()
            rig.staging.close()


def test_a_promoted_fill_moves_the_entry_into_l2(make_fills: FillFactory) -> None:
    rig = make_fills(Policy(True))
    ref = rig.stage("alpha", fill=0x33)
    loaded = rig.restore(ref)
    try:
        assert payload(loaded) == bytes([0x33]) * 16384
        assert loaded.manifest.entry.digest == ref.entry.digest
    finally:
        os.close(loaded.fd)
    assert until(rig.settled)
    promoted = rig.l2.peek(ref.entry.key)
    assert promoted is not None and promoted.digest == ref.entry.digest and promoted.origin == "l3"
    stats = rig.fills.stats()
    assert (stats.fills, stats.promotions, stats.promotions_declined, stats.fill_bytes) == (1, 1, 0, 0)
    assert rig.policy.asked == [ref.entry.digest] and rig.policy.settled == [ref.entry.digest]


def test_a_declined_fill_gives_its_memory_back_and_leaves_l2_as_it_was(make_fills: FillFactory) -> None:
    rig = make_fills(Policy(False))
    ref = rig.stage("alpha", fill=1)
    os.close(rig.restore(ref).fd)
    assert until(rig.settled)
    assert rig.l2.peek(ref.entry.key) is None
    l2 = rig.l2.stats()
    assert l2.entries == 0 and l2.reserved_bytes == 0
    assert rig.fills.stats().promotions_declined == 1 and rig.policy.settled == []


def test_two_restores_of_one_l3_entry_share_one_fill(make_fills: FillFactory) -> None:
    hold = threading.Event()
    rig = make_fills(Policy(True, hold=hold))
    ref = rig.stage("alpha", fill=0x44)
    first = rig.restore(ref)
    try:
        assert rig.policy.asking.wait(5)  # the fill is loaded; its promotion is being decided
        assert rig.fills.in_flight == 1
        second = rig.restore(ref)  # joins the fill in the table
        try:
            assert second.fd != first.fd
            assert payload(first) == payload(second) == bytes([0x44]) * 16384
            stats = rig.fills.stats()
            assert stats.fills == 1 and stats.fill_waits == 1
            assert rig.l3.stats().fills == 1, "the object was read from disk once"
            hold.set()
            assert until(rig.settled)
            promoted = rig.l2.peek(ref.entry.key)
            assert promoted is not None and promoted.digest == ref.entry.digest
            assert payload(second) == bytes([0x44]) * 16384, "a restore's own fd outlives the promotion"
        finally:
            os.close(second.fd)
    finally:
        os.close(first.fd)
    assert rig.policy.asked == [ref.entry.digest], "one fill, one decision"


def test_concurrent_restores_of_one_l3_entry_load_it_once(make_fills: FillFactory) -> None:
    hold = threading.Event()
    rig = make_fills(Policy(False, hold=hold))
    ref = rig.stage("alpha", fill=0x45, nbytes=1 << 20)
    restores = 6
    barrier = threading.Barrier(restores)

    def restore() -> bytes:
        barrier.wait()
        loaded = rig.restore(ref)
        try:
            return payload(loaded)
        finally:
            os.close(loaded.fd)

    with ThreadPoolExecutor(restores) as pool:
        got = [done.result(timeout=10) for done in [pool.submit(restore) for _ in range(restores)]]
    assert got == [bytes([0x45]) * (1 << 20)] * restores
    stats = rig.fills.stats()
    assert stats.fills == 1 and stats.fill_waits == restores - 1
    assert rig.l3.stats().fills == 1
    hold.set()
    assert until(rig.settled)


def test_the_fill_budget_refuses_a_second_memfd_fill_past_its_limit(make_fills: FillFactory) -> None:
    """L2 cannot hold these entries at all, so fills go to memfds; one may always run, however large,
    and while it is held a second one is refused (the restore serves a shorter prefix)."""
    hold = threading.Event()
    rig = make_fills(Policy(False, hold=hold), l2_budget=4096, fill_budget=1)
    a, b = rig.stage("alpha", fill=1), rig.stage("bravo", fill=2)
    loaded = rig.restore(a)
    try:
        assert payload(loaded) == bytes([1]) * 16384
    finally:
        os.close(loaded.fd)
    assert rig.policy.asking.wait(5)  # the first memfd is held while its promotion is decided
    assert rig.fills.stats().fill_bytes >= 16384
    with pytest.raises(Busy):
        rig.restore(b)
    stats = rig.fills.stats()
    assert stats.fills_refused == 1 and stats.fills == 1
    hold.set()
    assert until(rig.settled)
    assert rig.fills.stats().fill_bytes == 0, "the memfd's share of the budget came back"
    second = rig.restore(b)
    try:
        assert payload(second) == bytes([2]) * 16384
    finally:
        os.close(second.fd)
    assert until(rig.settled)
    assert rig.fills.stats().fill_bytes == 0 and rig.fills.stats().fills_refused == 1


def test_a_fill_that_l2_has_no_free_room_for_is_promoted_into_room_made_by_lru(
    make_fills: FillFactory,
) -> None:
    decls = [TensorDecl("x", "uint8", (16384,))]
    size = L2Tier.file_size_for(token_count=5, tensors=decls)
    assert size == L2Tier.file_size_for(token_count=5, tensors=decls, origin="l3")
    rig = make_fills(Policy(True), l2_budget=size)
    resident = admit_bytes(rig.l2, "other", 16384, fill=9)  # L2 is full
    ref = rig.stage("alpha", fill=3)
    loaded = rig.restore(ref)
    try:
        assert loaded.data_offset == 0, "served from a memfd: the fill evicted nothing"
        assert payload(loaded) == bytes([3]) * 16384
    finally:
        os.close(loaded.fd)
    assert until(rig.settled)
    promoted = rig.l2.peek(ref.entry.key)
    assert promoted is not None and promoted.digest == ref.entry.digest
    assert rig.l2.peek(resident.key) is None, "the promotion made room by LRU"
    assert rig.fills.stats().promotions == 1 and rig.fills.stats().fill_bytes == 0


@pytest.mark.parametrize("scope", ["digest", "key", "all"])
def test_an_eviction_while_a_promotion_is_decided_cancels_it(make_fills: FillFactory, scope: str) -> None:
    hold = threading.Event()
    rig = make_fills(Policy(True, hold=hold))
    ref = rig.stage("alpha", fill=5)
    os.close(rig.restore(ref).fd)
    assert rig.policy.asking.wait(5)
    if scope == "digest":
        rig.clock.evict(ref.entry.digest)
    elif scope == "key":
        rig.clock.evict(None, key=ref.entry.key)
    else:
        rig.clock.evict(None)
    hold.set()
    assert until(rig.settled)
    assert rig.l2.peek(ref.entry.key) is None
    assert rig.fills.stats().promotions == 0
    assert rig.l2.stats().reserved_bytes == 0


def test_a_raising_promotion_policy_does_not_stop_the_promoter(make_fills: FillFactory) -> None:
    rig = make_fills(Policy(True))
    rig.policy.fail_consider = True
    first = rig.stage("alpha", fill=1)
    os.close(rig.restore(first).fd)
    assert until(rig.settled)
    assert rig.l2.peek(first.entry.key) is None, "a failed decision is a no"
    assert rig.fills.stats().promotions_declined == 1
    health = rig.health.snapshot()[PROMOTER]
    assert health.errors == 1 and "RuntimeError" in health.last_error and health.alive
    assert rig.health.dead() == []

    rig.policy.fail_consider = False
    rig.policy.fail_settle = True
    second = rig.stage("bravo", fill=2)
    os.close(rig.restore(second).fd)
    assert until(lambda: rig.settled() and rig.health.snapshot()[PROMOTER].errors == 2)
    promoted = rig.l2.peek(second.entry.key)
    assert promoted is not None and promoted.digest == second.entry.digest, "the thread went on deciding"
    assert rig.health.healthy and rig.health.snapshot()[PROMOTER].alive

    rig.policy.fail_settle = False
    third = rig.stage("charlie", fill=3)
    os.close(rig.restore(third).fd)
    assert until(lambda: rig.settled() and rig.policy.settled == [third.entry.digest])
    assert rig.fills.stats().promotions == 2 and rig.health.snapshot()[PROMOTER].errors == 2


def test_a_full_promotion_queue_gives_the_fill_back_instead_of_waiting(make_fills: FillFactory) -> None:
    hold = threading.Event()
    rig = make_fills(Policy(True, hold=hold), queue_size=1)
    refs = [rig.stage(name, fill=n) for n, name in enumerate(["alpha", "bravo", "charlie"], start=1)]
    os.close(rig.restore(refs[0]).fd)
    assert rig.policy.asking.wait(5)  # the promoter is busy with the first decision
    os.close(rig.restore(refs[1]).fd)  # waits in the queue (now full)
    os.close(rig.restore(refs[2]).fd)  # no room in the queue: given back at once
    assert rig.fills.stats().promotions_dropped == 1
    hold.set()
    assert until(rig.settled)
    assert rig.l2.peek(refs[2].entry.key) is None
    assert all(rig.l2.peek(r.entry.key) is not None for r in refs[:2])
    assert rig.fills.stats().promotions == 2


def test_a_sync_write_evicted_while_it_waits_reports_none(make_rig: RigFactory) -> None:
    rig = make_rig(gate_open=False)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(rig.capture, "alpha", 7, sync=True)
        assert until(lambda: rig.writer.stats().queue_depth == 1)
        entry = rig.l2.peek(key_of("alpha"))
        assert entry is not None
        rig.clock.evict(entry.digest)
        rig.writer.forget(entry.digest)
        rig.health.gate.set()
        _, reply = waiting.result(timeout=5)
    assert reply == "none", "nothing of the evicted capture is kept: not 'deferred', which promises a write"
    assert rig.l3.get(entry.key) is None and rig.writer.marks.load() == {}


def test_a_sync_write_superseded_by_a_newer_capture_reports_none_and_the_newer_is_written(
    make_rig: RigFactory,
) -> None:
    rig = make_rig(gate_open=False)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(rig.capture, "alpha", 7, sync=True)
        assert until(lambda: rig.writer.stats().queue_depth == 1)
        newer, _ = rig.capture("alpha", fill=8)
        rig.health.gate.set()
        _, reply = waiting.result(timeout=5)
    assert reply == "none"
    assert rig.writer.wait_idle(timeout=5)
    assert rig.l3_digest(newer.key) == newer.digest


def test_an_intent_marker_on_a_full_tmpfs_is_no_space_and_leaves_nothing(mount_tmpfs: Any) -> None:
    from skippyd.errors import NoSpace

    fs = Path(mount_tmpfs("1m"))
    marks = PendingMarks(fs / "pending")
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(NoSpace, match="intent"):
        marks.mark("a" * 64, "b" * 64)
    assert list((fs / "pending").iterdir()) == []
