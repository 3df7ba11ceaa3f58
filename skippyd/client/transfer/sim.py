"""A CUDA simulator for the device transfer on the CPU (tests and ``bench.gpu_host``; client side, torch).

Within :func:`simulated`, CUDA's streams and events are stand-ins that record what was asked, the
"device" tensors are CPU tensors, ``cudaHostRegister``/``cudaHostUnregister`` are a :class:`Recorder`, and
the batched copy (``cuMemcpyBatchAsync``) is a stand-in that moves the bytes by address with ``memmove``
(so the addresses the batch call would get are checked byte for byte) or, with ``copy=False``, only
counts them (to time the host work that precedes a copy on a GPU, without the bytes). ``get_into``
(``BlockSpace``), ``Client.restore`` and ``skt.restore`` send CPU destinations the way they send CUDA
ones. What this cannot check is CUDA itself: tests/test_cuda.py does that on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import cuda
from . import device as dev

__all__ = ["FakeEvent", "FakeStream", "Recorder", "Sim", "memmove_batch", "simulated"]


class FakeEvent:
    def __init__(self, *_args: Any, blocking: bool = False, **_kwargs: Any) -> None:
        self.recorded_on: Any = None
        self.blocking = blocking  # (cudaEventBlockingSync: a wait sleeps instead of spinning)

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeStream:
    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        self.waited: list[Any] = []
        self.cuda_stream = 0x5EED

    def wait_stream(self, other: Any) -> None:
        self.waited.append(("stream", other))

    def wait_event(self, event: Any) -> None:
        self.waited.append(("event", event))


class Recorder:
    """``cudaHostRegister``/``cudaHostUnregister`` stand-ins that record every call (and can refuse)."""

    def __init__(self, refuse: bool = False, *, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = refuse  # answers False: this memory cannot be registered
        self.fail = fail  # answers None: failed for another reason (asked again next time)

    def register(self, address: int, nbytes: int, flags: int) -> bool | None:
        self.calls.append(("register", address, nbytes, flags))
        if self.fail:
            return None
        return not self.refuse

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))

    def count(self, what: str) -> int:
        return sum(1 for call in self.calls if call[0] == what)

    def registered_bytes(self) -> int:
        return sum(call[2] for call in self.calls if call[0] == "register")


@dataclass
class Batch:
    """The ``cuMemcpyBatchAsync`` stand-in: moves bytes by address (``copy``) or only counts."""

    copy: bool = True
    calls: int = 0
    scatters: int = 0  # device-side scatters of pages out of a staging buffer (one kernel each)
    runs: int = 0
    nbytes: int = 0

    def __call__(self, dsts: Any, srcs: Any, sizes: Any, count: int, *_rest: Any) -> int:
        self.calls += 1
        self.runs += count
        if self.copy:
            for i in range(count):
                ctypes.memmove(dsts[i], srcs[i], sizes[i])
                self.nbytes += sizes[i]
        return 0


def memmove_batch() -> Batch:
    return Batch(copy=True)


@dataclass
class Sim:
    transfer: dev.DeviceTransfer
    rec: Recorder
    current: FakeStream
    batch: Batch | None
    mode: str
    host: list[int] = field(default_factory=list)  # memcpys get_into's host path made (per reply)


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(old):
            setattr(obj, name, value)


@contextlib.contextmanager
def simulated(
    mode: str = "batch", *, copy: bool = True, through: bool = True, **transfer_args: Any
) -> Iterator[Sim]:
    """CUDA simulated on the CPU (see the module). ``mode``: ``"batch"`` (one batch call per issue) or
    ``"per-run"`` (one ``copy_`` per run). ``through``: ``BlockSpace.get_into``, ``Client.restore`` and
    ``skt.restore`` send CPU destinations to the simulated transfer (the process's :func:`dev.transfer`)."""
    from skippyd.client import blockspace, client

    current = FakeStream()
    batch = Batch(copy=copy) if mode == "batch" else None
    rec = Recorder()
    transfer = dev.DeviceTransfer(register=rec.register, unregister=rec.unregister, **transfer_args)
    transfer.idle_sweep = 3600  # (the calls sweep; what a test counts is not changed behind its back)
    sim = Sim(transfer, rec, current, batch, mode)
    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "Stream", FakeStream),
        (torch.cuda, "Event", FakeEvent),
        (torch.cuda, "current_stream", lambda _device=None: current),
        (torch.cuda, "stream", lambda _stream: contextlib.nullcontext()),
        (cuda, "_batch", [batch]),
    ]
    if batch is not None:  # the pages' scatter on the "device" moves bytes only when the batch call does
        put_rows = dev._put_rows

        def scatter(rows: Any, pages: Any, part: Any) -> None:
            batch.scatters += 1
            if batch.copy:
                put_rows(rows, pages, part)

        patches.append((dev, "_put_rows", scatter))
    if through:
        original = blockspace._memmoves

        def spy(copies: list[Any]) -> None:
            sim.host.append(len(copies))
            original(copies)

        patches += [
            (blockspace, "_CPU_AS_DEVICE", True),
            (blockspace, "_memmoves", spy),
            (client, "_CPU_AS_DEVICE", True),
            (dev, "transfer", lambda: transfer),
        ]
        skt = sys.modules.get("skippyd.integrations.transformers")
        if skt is not None:
            patches.append((skt, "_CPU_AS_DEVICE", True))
    try:
        with _patched(patches):
            yield sim
    finally:
        transfer.close()
