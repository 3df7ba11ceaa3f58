"""The L3 durable tier: content-addressed payloads on local disk, verified by BLAKE3 on every load.

The in-memory index (:class:`~skippyd.index.PrefixIndex` of :class:`~skippyd.payload.EntryRef`) is
rebuilt from the manifests at start (:mod:`.reconcile`), so finding the longest recorded prefix never
costs a disk access; the whole manifest (tensor table, ``meta``, segment digests) is read when an entry
is loaded. Objects are shared by every manifest with the same bytes in the same layout.

A load reads an object segment by segment, hashing each segment on a second thread while the next one
is read, checks every segment digest and then the payload digest; any mismatch quarantines the entry
and raises :class:`~skippyd.errors.CorruptEntry`: wrong bytes are never returned.

The budget covers objects, manifests, quarantine and writes in flight; past it the least recently used
entries go until the store is at 85%. Below ``min_free_bytes`` of free disk L3 takes no writes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from blake3 import blake3

from skippyd.errors import CorruptEntry, InvalidArgument, NoSpace, NotFound, TooLarge
from skippyd.files import fsync_dir, private_dirs, release_owner_lock, remove, set_mtimes, take_owner_lock
from skippyd.index import PrefixIndex
from skippyd.payload import Entry, EntryRef, payload_digest

from . import reconcile as recovery
from .layout import Layout
from .manifest import MAX_MANIFEST, SEGMENT_BYTES, Manifest, decode_manifest, encode_manifest, object_id
from .packs import L3Blocks, L3BlockStats
from .reconcile import Reconciliation
from .trash import Trash

__all__ = ["L3Ref", "L3Stats", "L3Store"]

log = logging.getLogger("skippyd.l3")

_EVICT_TO = 0.85
_QUARANTINE_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class L3Ref:
    """An entry L3 holds, as the index knows it, and the object its data region is in."""

    entry: EntryRef
    object: str


@dataclass(slots=True)
class L3Stats(L3BlockStats):
    """The store's counters: its entries' below, its blocks' (``block_*``) from :class:`L3BlockStats`."""

    entries: int = 0
    objects: int = 0
    bytes: int = 0  # everything on disk: objects, manifests, quarantine, in-flight writes
    budget_bytes: int = 0
    quarantine_bytes: int = 0
    inflight_bytes: int = 0
    readonly: bool = False
    free_disk_bytes: int = 0
    hits: int = 0
    misses: int = 0
    fills: int = 0
    writes: int = 0
    write_skips: int = 0
    refused_writes: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(slots=True)
class _Record:
    entry: EntryRef
    object: str
    manifest_size: int
    last_use: int

    def ref(self) -> L3Ref:
        return L3Ref(self.entry, self.object)


class L3Store:
    """The disk tier. Thread-safe; one owning process per directory.

    The constructor takes the directory (its lock and subdirectories) and nothing else; :meth:`reconcile`
    rebuilds the index from disk and repairs what a crash left. :meth:`open` does both.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        min_free_bytes: int = 0,
        segment_bytes: int = SEGMENT_BYTES,
        hash_threads: int = 2,
    ) -> None:
        if budget_bytes <= 0:
            raise InvalidArgument("the L3 budget must be positive")
        self.directory = Path(directory)
        self.layout = Layout(self.directory)
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.segment_bytes = segment_bytes
        self._hash_threads = hash_threads
        self._lock = threading.RLock()
        self._index: PrefixIndex[_Record] = PrefixIndex()
        self._objects: dict[str, int] = {}  # object -> its size on disk
        self._object_keys: dict[str, set[str]] = {}  # object -> keys of the manifests that name it
        self._unsynced: dict[str, int] = {}  # keys renamed into place whose directory fsync is to come
        self._object_bytes = 0
        self._manifest_bytes = 0
        self._quarantine_bytes = 0
        self._inflight = 0
        self._dirty: set[str] = set()
        self._stats = L3Stats(budget_bytes=budget_bytes)
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skippyd-l3-hash")
        self._closed = False
        self.last_reconciliation = Reconciliation()
        self._trash = Trash(self.layout.tmp)  # evicted files: renamed aside under the lock, unlinked after
        private_dirs(self.directory)
        # before anything under the directory is touched
        self._lock_fd = take_owner_lock(self.directory, "L3 store")
        try:
            self.layout.create()
            self.blocks = L3Blocks(
                self.layout.packs, self.layout.tmp, self._lock, make_room=self._room_for_blocks,
                quarantine=self._quarantine_path, discard=self._trash.discard,
            )  # fmt: skip
        except BaseException:
            release_owner_lock(self._lock_fd)
            raise

    @property
    def lock(self) -> threading.RLock:
        """The store's lock: its entries and its blocks (:attr:`blocks`) change under it."""
        return self._lock

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        min_free_bytes: int = 0,
        segment_bytes: int = SEGMENT_BYTES,
        hash_threads: int = 2,
        verify_objects: bool = False,
    ) -> L3Store:
        """The store over ``directory``, reconciled (and with ``verify_objects``, every object re-hashed)."""
        store = cls(
            directory, budget_bytes, min_free_bytes=min_free_bytes, segment_bytes=segment_bytes,
            hash_threads=hash_threads,
        )  # fmt: skip
        try:
            store.reconcile(verify_objects=verify_objects)
        except BaseException:
            store.close()
            raise
        return store

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.flush_recency()
            self.blocks.close()
            self._hasher.shutdown(wait=True)
            self._trash.close()
            release_owner_lock(self._lock_fd)

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- reconciliation
    def reconcile(
        self, *, verify_objects: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> Reconciliation:
        """Rebuilds the index from disk and repairs what a crash can leave behind (see :mod:`.reconcile`);
        with ``verify_objects`` every object is read and checked against its manifest too."""
        with self._lock:
            scan = recovery.scan(self.layout)
            self._index.clear()
            self._objects = dict(scan.objects)
            self._object_keys = {}
            self._object_bytes = sum(self._objects.values())
            self._manifest_bytes = 0
            for found in scan.found:  # oldest use first
                self._index_record(_Record(found.manifest.entry.ref(), found.manifest.object, found.size,
                                           found.last_use))  # fmt: skip
            report = scan.report
            dropped_before = self.blocks.stats().block_dropped_packs
            report.problems += self.blocks.reconcile()
            report.block_packs_quarantined = self.blocks.stats().block_dropped_packs - dropped_before
            self._quarantine_bytes = sum(size for _, size in self.layout.quarantined())
            report.manifests = len(self._index)
            report.blocks = self.blocks.stats().block_count
        if verify_objects:
            self._verify_all(report, progress)
            corrupt_before = self.blocks.stats().block_corrupt
            report.blocks_verified, problems = self.blocks.verify_all()
            report.block_packs_quarantined = self.blocks.stats().block_corrupt - corrupt_before
            report.problems += problems
            report.blocks = self.blocks.stats().block_count
        if report.problems:
            log.warning(
                "L3 reconciliation: %d problem(s); first: %s", len(report.problems), report.problems[0]
            )
        self.last_reconciliation = report
        return report

    def _verify_all(self, report: Reconciliation, progress: Callable[[int, int], None] | None) -> None:
        with self._lock:
            objects = sorted(self._object_keys)
        for index, name in enumerate(objects):
            with self._lock:
                keys = sorted(self._object_keys.get(name, ()))
            if keys:
                try:
                    manifest = self.manifest(keys[0])
                    self._read_verified(manifest, bytearray(manifest.entry.data_len))
                    report.verified += 1
                except NotFound:
                    pass
                except CorruptEntry as exc:
                    report.objects_quarantined += 1
                    report.problems.append(f"object {name[:16]}: {exc}")
            if progress is not None:
                progress(index + 1, len(objects))

    # ----------------------------------------------------------------- index (lock held)
    def _index_record(self, record: _Record) -> None:
        old = self._index.get(record.entry.key)
        if old is not None:
            self._unindex(old)
        self._index.add(record)
        self._manifest_bytes += record.manifest_size
        self._object_keys.setdefault(record.object, set()).add(record.entry.key)

    def _unindex(self, record: _Record) -> None:
        if self._index.remove(record.entry.key) is None:
            return
        self._manifest_bytes -= record.manifest_size
        self._dirty.discard(record.entry.key)
        keys = self._object_keys.get(record.object)
        if keys is not None:
            keys.discard(record.entry.key)
            if not keys:
                del self._object_keys[record.object]

    def _used(self) -> int:
        return (
            self._object_bytes
            + self._manifest_bytes
            + self._quarantine_bytes
            + self._inflight
            + self.blocks.bytes
        )

    def _drop_object_if_unused(self, name: str) -> None:
        if name not in self._object_keys and name in self._objects:
            size = self._objects.pop(name)
            self._object_bytes -= size
            self._trash.discard(self.layout.object_path(name), size)  # (unlinked after the lock)

    def _link_of(self, entry: EntryRef | Entry) -> Path:
        return self.layout.link_path(entry.identity, entry.token_count, entry.key)

    # ----------------------------------------------------------------- lookups
    def prefix_lengths(self, identity_digest: str, upto: int) -> list[int]:
        with self._lock:
            return self._index.lengths(identity_digest, upto)

    def get(self, key: str) -> L3Ref | None:
        with self._lock:
            record = self._index.get(key)
            return record.ref() if record is not None else None

    def _synced(self, key: str) -> None:
        """One write of ``key`` has its rename fsynced (lock held)."""
        left = self._unsynced.pop(key, 1) - 1
        if left:
            self._unsynced[key] = left

    def holds_durably(self, key: str, digest: str) -> bool:
        """Whether ``key`` names these bytes and its manifest's rename is fsynced (a write renames and
        indexes under the lock, then fsyncs the directory outside it: until then, not yet)."""
        with self._lock:
            record = self._index.get(key)
            return record is not None and record.entry.digest == digest and key not in self._unsynced

    def entries(self) -> list[tuple[L3Ref, int]]:
        """Every entry with its last use (ns since the epoch), least recently used first."""
        with self._lock:
            return [(record.ref(), record.last_use) for record in self._index]

    def keys_by_digest(self, digest: str) -> list[str]:
        with self._lock:
            return self._index.keys_of(digest)

    def digests(self) -> list[str]:
        """Every payload digest held (once each)."""
        with self._lock:
            return self._index.digests()

    def manifest(self, key: str, *, expected: L3Ref | None = None) -> Manifest:
        """The whole entry (tensor table, ``meta``, segment digests), read from its manifest on disk.

        :class:`NotFound` when the key is gone or was rewritten since ``expected`` was looked up; a
        manifest that no longer checks out is quarantined (:class:`CorruptEntry`).
        """
        with self._lock:
            record = self._index.get(key)
            if record is None or (expected is not None and record.ref() != expected):
                raise NotFound("the L3 entry changed since it was looked up")
            ref = record.ref()
        try:
            with self.layout.manifest_path(key).open("rb") as handle:  # a bounded read of one small file
                raw = handle.read(MAX_MANIFEST + 1)
        except FileNotFoundError:
            with self._lock:
                gone = self._index.get(key) is not record
            if gone:
                raise NotFound("the L3 entry was evicted") from None
            self.quarantine(ref, "its manifest file is missing")
            raise CorruptEntry("L3 manifest file is missing") from None
        try:
            manifest = decode_manifest(raw)
            if manifest.entry.ref() != ref.entry or manifest.object != ref.object:
                raise CorruptEntry("L3 manifest disagrees with the index built from it")
        except CorruptEntry as exc:
            with self._lock:
                rewritten = self._index.get(key) is not record
            if rewritten:  # a newer write of the key went into place after the look-up: this read is stale
                raise NotFound("the L3 entry changed since it was looked up") from None
            self.quarantine(ref, str(exc))
            raise
        return manifest

    def touch(self, key: str) -> None:
        with self._lock:
            record = self._index.touch(key)
            if record is not None:
                record.last_use = max(record.last_use + 1, time.time_ns())
                self._dirty.add(key)

    def flush_recency(self) -> None:
        """Records the last use of each entry and pack used since the last flush as its file's mtime (a
        restart's LRU order): what to write is taken under the lock, the utimes (a disk write each)
        happen after it, so thousands of them never stall a restore or stats."""
        with self._lock:
            touched = self.blocks.recency_to_flush()
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                record = self._index.get(key)
                if record is not None:
                    touched.append((self.layout.manifest_path(key), record.last_use))
        set_mtimes(touched)

    def count_hit(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._stats.hits += 1
            else:
                self._stats.misses += 1

    # ----------------------------------------------------------------- write path
    def free_disk(self) -> int:
        """Free bytes on L3's filesystem, counting what evicted files not unlinked yet will free."""
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize + self._trash.pending_bytes

    @property
    def readonly(self) -> bool:
        return self.free_disk() < self.min_free_bytes

    def write(self, entry: Entry, data: memoryview, *, wanted: Callable[[], bool] | None = None) -> bool:
        """Stores an entry's data region durably; True if written, False if it was already there.

        ``wanted`` is asked (under the store's lock, right before the entry becomes visible) whether the
        write still matters: False drops it without a trace (an eviction or a newer capture of the key
        arrived while the bytes went to disk). It must not call back into this store.

        Raises :class:`NoSpace` (disk floor or a full filesystem) or :class:`TooLarge` (budget); a
        failed write leaves nothing behind but what was there before.
        """
        if len(data) != entry.data_len:
            raise InvalidArgument("the data region does not match the entry")
        free = self.free_disk()  # a statvfs: kept outside the lock
        name = object_id(entry.digest, entry.tensors, entry.data_len)
        with self._lock:
            existing = self._index.get(entry.key)
            if existing is not None and existing.object == name:
                self._stats.write_skips += 1
                return False
            have_object = name in self._objects
            need = (0 if have_object else entry.data_len) + 4096
            if need > self.budget_bytes * _EVICT_TO:
                self._stats.refused_writes += 1
                raise TooLarge(f"an entry of {need} bytes does not fit the L3 budget ({self.budget_bytes})")
            if free - need < self.min_free_bytes:
                self._stats.refused_writes += 1
                if free < need:
                    raise NoSpace(f"the L3 disk is full: {free} bytes free, the write needs {need}")
                self._stats.readonly = True
                raise NoSpace("L3 is read-only: the write would take the disk below its minimum free space")
            self._make_room(need)
            self._inflight += need
        added_object = False
        try:
            segments: tuple[str, ...] | None = None
            segment_bytes = self.segment_bytes
            if not have_object:
                segments = tuple(self._segment_digests(data))
                self.layout.write_file(self.layout.object_path(name), data)
            with self._lock:
                if have_object and name not in self._objects:
                    raise NoSpace("the shared object was evicted while this write waited")
                if not have_object:
                    added_object = name not in self._objects
                    self._objects[name] = entry.data_len
                    self._object_bytes += entry.data_len if added_object else 0
                    self._stats.bytes_written += entry.data_len
                source_key = None
                if segments is None:
                    keys = self._object_keys.get(name)
                    source_key = next(iter(keys)) if keys else None
                    if source_key is None:
                        raise NoSpace("the shared object lost its manifest while this write waited")
            if segments is None:
                assert source_key is not None
                try:
                    source = self.manifest(source_key)
                except (NotFound, CorruptEntry) as exc:
                    raise NoSpace(f"the shared object's manifest went away meanwhile: {exc}") from exc
                segments, segment_bytes = source.segments, source.segment_bytes
            manifest = Manifest(replace(entry, origin="l3"), segment_bytes, segments)
            raw = encode_manifest(manifest)
            final = self.layout.manifest_path(entry.key)
            staged = self.layout.stage_file(final, memoryview(raw))
            self.layout.write_link(self._link_of(entry))
            with self._lock:
                # the decision and the rename under one lock: an eviction or a newer capture that
                # happened while the bytes went to disk wins, and the disk never names what the index
                # does not
                if have_object and name not in self._objects:  # quarantined or evicted since it was read
                    remove(staged)
                    raise NoSpace("the shared object went away while this write ran; it is written again")
                if wanted is not None and not wanted():
                    remove(staged)
                    if entry.key not in self._index:  # a key's link path is the same for any object
                        with contextlib.suppress(FileNotFoundError):
                            self._link_of(entry).unlink()
                    self._stats.write_skips += 1
                    if added_object:
                        self._drop_object_if_unused(name)
                        added_object = False
                    return False
                os.rename(staged, final)
                self._unsynced[entry.key] = self._unsynced.get(entry.key, 0) + 1
                try:
                    old = self._index.get(entry.key)
                    self._index_record(_Record(manifest.entry.ref(), name, len(raw), time.time_ns()))
                    if old is not None and old.object != name:
                        self._drop_object_if_unused(old.object)  # (the key's link stays: same path)
                except BaseException:
                    self._synced(entry.key)
                    raise
                self._stats.writes += 1
                self._stats.bytes_written += len(raw)
                added_object = False
            fsync_dir(final.parent)  # (if it fails, the key never counts as durably held until a restart)
            with self._lock:
                self._synced(entry.key)
            return True
        except BaseException as exc:
            if added_object:  # the object went in but its manifest did not: no orphan is left behind
                with self._lock:
                    self._drop_object_if_unused(name)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                with self._lock:
                    self._stats.refused_writes += 1
                raise NoSpace(f"L3 disk full: {exc.strerror}") from exc
            raise
        finally:
            with self._lock:
                self._inflight -= need

    def _segment_digests(self, data: memoryview) -> list[str]:
        step = self.segment_bytes
        digests = []
        for i in range(0, len(data), step):
            with data[i : i + step] as part:
                digests.append(blake3(part, max_threads=self._hash_threads).hexdigest())
        return digests

    def _make_room(self, need: int) -> None:
        """Evicts (quarantine first, then least recently used entries) when a write would pass the cap."""
        if self._used() + need <= self.budget_bytes:
            return
        target = self.budget_bytes * _EVICT_TO - need
        for path, size in self.layout.quarantined():
            if self._used() <= target:
                return
            self._trash.discard(path, size)
            self._quarantine_bytes -= size
        while self._used() > target:
            victim = self._index.oldest()
            oldest_pack = self.blocks.oldest_tick()
            if oldest_pack is not None and (victim is None or oldest_pack < victim.last_use):
                self.blocks.evict_oldest()
                continue
            if victim is None:
                return
            self._remove_record(victim)
            self._stats.evictions += 1

    def _room_for_blocks(self, need: int) -> None:
        """Admits a pack of ``need`` bytes (lock held): refused past the budget or the disk floor, room
        made by eviction otherwise."""
        if need > self.budget_bytes * _EVICT_TO:
            self._stats.refused_writes += 1
            raise TooLarge(f"a pack of {need} bytes does not fit the L3 budget ({self.budget_bytes})")
        free = self.free_disk()
        if free - need < self.min_free_bytes:
            self._stats.refused_writes += 1
            if free < need:
                raise NoSpace(f"the L3 disk is full: {free} bytes free, the write needs {need}")
            raise NoSpace("L3 is read-only: the write would take the disk below its minimum free space")
        self._make_room(need)

    def _remove_record(self, record: _Record, touched: set[Path] | None = None) -> None:
        """Forgets one entry and unlinks its manifest and link; with ``touched``, adds the directories
        whose entries changed (an explicit eviction fsyncs them: it must not come back after a power
        cut; a budget eviction need not)."""
        self._unindex(record)
        for path in (self.layout.manifest_path(record.entry.key), self._link_of(record.entry)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if touched is not None:
                touched.add(path.parent)
        self._drop_object_if_unused(record.object)

    def _sync_dirs(self, touched: set[Path]) -> None:
        for directory in sorted(touched):
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(directory)

    def remove(self, key: str, *, digest: str | None = None) -> bool:
        """Removes the entry under ``key``, durably (its manifest's removal is fsynced); only if its payload
        digest is ``digest``, where given (a caller that looked first never removes one written since)."""
        touched: set[Path] = set()
        with self._lock:
            record = self._index.get(key)
            if record is None or (digest is not None and record.entry.digest != digest):
                return False
            self._remove_record(record, touched)
        self._sync_dirs(touched)
        return True

    def remove_by_digest(self, digest: str) -> int:
        touched: set[Path] = set()
        with self._lock:
            keys = self._index.keys_of(digest)
            for key in keys:
                record = self._index.get(key)
                if record is not None:
                    self._remove_record(record, touched)
        self._sync_dirs(touched)
        return len(keys)

    def clear(self) -> int:
        touched: set[Path] = set()
        with self._lock:
            records = list(self._index)
            for record in records:
                self._remove_record(record, touched)
        self._sync_dirs(touched)
        return len(records)

    # ----------------------------------------------------------------- read path
    def load_into(self, key: str, dest: memoryview, *, expected: L3Ref | None = None) -> Manifest:
        """Reads and verifies an entry's data region into ``dest``; corruption quarantines it.

        ``expected`` (what :meth:`get` gave the caller) must still be what the key names: if the key was
        rewritten since, :class:`NotFound` is raised rather than loading bytes the caller's description
        does not match.
        """
        manifest = self.manifest(key, expected=expected)
        if len(dest) < manifest.entry.data_len:
            raise InvalidArgument("the destination is smaller than the entry")
        self._read_verified(manifest, dest)
        with self._lock:
            self._stats.fills += 1
            self._stats.bytes_read += manifest.entry.data_len
        self.touch(key)
        return manifest

    def _read_verified(self, manifest: Manifest, dest: Any) -> None:
        entry = manifest.entry
        path = self.layout.object_path(manifest.object)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            with self._lock:
                still_indexed = manifest.object in self._objects
            if not still_indexed:  # evicted (or replaced) between the lookup and the open
                raise NotFound("the L3 entry was evicted") from None
            self.quarantine(manifest, "its object file is missing")
            raise CorruptEntry("L3 object file is missing") from None
        view = memoryview(dest).cast("B")
        chunk: memoryview | None = None
        pending: Future[str] | None = None
        try:
            if os.fstat(fd).st_size != entry.data_len:
                raise CorruptEntry("L3 object has the wrong size")
            step = manifest.segment_bytes
            for index, start in enumerate(range(0, entry.data_len, step)):
                stop = min(start + step, entry.data_len)
                chunk = view[start:stop]
                got = 0
                while got < len(chunk):
                    n = os.preadv(fd, [chunk[got:]], start + got)
                    if n <= 0:
                        raise CorruptEntry("L3 object ended early")
                    got += n
                if pending is not None:
                    _check_segment(pending.result(), manifest, index - 1)
                pending = self._hasher.submit(_hash, chunk)
            if pending is not None:
                _check_segment(pending.result(), manifest, len(manifest.segments) - 1)
            if payload_digest(view, entry.tensors, threads=self._hash_threads) != entry.digest:
                raise CorruptEntry("L3 payload digest does not match its manifest")
        except CorruptEntry as exc:
            self.quarantine(manifest, str(exc))
            raise
        finally:
            os.close(fd)
            # No view of the caller's memory may outlive this call (a traceback would keep it, and the
            # caller could then not unmap that memory): wait for the hash in flight, release the views.
            if pending is not None:
                wait([pending])
            if chunk is not None:
                chunk.release()
            view.release()

    def quarantine(self, entry: Manifest | L3Ref, reason: str) -> None:
        """Moves an entry (its manifest and, as no other manifest may use it, its object) out of service,
        with a note of ``reason`` for a post-mortem."""
        ref = entry if isinstance(entry, L3Ref) else L3Ref(entry.entry.ref(), entry.object)
        log.error("L3 entry quarantined: %s", reason)
        with self._lock:
            self._stats.corrupt += 1
            record = self._index.get(ref.entry.key)
            if record is not None and record.object == ref.object:
                # only this entry's manifest: a newer write of the key (another object) stays in service
                self._unindex(record)
                self._quarantine_path(self.layout.manifest_path(ref.entry.key), reason)
                with contextlib.suppress(FileNotFoundError):
                    self._link_of(ref.entry).unlink()
            # the object is bad for every manifest that names it
            for other in list(self._object_keys.get(ref.object, ())):
                sharing = self._index.get(other)
                if sharing is None:
                    continue
                self._unindex(sharing)
                self._quarantine_path(self.layout.manifest_path(other), f"shares corrupt object: {reason}")
                with contextlib.suppress(FileNotFoundError):
                    self._link_of(sharing.entry).unlink()
            if ref.object in self._objects:
                self._object_bytes -= self._objects.pop(ref.object)
                self._quarantine_path(self.layout.object_path(ref.object), reason)

    def _quarantine_path(self, path: Path, reason: str) -> None:
        """Quarantines one file (lock held), keeping the quarantine within its share of the budget."""
        stamp, added = self.layout.quarantine_file(path, reason)
        self._quarantine_bytes += added
        limit = int(self.budget_bytes * _QUARANTINE_SHARE)
        for old, size in self.layout.quarantined():  # oldest first; the file just quarantined stays
            if self._quarantine_bytes <= limit or old.name.startswith(stamp):
                break
            self._trash.discard(old, size)
            self._quarantine_bytes -= size

    # ----------------------------------------------------------------- stats
    def stats(self) -> L3Stats:
        free = self.free_disk()
        with self._lock:
            stats = replace(self._stats)
            stats.entries = len(self._index)
            stats.objects = len(self._objects)
            stats.bytes = self._used()
            stats.quarantine_bytes = self._quarantine_bytes
            stats.inflight_bytes = self._inflight
            stats.free_disk_bytes = free
            stats.readonly = free < self.min_free_bytes
            blocks = self.blocks.stats()
            for name in L3BlockStats.__slots__:
                setattr(stats, name, getattr(blocks, name))
            return stats

    def keys(self) -> list[str]:
        with self._lock:
            return [record.entry.key for record in self._index]


def _hash(chunk: memoryview) -> str:
    return str(blake3(chunk).hexdigest())


def _check_segment(digest: str, manifest: Manifest, index: int) -> None:
    if digest != manifest.segments[index]:
        raise CorruptEntry(f"L3 segment {index} does not match its digest")
