"""Blocks in L2: slots of tmpfs slabs (:mod:`.slabs`), indexed by bound key, inside the tier's budget.

* **One budget.** Every allocated slot (held, being written, or free and kept pre-faulted) and every
  slab's header is charged to the L2 tier's budget beside its entries; when room is needed the tier
  gives back free entry files, then free slots (punched), then evicts the least recently used entry
  or block, whichever is older (:meth:`skippyd.l2.L2Tier._make_room`).
* **Chains are evicted from their tail.** A put and a get touch their run of blocks from the last to
  the first, so a chain's head is always its newest; evicting a block also evicts every block known to
  continue it (its parent link comes from the put: the block before it, or the put's ``parent``), so
  memory never holds blocks that ``contains`` could not reach.
* **Slabs are never shared across block spaces.** A reader's descriptor shows the whole slab, so one
  slab holds blocks of one space (identity and block size) only: no reader ever gets a descriptor over
  another model's, state's or namespace's bytes.
* **Digests off the request path.** A put may commit a block before its BLAKE3 digest is computed (its
  record says so): :meth:`L2Blocks.digest_take` hands such blocks, leased, to the background digester
  (:mod:`.digests`), the durable writer hashes any it writes first, and a clean stop hashes the rest.
  Nothing served needs the digest: a block's bytes are the daemon's own copy from the moment its record
  is written. The digest is what adoption and L3 check.
* A new process re-adopts every committed slot after checking its record and (by default) its digest;
  a slot committed but not yet hashed when a process was killed is hashed at adoption (its record,
  written after its bytes, vouches that they are whole).

Not thread-safe on its own: every method runs under the L2 tier's lock (passed in).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from blake3 import blake3

from skippyd.errors import NoSpace, TooLarge
from skippyd.files import private_dirs, remove
from skippyd.protocol import MAX_BLOCK_BYTES

from .demand import Demand
from .slabs import SLAB_SUFFIX, BadSlab, Slab, SlotRecord, block_digest, slot_class, slots_for

__all__ = [
    "BlockPlacement", "DigestJob", "GroupDemand", "L2BlockStats", "L2Blocks", "Lease", "Pending",
    "SpaceSummary",
]  # fmt: skip

log = logging.getLogger("skippyd.l2")

_HOLE, _FREE, _WRITING, _USED, _FAULTING = 0, 1, 2, 3, 4  # _FAULTING: the reserve faults it in
_SLAB_TARGET = 32 << 20
_QUIET_S = 0.002  # background work (the reserve, the digester) waits this long after the last put ended
_NO_DIGEST = bytes(32)
_LOOK_AGAIN_S = 0.005  # how often free slots found read under a lease are looked at again (while in demand)
_LOOK_BATCH = 256  # at most this many read slots of a group per look (≈ 0.2 ms of fcntl, under the lock)


@dataclass(slots=True)
class L2BlockStats:
    block_count: int = 0
    block_bytes: int = 0  # tmpfs bytes the held blocks' slots take
    block_payload_bytes: int = 0
    block_slabs: int = 0
    block_slab_bytes: int = 0  # every charged byte of the slabs: slots in use, free slots, headers
    block_free_slots: int = 0
    block_free_bytes: int = 0  # the free slots' bytes (pre-faulted, no block in them): part of the reserve
    block_free_slots_read: int = 0  # free slots still read under a lease when last looked at (not reused yet)
    block_hits: int = 0
    block_misses: int = 0
    block_inserts: int = 0
    block_evictions: int = 0
    block_cascade_evictions: int = 0
    block_adopted: int = 0
    block_adopt_dropped: int = 0
    block_prefaulted: int = 0  # free slots the reserve faulted in ahead of demand
    block_fresh_slots: int = 0  # slots a put had to fault in itself
    block_unhashed: int = 0  # held blocks whose digest the digester has still to compute
    block_unhashed_bytes: int = 0
    block_deferred_digests: int = 0  # blocks committed before their digest (computed off the request path)


@dataclass(slots=True)
class SpaceSummary:
    """What one block space holds in L2 (for ``ls``)."""

    space: bytes
    identity: bytes
    block_tokens: int
    count: int = 0
    nbytes: int = 0


@dataclass(slots=True)
class _SlabState:
    slab: Slab
    space: bytes
    state: list[int]

    def charged(self) -> int:
        """Its header and every slot that has pages."""
        return self.slab.header_bytes + sum(1 for s in self.state if s != _HOLE) * self.slab.slot_size


@dataclass(slots=True)
class _Group:
    """The slabs of one space and slot size, with their free (pre-faulted) slots and their holes."""

    space: bytes
    slot_size: int
    homes: list[_SlabState] = field(default_factory=list)
    free: deque[tuple[_SlabState, int]] = field(default_factory=deque)
    # free slots a lease still read when last looked at: looked at again a batch at a time, every few ms
    # (:meth:`L2Blocks._look_again`), never on every put (a scan of thousands, under the lock)
    read: deque[tuple[_SlabState, int]] = field(default_factory=deque)
    holes: list[tuple[_SlabState, int]] = field(default_factory=list)
    demand: Demand = field(default_factory=Demand)  # slot bytes puts and L3 reads took lately (the reserve)
    expected_at: float = -1e9  # when a restart expected reads into it (:meth:`L2Blocks.expect`)

    @property
    def key(self) -> tuple[bytes, int]:
        return self.space, self.slot_size

    @property
    def spare(self) -> int:
        """Its free slots, read ones included (pre-faulted, no block in them)."""
        return len(self.free) + len(self.read)


@dataclass(slots=True)
class GroupDemand:
    """One block group as the reserve weighs it (:meth:`L2Blocks.demands`)."""

    key: tuple[bytes, int]  # (space, slot size)
    unit: int  # slot size
    recent: int  # slot bytes taken within the reserve's window
    expected: bool  # a restart expects reads into it
    free: int  # bytes of its free, pre-faulted slots


@dataclass(slots=True)
class _Block:
    record: SlotRecord
    home: _SlabState
    index: int
    last_use: int


@dataclass(slots=True)
class Pending:
    """A slot taken for one block of a put: write :attr:`view`, then commit with its digest. A fresh slot
    reserved with ``allocate=False`` is :attr:`unallocated` until :func:`allocate_runs` gives it its
    pages, outside the tier's lock (write nothing to it before)."""

    record: SlotRecord
    home: _SlabState
    index: int
    view: memoryview
    recycled: bool
    unallocated: bool = False


@dataclass(slots=True)
class Prefault:
    """A slot the reserve faults in outside the tier's lock (:meth:`L2Blocks.prefault_take`)."""

    home: _SlabState
    index: int

    def fault(self) -> None:
        """Gives the slot its pages (:class:`NoSpace` when the tmpfs has none); no lock needed."""
        self.home.slab.allocate(self.index)


@dataclass(slots=True)
class DigestJob:
    """Held blocks to hash off the request path (:meth:`L2Blocks.digest_take`): each one's key, slab,
    slot and bytes, and the descriptors whose read leases keep those slots from reuse meanwhile."""

    items: list[tuple[bytes, Slab, int, memoryview]] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def hash(self, stop: Callable[[], bool] | None = None) -> list[bytes]:
        """The leading items' digests (no lock needed: the leases keep the bytes as they are): every
        item's, or those hashed before ``stop`` said so (asked before each block)."""
        digests: list[bytes] = []
        for _, _, _, view in self.items:
            if stop is not None and stop():
                break
            digests.append(block_digest(view))
        return digests

    def close(self) -> None:
        for _, _, _, view in self.items:
            view.release()
        self.items = []
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


#: Where one served block is: ``[descriptor index, offset there, size]``, as the reply carries it (a
#: plain list: a get of 256 blocks builds 256 of them).
BlockPlacement = list[int]


#: A slab's slots as a ``blocks_get`` reply shows them: (data start, slot size, generations).
SlotMap = tuple[int, int, bytes]


@dataclass(slots=True)
class Lease:
    """Descriptors (one per slab, each holding read locks on its blocks) and every block's place."""

    fds: list[int] = field(default_factory=list)
    placements: list[BlockPlacement] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)  # each descriptor's slab generation (0: once)
    slot_generations: list[int] = field(default_factory=list)  # each placement's slot generation (0: once)
    #: asked for: each descriptor's slab as (data start, slot size, every slot's generation as 8 bytes
    #: little-endian), None for a memfd
    slot_maps: list[SlotMap | None] | None = None

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


class L2Blocks:
    def __init__(
        self,
        directory: Path,
        lock: threading.RLock,
        *,
        budget_bytes: int,
        make_room: Callable[[int, int], None],
        room: Callable[[], int],
        evict_one: Callable[[], bool],
        tick: Callable[[int], int],
        fill_ended: Callable[[], None] = lambda: None,
    ) -> None:
        self.directory = directory
        self._fill_ended = fill_ended  # called (under the lock) whenever a fill ends
        self._lock = lock
        self._make_room = make_room
        self._room = room
        self._evict_one = evict_one
        self._tick = tick
        self._slab_target = max(1 << 20, min(_SLAB_TARGET, budget_bytes // 16))
        self.max_block = min(MAX_BLOCK_BYTES, budget_bytes // 4)
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._children: dict[bytes, set[bytes]] = {}
        self._groups: dict[tuple[bytes, int], _Group] = {}
        self._read_slots = 0  # free slots set aside as read (every group's ``read``)
        self._look_at = 0.0  # when the read slots are looked at again
        # the groups with free slots, and those with read ones: a put that evicts block after block, or a
        # look, never walks thousands of block spaces' groups that have none (least recently added first)
        self._with_free: dict[tuple[bytes, int], _Group] = {}
        self._with_read: dict[tuple[bytes, int], _Group] = {}
        self._payload = 0
        self._spaces: dict[bytes, SpaceSummary] = {}
        self._dirty: set[bytes] = set()
        self.charged = 0
        self._demand_at = 0.0
        self._filling = 0  # puts and L3 reads between taking their slots and committing them
        self.pending_bytes = 0  # slots reserved for a fill and not committed or given back yet
        self.idle_hooks: list[Callable[[], None]] = []  # told when the last of them ends (reserve, digester)
        self._unhashed: OrderedDict[bytes, int] = OrderedDict()  # held blocks with no digest yet: nbytes
        self.unhashed_bytes = 0
        self._hashing: set[bytes] = set()  # unhashed blocks a hasher (digester, block writer) has taken
        self._stats = L2BlockStats()
        private_dirs(directory)

    # ------------------------------------------------------------------ lookups
    def held(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` L2 holds."""
        blocks = self._blocks
        for count, key in enumerate(keys):
            if key not in blocks:
                return count
        return len(keys)

    def holds(self, key: bytes) -> bool:
        return key in self._blocks

    def record(self, key: bytes) -> SlotRecord | None:
        block = self._blocks.get(key)
        return block.record if block is not None else None

    def lease(self, keys: Sequence[bytes], *, max_fds: int, hit: bool = True, maps: bool = False) -> Lease:
        """The leading held ``keys`` (at most ``max_fds`` slabs of them) leased for reading; touches
        them from the last to the first when ``hit``; with ``maps``, each slab's slot map (every slot's
        generation: a client drops its registrations of punched slots). (One pass: a get of 256 blocks
        is mostly this.)"""
        blocks = self._blocks
        chosen: list[_Block] = []
        for key in keys:
            block = blocks.get(key)
            if block is None:
                break
            chosen.append(block)
        fds, placements, slabs, slot_generations = _lease_slots(chosen, max_fds)
        if len(placements) < len(chosen):
            del chosen[len(placements) :]
        if hit:
            self._stats.block_hits += len(chosen)
            self._touch_all(reversed(chosen))
        slot_maps: list[SlotMap | None] | None = (
            [(slab.data_start, slab.slot_size, slab.slot_map()) for slab in slabs] if maps else None
        )
        return Lease(fds, placements, [slab.generation for slab in slabs], slot_generations, slot_maps)

    def count_miss(self, blocks: int = 1) -> None:
        self._stats.block_misses += blocks

    def data_of(self, key: bytes) -> tuple[Slab, int, SlotRecord] | None:
        """Where a held block's bytes are in the daemon's own mapping (for the durable writer, which
        reads them through a lease it takes first)."""
        block = self._blocks.get(key)
        if block is None:
            return None
        return block.home.slab, block.index, block.record

    # ------------------------------------------------------------------ admission
    def fill_begun(self) -> None:
        """A put or an L3 read takes slots and copies into them from now until :meth:`fill_ended`: the
        reserve waits."""
        self._filling += 1

    def fill_ended(self) -> None:
        self._filling -= 1
        self._fill_ended()
        self._demand_at = time.monotonic()
        if not self._filling:
            for hook in self.idle_hooks:
                hook()

    def busy(self) -> bool:
        """A put or an L3 read is filling slots, or one ended less than a moment ago: background work
        (the reserve, the digester) waits rather than slow it down."""
        return self.quiet_in() != 0.0

    def quiet_in(self) -> float | None:
        """When background work may run: None while a put or an L3 read fills slots (the last one's end
        wakes the :attr:`idle_hooks`), else the seconds left of the quiet window after the last one ended
        (0.0: now)."""
        if self._filling:
            return None
        return max(0.0, self._demand_at + _QUIET_S - time.monotonic())

    @property
    def fills(self) -> int:
        """How many puts and L3 reads fill slots now (under the lock)."""
        return self._filling

    @property
    def filling(self) -> bool:
        """Whether a put or an L3 read fills slots now (read without the lock by a hasher between blocks:
        a hint, never a decision about the blocks themselves)."""
        return self._filling > 0

    def reserve(self, record: SlotRecord, *, mine: int = 0, allocate: bool = True) -> Pending:
        """A slot for a new block (may evict the least recently used entries and blocks first); ``mine``:
        the bytes of slots the calling fill holds reserved already (what it must not wait for). A fresh
        slot (not a free one reused) gets its pages here, or with ``allocate=False`` is charged and set
        aside :attr:`~Pending.unallocated`: the caller allocates it with :func:`allocate_runs` after
        the lock (faulting fresh tmpfs pages runs at ≈ 1-3 GB/s a core, too long to hold the lock for)."""
        if record.nbytes > self.max_block:
            raise TooLarge(f"a block of {record.nbytes} bytes is larger than L2 takes ({self.max_block})")
        size = slot_class(max(record.nbytes, 1))
        group = self._group(record.space, size)
        self._demand_at = now = time.monotonic()
        group.demand.add(size, now)
        taken = self._take_free(group)
        # A full tier: evict (the older of the oldest entry and the oldest block) until a free slot of this
        # group turns up or there is room, giving back other groups' free slots first; this group's own
        # free slots are reused, never punched and faulted in again.
        while taken is None and self._room() < size:
            if not (self.release_free(keep=group) or self._evict_one()):
                break
            taken = self._take_free(group)
        if taken is not None:
            home, index = taken
            home.state[index] = _WRITING
            self.pending_bytes += size
            return Pending(record, home, index, home.slab.data(index, record.nbytes), True)
        self._make_room(size, mine)
        home, index = self._hole(group, record.space, size, mine)
        if allocate:
            try:
                home.slab.allocate(index)
            except NoSpace:
                group.holes.append((home, index))
                self._drop_if_empty(home, group)
                raise
        home.state[index] = _WRITING
        self.charged += size
        self.pending_bytes += size
        self._stats.block_fresh_slots += 1
        return Pending(record, home, index, home.slab.data(index, record.nbytes), False, not allocate)

    def _group(self, space: bytes, size: int) -> _Group:
        group = self._groups.get((space, size))
        if group is None:
            group = self._groups[(space, size)] = _Group(space, size)
        return group

    def expect(self, space: bytes, nbytes: int) -> None:
        """Marks the group of blocks of ``nbytes`` in ``space`` as in demand, so the reserve stocks free
        slots for it (a restart expects the blocks L3 holds to be read back into L2)."""
        self._group(space, slot_class(max(nbytes, 1))).expected_at = time.monotonic()

    def demands(self, now: float, window: float, *, active_s: float) -> list[GroupDemand]:
        """Every block group's recent demand (slot bytes puts and L3 reads took within ``window``), whether
        a restart expected it within ``active_s``, and the bytes of its free slots (what the reserve
        weighs)."""
        return [
            GroupDemand(
                key, group.slot_size, group.demand.recent(now, window), now - group.expected_at < active_s,
                group.spare * group.slot_size,
            )
            for key, group in self._groups.items()
        ]  # fmt: skip

    def prefault_take(self, key: tuple[bytes, int]) -> Prefault | None:
        """A slot of the group ``key`` (space, slot size) for the reserve to fault in, while no put or L3
        read is filling slots and the budget has room for it without evicting anything; None otherwise.
        The slot is charged and set aside (neither free nor a hole) until :meth:`prefault_done`; the
        caller faults it in without the lock."""
        group = self._groups.get(key)
        if group is None or self.busy():  # faulting pages now would slow them down
            return None
        size = group.slot_size
        header = 0 if group.holes else -(-(4096 + slots_for(size, self._slab_target) * 256) // 4096) * 4096
        if self._room() < size + header:
            return None
        home, index = self._hole(group, group.space, size)
        home.state[index] = _FAULTING
        self.charged += size
        return Prefault(home, index)

    def punch_free_slot(self, key: tuple[bytes, int]) -> int:
        """Gives back one free slot of the group ``key`` that nobody reads (and its slab, once it holds
        nothing); the bytes given back (0: none could go)."""
        group = self._groups.get(key)
        if group is None:
            return 0
        taken = self._take_free(group)
        if taken is None:
            return 0
        self._punch(group, *taken)
        return group.slot_size

    def prefault_done(self, taken: Prefault, *, faulted: bool) -> int:
        """A slot from :meth:`prefault_take` joins the free slots (``faulted``), or goes back to being a
        hole; returns the bytes the reserve gained."""
        home, index = taken.home, taken.index
        group = self._groups[(home.space, home.slab.slot_size)]  # (no slab goes while a slot is set aside)
        if not faulted:
            home.state[index] = _HOLE
            self.charged -= home.slab.slot_size
            group.holes.append((home, index))
            self._drop_if_empty(home, group)
            return 0
        self._free(home, index)
        self._stats.block_prefaulted += 1
        return home.slab.slot_size

    def reserve_free(self, record: SlotRecord) -> Pending | None:
        """A free, pre-faulted slot for ``record`` if one is at hand, never by evicting (an L3 read that has
        not earned a place in L2 yet borrows it)."""
        size = slot_class(max(record.nbytes, 1))
        group = self._groups.get((record.space, size))
        if group is None:
            return None
        group.demand.add(size, time.monotonic())
        taken = self._take_free(group)
        if taken is None:
            return None
        home, index = taken
        home.state[index] = _WRITING
        self.pending_bytes += size
        return Pending(record, home, index, home.slab.data(index, record.nbytes), True)

    def lease_pending(self, pending: Sequence[Pending]) -> tuple[list[int], list[tuple[int, int]]]:
        """Read leases on slots still being filled (descriptors, and each slot's descriptor and offset)."""
        fds, placements, _, _ = _lease_slots(pending, max_fds=len(pending))
        return fds, [(at, offset) for at, offset, _ in placements]

    def _take_free(self, group: _Group) -> tuple[_SlabState, int] | None:
        """Takes a free, pre-faulted slot of ``group`` that nobody reads out of its free slots, or None.

        A slot found read under a lease is set aside (``group.read``), not looked at again by the next
        put: a reader ends its lease without telling the daemon (it closes a descriptor), so the slots
        set aside are looked at again in bounded batches, every few ms (:meth:`_look_again`). Before,
        every put scanned every read slot under the lock (an fcntl each): thousands of slots leased by
        one client's long-held views stalled every request for seconds."""
        self._look_again()
        taken: tuple[_SlabState, int] | None = None
        while group.free:
            home, index = group.free.popleft()
            if home.slab.has_readers(index):
                group.read.append((home, index))
                self._with_read[group.key] = group
                self._read_slots += 1
                continue
            taken = home, index
            break
        if not group.free:
            self._with_free.pop(group.key, None)
        return taken

    def _add_free(self, group: _Group, home: _SlabState, index: int) -> None:
        group.free.append((home, index))
        self._with_free[group.key] = group

    def _look_again(self, *, every: bool = False) -> None:
        """Returns the read slots whose leases ended to the free slots: :data:`_LOOK_BATCH` of them at a time
        (of every group together, round robin), batch after batch while at least half of a batch came
        back (a reader that let go of thousands of slots gives them all back at once, before a put would
        evict live blocks for want of them), then not again for :data:`_LOOK_AGAIN_S` after the look
        ended; with ``every``, all of them now (called under the lock)."""
        if not self._read_slots or (not every and time.monotonic() < self._look_at):
            return
        while self._read_slots:
            budget = self._read_slots if every else min(_LOOK_BATCH, self._read_slots)
            looked, back = budget, 0
            for key, group in list(self._with_read.items()):
                if budget <= 0:
                    break
                # (back at the end if some stay read: the next look starts elsewhere)
                del self._with_read[key]
                for _ in range(min(len(group.read), budget)):
                    budget -= 1
                    home, index = group.read.popleft()
                    if home.slab.has_readers(index):
                        group.read.append((home, index))
                    else:
                        self._add_free(group, home, index)
                        self._read_slots -= 1
                        back += 1
                if group.read:
                    self._with_read[key] = group
            if every or 2 * back < looked - budget:
                break
        self._look_at = time.monotonic() + _LOOK_AGAIN_S

    def _hole(self, group: _Group, space: bytes, size: int, mine: int = 0) -> tuple[_SlabState, int]:
        if group.holes:
            return group.holes.pop()
        slots = slots_for(size, self._slab_target)
        header = -(-(4096 + slots * 256) // 4096) * 4096
        self._make_room(size + header, mine)
        slab = Slab.create(self.directory, size, slots)
        home = _SlabState(slab, space, [_HOLE] * slots)
        group.homes.append(home)
        group.holes.extend((home, index) for index in range(slots - 1, 0, -1))
        self.charged += slab.header_bytes
        return home, 0

    def commit(self, pending: Pending, digest: bytes | None, *, durable: bool) -> bool:
        """Writes the slot's record (the commit point) and indexes the block; False (and the slot freed)
        when the key was committed meanwhile by another put. A ``digest`` of None commits the block
        unhashed: :meth:`digest_take` hands it to the digester later."""
        pending.view.release()
        record = pending.record
        if record.key in self._blocks:
            self.abort(pending, released=True)
            return False
        tick = self._tick(1)
        final = SlotRecord(  # (not dataclasses.replace: this runs once per block of every put)
            key=record.key, space=record.space, identity=record.identity, block_tokens=record.block_tokens,
            parent=record.parent, nbytes=record.nbytes, digest=digest if digest is not None else _NO_DIGEST,
            last_use=tick, durable=durable, hashed=digest is not None,
        )  # fmt: skip
        pending.home.slab.write_record(pending.index, final)
        pending.home.state[pending.index] = _USED
        self.pending_bytes -= pending.home.slab.slot_size
        self._index(_Block(final, pending.home, pending.index, tick))
        self._payload += final.nbytes
        self._stats.block_inserts += 1
        if digest is None:
            self._stats.block_deferred_digests += 1
        return True

    # ------------------------------------------------------------------ digests off the request path
    def digest_take(self, max_bytes: int) -> DigestJob | None:
        """The oldest unhashed blocks (at least one, about ``max_bytes`` in all), leased so that no put
        reuses their slots while they are hashed; None when every held block has its digest or is being
        hashed. Pass the job's digests to :meth:`record_digests` (or its keys to :meth:`hashing_ended`),
        then close it."""
        chosen: list[_Block] = []
        total = 0
        for key, nbytes in self._unhashed.items():
            if key in self._hashing:  # the block writer hashes it as it packs it
                continue
            if chosen and total + nbytes > max_bytes:
                break
            chosen.append(self._blocks[key])
            total += nbytes
        if not chosen:
            return None
        self.hashing_begun(b.record.key for b in chosen)
        fds, _, _, _ = _lease_slots(chosen, max_fds=len(chosen))
        items = [
            (b.record.key, b.home.slab, b.index, b.home.slab.data(b.index, b.record.nbytes)) for b in chosen
        ]
        return DigestJob(items, fds)

    def hashing_begun(self, keys: Iterable[bytes]) -> None:
        """A hasher took these unhashed blocks: no other takes them until :meth:`record_digests` or
        :meth:`hashing_ended` names them."""
        self._hashing.update(keys)

    def hashing_ended(self, keys: Iterable[bytes]) -> None:
        self._hashing.difference_update(keys)

    def record_digests(self, found: Iterable[tuple[bytes, Slab, int, bytes]]) -> None:
        """Digests computed off the request path (``key, slab, slot, digest``): written into the records
        of the blocks that are still held in that slot and still lack one."""
        for key, slab, index, digest in found:
            self._hashing.discard(key)
            block = self._blocks.get(key)
            if block is None or block.home.slab is not slab or block.index != index or block.record.hashed:
                continue
            block.record = replace(block.record, digest=digest, hashed=True)
            block.home.slab.write_record(block.index, block.record)
            self._forget_unhashed(key)

    def _forget_unhashed(self, key: bytes) -> None:
        self._hashing.discard(key)
        nbytes = self._unhashed.pop(key, None)
        if nbytes is not None:
            self.unhashed_bytes -= nbytes

    def abort(self, pending: Pending, *, released: bool = False) -> None:
        if not released:
            with contextlib.suppress(ValueError):  # (released already: a commit that failed part way)
                pending.view.release()
        if pending.home.state[pending.index] != _WRITING:
            return  # given back already, or committed
        self.pending_bytes -= pending.home.slab.slot_size
        if pending.unallocated:  # (or its allocation failed part way): a hole again, never a free slot
            home = pending.home
            self._punch(self._groups[(home.space, home.slab.slot_size)], home, pending.index)
            return
        self._free(pending.home, pending.index)

    def unallocate(self, pending: Pending) -> None:
        """Gives a reserved slot's pages back and keeps the slot reserved, :attr:`~Pending.unallocated`
        (a put whose slabs got their pages at once found the tmpfs full: it allocates again in put order,
        so the blocks stored are the leading ones). Under the lock."""
        pending.home.slab.punch(pending.index)
        pending.unallocated = True

    def room_changed(self) -> None:
        """Fills' slots were committed (evictable now) or given back: puts waiting for room look again."""
        self._fill_ended()

    def _free(self, home: _SlabState, index: int) -> None:
        home.state[index] = _FREE
        self._add_free(self._groups[(home.space, home.slab.slot_size)], home, index)

    def want_written(self, key: bytes) -> bool:
        """A held block now asks for an L3 copy (its record says so, so a restart re-queues it); False if
        it is no longer held or already asks."""
        block = self._blocks.get(key)
        if block is None or block.record.durable:
            return False
        block.record = replace(block.record, durable=True)
        block.home.slab.write_record(block.index, block.record)
        return True

    def mark_written(self, key: bytes) -> None:
        """The block's L3 copy is on disk: its record no longer asks for one."""
        block = self._blocks.get(key)
        if block is not None and block.record.durable:
            block.record = replace(block.record, durable=False)
            block.home.slab.write_record(block.index, block.record)

    def durable_wanted(self) -> list[SlotRecord]:
        """Every held block whose record still asks for an L3 copy (re-queued at start)."""
        return [block.record for block in self._blocks.values() if block.record.durable]

    # ------------------------------------------------------------------ eviction and removal
    def oldest_tick(self) -> int | None:
        block = next(iter(self._blocks.values()), None)
        return block.last_use if block is not None else None

    def evict_oldest(self) -> bool:
        block = next(iter(self._blocks.values()), None)
        if block is None:
            return False
        self._stats.block_evictions += 1
        self._remove_chain(block.record.key)
        return True

    def release_free(self, *, keep: _Group | None = None) -> bool:
        """Gives back one free slot's memory (and its slab's, once none is in use), of any group but
        ``keep``; False when none can go."""
        for group in list(self._with_free.values()):
            if group is keep:
                continue
            taken = self._take_free(group)
            if taken is not None:
                self._punch(group, *taken)
                return True
        return False

    def free_slots_read(self) -> bool:
        """Whether some free slot was still read under a lease when last looked at (so neither reused nor
        given back yet: soon free memory, once its reader lets go)."""
        self._look_again()
        return self._read_slots > 0 or bool(self._with_free)

    def _punch(self, group: _Group, home: _SlabState, index: int) -> None:
        home.slab.punch(index)
        home.state[index] = _HOLE
        group.holes.append((home, index))
        self.charged -= home.slab.slot_size
        self._drop_if_empty(home, group)

    def remove(self, keys: Iterable[bytes]) -> int:
        """Removes these blocks and every block continuing them; returns how many."""
        before = len(self._blocks)
        for key in keys:
            if key in self._blocks:
                self._remove_chain(key)
        return before - len(self._blocks)

    def remove_identity(self, identity: bytes) -> int:
        """Removes every block of an identity (every block size); returns how many."""
        return self.remove(self.keys_of(identity))

    def keys_of(self, identity: bytes | None) -> list[bytes]:
        """Every held block's key (of ``identity`` only, where given), least recently used first."""
        if identity is None:
            return list(self._blocks)
        return [b.record.key for b in self._blocks.values() if b.record.identity == identity]

    def clear(self) -> int:
        """Removes every block and gives back every free slot nobody still reads."""
        count = len(self._blocks)
        for key in list(self._blocks):
            if key in self._blocks:
                self._remove_chain(key)
        self.release_all_free()
        return count

    def _remove_chain(self, key: bytes) -> None:
        stack = [key]
        first = True
        while stack:
            current = stack.pop()
            block = self._blocks.pop(current, None)
            if block is None:
                continue
            if not first:
                self._stats.block_cascade_evictions += 1
            first = False
            stack.extend(self._children.pop(current, ()))
            parent = block.record.parent
            if parent is not None:
                siblings = self._children.get(parent)
                if siblings is not None:
                    siblings.discard(current)
                    if not siblings:
                        del self._children[parent]
            self._dirty.discard(current)
            self._forget_unhashed(current)
            block.home.slab.clear_record(block.index)
            self._free(block.home, block.index)
            self._payload -= block.record.nbytes
            summary = self._spaces.get(block.record.space)
            if summary is not None:
                summary.count -= 1
                summary.nbytes -= block.home.slab.slot_size
                if summary.count <= 0:
                    del self._spaces[block.record.space]

    def _drop_if_empty(self, home: _SlabState, group: _Group) -> None:
        if all(state == _HOLE for state in home.state):
            group.homes.remove(home)
            group.holes = [(h, i) for h, i in group.holes if h is not home]
            self.charged -= home.slab.header_bytes
            home.slab.unlink()
            if not group.homes:
                self._groups.pop(group.key, None)
                self._with_free.pop(group.key, None)
                self._with_read.pop(group.key, None)

    # ------------------------------------------------------------------ start and stop
    def adopt(self, *, verify: bool = True) -> None:
        """Re-adopts the committed slots an earlier process left (their record checksum and, with
        ``verify``, their digest checked); frees the rest."""
        found: list[_Block] = []
        for path in sorted(self.directory.iterdir()):
            if not path.name.endswith(SLAB_SUFFIX) or path.is_symlink() or not path.is_file():
                remove(path)
                continue
            try:
                slab = Slab.open(path)
            except (BadSlab, OSError, ValueError) as exc:
                log.warning("dropping block slab %s: %s", path.name, exc)
                remove(path)
                continue
            home = _SlabState(slab, b"", [_HOLE] * slab.slots)
            records = [slab.record(index) for index in range(slab.slots)]
            home.space = next((r.space for r in records if r is not None), b"")
            for index, found_record in enumerate(records):
                record = found_record
                if record is not None and (record.nbytes > slab.slot_size or record.space != home.space):
                    record = None  # (a slab holds one space: anything else was never written by us)
                if record is not None and not record.hashed:
                    record = _hashed_now(slab, index, record)  # (killed before its digest was computed)
                elif record is not None and verify and not _digest_holds(slab, index, record):
                    log.warning("dropping a block of %s whose bytes fail their digest", path.name)
                    self._stats.block_adopt_dropped += 1
                    record = None
                if record is None:
                    slab.clear_record(index)
                    if slab.has_readers(index):
                        home.state[index] = _FREE  # someone still reads it: its pages stay
                    else:
                        slab.punch(index)
                    continue
                home.state[index] = _USED
                found.append(_Block(record, home, index, record.last_use))
            if all(state == _HOLE for state in home.state):
                slab.unlink()
                continue
            group = self._group(home.space, slab.slot_size)
            group.homes.append(home)
            for index, state in enumerate(home.state):
                if state == _FREE:
                    self._add_free(group, home, index)
                elif state == _HOLE:
                    group.holes.append((home, index))
            self.charged += home.charged()
        found.sort(key=lambda b: b.last_use)
        for block in found:
            if block.record.key in self._blocks:  # the same key twice: keep the newer
                self._stats.block_adopt_dropped += 1
                block.home.slab.clear_record(block.index)
                self._free(block.home, block.index)
                continue
            self._index(block)
            self._payload += block.record.nbytes
            self._stats.block_adopted += 1

    def flush_recency(self, keys: Iterable[bytes] | None = None) -> int:
        """Writes the last use of these blocks (None: every block used since the last flush) into their slot
        records (under the lock: a slot may be reused); returns how many."""
        if keys is None:
            keys = self.take_dirty()
        written = 0
        for key in keys:
            block = self._blocks.get(key)
            if block is not None:
                block.home.slab.set_last_use(block.index, block.last_use)
                written += 1
        return written

    def take_dirty(self) -> list[bytes]:
        """The blocks used since the last flush (forgotten here: the caller flushes them)."""
        dirty, self._dirty = self._dirty, set()
        return list(dirty)

    def close(self) -> None:
        """Writes pending recency, punches every free slot nobody reads (unlinking slabs left with no
        block) and unmaps the slabs; the blocks stay for the next start to adopt."""
        self.flush_recency()
        self.release_all_free()
        for group in self._groups.values():
            for home in group.homes:
                home.slab.close()

    def release_all_free(self, limit: int | None = None, *, look: bool = True) -> int:
        """Gives back every free slot's memory nobody still reads (at most ``limit`` slots; ``look``: the
        slots set aside as read are all looked at again first); returns how many slots."""
        released = 0
        if look:
            self._look_again(every=True)
        for key in list(self._groups):
            while (limit is None or released < limit) and self.punch_free_slot(key):
                released += 1
        return released

    # ------------------------------------------------------------------ stats
    def stats(self) -> L2BlockStats:
        stats = L2BlockStats(**{name: getattr(self._stats, name) for name in L2BlockStats.__slots__})
        stats.block_count = len(self._blocks)
        stats.block_bytes = sum(s.nbytes for s in self._spaces.values())
        stats.block_payload_bytes = self._payload
        stats.block_slabs = sum(len(group.homes) for group in self._groups.values())
        stats.block_slab_bytes = self.charged
        stats.block_free_slots = sum(group.spare for group in self._groups.values())
        stats.block_free_bytes = sum(group.spare * group.slot_size for group in self._groups.values())
        stats.block_free_slots_read = self._read_slots
        stats.block_unhashed = len(self._unhashed)
        stats.block_unhashed_bytes = self.unhashed_bytes
        return stats

    def spaces(self) -> list[SpaceSummary]:
        return [
            SpaceSummary(s.space, s.identity, s.block_tokens, s.count, s.nbytes)
            for s in self._spaces.values()
        ]

    # ------------------------------------------------------------------ internals
    def _index(self, block: _Block) -> None:
        record = block.record
        self._blocks[record.key] = block
        if not record.hashed:
            self._unhashed[record.key] = record.nbytes
            self.unhashed_bytes += record.nbytes
        if record.parent is not None:
            self._children.setdefault(record.parent, set()).add(record.key)
        summary = self._spaces.get(record.space)
        if summary is None:
            summary = self._spaces[record.space] = SpaceSummary(
                record.space, record.identity, record.block_tokens
            )
        summary.count += 1
        summary.nbytes += block.home.slab.slot_size

    def _touch_all(self, blocks: Iterable[_Block]) -> None:
        """Marks ``blocks`` used, in this order (the last becomes the newest), with consecutive ticks (kept
        in their records, so a restart keeps the order)."""
        listed = list(blocks)
        tick = self._tick(len(listed))
        to_end = self._blocks.move_to_end
        keys: list[bytes] = []
        for block in listed:
            block.last_use = tick
            tick += 1
            key = block.record.key
            to_end(key)
            keys.append(key)
        self._dirty.update(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks held ``keys`` used, the last first (so a chain's head stays its newest)."""
        found = (self._blocks.get(key) for key in reversed(keys))
        self._touch_all(block for block in found if block is not None)


def allocation_runs(pending: Iterable[Pending]) -> list[list[list[Pending]]]:
    """The :attr:`~Pending.unallocated` slots among ``pending`` as runs of adjacent slots (one
    ``fallocate`` each), the runs of each slab in one list (a tmpfs file allocates under its inode's lock,
    so only different slabs allocate at once)."""
    slabs: dict[int, list[list[Pending]]] = {}
    for slot in pending:
        if not slot.unallocated:
            continue
        runs = slabs.setdefault(id(slot.home), [])
        if runs and runs[-1][-1].index + 1 == slot.index:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return list(slabs.values())


def allocate_runs(runs: Sequence[Sequence[Pending]]) -> None:
    """Gives each run of one slab its pages, in order, without the tier's lock (the slots are the
    caller's until it commits or aborts them); stops at the first slot that gets no pages and raises its
    :class:`NoSpace` (a run the tmpfs cannot hold whole is given its pages slot by slot, to keep what fits).
    The pages are not faulted in here: the copy into the slot maps each one, on the copy's threads."""
    for run in runs:
        first = run[0]
        try:
            first.home.slab.allocate(first.index, len(run), populate=False)
        except NoSpace:
            if len(run) == 1:
                raise
            allocate_runs([[slot] for slot in run])  # (a failed fallocate leaves none of its range allocated)
            continue
        for slot in run:
            slot.unallocated = False


class _InSlot(Protocol):
    """A slot of a slab (a held block, or one a put is filling)."""

    @property
    def record(self) -> SlotRecord: ...
    @property
    def home(self) -> _SlabState: ...
    @property
    def index(self) -> int: ...


def _lease_slots(
    slots: Sequence[_InSlot], max_fds: int
) -> tuple[list[int], list[BlockPlacement], list[Slab], list[int]]:
    """One read-locked descriptor per slab for the leading ``slots`` that fit in ``max_fds`` slabs, each
    holding a lock on every run of consecutive slots it serves; each leased slot's placement (descriptor
    index, offset, bytes), in order; each descriptor's slab; and each leased slot's generation. (One pass:
    a get of 256 blocks is mostly this.)"""
    at: dict[int, int] = {}  # id(slab state) -> descriptor index
    homes: list[_SlabState] = []
    runs: list[list[tuple[int, int]]] = []
    placements: list[BlockPlacement] = []
    generations: list[int] = []
    last: _SlabState | None = None
    fd_index = start = stride = 0
    spans: list[tuple[int, int]] = []
    slot_generations: Sequence[int] = ()
    for slot in slots:
        home, index = slot.home, slot.index
        if home is not last:  # a run of slots from one slab is the common case: one lookup per run
            found = at.get(id(home))
            if found is None:
                if len(homes) == max_fds:
                    break
                found = at[id(home)] = len(homes)
                homes.append(home)
                runs.append([])
            last, fd_index, spans = home, found, runs[found]
            slab = home.slab
            start, stride, slot_generations = slab.data_start, slab.slot_size, slab.slot_generations
        if spans and spans[-1][1] + 1 == index:
            spans[-1] = (spans[-1][0], index)
        else:
            spans.append((index, index))
        placements.append([fd_index, start + index * stride, slot.record.nbytes])
        generations.append(slot_generations[index])
    fds: list[int] = []
    try:
        for home, spans in zip(homes, runs, strict=True):
            fds.append(home.slab.lease(spans))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, placements, [home.slab for home in homes], generations


def _slot_digest(slab: Slab, index: int, record: SlotRecord) -> bytes:
    """The digest of the bytes a slot holds now (adoption: all threads, nothing else runs yet)."""
    view = slab.data(index, record.nbytes)
    try:
        return bytes(blake3(view, max_threads=blake3.AUTO).digest())
    finally:
        view.release()


def _digest_holds(slab: Slab, index: int, record: SlotRecord) -> bool:
    return _slot_digest(slab, index, record) == record.digest


def _hashed_now(slab: Slab, index: int, record: SlotRecord) -> SlotRecord:
    """A record committed unhashed, with its digest computed and written now (adoption)."""
    hashed = replace(record, digest=_slot_digest(slab, index, record), hashed=True)
    slab.write_record(index, hashed)
    return hashed
