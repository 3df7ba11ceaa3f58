"""The L3 store on real files: durable writes, verified loads, quarantine, budgets, reconciliation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import l2util
import pytest
from blake3 import blake3
from l2util import IDENT, borrow, key_of

from skippyd.errors import CorruptEntry, NoSpace, NotFound, StoreLocked, TooLarge
from skippyd.l2 import L2Tier
from skippyd.l3 import L3Store
from skippyd.l3.layout import Layout
from skippyd.payload import Entry, TensorDecl

KB, MB = 1024, 1 << 20


@pytest.fixture
def l2(shm_dir: Path) -> Iterator[L2Tier]:
    with L2Tier.open(shm_dir, 512 * MB) as tier:
        yield tier


def admit(l2: L2Tier, name: str, sizes: list[int], fill: int = 3) -> Entry:
    tensors = [TensorDecl(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    data = [bytes([(fill + i) % 256]) * n for i, n in enumerate(sizes)]
    return l2util.admit(
        l2, key=key_of(name), identity=IDENT, token_count=len(name), tensors=tensors, data=data
    )


def store(l2: L2Tier, l3: L3Store, entry: Entry) -> bool:
    with borrow(l2, entry.key) as (_e, view):
        return l3.write(entry, view)


def load(l3: L3Store, key: str) -> bytes:
    entry = l3.get(key)
    assert entry is not None
    buf = bytearray(entry.entry.data_len)
    l3.load_into(key, memoryview(buf))
    return bytes(buf)


def expected_bytes(l2: L2Tier, entry: Entry) -> bytes:
    with borrow(l2, entry.key) as (_e, view):
        return bytes(view)


def test_a_written_entry_loads_verified_and_survives_a_new_process(l2: L2Tier, tmp_path: Path) -> None:
    entry = admit(l2, "abc", [100 * KB, 0, 3 * MB + 5])
    with L3Store.open(tmp_path / "l3", 1 << 30, segment_bytes=MB) as l3:
        assert store(l2, l3, entry) is True
        assert load(l3, entry.key) == expected_bytes(l2, entry)
        found = l3.get(entry.key)
        assert found is not None and found.entry.digest == entry.digest
        assert len(l3.manifest(entry.key, expected=found).segments) == 4
        assert l3.prefix_lengths(IDENT.digest, 10) == [3]
    with L3Store.open(tmp_path / "l3", 1 << 30) as again:
        assert again.last_reconciliation.manifests == 1
        assert load(again, entry.key) == expected_bytes(l2, entry)
    for path in (tmp_path / "l3").rglob("*"):
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), path


def test_rewriting_identical_content_is_idempotent_and_shared_objects_are_stored_once(
    l2: L2Tier, tmp_path: Path
) -> None:
    a = admit(l2, "aaa", [MB], fill=9)
    b = admit(l2, "bbbb", [MB], fill=9)  # same bytes under another key
    assert a.digest == b.digest
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        assert store(l2, l3, a) is True
        assert store(l2, l3, a) is False
        assert store(l2, l3, b) is True
        stats = l3.stats()
        assert (stats.entries, stats.objects, stats.write_skips) == (2, 1, 1)
        assert l3.remove(a.key)
        assert load(l3, b.key) == expected_bytes(l2, b), "the object stays while a manifest names it"
        assert l3.remove(b.key)
        assert l3.stats().objects == 0
        assert not any((tmp_path / "l3" / "objects").rglob("*.obj"))


@pytest.mark.parametrize("segment", [0, 1, 2, 3])
def test_a_flipped_byte_in_any_segment_is_a_miss_and_a_quarantine_never_wrong_bytes(
    l2: L2Tier, tmp_path: Path, segment: int
) -> None:
    entry = admit(l2, "abc", [MB, 2 * MB + 10])
    other = admit(l2, "other", [KB], fill=77)
    with L3Store.open(tmp_path / "l3", 1 << 30, segment_bytes=MB) as l3:
        store(l2, l3, entry)
        store(l2, l3, other)
        found = l3.get(entry.key)
        assert found is not None
        obj = next((tmp_path / "l3" / "objects").rglob(f"{found.object}.obj"))
        where = segment * MB + (5 if segment == 3 else 123)  # the last segment holds 10 bytes
        with open(obj, "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0xFF]))
        buf = bytearray(entry.data_len)
        with pytest.raises(CorruptEntry):
            l3.load_into(entry.key, memoryview(buf))
        assert l3.get(entry.key) is None
        assert l3.stats().corrupt == 1
        assert any((tmp_path / "l3" / "quarantine").iterdir())
        with pytest.raises(NotFound):
            l3.load_into(entry.key, memoryview(buf))
        assert load(l3, other.key) == expected_bytes(l2, other), "other entries are untouched"


def test_a_flipped_byte_in_a_manifest_is_quarantined_at_start(l2: L2Tier, tmp_path: Path) -> None:
    entry = admit(l2, "abc", [64 * KB])
    keep = admit(l2, "keep", [64 * KB], fill=5)
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        store(l2, l3, entry)
        store(l2, l3, keep)
    manifest = next((tmp_path / "l3" / "manifests").rglob(f"{entry.key}.man"))
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    manifest.write_bytes(bytes(raw))
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        report = l3.last_reconciliation
        assert report.manifests_quarantined == 1 and report.manifests == 1
        assert l3.get(entry.key) is None and l3.get(keep.key) is not None
        assert report.orphans_collected == 0 or l3.stats().objects == 1


def test_startup_reconciliation_repairs_what_a_crash_leaves(l2: L2Tier, tmp_path: Path) -> None:
    entries = [admit(l2, name, [32 * KB], fill=i) for i, name in enumerate(["a1", "b22", "c333"])]
    root = tmp_path / "l3"
    with L3Store.open(root, 1 << 30) as l3:
        for e in entries:
            store(l2, l3, e)
        stored = l3.get(entries[1].key)
        assert stored is not None
    (root / "tmp" / "half.obj.123.tmp").write_bytes(b"x" * 1000)  # a write cut short
    orphan = root / "objects" / "ff" / ("f" * 64 + ".obj")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"y" * 10)  # an object no manifest names
    dangling = root / "links" / IDENT.digest / f"7.{'e' * 64}"
    dangling.write_bytes(b"")  # a link to a manifest that is gone
    missing_link = next((root / "links").rglob(f"*.{entries[0].key}"))
    missing_link.unlink()
    missing_object = root / "objects" / stored.object[:2] / f"{stored.object}.obj"
    missing_object.unlink()  # its manifest now points at nothing
    with L3Store.open(root, 1 << 30) as l3:
        report = l3.last_reconciliation
        assert report.temporary_removed == 1
        assert report.orphans_collected == 1
        assert report.dangling_links_dropped == 2, "the stray link and the quarantined manifest's"
        assert report.links_restored == 1
        assert report.manifests_quarantined == 1
        assert sorted(l3.keys()) == sorted([entries[0].key, entries[2].key])
    assert not any((root / "tmp").iterdir()) and not orphan.exists() and not dangling.exists()


def test_the_budget_covers_everything_and_evicts_oldest_use_down_to_85_percent(
    l2: L2Tier, tmp_path: Path
) -> None:
    entries = [admit(l2, f"e{i:02d}", [MB], fill=i) for i in range(10)]
    with L3Store.open(tmp_path / "l3", 6 * MB) as l3:
        for e in entries[:5]:
            store(l2, l3, e)
        assert l3.stats().evictions == 0
        l3.touch(entries[0].key)  # used recently: kept over 1, 2, 3
        store(l2, l3, entries[5])  # over the cap: evict until the store, new entry included, is <= 85%
        assert l3.stats().evictions == 1
        assert [l3.get(e.key) is not None for e in entries[:6]] == [True, False, True, True, True, True]
        assert l3.stats().bytes <= 0.85 * 6 * MB
        for e in entries[6:]:
            store(l2, l3, e)
            assert l3.stats().bytes <= 6 * MB
        assert l3.get(entries[-1].key) is not None
        with pytest.raises(TooLarge):
            store(l2, l3, admit(l2, "huge", [6 * MB]))
        assert l3.stats().refused_writes == 1


def test_evicted_files_are_unlinked_after_the_lock_and_count_as_free_until_then(
    l2: L2Tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unlinking a large file on a journaled disk takes milliseconds (it frees the extents there and
    then): an eviction of thousands under the L3 lock stalled every restore's look at L3. The files are
    renamed aside under the lock and unlinked by the trash's thread; their bytes count as free disk until
    then, and a restart empties what a crash left aside."""
    import threading

    entries = [admit(l2, f"t{i:02d}", [MB], fill=i) for i in range(7)]
    unlinked: list[tuple[str, bool]] = []
    gate = threading.Event()
    real = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.endswith((".obj", ".gone")):
            thread = threading.current_thread().name
            unlinked.append((thread, l3.lock._is_owned()))  # type: ignore[attr-defined]
            if thread == "skippyd-l3-trash":
                assert gate.wait(10)
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with L3Store.open(tmp_path / "l3", 6 * MB) as l3:
        for e in entries[:5]:
            store(l2, l3, e)
        store(l2, l3, entries[5])  # over the cap: the oldest entry is evicted
        assert l3.stats().evictions == 1 and l3.get(entries[0].key) is None
        aside = list(l3.layout.tmp.iterdir())
        assert len(aside) == 1 and aside[0].name.endswith(".gone"), "renamed aside, not unlinked yet"
        st = os.statvfs(l3.directory)
        assert l3.free_disk() - st.f_bavail * st.f_frsize >= MB, "its bytes count as free already"
        gate.set()
        assert l3._trash.drain(10) and not list(l3.layout.tmp.iterdir())
        assert unlinked and all(thread == "skippyd-l3-trash" and not locked for thread, locked in unlinked), (
            "never unlinked under the lock, nor by the thread that evicted"
        )
        (l3.layout.tmp / "left.by-a-crash.gone").write_bytes(b"x" * KB)  # renamed aside, never unlinked
    with L3Store.open(tmp_path / "l3", 6 * MB) as again:
        assert not list(again.layout.tmp.iterdir()), "a start empties what was set aside"
        assert again.get(entries[5].key) is not None


def test_below_the_free_space_floor_l3_is_read_only(l2: L2Tier, tmp_path: Path) -> None:
    entry = admit(l2, "abc", [KB])
    with L3Store.open(tmp_path / "l3", 1 << 30, min_free_bytes=1 << 60) as l3:
        with pytest.raises(NoSpace, match="read-only"):
            store(l2, l3, entry)
        stats = l3.stats()
        assert stats.readonly and stats.refused_writes == 1 and stats.entries == 0


@pytest.fixture
def small_fs(mount_tmpfs: Any) -> Path:
    return Path(mount_tmpfs("2m"))


def test_a_nearly_full_filesystem_refuses_writes_cleanly(l2: L2Tier, small_fs: Path) -> None:
    small = admit(l2, "fits", [256 * KB])
    big = admit(l2, "nope", [3 * MB])
    with L3Store.open(small_fs / "l3", 1 << 30) as l3:
        store(l2, l3, small)
        with pytest.raises(NoSpace):
            store(l2, l3, big)
        assert list(l3.keys()) == [small.key]
        assert not any((small_fs / "l3" / "tmp").iterdir())
        assert load(l3, small.key) == expected_bytes(l2, small)
    with L3Store.open(small_fs / "l3", 1 << 30) as l3:
        assert l3.last_reconciliation.manifests == 1


def test_one_owner_per_directory(tmp_path: Path) -> None:
    with L3Store.open(tmp_path / "l3", 1 << 30), pytest.raises(StoreLocked):
        L3Store.open(tmp_path / "l3", 1 << 30)


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    from l2util import admit, borrow
    from skippyd.l2 import L2Tier
    from skippyd.l3 import L3Store
    from skippyd.keys import Identity, cache_key, encode_tokens
    from skippyd.payload import TensorDecl
    ident = Identity("m", "s")
    l2 = L2Tier.open(sys.argv[2], 1 << 30)
    l3 = L3Store.open(sys.argv[1], 1 << 40)
    for i in range(10000):
        key = cache_key(ident, encode_tokens([i]))
        e = admit(l2, key=key, identity=ident, token_count=1, tensors=[TensorDecl("x", "uint8", (8 << 20,))],
                     data=[bytes([i % 256]) * (8 << 20)])
        with borrow(l2, key) as (entry, view):
            l3.write(entry, view)
        l2.remove(key)
        print(i, flush=True)
    """
)


def test_kill_9_during_a_write_leaves_no_torn_entry(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "l3"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(shm_dir / "l2"), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for _ in range(3):
        proc.stdout.readline()  # a few complete writes first
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with L3Store.open(root, 1 << 40) as l3:
        keys = list(l3.keys())
        assert len(keys) >= 3
        for key in keys:  # every entry it kept is whole and verifies
            ref = l3.get(key)
            assert ref is not None
            data = bytearray(ref.entry.data_len)
            l3.load_into(key, memoryview(data))
            assert blake3(bytes(data)).hexdigest() == ref.entry.digest
    assert not any((root / "tmp").iterdir())


def test_a_write_no_longer_wanted_leaves_no_trace(l2: L2Tier, tmp_path: Path) -> None:
    entry = admit(l2, "abc", [64 * KB])
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        with borrow(l2, entry.key) as (_e, view):
            assert l3.write(entry, view, wanted=lambda: False) is False
        assert l3.get(entry.key) is None and l3.stats().objects == 0 and l3.stats().bytes == 0
    for folder in ("objects", "manifests", "links", "tmp"):
        assert not [p for p in (tmp_path / "l3" / folder).rglob("*") if p.is_file()], folder
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        assert l3.get(entry.key) is None, "nothing comes back at the next start either"


def test_a_manifest_that_cannot_be_written_leaves_no_orphan_object(
    l2: L2Tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    entry = admit(l2, "abc", [64 * KB])
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        real = Layout.stage_file

        def stage(self: Layout, final: Path, data: memoryview) -> Path:
            if final.suffix == ".man":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(self, final, data)

        monkeypatch.setattr(Layout, "stage_file", stage)
        with pytest.raises(NoSpace):
            store(l2, l3, entry)
        assert l3.stats().objects == 0 and l3.stats().bytes == 0
        assert not list((tmp_path / "l3" / "objects").rglob("*.obj"))
        monkeypatch.setattr(Layout, "stage_file", real)
        assert store(l2, l3, entry) is True, "a later write succeeds normally"
        assert load(l3, entry.key) == expected_bytes(l2, entry)


def test_a_load_of_an_entry_rewritten_since_its_lookup_is_not_found(l2: L2Tier, tmp_path: Path) -> None:
    first = admit(l2, "abc", [64 * KB], fill=1)
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        store(l2, l3, first)
        looked_up = l3.get(first.key)
        assert looked_up is not None
        second = admit(l2, "abc", [64 * KB], fill=2)  # the same key, other bytes
        store(l2, l3, second)
        buf = bytearray(first.data_len)
        with pytest.raises(NotFound):
            l3.load_into(first.key, memoryview(buf), expected=looked_up)
        current = l3.get(first.key)
        assert current is not None
        l3.load_into(first.key, memoryview(buf), expected=current)
        assert bytes(buf) == expected_bytes(l2, second)


def test_a_load_racing_a_rewrite_of_its_key_is_a_miss_and_quarantines_no_other_key(
    l2: L2Tier, tmp_path: Path
) -> None:
    """A newer write of the key goes into place between a load's index look-up and its manifest read
    (outside the lock): the load sees the new manifest, which is a miss (the entry changed), not a
    corrupt one. Quarantining would also take the old object and every other key's manifest sharing it."""
    first = admit(l2, "abc", [64 * KB], fill=1)
    twin = admit(l2, "xyz", [64 * KB], fill=1)  # the same bytes under another key: one object for both
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        store(l2, l3, first)
        store(l2, l3, twin)
        looked_up = l3.get(first.key)
        assert looked_up is not None
        rewrites: list[bool] = []
        armed = [True]
        second: list[Entry] = []

        class RewriteBeforeTheRead(Layout):
            def manifest_path(self, key: str) -> Path:
                if key == first.key and armed:
                    armed.clear()  # (the rewrite asks for this path too)
                    second.append(admit(l2, "abc", [64 * KB], fill=2))  # the same key, other bytes
                    rewrites.append(store(l2, l3, second[0]))  # lands between the look-up and the read
                return super().manifest_path(key)

        object.__setattr__(l3, "layout", RewriteBeforeTheRead(l3.layout.root))
        with pytest.raises(NotFound):
            l3.load_into(first.key, memoryview(bytearray(first.data_len)), expected=looked_up)
        assert rewrites == [True]
        assert l3.stats().corrupt == 0
        assert load(l3, twin.key) == expected_bytes(l2, twin)
        assert load(l3, first.key) == expected_bytes(l2, second[0])
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        assert load(l3, twin.key) == expected_bytes(l2, twin), "and after a restart"
        assert not any((tmp_path / "l3" / "quarantine").iterdir())


def test_quarantining_an_old_version_keeps_the_keys_newer_manifest_in_service(
    l2: L2Tier, tmp_path: Path
) -> None:
    first = admit(l2, "abc", [64 * KB], fill=1)
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        store(l2, l3, first)
        old = l3.get(first.key)
        assert old is not None
        second = admit(l2, "abc", [64 * KB], fill=2)
        store(l2, l3, second)
        l3.quarantine(old, "a reader found the old object bad")
        assert load(l3, first.key) == expected_bytes(l2, second)
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        report = l3.last_reconciliation
        assert report.manifests_quarantined == 0 and report.links_restored == 0
        assert load(l3, first.key) == expected_bytes(l2, second), "and after a restart"


def test_rewriting_a_key_with_other_bytes_keeps_its_link(l2: L2Tier, tmp_path: Path) -> None:
    first = admit(l2, "abc", [64 * KB], fill=1)
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        store(l2, l3, first)
        store(l2, l3, admit(l2, "abc", [64 * KB], fill=2))
        assert l3.stats().objects == 1, "the first object had no other manifest: dropped"
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        assert l3.last_reconciliation.links_restored == 0
        assert l3.prefix_lengths(IDENT.digest, 10) == [3]


def test_a_store_from_before_objects_were_named_by_layout_is_adopted_not_wiped(
    l2: L2Tier, tmp_path: Path
) -> None:
    """Earlier versions kept a data region as ``<digest>.obj``; an upgrade moves it, and serves it."""
    entry = admit(l2, "abc", [100 * KB, 5])
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        assert store(l2, l3, entry) is True
        stored = l3.get(entry.key)
        assert stored is not None
        current = l3.layout.object_path(stored.object)
        legacy = l3.layout.object_path(stored.entry.digest)
    legacy.parent.mkdir(mode=0o700, exist_ok=True)
    os.rename(current, legacy)
    with L3Store.open(tmp_path / "l3", 1 << 30) as upgraded:
        report = upgraded.last_reconciliation
        assert report.objects_renamed == 1 and report.manifests == 1
        assert report.manifests_quarantined == 0 and report.orphans_collected == 1  # the old name
        assert load(upgraded, entry.key) == expected_bytes(l2, entry)
    assert current.exists() and not legacy.exists()


def test_a_new_shard_directory_is_on_disk_before_a_file_is_renamed_into_it_and_evictions_are_synced(
    l2: L2Tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An acknowledged write's manifest and object sit in ``xx/`` shard directories created on demand:
    each new one's entry is fsynced in its parent (the rename's own directory fsync does not cover it),
    so a power cut cannot lose the directory, and with it the acknowledged file."""
    import skippyd.files
    import skippyd.l3.layout
    import skippyd.l3.store

    synced: list[Path] = []
    real = skippyd.files.fsync_dir

    def recording(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(skippyd.files, "fsync_dir", recording)
    monkeypatch.setattr(skippyd.l3.layout, "fsync_dir", recording)
    monkeypatch.setattr(skippyd.l3.store, "fsync_dir", recording)
    entry = admit(l2, "abc", [64 * KB])
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        synced.clear()
        assert store(l2, l3, entry)
        found = l3.get(entry.key)
        assert found is not None
        for final in (l3.layout.manifest_path(entry.key), l3.layout.object_path(found.object)):
            shard = final.parent
            assert shard.parent in synced and shard in synced, (final, synced)
            assert synced.index(shard.parent) < synced.index(shard)  # the directory first, then the file
        synced.clear()
        assert l3.remove(entry.key)
        assert l3.layout.manifest_path(entry.key).parent in synced, "an explicit eviction is durable too"


def test_an_entry_counts_as_durably_held_only_once_its_manifests_directory_is_fsynced(
    l2: L2Tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write renames its manifest and indexes it under the lock, then fsyncs the directory outside it:
    in between, a restore may find it, but a durable capture of the same bytes is not told ``written``
    (what answers that, ``holds_durably``, says not yet)."""
    import skippyd.files
    import skippyd.l3.store

    entry = admit(l2, "abc", [64 * KB])
    seen: list[tuple[bool, bool]] = []
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        real = skippyd.files.fsync_dir

        def looking(path: Path) -> None:
            if path == l3.layout.manifest_path(entry.key).parent:
                seen.append((l3.get(entry.key) is not None, l3.holds_durably(entry.key, entry.digest)))
            real(path)

        monkeypatch.setattr(skippyd.l3.store, "fsync_dir", looking)
        assert store(l2, l3, entry)
        assert seen == [(True, False)]
        assert l3.holds_durably(entry.key, entry.digest)
        assert not l3.holds_durably(entry.key, "0" * 64)


def test_reconciliation_never_follows_a_symlink_out_of_the_store_and_removes_strays(
    l2: L2Tier, tmp_path: Path
) -> None:
    """A symlink where a shard directory belongs (an operator pointing objects/zz at another disk, say)
    was followed: repairing through it deleted, or quarantined, files outside the store, and one in
    links/ crashed every start. Only the link goes; stray files at the top of each directory go too."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "ab12.obj").write_text("not an object of the store")
    entry = admit(l2, "kept", [4 * KB], fill=5)
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        store(l2, l3, entry)
        expected = load(l3, entry.key)
    root = tmp_path / "l3"
    for sub in ("objects", "manifests", "links"):
        (root / sub / "zz").symlink_to(outside, target_is_directory=True)
        (root / sub / "stray.txt").write_text("x")
    with L3Store.open(tmp_path / "l3", 1 << 30) as l3:
        report = l3.last_reconciliation
        assert load(l3, entry.key) == expected, "the valid entry stays"
    assert sorted(p.name for p in outside.iterdir()) == ["ab12.obj", "precious.txt"]
    for sub in ("objects", "manifests", "links"):
        assert not (root / sub / "zz").exists() and not (root / sub / "zz").is_symlink()
        assert not (root / sub / "stray.txt").exists()
    assert report.orphans_collected >= 6 and any("no directory of the store" in p for p in report.problems)
