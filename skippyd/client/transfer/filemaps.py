"""Kept shared mappings of the daemon's files on the client (imports torch for their byte views).

:class:`FileMaps` keeps mappings of the daemon's linked files (entry files, block slabs), made through a
fresh open file description (``/proc/self/fd``), so a kept mapping holds no lease: the daemon may evict
and reuse the memory, and the *generation* of an entry file or of a slab's slot (docs/protocol.md) says
when it did. :func:`slab_slot_map` reads a mapped slab's slot generations from its records.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import map_without_leases
from .book import SlotMap

__all__ = ["FileMaps", "slab_slot_map"]


@dataclass(slots=True)
class _Mapped:
    keep: int  # our own description of the file (no lease): to notice it was removed
    mapping: mmap.mmap
    size: int
    base: int  # the mapping's address
    host: torch.Tensor  # uint8 over the whole mapping
    writable: bool


def _address_of(buffer: Any) -> tuple[int, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: torch warns that it is not writable
        host = torch.frombuffer(buffer, dtype=torch.uint8)
    return host.data_ptr(), host


def _linked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink > 0
    except OSError:
        return False


_LOOK_EVERY_CALL = 256  # kept mappings up to which every sweep looks at all of them


class FileMaps:
    """Shared mappings of the daemon's linked files (slabs, entry files), kept across calls by (device,
    inode): the ``limit`` most recently used. Made through ``/proc/self/fd`` (a fresh description: no
    lease is held by a kept mapping) and dropped once the file is unlinked. ``on_drop(key)`` runs before
    a mapping goes (the device transfer waits for the copies in flight and unregisters it). Mappings in
    ``pinned`` (collected copies not issued yet) are never dropped; the limit may be passed meanwhile."""

    def __init__(self, on_drop: Callable[[Hashable], None], limit: int = 256) -> None:
        self.limit = limit
        self._on_drop = on_drop
        self._maps: OrderedDict[Hashable, _Mapped] = OrderedDict()
        self.pinned: Counter[Hashable] = Counter()
        self._swept = 0.0

    def get(self, fd: int, end: int, needed: Collection[Hashable] = ()) -> tuple[Hashable, _Mapped] | None:
        """The mapping of the file open as ``fd`` covering ``[0, end)``; None for a descriptor that is not
        a linked regular file (a memfd: served once) or that this process cannot open again (the caller
        copies another way). Mappings in ``needed`` (and pinned ones) are not dropped to make room. A kept
        mapping is used only while its own file is still linked (so never for another file that took its
        inode number)."""
        info = os.fstat(fd)
        if info.st_nlink == 0 or not stat.S_ISREG(info.st_mode) or info.st_size < end:
            return None
        key = (info.st_dev, info.st_ino)
        found = self._maps.get(key)
        if found is not None and found.size == info.st_size and _linked(found.keep):
            self._maps.move_to_end(key)
            return key, found
        if found is not None:
            self.drop(key)
        made = map_without_leases(fd, info.st_size)
        if made is None:  # (a file this process may not open again, or map: used through the reply's fd)
            return None
        keep, mapping = made
        base, host = _address_of(mapping)
        self._maps[key] = _Mapped(keep, mapping, info.st_size, base, host, False)
        if len(self._maps) > self.limit:
            for old in [k for k in self._maps if k != key and not self.pinned[k] and k not in needed]:
                self.drop(old)
                if len(self._maps) <= self.limit:
                    break
        return key, self._maps[key]

    def sweep(self, *, every: float = 0.0) -> None:
        """Drops mappings of files the daemon removed (their pages would stay alive through us), then the
        least recently used past the limit; with ``every``, looks for removed files only if the last
        look is that many seconds old (a call's own mappings are checked by :meth:`get` either way).
        Past ``_LOOK_EVERY_CALL`` mappings (a raised ``SKIPPYD_KEPT_FILES``) the looks are spaced out in
        proportion (0.1 s a 256: one ``fstat`` a mapping), so a large working set does not cost each
        call milliseconds and a removed file's pages go within seconds."""
        now = time.monotonic()
        if len(self._maps) > _LOOK_EVERY_CALL:
            every = max(every, 0.1 * len(self._maps) / _LOOK_EVERY_CALL)
        if not every or now - self._swept >= every:
            self._swept = now
            for key, mapped in list(self._maps.items()):
                if self.pinned[key]:
                    continue
                try:
                    gone = os.fstat(mapped.keep).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    self.drop(key)
        if len(self._maps) > self.limit:  # (a layered get may pass it): the least recently used go
            for key in [k for k in self._maps if not self.pinned[k]][: len(self._maps) - self.limit]:
                self.drop(key)

    def drop(self, key: Hashable) -> None:
        mapped = self._maps.pop(key, None)
        if mapped is None:
            return
        self._on_drop(key)
        del mapped.host
        with contextlib.suppress(BufferError):
            mapped.mapping.close()
        with contextlib.suppress(OSError):
            os.close(mapped.keep)

    def peek(self, key: Hashable) -> _Mapped | None:
        """The kept mapping of ``key``, if any (its recency unchanged)."""
        return self._maps.get(key)

    def close(self) -> None:
        for key in list(self._maps):
            self.drop(key)

    def __len__(self) -> int:
        return len(self._maps)


# The slab file layout a client reads slot generations from (docs/format.md, "Block slabs"; the daemon's
# skippyd.l2.slabs writes it, and a test holds the two to the same numbers)
_SLAB_MAGIC, _SLAB_VERSION = b"SKPSLAB1", 1
_SLAB_HEAD = struct.Struct("<8sIIQQ")  # magic, version, slots, slot_size, data_start
_RECORDS_AT, _RECORD_BYTES, _GENERATION_AT, _MAX_SLOTS = 4096, 256, 192, 256


def slab_slot_map(host: np.ndarray) -> SlotMap | None:
    """A mapped slab's slot generations, as a ``blocks_get`` reply's slot map gives them, read from its
    records (``host``: uint8 over the whole file); None when it is not a slab of this layout, or one
    whose records do not carry them (an older daemon's: zero)."""
    if len(host) < _RECORDS_AT:
        return None
    magic, version, slots, slot_size, data_start = _SLAB_HEAD.unpack(host[: _SLAB_HEAD.size].tobytes())
    if (
        magic != _SLAB_MAGIC
        or version != _SLAB_VERSION
        or not 1 <= slots <= _MAX_SLOTS
        or data_start < _RECORDS_AT + slots * _RECORD_BYTES
        or len(host) < data_start + slots * slot_size
    ):
        return None
    records = host[_RECORDS_AT : _RECORDS_AT + slots * _RECORD_BYTES].reshape(slots, _RECORD_BYTES)
    fields = records[:, _GENERATION_AT : _GENERATION_AT + 8]
    if not fields.any(axis=1).all():
        return None  # a slab of a daemon that does not write them (generation 0 is never given)
    return data_start, slot_size, fields.tobytes()
