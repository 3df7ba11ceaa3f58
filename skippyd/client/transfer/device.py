"""CUDA copies between skippyd's shared memory and device tensors (client side; imports torch).

What it stands on: :mod:`.cuda` (which device a caller means, registration, the batched copy, events),
:mod:`.filemaps` (kept mappings of the daemon's files, through descriptions that hold no lease) and
:mod:`.leases` (the reply descriptors held until a copy's event has passed).

* :class:`DeviceTransfer` registers the ranges a copy needs with ``cudaHostRegister`` once per entry
  file generation or slot generation (:class:`~skippyd.client.transfer.book.RegistrationBook`: a punched slot
  re-registers only the ranges over it, waiting only for the copies in flight that read those ranges),
  merges the copies into runs
  (:mod:`~skippyd.client.transfer.plan`), and issues them on skippyd's own stream per device and direction:
  one ``cuMemcpyBatchAsync`` call (``cuda-bindings``, the ``gpu`` extra) or one ``copy_`` per run.

  - host → device (restore, ``get_into``): returns once the copies are queued; the caller's current
    stream waits on skippyd's event, and the reply's leases stay open until the event has passed.
  - device → host (capture, put): the copies go straight into the registered staging buffer; returns
    once they have landed (the daemon reads the buffer next; the source may then change).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from skippyd.errors import BadFrame, InvalidArgument, Mismatch

from .book import Register, RegistrationBook, SlotMap
from .cuda import (
    _SRC_ACCESS_ORDER_STREAM,
    _batch_function,
    _cuda_register,
    _cuda_unregister,
    _current_context_of,
    _event,
    _make_current,
    _MemcpyAttributes,
    batch_available,
    resolve_device,
)
from .filemaps import _LOOK_EVERY_CALL, FileMaps, _address_of, _Mapped, slab_slot_map
from .leases import _Leases
from .limits import kept_files, pin_limit
from .pages import PageLayout
from .plan import Flat, Run, page_spans, page_spans_of, plan_runs, split_runs

__all__ = [
    "DeviceTransfer",
    "FileMaps",
    "Layered",
    "batch_available",
    "release_host",
    "resolve_device",
    "slab_slot_map",
    "transfer",
]

log = logging.getLogger("skippyd.client.transfer")


# ---------------------------------------------------------------- the transfer


# A copy of one transfer: (source, offset, destination, offset, bytes, offset of its bytes in their block)
_Piece = tuple[Hashable, int, Any, int, int, int]
# What one source needs registered: (source, file generation, base, spans, each span's slot generation or
# None for a file that is one unit, the slab's slot map or None)
_Need = tuple[Hashable, int, int, list[tuple[int, int]], list[int] | None, SlotMap | None]
# A strided destination: (tensor, staging buffer, offset in it, bytes it takes, offset in its block). Its
# bytes land in a device staging buffer by DMA, then one copy_ on skippyd's stream lays them into it.
_Scatter = tuple[torch.Tensor, Any, int, int, int]


@dataclass(slots=True)
class _Part:
    pieces: list[_Piece]
    hosts: dict[Hashable, _Mapped]
    dests: dict[Any, torch.Tensor]
    needs: list[_Need]
    leases: list[int]  # duplicated descriptors: ours to close
    scatters: list[_Scatter]


class Layered:
    """Copies collected by :meth:`DeviceTransfer.layered` and, once issued, one event per span."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans
        self.parts: list[_Part] = []
        self.events: list[Any] = []
        self.device: torch.device | None = None
        self.pinned: list[Hashable] = []  # the mappings its parts use, kept until they are issued

    def add(  # noqa: PLR0917 - one reply's copies, as pieces_to_device prepared them
        self,
        pieces: list[_Piece],
        hosts: dict[Hashable, _Mapped],
        dests: dict[Any, torch.Tensor],
        needs: list[_Need],
        leases: list[int],
        device: torch.device,
        scatters: list[_Scatter] | None = None,
    ) -> None:
        if self.device is not None and device != self.device:
            raise InvalidArgument("the CUDA destinations of one layered get must be on one device")
        self.device = device
        self.parts.append(_Part(pieces, hosts, dests, needs, [os.dup(fd) for fd in leases], scatters or []))

    def take_leases(self) -> list[int]:
        leases = [fd for part in self.parts for fd in part.leases]
        for part in self.parts:
            part.leases = []
        return leases

    def release(self) -> None:
        for fd in self.take_leases():
            with contextlib.suppress(OSError):
                os.close(fd)


#: Seconds without a call after which :func:`_sweep_while_idle` looks (then as often, while idle).
_IDLE_SWEEP = 1.0
#: cuMemcpyBatchAsync's answers that mean this driver cannot do it (invalid value, not supported): copies
#: go one per run from then on. Any other error makes only that transfer go run by run.
_BATCH_REFUSALS = frozenset({1, 801})


def _sweep_while_idle(ref: weakref.ref[DeviceTransfer], closed: threading.Event) -> None:
    """The idle sweeper's thread (:meth:`DeviceTransfer.sweep_idle`): looks every ``idle_sweep`` s and
    sweeps where no call came for as long; ends with its transfer (closed, or collected: it holds only a
    weak reference)."""
    failed = False
    while True:
        transfer = ref()
        if transfer is None:
            return
        every = transfer.idle_sweep
        del transfer
        if closed.wait(every):
            return
        transfer = ref()
        if transfer is None:
            return
        try:
            if time.monotonic() - transfer._last_call >= transfer.idle_sweep:
                transfer.sweep_idle()
        except Exception as exc:  # (never a reason for the thread to die: the next call sweeps too)
            if not failed:
                failed = True
                log.warning("the idle sweep failed (%s); calls still sweep", exc)
        del transfer


def _storage_base(tensor: torch.Tensor) -> tuple[int, int]:
    """``(storage address, byte offset of the tensor in it)``."""
    base = tensor.untyped_storage().data_ptr()
    return base, tensor.data_ptr() - base


def _bytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DeviceTransfer:
    """Host ↔ CUDA copies through registered shared memory (one per process: :func:`transfer`).
    Thread-safe (one transfer at a time)."""

    def __init__(
        self,
        *,
        register: Register | None = None,
        unregister: Callable[[int], None] | None = None,
        limit_bytes: int | None = None,
        maps: int | None = None,
        batch: bool = True,
    ) -> None:
        """``limit_bytes`` registered and ``maps`` kept files at most (defaults: :mod:`.limits`: 64 GiB
        and 256, or ``SKIPPYD_PIN_LIMIT`` / ``SKIPPYD_KEPT_FILES``)."""
        limit_bytes = pin_limit() if limit_bytes is None else limit_bytes
        maps = kept_files() if maps is None else maps
        undo = unregister or _cuda_unregister

        def unregister_idle(address: int) -> None:  # never under a copy still in flight that reads it
            self._leases.drain_for(address)
            undo(address)

        self.book = RegistrationBook(register or _cuda_register, unregister_idle, limit_bytes=limit_bytes)
        self.maps = FileMaps(self._forget_file, maps)
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self._leases = _Leases()
        self._lock = threading.RLock()
        self._local = threading.local()  # a layered collection in progress on this thread
        self._use_batch = batch
        self._punch_swept = time.monotonic()  # when the kept slabs' records were last read
        self._released: deque[tuple[mmap.mmap, tuple[int, ...]]] = deque()  # (release_later)
        self.idle_sweep = _IDLE_SWEEP  # seconds without a call after which the sweeper looks
        self._last_call = time.monotonic()
        self._device_index: int | None = None  # the CUDA device of the last call (the sweeper's)
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.copies = 0  # runs issued (for tests and benchmarks)
        self.calls = 0  # batch calls or copy_ calls issued

    # ------------------------------------------------------------ plumbing
    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        key = (int(device.index or 0), direction)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _forget_file(self, key: Hashable) -> None:
        """A mapping is about to go: the copies in flight end first (one may read it), then its ranges
        are unregistered."""
        self._leases.drain()
        self.book.drop(key)

    def _hold(
        self, event: Any, fds: Sequence[int], registrations: set[int] | None = None, stream: Any = None
    ) -> None:
        # a duplicate keeps the description's locks (made once the copies in flight leave room for it)
        self._leases.room(len(fds))
        self._leases.hold(event, [os.dup(fd) for fd in fds], registrations, stream)

    @property
    def in_flight(self) -> int:
        """Copies whose leases are still held (their event has not been seen to pass)."""
        return len(self._leases)

    def drain(self) -> None:
        """Waits until every copy issued so far has landed and its leases are closed."""
        self._leases.drain()

    def _issue(
        self,
        runs: Sequence[Run],
        address: Callable[[Any, int], int],
        view: Callable[[Any, int, int], torch.Tensor],
        stream: torch.cuda.Stream,
    ) -> None:
        """Issues ``runs`` on ``stream``: one batch call, or one ``copy_`` per run."""
        if not runs:
            return
        self.copies += len(runs)
        dst = [address(r.dst, r.dst_offset) for r in runs]
        src = [address(r.src, r.src_offset) for r in runs]
        if self._issue_batch(dst, src, [r.nbytes for r in runs], stream):
            return
        with torch.cuda.stream(stream):
            for run in runs:
                view(run.dst, run.dst_offset, run.nbytes).copy_(
                    view(run.src, run.src_offset, run.nbytes), non_blocking=True
                )
                self.calls += 1

    def _issue_batch(self, dst: Any, src: Any, size: Any, stream: torch.cuda.Stream) -> bool:
        """Issues one transfer's copies (their destination addresses, source addresses and sizes: lists
        or integer arrays) as one ``cuMemcpyBatchAsync`` on ``stream``: True once issued; False where the
        driver has none, or refused this one (then one copy per run, from now on), and the caller issues
        them itself."""
        function = _batch_function() if self._use_batch else None
        if function is None:
            return False
        count = len(size)
        array = ctypes.c_uint64 * count  # (over numpy copies, writable whatever was given: no object a copy)
        dsts = array.from_buffer(np.array(dst, dtype=np.uint64).data)
        srcs = array.from_buffer(np.array(src, dtype=np.uint64).data)
        sizes = array.from_buffer(np.array(size, dtype=np.uint64).data)
        attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        index, failed = ctypes.c_size_t(0), ctypes.c_size_t(0)
        with _current_context_of(stream):
            err = function(
                dsts, srcs, sizes, count, ctypes.addressof(attrs), ctypes.byref(index), 1,
                ctypes.byref(failed), stream.cuda_stream,
            )  # fmt: skip
        self.calls += 1
        if err == 0:
            return True
        where = f" at copy {failed.value}" if failed.value < count else ""
        if err in _BATCH_REFUSALS:  # the driver cannot do it at all: never asked again
            log.warning(
                "cuMemcpyBatchAsync refused (CUresult %d%s): one copy per run from now on", err, where
            )
            self._use_batch = False
        else:  # (an error an earlier launch left, or a passing one: this transfer alone goes run by run)
            log.warning(
                "cuMemcpyBatchAsync failed (CUresult %d%s): this transfer one copy per run", err, where
            )
        return False

    # ------------------------------------------------------------ host → device
    def entry_to_device(
        self,
        fd: int,
        generation: int,
        data_offset: int,
        data_len: int,
        device: torch.device,
    ) -> torch.Tensor | None:
        """The entry's data region as one uint8 tensor on ``device``, its copy queued (the current stream
        waits for it); None when the file is not one to map and register (generation 0: served once)."""
        if generation == 0:
            return None
        with self._lock:
            self._begin(device)
            self.maps.sweep()
            found = self.maps.get(fd, data_offset + data_len)
            if found is None:
                return None
            key, mapped = found
            target = torch.empty(data_len, dtype=torch.uint8, device=device)
            if data_len == 0:
                return target
            cuts = self.book.ensure(key, generation, mapped.base, [(data_offset, data_offset + data_len)],
                                    readonly=True)  # fmt: skip
            runs = [Run(key, data_offset, "target", 0, data_len)]
            if cuts is not None:
                runs = split_runs(runs, {key: cuts})
            self._to_device(runs, {key: mapped}, {"target": target}, device, [fd])
            return target

    def blocks_to_device(
        self,
        placements: Sequence[tuple[int, int, int]],
        fds: Sequence[int],
        generations: Sequence[int],
        outs: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        *,
        slot_generations: Sequence[int] | None = None,
    ) -> bool:
        """Copies block ``i`` (``placements[i]``: descriptor index, offset, size) into ``outs[i]`` (a CUDA
        tensor of at least its size, or a list of them that its bytes fill in order; any strides; one
        device), queued on skippyd's stream; False when a descriptor is not one to map and register (the
        caller copies another way)."""
        pieces: list[tuple[int, int, int, torch.Tensor]] = []
        for block, ((_, _, nbytes), out) in enumerate(zip(placements, outs, strict=True)):
            at = 0
            for tensor in out if isinstance(out, list | tuple) else (out,):
                take = min(_bytes_of(tensor), nbytes - at)
                if take > 0:
                    pieces.append((block, at, take, tensor))
                    at += take
            if at < nbytes:
                raise Mismatch(f"a destination holds {at} bytes; its block has {nbytes}")
        return self.pieces_to_device(placements, fds, generations, pieces, slot_generations=slot_generations)

    def pieces_to_device(
        self,
        placements: Sequence[tuple[int, int, int]],
        fds: Sequence[int],
        generations: Sequence[int],
        pieces: Sequence[tuple[int, int, int, torch.Tensor]],
        *,
        slot_generations: Sequence[int] | None = None,
        slot_maps: Sequence[SlotMap | None] | None = None,
    ) -> bool:
        """Copies bytes ``[at, at + take)`` of block ``block`` into each ``(block, at, take, tensor)`` of
        ``pieces`` (CUDA tensors of one device: a contiguous one gets its bytes by DMA, merged with the
        pieces it continues in the slab and in device memory; a strided, conjugate or negative one gets
        them in a device staging buffer, then one ``copy_`` into it, in its logical order as ``put`` lays
        it out), queued on skippyd's stream; False when a descriptor is not one to map and register.
        ``slot_generations`` (one per placement, the reply's): registrations are kept and renewed per slot;
        without it, per descriptor (``generations``). ``slot_maps`` (one per descriptor, the reply's):
        registrations of the slabs' punched slots are dropped, read now or not."""
        if not pieces:
            return True
        device = pieces[0][3].device
        with self._lock:
            self._begin(device)
            collecting: Layered | None = getattr(self._local, "layered", None)
            found = self._sources(
                placements, fds, generations, slot_generations, slot_maps, every=collecting is not None
            )
            if found is None:
                return False
            needs, keys, hosts, leases = found
            if collecting is not None:  # issued layer by layer when the collection ends
                copies, dests, scatters = _prepare(pieces, placements, keys, device)
                used = list(keys.values())
                self.maps.pinned.update(used)
                collecting.pinned.extend(used)
                collecting.add(copies, hosts, dests, needs, leases, device, scatters)
                return True
            cuts = self._register(needs)
            # Issued a chunk at a time, so the first bytes move while the next pieces are planned.
            for chunk in _chunks(pieces):
                copies, dests, scatters = _prepare(chunk, placements, keys, device)
                flat, reads, buffers = self._flatten(copies, hosts, dests, cuts)
                self._to_device_flat(flat, reads, buffers, dests, device, leases, scatters, hosts)
            return True

    def sweep_punched(self, every: float = 1.0) -> None:
        """Drops the registrations of punched slots in every slab kept mapped and registered, read from
        the slabs' own records (so also in slabs no reply names any more: their old pages would stay
        pinned outside the daemon's budget); at most every ``every`` s, spaced out past 256 slabs as the
        sweep of removed files is (each slab whose generations did not move costs one look); with
        ``every=0``, now."""
        with self._lock:
            now = time.monotonic()
            if every and now - self._punch_swept < max(every, 0.1 * len(self.maps) / _LOOK_EVERY_CALL):
                return
            self._punch_swept = now
            for key in self.book.slotted():
                mapped = self.maps.peek(key)
                found = None if mapped is None else slab_slot_map(mapped.host.numpy())
                if found is not None:
                    self.book.drop_punched(key, found)

    def _sources(
        self,
        placements: Sequence[tuple[int, int, int]],
        fds: Sequence[int],
        generations: Sequence[int],
        slot_generations: Sequence[int] | None,
        slot_maps: Sequence[SlotMap | None] | None = None,
        *,
        every: bool = False,
    ) -> tuple[list[_Need], dict[int, Hashable], dict[Hashable, _Mapped], list[int]] | None:
        """What a reply's copies read: what each descriptor needs registered, its mapping's key by
        descriptor index, the mappings, the descriptors to hold as leases; None when a descriptor is not
        one to map and register (a memfd read once, a slot lent for the reply). ``every``: a long
        layered get, whose kept mappings are swept at most every 0.1 s instead of at each reply."""
        self.maps.sweep(every=0.1 if every else 0.0)
        self.sweep_punched()
        sources: dict[int, tuple[Hashable, _Mapped]] = {}
        ends: dict[int, int] = {}
        few = len(placements) <= 64  # (a few blocks: numpy's fixed cost is more than the loop)
        if few:
            for index, offset, nbytes in placements:
                ends[index] = max(ends.get(index, 0), offset + nbytes)
        else:
            table = np.asarray(placements, dtype=np.int64).reshape(-1, 3)
            column, end_of = table[:, 0], table[:, 1] + table[:, 2]
            found_at = np.unique(column, return_index=True)
            for index in found_at[0][np.argsort(found_at[1])].tolist():  # (in the reply's order)
                ends[index] = (
                    int(end_of[column == index].max()) if len(found_at[0]) > 1 else int(end_of.max())
                )
        for index, end in ends.items():
            if not 0 <= index < len(fds) or index >= len(generations):
                raise BadFrame("a blocks_get reply names a descriptor it did not carry")
            if generations[index] == 0:
                return None
            found = self.maps.get(fds[index], end, needed=[key for key, _ in sources.values()])
            if found is None:
                return None
            sources[index] = found
        if slot_generations is not None and len(slot_generations) != len(placements):
            raise BadFrame("a blocks_get reply's slot generations do not match its blocks")
        if slot_generations is not None and not all(slot_generations):  # (a slot lent for this reply)
            return None
        # what each descriptor's registrations must cover: its blocks' pages, consecutive slots of one
        # generation as one span (the book's work is per span)
        needs: list[_Need] = []
        if few:
            starts_of: dict[int, list[int]] = {index: [] for index in sources}
            ends_of: dict[int, list[int]] = {index: [] for index in sources}
            gens_of: dict[int, list[int]] = {index: [] for index in sources}
            for n, (index, offset, nbytes) in enumerate(placements):
                starts_of[index].append(offset)
                ends_of[index].append(offset + nbytes)
                if slot_generations is not None:
                    gens_of[index].append(int(slot_generations[n]))
            for index, (source, mapped) in sources.items():
                slots = None if slot_generations is None else gens_of[index]
                spans, gens = page_spans(starts_of[index], ends_of[index], slots)
                needs.append((
                    source, generations[index], mapped.base, spans, None if slots is None else gens,
                    None if slots is None or slot_maps is None else slot_maps[index],
                ))  # fmt: skip
        else:
            slot_gens = None if slot_generations is None else np.asarray(slot_generations, dtype=np.int64)
            spans_of = page_spans_of(column, table[:, 1], end_of, slot_gens)  # (every slab in one pass)
            for index, (source, mapped) in sources.items():
                spans, gens = spans_of.get(index, ([], []))
                needs.append((
                    source, generations[index], mapped.base, spans, None if slot_gens is None else gens,
                    None if slot_gens is None or slot_maps is None else slot_maps[index],
                ))  # fmt: skip
        keys = {index: key for index, (key, _) in sources.items()}
        return needs, keys, dict(sources.values()), [fds[i] for i in sources]

    def pages_to_device(
        self,
        placements: Sequence[tuple[int, int, int]],
        fds: Sequence[int],
        generations: Sequence[int],
        layout: PageLayout,
        first: int,
        *,
        slot_generations: Sequence[int] | None = None,
        slot_maps: Sequence[SlotMap | None] | None = None,
    ) -> bool:
        """Copies the reply's blocks into their pages (``layout``'s rows ``first``, ``first + 1``, ...:
        CUDA planes of one device), planned as arrays: where the pieces are large (at least
        ``_GATHER_BELOW`` a run once merged) one DMA per run straight into the pages; where they are small
        (a page's rows of one layer are often a few KiB), one DMA per run of whole blocks into a device
        staging buffer and one ``index_put_`` a plane on skippyd's stream scatters them into the pages.
        Queued on skippyd's stream, as :meth:`pieces_to_device`; False when a descriptor is not one to map
        and register, or inside :meth:`layered` (the caller then names the pages as pieces)."""
        if not placements:
            return True
        device = layout.device
        assert device is not None
        with self._lock:
            self._begin(device)
            if getattr(self._local, "layered", None) is not None:
                return False
            found = self._sources(placements, fds, generations, slot_generations, slot_maps)
            if found is None:
                return False
            needs, keys, hosts, leases = found
            cuts = self._register(needs)
            table = np.asarray(placements, dtype=np.int64).reshape(-1, 3)
            src_keys = list(dict.fromkeys(keys.values()))
            number = {key: n for n, key in enumerate(src_keys)}
            s_of = np.zeros(len(fds), dtype=np.int64)
            for index, key in keys.items():
                s_of[index] = number[key]
            s_base = np.asarray([hosts[key].base for key in src_keys], dtype=np.int64)
            s = s_of[table[:, 0]]
            offset = table[:, 1]
            nbytes = table[:, 2]
            dests: dict[Any, torch.Tensor] = {}
            plane_dest = np.zeros(len(layout.planes), dtype=np.int64)
            number_of: dict[int, int] = {}  # a storage's number among the destinations
            for j, plane in enumerate(layout.planes):
                storage = int(plane.untyped_storage().data_ptr())
                if storage not in number_of:
                    number_of[storage] = len(dests)
                    dests[storage] = _storage_bytes(plane)
                plane_dest[j] = number_of[storage]
            pieces = layout.pieces(first, s_base[s] + offset, nbytes)
            ps = s[pieces.block]
            flat = self._flat_arrays(ps, pieces.src - s_base[ps], pieces.size, pieces.dst, pieces.rel,
                                     plane_dest[pieces.plane], src_keys, hosts, cuts)  # fmt: skip
            if flat is None:  # (a piece across a registration boundary: the piece path cuts it)
                return False
            runs = flat[0].runs()
            small = len(runs[0]) and int(runs[2].sum()) < _GATHER_BELOW * len(runs[0])
            if small and bool((nbytes == layout.capacity).all()):
                self._gathered(layout, first, s, offset, src_keys, hosts, cuts, leases, dests, device)
            else:
                self._to_device_flat(
                    flat[0], flat[1], (src_keys, list(dests)), dests, device, leases, [], hosts
                )
            return True

    def _gathered(  # noqa: PLR0917 - one reply's parts
        self,
        layout: PageLayout,
        first: int,
        s: Any,
        offset: Any,
        src_keys: list[Hashable],
        hosts: dict[Hashable, _Mapped],
        cuts: dict[Hashable, list[int]],
        leases: Sequence[int],
        dests: dict[Any, torch.Tensor],
        device: torch.device,
    ) -> None:
        """Whole blocks by DMA into a device staging buffer (``_GATHER_BYTES`` at a time, one run per run
        of consecutive slots), then one ``index_put_`` per plane from it into the pages, all on skippyd's
        stream (so a chunk's scatter is done before the next chunk's DMA overwrites the buffer)."""
        capacity, k = layout.capacity, layout.pages_per_block
        n = len(s)
        per = max(1, _GATHER_BYTES // capacity)
        current = torch.cuda.current_stream(device)
        stream = self._stream(device, "h2d")
        stream.wait_stream(current)  # whatever the caller queued on the pages comes first
        staging = torch.empty(min(n, per) * capacity, dtype=torch.uint8, device=device)
        buffers = {**dests, ("staging", staging.data_ptr()): staging}
        for tensor in buffers.values():  # the allocator keeps the memory until skippyd's stream is past it
            if tensor.is_cuda:
                tensor.record_stream(stream)
        stage = len(buffers) - 1  # the staging buffer's number among the destinations
        starts = np.concatenate(([0], np.cumsum(layout.rows)[:-1])) * k
        reads: set[int] = set()
        try:
            with torch.cuda.stream(stream):
                pages = _index_to(layout.pages[first : first + n], device)
                rows = [_rows_of(plane, int(row), int(stride)) for plane, row, stride
                        in zip(layout.planes, layout.rows, layout.strides, strict=True)]  # fmt: skip
            for c0 in range(0, n, per):
                c1 = min(n, c0 + per)
                count = c1 - c0
                at = int(staging.data_ptr()) + np.arange(count, dtype=np.int64) * capacity
                size = np.full(count, capacity, dtype=np.int64)
                zero, into = np.zeros(count, dtype=np.int64), np.full(count, stage, dtype=np.int64)
                flat = self._flat_arrays(s[c0:c1], offset[c0:c1], size, at, zero, into, src_keys, hosts, cuts)
                if flat is None:  # a block is inside one slot, a slot inside one registration
                    raise AssertionError("a block across a registration boundary")
                reads |= flat[1]
                self._issue_flat(flat[0].runs(), (src_keys, list(buffers)), hosts, buffers, stream)
                with torch.cuda.stream(stream):
                    blocks = staging[: count * capacity].view(count, capacity)
                    for rows_j, start, row in zip(rows, starts.tolist(), layout.rows.tolist(), strict=True):
                        if row:
                            part = blocks[:, start : start + k * row].view(count, k, row)
                            _put_rows(rows_j, pages[c0:c1], part)
        finally:  # a failure part-way still leaves queued copies reading the slots: their leases are held
            event = _event()
            event.record(stream)
            self._hold(event, leases, reads, stream)
        current.wait_event(event)  # results are safe on the caller's stream, with no host sync

    @contextlib.contextmanager
    def layered(self, spans: Sequence[tuple[int, int]]) -> Iterator[Layered]:
        """Within this block, ``blocks_to_device`` (``get_into`` into CUDA tensors) only collects its
        copies (their leases and registrations taken); at its end they are issued span by span: every
        block's bytes ``[start, stop)`` of span 0 (one layer's keys and values, say), an event, then span
        1's, and so on. ``Layered.events[j]`` passes once span ``j`` of every block has landed; the caller
        waits on each where it needs that span (the current stream is not made to wait)."""
        collected = Layered([(int(a), int(b)) for a, b in spans])
        self._local.layered = collected
        try:
            yield collected
            with self._lock:
                self._issue_layered(collected)
        finally:
            self._local.layered = None
            collected.release()  # (the leases of issued copies were handed over already)
            with self._lock:
                self.maps.pinned.subtract(collected.pinned)
                self.maps.pinned = +self.maps.pinned  # (drops the zeros)

    def _register(self, needs: Sequence[_Need]) -> dict[Hashable, list[int]]:
        """Registers what each source needs (one call per source, at its newest file generation; slots
        at their own); returns the registration boundaries to cut runs at."""
        merged: dict[Hashable, _Need] = {}
        for need in needs:
            key, generation, base, spans, slots, slot_map = need
            seen = merged.get(key)
            if seen is None:
                listed = None if slots is None else list(slots)
                merged[key] = (key, generation, base, list(spans), listed, slot_map)
            else:
                seen[3].extend(spans)
                both = None if seen[4] is None or slots is None else [*seen[4], *slots]
                newest = slot_map if generation >= seen[1] else seen[5]  # the map of the newest reply
                merged[key] = (key, max(seen[1], generation), base, seen[3], both, newest)
        cuts: dict[Hashable, list[int]] = {}
        for key, generation, base, spans, slots, slot_map in merged.values():
            got = self.book.ensure(
                key, generation, base, spans, readonly=True, span_generations=slots, slot_map=slot_map,
                keep=merged.keys(),  # (room for one source is never made by dropping another of these copies)
            )  # fmt: skip
            if got is not None:
                cuts[key] = got
        return cuts

    def _registrations(self, runs: Sequence[Run], hosts: dict[Hashable, _Mapped]) -> set[int]:
        """The addresses of the registrations ``runs`` read from (each run lies inside one: runs are cut
        at registration boundaries): unregistering one of them waits for these copies."""
        found: set[int] = set()
        for run in runs:
            if run.src in hosts:
                address = self.book.registration_at(run.src, run.src_offset)
                if address is not None:
                    found.add(address)
        return found

    def _flatten(
        self,
        pieces: Sequence[_Piece],
        hosts: dict[Hashable, _Mapped],
        dests: dict[Any, torch.Tensor],
        cuts: dict[Hashable, list[int]],
    ) -> tuple[Flat, set[int], tuple[list[Any], list[Any]]]:
        """The pieces as a :class:`Flat` (absolute addresses; a group per registration of a source and
        destination buffer, so no run spans two registrations: a piece that does is cut at the boundary),
        the addresses of the registrations they read, and the buffers the group and source numbers name
        (``(source keys, destination keys)``)."""
        fast = self._flatten_arrays(pieces, hosts, dests, cuts)
        if fast is not None:
            return fast
        src_keys: dict[Hashable, int] = {}
        dst_keys: dict[Any, int] = {}
        columns: list[list[int]] = [[], [], [], [], [], []]
        src_c, dst_c, size_c, rel_c, group_c, source_c = columns
        where: dict[
            int, tuple[Hashable, int]
        ] = {}  # group of a registered segment -> (source, an offset in it)
        bases = {key: int(tensor.data_ptr()) for key, tensor in dests.items()}
        for key, offset, dest, at, nbytes, rel in pieces:
            s = src_keys.get(key)
            if s is None:
                s = src_keys[key] = len(src_keys)
            d = dst_keys.get(dest)
            if d is None:
                d = dst_keys[dest] = len(dst_keys)
            bounds = cuts.get(key)
            parts = [(offset, at, nbytes, rel)]
            if bounds:
                seg = bisect.bisect_right(bounds, offset)
                if seg < len(bounds) and bounds[seg] < offset + nbytes:  # (rare) it crosses a boundary
                    parts = []
                    at_, done = offset, 0
                    for cut in [*(c for c in bounds[seg:] if c < offset + nbytes), offset + nbytes]:
                        parts.append((at_, at + done, cut - at_, rel + done))
                        done += cut - at_
                        at_ = cut
            base, dbase = hosts[key].base, bases[dest]
            for o, a, n, r in parts:
                seg = bisect.bisect_right(bounds, o) if bounds else 0
                segment = (s << 16) | seg  # (a source's registrations: at most 2 a slot, 256 slots)
                if bounds and segment not in where:
                    where[segment] = (key, o)
                group = (segment << 32) | d
                src_c.append(base + o)
                dst_c.append(dbase + a)
                size_c.append(n)
                rel_c.append(r)
                group_c.append(group)
                source_c.append(s)
        reads: set[int] = set()
        for key, offset in where.values():
            address = self.book.registration_at(key, offset)
            if address is not None:
                reads.add(address)
        return Flat.of(columns), reads, (list(src_keys), list(dst_keys))

    def _flatten_arrays(
        self,
        pieces: Sequence[_Piece],
        hosts: dict[Hashable, _Mapped],
        dests: dict[Any, torch.Tensor],
        cuts: dict[Hashable, list[int]],
    ) -> tuple[Flat, set[int], tuple[list[Any], list[Any]]] | None:
        """:meth:`_flatten` with array operations where no piece crosses a registration boundary (None
        where one does: the loop there cuts it)."""
        if not pieces:
            return None
        keys, offsets, dests_col, ats, sizes, rels = zip(*pieces, strict=True)
        src_keys = list(dict.fromkeys(keys))
        dst_keys = list(dict.fromkeys(dests_col))
        s_of = {key: n for n, key in enumerate(src_keys)}
        d_of = {key: n for n, key in enumerate(dst_keys)}
        s = np.fromiter((s_of[k] for k in keys), dtype=np.int64, count=len(keys))
        d = np.fromiter((d_of[k] for k in dests_col), dtype=np.int64, count=len(keys))
        dst_base = np.asarray([int(dests[key].data_ptr()) for key in dst_keys], dtype=np.int64)
        offset, size = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
        dst = dst_base[d] + np.asarray(ats, dtype=np.int64)
        found = self._flat_arrays(
            s, offset, size, dst, np.asarray(rels, dtype=np.int64), d, src_keys, hosts, cuts
        )
        return None if found is None else (found[0], found[1], (src_keys, dst_keys))

    def _flat_arrays(  # noqa: PLR0917 - the pieces' columns
        self,
        s: Any,
        offset: Any,
        size: Any,
        dst: Any,
        rel: Any,
        d: Any,
        src_keys: list[Hashable],
        hosts: dict[Hashable, _Mapped],
        cuts: dict[Hashable, list[int]],
    ) -> tuple[Flat, set[int]] | None:
        """Pieces given as arrays (source number ``s`` into ``src_keys``, ``offset`` in that source,
        ``size``, absolute ``dst`` address, ``rel`` in the block, destination buffer number ``d``) as a
        :class:`Flat` grouped by registration and destination, and the addresses of the registrations
        they read; None where a piece crosses a registration boundary."""
        where: dict[int, tuple[Hashable, int]] = {}
        single = np.zeros(len(src_keys), dtype=np.int64)  # a source read through one registration: 1
        several = []
        for n, key in enumerate(src_keys):
            bounds = cuts.get(key)
            if bounds and len(bounds) == 2:  # (every piece of it lies in that registration)
                single[n] = 1
                where[(n << 16) | 1] = (key, bounds[0])
            elif bounds:
                several.append((n, key, bounds))
        seg = single[s]
        for n, key, bounds in several:
            mine = np.flatnonzero(s == n) if len(src_keys) > 1 else np.arange(len(s))
            edges = np.asarray(bounds, dtype=np.int64)
            at = np.searchsorted(edges, offset[mine], side="right")
            if (np.searchsorted(edges, offset[mine] + size[mine], side="left") > at).any():
                return None  # (a piece across a registration boundary: the loop cuts it)
            seg[mine] = at
            for value, first in zip(*np.unique(at, return_index=True), strict=True):
                where[(n << 16) | int(value)] = (key, int(offset[mine[first]]))
        src_base = np.asarray([hosts[key].base for key in src_keys], dtype=np.int64)
        group = (((s << 16) | seg) << 32) | d
        reads: set[int] = set()
        for key, at_offset in where.values():
            address = self.book.registration_at(key, at_offset)
            if address is not None:
                reads.add(address)
        return Flat.of([src_base[s] + offset, dst, size, rel, group, s]), reads

    def _issue_flat(
        self,
        runs: tuple[Any, Any, Any, Any, Any],
        buffers: tuple[list[Any], list[Any]],
        hosts: dict[Hashable, _Mapped],
        dests: dict[Any, torch.Tensor],
        stream: torch.cuda.Stream,
    ) -> None:
        """Issues merged runs (:meth:`Flat.runs`) on ``stream``: one batch call over the arrays as they
        are, or one ``copy_`` per run."""
        src, dst, size, group, source = runs
        count = len(src)
        if not count:
            return
        self.copies += count
        if self._issue_batch(dst, src, size, stream):
            return
        src_keys, dst_keys = buffers
        with torch.cuda.stream(stream):
            for s, d, n, g, k in zip(src.tolist(), dst.tolist(), size.tolist(), group.tolist(),
                                     source.tolist(), strict=True):  # fmt: skip
                mapped = hosts[src_keys[k]]
                into = dests[dst_keys[g & 0xFFFFFFFF]]
                at = d - int(into.data_ptr())
                into[at : at + n].copy_(mapped.host[s - mapped.base : s - mapped.base + n], non_blocking=True)
                self.calls += 1

    def _issue_layered(self, collected: Layered) -> None:
        if not collected.parts:
            return
        device = collected.device
        assert device is not None
        current = torch.cuda.current_stream(device)
        stream = self._stream(device, "h2d")
        stream.wait_stream(current)
        hosts: dict[Hashable, _Mapped] = {}
        dests: dict[Any, torch.Tensor] = {}
        for part in collected.parts:
            hosts.update(part.hosts)
            dests.update(part.dests)
        cuts = self._register([need for part in collected.parts for need in part.needs])
        for tensor in dests.values():  # freed before the copies land (a cache dropped unused): not reused
            if tensor.is_cuda:
                tensor.record_stream(stream)
        scatters = [s for part in collected.parts for s in part.scatters]
        reads: set[int] = set()
        try:
            flat, reads, buffers = self._flatten([p for part in collected.parts for p in part.pieces], hosts,
                                                 dests, cuts)  # fmt: skip
            _preload(scatters, dests, stream)
            for start, stop in collected.spans:  # each piece's bytes within [start, stop) of its block
                self._issue_flat(flat.runs(start, stop), buffers, hosts, dests, stream)
                # a strided piece is laid out once its span's bytes are in (again for each span it reaches)
                _scatter([s for s in scatters if s[4] < stop and start < s[4] + s[3]], dests, stream)
                event = _event()
                event.record(stream)
                collected.events.append(event)
        finally:  # the leases go once everything queued has landed, a failure part-way included
            last = _event()
            last.record(stream)
            self._leases.hold(last, collected.take_leases(), reads, stream)

    def _to_device_flat(  # noqa: PLR0917 - one transfer's parts
        self,
        flat: Flat,
        reads: set[int],
        buffers: tuple[list[Any], list[Any]],
        dests: dict[Any, torch.Tensor],
        device: torch.device,
        leases: Sequence[int],
        scatters: Sequence[_Scatter],
        hosts: dict[Hashable, _Mapped],
    ) -> None:
        current = torch.cuda.current_stream(device)
        stream = self._stream(device, "h2d")
        stream.wait_stream(current)  # whatever the caller queued on the destinations comes first
        for tensor in dests.values():  # the allocator keeps the memory until skippyd's stream is past it
            if tensor.is_cuda:
                tensor.record_stream(stream)
        try:
            _preload(scatters, dests, stream)
            self._issue_flat(flat.runs(), buffers, hosts, dests, stream)
            _scatter(scatters, dests, stream)
        finally:  # a failure part-way still leaves queued copies reading the slots: their leases are held
            event = _event()
            event.record(stream)
            self._hold(event, leases, reads, stream)
        current.wait_event(event)  # results are safe on the caller's stream, with no host sync

    def _to_device(  # noqa: PLR0917 - one transfer's parts
        self,
        runs: Sequence[Run],
        hosts: dict[Hashable, _Mapped],
        dests: dict[Any, torch.Tensor],
        device: torch.device,
        leases: Sequence[int],
        scatters: Sequence[_Scatter] = (),
    ) -> None:
        current = torch.cuda.current_stream(device)
        stream = self._stream(device, "h2d")
        stream.wait_stream(current)  # whatever the caller queued on the destinations comes first

        def address(buffer: Any, offset: int) -> int:
            mapped = hosts.get(buffer)
            if mapped is not None:
                return mapped.base + offset
            return int(dests[buffer].data_ptr()) + offset

        def view(buffer: Any, offset: int, nbytes: int) -> torch.Tensor:
            mapped = hosts.get(buffer)
            whole = mapped.host if mapped is not None else dests[buffer]
            return whole[offset : offset + nbytes]

        for tensor in dests.values():  # the allocator keeps the memory until skippyd's stream is past it
            if tensor.is_cuda:
                tensor.record_stream(stream)
        reads = self._registrations(runs, hosts)
        try:
            _preload(scatters, dests, stream)
            self._issue(runs, address, view, stream)
            _scatter(scatters, dests, stream)
        finally:  # a failure part-way still leaves queued copies reading the slots: their leases are held
            event = _event()
            event.record(stream)
            self._hold(event, leases, reads, stream)
        current.wait_event(event)  # results are safe on the caller's stream, with no host sync

    # ------------------------------------------------------------ device → host
    def to_host(self, region: memoryview, jobs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Copies each CUDA tensor of ``jobs`` (``(offset in region, tensor)``) into ``region`` (a writable
        mapping: the staging buffer) by DMA and waits until the bytes are there."""
        if not jobs:
            return
        device = jobs[0][1].device
        if not len(region):
            return
        with self._lock:
            self._begin(device)  # (drops released staging before the region's range is looked up)
            base, host = _address_of(region)
            buffers: dict[Any, torch.Tensor] = {}  # cleared on the way out: the region is released next
            try:
                self._to_host(region, jobs, device, base, host, buffers)
            finally:
                buffers.clear()
                del host

    def _to_host(  # noqa: PLR0917 - to_host's parts
        self,
        region: memoryview,
        jobs: Sequence[tuple[int, torch.Tensor]],
        device: torch.device,
        base: int,
        host: torch.Tensor,
        buffers: dict[Any, torch.Tensor],
    ) -> None:
        key = ("host", base)
        buffers[key] = host
        current = torch.cuda.current_stream(device)
        pieces = []
        for offset, given in jobs:
            if given.device != device:
                raise InvalidArgument("the CUDA tensors of one capture or put must be on one device")
            # a conjugate or negative view's bytes are made plain, a strided one contiguous, on the current
            # stream (the side stream waits for it)
            tensor = given.resolve_conj().resolve_neg()
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
            nbytes = _bytes_of(tensor)
            if not nbytes:
                continue
            if offset < 0 or offset + nbytes > len(region):
                raise InvalidArgument("a tensor does not fit the staging region")
            storage, at = _storage_base(tensor)
            if storage not in buffers:  # (one byte view a storage, not a tensor made for every piece)
                buffers[storage] = _storage_bytes(tensor)
            pieces.append((storage, at, key, offset, nbytes))
        runs = plan_runs(pieces)
        cuts = self.book.ensure(key, 1, base, [(r.dst_offset, r.dst_offset + r.nbytes) for r in runs],
                                readonly=False)  # fmt: skip
        if cuts is not None:
            runs = split_runs(runs, {key: cuts}, side="dst")
        stream = self._stream(device, "d2h")
        stream.wait_stream(current)  # the sources' producers (and any .contiguous()) come first

        def address(buffer: Any, offset: int) -> int:
            return (base if buffer == key else int(buffers[buffer].data_ptr())) + offset

        def view(buffer: Any, offset: int, nbytes: int) -> torch.Tensor:
            return buffers[buffer][offset : offset + nbytes]

        self._issue(runs, address, view, stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # (spins: the caller waits, briefly)
        event.record(stream)
        event.synchronize()  # the daemon reads these bytes next

    def release_later(self, mapping: mmap.mmap, addresses: Sequence[int]) -> None:
        """A staging mapping its client closed or dropped: its registrations at ``addresses`` go, then
        the mapping, at this transfer's next call or idle sweep (:meth:`_release_dropped`). A finalizer
        calls this, at any point of any thread, and an event loop's thread must not wait for the lock
        behind another thread's device copy, so it takes no lock. Never the other way round:
        unmapped while still registered, CUDA would keep the old pages for that range, and a new mapping
        at the same address (the next staging buffer's, likely) would be written through them, the book
        finding the range registered already: the daemon would store other bytes than the caller's.

        Before this transfer's first call has begun (no sweeper yet) nothing of it can be registered, and
        the mapping is closed at once: queued, it could wait for a call that never comes (a process whose
        only device restores are entries served once, which take the pinned path). A copy into it on its
        way holds a view of it (the mapping cannot close: queued, and that copy's call starts the
        sweeper)."""
        if self._sweeper is None:
            try:
                mapping.close()
                return
            except BufferError:
                pass
        self._released.append((mapping, tuple(addresses)))

    def _begin(self, device: torch.device) -> None:
        """(Under ``self._lock``, at the start of each call.) Releases dropped staging buffers, notes the
        call (the idle sweeper looks only once calls stop) and its device, and starts the sweeper."""
        self._release_dropped()
        self._last_call = time.monotonic()
        if device.type == "cuda":
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        if self._sweeper is None and not self._closed.is_set():
            self._sweeper = threading.Thread(
                target=_sweep_while_idle, args=(weakref.ref(self), self._closed), name="skippyd-idle-sweep",
                daemon=True,
            )  # fmt: skip
            weakref.finalize(self, self._closed.set)  # (collected without close(): the thread ends too)
            try:
                self._sweeper.start()
            except RuntimeError as exc:  # (no thread to be had: calls still sweep; never fails a call)
                log.warning("no idle sweeper (%s): what this process keeps goes at its calls only", exc)

    def sweep_idle(self) -> None:
        """What the idle sweeper does (``idle_sweep`` s after the last call, then as often): unmaps kept
        mappings of files the daemon removed, drops the registrations of slots it punched, releases
        dropped staging buffers. At a call these go at that call; without one, an engine that went idle
        would keep their pages (pinned, for registrations) outside the daemon's budget until its next
        transfer. Makes the device of the last call current on the thread it runs on, the sweeper's
        (:func:`_make_current`: unregistering is a CUDA runtime call)."""
        with self._lock:
            if not len(self.maps) and not self._released:
                return
            try:
                _make_current(self._device_index)
            except Exception:
                self._release_dropped(unregistered_only=True)  # (unmapping needs no device)
                raise
            self._release_dropped()
            self.maps.sweep()
            self.sweep_punched(every=self.idle_sweep)  # (spaced out past 256 slabs, as at calls)

    def _release_dropped(self, *, unregistered_only: bool = False) -> None:
        # (under self._lock) unregister first, then unmap; a mapping still in use (a copy into it on its
        # way: it may register it yet) is kept for the next look, its registrations dropped again then.
        # unregistered_only: where no device can be made current, only those with no registration go
        busy = []
        while self._released:
            mapping, addresses = self._released.popleft()
            if unregistered_only and any(("host", address) in self.book for address in addresses):
                busy.append((mapping, addresses))
                continue
            for address in addresses:
                self.book.drop(("host", address))
            try:
                mapping.close()
            except BufferError:
                busy.append((mapping, addresses))
        self._released.extend(busy)

    def close(self) -> None:
        self._closed.set()
        self._leases.drain()
        with self._lock:
            self._release_dropped()
            self.maps.close()
            self.book.close()


def _staged(scatter: _Scatter, dests: dict[Any, torch.Tensor]) -> torch.Tensor:
    """The staging bytes of a strided piece, viewed as its dtype and shape."""
    tensor, key, where, _, _ = scatter
    return dests[key][where : where + _bytes_of(tensor)].view(tensor.dtype).view(tensor.shape)


def _preload(scatters: Sequence[_Scatter], dests: dict[Any, torch.Tensor], stream: Any) -> None:
    """A strided piece its block fills only in part keeps its other bytes: they go to staging first."""
    with torch.cuda.stream(stream):
        for scatter in scatters:
            if scatter[3] < _bytes_of(scatter[0]):
                _staged(scatter, dests).copy_(scatter[0])


def _scatter(scatters: Sequence[_Scatter], dests: dict[Any, torch.Tensor], stream: Any) -> None:
    """One on-device ``copy_`` per strided piece, from its staging bytes, on skippyd's stream."""
    with torch.cuda.stream(stream):
        for scatter in scatters:
            scatter[0].copy_(_staged(scatter, dests))


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``tensor`` (so runs that span tensors are one view)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


_GATHER_BELOW = 512 << 10  # pages' runs smaller than this on average go through a device staging buffer
_GATHER_BYTES = 64 << 20  # ... this many bytes of blocks at a time (the buffer: device memory)


def _put_rows(rows: torch.Tensor, pages: torch.Tensor, part: torch.Tensor) -> None:
    """``rows[pages[i, m]] = part[i, m]`` on the device (one kernel; the simulator may only count it)."""
    rows.index_put_((pages,), part)


def _index_to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` (page numbers) on ``device``, queued on the current stream without making the host wait:
    from pageable memory a host→device copy is synchronous (the host would wait for everything queued on
    the stream before it, the caller's work included), so it goes through pinned memory (torch's caching
    host allocator, which keeps it until the copy has run)."""
    index = torch.from_numpy(array)
    if device.type != "cuda":  # (the simulator's "device" is the CPU)
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def gather_pages(layout: PageLayout, start: int, stop: int) -> torch.Tensor:
    """Blocks ``start`` to ``stop`` of ``layout`` gathered from their pages into one device tensor
    ``[blocks, capacity]`` (one indexing copy a plane, queued on the caller's current stream): what a put
    of small pages copies to the host as one DMA a run of blocks instead of one a page."""
    device = layout.device
    assert device is not None
    k, count = layout.pages_per_block, stop - start
    out = torch.empty((count, layout.capacity), dtype=torch.uint8, device=device)
    pages = _index_to(layout.pages[start:stop], device)
    at = 0
    for plane, row, stride in zip(layout.planes, layout.rows.tolist(), layout.strides.tolist(), strict=True):
        if row:
            out[:, at : at + k * row].view(count, k, row).copy_(_rows_of(plane, row, stride)[pages])
        at += k * row
    return out


def _rows_of(plane: torch.Tensor, row: int, stride: int) -> torch.Tensor:
    """A plane's pages as uint8 rows ``[pages, row]`` over its storage (what ``index_put_`` writes)."""
    whole = _storage_bytes(plane)
    start = int(plane.data_ptr()) - int(whole.data_ptr())
    return whole.as_strided((int(plane.shape[0]), row), (stride, 1), start)


_CHUNK_BYTES = 64 << 20  # a get_into's copies are issued this many bytes (and pieces) at a time
_CHUNK_PIECES = 256


def _chunks(
    pieces: Sequence[tuple[int, int, int, torch.Tensor]],
) -> Iterator[Sequence[tuple[int, int, int, torch.Tensor]]]:
    """``pieces`` in runs of at least ``_CHUNK_BYTES`` and ``_CHUNK_PIECES`` (where planning them takes
    long enough for an early start to pay for a chunk's own cost; the last may be more)."""
    start, total = 0, 0
    for n, piece in enumerate(pieces):
        total += piece[2]
        if total >= _CHUNK_BYTES and n + 1 - start >= _CHUNK_PIECES and len(pieces) - n > _CHUNK_PIECES:
            yield pieces[start : n + 1]
            start, total = n + 1, 0
    if start < len(pieces):
        yield pieces[start:]


def _prepare(
    pieces: Sequence[tuple[int, int, int, torch.Tensor]],
    placements: Sequence[tuple[int, int, int]],
    keys: dict[int, Hashable],
    device: torch.device,
) -> tuple[list[_Piece], dict[Any, torch.Tensor], list[_Scatter]]:
    """The copies of ``pieces`` (see :meth:`DeviceTransfer.pieces_to_device`), the destination buffers they
    name and the strided pieces to lay out from a device staging buffer."""
    copies: list[_Piece] = []
    dests: dict[Any, torch.Tensor] = {}
    strided: list[tuple[torch.Tensor, int, int, int, int]] = []  # tensor, src key index, offset...
    staged = 0
    storages: dict[int, int] = {}  # id of a view's base tensor -> its storage's address (one look-up)
    for block, at, take, tensor in pieces:
        index, offset, nbytes = placements[block]
        if at < 0 or take < 0 or at + take > nbytes or take > tensor.nbytes:
            raise Mismatch(f"a piece of {take} bytes at {at} does not fit its block of {nbytes}")
        if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
            root = tensor._base if tensor._base is not None else tensor
            base = storages.get(id(root))
            if base is None:  # (views of one tensor share its device: checked once)
                if tensor.device != device:
                    raise InvalidArgument("the CUDA destinations of one get_into must be on one device")
                base = storages[id(root)] = tensor.untyped_storage().data_ptr()
                if base not in dests:
                    dests[base] = _storage_bytes(tensor)
            copies.append((keys[index], offset + at, base, tensor.data_ptr() - base, take, at))
            continue
        if tensor.device != device:
            raise InvalidArgument("the CUDA destinations of one get_into must be on one device")
        staged = -(-staged // tensor.element_size()) * tensor.element_size()
        strided.append((tensor.detach(), block, at, take, staged))  # (laid out with copy_: no autograd)
        copies.append((keys[index], offset + at, "staging", staged, take, at))
        staged += _bytes_of(tensor)
    scatters: list[_Scatter] = []
    if strided:
        staging = torch.empty(staged, dtype=torch.uint8, device=device)
        key = ("staging", staging.data_ptr())
        dests[key] = staging
        copies = [(*c[:2], key, *c[3:]) if c[2] == "staging" else c for c in copies]
        for n, (tensor, _, at, take, where) in enumerate(strided):
            dests[("scatter", n, key)] = tensor  # (kept alive, and recorded on skippyd's stream)
            scatters.append((tensor, key, where, take, at))
    return copies, dests, scatters


_transfer: list[DeviceTransfer] = []
_transfer_lock = threading.Lock()


def transfer() -> DeviceTransfer:
    """The process's device transfer (made on first use)."""
    if not _transfer:
        with _transfer_lock:
            if not _transfer:
                _transfer.append(DeviceTransfer())
    return _transfer[0]


def release_host(mapping: mmap.mmap, addresses: Sequence[int]) -> bool:
    """A staging mapping closed without waiting for the transfer (:meth:`DeviceTransfer.release_later`):
    True when this process has a transfer, which will unregister whatever it registered at
    ``addresses`` and then close ``mapping`` (registered now or not: a device copy into it may still be
    on its way, on another thread, and register it after this); False when it has none (the caller
    closes it: nothing can be registered)."""
    if _transfer:
        _transfer[0].release_later(mapping, addresses)
        return True
    return False
