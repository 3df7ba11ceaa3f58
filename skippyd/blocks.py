"""The rules for blocks across tiers: what a put stores, what ``contains`` counts, what a get serves.

* **Keys.** Every key a client names (skippyd's own chained keys or an engine's block hashes, 1 to 64
  bytes) is bound to its block space with BLAKE3 (:func:`skippyd.keys.bind_keys`) before any tier sees
  it; tiers store, index and name blocks only by bound key.
* **put**: blocks already held are left as they are (``present``); each new one is copied from the
  connection's staging buffer into a slot only the daemon can write and hashed there (spread over the
  copy threads), and its record written last. A block whose chain has a hole before it (its parent is
  held by no tier) is not stored: ``contains`` could never reach it.
* **contains**: the leading run of keys held in L2 or L3, from memory.
* **get**: the leading run held, leased for reading: descriptors of the slabs (one per slab, at most
  :data:`~skippyd.protocol.MAX_FDS` a reply) and where each block is; the client asks again for the
  rest of a longer run.

Nothing here touches sockets or imports torch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from blake3 import blake3

from .errors import InvalidArgument, NoSpace, SkippydError, TooLarge
from .keys import BlockSpaceId, bind_keys
from .l2 import L2Tier
from .l2.blocks import Lease, Pending
from .l2.slabs import SlotRecord
from .shm import _copy_pool

__all__ = ["BlockCounters", "BlockRules", "PutOutcome", "Served"]

_PARALLEL_BYTES = 1 << 20  # puts smaller than this are copied and hashed on the calling thread


@dataclass(frozen=True, slots=True)
class PutOutcome:
    stored: int
    present: int
    skipped: int  # neither held nor sent, or left out because the chain has a hole before them
    nbytes: int
    durability: str = "none"


@dataclass(slots=True)
class Served:
    """What a get hands out: the leased run (its descriptors are the caller's to send and close) and how
    many leading keys are held in all (a longer run than one reply carries)."""

    lease: Lease
    held: int


@dataclass(slots=True)
class BlockCounters:
    block_puts: int = 0
    block_put_offered: int = 0  # blocks named by puts
    block_put_stored: int = 0
    block_put_present: int = 0
    block_bytes_offered: int = 0  # bytes of the blocks puts named (stored or not): the dedup ratio's top
    block_bytes_written: int = 0
    block_contains: int = 0
    block_gets: int = 0
    block_get_blocks: int = 0
    block_get_bytes: int = 0


class BlockRules:
    def __init__(self, l2: L2Tier, *, copy_threads: int = 2) -> None:
        self.l2 = l2
        self._copy_threads = max(1, copy_threads)
        self.counters = BlockCounters()
        self._lock = threading.Lock()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    # ----------------------------------------------------------------- contains / get
    def contains(self, space: BlockSpaceId, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held."""
        bound = bind_keys(space, keys)
        self._count(block_contains=1)
        with self.l2.lock:
            return self.l2.blocks.held(bound)

    def held(self, space: BlockSpaceId, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` are held, each (what a client asks before it copies a put's data)."""
        bound = bind_keys(space, keys)
        with self.l2.lock:
            return [self.l2.blocks.holds(key) for key in bound]

    def get(self, space: BlockSpaceId, keys: Sequence[bytes], *, max_fds: int) -> Served:
        bound = bind_keys(space, keys)
        with self.l2.lock:
            blocks = self.l2.blocks
            held = blocks.held(bound)
            lease = blocks.lease(bound[:held], max_fds=max_fds)
            if held < len(bound):
                blocks.count_miss()
        served = lease.placements
        self._count(block_gets=1, block_get_blocks=len(served), block_get_bytes=sum(p.nbytes for p in served))
        return Served(lease, held)

    # ----------------------------------------------------------------- put
    def put(
        self,
        space: BlockSpaceId,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
        *,
        parent: bytes | None = None,
        durable: bool | str = True,
    ) -> PutOutcome:
        """Stores the blocks of ``keys`` that are not held, each from ``source[offsets[i]:][:sizes[i]]``
        (an offset of -1: not sent, because the client found it held)."""
        if durable not in (True, False, "sync"):
            raise InvalidArgument('durable must be true, false or "sync"')
        if not len(keys) == len(sizes) == len(offsets):
            raise InvalidArgument("keys, sizes and offsets must be lists of the same length")
        for index, (size, offset) in enumerate(zip(sizes, offsets, strict=True)):
            if offset >= 0 and offset + size > len(source):
                raise InvalidArgument(f"block {index} lies outside the staging buffer")
        bound = bind_keys(space, keys)
        parent_key = bind_keys(space, [parent])[0] if parent is not None else None
        space_digest = bytes.fromhex(space.digest)
        identity = bytes.fromhex(space.identity.digest)
        pending: list[tuple[int, Pending]] = []
        present = skipped = 0
        failure: SkippydError | None = None
        blocks = self.l2.blocks
        with self.l2.lock:
            blocks.touch(bound)  # the held ones become the newest before anything is evicted for the rest
            taken: set[bytes] = set()
            for index, key in enumerate(bound):
                if blocks.holds(key) or key in taken:
                    present += 1
                    continue
                if offsets[index] < 0 or failure is not None:
                    skipped += 1
                    continue
                previous = bound[index - 1] if index else parent_key
                record = SlotRecord(
                    key=key, space=space_digest, identity=identity, block_tokens=space.block_tokens,
                    parent=previous, nbytes=sizes[index], digest=bytes(32),
                )  # fmt: skip
                try:
                    pending.append((index, blocks.reserve(record)))
                except (NoSpace, TooLarge) as exc:
                    failure = exc
                    skipped += 1
                    continue
                taken.add(key)
        try:
            digests = self._fill(pending, sizes, offsets, source)
        except BaseException:
            with self.l2.lock:
                for _, slot in pending:
                    blocks.abort(slot)
            raise
        stored = nbytes = 0
        with self.l2.lock:
            for (index, slot), digest in zip(pending, digests, strict=True):
                parent_of = slot.record.parent
                if parent_of is not None and not blocks.holds(parent_of):
                    blocks.abort(slot)  # a hole before it: contains could never reach it
                    skipped += 1
                    continue
                if blocks.commit(slot, digest, durable=False):
                    stored += 1
                    nbytes += sizes[index]
                else:
                    present += 1
            blocks.touch(bound)
        if failure is not None and stored == 0 and present == 0:
            raise failure
        self._count(
            block_puts=1, block_put_offered=len(bound), block_put_stored=stored, block_put_present=present,
            block_bytes_offered=sum(sizes), block_bytes_written=nbytes,
        )  # fmt: skip
        return PutOutcome(stored, present, skipped, nbytes, "none")

    def _fill(
        self,
        pending: list[tuple[int, Pending]],
        sizes: Sequence[int],
        offsets: Sequence[int],
        source: memoryview,
    ) -> list[bytes]:
        """Copies every pending block out of the staging buffer into its slot and hashes it there."""
        jobs = [(slot.view, source[offsets[i] : offsets[i] + sizes[i]]) for i, slot in pending]
        try:
            total = sum(sizes[i] for i, _ in pending)
            if self._copy_threads <= 1 or total < _PARALLEL_BYTES or len(jobs) < 2:
                return _copy_and_hash(jobs)
            step = -(-len(jobs) // self._copy_threads)
            pool = _copy_pool()
            futures = [pool.submit(_copy_and_hash, jobs[i : i + step]) for i in range(step, len(jobs), step)]
            first = _copy_and_hash(jobs[:step])
            return first + [digest for future in futures for digest in future.result()]
        finally:
            for _, src in jobs:
                src.release()

    # ----------------------------------------------------------------- admin
    def evict_identity(self, identity_digest: str) -> int:
        with self.l2.lock:
            return self.l2.blocks.remove_identity(bytes.fromhex(identity_digest))

    def clear(self) -> int:
        with self.l2.lock:
            return self.l2.blocks.clear()

    def stats(self) -> BlockCounters:
        with self._lock:
            return BlockCounters(**{name: getattr(self.counters, name) for name in BlockCounters.__slots__})


def _copy_and_hash(jobs: list[tuple[memoryview, memoryview]]) -> list[bytes]:
    digests = []
    for target, source in jobs:
        if len(source):
            np.copyto(np.frombuffer(target, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8))
        digests.append(bytes(blake3(target).digest()))
    return digests
