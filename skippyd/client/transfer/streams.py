"""The caller's CUDA streams, carried into a worker thread.

PyTorch's current stream is per thread: an async client that runs a copy with ``asyncio.to_thread``
would otherwise order skippyd's copies against the worker thread's default stream, not against the
caller's (so a copy could overwrite a destination the caller's stream still reads, or the caller read it
before the bytes land). :func:`in_callers_streams` wraps a function, on the calling thread, so that it runs
with the caller's current device and its current stream on every device; where CUDA was never
initialised in this process (every CPU-only host) it returns the function itself, and torch is not
imported for it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["cuda_in_use", "in_callers_streams"]

T = TypeVar("T")


def cuda_in_use() -> bool:
    """Whether this process initialised CUDA (no CUDA tensor exists before it does): the CPU paths' one
    check, which never imports torch."""
    torch: Any = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def in_callers_streams(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, to be run on another thread with this thread's CUDA device and current streams.

    Carried: the current stream of this thread's device, and that of every other device where it is not
    the default stream (the caller chose it, so that device has a context). No other device is made
    current on the worker, before or after: making a device current (``cudaSetDevice``, which
    ``torch.cuda.set_stream`` of another device's stream calls) creates its primary context, hundreds of
    MiB of that GPU's memory, in every engine process that sees all of a host's GPUs (one per rank, say)
    but uses one. For the same reason the worker goes back to its own device with torch's
    ``_maybe_exchange_device``, which makes it current only where it already has a context."""
    if not cuda_in_use():
        return fn
    torch: Any = sys.modules["torch"]
    device = torch.cuda.current_device()
    streams = [torch.cuda.current_stream(device)]
    for index in range(torch.cuda.device_count()):
        if index != device:
            stream = torch.cuda.current_stream(index)  # (reading a device's current stream creates nothing)
            if stream != torch.cuda.default_stream(index):
                streams.append(stream)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        before_device = torch.cuda.current_device()  # (cudaGetDevice: creates no context)
        before = [torch.cuda.current_stream(stream.device_index) for stream in streams]
        try:
            for stream in streams:
                torch.cuda.set_stream(stream)  # (sets that stream's device current as well)
            torch.cuda.set_device(device)
            return fn(*args, **kwargs)
        finally:  # a pool thread goes back as it was
            for stream in before:
                torch.cuda.set_stream(stream)
            _back_to_device(torch, before_device)

    return run


def _back_to_device(torch: Any, index: int) -> None:
    """Makes ``index`` this thread's device again without creating its context (where it has none, torch
    only remembers it as the thread's device until something needs one)."""
    exchange = getattr(torch.cuda, "_maybe_exchange_device", None)
    if exchange is not None:
        exchange(index)
    else:  # (a torch older than 2.1)
        torch.cuda.set_device(index)
