"""vLLM integration: skippyd as a secondary tier behind vLLM's ``OffloadingConnector``.

vLLM 0.33's offloading stack (``OffloadingConnector`` with ``TieringOffloadingSpec``) keeps a CPU primary
tier per instance and loads out-of-tree secondary tiers by module path::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":10737418240,
        "secondary_tiers":[{"type":"SkippydTier","module_path":"skippyd.integrations.vllm",
                            "socket":"/run/skippyd/skippyd.sock"}]}}'

:class:`SkippydTier` lives in vLLM's scheduler process and moves whole chunks (one primary slot each)
between the primary tier's shared memory and skippyd's blocks, keyed by vLLM's ``OffloadKey`` (the
chunk's last block hash and its KV cache group; skippyd binds every key to the identity, so the same
hash under another model or layout is another block). Every method vLLM calls returns at once:

* ``lookup`` answers from the verdicts of one batched ``blocks_contains`` per request and step, asked on
  vLLM's ``AsyncLookupManager`` thread (``RETRY`` until it answered; a daemon that is down or stalled
  answers MISS within ``timeout``, 1 s by default);
* ``submit_store`` (a cascade from the primary tier) puts the job's chunks, one put per KV cache group,
  copied from the primary slots into skippyd; ``submit_load`` (a promotion) reads the blocks straight
  from skippyd's shared memory into the primary slots (``get_into``: one copy). Each runs on its own
  thread and connection, so a large store never holds up a load; a job waits at most ``timeout`` plus
  its bytes at ``SLOWEST_RATE``, and one that finds the daemon away or stalled fails the jobs queued
  behind it at once;
* every job is reported exactly once through ``get_finished_jobs`` (a failed store with
  ``success=False``, which unpins its slots all the same); a failed load marks its keys missing, so the
  scheduler does not ask for them again;
* ``take_events`` reports the chunks skippyd stored and those it answered it no longer holds (found gone
  at a load; never for a daemon that did not answer) as vLLM ``OffloadingEvent``s, when vLLM's KV cache
  events are on.

Identity. ``model`` defaults to the served model's name and ``state`` to a digest of everything that
shapes a chunk: dtype, tokens per hash and blocks per chunk, bytes per chunk, the KV cache groups (their
block sizes, layer names and windows), the layout flags and the parallel sizes; never the engine id, so
two instances of one layout share chunks and two layouts never do. Pass ``model`` to pin a revision.

Options (the keys of the tier's dict besides ``type`` and ``module_path``): ``socket``, ``namespace``,
``model``, ``state``, ``durable`` (default true: chunks reach skippyd's L3), ``redis_url`` + ``scope``
(second-hit admission: a chunk is written to skippyd only once it was offered twice within the window
by any engine of the scope, counted by :class:`skippyd.Promotions`), ``timeout`` (seconds a lookup waits
for the daemon) and ``locality``. An unknown option is refused at engine start.

This module imports vLLM; nothing else in skippyd does.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

import skippyd
from skippyd.errors import ConnectionLost, SkippydError, Timeout
from skippyd.integrations._common import (
    SLOWEST_RATE,
    admission,
    check_durable,
    check_options,
    layout_state,
    why,
)

__all__ = ["LAYOUT_VERSION", "SkippydTier", "tier_identity"]

log = logging.getLogger("skippyd.vllm")

#: Bumped whenever what a chunk's bytes mean to this tier changes: older chunks then miss.
LAYOUT_VERSION = 1

#: The tier's own Prometheus metrics (vLLM's manager adds its transfer bytes, times and lookup delays).
_METRICS = {
    "vllm:skippyd_lookup_chunks": ("chunks SkippydTier asked skippyd about, by answer", ("result",)),
    "vllm:skippyd_stored_chunks": ("chunks cascaded into skippyd (newly stored or already held)", ()),
    "vllm:skippyd_loaded_chunks": ("chunks promoted from skippyd into the CPU primary tier", ()),
    "vllm:skippyd_not_admitted_chunks": ("chunks not written: offered once (second-hit admission)", ()),
    "vllm:skippyd_failed_jobs": ("store and load jobs that failed (daemon away, chunk gone)", ("kind",)),
}

_OPTIONS = ("socket", "namespace", "model", "state", "durable", "redis_url", "scope", "timeout", "locality")
_STOP = object()
#: The daemon did not answer (down, restarting or stalled): the jobs queued behind the one that found it
#: fail at once instead of each waiting its own timeout, and a load says nothing about what skippyd holds.
_AWAY: tuple[type[BaseException], ...] = (ConnectionLost, Timeout, OSError)


def tier_identity(spec: Any, block_size_bytes: int) -> tuple[str, str, int]:
    """``(model, state, block_tokens)`` of an offloading spec: the model name, a digest of the chunk
    layout (never the engine id or ranks that do not change the bytes), and tokens per chunk."""
    cfg = spec.config
    layout = {
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": int(cfg.cache.tokens_per_hash),
        "blocks_per_chunk": int(cfg.cache.blocks_per_chunk),
        "chunk_bytes": int(block_size_bytes),
        "worker_block_bytes": int(cfg.worker_kv_bytes_per_block),
        "groups": [
            [int(g.group_id), int(g.tokens_per_block), list(g.layer_names), g.sliding_window_size_in_chunks]
            for g in cfg.groups
        ],
        "layout": [bool(cfg.replicated_layout), bool(cfg.canonical_layout), cfg.kv_cache_layout],
        "parallel": [
            int(cfg.parallel.tp_size), int(cfg.parallel.pp_size), int(cfg.parallel.pcp_size),
            int(cfg.parallel.dcp_size), int(cfg.parallel.world_size),
        ],
    }  # fmt: skip
    block_tokens = max(1, min(65536, int(cfg.cache.tokens_per_hash) * int(cfg.cache.blocks_per_chunk)))
    return str(cfg.model.name), layout_state("vllm-kv", LAYOUT_VERSION, layout), block_tokens


def _by_group(keys: Sequence[OffloadKey], chunks: Sequence[int]) -> list[tuple[list[bytes], list[int]]]:
    """A job's keys split by KV cache group (the key's last 4 bytes), each in the job's order: one chain
    per group, so skippyd's parent links and tail-first eviction follow vLLM's prefix order."""
    groups: dict[bytes, tuple[list[bytes], list[int]]] = {}
    for key, chunk in zip(keys, chunks, strict=True):
        found = groups.setdefault(bytes(key[-4:]), ([], []))
        found[0].append(bytes(key))
        found[1].append(chunk)
    return list(groups.values())


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup machinery, answered by one ``blocks_contains`` per request and step."""

    def __init__(self, tier: SkippydTier) -> None:
        self._tier = tier
        super().__init__(tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:  # noqa: ARG002
        return self._tier._held(keys)


class SkippydTier(SecondaryTierManager):
    """A vLLM secondary tier backed by the local skippyd daemon (see the module)."""

    medium: ClassVar[Medium] = Medium.CPU  # hits come from host memory (or skippyd's local disk)

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        check_options("SkippydTier", options, _OPTIONS)
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        locality = options.get("locality", "LOCAL")
        self.locality = Locality(locality) if locality else None
        model, state, block_tokens = tier_identity(offloading_spec, self.block_size_bytes)
        self.model = str(options.get("model") or model)
        self.state = str(options.get("state") or state)
        self.namespace = str(options.get("namespace") or "")
        self.block_tokens = block_tokens
        self.durable = check_durable("SkippydTier", options.get("durable", True))
        self.timeout = float(options.get("timeout", 1.0))
        socket = options.get("socket")
        self._flat = primary_kv_view.cast("B")
        self._stride = self.block_size_bytes
        self._events_on = bool(getattr(offloading_spec.kv_events_config, "enable_kv_cache_events", False))
        self._events: list[OffloadingEvent] = []
        self._lock = threading.Lock()
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._missing: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()  # failed loads' keys
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._counts: dict[tuple[str, tuple[str, ...]], int] = {}  # for get_stats, under _lock
        self._admission = admission("SkippydTier", options.get("redis_url"), options.get("scope"))
        # One connection per kind of work: a lookup never waits behind a copy, a load never behind a store.
        # A job's requests wait ``timeout`` plus its bytes at the slowest rate allowed (set per job).
        self._clients = {
            kind: skippyd.Client(socket, timeout=self.timeout, connect_timeout=self.timeout)
            for kind in ("lookup", "load", "store")
        }
        self._stopping = False  # shutdown: jobs still queued fail without running
        self._spaces = {  # made once: a block space hashes the identity when it is built
            kind: client.blocks(
                model=self.model, state=self.state, namespace=self.namespace, block_tokens=self.block_tokens
            )
            for kind, client in self._clients.items()
        }
        self._queues: dict[str, queue.SimpleQueue[Any]] = {
            "load": queue.SimpleQueue(),
            "store": queue.SimpleQueue(),
        }
        self._threads = [
            threading.Thread(target=self._work, args=(kind,), name=f"skippyd-vllm-{kind}", daemon=True)
            for kind in self._queues
        ]
        for thread in self._threads:
            thread.start()
        self._lookups = _Lookups(self)

    # ----------------------------------------------------------------- skippyd side (worker threads)
    def _held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which keys skippyd holds; all False (MISS) while the daemon is away or does not answer."""
        try:
            held = self._spaces["lookup"].held([bytes(k) for k in keys])
        except (SkippydError, OSError) as exc:
            log.warning("skippyd lookup failed, answering MISS: %s", why(exc))
            held = [False] * len(keys)
        self._count("vllm:skippyd_lookup_chunks", sum(held), "hit")
        self._count("vllm:skippyd_lookup_chunks", len(held) - sum(held), "miss")
        return held

    def _slots(self, chunks: Sequence[int]) -> list[memoryview]:
        """Views of the primary slots (no copy); dropped with the job (the last is gone at shutdown)."""
        return [self._flat[c * self._stride : (c + 1) * self._stride] for c in chunks]

    def _bound(self, kind: str, job: TransferJob) -> None:
        """The ``kind`` connection's requests wait ``timeout`` plus this job's bytes at the slowest rate
        allowed: a stalled daemon costs a job seconds, not a fixed 30 s each."""
        self._clients[kind].timeout = self.timeout + len(job.keys) * self._stride / SLOWEST_RATE

    def _store(self, job: TransferJob) -> tuple[JobResult, bool]:
        """The job's result, and whether the daemon did not answer (away or stalled)."""
        keys = list(job.keys)
        chunks = [int(c) for c in job.chunk_ids]
        started = time.perf_counter()
        written = 0
        stored: list[OffloadKey] = []
        self._bound("store", job)
        try:
            space = self._spaces["store"]
            for offered, offered_chunks in _by_group(keys, chunks):
                count = len(offered)
                if self._admission is not None:  # a chain: the admitted run ends at the first refusal
                    count = self._admission.admitted(space, offered, self._stride)
                    self._count("vllm:skippyd_not_admitted_chunks", len(offered) - count)
                if not count:
                    continue
                group_keys = offered[:count]
                put = space.put(group_keys, self._slots(offered_chunks[:count]), durable=self.durable)
                written += put.nbytes
                stored += [OffloadKey(k) for k in group_keys[: put.stored + put.present]]
        except (SkippydError, OSError) as exc:
            log.warning("skippyd store of %d chunks failed: %s", len(keys), why(exc))
            self._count("vllm:skippyd_failed_jobs", 1, "store")
            elapsed = time.perf_counter() - started
            return JobResult(job.job_id, False, transfer_time=elapsed, transfer_bytes=0), isinstance(
                exc, _AWAY
            )
        if stored:
            self._event(stored, removed=False)
            self._count("vllm:skippyd_stored_chunks", len(stored))
        return JobResult(
            job.job_id, True, transfer_time=time.perf_counter() - started, transfer_bytes=written
        ), False

    def _load(self, job: TransferJob) -> tuple[JobResult, bool]:
        """The job's result, and whether the daemon did not answer (away or stalled). Only chunks skippyd
        answered it does not hold are reported removed: a daemon that did not answer may hold them all."""
        keys = list(job.keys)
        chunks = [int(c) for c in job.chunk_ids]
        started = time.perf_counter()
        loaded: list[OffloadKey] = []
        gone: list[OffloadKey] = []
        away = False
        self._bound("load", job)
        try:
            space = self._spaces["load"]
            for group_keys, group_chunks in _by_group(keys, chunks):
                count = space.get_into(group_keys, self._slots(group_chunks))
                loaded += [OffloadKey(k) for k in group_keys[:count]]
                if count < len(group_keys):  # (those after the first one gone may still be held)
                    rest = group_keys[count:]
                    gone += [
                        OffloadKey(k) for k, held in zip(rest, space.held(rest), strict=True) if not held
                    ]
        except (SkippydError, OSError) as exc:
            log.warning("skippyd load of %d chunks failed: %s", len(keys), why(exc))
            away = isinstance(exc, _AWAY)
        elapsed = time.perf_counter() - started
        self._count("vllm:skippyd_loaded_chunks", len(loaded))
        if len(loaded) == len(keys):
            result = JobResult(
                job.job_id, True, transfer_time=elapsed, transfer_bytes=len(keys) * self._stride
            )
            return result, False
        self._count("vllm:skippyd_failed_jobs", 1, "load")
        self._event(gone, removed=True)
        return self._load_failed(job, loaded, elapsed), away

    def _load_failed(self, job: TransferJob, loaded: list[OffloadKey], elapsed: float = 0.0) -> JobResult:
        """A load that did not bring every chunk: the rest are marked missing (the scheduler stops asking
        for them: vLLM's guard against promoting the same chunks for ever)."""
        done = set(loaded)
        self._missing.put([k for k in job.keys if k not in done])
        return JobResult(
            job.job_id, False, successful_keys=tuple(loaded), transfer_time=elapsed,
            transfer_bytes=len(loaded) * self._stride,
        )  # fmt: skip

    def _not_run(self, kind: str, job: TransferJob) -> JobResult:
        """A job failed without running: queued behind one that found the daemon away, or at shutdown."""
        self._count("vllm:skippyd_failed_jobs", 1, kind)
        if kind == "load":
            return self._load_failed(job, [])
        return JobResult(job.job_id, False, transfer_time=0.0, transfer_bytes=0)

    def _work(self, kind: str) -> None:
        jobs = self._queues[kind]
        run = self._load if kind == "load" else self._store
        stop = False
        while not stop:
            job = jobs.get()
            if job is _STOP:
                return
            away = False
            if self._stopping:
                result = self._not_run(kind, job)
            else:
                try:
                    result, away = run(job)
                except Exception:  # a bug: the job is still reported, the thread lives on
                    log.exception("skippyd %s job %s failed", kind, job.job_id)
                    result = JobResult(job.job_id, False, successful_keys=() if kind == "load" else None)
            self._report(result)
            while away:  # every job queued meanwhile fails now, not after a timeout each
                try:
                    queued = jobs.get_nowait()
                except queue.Empty:
                    break
                if queued is _STOP:
                    stop = True
                    break
                self._report(self._not_run(kind, queued))

    def _report(self, result: JobResult) -> None:
        self._finished.put(result)
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def _count(self, name: str, value: int, *labels: str) -> None:
        if value:
            with self._lock:
                key = (name, labels)
                self._counts[key] = self._counts.get(key, 0) + value

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if not self._events_on or not keys:
            return
        event = OffloadingEvent(
            keys=keys, medium=self.medium, removed=removed, locality=self.locality, ownership=self.tier_type
        )
        with self._lock:
            self._events.append(event)

    # ----------------------------------------------------------------- vLLM side (under the manager's lock)
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _submit(self, kind: str, job: TransferJob) -> None:
        with self._idle:
            self._inflight += 1
        self._queues[kind].put(job)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        while True:  # keys a load found gone: the scheduler stops asking for them
            try:
                self._lookups.mark_miss(self._missing.get_nowait())
            except queue.Empty:
                break
        out: list[JobResult] = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._inflight > 0

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0)

    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Recency is skippyd's own (every get touches what it serves)."""

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:  # noqa: ARG002
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:  # noqa: ARG002
        self._lookups.flush()

    def shutdown(self) -> None:
        """Stops the threads (the job each runs ends, those still queued fail without running) and lets
        go of the primary tier's memory."""
        self._stopping = True
        for jobs in self._queues.values():
            jobs.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=60)
        self._lookups.shutdown()
        for client in self._clients.values():
            client.close()
        if self._admission is not None:
            self._admission.close()
        # a failed copy's traceback may still hold views of the primary tier's memory in a reference
        # cycle: collect it now, or the primary tier cannot unmap its region after us
        gc.collect()
        try:
            self._flat.release()
        except BufferError:
            log.warning("views of vLLM's primary tier are still held; it keeps its region mapped")

    def config_info(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:  # noqa: ARG003
        """The tier's own Prometheus metrics (imported in vLLM's API server process too: cheap)."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata

        return {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=labels)
            for name, (doc, labels) in _METRICS.items()
        }

    def get_stats(self) -> Any:
        """What was counted since the last call (vLLM's stats interval), or None."""
        with self._lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for (name, labels), value in counts.items():
            stats.increase_counter(name, value, labelvalues=labels)
        return stats
