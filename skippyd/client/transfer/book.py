"""The registration book: which host memory is registered with CUDA, for which generation of its file.

Pure logic (no torch, no CUDA): the calls that register and unregister are injected, so the CPU tests
drive the book with a hook that records them. The device side (:mod:`skippyd.client.transfer.device`) passes
``cudaHostRegister``/``cudaHostUnregister``.

* **Once per memory.** A range is registered the first time a copy needs it and kept for the next
  copies; a later copy that needs more of the same mapping registers only the part not yet covered
  (ranges are never merged: a run is cut at registration boundaries instead, see
  :func:`skippyd.client.transfer.plan.split_runs`). Ranges are page-aligned, so two never share a page.
* **Read-only where it only reads** (``cudaHostRegisterReadOnly``, flag 8, for a ``PROT_READ`` mapping).
* **Generations.** Every span a copy needs carries the generation the daemon gave its memory: an entry
  file's (one unit: another generation unregisters every range of that file), or a block slot's
  (``span_generations``: one per span, docs/protocol.md "Generations"). The book remembers, for every
  registered range, the generation of each span it was registered for; a span whose slot generation
  changed (the daemon punched that slot, and may have filled it again: new pages) makes the book
  unregister the ranges that overlap it and register the span again. Ranges of the same file that
  cover only unchanged slots stay registered.
* **Bounded.** At most ``limit_bytes`` registered; the least recently used sources go first (never one
  the current call needs). ``drop`` unregisters a source before its mapping goes.
"""

from __future__ import annotations

import bisect
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["PAGE", "BookStats", "RegistrationBook", "SlotMap", "page_span"]

PAGE = 4096
READ_ONLY = 8  # cudaHostRegisterReadOnly
DEFAULT = 0  # cudaHostRegisterDefault

#: ``register(address, nbytes, flags) -> bool | None`` (True: registered; False: this memory cannot be
#: registered, never asked again; None: it failed for another reason, say an error an earlier launch
#: left, asked again next time; copies work either way, unpinned) and ``unregister(address)``.
Register = Callable[[int, int, int], bool | None]
Unregister = Callable[[int], None]

#: A slab's slots as a ``blocks_get`` reply shows them (``slot_maps``, docs/protocol.md "Generations"):
#: where its slots start, their size, and every slot's generation (8 bytes little-endian each).
SlotMap = tuple[int, int, bytes]


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
    #: what each range was registered for: (start, end, generation), sorted, disjoint, page-aligned, each
    #: inside one range (a range is the union of its parts)
    parts: list[tuple[int, int, int]] = field(default_factory=list)
    unregistrable: bool = False
    slotted: bool = False  # generations per span (a slab's slots), not one for the file
    seen_map: bytes = b""  # the slot generations last compared (a slab's map: the same one needs no look)

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
        span_generations: Sequence[int] | None = None,
        slot_map: SlotMap | None = None,
        keep: Collection[Hashable] = (),
    ) -> list[int] | None:
        """Registers what ``spans`` (byte ranges of the source ``key``, mapped at ``base``) need and is not
        registered for their generation yet; returns the registration boundaries inside them (to cut runs
        at), or None when the memory cannot be registered (copy it unpinned).

        Without ``span_generations`` every span has the file's ``generation`` (an entry file: another
        generation drops every range of the source). With it (one per span: a slab's slot generations)
        the file's ``generation`` is not compared; a range is dropped and registered again only where a
        span's generation differs from the one a part of that range was registered for. ``slot_map``
        (a slab's, from the same reply): when the file's generation grew since the last map compared (a
        slot of it was punched), every range holding a slot whose generation changed is dropped, wanted or not
        (its old pages would otherwise stay pinned until that slot is read again). Making room never drops
        ``key`` nor the sources in ``keep`` (the other sources of the same transfer, whose copies were
        planned against their registrations already)."""
        slotted = span_generations is not None
        source = self._sources.get(key)
        if source is not None and (
            source.base != base
            or source.readonly != readonly
            or source.slotted != slotted
            or (not slotted and source.generation != generation)
        ):
            if not slotted and source.generation != generation:
                self.stats.generation_changes += 1
            self.drop(key)
            source = None
        if source is None:
            source = self._sources[key] = _Source(generation, base, readonly, slotted=slotted)
        if not slotted:
            source.generation = generation
        elif slot_map is not None and generation > source.generation:
            # the file's generation only grows; it is recorded where a map was compared (a reply without
            # one, or an older reply answered late, must not hide a punch from the next map)
            self._drop_punched(source, slot_map)
            source.generation = generation
        self._sources.move_to_end(key)
        if source.unregistrable:
            return None
        gens = span_generations if span_generations is not None else [generation] * len(spans)
        if len(gens) != len(spans):
            raise ValueError("span_generations must name one generation per span")
        wanted_parts = _merge_parts(
            [(*page_span(a, b), g) for (a, b), g in zip(spans, gens, strict=True) if b > a]
        )
        wanted = _merge([(a, b) for a, b, _ in wanted_parts])
        if slotted:
            self._drop_stale(source, wanted_parts)
        missing = _gaps(source.ranges, wanted)
        need = sum(b - a for a, b in missing)
        if need:
            self._make_room(need, keep=key, also=keep)
            flags = READ_ONLY if readonly else DEFAULT
            for a, b in missing:
                registered = self._register(base + a, b - a, flags)
                if not registered:
                    self.stats.failures += 1
                    source.unregistrable = registered is False
                    self.drop(key, forget=False)
                    return None
                bisect.insort(source.ranges, (a, b))
                for part in _clip(wanted_parts, a, b):
                    bisect.insort(source.parts, part)
                self.stats.registrations += 1
                self.stats.registered_bytes += b - a
        return sorted({x for a, b in source.ranges for x in (a, b) if _touches(a, b, wanted)})

    def _drop_stale(self, source: _Source, wanted: Sequence[tuple[int, int, int]]) -> None:
        """Unregisters every range of ``source`` holding a part that overlaps a wanted span of another
        generation (its pages may not be the file's any more)."""
        stale: set[tuple[int, int]] = set()
        parts = source.parts
        i = 0
        for wa, wb, wg in wanted:  # both sorted and disjoint: one sweep
            while i < len(parts) and parts[i][1] <= wa:
                i += 1
            j = i
            while j < len(parts) and parts[j][0] < wb:
                if parts[j][2] != wg:
                    stale.add(self._range_of(source, parts[j][0]))
                j += 1
        self._unregister_ranges(source, stale)

    def _drop_punched(self, source: _Source, slot_map: SlotMap) -> None:
        """Unregisters every range of ``source`` holding a part registered for a slot whose generation in
        ``slot_map`` differs: its pages were punched (only pages wholly inside a slot are: a slot smaller
        than a page, or a page shared with the next, keeps its page; such parts are left alone)."""
        start, size, table = slot_map
        generations = array("Q")
        generations.frombytes(table)
        if sys.byteorder != "little":
            generations.byteswap()
        source.seen_map = table
        stale: set[tuple[int, int]] = set()
        for a, b, g in source.parts:
            first = max(0, (a - start) // size)
            last = min(len(generations), -(-(b - start) // size))
            for slot in range(first, last):
                at = start + slot * size
                lo, hi = -(-at // PAGE) * PAGE, (at + size) // PAGE * PAGE  # the pages wholly inside it
                if hi > lo and lo < b and a < hi and generations[slot] != g:
                    stale.add(self._range_of(source, a))
                    break
        self._unregister_ranges(source, stale)

    def slotted(self) -> list[Hashable]:
        """The sources registered per slot (slabs) that hold registrations, least recently used first."""
        return [key for key, source in self._sources.items() if source.slotted and source.ranges]

    def drop_punched(self, key: Hashable, slot_map: SlotMap) -> None:
        """Unregisters every range of the slab ``key`` holding a part registered for a slot whose
        generation in ``slot_map`` (read from the slab file itself: docs/protocol.md) differs; no work
        when the generations are the ones last compared."""
        source = self._sources.get(key)
        if source is not None and source.slotted and slot_map[2] != source.seen_map:
            self._drop_punched(source, slot_map)

    def _unregister_ranges(self, source: _Source, stale: set[tuple[int, int]]) -> None:
        for a, b in sorted(stale):
            self.stats.generation_changes += 1
            self._unregister(source.base + a)
            self.stats.unregistrations += 1
            self.stats.registered_bytes -= b - a
            source.ranges.remove((a, b))
            source.parts = [p for p in source.parts if not a <= p[0] < b]

    @staticmethod
    def _range_of(source: _Source, offset: int) -> tuple[int, int]:
        at = bisect.bisect_right(source.ranges, (offset, 1 << 62)) - 1
        return source.ranges[at]

    def registration_at(self, key: Hashable, offset: int) -> int | None:
        """The address a registered range of ``key`` holding byte ``offset`` was registered at (what
        unregistering it passes), or None."""
        source = self._sources.get(key)
        if source is None or not source.ranges:
            return None
        at = bisect.bisect_right(source.ranges, (offset, 1 << 62)) - 1
        if at < 0:
            return None
        a, b = source.ranges[at]
        return source.base + a if a <= offset < b else None

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
        source.parts = []
        if forget:
            del self._sources[key]

    def close(self) -> None:
        for key in list(self._sources):
            self.drop(key)

    def generation(self, key: Hashable) -> int | None:
        source = self._sources.get(key)
        return source.generation if source is not None else None

    def parts(self, key: Hashable) -> list[tuple[int, int, int]]:
        """What each registered range of ``key`` was registered for: ``(start, end, generation)``."""
        source = self._sources.get(key)
        return list(source.parts) if source is not None else []

    def ranges(self, key: Hashable) -> list[tuple[int, int]]:
        source = self._sources.get(key)
        return list(source.ranges) if source is not None else []

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sources

    def _make_room(self, need: int, *, keep: Hashable, also: Collection[Hashable] = ()) -> None:
        for key in list(self._sources):
            if self.stats.registered_bytes + need <= self.limit_bytes:
                return
            if key != keep and key not in also:
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


def _merge_parts(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Page spans with their generations, sorted and made disjoint (overlapping spans name one slot's
    pages: they carry one generation; were they not to, the newest, the largest, is kept)."""
    spans.sort()
    out: list[tuple[int, int, int]] = []
    for a, b, g in spans:
        if out and a < out[-1][1]:
            pa, pb, pg = out[-1]
            out[-1] = (pa, max(pb, b), max(pg, g))
        else:
            out.append((a, b, g))
    return out


def _clip(parts: Sequence[tuple[int, int, int]], a: int, b: int) -> list[tuple[int, int, int]]:
    """The parts (sorted, disjoint) cut to ``[a, b)``."""
    return [(max(pa, a), min(pb, b), g) for pa, pb, g in parts if pa < b and a < pb]


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
