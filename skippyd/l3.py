"""The L3 durable tier: content-addressed payloads on local disk, verified by BLAKE3 on every load.

Layout under ``--l3-dir`` (directories 0700, files 0600)::

    .lock                          owner lock (flock), the owner's pid inside
    objects/<o[:2]>/<object>.obj   one data region per (payload digest, layout): exactly as an L2
                                   entry lays it out (tensors at 4 KiB offsets), shared by every
                                   manifest with the same bytes in the same layout
    manifests/<k[:2]>/<key>.man    one per cached entry: checksummed JSON (format, key, identity,
                                   kind, token_count, tensor table, meta, digest, data_len,
                                   segment size and a BLAKE3 per segment); mtime = last use
    links/<identity>/<count>.<key> prefix links: which token counts an identity has, longest first
    quarantine/<time>-<name>       whatever failed verification, kept for a post-mortem (budgeted)
    tmp/                           writes in progress

Every file is written to ``tmp/``, fsynced, renamed into place, and its directory fsynced, so a crash
(kill -9, power loss) never leaves a torn entry under a real name; start-up reconciliation removes
temporary files, quarantines manifests that do not parse or check out, drops dangling links, restores
missing ones and collects objects no manifest names. The in-memory index is rebuilt from the manifests
at start, so finding the longest recorded prefix never costs a disk access.

A load reads an object segment by segment, hashing each segment on a second thread while the next one
is read, checks every segment digest and then the payload digest; any mismatch quarantines the entry
and raises :class:`~skippyd.errors.CorruptEntry` — wrong bytes are never returned.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from blake3 import blake3

from .errors import CorruptEntry, InvalidArgument, NoSpace, NotFound, TooLarge
from .files import fsync_dir, private_dirs, remove, take_owner_lock
from .keys import is_hex_digest
from .l2 import L2Entry, _Lengths
from .payload import TensorSpec, payload_digest

__all__ = ["L3Entry", "L3Ref", "L3Stats", "L3Store", "Reconciliation"]

log = logging.getLogger("skippyd.l3")

MANIFEST_FORMAT = 1
SEGMENT_BYTES = 4 << 20
_MANIFEST_MAGIC = b"SKIPPYD-L3-MANIFEST 1\n"
_MAX_MANIFEST = 8 << 20
_EVICT_TO = 0.85
_QUARANTINE_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class L3Entry:
    key: str
    identity: str
    token_count: int
    kind: str
    digest: str
    meta: Mapping[str, Any]
    tensors: tuple[TensorSpec, ...]
    data_len: int
    segment_bytes: int
    segments: tuple[str, ...]
    created_ns: int
    # The stored data region's name: its content digest *and* its layout (offsets, sizes, length). Two
    # entries with the same tensor bytes laid out differently (other shapes, so other offsets) have the
    # same payload digest but not the same data region; they never share an object. Derived once here:
    # the index and every fill look it up.
    object: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "object", object_id(self.digest, self.tensors, self.data_len))

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    def ref(self) -> L3Ref:
        return L3Ref(
            key=self.key, identity=_intern(self.identity), token_count=self.token_count,
            kind=_intern(self.kind), digest=self.digest, object=self.object, data_len=self.data_len,
            nbytes=self.nbytes, tensor_count=len(self.tensors), created_ns=self.created_ns,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "key": self.key,
            "identity": self.identity,
            "token_count": self.token_count,
            "kind": self.kind,
            "digest": self.digest,
            "meta": dict(self.meta),
            "tensors": [spec.to_wire() for spec in self.tensors],
            "data_len": self.data_len,
            "segment_bytes": self.segment_bytes,
            "segments": list(self.segments),
            "created_ns": self.created_ns,
        }

    @classmethod
    def from_json(cls, doc: Any) -> L3Entry:
        try:
            if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
                raise CorruptEntry("unknown manifest format")
            tensors = tuple(TensorSpec.from_wire(item) for item in doc["tensors"])
            entry = cls(
                key=doc["key"],
                identity=doc["identity"],
                token_count=int(doc["token_count"]),
                kind=doc["kind"],
                digest=doc["digest"],
                meta=dict(doc["meta"]),
                tensors=tensors,
                data_len=int(doc["data_len"]),
                segment_bytes=int(doc["segment_bytes"]),
                segments=tuple(doc["segments"]),
                created_ns=int(doc.get("created_ns", 0)),
            )
        except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
            raise CorruptEntry(f"manifest is invalid: {exc}") from exc
        if not (is_hex_digest(entry.key) and is_hex_digest(entry.identity) and is_hex_digest(entry.digest)):
            raise CorruptEntry("manifest names are not digests")
        if entry.segment_bytes <= 0 or len(entry.segments) != -(-entry.data_len // entry.segment_bytes):
            raise CorruptEntry("manifest segment list does not cover the data")
        if any(not is_hex_digest(s) for s in entry.segments):
            raise CorruptEntry("manifest segment digests are malformed")
        end = 0
        for spec in entry.tensors:
            if spec.offset < end:
                raise CorruptEntry("manifest tensors overlap")
            end = spec.offset + spec.nbytes
        if end > entry.data_len:
            raise CorruptEntry("manifest tensors run past the data")
        return entry


@dataclass(frozen=True, slots=True)
class L3Ref:
    """What the in-memory index keeps of an entry: what lookups, listings and budgets need, and nothing
    more. The tensor table, ``meta`` and segment digests stay in the manifest on disk, read when the
    entry is loaded (:meth:`L3Store.manifest`), so the index costs the same per entry whatever the
    entry's ``meta`` holds (docs/operations.md, "Sizing")."""

    key: str
    identity: str
    token_count: int
    kind: str
    digest: str
    object: str
    data_len: int
    nbytes: int
    tensor_count: int
    created_ns: int


def object_id(digest: str, tensors: tuple[TensorSpec, ...], data_len: int) -> str:
    layout = json.dumps([[t.offset, t.nbytes] for t in tensors] + [data_len], separators=(",", ":"))
    return str(blake3(b"skippyd/l3-object/v1\x00" + digest.encode() + layout.encode()).hexdigest())


def encode_manifest(entry: L3Entry) -> bytes:
    body = json.dumps(entry.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return _MANIFEST_MAGIC + blake3(body).hexdigest().encode() + b"\n" + body


def decode_manifest(raw: bytes) -> L3Entry:
    if not raw.startswith(_MANIFEST_MAGIC):
        raise CorruptEntry("not a skippyd manifest")
    rest = raw[len(_MANIFEST_MAGIC) :]
    checksum, _, body = rest.partition(b"\n")
    if blake3(body).hexdigest().encode() != checksum:
        raise CorruptEntry("manifest checksum does not match")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptEntry(f"manifest is not JSON: {exc}") from exc
    return L3Entry.from_json(doc)


@dataclass(slots=True)
class L3Stats:
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

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass
class Reconciliation:
    """What start-up (or ``skippyd l3 fsck``) found and did."""

    manifests: int = 0
    objects: int = 0
    temporary_removed: int = 0
    manifests_quarantined: int = 0
    objects_quarantined: int = 0
    dangling_links_dropped: int = 0
    links_restored: int = 0
    orphans_collected: int = 0
    objects_renamed: int = 0  # regions of earlier stores (named by digest alone) given their current name
    verified: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(slots=True)
class _Record:
    ref: L3Ref
    manifest_size: int
    last_use: int


_interned: dict[str, str] = {}


def _intern(text: str) -> str:
    """One string object per identity digest or kind, however many entries share it."""
    return _interned.setdefault(text, text)


class L3Store:
    """The disk tier. Thread-safe; one owning process per directory."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        min_free_bytes: int = 0,
        segment_bytes: int = SEGMENT_BYTES,
        hash_threads: int = 2,
        verify_objects_at_start: bool = False,
    ) -> None:
        if budget_bytes <= 0:
            raise InvalidArgument("the L3 budget must be positive")
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.segment_bytes = segment_bytes
        self._hash_threads = hash_threads
        self._lock = threading.RLock()
        self._records: dict[str, _Record] = {}
        self._by_identity: dict[str, _Lengths] = {}
        self._by_digest: dict[str, set[str]] = {}  # payload digest -> keys (evict --digest)
        self._by_object: dict[str, set[str]] = {}  # object -> keys of the manifests that name it
        self._object_sizes: dict[str, int] = {}
        self._object_bytes = 0
        self._manifest_bytes = 0
        self._quarantine_bytes = 0
        self._inflight = 0
        self._dirty: set[str] = set()
        self._stats = L3Stats(budget_bytes=budget_bytes)
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skippyd-l3-hash")
        self._closed = False
        self._dirs = {
            name: self.directory / name for name in ("objects", "manifests", "links", "quarantine", "tmp")
        }
        private_dirs(self.directory, *self._dirs.values())
        self._lock_fd = take_owner_lock(self.directory)
        try:
            self.last_reconciliation = self.reconcile(verify_objects=verify_objects_at_start)
        except BaseException:
            self._hasher.shutdown(wait=False)
            os.close(self._lock_fd)
            raise

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.flush_recency()
            self._hasher.shutdown(wait=True)
            os.close(self._lock_fd)

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- paths (never from client text)
    def _object_path(self, name: str) -> Path:
        return self._dirs["objects"] / name[:2] / f"{name}.obj"

    def _manifest_path(self, key: str) -> Path:
        return self._dirs["manifests"] / key[:2] / f"{key}.man"

    def _link_path(self, entry: L3Ref | L3Entry) -> Path:
        return self._dirs["links"] / entry.identity / f"{entry.token_count}.{entry.key}"

    # ----------------------------------------------------------------- reconciliation
    def reconcile(
        self, *, verify_objects: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> Reconciliation:
        """Rebuilds the index from disk and repairs what a crash can leave behind."""
        report = Reconciliation()
        with self._lock:
            self._records.clear()
            self._by_identity.clear()
            self._by_digest.clear()
            self._by_object.clear()
            self._object_sizes.clear()
            self._object_bytes = self._manifest_bytes = 0
            for child in self._dirs["tmp"].iterdir():
                remove(child)
                report.temporary_removed += 1
            for shard in self._dirs["objects"].iterdir():
                for obj in shard.iterdir() if shard.is_dir() else ():
                    name = obj.name.removesuffix(".obj")
                    if not obj.name.endswith(".obj") or not is_hex_digest(name) or obj.is_symlink():
                        remove(obj)
                        report.orphans_collected += 1
                        continue
                    self._add_object(name, obj.stat().st_size)
            report.objects = len(self._object_sizes)
            found: list[tuple[int, str, _Record]] = []
            for shard in self._dirs["manifests"].iterdir():
                for man in shard.iterdir() if shard.is_dir() else ():
                    key = man.name.removesuffix(".man")
                    try:
                        if not man.name.endswith(".man") or not is_hex_digest(key) or man.is_symlink():
                            raise CorruptEntry(f"unexpected file {man.name}")
                        st = man.stat()
                        raw = man.read_bytes() if st.st_size <= _MAX_MANIFEST else b""
                        entry = decode_manifest(raw)
                        if entry.key != key:
                            raise CorruptEntry("manifest holds another key")
                        size = self._object_sizes.get(entry.object)
                        if size is None and self._object_sizes.get(entry.digest) == entry.data_len:
                            size = self._adopt_legacy_object(entry)
                            report.objects_renamed += 1
                        if size is None:
                            raise CorruptEntry("its object is missing")
                        if size != entry.data_len:
                            raise CorruptEntry("its object has the wrong size")
                    except (CorruptEntry, OSError) as exc:
                        self._quarantine_file(man, f"manifest {man.name}: {exc}")
                        report.manifests_quarantined += 1
                        report.problems.append(f"manifest {man.name}: {exc}")
                        continue
                    found.append((st.st_mtime_ns, key, _Record(entry.ref(), st.st_size, st.st_mtime_ns)))
            for _mtime, _key, record in sorted(found, key=lambda item: (item[0], item[1])):
                self._index(record)
            report.manifests = len(self._records)
            # links: drop dangling ones, restore missing ones
            wanted = {self._link_path(r.ref) for r in self._records.values()}
            for ident_dir in self._dirs["links"].iterdir():
                for link in ident_dir.iterdir() if ident_dir.is_dir() else ():
                    if link not in wanted:
                        remove(link)
                        report.dangling_links_dropped += 1
                if ident_dir.is_dir() and not any(ident_dir.iterdir()):
                    ident_dir.rmdir()
            for path in wanted:
                if not path.exists():
                    self._write_link(path)
                    report.links_restored += 1
            # objects no manifest names
            for name in list(self._object_sizes):
                if name not in self._by_object:
                    self._drop_object_if_unused(name)
                    report.orphans_collected += 1
            self._quarantine_bytes = sum(
                p.stat().st_size for p in self._dirs["quarantine"].iterdir() if p.is_file()
            )
        if verify_objects:
            self._verify_all(report, progress)
        if report.problems:
            log.warning(
                "L3 reconciliation: %d problem(s); first: %s", len(report.problems), report.problems[0]
            )
        return report

    def _verify_all(self, report: Reconciliation, progress: Callable[[int, int], None] | None) -> None:
        with self._lock:
            objects = sorted(self._by_object)
        for index, name in enumerate(objects):
            with self._lock:
                keys = sorted(self._by_object.get(name, ()))
                record = self._records.get(keys[0]) if keys else None
            if record is not None:
                try:
                    entry = self.manifest(record.ref.key, expected=record.ref)
                    self._read_verified(entry, bytearray(entry.data_len))
                    report.verified += 1
                except NotFound:
                    continue
                except CorruptEntry as exc:
                    report.objects_quarantined += 1
                    report.problems.append(f"object {name[:16]}: {exc}")
            if progress is not None:
                progress(index + 1, len(objects))

    def _adopt_legacy_object(self, entry: L3Entry) -> int:
        """Stores from before objects were named by digest *and* layout kept an entry's data region
        as ``<digest>.obj``: it gets its current name as a hard link (several layouts may have named
        that one file; loads verify every segment and the digest against each manifest, so a region
        written for another layout is caught there). The old name, named by no manifest now, is
        collected with the orphans."""
        old, new = self._object_path(entry.digest), self._object_path(entry.object)
        new.parent.mkdir(mode=0o700, exist_ok=True)
        os.link(old, new)
        fsync_dir(new.parent)
        size = self._object_sizes[entry.digest]
        self._add_object(entry.object, size)
        return size

    # ----------------------------------------------------------------- index (lock held)
    def _add_object(self, name: str, size: int) -> None:
        self._object_bytes += size - self._object_sizes.get(name, 0)
        self._object_sizes[name] = size

    def _index(self, record: _Record) -> None:
        entry = record.ref
        old = self._records.get(entry.key)
        if old is not None:
            self._unindex(old.ref)
        self._records[entry.key] = record
        self._manifest_bytes += record.manifest_size
        self._by_identity.setdefault(entry.identity, _Lengths()).add(entry.token_count)
        self._by_digest.setdefault(entry.digest, set()).add(entry.key)
        self._by_object.setdefault(entry.object, set()).add(entry.key)

    def _unindex(self, entry: L3Ref) -> None:
        record = self._records.pop(entry.key, None)
        if record is not None:
            self._manifest_bytes -= record.manifest_size
        self._dirty.discard(entry.key)
        lengths = self._by_identity.get(entry.identity)
        if lengths is not None:
            lengths.discard(entry.token_count)
            if not lengths.counts:
                del self._by_identity[entry.identity]
        for index, name in ((self._by_digest, entry.digest), (self._by_object, entry.object)):
            keys = index.get(name)
            if keys is not None:
                keys.discard(entry.key)
                if not keys:
                    del index[name]

    def _used(self) -> int:
        return self._object_bytes + self._manifest_bytes + self._quarantine_bytes + self._inflight

    # ----------------------------------------------------------------- lookups
    def prefix_lengths(self, identity_digest: str, upto: int) -> list[int]:
        with self._lock:
            lengths = self._by_identity.get(identity_digest)
            return lengths.upto(upto) if lengths is not None else []

    def get(self, key: str) -> L3Ref | None:
        with self._lock:
            record = self._records.get(key)
            return record.ref if record is not None else None

    def entries(self) -> list[tuple[L3Ref, int]]:
        with self._lock:
            return [(r.ref, r.last_use) for r in self._records.values()]

    def manifest(self, key: str, *, expected: L3Ref | None = None) -> L3Entry:
        """The whole entry (tensor table, ``meta``, segment digests), read from its manifest on disk.

        :class:`NotFound` when the key is gone or was rewritten since ``expected`` was looked up; a
        manifest that no longer checks out is quarantined (:class:`CorruptEntry`).
        """
        with self._lock:
            record = self._records.get(key)
            if record is None or (expected is not None and record.ref != expected):
                raise NotFound("the L3 entry changed since it was looked up")
            ref = record.ref
        path = self._manifest_path(key)
        try:
            with open(path, "rb") as handle:  # a bounded read of one small file
                raw = handle.read(_MAX_MANIFEST + 1)
        except FileNotFoundError:
            with self._lock:
                gone = self._records.get(key) is not record
            if gone:
                raise NotFound("the L3 entry was evicted") from None
            self._quarantine_ref(ref, "its manifest file is missing")
            raise CorruptEntry("L3 manifest file is missing") from None
        try:
            entry = decode_manifest(raw)
            if entry.ref() != ref:
                raise CorruptEntry("L3 manifest disagrees with the index built from it")
        except CorruptEntry as exc:
            self._quarantine_ref(ref, str(exc))
            raise
        return entry

    def touch(self, key: str) -> None:
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                record.last_use = max(record.last_use + 1, time.time_ns())
                self._dirty.add(key)

    def flush_recency(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                record = self._records.get(key)
                if record is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.utime(self._manifest_path(key), ns=(record.last_use, record.last_use))

    def count_hit(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._stats.hits += 1
            else:
                self._stats.misses += 1

    # ----------------------------------------------------------------- write path
    def free_disk(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    @property
    def readonly(self) -> bool:
        return self.free_disk() < self.min_free_bytes

    def write(self, entry: L2Entry, data: memoryview, *, wanted: Callable[[], bool] | None = None) -> bool:
        """Stores an L2 entry's data region durably; True if written, False if it was already there.

        ``wanted`` is asked (under the store's lock, right before the entry becomes visible) whether the
        write still matters: False drops it without a trace (an eviction or a newer capture of the key
        arrived while the bytes went to disk). It must not call back into this store.

        Raises :class:`NoSpace` (disk floor or a full filesystem) or :class:`TooLarge` (budget); a
        failed write leaves nothing behind but what was there before.
        """
        if len(data) != entry.data_len:
            raise InvalidArgument("the data region does not match the entry")
        free = self.free_disk()  # a statvfs: kept outside the lock
        with self._lock:
            existing = self._records.get(entry.key)
            name = object_id(entry.digest, entry.tensors, entry.data_len)
            if existing is not None and existing.ref.object == name:
                self._stats.write_skips += 1
                return False
            have_object = name in self._object_sizes
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
                self._write_file(self._object_path(name), data)
            with self._lock:
                if have_object and name not in self._object_sizes:
                    raise NoSpace("the shared object was evicted while this write waited")
                if not have_object:
                    added_object = name not in self._object_sizes
                    self._add_object(name, entry.data_len)
                    self._stats.bytes_written += entry.data_len
                source_key = None
                if segments is None:
                    keys = self._by_object.get(name)
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
            manifest = L3Entry(
                key=entry.key, identity=entry.identity, token_count=entry.token_count, kind=entry.kind,
                digest=entry.digest, meta=dict(entry.meta), tensors=entry.tensors, data_len=entry.data_len,
                segment_bytes=segment_bytes, segments=segments, created_ns=entry.created_ns,
            )  # fmt: skip
            raw = encode_manifest(manifest)
            final = self._manifest_path(entry.key)
            staged = self._stage_file(final, memoryview(raw))
            self._write_link(self._link_path(manifest))
            with self._lock:
                # the decision and the rename under one lock: an eviction or a newer capture that
                # happened while the bytes went to disk wins, and the disk never names what the index
                # does not
                if wanted is not None and not wanted():
                    remove(staged)
                    if entry.key not in self._records:  # a key's link path is the same for any object
                        with contextlib.suppress(FileNotFoundError):
                            self._link_path(manifest).unlink()
                    self._stats.write_skips += 1
                    if added_object:
                        self._drop_object_if_unused(name)
                        added_object = False
                    return False
                os.rename(staged, final)
                old = self._records.get(entry.key)
                self._index(_Record(manifest.ref(), len(raw), time.time_ns()))
                if old is not None and old.ref.object != manifest.object:
                    self._drop_object_if_unused(old.ref.object)  # (the key's link stays: same path)
                self._stats.writes += 1
                self._stats.bytes_written += len(raw)
                added_object = False
            fsync_dir(final.parent)
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

    def _write_file(self, final: Path, data: memoryview) -> None:
        """tmp + write + fsync + rename + directory fsync: the file appears whole or not at all."""
        os.rename(self._stage_file(final, data), final)
        fsync_dir(final.parent)

    def _stage_file(self, final: Path, data: memoryview) -> Path:
        """Writes and fsyncs ``data`` to a temporary file beside ``final``'s tier; returns its path."""
        final.parent.mkdir(mode=0o700, exist_ok=True)
        temp = self._dirs["tmp"] / f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        view = memoryview(data).cast("B")
        try:
            written = 0
            while written < len(view):
                with view[written : written + (64 << 20)] as part:
                    written += os.pwrite(fd, part, written)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            raise
        finally:
            # No view of the caller's memory may outlive this call, even when a traceback keeps this frame:
            # the caller could not unmap that memory afterwards (BufferError).
            view.release()
        os.close(fd)
        return temp

    def _write_link(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        fsync_dir(path.parent)

    def _make_room(self, need: int) -> None:
        """Evicts (quarantine first, then least recently used entries) when a write would pass the cap."""
        if self._used() + need <= self.budget_bytes:
            return
        target = self.budget_bytes * _EVICT_TO - need
        for path in sorted(self._dirs["quarantine"].iterdir(), key=lambda p: p.name):
            if self._used() <= target:
                return
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                path.unlink()
                self._quarantine_bytes -= size
        victims = sorted(self._records.values(), key=lambda r: (r.last_use, r.ref.key))
        for record in victims:
            if self._used() <= target:
                return
            self._remove_entry(record.ref)
            self._stats.evictions += 1

    def _remove_entry(self, entry: L3Ref) -> None:
        self._unindex(entry)
        for path in (self._manifest_path(entry.key), self._link_path(entry)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._drop_object_if_unused(entry.object)

    def _drop_object_if_unused(self, name: str) -> None:
        if name not in self._by_object and name in self._object_sizes:
            self._object_bytes -= self._object_sizes.pop(name)
            with contextlib.suppress(FileNotFoundError):
                self._object_path(name).unlink()

    def remove(self, key: str) -> bool:
        with self._lock:
            record = self._records.get(key)
            if record is None:
                return False
            self._remove_entry(record.ref)
            return True

    def keys_by_digest(self, digest: str) -> list[str]:
        with self._lock:
            return sorted(self._by_digest.get(digest, ()))

    def digests(self) -> list[str]:
        """Every payload digest held (once each)."""
        with self._lock:
            return list(self._by_digest)

    def remove_by_digest(self, digest: str) -> int:
        with self._lock:
            keys = list(self._by_digest.get(digest, ()))
            for key in keys:
                self.remove(key)
            return len(keys)

    def clear(self) -> int:
        with self._lock:
            records = list(self._records.values())
            for record in records:
                self._remove_entry(record.ref)
            return len(records)

    # ----------------------------------------------------------------- read path
    def load_into(self, key: str, dest: memoryview, *, expected: L3Entry | L3Ref | None = None) -> L3Entry:
        """Reads and verifies an entry's data region into ``dest``; corruption quarantines it.

        ``expected`` (what :meth:`manifest` gave the caller) must still be what the key names: if the
        key was rewritten since, :class:`NotFound` is raised rather than loading bytes the caller's
        description does not match.
        """
        if isinstance(expected, L3Entry):
            expected = expected.ref()
        entry = self.manifest(key, expected=expected)
        if len(dest) < entry.data_len:
            raise InvalidArgument("the destination is smaller than the entry")
        self._read_verified(entry, dest)
        with self._lock:
            self._stats.fills += 1
            self._stats.bytes_read += entry.data_len
        self.touch(key)
        return entry

    def _read_verified(self, entry: L3Entry, dest: Any) -> None:
        path = self._object_path(entry.object)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            with self._lock:
                still_indexed = entry.object in self._object_sizes
            if not still_indexed:  # evicted (or replaced) between the lookup and the open
                raise NotFound("the L3 entry was evicted") from None
            self.quarantine(entry, "its object file is missing")
            raise CorruptEntry("L3 object file is missing") from None
        view = memoryview(dest).cast("B")
        chunk: memoryview | None = None
        pending: Future[str] | None = None
        try:
            if os.fstat(fd).st_size != entry.data_len:
                raise CorruptEntry("L3 object has the wrong size")
            step = entry.segment_bytes
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
                    _check_segment(pending.result(), entry, index - 1)
                pending = self._hasher.submit(_hash, chunk)
            if pending is not None:
                _check_segment(pending.result(), entry, len(entry.segments) - 1)
            if payload_digest(view, entry.tensors, threads=self._hash_threads) != entry.digest:
                raise CorruptEntry("L3 payload digest does not match its manifest")
        except CorruptEntry as exc:
            self.quarantine(entry, str(exc))
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

    def quarantine(self, entry: L3Entry | L3Ref, reason: str) -> None:
        """Moves an entry (manifest and, if no other manifest shares it, its object) out of service."""
        self._quarantine_ref(entry if isinstance(entry, L3Ref) else entry.ref(), reason)

    def _quarantine_ref(self, entry: L3Ref, reason: str) -> None:
        log.error("L3 entry quarantined: %s", reason)
        with self._lock:
            self._stats.corrupt += 1
            record = self._records.get(entry.key)
            if record is not None and record.ref.object == entry.object:
                # only this entry's manifest: a newer write of the key (another object) stays in service
                self._unindex(record.ref)
                self._quarantine_file(self._manifest_path(entry.key), reason)
                with contextlib.suppress(FileNotFoundError):
                    self._link_path(entry).unlink()
            # the object is bad for every manifest that names it
            for other in list(self._by_object.get(entry.object, ())):
                record = self._records[other]
                self._unindex(record.ref)
                self._quarantine_file(self._manifest_path(other), f"shares corrupt object: {reason}")
                with contextlib.suppress(FileNotFoundError):
                    self._link_path(record.ref).unlink()
            if entry.object in self._object_sizes:
                self._object_bytes -= self._object_sizes.pop(entry.object)
                self._quarantine_file(self._object_path(entry.object), reason)

    def _quarantine_file(self, path: Path, reason: str) -> None:
        target = self._dirs["quarantine"] / f"{time.time_ns()}-{path.name}"
        try:
            size = path.stat().st_size
            os.rename(path, target)
        except OSError:
            return
        self._quarantine_bytes += size
        limit = int(self.budget_bytes * _QUARANTINE_SHARE)
        for old in sorted(self._dirs["quarantine"].iterdir(), key=lambda p: p.name):
            if self._quarantine_bytes <= limit or old == target:
                break
            with contextlib.suppress(OSError):
                old_size = old.stat().st_size
                old.unlink()
                self._quarantine_bytes -= old_size
        del reason

    # ----------------------------------------------------------------- stats
    def stats(self) -> L3Stats:
        free = self.free_disk()
        with self._lock:
            stats = replace(self._stats)
            stats.entries = len(self._records)
            stats.objects = len(self._object_sizes)
            stats.bytes = self._used()
            stats.quarantine_bytes = self._quarantine_bytes
            stats.inflight_bytes = self._inflight
            stats.free_disk_bytes = free
            stats.readonly = free < self.min_free_bytes
            return stats

    def iter_keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._records))


def _hash(chunk: memoryview) -> str:
    return str(blake3(chunk).hexdigest())


def _check_segment(digest: str, entry: L3Entry, index: int) -> None:
    if digest != entry.segments[index]:
        raise CorruptEntry(f"L3 segment {index} does not match its digest")
