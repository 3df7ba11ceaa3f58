"""The transfer layer: how bytes move between skippyd's shared memory and a device (client side only).

* :mod:`.plan`: the copies of one transfer merged into contiguous runs (pure logic).
* :mod:`.book`: which host memory is registered with CUDA, for which generation of its file or slot
  (pure logic, with injected register/unregister calls).
* :mod:`.streams`: the caller's CUDA streams carried into a worker thread (the async client's copies).
* :mod:`.device` (imports torch): CUDA device checks (a typed :class:`~skippyd.errors.NoDevice`), kept
  mappings of the daemon's files, the registrations, skippyd's own CUDA stream per direction, batched
  copies (``cuMemcpyBatchAsync`` when ``cuda-bindings`` has it, else one ``cudaMemcpyAsync`` per run
  through torch) and the events the caller's stream waits on.

The daemon never imports this package. CPU copies do not go through it (they stay plain memcpys).
"""

from __future__ import annotations

import sys

from .book import BookStats, RegistrationBook, page_span
from .plan import Run, plan_runs, split_runs, total_bytes
from .streams import cuda_in_use, in_callers_streams

__all__ = [
    "BookStats",
    "RegistrationBook",
    "Run",
    "cuda_in_use",
    "forget_host",
    "in_callers_streams",
    "page_span",
    "plan_runs",
    "split_runs",
    "total_bytes",
]


def forget_host(address: int) -> None:
    """Unregisters host memory at ``address`` (a staging mapping about to be unmapped), if the device
    side registered it; imports nothing when it never ran."""
    device = sys.modules.get("skippyd.transfer.device")
    if device is not None:
        device.forget_host(address)
