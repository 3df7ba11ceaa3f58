"""The transfer layer: how bytes move between skippyd's shared memory and a device (client side only).

* :mod:`.plan`: the copies of one transfer merged into contiguous runs (pure logic).
* :mod:`.book`: which host memory is registered with CUDA, for which generation of its file or slot
  (pure logic, with injected register/unregister calls).
* :mod:`.streams`: the caller's CUDA streams carried into a worker thread (the async client's copies).
* :mod:`.device` (imports torch): the registrations, skippyd's own CUDA stream per direction, batched
  copies (``cuMemcpyBatchAsync`` when ``cuda-bindings`` has it, else one ``cudaMemcpyAsync`` per run
  through torch) and the events the caller's stream waits on; on :mod:`.cuda` (CUDA device checks, a
  typed :class:`~skippyd.errors.NoDevice`; registration and the batch call's binding), :mod:`.filemaps`
  (kept mappings of the daemon's files) and :mod:`.leases` (descriptors held until a copy has landed).

The daemon never imports this package. CPU copies do not go through it (they stay plain memcpys).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys

from .book import BookStats, RegistrationBook, page_span
from .plan import Run, plan_runs, split_runs, total_bytes
from .streams import cuda_in_use, in_callers_streams

__all__ = [
    "BookStats",
    "RegistrationBook",
    "Run",
    "cuda_in_use",
    "in_callers_streams",
    "map_without_leases",
    "page_span",
    "plan_runs",
    "release_host",
    "split_runs",
    "total_bytes",
]


def release_host(mapping: mmap.mmap, addresses: tuple[int, ...]) -> None:
    """Closes a staging mapping (its client's close, or a finalizer's call: any thread, any point, never
    waiting). Where the device side registered a range of it, that range is unregistered first, at the
    transfer's next call or idle sweep, and only then the mapping closed (until then it stays mapped, so
    no new mapping can take its addresses); imports nothing when the device side never ran."""
    device = sys.modules.get("skippyd.client.transfer.device")
    if device is None or not device.release_host(mapping, addresses):
        with contextlib.suppress(BufferError):
            mapping.close()


def map_without_leases(fd: int, size: int) -> tuple[int, mmap.mmap] | None:
    """A read-only shared mapping of ``size`` bytes of the file open as ``fd``, made through a fresh open
    file description (``/proc/self/fd``) and that description's fd (to notice the file unlinked); None
    where this process may not open the file again (a daemon of another user) or map it (``ENOMEM``: the
    address space or ``vm.max_map_count`` is used up): the caller copies through the reply's fd instead.

    Never the reply's own descriptor: it holds the read leases (``F_OFD_SETLK``) on what the reply
    served, and an OFD lock lives as long as its description, mappings included; a mapping kept across
    calls would keep them, and the daemon could neither reuse nor give back those slots."""
    try:
        keep = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return keep, mmap.mmap(keep, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError:
        os.close(keep)
        return None
    except BaseException:
        os.close(keep)
        raise
