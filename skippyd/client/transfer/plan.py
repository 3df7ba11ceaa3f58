"""Run planning: the copies of one transfer, merged into as few contiguous runs as their bytes allow.

Pure logic (no torch, no CUDA). A *piece* is ``(src, src_offset, dst, dst_offset, nbytes)``: ``src`` and
``dst`` name two buffers (a mapped file, a device allocation, the staging buffer: any hashable, ordered
names the caller picks) and the offsets are bytes inside them. Pieces that continue each other on both
sides become one run, so a put's blocks in consecutive slots copied into consecutive pages of one KV
cache are one DMA. A block made of several pieces (a list of tensors: issue 25) is just more pieces.

A run must not span two CUDA registrations of its host memory (a registration is one pinned range; a
copy that crosses into another one is not known to be pinned as a whole): :func:`split_runs` cuts runs
at the registration boundaries the book reports.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Flat", "Run", "page_spans", "plan_runs", "split_runs", "total_bytes"]


@dataclass(frozen=True, slots=True)
class Run:
    """One contiguous copy: ``nbytes`` from ``src`` at ``src_offset`` to ``dst`` at ``dst_offset``."""

    src: Any
    src_offset: int
    dst: Any
    dst_offset: int
    nbytes: int


def plan_runs(pieces: Iterable[tuple[Hashable, int, Hashable, int, int]], *, sort: bool = True) -> list[Run]:
    """The pieces merged into runs (empty pieces dropped). With ``sort`` the pieces are ordered by their
    buffers and source offset first, so pieces given out of order still merge; without it only pieces
    that follow each other in the given order do."""
    listed = [p for p in pieces if p[4] > 0]
    for src, src_offset, dst, dst_offset, nbytes in listed:
        if src_offset < 0 or dst_offset < 0 or nbytes < 0:
            raise ValueError(f"a piece with a negative offset or size: {(src, src_offset, dst, dst_offset)}")
    if sort:  # by buffer (in order of first appearance), then source offset
        srcs: dict[Hashable, int] = {}
        dsts: dict[Hashable, int] = {}
        for p in listed:
            srcs.setdefault(p[0], len(srcs))
            dsts.setdefault(p[2], len(dsts))
        listed.sort(key=lambda p: (srcs[p[0]], dsts[p[2]], p[1], p[3]))
    runs: list[Run] = []
    if not listed:
        return runs
    src, src_offset, dst, dst_offset, nbytes = listed[0]
    for nsrc, nsrc_offset, ndst, ndst_offset, n in listed[1:]:
        if (
            nsrc == src
            and ndst == dst
            and nsrc_offset == src_offset + nbytes
            and ndst_offset == dst_offset + nbytes
        ):
            nbytes += n
            continue
        runs.append(Run(src, src_offset, dst, dst_offset, nbytes))
        src, src_offset, dst, dst_offset, nbytes = nsrc, nsrc_offset, ndst, ndst_offset, n
    runs.append(Run(src, src_offset, dst, dst_offset, nbytes))
    return runs


def split_runs(runs: Sequence[Run], cuts: Mapping[Any, Sequence[int]], *, side: str = "src") -> list[Run]:
    """``runs`` cut wherever one crosses a boundary in ``cuts[buffer]`` (sorted offsets) on ``side``
    (``"src"`` or ``"dst"``: the host side of the copy)."""
    out: list[Run] = []
    for run in runs:
        buffer = run.src if side == "src" else run.dst
        start = run.src_offset if side == "src" else run.dst_offset
        bounds = cuts.get(buffer)
        if not bounds:
            out.append(run)
            continue
        end = start + run.nbytes
        at = start
        for cut in bounds:
            if cut <= at:
                continue
            if cut >= end:
                break
            out.append(_part(run, at - start, cut - at))
            at = cut
        out.append(_part(run, at - start, end - at))
    return out


def _part(run: Run, skip: int, nbytes: int) -> Run:
    if skip == 0 and nbytes == run.nbytes:
        return run
    return Run(run.src, run.src_offset + skip, run.dst, run.dst_offset + skip, nbytes)


def total_bytes(runs: Iterable[Run]) -> int:
    return sum(run.nbytes for run in runs)


# ---------------------------------------------------------------- many pieces at once (numpy)


@dataclass(frozen=True, slots=True)
class Flat:
    """The pieces of one transfer as arrays (int64), sorted so that pieces that may merge are adjacent:
    absolute ``src``/``dst`` addresses, ``size``, ``rel`` (where the piece's bytes start in its block: a
    span ``[start, stop)`` of every block picks the same bytes of each), ``group`` (pieces merge only
    within one: one CUDA registration of one source, and one destination buffer) and ``source`` (an
    index the caller maps back to its buffer)."""

    src: Any
    dst: Any
    size: Any
    rel: Any
    group: Any
    source: Any

    @classmethod
    def of(cls, columns: Sequence[Any]) -> Flat:
        """From six equal columns (lists or arrays): src, dst, size, rel, group, source."""
        import numpy as np

        src, dst, size, rel, group, source = (np.asarray(c, dtype=np.int64) for c in columns)
        order = np.lexsort((dst, src, group))
        return cls(src[order], dst[order], size[order], rel[order], group[order], source[order])

    def runs(self, start: int = 0, stop: int = 1 << 62) -> tuple[Any, Any, Any, Any, Any]:
        """Bytes ``[start, stop)`` of every piece's block that the piece holds, merged into runs: arrays
        ``(src, dst, size, group, source)``, one entry per run (a run never spans two groups)."""
        import numpy as np

        rel = self.rel
        lo = np.maximum(rel, start)
        hi = np.minimum(rel + self.size, stop)
        keep = lo < hi
        if not keep.all():
            lo, hi, rel = lo[keep], hi[keep], rel[keep]
            src, dst, group, source = self.src[keep], self.dst[keep], self.group[keep], self.source[keep]
        else:
            src, dst, group, source = self.src, self.dst, self.group, self.source
        skip = lo - rel
        src, dst, size = src + skip, dst + skip, hi - lo
        if len(src) > 1:
            join = (
                (src[1:] == src[:-1] + size[:-1])
                & (dst[1:] == dst[:-1] + size[:-1])
                & (group[1:] == group[:-1])
            )
            if join.any():
                starts = np.concatenate(([0], np.flatnonzero(~join) + 1))
                size = np.add.reduceat(size, starts)
                src, dst, group, source = src[starts], dst[starts], group[starts], source[starts]
        return src, dst, size, group, source


def page_spans(
    starts: Any, ends: Any, generations: Any | None = None, *, page: int = 4096
) -> tuple[list[tuple[int, int]], list[int]]:
    """Byte ranges ``[starts[i], ends[i])`` of one source widened to whole pages, and joined where one
    ends on the page the next begins and both carry one generation: what a registration book is asked
    for (a reply's blocks in consecutive slots are one span, not one per block). ``generations``: one per
    range (None: all 0). Where two ranges share a page (slots smaller than a page, or not page-aligned)
    nothing is joined: the book settles shared pages itself (one generation for the pair, the newest)."""
    if len(starts) <= _FEW:  # (a few ranges: numpy's fixed cost is more than the loop)
        return _page_spans_few(starts, ends, generations, page)
    return page_spans_of([0] * len(starts), starts, ends, generations, page=page).get(0, ([], []))


def page_spans_of(
    sources: Any, starts: Any, ends: Any, generations: Any | None = None, *, page: int = 4096
) -> dict[int, tuple[list[tuple[int, int]], list[int]]]:
    """:func:`page_spans` of the ranges of each source at once (``sources[i]``: range ``i``'s source
    number), as arrays for all of them: ``{source: (spans, generations)}``, each exactly what
    :func:`page_spans` gives for that source's ranges (a reply's blocks in up to 8 slabs: one pass, not
    one a slab)."""
    import numpy as np

    src = np.asarray(sources, dtype=np.int64)
    lo = np.asarray(starts, dtype=np.int64) // page * page
    hi = -(-np.asarray(ends, dtype=np.int64) // page) * page
    gen = (
        np.zeros(len(lo), dtype=np.int64) if generations is None else np.asarray(generations, dtype=np.int64)
    )
    keep = hi > lo
    if not keep.all():
        src, lo, hi, gen = src[keep], lo[keep], hi[keep], gen[keep]
    out: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}
    if not len(lo):
        return out
    order = np.lexsort((gen, hi, lo, src))  # by source, then as page_spans sorts them
    src, lo, hi, gen = src[order], lo[order], hi[order], gen[order]
    same = src[1:] == src[:-1]
    shared = np.zeros(len(lo), dtype=bool)  # a source with a page two of its ranges share: as they are
    overlap = np.flatnonzero(same & (lo[1:] < hi[:-1]))
    if len(overlap):
        shared = np.isin(src, np.unique(src[overlap]))
    new = np.ones(len(lo), dtype=bool)
    new[1:] = ~same | (lo[1:] != hi[:-1]) | (gen[1:] != gen[:-1]) | shared[1:]
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(lo)) - 1
    owner, begin, end, first_gen = src[first], lo[first], hi[last], gen[first]
    bounds = np.flatnonzero(np.append(True, owner[1:] != owner[:-1]))
    for at, stop in zip(bounds.tolist(), [*bounds[1:].tolist(), len(owner)], strict=True):
        out[int(owner[at])] = (
            list(zip(begin[at:stop].tolist(), end[at:stop].tolist(), strict=True)),
            first_gen[at:stop].tolist(),
        )
    return out


_FEW = 32


def _page_spans_few(
    starts: Any, ends: Any, generations: Any | None, page: int
) -> tuple[list[tuple[int, int]], list[int]]:
    """:func:`page_spans` for a few ranges, in Python (the same result)."""
    gens = [0] * len(starts) if generations is None else [int(g) for g in generations]
    ranges = sorted(
        (int(a) // page * page, -(-int(b) // page) * page, g)
        for a, b, g in zip(starts, ends, gens, strict=True)
        if -(-int(b) // page) * page > int(a) // page * page
    )
    if any(ranges[i + 1][0] < ranges[i][1] for i in range(len(ranges) - 1)):  # pages shared: as they are
        return [(a, b) for a, b, _ in ranges], [g for _, _, g in ranges]
    spans: list[tuple[int, int]] = []
    out: list[int] = []
    for a, b, g in ranges:
        if spans and spans[-1][1] == a and out[-1] == g:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
            out.append(g)
    return spans, out
