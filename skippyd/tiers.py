"""The rules across tiers: where a capture goes, which tier answers a lookup, what a restore serves.

The daemon's handlers talk to this one object; it owns the L2 tier (and, when configured, the L3 tier
and the coordination layer, each through a small interface). It never touches sockets and never
imports torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument, TooLarge
from .keys import Identity, cache_key, prefix_keys, token_count
from .l2 import L2Entry, L2Tier, copy_into
from .payload import TensorDecl, plan_layout

__all__ = ["CaptureOutcome", "Located", "Opened", "Tiers"]


@dataclass(frozen=True, slots=True)
class CaptureOutcome:
    digest: str
    token_count: int
    nbytes: int
    l2: bool
    l3: bool


@dataclass(frozen=True, slots=True)
class Located:
    token_count: int
    source: str
    digest: str
    nbytes: int


@dataclass(slots=True)
class Opened:
    """An entry opened for a restore: its description and a leased read-only fd (caller closes)."""

    entry: L2Entry
    fd: int
    source: str
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class OpCounters:
    captures: int = 0
    capture_bytes: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    restores: int = 0
    restore_hits: int = 0
    restore_bytes: int = 0
    evictions_requested: int = 0


class Tiers:
    """L2 today; L3 and coordination plug in through ``on_capture`` hooks and the same lookup path."""

    def __init__(self, l2: L2Tier, *, copy_threads: int = 2, max_entry: int | None = None) -> None:
        self.l2 = l2
        self._copy_threads = copy_threads
        self._max_entry = max_entry
        self._lock = threading.Lock()
        self.counters = OpCounters()
        self.capture_hooks: list[Callable[[Identity, bytes, L2Entry, bool], bool]] = []

    # ----------------------------------------------------------------- capture
    def capture(
        self,
        *,
        identity: Identity,
        tokens: bytes,
        tensors: Sequence[TensorDecl],
        source: memoryview,
        kind: str = "kv",
        meta: Mapping[str, Any] | None = None,
        durable: bool = True,
    ) -> CaptureOutcome:
        """Copies the tensors out of ``source`` (laid out by :func:`plan_layout`) into a new L2 entry.

        The copy lands in memory only the daemon can write, and the digest is computed over it there, so
        whatever the client does to ``source`` afterwards cannot change the committed entry.
        """
        count = token_count(tokens)
        if count == 0:
            raise InvalidArgument("a capture needs at least one token")
        specs, data_len = plan_layout(tensors)
        if data_len > len(source):
            raise InvalidArgument(
                f"the staging buffer holds {len(source)} bytes; the tensors need {data_len}"
            )
        if self._max_entry is not None and data_len > self._max_entry:
            raise TooLarge(f"an entry of {data_len} bytes exceeds the entry limit of {self._max_entry}")
        key = cache_key(identity, tokens)
        with self.l2.reserve(
            key=key, identity=identity, token_count=count, tensors=tensors, kind=kind, meta=meta
        ) as reservation:
            for spec in specs:
                copy_into(
                    reservation.data,
                    spec.offset,
                    spec.nbytes,
                    source[spec.offset : spec.offset + spec.nbytes],
                    threads=self._copy_threads,
                )
            entry = reservation.commit()
        l3 = False
        for hook in self.capture_hooks:
            l3 = hook(identity, tokens, entry, durable) or l3
        with self._lock:
            self.counters.captures += 1
            self.counters.capture_bytes += entry.nbytes
        return CaptureOutcome(entry.digest, entry.token_count, entry.nbytes, True, l3)

    # ----------------------------------------------------------------- lookup / restore
    def lookup(self, identity: Identity, tokens: bytes) -> Located | None:
        """The longest captured prefix, without touching recency (a restore does that)."""
        token_count(tokens)
        entry = self._find(identity, tokens, touch=False)
        with self._lock:
            self.counters.lookups += 1
            if entry is not None:
                self.counters.lookup_hits += 1
        if entry is None:
            return None
        return Located(entry.token_count, "l2", entry.digest, entry.nbytes)

    def open_restore(self, identity: Identity, tokens: bytes) -> Opened | None:
        """The longest captured prefix, opened for reading with a lease; counts a hit and moves recency."""
        started = time.perf_counter()
        token_count(tokens)
        for _attempt in range(3):
            entry = self._find(identity, tokens, touch=True)
            if entry is None:
                break
            opened = self.l2.open_reader(entry.key)
            if opened is None:  # evicted between the lookup and the open: look again
                continue
            fd, current = opened
            with self._lock:
                self.counters.restores += 1
                self.counters.restore_hits += 1
                self.counters.restore_bytes += current.nbytes
            return Opened(current, fd, "l2", {"lookup_ms": (time.perf_counter() - started) * 1e3})
        with self._lock:
            self.counters.restores += 1
        return None

    def _find(self, identity: Identity, tokens: bytes, *, touch: bool) -> L2Entry | None:
        if touch:
            return self.l2.lookup(identity, tokens)
        lengths = self.l2.prefix_lengths(identity.digest, len(tokens) // 4)
        if not lengths:
            return None
        for key in reversed(prefix_keys(identity, tokens, lengths)):
            entry = self.l2.peek(key)
            if entry is not None:
                return entry
        return None

    # ----------------------------------------------------------------- admin
    def evict_digest(self, digest: str) -> int:
        with self._lock:
            self.counters.evictions_requested += 1
        return self.l2.remove_by_digest(digest)

    def evict_all(self) -> int:
        with self._lock:
            self.counters.evictions_requested += 1
        return self.l2.clear()

    def entries(self) -> list[dict[str, Any]]:
        now = time.time_ns()
        return [
            {
                "tier": "l2",
                "digest": e.digest,
                "token_count": e.token_count,
                "kind": e.kind,
                "nbytes": e.nbytes,
                "file_size": e.file_size,
                "age_s": max(0.0, (now - e.created_ns) / 1e9),
                "idle_s": max(0.0, (now - last_use) / 1e9),
                "tensors": len(e.tensors),
            }
            for e, last_use in reversed(self.l2.entries_with_last_use())
        ]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            ops = _slots(self.counters)
        return {"l2": self.l2.stats().as_dict(), "ops": ops}

    def housekeeping(self) -> None:
        self.l2.flush_recency()
        self.l2.trim_free(idle_seconds=300.0)

    def close(self) -> None:
        self.l2.close()


def _slots(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}
