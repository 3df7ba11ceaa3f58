"""Slabs: the tmpfs files that hold blocks, a fixed number of equal slots each, and their leases.

A slab is one file of one slot size (a size class: 4 KiB multiples, 8 classes per doubling). Its first
page names its geometry; the next pages hold one 256-byte record per slot; slot ``i``'s bytes start at
``data_start + i * slot_size`` (page-aligned). Layout in docs/format.md, "Block slabs".

* **Commit point.** A slot's bytes are written first, its record last: a record whose checksum holds
  names bytes that are complete (a process killed mid-copy leaves no record). Clearing a record's
  magic frees the slot.
* **Leases are byte-range locks.** A reader gets a fresh read-only open file description with an
  ``F_OFD_SETLK`` read lock on the range of every slot it was given. The lock lives as long as that
  description (the fd or any mapping made from it) and dies with the reader's process. Before the
  daemon rewrites or punches a slot it probes the range with a write lock through its own description:
  a slot someone still reads is never changed under them.
* **Memory is charged per slot.** A slot's pages exist from the moment it is allocated
  (``posix_fallocate``: a full tmpfs is ``NoSpace``, never SIGBUS) until it is punched
  (``MADV_REMOVE``), so the tier can give a free slot's memory back without touching its neighbours.
* **Slot generations in the file.** Each record carries its slot's generation at ``GENERATION_AT``
  (outside the record's checksum, as ``last_use`` is; free slots too): a client that keeps a slab mapped
  and registered with CUDA reads them there to learn which slots were punched since, without asking
  (docs/protocol.md, "Generations").
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from skippyd.errors import Busy
from skippyd.shm import (
    PAGE,
    create_shared,
    fallocate,
    fill_holes,
    new_name,
    next_generation,
    ofd_lock,
    populate_write,
    share,
)

__all__ = [
    "MAX_SLOTS",
    "RECORD_SIZE",
    "SLAB_SUFFIX",
    "BadSlab",
    "Slab",
    "SlabFacts",
    "SlotRecord",
    "block_digest",
    "describe",
    "slot_class",
    "slots_for",
]

SLAB_MAGIC = b"SKPSLAB1"
SLAB_VERSION = 1
SLAB_SUFFIX = ".slab"
RECORD_MAGIC = b"SKPBLK\x01\x00"
RECORD_SIZE = 256
MAX_SLOTS = 256
_SLAB_HEADER = struct.Struct("<8sIIQQ")  # magic, version, slots, slot_size, data_start
_RECORD = struct.Struct("<8sQQII32s32s32s32s32s48x")  # checksum follows at 240
_CHECKSUM_AT = 240
_LAST_USE_AT = 16
GENERATION_AT = 192  # a record's slot generation (8 bytes LE, in what was padding; not checksummed)
_GENERATION = struct.Struct("<Q")
_SMALL_LIMIT = 64 * 1024
_STEPS_PER_DOUBLING = 8
FLAG_DURABLE = 1  # an L3 copy is wanted and not yet known written
FLAG_PARENT = 2
FLAG_UNHASHED = 4  # committed before its digest was computed (the digest field is zero until it is)


def block_digest(data: memoryview | bytes) -> bytes:
    """A block's digest as its slot record and its L3 pack record carry it: BLAKE3 of its bytes."""
    return bytes(blake3(data).digest())


class BadSlab(ValueError):
    """A slab file whose header does not hold."""


def slot_class(nbytes: int) -> int:
    """The slot size a block of ``nbytes`` takes: pages up to 64 KiB, then 8 classes per doubling."""
    if nbytes <= _SMALL_LIMIT:
        return max(PAGE, -(-nbytes // PAGE) * PAGE)
    top = 1 << (nbytes.bit_length() - 1)
    step = max(PAGE, top // _STEPS_PER_DOUBLING)
    return -(-nbytes // step) * step


def slots_for(slot_size: int, target_bytes: int) -> int:
    """How many slots a new slab of ``slot_size`` gets: about ``target_bytes`` of data, 1 to 256."""
    return max(1, min(MAX_SLOTS, target_bytes // slot_size))


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """What a committed slot holds: the block's key (bound to its space), where it came from, its bytes."""

    key: bytes  # 32: the bound key
    space: bytes  # 32: the space key's digest
    identity: bytes  # 32: the identity digest
    block_tokens: int
    parent: bytes | None  # 32: the bound key of the block before it in its chain, when known
    nbytes: int
    digest: bytes  # 32: BLAKE3 of the block's bytes (zero while ``hashed`` is False)
    last_use: int = 0
    durable: bool = False
    hashed: bool = True  # False: committed with its digest still to be computed (in the background)

    def encode(self) -> bytes:
        flags = (
            (FLAG_DURABLE if self.durable else 0)
            | (FLAG_PARENT if self.parent is not None else 0)
            | (0 if self.hashed else FLAG_UNHASHED)
        )
        body = _RECORD.pack(
            RECORD_MAGIC, self.nbytes, self.last_use, flags, self.block_tokens, self.key, self.space,
            self.identity, self.parent or bytes(32), self.digest,
        )  # fmt: skip
        return body + _record_checksum(body)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> SlotRecord | None:
        """The record, or None for a free slot or one whose checksum fails (never committed)."""
        raw = bytes(raw)
        if raw[:8] != RECORD_MAGIC or _record_checksum(raw[:_CHECKSUM_AT]) != raw[_CHECKSUM_AT:RECORD_SIZE]:
            return None
        _m, nbytes, last_use, flags, block_tokens, key, space, ident, parent, digest = _RECORD.unpack_from(
            raw
        )
        return cls(
            key=key, space=space, identity=ident, block_tokens=block_tokens,
            parent=parent if flags & FLAG_PARENT else None, nbytes=nbytes, digest=digest,
            last_use=last_use, durable=bool(flags & FLAG_DURABLE), hashed=not flags & FLAG_UNHASHED,
        )  # fmt: skip


def _record_checksum(body: bytes | memoryview) -> bytes:
    # last_use is outside the checksum: recency is rewritten in place, 8 bytes at a time; the slot
    # generation is checksummed as zero (what the records of slabs made before it hold there)
    raw = bytes(body)
    return bytes(
        blake3(
            raw[:_LAST_USE_AT]
            + raw[_LAST_USE_AT + 8 : GENERATION_AT]
            + bytes(8)
            + raw[GENERATION_AT + 8 : _CHECKSUM_AT]
        ).digest()
    )[:16]


def _header(slots: int, slot_size: int, data_start: int) -> bytes:
    body = _SLAB_HEADER.pack(SLAB_MAGIC, SLAB_VERSION, slots, slot_size, data_start)
    return body + bytes(blake3(body).digest())[:16]


class Slab:
    """One slab file, mapped read-write by the daemon for its lifetime. Not thread-safe (the tier's lock)."""

    def __init__(self, path: Path, fd: int, slots: int, slot_size: int, data_start: int) -> None:
        self.path = path
        self.slots = slots
        self.slot_size = slot_size
        self.data_start = data_start
        self.size = data_start + slots * slot_size
        self._fd = fd  # O_RDWR: the daemon's own description (its probes conflict with every reader's)
        self.mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        #: Changes whenever a slot's pages are punched (a slot filled again later is new memory): a client
        #: that registered this slab's pages with CUDA registers them again (docs/protocol.md).
        self.generation = next_generation()
        #: Each slot's own generation: changes when that slot is punched (so a registration of its old
        #: pages is never used for the pages it is filled with again), and only then. A new or adopted
        #: slab's slots start at a number never given before (its file may reuse an old inode).
        self.slot_generations = array("Q", [self.generation]) * slots
        for index in range(slots):
            self._write_generation(index)

    def slot_map(self) -> bytes:
        """Every slot's generation, 8 bytes little-endian each (a ``blocks_get`` reply's ``slot_maps``)."""
        if sys.byteorder == "little":
            return self.slot_generations.tobytes()
        swapped = array("Q", self.slot_generations)
        swapped.byteswap()
        return swapped.tobytes()

    @property
    def header_bytes(self) -> int:
        """The bytes of the slab that are not slots (its header and records), always allocated."""
        return self.data_start

    @classmethod
    def create(cls, directory: Path, slot_size: int, slots: int) -> Slab:
        """A new sparse slab: header and records allocated, every slot a hole until allocated."""
        data_start = -(-(PAGE + slots * RECORD_SIZE) // PAGE) * PAGE
        path = directory / f"{slot_size}-{new_name(SLAB_SUFFIX)}"
        fd = create_shared(path)
        try:
            os.ftruncate(fd, data_start + slots * slot_size)
            _allocate(fd, 0, data_start, path)
            os.pwrite(fd, _header(slots, slot_size, data_start), 0)
            return cls(path, fd, slots, slot_size, data_start)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise

    @classmethod
    def open(cls, path: Path) -> Slab:
        """An existing slab (adoption); :class:`BadSlab` when its header or size does not hold."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            slots, slot_size, data_start = _geometry(fd, path)
            fill_holes(fd, data_start)  # (the records are written through the mapping; free slots are
            share(fd, adopted=True)  # punched by design and faulted in without SIGBUS when reused)
            return cls(path, fd, slots, slot_size, data_start)
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------------------ slots
    def offset(self, index: int) -> int:
        return self.data_start + index * self.slot_size

    def data(self, index: int, nbytes: int) -> memoryview:
        start = self.offset(index)
        return memoryview(self.mapping)[start : start + nbytes]

    def record(self, index: int) -> SlotRecord | None:
        start = PAGE + index * RECORD_SIZE
        return SlotRecord.decode(self.mapping[start : start + RECORD_SIZE])

    def write_record(self, index: int, record: SlotRecord) -> None:
        start = PAGE + index * RECORD_SIZE
        raw = bytearray(record.encode())
        _GENERATION.pack_into(raw, GENERATION_AT, self.slot_generations[index])  # (never seen as zero)
        self.mapping[start : start + RECORD_SIZE] = raw

    def clear_record(self, index: int) -> None:
        start = PAGE + index * RECORD_SIZE
        self.mapping[start : start + 8] = bytes(8)

    def set_last_use(self, index: int, tick: int) -> None:
        start = PAGE + index * RECORD_SIZE + _LAST_USE_AT
        self.mapping[start : start + 8] = struct.pack("<Q", tick)

    def allocate(self, index: int, count: int = 1, *, populate: bool = True) -> None:
        """Gives the ``count`` slots from ``index`` their pages (:class:`NoSpace` when the tmpfs has none),
        faulted into this process's mapping with ``populate``; without it the first write to each page maps
        it (the page exists, so no write can fail), on whichever thread writes it."""
        start = self.offset(index)
        _allocate(self._fd, start, count * self.slot_size, self.path)
        if populate:
            populate_write(self.mapping, start, count * self.slot_size)

    def punch(self, index: int) -> None:
        """Gives slot ``index``'s pages back to the system (call only when :meth:`has_readers` is False)."""
        self.mapping.madvise(mmap.MADV_REMOVE, self.offset(index), self.slot_size)
        self.generation = next_generation()
        self.slot_generations[index] = self.generation
        self._write_generation(index)

    def _write_generation(self, index: int) -> None:
        _GENERATION.pack_into(
            self.mapping, PAGE + index * RECORD_SIZE + GENERATION_AT, self.slot_generations[index]
        )

    # ------------------------------------------------------------------ leases
    def has_readers(self, index: int) -> bool:
        """Whether any description other than the daemon's own holds a lease on slot ``index``."""
        start = self.offset(index)
        if not ofd_lock(self._fd, fcntl.F_WRLCK, start, self.slot_size):
            return True
        ofd_lock(self._fd, fcntl.F_UNLCK, start, self.slot_size)
        return False

    def lease(self, runs: list[tuple[int, int]]) -> int:
        """A fresh read-only fd of the slab holding a read lock on slots ``[first, last]`` of every run;
        the caller owns it (and sends it)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            for first, last in runs:  # (under the tier's lock: no probe of its own can be in the way)
                start = self.offset(first)
                if not ofd_lock(fd, fcntl.F_RDLCK, start, (last - first + 1) * self.slot_size):
                    raise Busy(f"could not take a read lease on slots {first}-{last} of {self.path.name}")
            return fd
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.mapping.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def unlink(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _geometry(fd: int, path: Path) -> tuple[int, int, int]:
    """``(slots, slot_size, data_start)`` of an open slab; :class:`BadSlab` when they do not hold."""
    raw = os.pread(fd, _SLAB_HEADER.size + 16, 0)
    if (
        len(raw) < _SLAB_HEADER.size + 16
        or raw[_SLAB_HEADER.size :] != bytes(blake3(raw[: _SLAB_HEADER.size]).digest())[:16]
    ):
        raise BadSlab(f"{path.name}: header checksum fails")
    magic, version, slots, slot_size, data_start = _SLAB_HEADER.unpack_from(raw)
    if magic != SLAB_MAGIC or version != SLAB_VERSION:
        raise BadSlab(f"{path.name}: not a version {SLAB_VERSION} slab")
    if (
        not 1 <= slots <= MAX_SLOTS
        or slot_size % PAGE
        or slot_size <= 0
        or data_start < PAGE + slots * RECORD_SIZE
        or data_start % PAGE
        or os.fstat(fd).st_size != data_start + slots * slot_size
    ):
        raise BadSlab(f"{path.name}: geometry does not hold")
    return slots, slot_size, data_start


@dataclass(frozen=True, slots=True)
class SlabFacts:
    """What ``doctor`` reads of a slab without opening it for writing: its geometry, how many slots hold
    a committed block (record checksum good), and the tmpfs bytes it takes (holes are free)."""

    slots: int
    slot_size: int
    committed: int
    durable_wanted: int
    allocated: int


def describe(path: Path) -> SlabFacts:
    """Reads a slab's header and records read-only; :class:`BadSlab` when they do not hold."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        slots, slot_size, _ = _geometry(fd, path)
        raw = os.pread(fd, slots * RECORD_SIZE, PAGE)
        records = [SlotRecord.decode(raw[i * RECORD_SIZE : (i + 1) * RECORD_SIZE]) for i in range(slots)]
        held = [r for r in records if r is not None and r.nbytes <= slot_size]
        allocated = os.fstat(fd).st_blocks * 512
        return SlabFacts(slots, slot_size, len(held), sum(r.durable for r in held), allocated)
    finally:
        os.close(fd)


def _allocate(fd: int, offset: int, length: int, path: Path) -> None:
    fallocate(fd, offset, length, f"in {path.parent}")
