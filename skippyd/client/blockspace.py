"""Blocks on the client side: :class:`BlockSpace` (blocking) and :class:`AsyncBlockSpace`, over one core.

A block space is one identity (model, state, namespace) and one block size. Keys come from
:meth:`BlockSpace.keys` (32 bytes, chained over the space and every earlier block) or from the engine
(any bytes, 1 to 64 each); the daemon binds every key to the space, so the same engine hash in
another space is another block.

* ``put`` asks which blocks are held first (one request), copies only the others into the connection's
  staging buffer, and sends one request per staging buffer's worth.
* ``get`` maps each slab descriptor once (private copy-on-write: a write to a tensor never reaches the
  store or a later get) and slices one tensor per block out of it: no copy.
* ``get_into`` copies each block straight from the daemon's slab into the caller's buffer: through a
  read-only shared mapping of the slab that the process keeps (:class:`SlabMaps`, a few slabs, so the
  copy is a memcpy from mapped memory, not a read through the page cache), or with ``preadv`` for a
  descriptor that is not a slab file (an L3 read into a memfd); split over two threads for large runs.
  The reply's descriptor holds the read lease while the copy runs, as for ``get``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from skippyd.errors import BadFrame, InvalidArgument, Mismatch
from skippyd.keys import MAX_BLOCK_KEY_BYTES, block_keys, block_space, encode_tokens
from skippyd.protocol import MAX_BLOCKS_PER_REQUEST, MAX_FDS

from .transfer import cuda_in_use, in_callers_streams, map_without_leases
from .transfer.book import SlotMap
from .transfer.pages import LazyPieces, PageLayout
from .transfer.plan import Flat

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_KEYS_PER_REQUEST", "AsyncBlockSpace", "BlockSpace", "BlocksPut", "SlabMaps", "slab_maps"]

MAX_KEYS_PER_REQUEST = MAX_BLOCKS_PER_REQUEST  # what the daemon takes in one request
_ALIGN = 64
_PARALLEL_BYTES = 4 << 20
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class BlocksPut:
    """What a put did: ``stored`` blocks newly written (``nbytes`` of them), ``present`` already held
    (not rewritten), ``skipped`` neither (held when asked but gone when sent, or a hole before them).

    A put returns once skippyd holds its bytes; the daemon's copy out of its staging buffer and the
    commit may follow (docs/protocol.md, "Staging halves"): ``durability`` is then ``"pending"`` for a
    durable put (its L3 copy is queued once the commit is done; any later call on this client sees the
    blocks, and a clean stop keeps them, but a kill -9 within the copy's milliseconds does not: use
    ``durable="sync"`` for a put that must survive one)."""

    stored: int
    present: int
    nbytes: int
    skipped: int = 0
    durability: str = "none"


# ---------------------------------------------------------------- the sans-I/O core


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    listed = list(keys)
    if all(type(key) is bytes and 0 < len(key) <= MAX_BLOCK_KEY_BYTES for key in listed):
        return listed
    for index, key in enumerate(listed):
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_BLOCK_KEY_BYTES:
            raise InvalidArgument(f"block key {index} must be bytes, 1 to {MAX_BLOCK_KEY_BYTES} long")
    return listed


Part = Any  # a memoryview of a buffer's bytes, or a torch tensor (copied as it lies: any strides, any device)


def _part(item: Any) -> Part:
    if type(item).__module__.startswith("torch"):
        return item.detach()
    try:
        view = memoryview(item)
    except TypeError:
        raise InvalidArgument(
            f"block data must be a tensor, a buffer or a list of them, not {type(item).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("block buffers must be C-contiguous")
    return view.cast("B")


def _part_bytes(part: Part) -> int:
    return len(part) if isinstance(part, memoryview) else int(part.numel() * part.element_size())


def _block_parts(item: Any) -> list[Part]:
    """The pieces of one block, in order: a tensor (any dtype, device or strides: nothing is copied until
    the bytes go into the staging buffer), a C-contiguous buffer, or a list or tuple of them (the block
    is their bytes one after another)."""
    if isinstance(item, list | tuple):
        return [_part(piece) for piece in item]
    return [_part(item)]


def _torch() -> Any:
    import torch

    return torch


@dataclass(slots=True)
class _Batch:
    start: int
    stop: int
    offsets: list[int]
    size: int  # staging bytes it needs


def _plan_batches(sizes: Sequence[int], held: Sequence[bool], limit: int) -> list[_Batch]:
    """Splits a put into requests of at most ``limit`` bytes each (a staging half's worth); a block
    larger than that goes as a request of its own, which the client stages whole (and the daemon
    refuses as ``too_large`` past what it lends one connection)."""
    batches: list[_Batch] = []
    current = _Batch(0, 0, [], 0)
    for index, (size, have) in enumerate(zip(sizes, held, strict=True)):
        need = 0 if have else -(-size // _ALIGN) * _ALIGN
        if current.stop > current.start and (
            current.size + need > limit or current.stop - current.start >= MAX_KEYS_PER_REQUEST
        ):
            batches.append(current)
            current = _Batch(index, index, [], 0)
        current.offsets.append(-1 if have else current.size)
        current.size += need
        current.stop = index + 1
    if current.stop > current.start:
        batches.append(current)
    return batches


def _copy_part(region: memoryview, offset: int, part: Part) -> int:
    """Copies one piece to ``offset`` of the staging region; returns its size."""
    size = _part_bytes(part)
    if not size:
        return 0
    if isinstance(part, memoryview):
        target = np.frombuffer(region, dtype=np.uint8, count=size, offset=offset)
        np.copyto(target, np.frombuffer(part, dtype=np.uint8))
        return size
    torch = _torch()
    into = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset)
    try:  # strided and device tensors are copied as they lie, straight into the staging buffer
        into.view(part.dtype).view(part.shape).copy_(part)
    except RuntimeError:  # a dtype the bytes cannot be viewed as at this offset: go through its bytes
        into.copy_(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return size


def _write_blocks(region: memoryview, jobs: list[tuple[int, list[Part]]]) -> None:
    """Copies each block's pieces to its offset in the staging region (two threads for large puts; CUDA
    pieces by DMA straight into it, see :mod:`skippyd.client.transfer`)."""
    if cuda_in_use() and any(getattr(piece, "is_cuda", False) for _, pieces in jobs for piece in pieces):
        jobs = _cuda_pieces_to_host(region, jobs)

    def run(part: list[tuple[int, list[Part]]]) -> None:
        for start, pieces in part:
            at = start
            for piece in pieces:
                at += _copy_part(region, at, piece)

    in_two(run, jobs, sum(_part_bytes(piece) for _, pieces in jobs for piece in pieces))


def _cuda_pieces_to_host(
    region: memoryview, jobs: list[tuple[int, list[Part]]]
) -> list[tuple[int, list[Part]]]:
    """Copies the contiguous CUDA pieces by DMA (one transfer, waited for); returns what is left to copy
    on the host (the other pieces, at their offsets)."""
    from .transfer.device import transfer

    on_cuda: list[tuple[int, Any]] = []
    rest: list[tuple[int, list[Part]]] = []
    for start, pieces in jobs:
        at = start
        for piece in pieces:
            size = _part_bytes(piece)
            if getattr(piece, "is_cuda", False) and not piece.is_sparse:
                on_cuda.append((at, piece))
            elif size:
                rest.append((at, [piece]))
            at += size
    transfer().to_host(region, on_cuda)
    return rest


_pools: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    if not _pools:
        _pools.append(ThreadPoolExecutor(max_workers=2, thread_name_prefix="skippyd-blocks"))
    return _pools[0]


def in_two(run: Callable[[list[Any]], None], jobs: list[Any], nbytes: int) -> None:
    """``run(jobs)``, split in two halves over this thread and a pool thread when the jobs move at least
    4 MiB (the client's copies release the GIL); on this thread alone otherwise."""
    if nbytes < _PARALLEL_BYTES or len(jobs) < 2:
        run(jobs)
        return
    half = len(jobs) // 2
    future = _pool().submit(run, jobs[half:])
    run(jobs[:half])
    future.result()


def _placements(reply: dict[str, Any], fds: list[int]) -> list[tuple[int, int, int]]:
    try:
        placements = [(a, b, c) for a, b, c in reply["blocks"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise BadFrame(f"a blocks_get reply without a valid block list: {exc}") from exc
    carried = range(len(fds))
    for fd, offset, nbytes in placements:
        if type(fd) is not int or type(offset) is not int or type(nbytes) is not int:
            raise BadFrame("a blocks_get reply places a block with something other than integers")
        if fd not in carried or offset < 0 or nbytes < 0:
            raise BadFrame("a blocks_get reply names a descriptor it did not carry, or a negative place")
    return placements


def _runs(placements: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Placements grouped into runs ``(fd, offset, nbytes, count, stride)``: blocks of one size at a steady
    stride in one descriptor (a put's blocks in consecutive slots); a run of one has stride 0."""
    runs: list[tuple[int, int, int, int, int]] = []
    index, count = 0, len(placements)
    while index < count:
        fd, offset, nbytes = placements[index]
        end = index + 1
        stride = placements[end][1] - offset if end < count else 0
        if nbytes and stride >= nbytes:
            while end < count:
                nfd, noffset, nnbytes = placements[end]
                if nfd != fd or nnbytes != nbytes or noffset != offset + (end - index) * stride:
                    break
                end += 1
        runs.append((fd, offset, nbytes, end - index, stride if end - index > 1 else 0))
        index = end
    return runs


def _map_blocks(reply: dict[str, Any], fds: list[int]) -> list[torch.Tensor]:
    """One uint8 tensor per served block, views of one private mapping per descriptor; each run of
    blocks at a steady stride comes out of one strided view, unbound in one call."""
    torch = _torch()
    runs = _runs(_placements(reply, fds))
    spans: dict[int, tuple[int, int]] = {}
    for fd, offset, nbytes, count, stride in runs:
        if nbytes:
            end = offset + (count - 1) * stride + nbytes
            lo, hi = spans.get(fd, (offset, end))
            spans[fd] = (min(lo, offset), max(hi, end))
    bases: dict[int, tuple[int, Any]] = {}
    for fd, (lo, hi) in spans.items():
        start = lo // _PAGE * _PAGE
        mapping = mmap.mmap(
            fds[fd], hi - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start
        )
        bases[fd] = (start, torch.frombuffer(mapping, dtype=torch.uint8))
    out: list[Any] = []
    for fd, offset, nbytes, count, stride in runs:
        if not nbytes:
            out += [torch.empty(0, dtype=torch.uint8) for _ in range(count)]
            continue
        start, base = bases[fd]
        if count > 1:
            out += base.as_strided((count, nbytes), (stride, 1), offset - start).unbind(0)
        else:
            out.append(base[offset - start : offset - start + nbytes])
    return out


class SlabMaps:
    """Read-only shared mappings of the daemon's slab files, kept across ``get_into`` calls (the ``limit``
    most recently used), so copying a block out is a memcpy from mapped memory. A mapping is made through
    a fresh open file description (``/proc/self/fd``), never the reply's: the reply's holds the read
    leases on the slots it served (``F_OFD_SETLK``), and a kept mapping of it would keep them, so the
    daemon could neither reuse nor give back those slots after they were evicted. A mapping never pins
    memory the daemon gave back: an evicted slot's pages are punched out of the file (and out of every
    mapping of it), and a slab file is removed only once all its slots are. A slab found removed (its
    file's link count 0, say after its directory was wiped) is unmapped at the next call. Descriptors
    that are not linked files (the memfds of L3 reads), or that this process may not open again (a
    daemon of another user), are never mapped here. Thread-safe."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._maps: OrderedDict[tuple[int, int], tuple[int, mmap.mmap, int]] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, fd: int, end: int) -> memoryview | None:
        """A read-only view of the slab open as ``fd`` covering at least ``[0, end)``, or None."""
        info = os.fstat(fd)
        if info.st_nlink == 0 or not stat.S_ISREG(info.st_mode) or info.st_size < end:
            return None
        key = (info.st_dev, info.st_ino)
        with self._lock:
            self._sweep_locked()
            found = self._maps.get(key)
            if found is not None and found[2] >= end:
                self._maps.move_to_end(key)
                return memoryview(found[1])
        made = map_without_leases(fd, info.st_size)
        if made is None:  # (a file this process may not open again, or map: read through the reply's fd)
            return None
        keep, mapping = made
        with self._lock:
            old = self._maps.pop(key, None)
            self._maps[key] = (keep, mapping, info.st_size)
            dropped = [old] if old is not None else []
            while len(self._maps) > self.limit:
                dropped.append(self._maps.popitem(last=False)[1])
        for entry in dropped:
            _unmap(entry)
        return memoryview(mapping)

    def _sweep_locked(self) -> None:
        for key, entry in list(self._maps.items()):
            try:
                gone = os.fstat(entry[0]).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                del self._maps[key]
                _unmap(entry)

    def close(self) -> None:
        with self._lock:
            entries, self._maps = list(self._maps.values()), OrderedDict()
        for entry in entries:
            _unmap(entry)

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)


def _unmap(entry: tuple[int, mmap.mmap, int]) -> None:
    with contextlib.suppress(OSError):
        os.close(entry[0])
    with contextlib.suppress(BufferError):  # a copy still running holds a view: unmapped when it ends
        entry[1].close()


#: The process's slab mappings (one set for every client: slabs are named by device and inode).
slab_maps = SlabMaps()


# A destination piece of ``get_into``: ``(block, at, nbytes, where)``: block ``block`` of the reply, its bytes
# ``[at, at + nbytes)``; ``where`` is the address for plain memory (a C-contiguous buffer or a contiguous
# CPU tensor: a memcpy; ``out`` keeps it alive) or a tensor to fill with ``copy_`` (strided, conjugate or
# negative views, other devices; CUDA tensors go through skippyd.client.transfer first).
_Dest = tuple[int, int, int, Any]

#: Tests only (tests/test_transfer_sim.py): CPU tensors go the way CUDA ones do, to the device transfer.
_CPU_AS_DEVICE = False


class _NoTensor:  # what isinstance checks against before torch is imported (no tensor can exist then)
    pass


def _tensor_type() -> type:
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else _NoTensor


def _destination(  # noqa: PLR0917 - one block's destination and where its pieces go
    target: Any,
    nbytes: int,
    index: int,
    block: int,
    tensor: Any,
    lists: tuple[list[_Dest], list[_Dest], list[Any], list[_Dest]],
) -> None:
    """Where block ``index``'s ``nbytes`` go: ``target`` (one buffer or tensor, or a list or tuple of them
    that the block's bytes fill one after another, as ``put`` takes pieces; the last may be filled only
    in part) split into memory to memcpy into (``raw``), tensors to ``copy_`` into (``other``, detached)
    and CUDA tensors for the device transfer (``cuda``, as they are: it reads their layout itself and
    detaches them only if it falls back to ``copy_``); what keeps a buffer's address valid goes to
    ``keep``. Lean: an engine passes thousands of pieces."""
    raw, other, keep, cuda = lists
    pieces = target if isinstance(target, list | tuple) else (target,)
    at = 0
    plain = not _CPU_AS_DEVICE
    for piece in pieces:
        left = nbytes - at
        if not left:
            break
        if isinstance(piece, tensor):
            take = piece.nbytes
            if take > left:
                take = left
            elif not take:
                continue
            if not plain or piece.is_cuda:
                if not piece.is_contiguous():
                    _no_zero_stride(piece, index)
                cuda.append((block, at, take, piece))
            elif piece.is_cpu and piece.is_contiguous() and not piece.is_conj() and not piece.is_neg():
                raw.append((block, at, take, piece.data_ptr()))
            else:
                if not piece.is_contiguous():  # (a contiguous piece has no 0 stride: pages skip the look)
                    _no_zero_stride(piece, index)
                other.append((block, at, take, piece.detach()))
            at += take
            continue
        try:
            view = memoryview(piece)
        except TypeError:
            raise InvalidArgument(
                f"out[{index}] must be a tensor or a writable buffer, or a list of them"
            ) from None
        if view.readonly:
            raise InvalidArgument(f"out[{index}] is read-only")
        if not view.c_contiguous:
            raise InvalidArgument(
                f"out[{index}]: buffers must be C-contiguous (a strided array: pass it as a tensor)"
            )
        take = min(view.nbytes, left)
        if take:
            array = np.frombuffer(view.cast("B"), dtype=np.uint8)
            keep.append(array)
            raw.append((block, at, take, array.ctypes.data))
            at += take
    if at < nbytes:
        raise Mismatch(f"out[{index}] holds {at} bytes; block {index} has {nbytes}")


def _no_zero_stride(piece: Any, index: int) -> None:
    if any(s == 0 and n > 1 for s, n in zip(piece.stride(), piece.shape, strict=True)):
        raise InvalidArgument(f"out[{index}] has a piece whose elements share memory (a 0 stride)")


@dataclass(frozen=True, slots=True)
class _Generations:
    files: list[int]  # each descriptor's
    slots: list[int] | None  # each block's slot (None: an older daemon's reply has none per slot)
    maps: list[SlotMap | None] | None  # each descriptor's slab slot map, when asked for and given


def _generations(
    reply: dict[str, Any], fds: list[int], placements: list[tuple[int, int, int]]
) -> _Generations | None:
    """A reply's descriptor generations, its blocks' slot generations and its slabs' slot maps, or None
    when the descriptors' generations are missing."""
    generations = reply.get("generations")
    if not isinstance(generations, list) or len(generations) != len(fds):
        return None
    slots = reply.get("slot_generations")  # one per placement (an older daemon: absent, per file then)
    slot_generations = (
        [int(g) for g in slots] if isinstance(slots, list) and len(slots) == len(placements) else None
    )
    maps = _slot_maps(reply.get("slot_maps"), fds)
    return _Generations([int(g) for g in generations], slot_generations, maps)


def _slot_maps(maps: Any, fds: list[int]) -> list[SlotMap | None] | None:
    """A reply's ``slot_maps`` (one per descriptor: data start, slot size, 8 bytes a slot), or None when
    it has none (not asked for, an older daemon) or they do not hold together."""
    if not isinstance(maps, list) or len(maps) != len(fds):
        return None
    out: list[SlotMap | None] = []
    for item in maps:
        if item is None:
            out.append(None)
            continue
        if not isinstance(item, list | tuple) or len(item) != 3:
            return None
        start, size, table = item
        if not (type(start) is int and type(size) is int and isinstance(table, bytes)):
            return None
        if start < 0 or size <= 0 or len(table) % 8:
            return None
        out.append((start, size, table))
    return out


def _to_cuda(
    reply: dict[str, Any], fds: list[int], placements: list[tuple[int, int, int]], pieces: list[_Dest]
) -> bool:
    """Queues the DMA of every CUDA piece (one device) from the registered slabs (skippyd.client.transfer: one
    copy per contiguous run, strided pieces through a device staging buffer and one on-device copy);
    False when they are on several devices or a descriptor is served once (then the host path copies)."""
    device = pieces[0][3].device
    if not all(piece[3].device == device for piece in pieces):
        return False
    from .transfer.device import transfer

    found = _generations(reply, fds, placements)
    if found is None:
        return False
    return transfer().pieces_to_device(
        placements, fds, found.files, pieces, slot_generations=found.slots, slot_maps=found.maps
    )


def _read_pages(reply: dict[str, Any], fds: list[int], layout: PageLayout, first: int) -> int:
    """Reads every served block into its pages (``layout``'s rows ``first``, ...); returns how many. On
    the CPU: every piece planned as arrays, merged into runs, one memcpy a run from the kept slab
    mappings; CUDA planes go to the device transfer; a descriptor that is not a slab file (an L3 read
    into a memfd), or planes on another device, take get_into's way with the pages as pieces."""
    placements = _placements(reply, fds)
    if not placements:
        return 0
    device = layout.device
    assert device is not None
    if device.type != "cpu" or _CPU_AS_DEVICE:
        if device.type == "cuda" or _CPU_AS_DEVICE:
            from .transfer.device import transfer

            found = _generations(reply, fds, placements)
            if found is not None and transfer().pages_to_device(
                placements, fds, found.files, layout, first,
                slot_generations=found.slots, slot_maps=found.maps,
            ):  # fmt: skip
                return len(placements)
        return _read_blocks(reply, fds, LazyPieces(layout), first)
    table = np.asarray(placements, dtype=np.int64).reshape(-1, 3)
    views: list[memoryview] = []
    bases = np.zeros(len(fds), dtype=np.int64)
    try:
        for index in np.unique(table[:, 0]).tolist():
            mine = table[table[:, 0] == index]
            view = slab_maps.view(fds[index], int((mine[:, 1] + mine[:, 2]).max()))
            if view is None:
                return _read_blocks(reply, fds, LazyPieces(layout), first)
            views.append(view)
            bases[index] = np.frombuffer(view, dtype=np.uint8).ctypes.data
        pieces = layout.pieces(first, bases[table[:, 0]] + table[:, 1], table[:, 2])
        zero = np.zeros(len(pieces.src), dtype=np.int64)  # (host memory: any two ranges that meet merge)
        src, dst, size, _, _ = Flat.of([pieces.src, pieces.dst, pieces.size, pieces.rel, zero, zero]).runs()
        in_two(_memmoves, list(zip(src.tolist(), dst.tolist(), size.tolist(), strict=True)), int(size.sum()))
    finally:
        for view in views:
            with contextlib.suppress(BufferError):
                view.release()
    return len(placements)


def _read_blocks(reply: dict[str, Any], fds: list[int], out: Sequence[Any], first: int) -> int:
    """Reads every served block into ``out[first + i]``; returns how many. The host copies of the blocks
    whose destinations are checked start in a pool thread while the next blocks' are (so a destination
    that does not fit raises :class:`Mismatch` with the blocks before it possibly copied)."""
    placements = _placements(reply, fds)
    raw: list[_Dest] = []
    other: list[_Dest] = []
    keep: list[Any] = []
    cuda: list[_Dest] = []
    lists, tensor = (raw, other, keep, cuda), _tensor_type()
    copier = _HostCopies(fds, placements)
    try:
        for i, (_, _, nbytes) in enumerate(placements):
            start = len(raw)
            _destination(out[first + i], nbytes, first + i, i, tensor, lists)
            copier.add(raw, start)
        if cuda and not _to_cuda(reply, fds, placements, cuda):  # the host path copies them after all
            other.extend((block, at, take, piece.detach()) for block, at, take, piece in cuda)
        copier.finish(other)
    finally:
        copier.close()
    return len(placements)


_CHUNK = 4 << 20  # merged copies handed to a pool thread at a time
_LARGE_COPY = 256 << 10  # ... when they average at least this much


class _HostCopies:
    """The host side of one ``get_into`` reply: copies into plain memory with one memcpy per run (pieces
    that continue each other in the slab and in memory merge: a block into consecutive pages of one
    tensor is one copy per run of pages), from a read-only mapping of the slab, handed to a pool thread
    4 MiB at a time as they are planned when the copies are large (measured: small ones are slower on
    two threads, each copy taking the GIL back); ``preadv`` where the descriptor is not a slab file; then the
    other pieces filled with ``copy_`` from a uint8 view of their bytes reinterpreted as the piece's dtype
    and shape (the mirror of ``put``: the block holds a piece's elements in their logical order)."""

    def __init__(self, fds: list[int], placements: list[tuple[int, int, int]]) -> None:
        self.fds, self.placements = fds, placements
        self.mapped: dict[int, memoryview | None] = {}
        self.bases: dict[int, int] = {}
        self.reads: list[tuple[int, int, str, int, int]] = []  # (fd, offset, "mem", address, bytes): preadv
        self.chunk: list[tuple[int, int, int]] = []  # source address, target address, bytes: a memcpy each
        self.chunk_bytes = 0
        self.futures: list[Any] = []
        self.run = (-1, -1, -1)  # the copy being extended

    def _base(self, fd: int) -> int | None:
        if fd not in self.mapped:
            end = max(offset + nbytes for index, offset, nbytes in self.placements if index == fd)
            view = self.mapped[fd] = slab_maps.view(self.fds[fd], end)
            if view is not None:
                self.bases[fd] = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        return self.bases.get(fd)

    def add(self, raw: list[_Dest], start: int) -> None:
        """Plans the copies of ``raw[start:]`` (one block's plain pieces)."""
        if start == len(raw):
            return
        placements, bases = self.placements, self.bases
        src_at, dst_at, size = self.run
        for block, at, take, address in raw[start:]:
            fd, offset, _ = placements[block]
            base = bases.get(fd)
            if base is None and (base := self._base(fd)) is None:
                self.reads.append((fd, offset + at, "mem", address, take))
            elif base + offset + at == src_at + size and address == dst_at + size:
                size += take
            else:
                if size > 0:
                    self._copy(src_at, dst_at, size)
                src_at, dst_at, size = base + offset + at, address, take
        self.run = (src_at, dst_at, size)

    def _copy(self, source: int, target: int, nbytes: int) -> None:
        self.chunk.append((source, target, nbytes))
        self.chunk_bytes += nbytes
        if self.chunk_bytes >= _CHUNK:
            if self.chunk_bytes >= len(self.chunk) * _LARGE_COPY:
                self.futures.append(_pool().submit(_memmoves, self.chunk))
            else:  # many small copies: here (a thread would wait for the GIL between every two of them)
                _memmoves(self.chunk)
            self.chunk, self.chunk_bytes = [], 0

    def finish(self, other: list[_Dest]) -> None:
        """The last copies here, the reads, then the pieces to fill with ``copy_``."""
        src_at, dst_at, size = self.run
        if size > 0:
            self.chunk.append((src_at, dst_at, size))
            self.run = (-1, -1, -1)
        fills: list[tuple[Any, int, int, Any]] = []  # piece, address of its bytes, bytes, what holds them
        if other:
            torch = _torch()
            for block, at, take, target in other:
                fd, offset, _ = self.placements[block]
                base = self._base(fd)
                if base is not None:
                    fills.append((target, base + offset + at, take, None))
                else:  # read into a buffer first
                    temp = torch.empty(take, dtype=torch.uint8)
                    self.reads.append((fd, offset + at, "mem", temp.data_ptr(), take))
                    fills.append((target, temp.data_ptr(), take, temp))
        _memmoves(self.chunk)
        for future in self.futures:
            future.result()
        self.futures = []
        _preadv(self.fds, self.reads)
        for target, address, take, _ in fills:
            _fill(target, address, take)

    def close(self) -> None:
        """Waits for the copies still running (a failed call's), then lets the mappings go."""
        for future in self.futures:
            with contextlib.suppress(Exception):
                future.result()
        for view in self.mapped.values():
            if view is not None:
                with contextlib.suppress(BufferError):  # a failed copy's frames may hold a view a while
                    view.release()


def _memmoves(copies: list[tuple[int, int, int]]) -> None:
    import ctypes

    for source, target, nbytes in copies:
        ctypes.memmove(target, source, nbytes)  # (releases the GIL)


def _preadv(fds: list[int], reads: list[tuple[int, int, str, int, int]]) -> None:
    """Reads ``(fd, offset, _, address, bytes)`` from descriptors that are not slab files (an L3 read into
    a memfd): merged into runs, up to 512 buffers a call, split over two threads for large reads."""
    import ctypes

    from .transfer.plan import plan_runs

    runs: list[tuple[int, int, list[Any], int]] = []  # fd, offset, buffers, bytes: one preadv each
    for run in plan_runs(reads, sort=False):
        buffer = (ctypes.c_char * run.nbytes).from_address(run.dst_offset)
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[0] == run.src
            and last[1] + last[3] == run.src_offset
            and len(last[2]) < 512
        ):
            last[2].append(buffer)
            runs[-1] = (run.src, last[1], last[2], last[3] + run.nbytes)
        else:
            runs.append((run.src, run.src_offset, [buffer], run.nbytes))

    def read(part: list[tuple[int, int, list[Any], int]]) -> None:
        for fd, offset, buffers, total in part:
            got = os.preadv(fds[fd], buffers, offset)
            if got != total:
                raise BadFrame(f"a block descriptor gave {got} of {total} bytes")

    total = sum(run[3] for run in runs)
    if total < _PARALLEL_BYTES or len(runs) >= 2:
        in_two(read, runs, total)
        return
    fd, offset, buffers, _ = runs[0]  # one long run: split it in two by its buffers
    half = len(buffers) // 2
    if not half:
        read(runs)
        return
    second = offset + sum(len(b) for b in buffers[:half])
    future = _pool().submit(read, [(fd, second, buffers[half:], sum(len(b) for b in buffers[half:]))])
    read([(fd, offset, buffers[:half], second - offset)])
    future.result()


def _fill(piece: Any, address: int, take: int) -> None:
    """``piece`` (any strides, any device) gets the ``take`` bytes at ``address`` as its first elements in
    logical order, its dtype and shape laid over them (the rest of a piece filled in part is kept)."""
    import ctypes

    torch = _torch()
    source = torch.frombuffer((ctypes.c_char * take).from_address(address), dtype=torch.uint8)
    size = piece.numel() * piece.element_size()
    if take < size:  # the block ends inside this piece: its other bytes stay as they are
        whole = piece.resolve_conj().resolve_neg().to("cpu", memory_format=torch.contiguous_format, copy=True)
        whole.reshape(-1).view(torch.uint8)[:take].copy_(source)
        piece.copy_(whole)
        return
    if address % piece.element_size():
        source = source.clone()  # (aligned for the element type)
    piece.copy_(source.view(piece.dtype).view(piece.shape))


async def finish_in_thread(work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)`` on a thread, awaited. Cancelled meanwhile, it waits for ``work`` to end before the
    cancellation goes on: what ``work`` reads or writes (a reply's leased descriptors, the staging buffer,
    the caller's tensors) must not be let go, reused or handed back to the caller while it still runs."""
    import asyncio

    job = asyncio.ensure_future(asyncio.to_thread(work, *args))
    try:
        return await asyncio.shield(job)
    finally:
        while not job.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([job])


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# A call is written once, as a generator of steps: it yields what it needs done (a request, a request
# after a copy into the staging buffer, or blocking work; or a request sent ahead, and later its reply)
# and is sent the result. BlockSpace runs the steps on the blocking client, AsyncBlockSpace awaits them
# on the async one; a request sent ahead whose reply the steps never took is abandoned (its descriptors
# closed) when they end.
_CALL, _STAGED, _WORK, _SEND, _RECEIVE = "call", "staged", "work", "send", "receive"
Step = tuple[str, Any, int, Any]
Steps = Generator[Step, Any, Any]


class _Space:
    """What both flavours share: the space, its request bodies, the keys and every call's steps."""

    def __init__(self, model: str, state: str, namespace: str, block_tokens: int) -> None:
        self.space = block_space(model, state, namespace, block_tokens)
        self.model, self.state, self.namespace, self.block_tokens = model, state, namespace, block_tokens
        self._base = {"model": model, "state": state, "namespace": namespace, "block_tokens": block_tokens}

    def keys(self, tokens: Any) -> list[bytes]:
        """skippyd's chained keys of ``tokens``: one per WHOLE block (a trailing partial block has none)."""
        return block_keys(self.space, encode_tokens(tokens))

    def _body(self, op: str, keys: list[bytes], **more: Any) -> dict[str, Any]:
        return {"op": op, **self._base, "keys": keys, **more}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.model!r}, state={self.state!r}, "
            f"namespace={self.namespace!r}, block_tokens={self.block_tokens})"
        )

    def _ask(self, body: dict[str, Any]) -> Generator[Step, Any, dict[str, Any]]:
        reply, fds = yield (_CALL, body, 0, None)
        _close(fds)
        return dict(reply)

    def _contains_steps(self, keys: Sequence[bytes]) -> Steps:
        listed = _check_keys(keys)
        held = 0
        for start in range(0, len(listed), MAX_KEYS_PER_REQUEST):
            part = listed[start : start + MAX_KEYS_PER_REQUEST]
            count = int((yield from self._ask(self._body("blocks_contains", part)))["count"])
            held += count
            if count < len(part):
                break
        return held

    def _held_steps(self, keys: Sequence[bytes]) -> Steps:
        listed = _check_keys(keys)
        held: list[bool] = []
        for start in range(0, len(listed), MAX_KEYS_PER_REQUEST):
            part = listed[start : start + MAX_KEYS_PER_REQUEST]
            reply = yield from self._ask(self._body("blocks_contains", part, each=True))
            held += [bool(b) for b in reply["held"]]
        return held

    def _put_steps(
        self, keys: Sequence[bytes], data: Sequence[Any], durable: Any, parent: bytes | None
    ) -> Steps:
        listed = _check_keys(keys)
        if len(data) != len(listed):
            raise InvalidArgument(f"{len(listed)} keys but {len(data)} blocks of data")
        if parent is not None:
            _check_keys([parent])
        mode = _check_durable(durable)
        views = [_block_parts(item) for item in data]
        sizes = [sum(_part_bytes(piece) for piece in pieces) for pieces in views]
        held = [False] * len(listed)
        if len(listed) > 1:  # ask which are held first, so only the others are copied
            held = yield from self._held_steps(listed)
        limit = yield (_WORK, None, 0, None)  # the staging limit, from the handshake
        parts = []
        for batch in _plan_batches(sizes, held, limit):
            body = self._body(
                "blocks_put", listed[batch.start : batch.stop], sizes=sizes[batch.start : batch.stop],
                offsets=batch.offsets, durable=mode,
                parent=listed[batch.start - 1] if batch.start else parent,
            )  # fmt: skip
            jobs = [(offset, views[batch.start + i]) for i, offset in enumerate(batch.offsets) if offset >= 0]
            if batch.size:
                parts.append((yield (_STAGED, body, batch.size, partial(_write_blocks, jobs=jobs))))
            else:  # every block of it is held: nothing to copy
                parts.append((yield from self._ask(body)))
        return _sum_puts(parts)

    def _get_steps(
        self, keys: Sequence[bytes], out: Sequence[Any] | None, pages: PageLayout | None = None
    ) -> Steps:
        """Served blocks mapped (``out`` None: the tensors) or read into ``out`` (the count).

        A long get is several requests, each sent before the reply in hand is read into ``out`` (or
        mapped): the daemon leases the next blocks while the client copies these (or queues their DMA).
        The first asks for :data:`_FIRST_GET` keys, so the first copies start early; each next one for
        twice what the last served, up to 8192 (a reply carries at most ``MAX_FDS``, 64, slab
        descriptors)."""
        listed = _check_keys(keys)
        if out is not None and len(out) < len(listed):
            raise InvalidArgument(f"{len(listed)} keys but only {len(out)} destinations")
        tensors: list[Any] = []
        done = 0
        # a device's copies keep registrations: its replies say which slots were punched since
        more: dict[str, Any] = {"max_fds": MAX_FDS}  # (a slab a descriptor: fewer round trips)
        if _device_bound(out, pages):
            more["slot_maps"] = True
        asked = min(len(listed), _FIRST_GET)
        ahead = (yield (_SEND, self._body("blocks_get", listed[:asked], **more), 0, None)) if asked else None
        while ahead is not None:
            reply, fds = yield (_RECEIVE, ahead, 0, None)
            ahead = None
            try:
                served = _served(reply)
                end = done + served
                # the next request, before this reply is read: all asked were served (more may follow),
                # or fewer but the run goes on (the reply was full)
                if served and end < len(listed) and (served >= asked or int(reply.get("held", 0)) > served):
                    asked = min(len(listed) - end, 2 * served, MAX_KEYS_PER_REQUEST)
                    body = self._body("blocks_get", listed[end : end + asked], **more)
                    ahead = yield (_SEND, body, 0, None)
                if out is None:
                    got = _map_blocks(reply, fds)
                    tensors += got
                    count = len(got)
                elif pages is not None:
                    count = yield (_WORK, partial(_read_pages, reply, fds, pages, done), 0, None)
                else:
                    count = yield (_WORK, partial(_read_blocks, reply, fds, out, done), 0, None)
            finally:
                _close(fds)
            done += count
        return tensors if out is None else done


_FIRST_GET = 64  # keys the first blocks_get of a long get asks for


def _device_bound(out: Sequence[Any] | None, pages: PageLayout | None) -> bool:
    """Whether a get's copies go to a device (judged by its first destination: the transfer layer
    keeps registrations of what they read)."""
    if pages is not None:
        device = pages.device
    else:
        first = out[0] if out is not None and len(out) else None  # a 2-D tensor or array has no truth
        if isinstance(first, list | tuple):
            first = first[0] if first else None
        device = getattr(first, "device", None)
    return device is not None and (getattr(device, "type", None) == "cuda" or _CPU_AS_DEVICE)


def _served(reply: dict[str, Any]) -> int:
    """How many blocks a ``blocks_get`` reply serves (its placements are checked where they are read)."""
    blocks = reply.get("blocks")
    if not isinstance(blocks, list):
        raise BadFrame("a blocks_get reply without its blocks")
    return len(blocks)


def _check_durable(durable: Any) -> bool | str:
    if isinstance(durable, bool) or durable == "sync":
        return durable  # type: ignore[no-any-return]
    raise InvalidArgument('durable must be True, False or "sync"')


def _sum_puts(parts: list[dict[str, Any]]) -> BlocksPut:
    # A part that stored nothing and found nothing held says nothing about durability. Otherwise the
    # weakest answer stands: "written" only when every part's blocks are on disk ("none" beats it).
    named = [p for p in parts if int(p.get("stored", 0)) or int(p.get("present", 0))] or parts
    durabilities = [str(p.get("durability", "none")) for p in named]
    order = ("deferred", "pending", "queued", "none", "written")
    durability = next((d for d in order if d in durabilities), "none")
    return BlocksPut(
        stored=sum(int(p["stored"]) for p in parts),
        present=sum(int(p["present"]) for p in parts),
        nbytes=sum(int(p["nbytes"]) for p in parts),
        skipped=sum(int(p.get("skipped", 0)) for p in parts),
        durability=durability,
    )


Call = Callable[[dict[str, Any]], tuple[dict[str, Any], list[int]]]
Staged = Callable[[dict[str, Any], int, Callable[[memoryview], None]], dict[str, Any]]


class BlockSpace(_Space):
    """Blocks of one identity and block size on a :class:`~skippyd.client.Client` (see the module)."""

    def __init__(
        self,
        call: Call,
        staged: Staged,
        staging_max: Callable[[], int],
        *,
        ahead: tuple[Callable[[dict[str, Any]], Any], Callable[[Any], tuple[dict[str, Any], list[int]]],
                     Callable[[Any], None]] | None = None,
        **space: Any,
    ) -> None:  # fmt: skip
        super().__init__(**space)
        self._call, self._staged, self._staging_max = call, staged, staging_max
        self._ahead = ahead

    def _run(self, steps: Steps) -> Any:
        result: Any = None
        sent: list[Any] = []  # requests sent ahead whose replies were not taken yet
        try:
            while True:
                kind, what, size, write = steps.send(result)
                if kind == _CALL:
                    result = self._call(what)
                elif kind == _STAGED:
                    result = self._staged(what, size, write)
                elif kind == _SEND:
                    result = what if self._ahead is None else self._ahead[0](what)
                    sent.append(result)
                elif kind == _RECEIVE:
                    sent.remove(what)
                    result = self._call(what) if self._ahead is None else self._ahead[1](what)
                else:
                    result = self._staging_max() if what is None else what()
        except StopIteration as done:
            return done.value
        finally:
            for ahead in sent:
                if self._ahead is not None:
                    self._ahead[2](ahead)

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many LEADING keys are held (in L2 or L3)."""
        return int(self._run(self._contains_steps(keys)))

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held (L2 or L3), in one request per 8192 keys: what an engine asks about
        keys that are not one chain (another group's, or out of order)."""
        result: list[bool] = self._run(self._held_steps(keys))
        return result

    def put(
        self,
        keys: Sequence[bytes],
        data: Sequence[Any],
        *,
        durable: bool | str = True,
        parent: bytes | None = None,
    ) -> BlocksPut:
        """Stores ``data[i]`` (a tensor of any dtype/device, or a buffer) as the block of ``keys[i]``, in
        chain order; held blocks are left as they are. ``parent``: the key of the block before ``keys[0]``
        when the put continues a chain (so eviction knows the chain)."""
        result: BlocksPut = self._run(self._put_steps(keys, data, durable, parent))
        return result

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The leading held blocks as 1-D uint8 tensors: views of shared memory, no copy (private
        copy-on-write mappings: a write never reaches the store)."""
        result: list[torch.Tensor] = self._run(self._get_steps(keys, None))
        return result

    def get_into(self, keys: Sequence[bytes], out: Sequence[Any]) -> int:
        """Copies the leading held blocks into ``out[i]`` (a tensor on any device or a writable buffer of at
        least the block's size, or a list of them that the block's bytes fill in order, as ``put``'s
        pieces: a page scattered over an engine's layers); returns how many."""
        return int(self._run(self._get_steps(keys, out)))

    def get_into_pages(self, keys: Sequence[bytes], planes: Any, pages: Any) -> int:
        """Copies the leading held blocks into their pages of an engine's pools; returns how many. Block
        ``i``'s bytes fill ``planes[0][pages[i]]``, then ``planes[1][pages[i]]``, ... (each plane a tensor
        whose first axis is the page, each page's bytes contiguous; ``pages[i]`` one page number, or a row
        of them: the block's pages in each plane, in order): what ``get_into(keys, [[plane[p] for plane
        in planes for p in pages[i]] ...])`` does, planned as arrays instead of per piece (see
        :mod:`skippyd.client.transfer.pages`; on a GPU, small pages go through a device staging buffer)."""
        layout = _page_layout(planes, pages, keys)
        return int(self._run(self._get_steps(keys, LazyPieces(layout), layout)))

    def put_pages(
        self,
        keys: Sequence[bytes],
        planes: Any,
        pages: Any,
        *,
        durable: bool | str = True,
        parent: bytes | None = None,
    ) -> BlocksPut:
        """Stores the blocks whose bytes are their pages in ``planes`` (as :meth:`get_into_pages` lays them
        out): ``put`` with each block's pages as its pieces; small CUDA pages are gathered on the device
        first (at most 256 MiB of blocks a ``put``), so each run of blocks is one DMA to the host."""
        layout = _page_layout(planes, pages, keys, unique=False)
        listed = _check_keys(keys)
        parts = [
            self.put(listed[start:stop], data, durable=durable, parent=listed[start - 1] if start else parent)
            for start, stop, data in _page_puts(layout, len(listed))
        ]
        return _sum_puts_of(parts)


_GATHER_PUT_BYTES = 256 << 20  # small CUDA pages a put_pages gathers on the device at a time
_GATHER_ROW = 512 << 10  # ... when a block's pages are smaller than this on average


def _page_puts(layout: PageLayout, count: int) -> Iterator[tuple[int, int, Sequence[Any]]]:
    """The puts of ``put_pages``: ``(start, stop, data)``; one with the pages as pieces, or, for small
    pages on a CUDA device, blocks gathered on the device ``_GATHER_PUT_BYTES`` at a time."""
    device = layout.device
    pieces = len(layout.rows) * layout.pages_per_block
    small = layout.capacity < _GATHER_ROW * pieces
    if not count or device is None or not small or not (device.type == "cuda" or _CPU_AS_DEVICE):
        yield 0, count, LazyPieces(layout)
        return
    from .transfer.device import gather_pages

    per = max(1, _GATHER_PUT_BYTES // max(1, layout.capacity))
    for start in range(0, count, per):
        stop = min(count, start + per)
        yield start, stop, list(gather_pages(layout, start, stop).unbind(0))


def _sum_puts_of(parts: list[BlocksPut]) -> BlocksPut:
    return parts[0] if len(parts) == 1 else _sum_puts([dataclasses.asdict(part) for part in parts])


def _page_layout(planes: Any, pages: Any, keys: Sequence[bytes], *, unique: bool = True) -> PageLayout:
    _torch()  # (the planes are tensors)
    return PageLayout(planes, pages, len(_check_keys(keys)), unique=unique)


AsyncCall = Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], list[int]]]]
AsyncStaged = Callable[[dict[str, Any], int, Callable[[memoryview], None]], Awaitable[dict[str, Any]]]


class AsyncBlockSpace(_Space):
    """The same calls as :class:`BlockSpace`, as coroutines, on an :class:`~skippyd.client.AsyncClient`."""

    def __init__(
        self,
        call: AsyncCall,
        staged: AsyncStaged,
        staging_max: Callable[[], Awaitable[int]],
        *,
        ahead: tuple[Callable[[dict[str, Any]], Any],
                     Callable[[Any], Awaitable[tuple[dict[str, Any], list[int]]]],
                     Callable[[Any], None]] | None = None,
        **space: Any,
    ) -> None:  # fmt: skip
        super().__init__(**space)
        self._call, self._staged, self._staging_max = call, staged, staging_max
        self._ahead = ahead

    async def _run(self, steps: Steps) -> Any:
        result: Any = None
        sent: list[Any] = []  # requests sent ahead whose replies were not taken yet
        try:
            while True:
                kind, what, size, write = steps.send(result)
                if kind == _CALL:
                    result = await self._call(what)
                elif kind == _STAGED:
                    result = await self._staged(what, size, write)
                elif kind == _SEND:
                    result = what if self._ahead is None else self._ahead[0](what)
                    sent.append(result)
                elif kind == _RECEIVE:
                    # (taken off ``sent`` once it is in hand: a reply that came as this was cancelled is
                    # abandoned below, its descriptors closed)
                    result = await (self._call(what) if self._ahead is None else self._ahead[1](what))
                    sent.remove(what)
                else:
                    # (a copy to or from a GPU stays ordered against the caller's current stream)
                    work = in_callers_streams(what) if what is not None else None
                    # (cancelled mid-copy: the copy ends before the reply's descriptors are closed)
                    result = await self._staging_max() if work is None else await finish_in_thread(work)
        except StopIteration as done:
            return done.value
        finally:
            for ahead in sent:
                if self._ahead is not None:
                    self._ahead[2](ahead)

    async def contains(self, keys: Sequence[bytes]) -> int:
        """As :meth:`BlockSpace.contains`."""
        return int(await self._run(self._contains_steps(keys)))

    async def held(self, keys: Sequence[bytes]) -> list[bool]:
        """As :meth:`BlockSpace.held`."""
        result: list[bool] = await self._run(self._held_steps(keys))
        return result

    async def put(
        self,
        keys: Sequence[bytes],
        data: Sequence[Any],
        *,
        durable: bool | str = True,
        parent: bytes | None = None,
    ) -> BlocksPut:
        """As :meth:`BlockSpace.put`; the copies into the staging buffer run in a thread."""
        result: BlocksPut = await self._run(self._put_steps(keys, data, durable, parent))
        return result

    async def get(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """As :meth:`BlockSpace.get`."""
        result: list[torch.Tensor] = await self._run(self._get_steps(keys, None))
        return result

    async def get_into(self, keys: Sequence[bytes], out: Sequence[Any]) -> int:
        """As :meth:`BlockSpace.get_into`; the reads run in a thread."""
        return int(await self._run(self._get_steps(keys, out)))

    async def get_into_pages(self, keys: Sequence[bytes], planes: Any, pages: Any) -> int:
        """As :meth:`BlockSpace.get_into_pages`; the reads run in a thread."""
        layout = _page_layout(planes, pages, keys)
        return int(await self._run(self._get_steps(keys, LazyPieces(layout), layout)))

    async def put_pages(
        self,
        keys: Sequence[bytes],
        planes: Any,
        pages: Any,
        *,
        durable: bool | str = True,
        parent: bytes | None = None,
    ) -> BlocksPut:
        """As :meth:`BlockSpace.put_pages`."""
        layout = _page_layout(planes, pages, keys, unique=False)
        listed = _check_keys(keys)
        parts = []
        for start, stop, data in _page_puts(layout, len(listed)):
            before = listed[start - 1] if start else parent
            parts.append(await self.put(listed[start:stop], data, durable=durable, parent=before))
        return _sum_puts_of(parts)
