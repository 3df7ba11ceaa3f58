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
    """``fn``, to be run on another thread with this thread's CUDA device and current streams."""
    if not cuda_in_use():
        return fn
    torch: Any = sys.modules["torch"]
    device = torch.cuda.current_device()
    streams = [torch.cuda.current_stream(index) for index in range(torch.cuda.device_count())]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        before_device = torch.cuda.current_device()
        before = [torch.cuda.current_stream(index) for index in range(len(streams))]
        try:
            for stream in streams:
                torch.cuda.set_stream(stream)  # (sets that stream's device current as well)
            torch.cuda.set_device(device)
            return fn(*args, **kwargs)
        finally:  # a pool thread goes back as it was
            for stream in before:
                torch.cuda.set_stream(stream)
            torch.cuda.set_device(before_device)

    return run
