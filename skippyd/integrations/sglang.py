"""SGLang integration: skippyd as a HiCache storage backend, shared by every SGLang worker on a host.

SGLang's hierarchical cache keeps KV in GPU memory, then in a host pool of its own, then in a storage
backend that ``StorageBackendFactory`` loads by module path (SGLang 0.5.23)::

    python -m sglang.launch_server --model-path Qwen/Qwen2.5-7B-Instruct --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"skippyd",
        "module_path":"skippyd.integrations.sglang","class_name":"SkippydStorage","interface_v1":1,
        "hicache_storage_pass_prefix_keys":true,"socket":"/run/skippyd/skippyd.sock"}'

:class:`SkippydStorage` lives in each worker (every tensor/pipeline-parallel rank builds its own) and
stores one skippyd block per HiCache page, keyed by SGLang's page hash (its hex digest as 32 bytes):

* ``batch_exists`` answers how many LEADING pages skippyd holds (one ``blocks_contains``), what
  HiCache's prefetch asks before it reserves host memory;
* ``batch_get_v1``/``batch_set_v1`` (``interface_v1``) copy straight between the host pool's pages and
  skippyd's shared memory: a page is the pieces of the pool's own page view (two for the page-first
  layouts, two per layer for layer-first), written into the connection's staging buffer by ``put``
  and read out of skippyd's slabs by ``get_into_pages`` into the pool seen as page planes
  (:func:`page_planes`: a reply's pieces planned as arrays; ``get_into`` with each page's pieces where
  the pool's pages are not that regular); no Python ``bytes`` in between. The bytes are the pool's
  flat page (``get_data_page``), so the ``get``/``set`` path and the v1 path share pages;
* ``get``/``batch_get``/``set``/``batch_set`` take the flat pages SGLang's generic path hands them;
* ``clear`` drops every page of this worker's identity (shared with the workers of the same layout);
  ``get_stats`` reports the pages and bandwidth of each transfer since the last call.

Identity. The block space is bound once the host pool is registered: ``model`` defaults to SGLang's
model name and ``state`` to a digest of everything that shapes a page's bytes: the pool's class,
layout, dtype, page size and page shape, MLA or not, and the tensor/pipeline/context-parallel rank and
size (the tensor rank and size left out for MLA, where every rank holds the same KV); never a process
id, so two workers of one layout share pages and two layouts never do.

Options (keys of ``--hicache-storage-backend-extra-config`` besides SGLang's ``backend_name``,
``module_path``, ``class_name`` and ``interface_v1``): ``socket``, ``namespace``, ``model``, ``state``,
``durable`` (default true: pages reach skippyd's L3), ``redis_url`` + ``scope`` (second-hit admission:
a page is written only once it was offered twice within the window by any worker of the scope) and
``timeout`` (seconds a lookup waits for the daemon, 1 by default). An unknown option stops the engine
at start with one line naming it.

Failure. Nothing raises into SGLang's cache controller: while the daemon is down or stalled, lookups
answer 0 within ``timeout``, loads and stores answer ``False``; each call reconnects by itself. A
corrupt block is never served (skippyd verifies it): it is a miss.

This module imports SGLang; nothing else in skippyd does.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from blake3 import blake3
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import skippyd
from skippyd.client.blockspace import BlockSpace
from skippyd.errors import SkippydError
from skippyd.integrations._common import (
    SLOWEST_RATE,
    admission,
    check_durable,
    check_options,
    layout_state,
    why,
)

__all__ = ["LAYOUT_VERSION", "SkippydStorage", "page_pieces", "page_planes", "storage_identity"]

log = logging.getLogger("skippyd.sglang")

#: Bumped whenever what a page's bytes mean to this backend changes: older pages then miss.
LAYOUT_VERSION = 1

_OPTIONS = ("socket", "namespace", "model", "state", "durable", "redis_url", "scope", "timeout")
#: Keys SGLang itself reads from the same extra config (the dynamic loader's, the zero-copy switch, and
#: the prefetch knobs SGLang 0.5.23 normally takes out before the backend sees the config).
_SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
)  # fmt: skip
_HEX = re.compile(r"[0-9a-fA-F]+")

T = TypeVar("T")


def engine_key(key: str) -> bytes:
    """SGLang's page hash as skippyd's engine key: its hex digest's bytes (32 for SHA-256), or a
    BLAKE3 of the text for a key that is not hex (a backend-specific suffix, say). A key that is not text
    is a :class:`TypeError` (the backend's calls catch it: nothing raises into SGLang)."""
    if not isinstance(key, str):
        raise TypeError(f"an SGLang page key is text (str), not {type(key).__name__}")
    if len(key) % 2 == 0 and 0 < len(key) <= 128 and _HEX.fullmatch(key):
        return bytes.fromhex(key)
    return blake3(key.encode("utf-8", "surrogatepass")).digest()


def storage_identity(config: HiCacheStorageConfig, pool: Any) -> tuple[str, str, int]:
    """``(model, state, block_tokens)`` of a worker: SGLang's model name, a digest of the page layout and
    the worker's place in the parallel layout (never a process id), and tokens per page."""
    page = pool.get_data_page(0, flat=False)
    replicated = bool(config.is_mla_model)  # every tensor rank holds the same KV
    layout = {
        "pool": type(pool).__name__,
        "layout": str(pool.layout),
        "format": getattr(pool, "storage_format_tag", None),
        "dtype": str(pool.dtype),
        "page_size": int(pool.page_size),
        "page_shape": [int(n) for n in page.shape],
        "page_bytes": int(page.numel() * page.element_size()),
        "mla": replicated,
        "tp": None if replicated else [int(config.tp_rank), int(config.tp_size)],
        "pp": [int(config.pp_rank), int(config.pp_size)],
        "cp": [int(config.attn_cp_rank), int(config.attn_cp_size)],
        "dcp": [int(getattr(config, "dcp_rank", 0)), int(getattr(config, "dcp_size", 1))],
        "heads": [getattr(config, "tp_lcm_size", None), bool(getattr(config, "should_split_heads", False))],
    }  # fmt: skip
    block_tokens = max(1, min(65536, int(pool.page_size)))
    return str(config.model_name or "sglang"), layout_state("sglang-kv", LAYOUT_VERSION, layout), block_tokens


def page_pieces(page: torch.Tensor) -> list[torch.Tensor]:
    """The contiguous pieces of a view of one page, in the order of its flat bytes: the view itself
    when it is contiguous, else the pieces of each of its first-axis slices (K and V, then layers)."""
    if page.is_contiguous():
        return [page]
    out: list[torch.Tensor] = []
    for part in page.unbind(0):
        out += page_pieces(part)
    return out


def page_planes(pool: Any) -> list[torch.Tensor] | None:
    """The host pool as page planes (what ``BlockSpace.get_into_pages`` takes): one uint8 tensor per
    contiguous piece of a page (:func:`page_pieces`), its first axis the page number (token index //
    page size), over the pool's own memory; None when the pool's pages are not laid out that regularly
    (each piece at one stride from page to page, checked at the first, second and last page)."""
    size = int(pool.page_size)
    pages = int(getattr(pool, "size", 0)) // max(size, 1)
    if pages < 2:
        return None
    first, second, last = (
        page_pieces(pool.get_data_page(page * size, flat=False)) for page in (0, 1, pages - 1)
    )
    if not len(first) == len(second) == len(last):
        return None
    storage = first[0].untyped_storage()
    base = storage.data_ptr()
    whole = torch.empty(0, dtype=torch.uint8, device=first[0].device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
    planes: list[torch.Tensor] = []
    for a, b, c in zip(first, second, last, strict=True):
        nbytes, stride = a.nbytes, b.data_ptr() - a.data_ptr()
        if (
            {b.nbytes, c.nbytes} != {nbytes}
            or stride < nbytes
            or c.data_ptr() != a.data_ptr() + (pages - 1) * stride
            or any(t.untyped_storage().data_ptr() != base for t in (a, b, c))
        ):
            return None
        planes.append(whole.as_strided((pages, nbytes), (stride, 1), a.data_ptr() - base))
    return planes


def _check_page_view(pool: Any) -> None:
    """Refuses, at engine start, a host pool whose page is not a view of its buffer (pages are read
    straight into that view: into a copy, HiCache would take pages that were never loaded)."""
    try:
        page = pool.get_data_page(0, flat=False)
        buffer = pool.kv_buffer
        shared = page.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    except Exception as exc:
        raise ValueError(
            f"SkippydStorage: SGLang's {type(pool).__name__} with layout {getattr(pool, 'layout', '?')!r} "
            f"has no page view ({why(exc)}); use layer_first, page_first or page_first_direct"
        ) from None
    if not shared:
        raise ValueError(
            f"SkippydStorage: SGLang's {type(pool).__name__} pages (layout {pool.layout!r}) are not views "
            "of its buffer; use layer_first, page_first or page_first_direct"
        )


class SkippydStorage(HiCacheStorage):
    """A HiCache storage backend on the local skippyd daemon (see the module)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        options = dict(storage_config.extra_config or {})
        options.update(kwargs or {})
        for key in _SGLANG_KEYS:
            options.pop(key, None)
        check_options("SkippydStorage", options, _OPTIONS)
        self.storage_config = storage_config
        self.options = options
        self.namespace = str(options.get("namespace") or "")
        self.durable = check_durable("SkippydStorage", options.get("durable", True))
        self.timeout = float(options.get("timeout", 1.0))
        self.model = ""
        self.state = ""
        self.block_tokens = 0
        self.page_bytes = 0
        self._admission = admission("SkippydStorage", options.get("redis_url"), options.get("scope"))
        socket = options.get("socket")
        # One connection per kind of work (HiCache asks, loads and stores from their own threads): a
        # lookup never waits behind a copy, a load never behind a store.
        self._clients = {
            kind: skippyd.Client(socket, timeout=self.timeout, connect_timeout=self.timeout)
            for kind in ("query", "load", "store")
        }
        self._locks = {kind: threading.Lock() for kind in self._clients}
        self._spaces: dict[str, BlockSpace] = {}
        self._stats_lock = threading.Lock()
        self._stats: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                               "prefetch_bandwidth": [], "backup_bandwidth": []}  # fmt: skip
        self._warned = False
        self.mem_pool_host: Any = None
        self._planes: list[torch.Tensor] | None = None  # the pool's pages as planes, where regular

    # ----------------------------------------------------------------- binding to the host pool
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Binds the block space: the identity is derived from the host pool and the storage config."""
        _check_page_view(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        model, state, block_tokens = storage_identity(self.storage_config, mem_pool_host)
        self.model = str(self.options.get("model") or model)
        self.state = str(self.options.get("state") or state)
        self.block_tokens = block_tokens
        page = mem_pool_host.get_data_page(0, flat=False)
        self.page_bytes = int(page.numel() * page.element_size())
        try:
            self._planes = page_planes(mem_pool_host)
        except Exception as exc:  # an unusual pool: its pages are read as pieces
            name = type(mem_pool_host).__name__
            log.warning("skippyd HiCache storage reads %s pages as pieces: %s", name, why(exc))
            self._planes = None
        self._spaces = {
            kind: client.blocks(
                model=self.model, state=self.state, namespace=self.namespace, block_tokens=block_tokens
            )
            for kind, client in self._clients.items()
        }
        log.info("skippyd HiCache storage bound to model %r, state %s", self.model, self.state)

    def _pages(self, host_indices: torch.Tensor, count: int) -> list[list[torch.Tensor]]:
        """The pieces of each of the first ``count`` pages ``host_indices`` names (views of the pool)."""
        pool = self.mem_pool_host
        size = int(pool.page_size)
        starts = host_indices[: count * size : size].tolist()
        return [page_pieces(pool.get_data_page(int(start), flat=False)) for start in starts]

    def _load_into_pool(self, space: BlockSpace, run: list[bytes], host_indices: torch.Tensor) -> int:
        """Reads a run of blocks into the pool's pages ``host_indices`` names: by page numbers into the
        pool's planes (planned as arrays) where its pages are regular and every page starts on a page
        boundary within the pool, else as each page's pieces (which check what they are given)."""
        planes, size = self._planes, int(self.mem_pool_host.page_size)
        starts = host_indices[: len(run) * size : size]
        if planes is not None and len(starts) == len(run):
            numbers = starts // size
            inside = 0 <= int(numbers.min()) <= int(numbers.max()) < len(planes[0])
            if inside and not bool((starts % size).any()):
                return space.get_into_pages(run, planes, numbers.tolist())
        return space.get_into(run, self._pages(host_indices, len(run)))

    # ----------------------------------------------------------------- calls that never raise
    def _run(self, kind: str, what: str, call: Callable[[BlockSpace], T], fallback: T, nbytes: int = 0) -> T:
        """``call`` on the ``kind`` connection's space; ``fallback`` (a miss, a failure) when the daemon is
        away, stalled or refuses, or before the host pool is registered. Loads and stores get ``timeout``
        plus the time their bytes take at the slowest rate allowed."""
        space = self._spaces.get(kind)
        if space is None:
            if not self._warned:
                self._warned = True
                log.warning("skippyd HiCache storage used before a host pool was registered: all misses")
            return fallback
        client = self._clients[kind]
        with self._locks[kind]:
            client.timeout = self.timeout + nbytes / SLOWEST_RATE  # (a stall: the lookup finds it)
            try:
                return call(space)
            except (SkippydError, OSError) as exc:
                log.warning("skippyd %s failed: %s", what, why(exc))
            except Exception as exc:  # a bug or bad input: never into SGLang's controller
                log.error("skippyd %s failed unexpectedly: %s", what, why(exc))
        return fallback

    def _bind(self, keys: list[Any], what: str) -> list[bytes] | None:
        """SGLang's page keys as engine keys; None (logged in one line) when one is unusable (not text):
        the call then misses or writes nothing, and nothing raises into SGLang's controller."""
        try:
            return [engine_key(k) for k in keys]
        except Exception as exc:
            log.error("skippyd %s failed: %s", what, why(exc))
            return None

    def _held(self, keys: list[bytes]) -> int:
        return self._run("query", "lookup", lambda space: space.contains(keys), 0)

    def _read(self, keys: list[str], load: Callable[[BlockSpace, list[bytes]], int]) -> int:
        """How many leading pages ``load(space, run)`` read (the run asked first on the lookup
        connection, so a stalled daemon answers within ``timeout``)."""
        if not keys:
            return 0
        bound = self._bind(keys, "load")
        if bound is None:
            return 0
        held = self._held(bound)
        if not held:
            return 0
        started = time.perf_counter()
        got = self._run(
            "load", f"load of {held} pages", lambda space: load(space, bound[:held]), 0,
            nbytes=held * self.page_bytes,
        )  # fmt: skip
        self._record("prefetch", got, time.perf_counter() - started)
        return got

    def _write(self, keys: list[str], data: Callable[[int], list[Any]], extra_info: Any = None) -> int:
        """How many leading pages skippyd holds after a put of ``data(count)`` (pages not admitted by
        second-hit admission count as written: they are not an error, only not kept)."""
        if not keys:
            return 0
        bound = self._bind(keys, "store")
        if bound is None:
            return 0
        count = len(bound)
        if self._admission is not None:
            space = self._spaces.get("store")
            if space is not None:
                count = self._admission.admitted(space, bound, self.page_bytes)
            if not count:
                return len(bound)
        if not self._run("query", "lookup", lambda space: space.contains(bound[:1]) >= 0, False):
            return 0  # asked first on the lookup connection: a stalled daemon is found within ``timeout``
        parent = None
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix:
            parents = self._bind([str(prefix[-1])], "store")
            if parents is None:
                return 0
            parent = parents[0]
        started = time.perf_counter()

        def store(space: BlockSpace) -> Any:
            pages = data(count)
            put = space.put(bound[:count], pages, durable=self.durable, parent=parent)
            if put.skipped and parent is not None:  # skippyd no longer holds the parent: a chain of its own
                put = space.put(bound[:count], pages, durable=self.durable)
            return put

        put = self._run("store", f"store of {count} pages", store, None, nbytes=count * self.page_bytes)
        if put is None:
            return 0
        done = put.stored + put.present
        self._record("backup", done, time.perf_counter() - started)
        return done + (len(bound) - count) if done == count else done

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if pages <= 0:
            return
        with self._stats_lock:
            self._stats[f"{kind}_pgs"].append(pages)
            self._stats[f"{kind}_bandwidth"].append(pages * self.page_bytes / 1e9 / max(seconds, 1e-9))

    # ----------------------------------------------------------------- HiCacheStorage
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many LEADING pages of ``keys`` skippyd holds (L2 or L3); 0 while it is away."""
        if not keys or not self._spaces:
            return 0
        bound = self._bind(list(keys), "lookup")
        return self._held(bound) if bound is not None else 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Reads the leading held pages straight into the host pool's pages ``host_indices`` names."""
        got = self._read(list(keys), lambda space, run: self._load_into_pool(space, run, host_indices))
        return [True] * got + [False] * (len(keys) - got)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Writes the host pool's pages ``host_indices`` names, copied straight into skippyd."""
        done = self._write(list(keys), lambda count: self._pages(host_indices, count), extra_info)
        return [True] * done + [False] * (len(keys) - done)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """The leading held pages, read into ``target_locations`` (SGLang's flat pages) when given, else
        new tensors of the pool's dtype; ``None`` for the rest."""
        keys = list(keys)
        if target_locations is None:
            dtype = getattr(self.mem_pool_host, "dtype", torch.uint8)
            size = max(self.page_bytes, 1)
            target_locations = [torch.empty(size // dtype.itemsize, dtype=dtype) for _ in keys]
        targets = list(target_locations)
        got = self._read(keys, lambda space, run: space.get_into(run, targets[: len(run)]))
        return [targets[i] if i < got else None for i in range(len(keys))]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Writes SGLang's flat pages ``values``; True when skippyd holds every one afterwards."""
        keys = list(keys)
        if values is None or len(values) != len(keys):
            log.error("skippyd batch_set needs one value per key (%d keys)", len(keys))
            return False
        listed = list(values)
        return self._write(keys, lambda count: listed[:count]) == len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """Drops every page of this identity from skippyd (both tiers): the pages of every worker of
        the same layout, which share them."""
        if not self._spaces:
            return
        self._run(
            "store", "clear",
            lambda space: self._clients["store"].evict(
                blocks=True, model=space.model, state=space.state, namespace=space.namespace
            ),
            0,
        )  # fmt: skip

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the transfers since the last call (pages and GB/s of each)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._stats_lock:
            stats, self._stats = self._stats, {name: [] for name in self._stats}
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(int(n) for n in stats["prefetch_pgs"])
        metrics.backup_pgs.extend(int(n) for n in stats["backup_pgs"])
        metrics.prefetch_bandwidth.extend(stats["prefetch_bandwidth"])
        metrics.backup_bandwidth.extend(stats["backup_bandwidth"])
        return metrics

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        if self._admission is not None:
            self._admission.close()
