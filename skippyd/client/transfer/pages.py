"""Destinations named as page pools and page numbers (``BlockSpace.get_into_pages``), planned as arrays.

An engine keeps its KV cache as pools of pages: tensors whose first axis is the page number (vLLM's
``kv_caches[layer][0]`` and ``[1]`` for keys and values, SGLang's host pool per layer), each page a
contiguous row. A block of skippyd is then the rows of its pages in every pool, in order: block ``i``
holds ``planes[0][pages[i][0]]``, ``planes[0][pages[i][1]]``, ..., then ``planes[1][pages[i][0]]`` and so
on (plane-major, the way ``put`` lays out a list of pieces given in that order). Naming destinations
this way instead of as one tensor per piece lets a get plan every piece of a reply with a few numpy
operations (one address computation for all of them) instead of Python work per piece, which is what
bounds a get of many small blocks.

:class:`PageLayout` checks the planes and the page numbers once per call; :meth:`PageLayout.pieces`
gives a reply's pieces as arrays of absolute source and destination addresses. Client side (torch is
imported by the caller; this module reads tensors' metadata only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from skippyd.errors import InvalidArgument, Mismatch

__all__ = ["LazyPieces", "PageLayout", "PagePieces"]


@dataclass(frozen=True, slots=True)
class PagePieces:
    """The pieces of some blocks as arrays (int64, one entry per piece, empty pieces left out): absolute
    ``src`` and ``dst`` addresses, ``size``, ``rel`` (where the piece's bytes start in its block),
    ``block`` (its row in the reply) and ``plane`` (the pool it lands in)."""

    src: Any
    dst: Any
    size: Any
    rel: Any
    block: Any
    plane: Any


class PageLayout:
    """Pools of pages (``planes``) and the pages of each block (``pages``), checked (see the module).

    ``planes``: a tensor or a list of tensors of one device, each at least 1-D with contiguous rows
    along its first axis (``plane[p]`` is one page, its bytes contiguous), pages not overlapping.
    ``pages``: one page number per block (a sequence, numpy array or tensor of integers), or a row of
    ``k`` page numbers per block (a block of ``k`` pages per plane); at least ``count`` rows, every number
    a page of every plane, no page named twice (with ``unique``: where blocks land; a put may read a page
    twice)."""

    def __init__(self, planes: Any, pages: Any, count: int, *, unique: bool = True) -> None:
        listed = list(planes) if isinstance(planes, list | tuple) else [planes]
        if not listed:
            raise InvalidArgument("planes must name at least one tensor")
        import torch

        device = None
        rows, strides, bases, lengths = [], [], [], []
        for index, plane in enumerate(listed):
            if not isinstance(plane, torch.Tensor):
                raise InvalidArgument(f"planes[{index}] must be a tensor, not {type(plane).__name__}")
            if plane.dim() < 1 or plane.shape[0] < 1:
                raise InvalidArgument(f"planes[{index}] must have at least one page (a first axis)")
            if plane.is_conj() or plane.is_neg() or plane.layout != torch.strided:
                raise InvalidArgument(f"planes[{index}] must be a plain strided tensor")
            if device is None:
                device = plane.device
            elif plane.device != device:
                raise InvalidArgument("every plane must be on one device")
            size = plane.element_size()
            row = int(plane[0].numel()) * size
            if not plane[0].is_contiguous():
                raise InvalidArgument(
                    f"planes[{index}]: a page's bytes must be contiguous (pass such pages to get_into)"
                )
            stride = int(plane.stride(0)) * size
            if plane.shape[0] > 1 and row and stride < row:
                raise InvalidArgument(f"planes[{index}]: its pages overlap (stride {stride} < {row} bytes)")
            rows.append(row)
            strides.append(stride)
            bases.append(int(plane.data_ptr()))
            lengths.append(int(plane.shape[0]))
        self.planes: list[Any] = listed
        self.device = device
        self.rows = np.asarray(rows, dtype=np.int64)
        self.strides = np.asarray(strides, dtype=np.int64)
        self.bases = np.asarray(bases, dtype=np.int64)
        self.pages = _page_table(pages, count, min(lengths), unique=unique)
        k = self.pages.shape[1]
        # piece q = (plane j, page m of the block), plane-major; where its bytes start in the block
        self.piece_plane = np.repeat(np.arange(len(listed), dtype=np.int64), k)
        self.piece_page = np.tile(np.arange(k, dtype=np.int64), len(listed))
        before = np.concatenate(([0], np.cumsum(self.rows)[:-1])) * k
        self.rel = before[self.piece_plane] + self.piece_page * self.rows[self.piece_plane]
        self.capacity = int(self.rows.sum()) * k  # bytes of one block

    @property
    def pages_per_block(self) -> int:
        return int(self.pages.shape[1])

    def pieces(self, first: int, sources: Any, sizes: Any) -> PagePieces:
        """The pieces of blocks ``first``, ``first + 1``, ... whose bytes start at the addresses
        ``sources`` (one per block) and number ``sizes``: the pages of each, as far as its bytes reach (a
        block shorter than :attr:`capacity` fills its first pieces); :class:`Mismatch` for a block
        longer than its pages hold."""
        src0 = np.asarray(sources, dtype=np.int64)
        nbytes = np.asarray(sizes, dtype=np.int64)
        n = len(src0)
        if n and int(nbytes.max()) > self.capacity:
            at = int(np.argmax(nbytes > self.capacity))
            raise Mismatch(f"block {first + at} has {int(nbytes[at])} bytes; its pages hold {self.capacity}")
        pages = self.pages[first : first + n]  # (n, k)
        plane, rel = self.piece_plane, self.rel
        row = self.rows[plane]
        size = np.clip(nbytes[:, None] - rel[None, :], 0, row[None, :])  # (n, q)
        dst = self.bases[plane][None, :] + pages[:, self.piece_page] * self.strides[plane][None, :]
        src = src0[:, None] + rel[None, :]
        block = np.broadcast_to(np.arange(n, dtype=np.int64)[:, None], size.shape)
        keep = size > 0
        if keep.all():
            return PagePieces(
                src.ravel(), dst.ravel(), size.ravel(), np.broadcast_to(rel, size.shape).ravel(),
                block.ravel(), np.broadcast_to(plane, size.shape).ravel(),
            )  # fmt: skip
        return PagePieces(
            src[keep], dst[keep], size[keep], np.broadcast_to(rel, size.shape)[keep], block[keep],
            np.broadcast_to(plane, size.shape)[keep],
        )  # fmt: skip

    def block_pieces(self, index: int) -> list[Any]:
        """Block ``index``'s destination as ``get_into`` takes it: its pages' rows, plane-major."""
        return [plane[int(p)] for plane in self.planes for p in self.pages[index]]


class LazyPieces(Sequence[Any]):
    """Every block's destination as a list of pieces, made when asked for (``get_into``'s ``out``, for
    a reply the page path does not take: a descriptor read once, several devices)."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout

    def __len__(self) -> int:
        return int(self.layout.pages.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.layout.block_pieces(i) for i in range(*index.indices(len(self)))]
        return self.layout.block_pieces(int(index))


def _page_table(pages: Any, count: int, limit: int, *, unique: bool) -> Any:
    """``pages`` as an (n, k) int64 array: checked against ``count`` blocks and ``limit`` pages."""
    if hasattr(pages, "detach") and hasattr(pages, "cpu"):  # a tensor (a CUDA one is copied here)
        pages = pages.detach().cpu().numpy()
    try:
        table = np.asarray(pages)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"pages must be integers, one (or one row) per block: {exc}") from None
    if table.dtype == object or not (np.issubdtype(table.dtype, np.integer) or table.size == 0):
        raise InvalidArgument("pages must be integers, one (or one row) per block")
    table = table.astype(np.int64, copy=False)
    if table.ndim == 1:
        table = table[:, None]
    if table.ndim != 2 or (table.shape[0] and table.shape[1] < 1):
        raise InvalidArgument("pages must be one page number per block, or a row of page numbers per block")
    if table.shape[0] < count:
        raise InvalidArgument(f"{count} keys but pages for only {table.shape[0]} blocks")
    used = table[:count]
    if used.size:
        if int(used.min()) < 0 or int(used.max()) >= limit:
            raise InvalidArgument(f"a page number is outside the planes' {limit} pages")
        flat = np.sort(used.ravel()) if unique else used[:0].ravel()
        twice = flat[1:][flat[1:] == flat[:-1]]
        if len(twice):
            raise InvalidArgument(f"page {int(twice[0])} is named twice (two blocks cannot land in one page)")
    return np.ascontiguousarray(used)
