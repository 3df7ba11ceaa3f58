"""The composition root: builds the tiers, coordination and server from a Config and runs them.

Start-up order: the checks that need no tier (:func:`preflight`), the metrics port, the embedded Redis
(when no ``redis_url``), L2 (re-adopting what tmpfs still holds), L3 (reconciled), the tiers and
handlers, then the socket; the node is announced to Redis only once the socket serves. Shutdown runs the
same list backwards, so committed entries and the warm table are always left consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from . import __version__
from .blocks import Admission
from .config import Config, human_size
from .coordination import Coordinator, LocalPromotions, PromotionSettings
from .errors import ConfigError
from .handlers import Handlers
from .keys import Identity
from .l2 import L2Tier
from .l3 import L3Store
from .locate import remove_runtime, write_runtime
from .logs import setup_logging
from .payload import Entry
from .redis_embedded import EmbeddedRedis
from .server import Server, check_socket_free
from .stats import ServerState, Snapshot
from .systemd import extend_start_timeout
from .tiers import PromotionPolicy, Tiers
from .workers import Health

__all__ = ["run"]

log = logging.getLogger("skippyd.daemon")


def run(
    config: Config,
    *,
    sources: Mapping[str, str] | None = None,
    on_ready: Callable[[], None] | None = None,
    install_signals: bool = True,
) -> int:
    """Runs the daemon until SIGTERM/SIGINT; returns the process exit code.

    Everything that can be checked without touching the tiers is checked first (the configuration
    was validated when it was loaded; here: a live daemon on the socket, the socket's directory, the
    metrics port), so a mistake fails in a second, not after minutes of L2 verification.
    """
    setup_logging(config.log_level, config.log_format)
    preflight(config)
    with contextlib.ExitStack() as stack:
        late: dict[str, Handlers] = {}
        state = ServerState()
        if config.metrics_addr:
            from .metrics import DaemonCollector, MetricsServer

            def snapshot() -> Snapshot | None:
                handlers = late.get("handlers")
                return handlers.snapshot() if handlers is not None else None  # None: still starting

            metrics = MetricsServer(config.metrics_addr, DaemonCollector(snapshot, state.latency.snapshot))
            metrics.start()  # bound before the tiers start: a port in use fails now
            stack.callback(metrics.stop)
        redis_url = config.redis_url
        if not redis_url:
            embedded = EmbeddedRedis(Path(config.state_dir))
            redis_url = embedded.start()
            stack.callback(embedded.stop)
        coordinator = None
        promotion = PromotionSettings(
            config.promotion_window, config.promotion_max_bytes, config.promotion_worth_tokens,
            config.promotion_max_observations,
        )  # fmt: skip
        promotions: PromotionPolicy = LocalPromotions(promotion)
        if redis_url != "none":
            coordinator = Coordinator(
                redis_url,
                node=config.node_name,
                scope=config.scope,
                prefix=config.redis_prefix,
                timeout=config.redis_timeout,
                heartbeat_s=config.heartbeat,
                ttl_s=config.node_ttl,
                buffer=config.ran_buffer,
                promotion=promotion,
            )
            stack.callback(coordinator.close)
            promotions = coordinator
        admission: Admission | None = None
        if config.l3_block_admission == "second-put":
            admission = (
                coordinator.admit if coordinator is not None else LocalPromotions(promotion).consider_many
            )
        l2 = L2Tier(config.shm_path, config.l2_budget, hash_threads=config.copy_threads)
        try:
            held = l2.bytes_to_verify(config.shm_path)
            if held:  # adoption hashes every byte still on tmpfs: tell systemd how long that may take
                seconds = 30 + held / 300e6  # a conservative 300 MB/s of hashing, on top of the usual start
                extend_start_timeout(seconds, f"verifying {held >> 20} MiB of L2 entries")
            l2.adopt()
            l3 = None
            if config.l3_path is not None:
                l3 = L3Store.open(config.l3_path, config.l3_budget, min_free_bytes=config.l3_min_free)
        except BaseException:
            l2.close()
            raise
        if l3 is not None:
            report = l3.last_reconciliation
            log.info(
                "L3 at %s: %d entries; reconciliation removed %d temporary file(s), quarantined %d, "
                "collected %d orphan(s)", config.l3_path, report.manifests, report.temporary_removed,
                report.manifests_quarantined, report.orphans_collected,
            )  # fmt: skip
        health = Health()
        tiers = Tiers(
            l2,
            l3=l3,
            promotions=promotions,
            admission=admission,
            copy_threads=config.copy_threads,
            max_entry=config.entry_limit,
            l3_queue=config.l3_queue,
            fill_budget=config.fill_budget,
            reserve_bytes=config.l2_reserve,
            reserve_window=config.l2_reserve_window,
            reserve_rate=config.l2_reserve_rate,
            reserve_share=config.l2_reserve_share,
            digest_backlog=config.l2_digest_backlog,
            sync_timeout=config.sync_timeout,
            health=health,
        )
        stack.callback(tiers.close, config.shutdown_timeout)
        if coordinator is not None and config.warm_on_capture:
            tiers.capture_hooks.append(_feed_warm_table(coordinator))
        stats = l2.stats()
        log.info(
            "L2 at %s: %d entries adopted (%d dropped), budget %d bytes",
            config.shm_path,
            stats.adopted,
            stats.adopt_dropped,
            config.l2_budget,
        )
        handlers = Handlers(config, tiers, coordinator, health=health, sources=sources, server=state)
        server = Server(
            config, handlers, health=health, state=state, housekeeping=tiers.housekeeping,
            before_forced_exit=l2.flush_recency,
        )  # fmt: skip
        late["handlers"] = handlers

        def serving() -> None:
            if coordinator is not None:  # the node is announced only once its socket serves
                coordinator.start(health)
            state_dir = Path(config.state_dir)
            with contextlib.suppress(OSError):  # how `skippyd` commands in a checkout find this daemon
                info = {"socket": config.socket, "pid": os.getpid(), "node": config.node_name,
                        "version": __version__, "state_dir": config.state_dir}  # fmt: skip
                write_runtime(state_dir, info)
                stack.callback(remove_runtime, state_dir, os.getpid())
            if on_ready is not None:
                on_ready()

        asyncio.run(server.serve(install_signals=install_signals, on_ready=serving))
    return 0


def preflight(config: Config) -> None:
    """Fails fast on what would otherwise fail after start-up I/O; warns about what will fail later."""
    socket = Path(config.socket)
    check_socket_free(socket)
    parent = socket.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"invalid socket: cannot create its directory {parent}: {exc.strerror}") from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"invalid socket: {parent} is not writable by this user")
    where = config.shm_path
    while not where.exists() and where != where.parent:
        where = where.parent
    vfs = os.statvfs(where)
    size = vfs.f_blocks * vfs.f_frsize
    if size < config.l2_budget:
        log.warning(
            "l2_budget %s is larger than the filesystem under %s (%s): captures will fail with no_space "
            "once it is full; lower --l2-budget or grow the tmpfs",
            human_size(config.l2_budget), config.shm_path, human_size(size),
        )  # fmt: skip


def _feed_warm_table(coordinator: Coordinator) -> Callable[[Identity, bytes, Entry], None]:
    """A capture is this node running that prompt: the warm table hears of it (in a batch, later)."""

    def hook(identity: Identity, tokens: bytes, entry: Entry) -> None:  # noqa: ARG001 - the hook's signature
        coordinator.ran(identity.model, tokens)

    return hook
