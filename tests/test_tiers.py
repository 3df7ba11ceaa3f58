"""The rules across tiers, in-process: the newest capture of a key wins over durable writes in flight."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import eventually

from skippyd.keys import Identity, cache_key, encode_tokens
from skippyd.l2 import L2Tier
from skippyd.l3 import L3Store
from skippyd.payload import TensorDecl, plan_layout
from skippyd.tiers import Tiers

IDENT = Identity("m", "s")


def staged(fill: int, n: int = 10000) -> tuple[list[TensorDecl], memoryview]:
    decls = [TensorDecl("x", "uint8", (n,))]
    specs, length = plan_layout(decls)
    buf = bytearray(length)
    buf[specs[0].offset : specs[0].offset + n] = bytes([fill]) * n
    return decls, memoryview(buf)


def gate_l3_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every L3 entry write waits until the returned event is set (at most 30 s)."""
    gate = threading.Event()
    real = L3Store.write

    def gated(self: L3Store, entry: Any, data: memoryview, **options: Any) -> bool:
        gate.wait(timeout=30)
        return real(self, entry, data, **options)

    monkeypatch.setattr(L3Store, "write", gated)
    return gate


@pytest.fixture
def tiers(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Tiers, threading.Event]]:
    gate = gate_l3_writes(monkeypatch)
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30))
    try:
        yield t, gate
    finally:
        gate.set()
        t.close()


def settle(t: Tiers) -> None:
    """Waits until the durable writes queued so far are done."""
    assert t.writer is not None
    t.writer.wait_idle()


def capture(t: Tiers, tokens: list[int], fill: int, durable: bool) -> str:
    decls, source = staged(fill)
    out = t.capture(
        identity=IDENT, tokens=encode_tokens(tokens), tensors=decls, source=source, durable=durable
    )
    return out.digest


def served_digest(t: Tiers, tokens: list[int]) -> str | None:
    opened = t.open_restore(IDENT, encode_tokens(tokens))
    if opened is None:
        return None
    os.close(opened.fd)
    return opened.entry.digest


def test_a_queued_durable_write_superseded_by_a_newer_capture_never_reaches_l3(
    tiers: tuple[Tiers, threading.Event],
) -> None:
    t, gate = tiers
    capture(t, [9, 9], fill=1, durable=True)  # occupies the writer until the gate opens
    capture(t, [1, 2, 3], fill=2, durable=True)  # v1 of the key, queued
    newest = capture(t, [1, 2, 3], fill=3, durable=False)  # v2, not durable
    gate.set()
    settle(t)
    assert t.l3 is not None
    assert t.l3.get(cache_key(IDENT, encode_tokens([1, 2, 3]))) is None, "v1 was skipped"
    assert served_digest(t, [1, 2, 3]) == newest


def test_a_durable_write_in_flight_when_its_key_is_captured_again_is_withdrawn(
    tiers: tuple[Tiers, threading.Event],
) -> None:
    t, gate = tiers
    capture(t, [1, 2, 3], fill=2, durable=True)  # v1: the writer picks it up and waits at the gate
    time.sleep(0.2)
    newest = capture(t, [1, 2, 3], fill=3, durable=False)  # v2 while v1 is being written
    gate.set()
    settle(t)
    assert t.l3 is not None
    assert t.l3.get(cache_key(IDENT, encode_tokens([1, 2, 3]))) is None
    assert served_digest(t, [1, 2, 3]) == newest


def commit_behind(t: Tiers, key: str, fill: int) -> Any:
    """An L2 entry of 2 tokens committed straight into L2, behind the rules' back; its entry."""
    decls, source = staged(fill)
    with t.l2.reserve(key=key, identity=IDENT, token_count=2, tensors=decls) as r:
        r.data[: len(source)] = source
        return r.commit()


def in_l3(tiers: tuple[Tiers, threading.Event], tokens: list[int], fill: int) -> tuple[Tiers, str, str]:
    """The tiers with their L3 writes let through and one durable capture written: the tiers, its digest
    and its key."""
    t, gate = tiers
    gate.set()
    digest = capture(t, tokens, fill=fill, durable=True)
    settle(t)
    return t, digest, cache_key(IDENT, encode_tokens(tokens))


def test_l3_is_the_authority_over_a_disagreeing_l2_entry(tiers: tuple[Tiers, threading.Event]) -> None:
    t, durable, key = in_l3(tiers, [5, 6], fill=7)
    commit_behind(t, key, 8)
    assert served_digest(t, [5, 6]) == durable
    assert t.counters.l2_mismatches_removed == 1


def test_the_authority_check_never_removes_an_l2_entry_committed_after_it_looked(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    t, _, key = in_l3(tiers, [5, 6], fill=7)
    looked = commit_behind(t, key, 8)  # disagrees with L3
    newer = commit_behind(t, key, 9)  # committed since the look
    monkeypatch.setattr(t.l2, "peek", lambda _key: looked)  # the look happened before the newer commit
    t.lookup(IDENT, encode_tokens([5, 6]))
    held = t.l2.hold(key, hit=False)
    assert held is not None
    os.close(held.fd)
    assert held.entry.digest == newer.digest, "the entry committed after the look was removed"
    assert t.counters.l2_mismatches_removed == 0


def test_conditional_removes_keep_an_entry_of_another_digest(tiers: tuple[Tiers, threading.Event]) -> None:
    t, digest, key = in_l3(tiers, [3, 3], fill=4)
    assert t.l3 is not None
    assert not t.l2.remove(key, digest="0" * 64) and t.l2.peek(key) is not None
    assert not t.l3.remove(key, digest="0" * 64) and t.l3.get(key) is not None
    assert t.l2.remove(key, digest=digest) and t.l2.peek(key) is None
    assert t.l3.remove(key, digest=digest) and t.l3.get(key) is None


def test_an_eviction_during_a_durable_write_wins_over_the_write(
    tiers: tuple[Tiers, threading.Event],
) -> None:
    t, gate = tiers
    digest = capture(t, [4, 4], fill=5, durable=True)  # the writer passes its first check, waits
    time.sleep(0.2)
    assert t.evict_digest(digest) == 1
    gate.set()
    settle(t)
    assert t.l3 is not None
    assert t.l3.get(cache_key(IDENT, encode_tokens([4, 4]))) is None, "evicted means gone from both tiers"
    assert served_digest(t, [4, 4]) is None


def test_evict_all_during_a_durable_write_leaves_l3_empty(tiers: tuple[Tiers, threading.Event]) -> None:
    t, gate = tiers
    capture(t, [4, 4], fill=5, durable=True)
    time.sleep(0.2)
    t.evict_all()
    gate.set()
    settle(t)
    assert t.l3 is not None
    assert t.l3.stats().entries == 0 and t.l3.stats().objects == 0
    assert not list(t.l3.directory.joinpath("objects").rglob("*.obj")), "no object written for nothing"


def test_work_after_an_eviction_is_not_cancelled_by_it(tiers: tuple[Tiers, threading.Event]) -> None:
    t, gate = tiers
    gate.set()
    digest = capture(t, [4, 4], fill=5, durable=True)
    settle(t)
    t.evict_digest(digest)
    again = capture(t, [4, 4], fill=5, durable=True)  # the same bytes captured after the eviction
    settle(t)
    assert t.l3 is not None
    stored = t.l3.get(cache_key(IDENT, encode_tokens([4, 4])))
    assert stored is not None and stored.entry.digest == again == digest


def test_a_capture_retires_the_stale_durable_copy_before_its_entry_is_visible(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore in between would otherwise find the new L2 entry disagreeing with the old L3 authority
    and remove the new one."""
    t, gate = tiers
    gate.set()
    old = capture(t, [7, 7], fill=1, durable=True)
    settle(t)
    assert t.l3 is not None
    key = cache_key(IDENT, encode_tokens([7, 7]))
    seen_in_l2: list[str | None] = []
    real_remove = L3Store.remove

    def remove(self: L3Store, k: str, **options: Any) -> bool:
        entry = t.l2.peek(k)
        seen_in_l2.append(entry.digest if entry is not None else None)
        return real_remove(self, k, **options)

    monkeypatch.setattr(L3Store, "remove", remove)
    new = capture(t, [7, 7], fill=2, durable=False)
    assert seen_in_l2 == [None], "the old L2 entry left at reserve; the new one was not yet published"
    assert t.l3.get(key) is None
    assert served_digest(t, [7, 7]) == new != old


class Policy:
    """A promotion policy that answers ``answer``, optionally holding the promoter at ``hold``."""

    def __init__(self, answer: bool, hold: threading.Event | None = None) -> None:
        self.answer = answer
        self.hold = hold
        self.asked = threading.Event()

    def consider(self, manifest_key: str, token_count: int, payload_bytes: int) -> bool:
        self.asked.set()
        if self.hold is not None:
            self.hold.wait(timeout=30)
        return self.answer

    def settle(self, manifest_key: str) -> None:
        pass


def make_tiers(shm_dir: Path, tmp_path: Path, l2_bytes: int, policy: Policy) -> Tiers:
    return Tiers(L2Tier.open(shm_dir, l2_bytes), l3=L3Store.open(tmp_path / "l3", 1 << 30), promotions=policy)


def wait_for_decision(t: Tiers) -> None:
    """Until the promoter has asked and carried out its answer (no fill or write is outstanding)."""
    assert t.fills is not None
    policy = t.fills.promotions
    assert isinstance(policy, Policy)
    fills = t.fills
    assert eventually(
        lambda: policy.asked.is_set() and t.clock.outstanding == 0 and not fills.in_flight, timeout=10
    )


def test_an_l3_fill_evicted_while_its_promotion_is_decided_is_not_promoted(
    shm_dir: Path, tmp_path: Path
) -> None:
    hold = threading.Event()
    policy = Policy(True, hold)
    t = make_tiers(shm_dir, tmp_path, 64 << 20, policy)
    try:
        digest = capture(t, [3, 3], fill=9, durable=True)
        settle(t)
        key = cache_key(IDENT, encode_tokens([3, 3]))
        t.l2.remove(key)
        opened = t.open_restore(IDENT, encode_tokens([3, 3]))
        assert opened is not None and opened.source == "l3"
        os.close(opened.fd)
        assert policy.asked.wait(10)
        t.evict_digest(digest)
        hold.set()
        wait_for_decision(t)
        assert t.l2.peek(key) is None, "the eviction came after the fill began: it wins"
        assert served_digest(t, [3, 3]) is None
    finally:
        hold.set()
        t.close()


@pytest.mark.parametrize("promote", [False, True])
def test_an_l3_fill_never_evicts_l2_entries_until_promotion_says_so(
    shm_dir: Path, tmp_path: Path, promote: bool
) -> None:
    """With L2 full, the fill is served from a sealed read-only memfd; only a promotion makes room."""
    size = L2Tier.file_size_for(token_count=2, tensors=staged(0)[0])
    t = make_tiers(shm_dir, tmp_path, size, Policy(promote))
    try:
        durable = capture(t, [3, 3], fill=9, durable=True)
        settle(t)
        other = capture(t, [8, 8], fill=8, durable=False)  # evicts [3, 3] from L2: L2 is full now
        key, other_key = (cache_key(IDENT, encode_tokens(x)) for x in ([3, 3], [8, 8]))
        assert t.l2.peek(key) is None
        opened = t.open_restore(IDENT, encode_tokens([3, 3]))
        assert opened is not None and opened.source == "l3" and opened.entry.digest == durable
        try:
            assert fcntl.fcntl(opened.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert fcntl.fcntl(opened.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE, "no one can change it"
            with pytest.raises(OSError):
                os.pwrite(opened.fd, b"x", 0)
        finally:
            os.close(opened.fd)
        wait_for_decision(t)
        promoted = t.l2.peek(key)
        if promote:
            assert promoted is not None and promoted.digest == durable
            assert t.l2.peek(other_key) is None, "room was made for the promoted entry"
        else:
            assert promoted is None
            kept = t.l2.peek(other_key)
            assert kept is not None and kept.digest == other, "a declined fill evicted nothing"
    finally:
        t.close()


@pytest.mark.parametrize("l2_full", [False, True])
def test_a_corrupt_l3_entry_is_a_clean_miss_whether_filled_into_l2_or_a_memfd(
    shm_dir: Path, tmp_path: Path, l2_full: bool
) -> None:
    """The corruption error, not a leftover-buffer error, decides: the entry is quarantined and a shorter
    prefix (here none) is served, on the L2-reservation path and on the memfd path alike."""
    size = L2Tier.file_size_for(token_count=2, tensors=staged(0)[0])
    t = make_tiers(shm_dir, tmp_path, size if l2_full else 64 << 20, Policy(False))
    try:
        capture(t, [3, 3], fill=9, durable=True)
        settle(t)
        key = cache_key(IDENT, encode_tokens([3, 3]))
        t.l2.remove(key)
        if l2_full:
            capture(t, [8, 8], fill=8, durable=False)
        assert t.l3 is not None
        entry = t.l3.get(key)
        assert entry is not None
        with open(t.l3.layout.object_path(entry.object), "r+b") as f:
            f.seek(entry.entry.data_len // 2)
            byte = f.read(1)
            f.seek(entry.entry.data_len // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        for _ in range(2):
            assert t.open_restore(IDENT, encode_tokens([3, 3, 4])) is None
        assert t.l3.get(key) is None and t.l3.stats().corrupt == 1
        assert eventually(
            lambda: t.clock.outstanding == 0 and t.fills is not None and not t.fills.in_flight, timeout=10
        )
    finally:
        t.close()


def test_an_eviction_just_after_a_capture_commits_cancels_its_durable_write(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eviction arrives between the L2 commit and the queueing of the durable write: it still wins."""
    t, gate = tiers
    gate.set()
    real = t.l2.hold

    def open_then_evicted(key: str, **options: Any) -> Any:
        held = real(key, **options)
        if held is not None:
            t.evict_digest(held.entry.digest)
        return held

    monkeypatch.setattr(t.l2, "hold", open_then_evicted)
    capture(t, [5, 5], fill=5, durable=True)
    settle(t)
    assert t.l3 is not None and t.l3.get(cache_key(IDENT, encode_tokens([5, 5]))) is None
    assert served_digest(t, [5, 5]) is None


def test_a_restore_that_begins_while_an_eviction_sweeps_the_tiers_does_not_promote_the_evicted_entry(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = make_tiers(shm_dir, tmp_path, 64 << 20, Policy(True))
    try:
        digest = capture(t, [3, 3], fill=9, durable=True)
        settle(t)
        key = cache_key(IDENT, encode_tokens([3, 3]))
        t.l2.remove(key)
        assert t.l3 is not None
        real = t.l3.remove_by_digest
        served: list[str] = []

        def restore_first(d: str) -> int:
            if served:
                return real(d)
            opened = t.open_restore(IDENT, encode_tokens([3, 3]))  # L3 still holds it: a fill begins
            if opened is not None:
                served.append(opened.source)
                os.close(opened.fd)
            return real(d)

        monkeypatch.setattr(t.l3, "remove_by_digest", restore_first)
        t.evict_digest(digest)
        assert served == ["l3"]
        wait_for_decision(t)
        assert t.l2.peek(key) is None, "the fill began during the eviction: it is not promoted"
        assert served_digest(t, [3, 3]) is None
    finally:
        t.close()


def test_l3_restores_held_outside_l2_are_capped_by_the_fill_budget(shm_dir: Path, tmp_path: Path) -> None:
    """With L2 full, fills live in memfds (RAM beyond the L2 budget); past the fill budget a restore
    falls back to a shorter prefix (here none) instead of taking more memory."""
    size = L2Tier.file_size_for(token_count=2, tensors=staged(0)[0])
    hold = threading.Event()
    policy = Policy(False, hold)
    t = Tiers(
        L2Tier.open(shm_dir, size),
        l3=L3Store.open(tmp_path / "l3", 1 << 30),
        promotions=policy,
        fill_budget=size,
    )
    try:
        first = capture(t, [3, 3], fill=3, durable=True)
        second = capture(t, [4, 4], fill=4, durable=True)
        settle(t)
        capture(t, [8, 8], fill=8, durable=False)  # L2 is full of an entry L3 does not hold
        opened = t.open_restore(IDENT, encode_tokens([3, 3]))
        assert opened is not None and opened.source == "l3" and opened.entry.digest == first
        os.close(opened.fd)
        assert policy.asked.wait(10)  # the first fill's memfd is held while its promotion is decided
        assert t.open_restore(IDENT, encode_tokens([4, 4])) is None
        assert t.fills is not None and t.fills.stats().fills_refused == 1
        hold.set()
        wait_for_decision(t)
        assert t.fills.stats().fill_bytes == 0
        assert served_digest(t, [4, 4]) == second, "with the budget free again it is served"
    finally:
        hold.set()
        t.close()


def test_an_eviction_during_a_capture_cancels_its_write_even_when_other_work_ends_meanwhile(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eviction marks are forgotten once no older work is outstanding; a capture in progress is work."""
    t, gate = tiers
    gate.set()
    digest = capture(t, [6], fill=5, durable=False)  # the same bytes under another key: their digest
    real = t.l2.reserve

    def evicted_meanwhile(**options: Any) -> Any:
        other = t.clock.begin()  # some other work, running while the eviction comes...
        t.evict_digest(digest)
        t.clock.end(other)  # ...and ending before this capture queues its durable write
        return real(**options)

    monkeypatch.setattr(t.l2, "reserve", evicted_meanwhile)
    capture(t, [5, 5], fill=5, durable=True)
    settle(t)
    assert t.l3 is not None and t.l3.get(cache_key(IDENT, encode_tokens([5, 5]))) is None


def _staged_as(fill: int, dtype: str, shape: tuple[int, ...]) -> tuple[list[TensorDecl], memoryview]:
    decls = [TensorDecl("x", dtype, shape)]
    specs, length = plan_layout(decls)
    buf = bytearray(length)
    buf[specs[0].offset : specs[0].offset + specs[0].nbytes] = bytes([fill]) * specs[0].nbytes
    return decls, memoryview(buf)


def test_a_restore_never_joins_another_keys_fill_of_the_same_bytes(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keys whose entries have the same bytes (one L3 object) but another dtype, shape and meta: a
    restore of one while the other's L3 load runs gets its own table, never the other key's."""
    from skippyd.keys import cache_key

    l3 = L3Store.open(tmp_path / "l3", 1 << 30)
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=l3)
    try:
        a, b = Identity("model-a", "s"), Identity("model-b", "s")
        ta, tb = encode_tokens([1, 2, 3]), encode_tokens([7, 8, 9, 10])
        da, sa = _staged_as(5, "uint8", (10000,))
        db, sb = _staged_as(5, "int16", (50, 100))  # the same 10,000 bytes
        t.capture(identity=a, tokens=ta, tensors=da, source=sa, meta={"who": "A"}, durable="sync")
        t.capture(identity=b, tokens=tb, tensors=db, source=sb, meta={"who": "B"}, durable="sync")
        ka, kb = cache_key(a, ta), cache_key(b, tb)
        ref_a, ref_b = l3.get(ka), l3.get(kb)
        assert ref_a is not None and ref_b is not None and ref_a.object == ref_b.object
        t.l2.remove(ka)
        t.l2.remove(kb)  # only L3 holds them
        loading, joined = threading.Event(), threading.Event()
        real = L3Store.load_into

        def slow(self: L3Store, key: str, dest: Any, **options: Any) -> Any:
            if key == ka:
                loading.set()
                joined.wait(2)  # the load of A runs while B's restore comes
            return real(self, key, dest, **options)

        monkeypatch.setattr(L3Store, "load_into", slow)
        got: dict[str, Any] = {}
        leader = threading.Thread(target=lambda: got.setdefault("a", t.open_restore(a, ta)))
        leader.start()
        assert loading.wait(10)
        got["b"] = t.open_restore(b, tb)
        joined.set()
        leader.join(30)
        for name, key, identity, meta in (("a", ka, a, "A"), ("b", kb, b, "B")):
            entry = got[name].entry
            assert (entry.key, entry.identity, entry.meta) == (key, identity.digest, {"who": meta})
            os.close(got[name].fd)
        assert [(s.dtype, s.shape) for s in got["b"].entry.tensors] == [("int16", (50, 100))]
    finally:
        t.close()


def test_a_write_reusing_an_object_quarantined_meanwhile_is_not_acknowledged_written(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture with the same bytes as another key's L3 entry reuses its object; if that object is
    quarantined while the write runs, the write must not index a manifest naming a missing object."""
    from skippyd.keys import cache_key

    l3 = L3Store.open(tmp_path / "l3", 1 << 30)
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=l3)
    try:
        a, b = Identity("m", "s"), Identity("m", "other")
        ta, tb = encode_tokens([1, 2]), encode_tokens([3, 4])
        ka, kb = cache_key(a, ta), cache_key(b, tb)
        decls, source = staged(7)
        assert t.capture(identity=a, tokens=ta, tensors=decls, source=source, durable="sync").durability == (
            "written"
        )
        real = L3Store.manifest

        def manifest(self: L3Store, key: str, *, expected: Any = None) -> Any:
            found = real(self, key, expected=expected)
            if key == ka and expected is None:  # the write reads the shared object's segment digests
                held = self.get(ka)
                assert held is not None
                self.quarantine(held, "a restore found it corrupt meanwhile")
            return found

        monkeypatch.setattr(L3Store, "manifest", manifest)
        decls, source = staged(7)
        out = t.capture(identity=b, tokens=tb, tensors=decls, source=source, durable="sync")
        monkeypatch.setattr(L3Store, "manifest", real)
        ref = l3.get(kb)
        assert out.durability != "written" or (ref is not None and l3.layout.object_path(ref.object).exists())
        assert ref is None or l3.layout.object_path(ref.object).exists()
    finally:
        t.close()


def test_a_capture_refused_for_a_full_tmpfs_leaves_an_earlier_queued_write_alone(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent marker of a second capture of the key cannot be written (full tmpfs): that capture is
    refused, and must not supersede the first one's queued durable write on its way out."""
    from skippyd.durable import PendingMarks
    from skippyd.errors import NoSpace
    from skippyd.keys import cache_key

    t, gate = tiers
    first = capture(t, [1, 2, 3], fill=1, durable=True)  # queued: the writer is held at the gate
    key = cache_key(IDENT, encode_tokens([1, 2, 3]))
    real = PendingMarks.mark

    def full(self: PendingMarks, k: str, digest: str) -> None:
        if k == key and digest != first:
            raise NoSpace("no room on the L2 tmpfs")
        real(self, k, digest)

    monkeypatch.setattr(PendingMarks, "mark", full)
    with pytest.raises(NoSpace):
        capture(t, [1, 2, 3], fill=2, durable=True)
    monkeypatch.setattr(PendingMarks, "mark", real)
    gate.set()
    settle(t)
    assert t.l3 is not None
    held = t.l3.get(key)
    assert held is not None and held.entry.digest == first


def test_a_newer_capture_during_a_durable_writes_lease_supersedes_the_write(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer, non-durable capture of the key lands while the older capture's write takes its lease:
    the older bytes must not reach L3 (L3, the authority, would then remove the newer L2 entry)."""
    from skippyd.keys import cache_key

    t, gate = tiers
    gate.set()
    key = cache_key(IDENT, encode_tokens([1, 2, 3]))
    real = t.l2.hold
    newer: list[str] = []

    def hold(k: str, *, hit: bool = True) -> Any:
        found = real(k, hit=hit)
        if not hit and k == key and not newer:
            newer.append(capture(t, [1, 2, 3], fill=2, durable=False))
        return found

    monkeypatch.setattr(t.l2, "hold", hold)
    capture(t, [1, 2, 3], fill=1, durable=True)
    monkeypatch.setattr(t.l2, "hold", real)
    settle(t)
    assert served_digest(t, [1, 2, 3]) == newer[0]
    assert t.l3 is not None and t.l3.get(key) is None


def test_an_eviction_while_a_deferred_write_takes_its_lease_is_not_undone(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write kept in the backlog is opened by the writer: an eviction of its key that runs while it
    takes the lease cancels it; the evicted entry never comes back from L3."""
    from skippyd.keys import cache_key

    gate = gate_l3_writes(monkeypatch)
    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30), l3_queue=1)
    try:
        for n, tokens in enumerate(([9], [8])):  # the writer busy, its queue full: the next is deferred
            capture(t, tokens, fill=10 + n, durable=True)
            time.sleep(0.1)
        assert capture(t, [1, 2, 3], fill=1, durable=True)
        key = cache_key(IDENT, encode_tokens([1, 2, 3]))
        real_hold = t.l2.hold
        evicted: list[int] = []

        def hold(k: str, *, hit: bool = True) -> Any:
            found = real_hold(k, hit=hit)
            if (
                k == key
                and not hit
                and not evicted
                and threading.current_thread().name.startswith("skippyd-l3")
            ):
                evicted.append(t.evict_key(key))
            return found

        monkeypatch.setattr(t.l2, "hold", hold)
        gate.set()
        settle(t)
        assert evicted == [1]
        assert t.l3 is not None and t.l3.get(key) is None
        assert served_digest(t, [1, 2, 3]) is None
    finally:
        gate.set()
        t.close()


def test_of_two_durable_captures_announced_before_either_published_the_marker_names_the_one_kept(
    tiers: tuple[Tiers, threading.Event], monkeypatch: pytest.MonkeyPatch, shm_dir: Path
) -> None:
    """A announces itself (its marker), then B does and publishes, then A publishes: L2 holds A, whose
    write is queued ("queued" survives a kill -9 through its marker), so the marker must name A, not B."""
    from skippyd.keys import cache_key
    from skippyd.l2.tier import L2Tier as Tier

    t, _gate = tiers  # the writer is held: nothing reaches L3 while the markers are looked at
    key = cache_key(IDENT, encode_tokens([1, 2, 3]))
    b_published, a_published = threading.Event(), threading.Event()
    real = Tier._commit

    def commit(self: Tier, file: Any, entry: Any, offset: int, expected: Any, before: Any, **kw: Any) -> Any:  # noqa: PLR0917
        who = threading.current_thread().name

        def announced(digest: str) -> None:
            before(digest)
            if who == "A":
                b_published.wait(10)  # B announces itself and publishes meanwhile

        found = real(self, file, entry, offset, expected, announced if before else None, **kw)
        if who == "B":
            b_published.set()
            a_published.wait(10)  # B's submit comes after A has published
        else:
            a_published.set()
        return found

    monkeypatch.setattr(Tier, "_commit", commit)
    digests: dict[str, str] = {}

    def run(name: str, fill: int) -> None:
        digests[name] = capture(t, [1, 2, 3], fill=fill, durable=True)

    first = threading.Thread(target=run, args=("A", 1), name="A")
    first.start()
    time.sleep(0.2)
    second = threading.Thread(target=run, args=("B", 2), name="B")
    second.start()
    first.join(30)
    second.join(30)
    held = t.l2.peek(key)
    assert held is not None and held.digest == digests["A"]
    assert (shm_dir / "pending" / key).read_text() == digests["A"]


@pytest.mark.parametrize("durable", [True, "sync"])
def test_an_eviction_while_a_capture_is_copied_keeps_it_out_of_both_tiers_and_says_so(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool | str
) -> None:
    """``evict`` of a key whose capture is being copied (hashed, not yet visible) cancels that capture:
    it is not published, its durable write never runs, and its reply says so (l2 and l3 false, none),
    rather than an L2 entry outliving the eviction beside a reply promising an L3 copy that never comes."""
    from skippyd.keys import cache_key
    from skippyd.l2.tier import L2Tier as Tier

    t = Tiers(L2Tier.open(shm_dir, 64 << 20), l3=L3Store.open(tmp_path / "l3", 1 << 30))
    try:
        key = cache_key(IDENT, encode_tokens([1, 2, 3]))
        real = Tier._commit
        evicted: list[int] = []

        def commit(  # noqa: PLR0917 - _commit's own signature
            self: Tier, file: Any, entry: Any, offset: int, expected: Any, before: Any, **kw: Any
        ) -> Any:
            def announced(digest: str) -> None:
                before(digest)
                if not evicted:
                    evicted.append(t.evict_key(key))

            return real(self, file, entry, offset, expected, announced if before else None, **kw)

        monkeypatch.setattr(Tier, "_commit", commit)
        decls, source = staged(3)
        out = t.capture(
            identity=IDENT, tokens=encode_tokens([1, 2, 3]), tensors=decls, source=source, durable=durable
        )
        monkeypatch.setattr(Tier, "_commit", real)
        settle(t)
        assert (out.l2, out.l3, out.durability) == (False, False, "none")
        assert t.l2.peek(key) is None
        assert t.l3 is not None and t.l3.get(key) is None
        assert not (shm_dir / "pending" / key).exists()
        again = t.capture(identity=IDENT, tokens=encode_tokens([1, 2, 3]), tensors=decls, source=staged(3)[1])
        assert again.l2 and served_digest(t, [1, 2, 3]) == again.digest  # later captures are not cancelled
    finally:
        t.close()


def test_a_request_that_would_wait_for_a_held_tier_lock_runs_on_a_worker_not_on_the_event_loop(
    tiers: tuple[Tiers, threading.Event],
) -> None:
    """Inline requests (stats, blocks_contains, blocks_get, short lookups and restores) take the tiers'
    locks on the event loop: while another thread holds one (a big eviction, a flush), the first such
    request would stall the loop and every other client with it (even ping). It goes to a worker then;
    lock-free ones (ping, hello, config) stay inline. A continuation that must park goes back to the event
    loop (which parks it holding no thread), never waits on the worker."""
    from skippyd.config import Config
    from skippyd.handlers import Deferred, Handlers, Reply, Session
    from skippyd.server import _to_end

    t, _gate = tiers
    handlers = Handlers(Config(), t)
    session = Session(1, handshaken=True)
    contains = {"op": "blocks_contains", "model": "m", "state": "s", "namespace": "", "block_tokens": 16,
                "keys": [b"k"]}  # fmt: skip
    assert handlers.route(session, contains)[2] is False  # nothing held: inline
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with t.l2.lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        held.wait(10)
        assert handlers.route(session, contains)[2] is True
        assert handlers.route(session, {"op": "stats"})[2] is True
        assert handlers.route(session, {"op": "ping"})[2] is False
    finally:
        release.set()
        thread.join(10)
    parked = Deferred(lambda: Reply({}), park=lambda _wake: lambda: None)
    assert _to_end(parked) is parked, "a worker hands a continuation that must park back to the event loop"
