"""The L2 tier behaves like the seed's L2Tier: budget, LRU, replacement, digests, restarts, prefixes."""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3
from l2util import IDENT, admit, admit_bytes, borrow, get, key_of, keys_lru_first, lookup, size_of

from skippyd.errors import DigestMismatch, NoSpace, SkippydError, StoreLocked, TooLarge
from skippyd.keys import Identity, cache_key, encode_tokens, prefix_keys
from skippyd.l2 import L2Tier
from skippyd.l2.pool import File
from skippyd.payload import TensorDecl, header_span
from skippyd.shm import size_class

KB = 1024


def _keys_in_lru_order(tier: L2Tier) -> list[str]:
    return keys_lru_first(tier)


def test_budget_is_kept_by_evicting_the_oldest_use_first(shm_dir: Path) -> None:
    one = size_of(5 * KB)
    with L2Tier.open(shm_dir, 3 * one) as tier:  # exactly three entries fit
        for name in "abc":
            admit_bytes(tier, name, 5 * KB)
        assert get(tier, key_of("a")) is not None  # a is now the most recent
        admit_bytes(tier, "d", 5 * KB)
        assert _keys_in_lru_order(tier) == [key_of("c"), key_of("a"), key_of("d")]
        stats = tier.stats()
        assert stats.evictions == 1
        assert stats.bytes == 3 * one <= stats.budget_bytes


def test_an_entry_larger_than_the_whole_budget_is_refused_before_anything_is_evicted(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 64 * KB) as tier:
        admit_bytes(tier, "small", 4 * KB)
        with pytest.raises(TooLarge):
            admit_bytes(tier, "huge", 200 * KB)
        stats = tier.stats()
        assert stats.entries == 1
        assert stats.evictions == 0
        assert stats.refused_bytes == size_of(200 * KB)
        assert tier.peek(key_of("small")) is not None


def test_get_moves_recency_only_on_a_real_hit_and_peek_never(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        for name in "abc":
            admit_bytes(tier, name, 1 * KB)
        assert tier.peek(key_of("a")) is not None
        assert get(tier, key_of("zzz")) is None
        assert _keys_in_lru_order(tier) == [key_of("a"), key_of("b"), key_of("c")]
        get(tier, key_of("b"))
        assert _keys_in_lru_order(tier) == [key_of("a"), key_of("c"), key_of("b")]
        stats = tier.stats()
        assert (stats.hits, stats.misses) == (1, 1)


def test_readmitting_a_key_replaces_it_with_exact_accounting(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        admit_bytes(tier, "a", 2 * KB, fill=1)
        admit_bytes(tier, "b", 2 * KB)
        first = tier.stats().bytes
        replaced = admit_bytes(tier, "a", 100 * KB, fill=2)
        stats = tier.stats()
        assert stats.entries == 2
        assert stats.bytes == first - size_of(2 * KB) + size_of(100 * KB)
        assert stats.inserts == 3
        assert tier.peek(key_of("a")) == replaced
        assert replaced.digest == blake3(b"\x02" * 100 * KB).hexdigest()
        assert _keys_in_lru_order(tier)[-1] == key_of("a")


def test_remove_remove_by_digest_and_clear(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        shared = admit_bytes(tier, "a", 3 * KB, fill=9)
        admit_bytes(tier, "b", 3 * KB, fill=9)  # same bytes, same digest
        admit_bytes(tier, "c", 3 * KB, fill=1)
        assert tier.remove(key_of("c")) is True
        assert tier.remove(key_of("c")) is False
        assert tier.remove_by_digest(shared.digest) == 2
        assert tier.stats().entries == 0
        admit_bytes(tier, "d", 3 * KB)
        assert tier.clear() == 1
        stats = tier.stats()
        assert (stats.entries, stats.bytes, stats.free_bytes) == (0, 0, 0)
        assert not any((shm_dir / "entries").iterdir())


def test_a_digest_mismatch_at_admission_stores_nothing_and_counts_a_reject(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        with pytest.raises(DigestMismatch):
            admit_bytes(tier, "a", 4 * KB, expected=blake3(b"something else").hexdigest())
        good = admit_bytes(tier, "b", 4 * KB, expected=blake3(b"\x07" * 4 * KB).hexdigest())
        stats = tier.stats()
        assert stats.admission_rejects == 1
        assert stats.entries == 1 and stats.inserts == 1
        assert tier.peek(key_of("a")) is None
        assert [p.name for p in (shm_dir / "entries").iterdir()] == [f"{good.key}.skp"]
        assert stats.bytes + stats.free_bytes + stats.reserved_bytes <= stats.budget_bytes


def test_stats_report_every_seed_counter(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        admit_bytes(tier, "a", 1 * KB)
        fields = dataclasses.asdict(tier.stats())
    for name in [
        "entries",
        "bytes",
        "budget_bytes",
        "hits",
        "misses",
        "inserts",
        "evictions",
        "admission_rejects",
        "refused_bytes",
    ]:
        assert name in fields
    assert fields["entries"] == 1 and fields["inserts"] == 1 and fields["budget_bytes"] == 1 << 20


def _admit_prefix(tier: L2Tier, ident: Identity, tokens: list[int], fill: int = 1) -> str:
    toks = encode_tokens(tokens)
    key = cache_key(ident, toks)
    admit(
        tier,
        key=key,
        identity=ident,
        token_count=len(tokens),
        tensors=[TensorDecl("x", "uint8", (16,))],
        data=[bytes([fill]) * 16],
    )
    return key


def test_lookup_finds_the_longest_captured_prefix_of_the_query(shm_dir: Path) -> None:
    prompt = list(range(1000, 1300))
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        _admit_prefix(tier, IDENT, prompt[:64])
        k200 = _admit_prefix(tier, IDENT, prompt[:200])
        _admit_prefix(tier, IDENT, [*prompt[:199], 5])  # same length as a prefix, different tokens
        _admit_prefix(tier, IDENT, [*prompt[:250], 9])  # longer than the query's prefix: diverges
        hit = lookup(tier, IDENT, encode_tokens(prompt[:240]))
        assert hit is not None and hit.key == k200 and hit.token_count == 200
        assert lookup(tier, IDENT, encode_tokens(prompt[:63])) is None
        assert lookup(tier, IDENT, encode_tokens([1, 2, 3])) is None
        stats = tier.stats()
        assert (stats.hits, stats.misses) == (1, 2)


@pytest.mark.parametrize(
    "other",
    [
        Identity("model-b", "state-v1", ""),
        Identity("model-a", "state-v2", ""),
        Identity("model-a", "state-v1", "t2"),
    ],
)
def test_lookup_never_crosses_model_state_or_namespace(shm_dir: Path, other: Identity) -> None:
    prompt = list(range(500))
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        _admit_prefix(tier, IDENT, prompt[:100])
        assert lookup(tier, other, encode_tokens(prompt)) is None
        assert lookup(tier, IDENT, encode_tokens(prompt)) is not None


def test_lookup_cost_does_not_grow_with_entries_of_other_identities(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import l2util

    computed: list[int] = []
    real = prefix_keys

    def counting(ident: Identity, toks: bytes | memoryview, lengths: Sequence[int]) -> list[str]:
        computed.append(len(lengths))
        return real(ident, toks, lengths)

    prompt = list(range(300))
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        for n in (10, 20, 30):
            _admit_prefix(tier, IDENT, prompt[:n])
        for i in range(300):
            _admit_prefix(tier, Identity(f"other-{i}", "s"), prompt[: 1 + i % 200])
        monkeypatch.setattr(l2util, "prefix_keys", counting)
        assert lookup(tier, IDENT, encode_tokens(prompt)) is not None
        assert tier.prefix_lengths(IDENT.digest, 300) == [10, 20, 30]
    assert computed == [3], "only this identity's three captured lengths are candidates"


def test_a_new_process_readopts_committed_entries_with_lru_order_and_stats(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        for name in "abcd":
            admit_bytes(tier, name, 2 * KB, fill=ord(name))
        get(tier, key_of("b"))
        order = _keys_in_lru_order(tier)
        before = tier.stats()
    code = (
        "import sys, json; from skippyd.l2 import L2Tier\n"
        "t = L2Tier.open(sys.argv[1], 1 << 20)\n"
        "import dataclasses\n"
        "print(json.dumps([[e.entry.key for e in t.entries()], dataclasses.asdict(t.stats())]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(shm_dir)], check=True, capture_output=True, text=True
    ).stdout
    import json

    keys_after, stats_after = json.loads(out)
    assert keys_after == order
    assert stats_after["entries"] == before.entries == 4
    assert stats_after["bytes"] == before.bytes
    assert stats_after["adopted"] == 4
    with L2Tier.open(shm_dir, 4 * size_of(2 * KB)) as again:  # full: the next admission evicts the LRU
        admit_bytes(again, "f", 2 * KB)
        assert again.peek(key_of("a")) is None, "a was least recently used before the restart"
        assert again.peek(key_of("b")) is not None


def test_restart_breaks_recency_ties_by_key(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        for name in "xyz":
            admit_bytes(tier, name, 1 * KB)
    for path in (shm_dir / "entries").iterdir():
        os.utime(path, ns=(10**18, 10**18))
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        assert _keys_in_lru_order(tier) == sorted(key_of(n) for n in "xyz")


def test_restart_removes_partial_leftovers_and_entries_that_fail_verification(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        good = admit_bytes(tier, "good", 8 * KB)
        flipped_data = admit_bytes(tier, "data", 8 * KB)
        flipped_head = admit_bytes(tier, "head", 8 * KB)
        truncated = admit_bytes(tier, "trunc", 8 * KB)
        renamed = admit_bytes(tier, "renamed", 8 * KB)
    entries = shm_dir / "entries"
    with open(entries / f"{flipped_data.key}.skp", "r+b") as f:
        f.seek(header_span(flipped_data) + 100)
        f.write(b"\x00")
    with open(entries / f"{flipped_head.key}.skp", "r+b") as f:
        f.seek(80)
        byte = f.read(1)
        f.seek(80)
        f.write(bytes([byte[0] ^ 0x20]))
    os.truncate(entries / f"{truncated.key}.skp", header_span(truncated) + 10)
    os.rename(entries / f"{renamed.key}.skp", entries / f"{'0' * 64}.skp")
    (entries / "notes.txt").write_text("stray")
    (shm_dir / "tmp" / "half-written.part").write_bytes(b"x" * 100)
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        assert keys_lru_first(tier) == [good.key]
        stats = tier.stats()
        assert stats.adopted == 1
        assert stats.adopt_dropped == 5
    assert sorted(p.name for p in entries.iterdir()) == [f"{good.key}.skp"]
    assert not any((shm_dir / "tmp").iterdir())


def test_a_second_owner_of_the_same_directory_is_refused(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20), pytest.raises(StoreLocked, match="owned by another"):
        L2Tier.open(shm_dir, 1 << 20)
    L2Tier.open(shm_dir, 1 << 20).close()  # released on close


def test_files_the_reserve_faults_in_count_as_prefaulted_not_as_a_captures_fresh_file(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 8 * size_of(60 * KB)) as tier:
        admit_bytes(tier, "a", 60 * KB)  # faulted on the request path: a fresh file, and a size class seen
        assert tier.stats().fresh_files == 1
        assert tier.prefault_step(4 * size_of(60 * KB)) > 0
        stats = tier.stats()
        assert (stats.fresh_files, stats.prefaulted_files) == (1, 1)


def test_a_file_the_reserve_faults_in_while_the_tier_closes_is_given_back_not_left_free(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = L2Tier.open(shm_dir, 8 * size_of(60 * KB))
    admit_bytes(tier, "a", 60 * KB)  # a size class seen: the reserve wants a file of it
    faulting, go = threading.Event(), threading.Event()
    real = File.prefault

    def slow_prefault(file: File) -> None:
        faulting.set()
        assert go.wait(10)
        real(file)

    monkeypatch.setattr(File, "prefault", slow_prefault)
    added: list[int] = []
    step = threading.Thread(target=lambda: added.append(tier.prefault_step(4 * size_of(60 * KB))))
    step.start()
    try:
        assert faulting.wait(10)
        tier.close()  # gives every free file back while the fault runs outside the lock
    finally:
        go.set()
        step.join(10)
    assert added == [0]
    assert list((shm_dir / "free").iterdir()) == [] and list((shm_dir / "tmp").iterdir()) == []


def test_files_of_evicted_entries_are_reused_for_the_same_size_class(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 2 * size_of(60 * KB)) as tier:
        admit_bytes(tier, "a", 60 * KB)
        admit_bytes(tier, "b", 60 * KB)
        for name in "cdef":
            admit_bytes(tier, name, 60 * KB - 100)  # same size class
        stats = tier.stats()
        assert stats.fresh_files == 2
        assert stats.reused_files == 4
        assert stats.evictions == 4


def test_a_file_served_for_one_identity_is_never_reused_for_another(shm_dir: Path) -> None:
    """A client may keep a lease-free description of an entry file it was given (reopened through
    /proc/self/fd, as kept CUDA mappings are) and see what the file holds next: a file served for one
    model, state and namespace is reused only for that identity. Files no client was given serve any."""
    from skippyd.keys import Identity
    from skippyd.l2.pool import owner_of

    other = Identity("model-b", "state-v1", "tenant-b")
    with L2Tier.open(shm_dir, 2 * size_of(60 * KB)) as tier:
        served = admit_bytes(tier, "served", 60 * KB, fill=1)
        held = tier.hold(served.key)  # a restore: the fd went to a client
        assert held is not None
        kept = os.open(f"/proc/self/fd/{held.fd}", os.O_RDONLY)  # its lease-free description
        os.close(held.fd)
        inode = os.fstat(kept).st_ino
        assert tier.remove(served.key)
        theirs = admit_bytes(tier, "theirs", 60 * KB, fill=2, ident=other)  # another identity: a fresh file
        assert os.stat(shm_dir / "entries" / f"{theirs.key}.skp").st_ino != inode
        assert os.pread(kept, 1, size_of(60 * KB) - 4096) != bytes([2]), "never another identity's bytes"
        assert tier.stats().reused_files == 0
        mine = admit_bytes(tier, "mine", 60 * KB, fill=3, ident=IDENT)  # the same identity: reused
        assert os.stat(shm_dir / "entries" / f"{mine.key}.skp").st_ino == inode
        os.close(kept)
        unserved = admit_bytes(tier, "unserved", 60 * KB - 100, fill=4, ident=other)  # (evicts "theirs")
        assert tier.remove(unserved.key)  # never given to a client: any identity may take it
        before = tier.stats().reused_files
        admit_bytes(tier, "anyone", 60 * KB - 200, fill=5)
        assert tier.stats().reused_files == before + 1
        names = sorted(p.name.split(".")[1] for p in (shm_dir / "free").iterdir())
    assert set(names) <= {"any", owner_of(IDENT.digest), owner_of(other.digest)}
    with L2Tier.open(shm_dir, 2 * size_of(60 * KB)) as tier:  # the owner marks survive a restart
        files = [f for files in tier._pool._free.values() for f in files]
        assert sorted(f.owner for f in files) == names


def test_a_recycled_file_never_shows_the_previous_entrys_bytes(shm_dir: Path) -> None:
    table = [TensorDecl("a", "uint8", (10,)), TensorDecl("b", "uint8", (49000,))]
    one = size_of(50000, "secret")
    assert L2Tier.file_size_for(token_count=4, tensors=table) == one, "same size class"
    with L2Tier.open(shm_dir, one) as tier:
        admit_bytes(tier, "secret", 50000, fill=0xAB)
        small = admit(
            tier,
            key=key_of("next"),
            identity=IDENT,
            token_count=4,
            tensors=table,
            data=[b"\x01" * 10, b"\x02" * 49000],
        )
        assert tier.stats().reused_files == 1
        raw = (shm_dir / "entries" / f"{small.key}.skp").read_bytes()
    assert len(raw) == size_class(header_span(small) + small.data_len)
    assert b"\xab" not in raw[64:], "past the fixed header (whose checksum is random bytes) nothing is stale"


def test_an_aborted_reservation_gives_its_budget_back(shm_dir: Path) -> None:
    with L2Tier.open(shm_dir, 1 << 20) as tier:
        reservation = tier.reserve(
            key=key_of("a"), identity=IDENT, token_count=1, tensors=[TensorDecl("x", "uint8", (100,))]
        )
        assert tier.stats().reserved_bytes > 0
        reservation.abort()
        stats = tier.stats()
        assert stats.reserved_bytes == 0 and stats.entries == 0
        assert not any((shm_dir / "tmp").iterdir())


@pytest.fixture
def tiny_tmpfs(mount_tmpfs: Any) -> Path:
    return Path(mount_tmpfs("256k"))


def test_a_full_tmpfs_is_a_typed_error_with_no_partial_entry_visible(tiny_tmpfs: Path) -> None:
    with L2Tier.open(tiny_tmpfs / "l2", 64 << 20) as tier:
        admit_bytes(tier, "fits", 100 * KB)
        with pytest.raises(NoSpace):
            admit_bytes(tier, "too-big-for-the-filesystem", 400 * KB)
        assert keys_lru_first(tier) == [key_of("fits")]
        assert not any((tiny_tmpfs / "l2" / "tmp").iterdir())
        assert tier.stats().reserved_bytes == 0
        admit_bytes(tier, "still-works", 50 * KB)
    with L2Tier.open(tiny_tmpfs / "l2", 64 << 20) as tier:
        assert tier.stats().entries == 2


def test_a_large_fresh_entry_file_is_faulted_in_by_several_threads_and_a_full_tmpfs_leaves_nothing(
    mount_tmpfs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd import shm

    fs = Path(mount_tmpfs("48m"))
    faulting: set[int] = set()
    real = shm._populate

    def seen(mapping: Any, offset: int, length: int) -> int:
        faulting.add(threading.get_ident())
        return real(mapping, offset, length)

    monkeypatch.setattr(shm, "_populate", seen)
    mapping = shm.allocate_mapped(fs / "a", 32 << 20, threads=2)
    assert len(faulting) == 2, "two threads faulted the file in"
    assert os.stat(fs / "a").st_blocks * 512 >= 32 << 20  # every page given (none left to fault later)
    mapping[:4] = b"abcd"
    mapping[-4:] = b"wxyz"
    assert bytes(mapping[:4]) + bytes(mapping[-4:]) == b"abcdwxyz"
    mapping.close()
    with pytest.raises(NoSpace, match="tmpfs is full"):  # 32 MiB more do not fit in 48: nothing is left
        shm.allocate_mapped(fs / "b", 32 << 20, threads=2)
    assert not (fs / "b").exists()
    assert os.statvfs(fs).f_bfree * os.statvfs(fs).f_frsize >= 15 << 20, "the pages it took are given back"
    # a kernel without MADV_POPULATE_WRITE: fallocate gives the pages (and says when it cannot)
    monkeypatch.setattr(shm, "_populate", lambda *_: errno.EINVAL)
    (fs / "a").unlink()
    shm.allocate_mapped(fs / "c", 32 << 20, threads=2).close()
    assert os.stat(fs / "c").st_blocks * 512 >= 32 << 20
    with pytest.raises(NoSpace):
        shm.allocate_mapped(fs / "e", 32 << 20, threads=2)
    assert not (fs / "e").exists()


def test_a_mode_or_group_the_kernel_refuses_is_logged_once_and_never_fails_an_allocation(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from skippyd import shm

    def refused(fd: int, mode: int) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")  # (an LSM, say)

    monkeypatch.setattr(os, "fchmod", refused)
    monkeypatch.setattr(shm, "_share_refused", [])
    with caplog.at_level("WARNING", logger="skippyd.shm"):
        for name in ("a", "b"):
            shm.allocate_mapped(shm_dir / name, 1 << 20).close()
    assert (shm_dir / "a").stat().st_size == 1 << 20 and (shm_dir / "b").exists()
    assert len([r for r in caplog.records if "cannot give the files" in r.message]) == 1


def test_copy_threads_above_eight_get_a_copy_pool_that_runs_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    from skippyd import shm

    monkeypatch.setattr(shm, "_pools", [])  # (a fresh pool, as in a daemon that just started)
    monkeypatch.setattr(shm, "_pool_threads", list(shm._pool_threads))
    shm.set_copy_threads(12)
    pool = shm._copy_pool()
    try:
        assert pool._max_workers == 11  # the caller's thread runs the twelfth share
    finally:
        pool.shutdown()


def test_size_classes_are_stable_cover_the_request_and_waste_at_most_an_eighth() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    from skippyd.shm import size_class

    @given(st.integers(min_value=1, max_value=1 << 40))
    def check(n: int) -> None:
        c = size_class(n)
        assert c >= n
        assert c % 4096 == 0
        assert size_class(c) == c
        assert c - n < max(4096, (n - 4096) // 8 + 4096)

    check()
    assert size_class((64 << 20) + 4096) == (64 << 20) + 4096, "a power-of-two payload plus its header page"


def test_concurrent_admissions_recycling_files_never_cross_entries(shm_dir: Path) -> None:
    """Evictions recycle files while other threads re-admit the same keys: every entry keeps its own bytes."""
    import threading

    from blake3 import blake3

    one = size_of(20 * KB, "k0")
    errors: list[str] = []
    with L2Tier.open(shm_dir, 6 * one) as tier:

        def worker(seed: int) -> None:
            for i in range(150):
                name = f"k{(seed + i) % 8}"
                fill = (seed * 31 + i) % 256
                try:
                    entry = admit_bytes(tier, name, 20 * KB, fill)
                except SkippydError as exc:
                    errors.append(str(exc))
                    continue
                if entry.digest != blake3(bytes([fill]) * 20 * KB).hexdigest():
                    errors.append("digest of another entry")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for item in tier.entries():
            entry = item.entry
            with borrow(tier, entry.key) as (_e, view):
                assert blake3(bytes(view[: entry.nbytes])).hexdigest() == entry.digest
        stats = tier.stats()
        assert stats.bytes + stats.free_bytes + stats.reserved_bytes <= stats.budget_bytes
        assert stats.reserved_bytes == 0
    assert not errors, errors[:3]
    with L2Tier.open(shm_dir, 6 * one) as again:
        assert again.stats().adopt_dropped == 0, "every file on disk is the entry its name says"


def test_a_commit_racing_the_reuse_of_an_evicted_file_cannot_take_its_name(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reusing an evicted file moves it out of entries/ under the tier's lock: a commit of the evicted key
    in that instant waits, instead of having its new file moved away under the old name."""
    import threading

    from blake3 import blake3

    one = size_of(20 * KB, "kk")
    with L2Tier.open(shm_dir, 2 * one) as tier:
        admit_bytes(tier, "kk", 20 * KB, fill=1)  # the victim-to-be
        admit_bytes(tier, "zz", 20 * KB, fill=2)
        racer: list[threading.Thread] = []
        real_rename = os.rename

        def rename(src: Any, dst: Any) -> None:
            if "entries" in str(src) and "tmp" in str(dst) and not racer:
                # the instant an evicted file is being reused: commit a new version of the evicted key
                thread = threading.Thread(target=admit_bytes, args=(tier, "kk", 20 * KB, 3))
                racer.append(thread)
                thread.start()
                thread.join(timeout=0.5)
            real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        admit_bytes(tier, "yy", 20 * KB, fill=4)  # evicts kk (least recently used) and reuses its file
        racer[0].join(timeout=10)
        monkeypatch.setattr(os, "rename", real_rename)
        for item in tier.entries():
            entry = item.entry
            held = tier.hold(entry.key, hit=False)
            assert held is not None, "every indexed entry has its file"
            os.close(held.fd)
            with borrow(tier, entry.key) as (_e, view):
                assert blake3(bytes(view[: entry.nbytes])).hexdigest() == entry.digest


def test_a_read_lease_waits_out_a_momentary_exclusive_probe_and_is_busy_otherwise(shm_dir: Path) -> None:
    import fcntl
    import threading

    from skippyd.errors import Busy
    from skippyd.shm import has_readers, ofd_lock, open_reader

    path = shm_dir / "probe.skp"
    path.write_bytes(b"x" * 4096)
    probe = os.open(path, os.O_RDWR)  # (the daemon's own: only a read-write description can write-lock)
    try:
        assert ofd_lock(probe, fcntl.F_WRLCK)
        with pytest.raises(Busy):
            open_reader(path)
        threading.Timer(0.002, ofd_lock, args=(probe, fcntl.F_UNLCK)).start()
        fd = open_reader(path)  # the probe lets go within the wait
        assert has_readers(path)
        os.close(fd)
        assert not has_readers(path)
    finally:
        os.close(probe)


def test_a_clients_exclusive_flock_on_its_lease_neither_blocks_leases_nor_lets_the_file_be_reused(
    shm_dir: Path,
) -> None:
    """flock ignores the access mode: a client could turn the read-only description it was given into an
    exclusive lock, and every lease of that file spun then failed busy (under the tier's lock, and in the
    L3 writer, which died of it). Leases are read locks a read-only description cannot conflict with; the
    client's flock only makes the file count as read, so it is unlinked rather than reused under it."""
    import fcntl

    from skippyd.shm import has_readers, open_reader

    path = shm_dir / "entry.skp"
    path.write_bytes(b"x" * 4096)
    hostile = open_reader(path)
    fcntl.flock(hostile, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(open_reader(path))  # at once: another reader's lease is not held up
    assert has_readers(path)
    fcntl.flock(hostile, fcntl.LOCK_UN)  # (what protocol.md tells clients not to do)
    assert has_readers(path), "its read lease is still there"
    os.close(hostile)
    assert not has_readers(path)
    with open(path, "rb") as plain:  # a client with a description of its own and an flock
        fcntl.flock(plain, fcntl.LOCK_SH)
        assert has_readers(path), "an flock counts as a reader: never reused under it"
    assert not has_readers(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another user")
def test_a_tier_directory_owned_by_another_user_is_refused(shm_dir: Path, tmp_path: Path) -> None:
    from skippyd.errors import ConfigError
    from skippyd.l3 import L3Store

    for target in (shm_dir / "theirs", tmp_path / "theirs-l3"):
        target.mkdir()
        os.chown(target, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        L2Tier.open(shm_dir / "theirs", 1 << 20)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        L3Store.open(tmp_path / "theirs-l3", 1 << 30)


def test_the_reserve_faults_a_block_slot_in_without_holding_the_tiers_lock(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the reserve faults a slot in (≈ 2 ms per 2 MiB at first touch here, longer under load), a
    lookup, a get or a put of another connection takes the tier's lock and goes on."""
    import threading

    from skippyd.l2.blocks import Prefault

    started, release = threading.Event(), threading.Event()
    real_fault = Prefault.fault

    def slow_fault(self: Prefault) -> None:
        started.set()
        assert release.wait(10)
        real_fault(self)

    monkeypatch.setattr(Prefault, "fault", slow_fault)
    slot = 256 * KB
    with L2Tier.open(shm_dir, 64 * slot) as tier:
        tier.blocks.expect(b"s" * 32, slot)
        before = tier.stats().block_slab_bytes
        added: list[int] = []
        reserve = threading.Thread(target=lambda: added.append(tier.prefault_step(16 * slot)))
        reserve.start()
        assert started.wait(10)
        got = tier.lock.acquire(timeout=2)  # the reserve's thread is in the middle of faulting
        assert got, "the reserve held the tier's lock while it faulted a slot in"
        try:
            assert tier.blocks.held([b"k" * 32]) == 0
            assert tier.stats().block_free_slots == 0, "a slot being faulted in is not free yet"
        finally:
            tier.lock.release()
        release.set()
        reserve.join(10)
        assert added == [slot]
        stats = tier.stats()
        assert (stats.block_free_slots, stats.block_prefaulted) == (1, 1)
        assert stats.block_slab_bytes > before


def test_a_slot_the_reserve_could_not_fault_in_goes_back_to_being_a_hole(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd.l2.blocks import Prefault

    def no_space(self: Prefault) -> None:
        raise NoSpace("tmpfs full")

    monkeypatch.setattr(Prefault, "fault", no_space)
    slot = 256 * KB
    with L2Tier.open(shm_dir, 64 * slot) as tier:
        tier.blocks.expect(b"s" * 32, slot)
        assert tier.prefault_step(16 * slot) == 0
        stats = tier.stats()
        assert (stats.block_free_slots, stats.block_prefaulted) == (0, 0)
        assert tier.blocks.charged == 0, "nothing stays charged: the slab holding only holes is gone"
        assert not list(shm_dir.rglob("*.slab"))


def test_populate_write_faults_a_writable_shared_mapping_and_refuses_a_closed_or_read_only_one(
    shm_dir: Path,
) -> None:
    import mmap

    from skippyd.shm import populate_write

    path = shm_dir / "populate"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        mapping = mmap.mmap(fd, 1 << 20)
        assert populate_write(mapping, 0, 1 << 20)
        assert os.stat(path).st_blocks * 512 >= 1 << 20, "the pages were given to the file"
        mapping[:5] = b"still"  # and the mapping is usable as before (no export left behind)
        mapping.close()
        assert not populate_write(mapping, 0, 4096)
        readonly = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
        assert not populate_write(readonly, 0, 4096)
        readonly.close()
    finally:
        os.close(fd)


def test_copy_and_hash_gives_the_payload_digest_of_the_copy_across_chunks() -> None:
    import numpy as np

    from skippyd.l2.tier import copy_and_hash
    from skippyd.payload import payload_digest, plan_layout

    decls = [
        TensorDecl("a", "uint8", (40 << 20,)),  # three chunks of 16 MiB, the last partial
        TensorDecl("b", "float32", (0,)),
        TensorDecl("c", "int64", (1000,)),
    ]
    specs, data_len = plan_layout(decls)
    source = np.random.default_rng(5).integers(0, 255, data_len, dtype=np.uint8)
    target = np.zeros(data_len, dtype=np.uint8)
    region = memoryview(target.data)
    digest = copy_and_hash(region, specs, source.data, threads=2)
    assert digest == payload_digest(source.data, specs)
    assert digest == payload_digest(region, specs)
    for spec in specs:
        assert np.array_equal(
            target[spec.offset : spec.offset + spec.nbytes], source[spec.offset : spec.offset + spec.nbytes]
        )


def test_an_identity_takes_its_own_served_file_before_the_shared_stock(shm_dir: Path) -> None:
    """A file served for an identity serves only it, a file no client was given serves anyone: an entry
    of that identity takes its own first, leaving the shared one for the others."""
    from skippyd.l2.pool import ANY_OWNER, owner_of

    with L2Tier.open(shm_dir, 4 * size_of(60 * KB)) as tier:
        served = admit_bytes(tier, "served", 60 * KB, fill=1)
        held = tier.hold(served.key)
        assert held is not None
        os.close(held.fd)
        unserved = admit_bytes(tier, "unserved", 60 * KB - 100, fill=2)
        assert tier.remove(served.key) and tier.remove(unserved.key)
        owners = sorted(f.owner for files in tier._pool._free.values() for f in files)
        assert owners == sorted([ANY_OWNER, owner_of(IDENT.digest)])
        admit_bytes(tier, "again", 60 * KB - 200, fill=3)
        assert [f.owner for files in tier._pool._free.values() for f in files] == [ANY_OWNER]
