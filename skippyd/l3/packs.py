"""Blocks in L3: immutable pack files, one per group commit, inside the store's budget.

A pack holds many blocks: their bytes (each 4 KiB-aligned), then a table of one record per block,
then a footer naming the table and its checksum. It is written whole to ``tmp/``, fsynced, renamed
into ``packs/`` and the directory fsynced, so a crash leaves either the whole pack or none of it, and
64 GiB of 256 KiB blocks costs one fsync per batch, not one per block. Layout in docs/format.md.

* **Removal** appends the record's index to the pack's ``.dead`` sidecar (fsynced for explicit
  evictions; budget evictions need no fsync: a block that comes back after a crash is still valid).
  A pack with nothing live is unlinked; one at least half dead is compacted: its live blocks are
  written into a new pack (read and verified first), then it is unlinked.
* **Budget eviction** takes the pack whose newest use is the oldest, and every block known to continue
  a block it held (a chain is never kept behind a hole).
* **Reads verify.** Every block read is hashed (BLAKE3) against its record while the next one is read;
  a mismatch quarantines the whole pack (with a note of why): wrong bytes are never returned.
* **Duplicates**: the same key in two packs (a crash between a compaction's rename and its unlink)
  resolves to the newer pack at reconciliation.

Every method runs under the store's lock except the I/O of :meth:`L3Blocks.write` and :meth:`read_into`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from skippyd.errors import CorruptEntry, NoSpace
from skippyd.files import fsync_dir, private_dirs, remove, set_mtimes
from skippyd.shm import new_name

__all__ = ["BlockItem", "L3BlockStats", "L3Blocks", "PackRecord"]

log = logging.getLogger("skippyd.l3")

PACK_MAGIC = b"SKPPACK1"
PACK_VERSION = 1
PACK_SUFFIX = ".pack"
DEAD_SUFFIX = ".dead"
_RECORD = struct.Struct("<32s32s32s32s32sQQII8x")  # key, space, identity, parent, digest, offset, nbytes,
#                                                     block_tokens, flags
_FOOTER = struct.Struct("<8sIIQQ16s")  # magic, version, count, table offset, table bytes, table checksum
_FOOTER_SIZE = _FOOTER.size + 16
_ALIGN = 4096
_FLAG_PARENT = 1
_COMPACT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class PackRecord:
    key: bytes
    space: bytes
    identity: bytes
    block_tokens: int
    parent: bytes | None
    nbytes: int
    digest: bytes
    offset: int = 0


@dataclass(slots=True)
class BlockItem:
    """One block to write: its record (the offset is filled in by the writer) and its bytes."""

    record: PackRecord
    data: memoryview


@dataclass(slots=True)
class L3BlockStats:
    block_count: int = 0
    block_bytes: int = 0  # bytes of the live blocks in their packs
    block_packs: int = 0
    block_pack_bytes: int = 0  # every pack byte on disk, dead blocks included (until compaction)
    block_dead_bytes: int = 0
    block_hits: int = 0
    block_misses: int = 0
    block_writes: int = 0  # packs written
    block_blocks_written: int = 0
    block_bytes_written: int = 0
    block_bytes_read: int = 0
    block_evictions: int = 0
    block_compactions: int = 0
    block_corrupt: int = 0
    block_reconciled: int = 0
    block_dropped_packs: int = 0


@dataclass(slots=True)
class _Pack:
    name: str
    path: Path
    size: int
    records: list[PackRecord]
    dead: set[int] = field(default_factory=set)
    last_use: int = 0

    @property
    def live(self) -> int:
        return len(self.records) - len(self.dead)

    def dead_bytes(self) -> int:
        return sum(self.records[i].nbytes for i in self.dead)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_table(records: Sequence[PackRecord]) -> bytes:
    return b"".join(
        _RECORD.pack(
            r.key,
            r.space,
            r.identity,
            r.parent or bytes(32),
            r.digest,
            r.offset,
            r.nbytes,
            r.block_tokens,
            _FLAG_PARENT if r.parent is not None else 0,
        )
        for r in records
    )


def _footer(count: int, table_offset: int, table: bytes) -> bytes:
    body = _FOOTER.pack(
        PACK_MAGIC, PACK_VERSION, count, table_offset, len(table), blake3(table).digest()[:16]
    )
    return body + bytes(blake3(body).digest())[:16]


def read_table(fd: int, size: int) -> list[PackRecord]:
    """The records of a pack (its footer and table checksums checked); :class:`CorruptEntry` if not."""
    if size < _FOOTER_SIZE:
        raise CorruptEntry("pack too short for its footer")
    raw = os.pread(fd, _FOOTER_SIZE, size - _FOOTER_SIZE)
    body, check = raw[: _FOOTER.size], raw[_FOOTER.size :]
    if bytes(blake3(body).digest())[:16] != check:
        raise CorruptEntry("pack footer checksum fails")
    magic, version, count, table_offset, table_len, table_check = _FOOTER.unpack(body)
    if magic != PACK_MAGIC or version != PACK_VERSION:
        raise CorruptEntry("not a version 1 pack")
    if table_len != count * _RECORD.size or table_offset + table_len + _FOOTER_SIZE != size:
        raise CorruptEntry("pack table geometry does not hold")
    table = os.pread(fd, table_len, table_offset)
    if len(table) != table_len or bytes(blake3(table).digest())[:16] != table_check:
        raise CorruptEntry("pack table checksum fails")
    records = []
    for i in range(count):
        key, space, ident, parent, digest, offset, nbytes, block_tokens, flags = _RECORD.unpack_from(
            table, i * _RECORD.size
        )
        if offset % _ALIGN or offset + nbytes > table_offset:
            raise CorruptEntry(f"pack record {i} points outside the pack's data")
        records.append(
            PackRecord(
                key,
                space,
                ident,
                block_tokens,
                parent if flags & _FLAG_PARENT else None,
                nbytes,
                digest,
                offset,
            )
        )
    return records


class L3Blocks:
    def __init__(
        self,
        directory: Path,
        tmp: Path,
        lock: Any,
        *,
        make_room: Callable[[int], None],
        quarantine: Callable[[Path, str], None],
        discard: Callable[[Path, int], None] | None = None,
    ) -> None:
        self.directory = directory
        self._tmp = tmp
        self._lock = lock
        self._make_room = make_room
        self._quarantine = quarantine
        # a dropped pack is taken out of the way under the lock and unlinked after it (l3.trash)
        self._discard = discard or (lambda path, _size: remove(path))
        # least recently used first (a touch moves a pack to the end): the oldest is found in O(1), not by a
        # scan of every pack per evicted pack (quadratic when a write evicts thousands under the lock)
        self._packs: OrderedDict[str, _Pack] = OrderedDict()
        self._index: dict[bytes, tuple[_Pack, int]] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._dirty: set[str] = set()
        self.bytes = 0  # every pack byte on disk
        self._live_bytes = 0
        self._stats = L3BlockStats()
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="skippyd-l3-blocks")
        private_dirs(directory)

    # ------------------------------------------------------------------ reconciliation
    def reconcile(self) -> list[str]:
        """Rebuilds the index from the packs on disk (newest pack wins a duplicate key); returns problems."""
        problems: list[str] = []
        self._packs.clear()
        self._index.clear()
        self._children.clear()
        self.bytes = self._live_bytes = 0
        found: list[tuple[str, _Pack]] = []
        for path in sorted(self.directory.iterdir()):
            name = path.name
            if name.endswith(DEAD_SUFFIX):
                if not (self.directory / (name[: -len(DEAD_SUFFIX)] + PACK_SUFFIX)).exists():
                    remove(path)
                continue
            if not name.endswith(PACK_SUFFIX) or path.is_symlink() or not path.is_file():
                problems.append(f"removed a stray file in packs/: {name}")
                remove(path)
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    st = os.fstat(fd)
                    records = read_table(fd, st.st_size)
                finally:
                    os.close(fd)
            except (CorruptEntry, OSError) as exc:
                problems.append(f"pack {name}: {exc}; quarantined")
                self._stats.block_dropped_packs += 1
                self._quarantine(path, str(exc))
                continue
            pack = _Pack(name[: -len(PACK_SUFFIX)], path, st.st_size, records, last_use=st.st_mtime_ns)
            pack.dead = self._read_dead(pack)
            found.append((pack.name, pack))
        for _, pack in sorted(found):  # names begin with a sequence number: oldest first
            for index, record in enumerate(pack.records):
                if index in pack.dead:
                    continue
                old = self._index.get(record.key)
                if old is not None:  # the newer pack wins; the older copy is dead
                    old[0].dead.add(old[1])
                    self._unlink_child(old[0].records[old[1]])
                    self._live_bytes -= old[0].records[old[1]].nbytes
                self._index[record.key] = (pack, index)
                self._link_child(record)
                self._live_bytes += record.nbytes
            self._packs[pack.name] = pack
            self.bytes += pack.size
        for pack in list(self._packs.values()):
            if pack.live == 0:
                self._drop_pack(pack)
        for pack in sorted(self._packs.values(), key=lambda p: p.last_use):  # (recency: their mtimes)
            self._packs.move_to_end(pack.name)
        self._stats.block_reconciled = len(self._index)
        return problems

    def _read_dead(self, pack: _Pack) -> set[int]:
        path = self._dead_path(pack)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return set()
        usable = len(raw) - len(raw) % 4  # a torn append is ignored
        return {i for (i,) in struct.iter_unpack("<I", raw[:usable]) if i < len(pack.records)}

    def _dead_path(self, pack: _Pack) -> Path:
        return self.directory / f"{pack.name}{DEAD_SUFFIX}"

    # ------------------------------------------------------------------ lookups
    def holds(self, key: bytes) -> bool:
        return key in self._index

    def record(self, key: bytes) -> PackRecord | None:
        found = self._index.get(key)
        return found[0].records[found[1]] if found is not None else None

    def touch(self, keys: Iterable[bytes]) -> None:
        now = time.time_ns()
        for key in keys:
            found = self._index.get(key)
            if found is not None:
                pack = found[0]
                pack.last_use = now
                self._dirty.add(pack.name)
                if self._packs.get(pack.name) is pack:
                    self._packs.move_to_end(pack.name)

    def oldest_tick(self) -> int | None:
        return next(iter(self._packs.values())).last_use if self._packs else None

    def count(self, *, hits: int = 0, misses: int = 0) -> None:
        self._stats.block_hits += hits
        self._stats.block_misses += misses

    # ------------------------------------------------------------------ writing (no lock held)
    def write(
        self,
        items: Sequence[BlockItem],
        *,
        wanted: Callable[[bytes], bool] | None = None,
        superseding: _Pack | None = None,
    ) -> int:
        """Writes every item not already held as one pack, durably; returns how many were written.

        ``wanted`` is asked under the lock, right before the pack becomes visible, which keys still matter
        (an eviction may have come while the bytes went to disk): the others are marked dead at once.
        Keys held by ``superseding`` (a pack being compacted) move to the new pack.
        """
        with self._lock:
            todo: list[BlockItem] = []
            seen: set[bytes] = set()
            for item in items:
                key = item.record.key
                held = self._index.get(key)
                if key in seen or (held is not None and held[0] is not superseding):
                    continue
                if superseding is not None and held is None:  # evicted since compaction read it
                    continue
                seen.add(key)
                todo.append(item)
            if not todo:
                return 0
            offsets, cursor = [], 0
            for item in todo:
                offsets.append(cursor)
                cursor += _aligned(len(item.data))
            records = [
                PackRecord(
                    i.record.key,
                    i.record.space,
                    i.record.identity,
                    i.record.block_tokens,
                    i.record.parent,
                    len(i.data),
                    i.record.digest,
                    offset,
                )
                for i, offset in zip(todo, offsets, strict=True)
            ]
            table = encode_table(records)
            footer = _footer(len(records), cursor, table)
            size = cursor + len(table) + len(footer)
            self._make_room(size)  # raises NoSpace/TooLarge: nothing written
            name = f"{time.time_ns():016x}-{new_name('')}"
        temp = self._tmp / f"{name}{PACK_SUFFIX}.tmp"
        final = self.directory / f"{name}{PACK_SUFFIX}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            for item, offset in zip(todo, offsets, strict=True):
                _write_all(fd, item.data, offset)
            _write_all(fd, memoryview(table + footer), cursor)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            remove(temp)
            raise
        os.close(fd)
        with self._lock:
            # Decided under the lock (an eviction waits for it), the dead marks made durable, and only
            # then the rename: a block evicted while this pack was written never comes back, not even
            # after a power cut right after the rename.
            pack = _Pack(name, final, size, records, last_use=time.time_ns())
            keep: list[int] = []
            for index, record in enumerate(records):
                held = self._index.get(record.key)
                if superseding is not None:
                    if held is None or held[0] is not superseding:  # evicted while this pack was written
                        pack.dead.add(index)
                        continue
                elif (wanted is not None and not wanted(record.key)) or held is not None:
                    pack.dead.add(index)
                    continue
                keep.append(index)
            if pack.dead:
                try:
                    self._append_dead(pack, sorted(pack.dead), sync=True)
                except OSError:
                    remove(temp)
                    remove(self._dead_path(pack))
                    raise
            os.rename(temp, final)
            self._packs[name] = pack
            self.bytes += size
            for index in keep:
                record = records[index]
                if superseding is not None:
                    _old, at = self._index.pop(record.key)
                    superseding.dead.add(at)
                    self._unlink_child(record)
                    self._live_bytes -= record.nbytes
                self._index[record.key] = (pack, index)
                self._link_child(record)
                self._live_bytes += record.nbytes
            written = len(keep)
            self._stats.block_writes += 1
            self._stats.block_blocks_written += written
            self._stats.block_bytes_written += size
            if pack.live == 0:
                self._drop_pack(pack)
        fsync_dir(self.directory)
        return written

    # ------------------------------------------------------------------ reading (no lock held)
    def read_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> int:
        """Reads the blocks of ``keys`` into ``views`` (each at least the block's size), verifying each
        while the next is read; returns how many leading blocks were read. A block that fails its digest
        quarantines its pack and ends the run there."""
        with self._lock:
            plan = []
            for key in keys:
                found = self._index.get(key)
                if found is None:
                    break
                plan.append((found[0], found[0].records[found[1]]))
        spans: dict[str, tuple[int, int]] = {}  # per pack: where the blocks read from it begin and end
        for pack, record in plan:
            start, end = spans.get(pack.name, (record.offset, record.offset))
            spans[pack.name] = (min(start, record.offset), max(end, record.offset + record.nbytes))
        done = 0
        fds: dict[str, int] = {}
        pending: list[tuple[Future[bytes], PackRecord, _Pack]] = []
        try:
            for (pack, record), view in zip(plan, views, strict=False):
                fd = fds.get(pack.name)
                if fd is None:
                    try:
                        fd = fds[pack.name] = os.open(pack.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                    except FileNotFoundError:
                        break  # evicted meanwhile: the run ends here
                    _read_ahead(fd, *spans[pack.name])
                target = view[: record.nbytes]
                if _read_all(fd, target, record.offset) != record.nbytes:
                    self._corrupt(pack, "a block ends past the end of its pack")
                    break
                pending.append((self._hasher.submit(_digest, target), record, pack))
            for future, record, pack in pending:
                if future.result() != record.digest:
                    self._corrupt(pack, f"block {record.key.hex()[:16]} does not match its digest")
                    break
                done += 1
        finally:
            wait([future for future, _, _ in pending])  # no hash may still read a view after this returns
            for fd in fds.values():
                os.close(fd)
        with self._lock:
            self._stats.block_bytes_read += sum(r.nbytes for _, r in plan[:done])
        return done

    def _corrupt(self, pack: _Pack, reason: str) -> None:
        log.error("L3 block pack %s quarantined: %s", pack.name, reason)
        with self._lock:
            self._stats.block_corrupt += 1
            if self._packs.get(pack.name) is pack:
                self._forget(pack)
                self._quarantine(pack.path, reason)
                remove(self._dead_path(pack))

    # ------------------------------------------------------------------ removal
    def remove(self, keys: Iterable[bytes], *, sync: bool = True) -> int:
        """Marks these blocks and every block continuing them dead (fsynced with ``sync``); returns how
        many.

        A pack's deaths go to disk before the index forgets its blocks (a pack left with nothing live is
        removed instead, which writes nothing). Where they cannot be written (a full disk), that pack's
        blocks stay, here and on disk alike, the others go, and :class:`NoSpace` says so: never an
        eviction that holds only until the next start."""
        doomed: dict[str, list[tuple[bytes, int]]] = {}
        seen: set[bytes] = set()
        stack = [k for k in keys if k in self._index]
        while stack:
            key = stack.pop()
            found = self._index.get(key)
            if found is None or key in seen:
                continue
            seen.add(key)
            doomed.setdefault(found[0].name, []).append((key, found[1]))
            stack.extend(self._children.get(key, ()))
        count = 0
        failure: OSError | None = None
        for name, victims in doomed.items():
            pack = self._packs[name]
            whole = pack.live == len(victims)
            if not whole:
                try:
                    self._append_dead(pack, [index for _, index in victims], sync=sync)
                except OSError as exc:
                    failure = exc
                    continue
            for key, index in victims:
                record = pack.records[index]
                del self._index[key]
                self._unlink_child(record)
                self._children.pop(key, None)
                pack.dead.add(index)
                self._live_bytes -= record.nbytes
                count += 1
            if whole:
                self._drop_pack(pack)
        if sync and count:
            fsync_dir(self.directory)
        if failure is not None:
            log.warning("L3 could not record %d pack(s)' evicted blocks: %s", len(doomed), failure)
            raise NoSpace(
                f"L3 could not record the eviction of some blocks ({failure.strerror}); they stay held"
            ) from failure
        return count

    def remove_identity(self, identity: bytes) -> int:
        keys = [k for k, (p, i) in self._index.items() if p.records[i].identity == identity]
        return self.remove(keys)

    def clear(self) -> int:
        count = len(self._index)
        for pack in list(self._packs.values()):
            self._drop_pack(pack)
        fsync_dir(self.directory)
        return count

    def evict_oldest(self) -> bool:
        """Removes the pack used least recently (and the blocks continuing its blocks elsewhere)."""
        if not self._packs:
            return False
        pack = next(iter(self._packs.values()))
        keys = [r.key for i, r in enumerate(pack.records) if i not in pack.dead]
        self._stats.block_evictions += len(keys)
        with contextlib.suppress(NoSpace):  # (the pack goes whole; only blocks continuing it elsewhere
            self.remove(keys, sync=False)  # may stay, unreachable behind it, until their own pack goes)
        if pack.name in self._packs:  # (only if nothing was live: remove() dropped it otherwise)
            self._drop_pack(pack)
        return True

    def _append_dead(self, pack: _Pack, indexes: Sequence[int], *, sync: bool) -> None:
        """Appends these dead marks whole, or none of them: a write cut short (a nearly full disk writes
        part and refuses the rest) is taken back and raised as ENOSPC."""
        data = b"".join(struct.pack("<I", i) for i in indexes)
        fd = os.open(self._dead_path(pack), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            start = os.fstat(fd).st_size
            try:
                done = 0
                while done < len(data):
                    wrote = os.write(fd, data[done:])
                    if wrote <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += wrote
                if sync:
                    os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)  # (never a part of the marks: the index keeps them all)
                raise
        finally:
            os.close(fd)

    def _forget(self, pack: _Pack) -> None:
        for index, record in enumerate(pack.records):
            if index in pack.dead:
                continue
            if self._index.get(record.key) == (pack, index):
                del self._index[record.key]
                self._unlink_child(record)
                self._live_bytes -= record.nbytes
        self._packs.pop(pack.name, None)
        self._dirty.discard(pack.name)
        self.bytes -= pack.size

    def _drop_pack(self, pack: _Pack) -> None:
        self._forget(pack)
        self._discard(pack.path, pack.size)
        remove(self._dead_path(pack))

    def _link_child(self, record: PackRecord) -> None:
        if record.parent is not None:
            self._children.setdefault(record.parent, set()).add(record.key)

    def _unlink_child(self, record: PackRecord) -> None:
        if record.parent is not None:
            siblings = self._children.get(record.parent)
            if siblings is not None:
                siblings.discard(record.key)
                if not siblings:
                    del self._children[record.parent]

    # ------------------------------------------------------------------ compaction (no lock held)
    def compaction_candidate(self) -> list[bytes] | None:
        """The live keys of one pack that is at least half dead, or None."""
        with self._lock:
            for pack in self._packs.values():
                if pack.dead and pack.dead_bytes() >= _COMPACT_SHARE * sum(r.nbytes for r in pack.records):
                    return [r.key for i, r in enumerate(pack.records) if i not in pack.dead]
        return None

    def compact(self, keys: list[bytes]) -> bool:
        """Rewrites these blocks (one pack's live ones) into a new pack; the old one goes once it has no
        live block left."""
        with self._lock:
            records = [self.record(k) for k in keys]
            found = [self._index[k][0] for k in keys if k in self._index]
        if not found or any(r is None for r in records):
            return False
        old = found[0]
        buffers = [bytearray(r.nbytes) for r in records if r is not None]
        views = [memoryview(b) for b in buffers]
        if self.read_into(keys, views) != len(keys):
            return False
        items = [BlockItem(r, v) for r, v in zip(records, views, strict=True) if r is not None]
        try:
            self.write(items, superseding=old)
        finally:
            with self._lock:
                if self._packs.get(old.name) is old and old.live == 0:
                    self._drop_pack(old)
                self._stats.block_compactions += 1
        return True

    # ------------------------------------------------------------------ housekeeping
    def flush_recency(self) -> None:
        set_mtimes(self.recency_to_flush())

    def recency_to_flush(self) -> list[tuple[Path, int]]:
        """Each pack used since the last flush, with its last use (for its mtime: a restart's order);
        taken under the lock, written by the caller after it (one utime each)."""
        dirty, self._dirty = self._dirty, set()
        return [(pack.path, pack.last_use) for name in dirty if (pack := self._packs.get(name)) is not None]

    def close(self) -> None:
        self.flush_recency()
        self._hasher.shutdown(wait=True)

    def stats(self) -> L3BlockStats:
        stats = L3BlockStats(**{name: getattr(self._stats, name) for name in L3BlockStats.__slots__})
        stats.block_count = len(self._index)
        stats.block_bytes = self._live_bytes
        stats.block_packs = len(self._packs)
        stats.block_pack_bytes = self.bytes
        stats.block_dead_bytes = sum(p.dead_bytes() for p in self._packs.values())
        return stats

    def sizes(self) -> dict[tuple[bytes, int], int]:
        """Bytes held per ``(space, block size)``: what a restart is likely to read back first."""
        out: dict[tuple[bytes, int], int] = {}
        with self._lock:
            for pack, index in self._index.values():
                record = pack.records[index]
                key = (record.space, record.nbytes)
                out[key] = out.get(key, 0) + record.nbytes
        return out

    def identities(self) -> dict[bytes, tuple[int, int]]:
        """Blocks and bytes per identity digest (for ``ls``)."""
        out: dict[bytes, tuple[int, int]] = {}
        for pack, index in self._index.values():
            record = pack.records[index]
            count, nbytes = out.get(record.identity, (0, 0))
            out[record.identity] = (count + 1, nbytes + record.nbytes)
        return out

    def verify_all(self) -> tuple[int, list[str]]:
        """Reads and checks every live block (``l3 fsck --verify``); returns how many held and problems."""
        with self._lock:
            keys = list(self._index)
        problems = []
        good = 0
        for key in keys:
            with self._lock:
                record = self.record(key)
            if record is None:
                continue
            view = memoryview(bytearray(record.nbytes))
            if self.read_into([key], [view]) == 1:
                good += 1
            else:
                problems.append(f"block {key.hex()[:16]} failed verification; its pack was quarantined")
        return good, problems


def _digest(view: memoryview) -> bytes:
    return bytes(blake3(view).digest())


def _read_ahead(fd: int, start: int, end: int) -> None:
    """Asks the kernel to start reading the span of a pack a run's blocks lie in: the blocks are then read
    one by one (each hashed while the next is read), and without the hint each read of a cold pack waits
    for its own few I/Os (measured here: 256 reads of 256 KiB 53 ms, with the hint 38-43 ms, one plain
    read of the 64 MiB 33 ms)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)


def _read_all(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got
