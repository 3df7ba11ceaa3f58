"""The registration book: which host memory is registered with CUDA, for which generation of its file.

Pure logic (no torch, no CUDA): the calls that register and unregister are injected, so the CPU tests
drive the book with a hook that records them. The device side (:mod:`skippyd.transfer.device`) passes
``cudaHostRegister``/``cudaHostUnregister``.

* **Once per memory.** A range is registered the first time a copy needs it and kept for the next
  copies; a later copy that needs more of the same mapping registers only the part not yet covered
  (ranges are never merged: a run is cut at registration boundaries instead, see
  :func:`skippyd.transfer.plan.split_runs`). Ranges are page-aligned, so two never share a page.
* **Read-only where it only reads** (``cudaHostRegisterReadOnly``, flag 8, for a ``PROT_READ`` mapping).
* **Generations.** Every source names the generation the daemon gave its file (a slab or an entry file).
  When the daemon punched a slot and filled it again (or recycled a file), its generation changed: the
  pages the old registration pinned are not the file's any more, so every range of that source is
  unregistered and registered again before a copy uses it.
* **Bounded.** At most ``limit_bytes`` registered; the least recently used sources go first (never one
  the current call needs). ``drop`` unregisters a source before its mapping goes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["PAGE", "BookStats", "RegistrationBook", "page_span"]

PAGE = 4096
READ_ONLY = 8  # cudaHostRegisterReadOnly
DEFAULT = 0  # cudaHostRegisterDefault

#: ``register(address, nbytes, flags) -> bool`` (False: this memory cannot be registered; copies still
#: work, unpinned) and ``unregister(address)``.
Register = Callable[[int, int, int], bool]
Unregister = Callable[[int], None]


def page_span(start: int, end: int) -> tuple[int, int]:
    """``[start, end)`` widened to whole pages."""
    return start // PAGE * PAGE, -(-end // PAGE) * PAGE


@dataclass(slots=True)
class BookStats:
    registered_bytes: int = 0
    registrations: int = 0
    unregistrations: int = 0
    generation_changes: int = 0
    failures: int = 0


@dataclass(slots=True)
class _Source:
    generation: int
    base: int  # the mapping's address: a range [a, b) of the source is registered at base + a
    readonly: bool
    ranges: list[tuple[int, int]] = field(default_factory=list)  # sorted, disjoint, page-aligned
    unregistrable: bool = False

    def nbytes(self) -> int:
        return sum(b - a for a, b in self.ranges)


class RegistrationBook:
    """Registrations of host memory by source (a mapped file), generation and range. Not thread-safe:
    the device transfer calls it under its own lock."""

    def __init__(self, register: Register, unregister: Unregister, *, limit_bytes: int = 64 << 30) -> None:
        self._register = register
        self._unregister = unregister
        self.limit_bytes = limit_bytes
        self._sources: OrderedDict[Hashable, _Source] = OrderedDict()  # least recently used first
        self.stats = BookStats()

    def ensure(
        self,
        key: Hashable,
        generation: int,
        base: int,
        spans: Sequence[tuple[int, int]],
        *,
        readonly: bool,
    ) -> list[int] | None:
        """Registers what ``spans`` (byte ranges of the source ``key``, mapped at ``base``) need and is not
        registered for this ``generation`` yet; returns the registration boundaries inside them (to
        cut runs at), or None when the memory cannot be registered (copy it unpinned)."""
        source = self._sources.get(key)
        if source is not None and (
            source.generation != generation or source.base != base or source.readonly != readonly
        ):
            if source.generation != generation:
                self.stats.generation_changes += 1
            self.drop(key)
            source = None
        if source is None:
            source = self._sources[key] = _Source(generation, base, readonly)
        self._sources.move_to_end(key)
        if source.unregistrable:
            return None
        wanted = _merge([page_span(a, b) for a, b in spans if b > a])
        missing = _gaps(source.ranges, wanted)
        need = sum(b - a for a, b in missing)
        if need:
            self._make_room(need, keep=key)
            flags = READ_ONLY if readonly else DEFAULT
            for a, b in missing:
                if not self._register(base + a, b - a, flags):
                    self.stats.failures += 1
                    source.unregistrable = True
                    self.drop(key, forget=False)
                    return None
                source.ranges.append((a, b))
                self.stats.registrations += 1
                self.stats.registered_bytes += b - a
            source.ranges.sort()
        return sorted({x for a, b in source.ranges for x in (a, b) if _touches(a, b, wanted)})

    def drop(self, key: Hashable, *, forget: bool = True) -> None:
        """Unregisters every range of ``key`` (call before its mapping is unmapped)."""
        source = self._sources.get(key)
        if source is None:
            return
        for a, b in source.ranges:
            self._unregister(source.base + a)
            self.stats.unregistrations += 1
            self.stats.registered_bytes -= b - a
        source.ranges = []
        if forget:
            del self._sources[key]

    def close(self) -> None:
        for key in list(self._sources):
            self.drop(key)

    def generation(self, key: Hashable) -> int | None:
        source = self._sources.get(key)
        return source.generation if source is not None else None

    def ranges(self, key: Hashable) -> list[tuple[int, int]]:
        source = self._sources.get(key)
        return list(source.ranges) if source is not None else []

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sources

    def _make_room(self, need: int, *, keep: Hashable) -> None:
        for key in list(self._sources):
            if self.stats.registered_bytes + need <= self.limit_bytes:
                return
            if key != keep:
                self.drop(key)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    spans.sort()
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _gaps(have: Sequence[tuple[int, int]], want: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``want`` (sorted, disjoint) that no range of ``have`` (sorted, disjoint) covers."""
    out: list[tuple[int, int]] = []
    for a, b in want:
        at = a
        for ha, hb in have:
            if hb <= at:
                continue
            if ha >= b:
                break
            if ha > at:
                out.append((at, ha))
            at = max(at, hb)
            if at >= b:
                break
        if at < b:
            out.append((at, b))
    return out


def _touches(a: int, b: int, wanted: Sequence[tuple[int, int]]) -> bool:
    return any(a < wb and wa < b for wa, wb in wanted)
