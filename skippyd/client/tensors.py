"""torch ⇄ entry bytes, on the client side only (the daemon never imports this module).

* :func:`declare` / :func:`write_into` turn a mapping of tensors (any device, layout or contiguity)
  into a tensor table and their exact bytes at the table's offsets.
* :func:`map_entry` gives tensors that are views of an entry's shared memory with no copy. The mapping
  is private and copy-on-write: writing to a restored tensor changes only the writer's copy, never the
  cached entry. The mapping keeps the reader's lease alive until the last tensor is collected.
* :func:`copy_entry` copies into preallocated tensors; :class:`DeviceStager` moves an entry to a CUDA
  device through reusable pinned buffers, overlapping the host copy with the DMA.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from skippyd.errors import InvalidArgument, Mismatch, UnsupportedDtype
from skippyd.payload import DTYPES, TensorDecl, TensorSpec

__all__ = [
    "DeviceStager",
    "copy_entry",
    "declare",
    "device_views",
    "dtype_name",
    "map_entry",
    "torch_dtype",
    "write_into",
]

_ITEM_SIZES = DTYPES
_BY_NAME: dict[str, torch.dtype] = {}
_BY_DTYPE: dict[torch.dtype, str] = {}
for _name in DTYPES:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _BY_NAME[_name] = _dt
        _BY_DTYPE[_dt] = _name


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedDtype(f"dtype {dtype} is not supported by skippyd") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedDtype(f"dtype {name!r} is not available in this torch build") from None


def _dense(tensor: Any, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t


def declare(tensors: Mapping[str, Any]) -> list[TensorDecl]:
    """The table of ``tensors`` in their mapping order."""
    if not isinstance(tensors, Mapping):
        raise InvalidArgument("tensors must be a mapping of name to torch.Tensor")
    decls = []
    for name, tensor in tensors.items():
        t = _dense(tensor, name)
        if not isinstance(name, str) or not name:
            raise InvalidArgument("tensor names must be non-empty strings")
        decls.append(TensorDecl(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape)))
    return decls


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _views(base: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """One view per tensor: a typed alias of ``base`` per dtype, then a single ``as_strided`` each."""
    typed: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        size = _ITEM_SIZES[spec.dtype]
        alias = typed.get(spec.dtype)
        if alias is None:
            usable = base.numel() // size * size
            alias = typed[spec.dtype] = base[:usable].view(torch_dtype(spec.dtype))
        if spec.offset % size or spec.offset + spec.nbytes > base.numel():
            raise InvalidArgument(f"tensor {spec.name!r} is misaligned or outside the entry")
        out[spec.name] = alias.as_strided(spec.shape, _contiguous_strides(spec.shape), spec.offset // size)
    return out


def device_views(data: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """The entry's tensors as views of ``data`` (its whole data region, uint8, on any device)."""
    if not data.numel():
        return _empty_tensors(specs, data.device)
    return _views(data, specs)


def write_into(region: Any, specs: Sequence[TensorSpec], tensors: Mapping[str, Any]) -> None:
    """Copies each tensor's bytes into ``region`` (a writable buffer) at its spec's offset; CUDA tensors
    go by DMA straight into it (:mod:`skippyd.client.transfer`), and this returns once they are there.

    Tensors with no elements take no bytes (an entry may hold only such tensors, or none at all)."""
    for spec in specs:
        source = _dense(tensors[spec.name], spec.name)
        if tuple(source.shape) != spec.shape or dtype_name(source.dtype) != spec.dtype:
            raise InvalidArgument(f"tensor {spec.name!r} changed while it was being captured")
    sized = [spec for spec in specs if spec.nbytes]
    if not sized:
        return
    on_cuda: list[TensorSpec] = []
    on_host: list[TensorSpec] = []
    for spec in sized:
        (on_cuda if getattr(tensors[spec.name], "is_cuda", False) else on_host).append(spec)
    if on_cuda:
        from .transfer.device import transfer

        transfer().to_host(region, [(s.offset, _dense(tensors[s.name], s.name)) for s in on_cuda])
        sized = on_host
        if not sized:
            return
    views = _views(torch.frombuffer(region, dtype=torch.uint8), sized)
    for spec in sized:
        views[spec.name].copy_(_dense(tensors[spec.name], spec.name))


def _empty_tensors(
    specs: Sequence[TensorSpec], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    return {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs}


def map_entry(
    fd: int, data_offset: int, data_len: int, specs: Sequence[TensorSpec]
) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over an entry's data region (private copy-on-write mapping)."""
    if data_len == 0:
        return _empty_tensors(specs)
    mapping = mmap.mmap(
        fd, data_len, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=data_offset
    )
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    return _views(base, specs)


def _source_view(fd: int, data_offset: int, data_len: int) -> tuple[mmap.mmap, torch.Tensor]:
    # Not pre-populated: torch's copy_ splits large copies over its intra-op threads, and letting each
    # thread fault in its own half measured faster than one MADV_POPULATE_READ call up front.
    mapping = mmap.mmap(
        fd, data_len, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=data_offset
    )
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def copy_entry(
    fd: int,
    data_offset: int,
    data_len: int,
    specs: Sequence[TensorSpec],
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Copies an entry into ``out`` (preallocated, any device) or into fresh CPU tensors."""
    result = dict(out) if out is not None else _empty_tensors(specs)
    for spec in specs:
        target = result.get(spec.name)
        if target is None:
            raise Mismatch(f"no destination tensor for {spec.name!r}")
        if tuple(target.shape) != spec.shape or dtype_name(target.dtype) != spec.dtype:
            raise Mismatch(
                f"destination {spec.name!r} is {target.dtype}{tuple(target.shape)}, "
                f"the entry holds {spec.dtype}{spec.shape}"
            )
    if data_len == 0:
        return result
    mapping, base = _source_view(fd, data_offset, data_len)
    try:
        for name, view in _views(base, specs).items():
            result[name].copy_(view)
    finally:
        del base
        with contextlib.suppress(BufferError):
            mapping.close()
    return result


class DeviceStager:
    """Copies entries to a CUDA device through pairs of reusable pinned host buffers.

    The host copy of chunk ``i + 1`` into one pinned buffer of a pair overlaps the DMA of chunk ``i`` from
    the other; the destination is one device allocation of the data region, and the tensors are views of
    it. Each copy has a pair to itself (two copies sharing one would write a buffer the other's DMA still
    reads): restores at once (an ``AsyncClient``'s, on worker threads) each take one, up to ``pairs``
    (each made at its first use and kept: ``2 × chunk_bytes`` of pinned memory); past that a copy waits
    for a pair to come back.
    """

    def __init__(self, chunk_bytes: int = 32 << 20, pairs: int = 2) -> None:
        if pairs < 1:
            raise InvalidArgument("a DeviceStager needs at least one pair of buffers")
        self.chunk_bytes = chunk_bytes
        self.pairs = pairs
        self._free: list[list[torch.Tensor]] = []
        self._made = 0
        self._cond = threading.Condition()

    def _take(self) -> list[torch.Tensor]:
        with self._cond:
            while not self._free and self._made >= self.pairs:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        try:  # (pinning is slow: outside the lock)
            return [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def _give(self, pair: list[torch.Tensor]) -> None:
        with self._cond:
            self._free.append(pair)
            self._cond.notify()

    def to_device(
        self, fd: int, data_offset: int, data_len: int, specs: Sequence[TensorSpec], device: torch.device
    ) -> dict[str, torch.Tensor]:
        if device.type != "cuda":
            raise InvalidArgument(f"DeviceStager copies to CUDA devices, not {device}")
        if data_len == 0:
            return _empty_tensors(specs, device)
        pair = self._take()
        try:
            return self._to_device(pair, fd, data_offset, data_len, specs, device)
        finally:  # (every DMA that read the pair has passed: _to_device waited for each)
            self._give(pair)

    def _to_device(  # noqa: PLR0917 - one copy's parts
        self,
        pair: list[torch.Tensor],
        fd: int,
        data_offset: int,
        data_len: int,
        specs: Sequence[TensorSpec],
        device: torch.device,
    ) -> dict[str, torch.Tensor]:
        target = torch.empty(data_len, dtype=torch.uint8, device=device)
        mapping, base = _source_view(fd, data_offset, data_len)
        stream = torch.cuda.current_stream(device)
        events: list[Any] = [None, None]
        done_all = False
        try:
            for index, start in enumerate(range(0, data_len, self.chunk_bytes)):
                stop = min(start + self.chunk_bytes, data_len)
                slot = index % 2
                event = events[slot]
                if event is not None:
                    event.synchronize()  # the DMA that last read this pinned buffer is done
                pinned = pair[slot][: stop - start]
                pinned.copy_(base[start:stop])
                target[start:stop].copy_(pinned, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
                events[slot] = done
            for event in events:
                if event is not None:
                    event.synchronize()
            done_all = True
        finally:
            # a failure part-way: the pair goes back once no DMA reads it (one may have been queued
            # without its event), as far as one can wait
            if not done_all:
                with contextlib.suppress(Exception):
                    stream.synchronize()
            del base
            with contextlib.suppress(BufferError):
                mapping.close()
        return _views(target, specs)
