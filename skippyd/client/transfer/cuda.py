"""What the device transfer asks of CUDA itself (client side; imports torch): which device a caller means,
host-memory registration, the batched copy, the events and current device of skippyd's own threads.

* :func:`resolve_device`: a CUDA device this process cannot use is :class:`~skippyd.errors.NoDevice`.
* ``cudaHostRegister``/``cudaHostUnregister`` through torch's runtime (``torch.cuda.cudart()``), the
  portable flag asked for once, a failed call's error cleared in torch's own ``libcudart``.
* ``cuMemcpyBatchAsync`` through ``cuda-bindings`` (the ``gpu`` extra) where the driver has it
  (:func:`batch_available`), looked up once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from typing import Any

import torch

from skippyd.errors import InvalidArgument, NoDevice

__all__ = ["batch_available", "resolve_device"]

log = logging.getLogger("skippyd.client.transfer")

_SRC_ACCESS_ORDER_STREAM = 1  # CUmemcpySrcAccessOrder: the source is read in stream order


# ---------------------------------------------------------------- devices


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` (None: the CPU); a CUDA device this process cannot use is
    :class:`~skippyd.errors.NoDevice`, one clear line."""
    if device is None:
        return torch.device("cpu")
    try:
        target = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"not a device: {device!r} ({exc})") from None
    if target.type != "cuda":
        return target
    if not torch.cuda.is_available():
        why = "this torch has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise NoDevice(f"{target} was asked for, but {why} (torch {torch.__version__})")
    count = torch.cuda.device_count()
    index = target.index if target.index is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise NoDevice(f"{target} was asked for, but this process sees {count} CUDA device(s)")
    return torch.device("cuda", index)


# ---------------------------------------------------------------- CUDA calls


#: cudaHostRegisterPortable: the range is pinned for every CUDA context of the process, not only the one
#: current on the registering thread (without it, a copy on another device's stream, say a restore to
#: cuda:1 asked for from a thread whose device is cuda:0, would treat the memory as pageable: ≈ 9× slower).
_PORTABLE = 1
#: Whether registrations ask for _PORTABLE (cleared, once, where the driver refuses it but not the rest).
_portable = [True]


#: cudaHostRegister's answers that refuse the memory itself (invalid value, out of memory, already
#: registered, not supported): that range is copied unpinned from then on. Any other code may be an
#: error an earlier asynchronous launch left ("may also return error codes from previous, asynchronous
#: launches"), or a passing one: that transfer copies unpinned and the range is asked again next time.
#: Either way the error is cleared: left, torch would raise it at the engine's next, unrelated launch
#: (an earlier launch's sticky error still shows at the engine's next call).
_REFUSALS = frozenset({1, 2, 712, 801})


def _cuda_register(address: int, nbytes: int, flags: int) -> bool | None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    if _portable[0]:
        err = cudart.cudaHostRegister(address, nbytes, flags | _PORTABLE)
        code = int(getattr(err, "value", err))
        if code == 0:
            return True
        _clear_last_error()
        if code not in _REFUSALS:
            log.warning("cudaHostRegister of %d bytes: %s (not a refusal): unpinned this time", nbytes, err)
            return None
    err = cudart.cudaHostRegister(address, nbytes, flags)
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_last_error()
        if code not in _REFUSALS:
            log.warning("cudaHostRegister of %d bytes: %s (not a refusal): unpinned this time", nbytes, err)
            return None
        log.warning("cudaHostRegister of %d bytes refused (%s): copying that memory unpinned", nbytes, err)
        return False
    if _portable[0]:
        _portable[0] = False
        log.info("cudaHostRegisterPortable refused where the registration alone is not: not asked again")
    return True


def _current_context_of(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """The batch call is a driver call, run in the calling thread's current context: that of ``stream``'s
    device must be current (the caller's device may be another; torch's ``copy_`` sees to it itself)."""
    index = _device_index_of(stream)
    if index is None or index == torch.cuda.current_device():  # (None: the simulator's stand-ins)
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _cuda_unregister(address: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
    if int(getattr(err, "value", err)) != 0:
        _clear_last_error()


def _clear_last_error() -> None:
    """A failed runtime call leaves its error for the next ``cudaGetLastError`` of the same runtime
    library in this thread, which torch would then raise at an unrelated kernel launch: cleared in
    torch's runtime (the one ``torch.cuda.cudart()`` calls go through), not cuda-bindings' (linked into it
    statically: clearing that one leaves torch's error in place)."""
    library = _torch_runtime()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def _torch_runtime() -> Any:
    """torch's CUDA runtime library as loaded (``libcudart.so.<major>``, by its soname, else the mapped
    file of that name); None where none is loaded (a torch that links it statically)."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        names += sorted({line.split(None, 5)[5].strip() for line in maps
                         if "/libcudart.so" in line and len(line.split(None, 5)) == 6})  # fmt: skip
    for name in names:
        try:
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        library.cudaGetLastError.restype = ctypes.c_int
        return library
    log.debug("no loaded libcudart found: a failed registration's error is not cleared")
    return None


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", ctypes.c_uint * 2),
        ("dstLocHint", ctypes.c_uint * 2),
        ("flags", ctypes.c_uint),
    ]


_BATCH_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_uint,  # CUresult
    ctypes.c_void_p,  # dsts
    ctypes.c_void_p,  # srcs
    ctypes.c_void_p,  # sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # attrs
    ctypes.c_void_p,  # attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # failIdx (the 12.8 entry point)
    ctypes.c_void_p,  # stream
)
_batch: list[Any] = []  # [] not looked up yet, [None] unavailable, [function]


def _batch_function() -> Any:
    if not _batch:
        function = None
        try:
            from cuda.bindings import driver

            err, address, _status = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
            if err == driver.CUresult.CUDA_SUCCESS and int(address):
                function = _BATCH_TYPE(int(address))
        except Exception as exc:  # no cuda-bindings, or a driver older than 12.8
            log.debug("cuMemcpyBatchAsync is not available (%s): one copy per run", exc)
        _batch.append(function)
    return _batch[0]


def batch_available() -> bool:
    """Whether copies go out as one ``cuMemcpyBatchAsync`` per transfer (else one copy per run)."""
    return _batch_function() is not None


_thread_device = threading.local()  # .index: the device _make_current made current on this thread


def _make_current(index: int | None) -> None:
    """Makes ``cuda:index`` current on one of skippyd's own threads (the leases', the idle sweeper's),
    once per change (None: no device, the simulator's). Their CUDA runtime calls (an event's wait,
    unregistering) on a thread with no device made current would create a context on device 0: hundreds
    of MiB of a GPU the process may not use. Never on a caller's thread (its current device is its own)."""
    if index is None or getattr(_thread_device, "index", None) == index:
        return
    torch.cuda.set_device(index)
    _thread_device.index = index


def _device_index_of(stream: Any) -> int | None:
    """The CUDA device of ``stream`` (None: the simulator's stand-ins, or no stream)."""
    device = getattr(stream, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return device.index
    return None


def _event() -> Any:
    """The event of copies whose leases the leases' thread holds. Blocking: that thread waits for every
    copy in flight, and sleeps instead of spinning a core the whole time (a default event's wait spins
    where the process has fewer CUDA contexts than CPUs, which is every engine), for a wake-up of tens
    of µs before the leases go, which delays no caller (the caller's stream waits on the event on the
    GPU). A put's own wait before its request goes out keeps a default event (the caller waits briefly
    and a wake-up would add to every put)."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
