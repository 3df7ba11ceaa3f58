"""The composition root: builds the tiers, coordination and server from a Config and runs them.

Start-up order: the checks that need no tier (:func:`preflight`); the owner locks of the state
directory, the L2 directory and the L3 directory, taken before anything under them is touched (a second
daemon pointed at a live one's directories is refused there, with ``store_locked``, having changed
nothing); the metrics port; the embedded Redis (when no ``redis_url``), supervised from then on; L2
(re-adopting what tmpfs still holds), L3 (reconciled), the tiers and handlers, then the socket; the node
is announced to Redis only once the socket serves. Shutdown runs the same list backwards, so committed
entries and the warm table are always left consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import resource
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from . import __version__
from .blocks import Admission
from .cluster.coordination import Coordinator, LocalPromotions, PromotionSettings
from .cluster.redis_embedded import EmbeddedRedis
from .config import Config, human_size
from .display import plural
from .errors import ConfigError, StoreLocked
from .files import release_owner_lock, take_owner_lock
from .handlers import Handlers
from .keys import Identity
from .l2 import L2Tier
from .l3 import L3Store
from .locate import remove_runtime, write_runtime
from .logs import setup_logging
from .payload import Entry
from .server import Server, check_socket_free
from .shm import set_copy_threads, share_with
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
    owner locks of the state, L2 and L3 directories, the metrics port), so a mistake fails in a second,
    not after minutes of L2 verification, and a refused daemon leaves a live one's files alone.
    """
    setup_logging(config.log_level, config.log_format)
    preflight(config)
    raise_open_files_limit()
    set_copy_threads(config.copy_thread_count)  # (a copy_threads above 8 gets the threads it names)
    # the files clients are handed: readable by the socket's group and the allowed ids (shm.share)
    group = grp.getgrnam(config.socket_group).gr_gid if config.socket_group else -1  # (preflight checked it)
    share_with(group, config.allowed_uids, config.allowed_gids)
    with contextlib.ExitStack() as stack:
        state_dir = Path(config.state_dir)
        state_lock = lock_state_dir(state_dir, needed=_needs_state_dir(config))
        if state_lock is not None:
            stack.callback(release_owner_lock, state_lock)
        # the tiers' constructors take their directories' locks and touch nothing else: recovery (adopt,
        # reconcile) waits until everything this daemon needs is known to be its own
        with _owned("L2 directory", "--shm-dir"):
            l2 = L2Tier(config.shm_path, config.l2_budget, hash_threads=config.copy_thread_count)
        stack.callback(l2.close)  # idempotent: normally closed by the tiers first
        l3 = None
        if config.l3_path is not None:
            with _owned("L3 directory", "--l3-dir"):
                l3 = L3Store(config.l3_path, config.l3_budget, min_free_bytes=config.l3_min_free)
            stack.callback(l3.close)
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
        embedded = None
        if not redis_url:
            embedded = EmbeddedRedis(state_dir)
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
        health = Health()
        if embedded is not None and coordinator is not None:  # restarted whenever it dies; the
            # coordinator hears of both, buffers meanwhile, and reports the server's restarts
            coordinator.server_status = embedded.status
            embedded.supervise(on_down=coordinator.server_down, on_up=coordinator.server_up, health=health)
        admission: Admission | None = None
        if config.l3_block_admission == "second-put":
            admission = (
                coordinator.admit if coordinator is not None else LocalPromotions(promotion).consider_many
            )
        held = l2.bytes_to_verify(config.shm_path)
        if held:  # adoption hashes every byte still on tmpfs: tell systemd how long that may take
            seconds = 30 + held / 300e6  # a conservative 300 MB/s of hashing, on top of the usual start
            extend_start_timeout(seconds, f"verifying {held >> 20} MiB of L2 entries")
        l2.adopt()
        if l3 is not None:
            l3.reconcile()
            report = l3.last_reconciliation
            log.info(
                "L3 at %s: %s, %s; reconciliation removed %s, quarantined %d, collected %s",
                config.l3_path, plural(report.manifests, "entry"), plural(report.blocks, "block"),
                plural(report.temporary_removed, "temporary file"), report.manifests_quarantined,
                plural(report.orphans_collected, "orphan"),
            )  # fmt: skip
        tiers = Tiers(
            l2,
            l3=l3,
            promotions=promotions,
            admission=admission,
            copy_threads=config.copy_thread_count,
            settle_waiters=max(1, config.worker_threads - 2),  # two workers always left for the rest
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
            "L2 at %s: %s adopted (%d dropped), %s adopted (%d dropped), budget %s",
            config.shm_path, plural(stats.adopted, "entry"), stats.adopt_dropped,
            plural(stats.block_adopted, "block"), stats.block_adopt_dropped, human_size(config.l2_budget),
        )  # fmt: skip
        handlers = Handlers(config, tiers, coordinator, health=health, sources=sources, server=state)
        server = Server(
            config, handlers, health=health, state=state, housekeeping=tiers.housekeeping,
            before_forced_exit=l2.flush_recency,
        )  # fmt: skip
        late["handlers"] = handlers

        def serving() -> None:
            if coordinator is not None:  # the node is announced only once its socket serves
                coordinator.start(health)
            with contextlib.suppress(OSError):  # how `skippyd` commands in a checkout find this daemon
                info = {"socket": config.socket, "pid": os.getpid(), "node": config.node_name,
                        "version": __version__, "state_dir": config.state_dir}  # fmt: skip
                write_runtime(state_dir, info)
                stack.callback(remove_runtime, state_dir, os.getpid())
            if on_ready is not None:
                on_ready()

        asyncio.run(server.serve(install_signals=install_signals, on_ready=serving))
    return 0


def lock_state_dir(state_dir: Path, *, needed: bool = True) -> int | None:
    """Takes the state directory's owner lock (the embedded Redis, the default L3 and ``daemon.json``
    live there); a live daemon holding it refuses this one with one line, before anything is touched.

    A daemon that keeps nothing there (a shared Redis or none, L3 elsewhere or off) runs on when the
    directory cannot be made (None): only ``daemon.json``, a convenience, is then not written."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with _owned("state directory", "--state-dir"):
            return take_owner_lock(state_dir, "state directory")
    except StoreLocked:
        raise
    except OSError as exc:
        if needed:
            raise ConfigError(f"invalid state_dir: cannot use {state_dir}: {exc.strerror}") from exc
        log.info("state directory %s not usable (%s): nothing of this daemon's lives there", state_dir,
                 exc.strerror)  # fmt: skip
        return None


def _needs_state_dir(config: Config) -> bool:
    """Whether anything of the daemon's lives in the state directory: the embedded Redis, or L3."""
    l3 = config.l3_path
    state = Path(config.state_dir).absolute()
    return not config.redis_url or (l3 is not None and state in (l3.absolute(), *l3.absolute().parents))


@contextlib.contextmanager
def _owned(what: str, flag: str) -> Iterator[None]:
    """A directory another live daemon owns: one line that says what to do."""
    try:
        yield
    except StoreLocked as exc:
        raise StoreLocked(
            f"{exc}: another skippyd uses this {what}; stop it, or give this daemon its own {flag}"
        ) from None


def raise_open_files_limit(most: int = 1 << 20) -> int:
    """Raises this process's soft limit on open descriptors to its hard limit (at most ``most``), as
    servers do: slab and entry descriptors travel in replies, and a shell's soft limit is often 1024.
    Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, target, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


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
    if config.socket_group:
        try:
            grp.getgrnam(config.socket_group)
        except KeyError:
            raise ConfigError(f"invalid socket_group: no group named {config.socket_group!r}") from None
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
