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

__all__ = ["in_callers_streams"]

T = TypeVar("T")


def in_callers_streams(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, to be run on another thread with this thread's CUDA device and current streams."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return fn
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
