"""``skippyd doctor``: one line per finding, each problem with its fix; non-zero exit on a problem.

Checks what an operator gets wrong on a GPU host: the embedded Redis binary, Redis reachability and
version, the tmpfs under the L2 tier (space, type, huge pages, the POSIX ACL for allowed ids), L3
permissions and free space, the socket's mode and owner, budget sanity, and — when the daemon answers —
what it reports about itself. With ``--gpu``, the GPU data path as an engine on this host would use it
(:mod:`skippyd.client.transfer.probe`, run in the engine's Python: the daemon's never imports torch).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .config import Config, embedded_redis_url, human_size
from .display import plural
from .errors import SkippydError
from .l2.slabs import SLAB_SUFFIX, BadSlab, describe
from .shm import ACL_XATTR, new_name, read_acl
from .stats import Snapshot, redis_summary, server_restarts

__all__ = ["Finding", "check_gpu", "diagnose"]

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    level: str
    what: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.level.upper():4}  {self.what}"
        return f"{text}  →  {self.fix}" if self.fix else text


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, options) of the mount holding ``path``."""
    best = ("/", "", "")
    target = str(path.resolve())
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, parts[2], parts[3])
    return best


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _total_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_redis(config: Config, daemon: Snapshot | None) -> Iterator[Finding]:
    if config.redis_url == "none":
        yield Finding(INFO, "running without Redis: no warm table, promotions counted locally")
        return
    if not config.redis_url:
        if shutil.which("redis-server") is None:
            yield Finding(
                FAIL,
                "redis-server is not installed (the embedded default needs it)",
                "apt-get install redis-server, or set redis_url / --redis-url",
            )
            return
        url = embedded_redis_url(config.state_dir)
        if daemon is None and not Path(url.removeprefix("unix://")).exists():
            yield Finding(INFO, "embedded Redis is not running (the daemon starts it with itself)")
            return
    else:
        url = config.redis_url
    from .cluster.coordination import server_version

    try:
        version = server_version(url)
    except SkippydError as exc:
        yield Finding(
            FAIL,
            f"Redis at {url} is not reachable: {exc}",
            "start it, fix redis_url, or check the socket's permissions",
        )
        return
    major = int(version.split(".", maxsplit=1)[0]) if version.split(".", maxsplit=1)[0].isdigit() else 0
    if major < 6:
        yield Finding(FAIL, f"Redis {version} at {url} is too old", "use Redis 6.2 or newer")
    else:
        yield Finding(OK, f"Redis {version} reachable at {url}")
    if daemon is not None and daemon.redis.degraded:
        yield Finding(
            FAIL,
            f"the daemon's Redis link is {redis_summary(daemon.redis)}",
            "check Redis load and network; the daemon retries with backoff"
            + (" and restarts its embedded redis-server" if daemon.redis.embedded else ""),
        )
    if daemon is not None and daemon.redis.embedded and daemon.redis.server_restarts:
        yield Finding(
            WARN,
            f"the embedded redis-server died and was {server_restarts(daemon.redis)}",
            f"see {Path(config.state_dir) / 'redis' / 'redis.log'} and the kernel log (OOM killer)",
        )


def check_tmpfs(config: Config) -> Iterator[Finding]:
    shm = config.shm_path
    point, fstype, options = _mount_of(_existing(shm))
    if fstype != "tmpfs":
        yield Finding(
            FAIL,
            f"L2 dir {shm} is on {fstype or 'an unknown filesystem'}, not tmpfs",
            "put --shm-dir on a tmpfs (default /dev/shm/skippyd-<node>)",
        )
        return
    st = os.statvfs(_existing(shm))
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    # allocated bytes, not sizes: block slabs are sparse (a free slot is a hole until it is used)
    held = sum(p.stat().st_blocks * 512 for p in shm.rglob("*") if p.is_file()) if shm.exists() else 0
    if size < config.l2_budget:
        yield Finding(
            WARN,
            f"tmpfs {point} is {human_size(size)} but l2_budget is {human_size(config.l2_budget)}: "
            "captures will fail with no_space once it is full",
            f"lower --l2-budget or grow it (mount -o remount,size=... {point}; Docker: --shm-size)",
        )
    elif free + held < config.l2_budget:
        yield Finding(
            WARN,
            f"tmpfs {point} has {human_size(free)} free, less than the L2 budget needs",
            "other programs use this tmpfs: give skippyd its own mount or lower --l2-budget",
        )
    else:
        yield Finding(
            OK,
            f"tmpfs {point}: {human_size(size)}, {human_size(free)} free "
            f"for a {human_size(config.l2_budget)} budget",
        )
    if "huge=" not in options or "huge=never" in options:
        yield Finding(
            INFO,
            f"tmpfs {point} uses 4 KiB pages",
            "a dedicated tmpfs mounted huge=within_size makes fresh admits and copy restores faster",
        )
    ram = _total_ram()
    if ram and config.l2_budget > ram * 0.8:
        yield Finding(
            FAIL,
            f"l2_budget {human_size(config.l2_budget)} is over 80% of RAM ({human_size(ram)})",
            "tmpfs pages are RAM: leave room for the engine and the page cache",
        )
    if shm.exists():
        mode = stat.S_IMODE(shm.stat().st_mode)
        if mode & 0o077:
            yield Finding(FAIL, f"L2 dir {shm} has mode {mode:o}", f"chmod 700 {shm}")
        if shm.stat().st_uid != os.geteuid():
            yield Finding(
                WARN,
                f"L2 dir {shm} belongs to uid {shm.stat().st_uid}, not this user",
                "run doctor as the daemon's user, or chown it",
            )


def _scratch_file(where: Path) -> int:
    """An fd of a new file in ``where`` that no path names: ``O_TMPFILE``, or where the filesystem has no
    such thing, a random name removed at once."""
    try:
        return os.open(where, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    path = where / f".doctor-{new_name('')}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return fd


def check_sharing(config: Config) -> Iterator[Finding]:
    """Whether the L2 tmpfs takes the POSIX ACL that gives ``allowed_uids``/``allowed_gids`` read access to
    the files clients are handed (tried on an unnamed file there: ``O_TMPFILE``, nothing left behind).
    Without it such clients are still served, through each reply's descriptor: a copy a call instead of a
    mapping they keep."""
    if not config.allowed_uids and not config.allowed_gids:
        return
    where = _existing(config.shm_path)
    point = _mount_of(where)[0]
    try:
        fd = _scratch_file(where)
    except OSError as exc:
        refused = exc.errno in (errno.EACCES, errno.EPERM)
        fix = "run doctor as the daemon's user" if refused else ""
        yield Finding(INFO, f"cannot try a POSIX ACL on {where} ({exc.strerror})", fix)
        return
    try:
        os.setxattr(fd, ACL_XATTR, read_acl(config.allowed_uids, config.allowed_gids))
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            yield Finding(
                WARN,
                f"{point} has no POSIX ACLs: clients allowed by allowed_uids/allowed_gids alone are "
                "served a copy each call instead of a mapping they keep",
                "mount a tmpfs with ACL support for --shm-dir (a kernel with CONFIG_TMPFS_POSIX_ACL), or "
                "put those clients in the socket's group (--socket-group)",
            )
        else:
            yield Finding(INFO, f"cannot try a POSIX ACL on {where} ({exc.strerror})")
    else:
        ids = [*(f"uid {uid}" for uid in config.allowed_uids), *(f"gid {gid}" for gid in config.allowed_gids)]
        yield Finding(OK, f"L2 files give {', '.join(ids)} read access (a POSIX ACL on {point})")
    finally:
        os.close(fd)


def check_slabs(config: Config) -> Iterator[Finding]:
    """The block slabs on the L2 tmpfs, read without opening them for writing (the daemon may run)."""
    directory = config.shm_path / "blocks"
    if not directory.is_dir():
        return
    count = committed = wanted = allocated = 0
    classes: set[int] = set()
    for path in sorted(directory.glob(f"*{SLAB_SUFFIX}")):
        try:
            facts = describe(path)
        except (BadSlab, OSError) as exc:
            yield Finding(
                WARN,
                f"L2 block slab {path.name} is damaged ({exc})",
                "the daemon drops it (and the blocks in it) at its next start; nothing wrong is served",
            )
            continue
        count += 1
        committed += facts.committed
        wanted += facts.durable_wanted
        allocated += facts.allocated
        classes.add(facts.slot_size)
    if count:
        sizes = ", ".join(human_size(size) for size in sorted(classes))
        yield Finding(
            OK,
            f"L2 block slabs: {plural(count, 'slab')} ({sizes} slots), {plural(committed, 'block')}, "
            f"{human_size(allocated)} of tmpfs",
        )
    if wanted:
        yield Finding(
            INFO,
            f"{plural(wanted, 'L2 block')} still wait for their L3 copy",
            "written by the daemon's block writer; a daemon restart re-queues them, a reboot loses them",
        )


def check_l3(config: Config) -> Iterator[Finding]:
    path = config.l3_path
    if path is None:
        yield Finding(INFO, "L3 is off: nothing survives a reboot")
        return
    where = _existing(path)
    if not path.exists():
        if not os.access(where, os.W_OK):
            yield Finding(
                FAIL,
                f"L3 dir {path} does not exist and {where} is not writable",
                f"create it: install -d -m 700 {path} (owned by the daemon's user)",
            )
        else:
            yield Finding(INFO, f"L3 dir {path} will be created at start")
    else:
        st = path.stat()
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            yield Finding(FAIL, f"L3 dir {path} has mode {mode:o}", f"chmod 700 {path}")
        if not os.access(path, os.W_OK | os.X_OK):
            yield Finding(
                FAIL, f"L3 dir {path} is not writable by this user", f"chown the daemon's user {path}"
            )
        quarantine = path / "quarantine"
        if quarantine.exists() and any(quarantine.iterdir()):
            count = sum(1 for _ in quarantine.iterdir())
            yield Finding(
                WARN,
                f"L3 quarantine holds {count} file(s) that failed verification",
                f"inspect {quarantine} (disk errors?), then remove them",
            )
    vfs = os.statvfs(where)
    free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    if free < config.l3_min_free:
        yield Finding(
            FAIL,
            f"L3 disk has {human_size(free)} free, below l3_min_free {human_size(config.l3_min_free)}: "
            "L3 is read-only",
            "free disk space or lower --l3-budget/--l3-min-free",
        )
    else:
        yield Finding(
            OK,
            f"L3 disk: {human_size(free)} free of {human_size(total)} "
            f"(floor {human_size(config.l3_min_free)})",
        )
    if config.l3_budget > total:
        yield Finding(
            WARN,
            f"l3_budget {human_size(config.l3_budget)} is larger than the disk ({human_size(total)})",
            "lower --l3-budget: the free-space floor will stop writes first",
        )


def check_socket(config: Config, answering: bool) -> Iterator[Finding]:
    path = Path(config.socket)
    if not path.exists():
        if not os.access(_existing(path.parent), os.W_OK):
            yield Finding(
                FAIL,
                f"socket dir {path.parent} is not writable by this user",
                "systemd: RuntimeDirectory=skippyd; by hand: create it for the daemon's user",
            )
        else:
            yield Finding(WARN if not answering else OK, f"no socket at {path}: the daemon is not running")
        return
    st = path.lstat()
    if not stat.S_ISSOCK(st.st_mode):
        yield Finding(FAIL, f"{path} is not a socket", "remove it; the daemon publishes the socket itself")
        return
    mode = stat.S_IMODE(st.st_mode)
    owner = f"uid {st.st_uid} gid {st.st_gid}"
    want = config.socket_mode
    if mode != want:
        yield Finding(
            FAIL,
            f"socket {path} has mode {mode:o} ({owner})",
            f"restart the daemon (it publishes {want:o}); do not loosen it by hand",
        )
    else:
        why = ", access by allowed_uids/allowed_gids" if want != 0o660 else ""
        yield Finding(OK, f"socket {path}: mode {mode:o}{why}, {owner}")
    if not answering:
        yield Finding(
            FAIL,
            f"nothing answers on {path} (a stale socket)",
            "start the daemon; it replaces a stale socket",
        )


def check_budgets(config: Config) -> Iterator[Finding]:
    if config.max_entry and config.max_entry > config.l2_budget:
        yield Finding(
            WARN,
            "max_entry is larger than the L2 budget; the budget caps it",
            "set --max-entry at most --l2-budget",
        )
    if config.staging_budget < min(64 << 20, config.l2_budget):
        yield Finding(
            WARN,
            f"staging_budget {human_size(config.staging_budget)} is small: large captures get busy errors",
            "raise --staging-budget to the largest capture times the engines capturing at once",
        )
    if config.l2_budget < 64 << 20:
        yield Finding(
            WARN,
            f"l2_budget {human_size(config.l2_budget)} holds little KV",
            "size it from the engines' KV bytes",
        )


def check_daemon(daemon: Snapshot | None) -> Iterator[Finding]:
    if daemon is None:
        return
    yield Finding(
        OK,
        f"daemon {daemon.version} answers: node {daemon.node}, "
        f"{plural(daemon.l2.entries, 'L2 entry', 'L2 entries')}, "
        f"{plural(daemon.l2.block_count, 'L2 block')}, {human_size(daemon.l2.used_bytes)} used of "
        f"{human_size(daemon.l2.budget_bytes)} (+ {human_size(daemon.l2.reserve_bytes)} pre-faulted reserve)",
    )
    l2 = daemon.l2
    if l2.block_count or l2.block_slabs:
        yield Finding(
            OK,
            f"the daemon holds {plural(l2.block_count, 'block')} in L2 ({human_size(l2.block_bytes)} "
            f"in {plural(l2.block_slabs, 'slab')})",
        )
    if l2.block_adopt_dropped:
        yield Finding(
            WARN,
            f"{plural(l2.block_adopt_dropped, 'L2 block')} failed verification at start and were dropped",
            "something wrote to the tmpfs behind the daemon's back, or memory is failing (check dmesg)",
        )
    l3 = daemon.l3
    if l3 is not None and l3.readonly:
        yield Finding(FAIL, "the daemon's L3 is read-only (disk below its floor)", "free disk space")
    if l3 is not None and l3.corrupt:
        yield Finding(
            WARN,
            f"{l3.corrupt} L3 entries failed verification since start",
            "check the disk (SMART, dmesg); skippyd l3 fsck after stopping the daemon",
        )
    report = daemon.reconciliation
    if report is not None:
        repaired = {
            k: v
            for k, v in report.as_dict().items()
            if k not in ("manifests", "objects", "verified", "problems") and v
        }
        if repaired:
            details = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(repaired.items()))
            yield Finding(
                WARN,
                f"L3 start-up reconciliation repaired: {details}",
                "usually a crash mid-write; if it repeats, check the disk and run skippyd l3 fsck",
            )
    for name, thread in sorted(daemon.threads.items()):
        if not thread.alive:
            yield Finding(
                FAIL,
                f"background thread {name} died (last error: {thread.last_error or 'none'})",
                "restart the daemon (under systemd its watchdog does); the log has the traceback",
            )
        elif thread.errors:
            yield Finding(
                WARN,
                f"background thread {name}: {thread.errors} job(s) failed, the last with {thread.last_error}",
                "the log has each failure; a full disk or tmpfs, or Redis away, explains most",
            )
    durable = daemon.durable
    if durable is not None and durable.lost:
        yield Finding(
            WARN,
            f"{durable.lost} deferred durable writes were lost (their entries left L2 before L3 had room)",
            "raise --l3-queue, use a faster disk, or give L3 more room (it may be read-only)",
        )
    if durable is not None and durable.backlog:
        yield Finding(
            INFO,
            f"{durable.backlog} durable writes are waiting for L3 (queue full, or L3 out of room)",
            "they are written once L3 can take them; a backlog that keeps growing needs a faster disk",
        )


def diagnose(config: Config, daemon: Snapshot | None) -> list[Finding]:
    findings: list[Finding] = []
    for check in (
        check_socket(config, daemon is not None),
        check_redis(config, daemon),
        check_tmpfs(config),
        check_sharing(config),
        check_slabs(config),
        check_l3(config),
        check_budgets(config),
        check_daemon(daemon),
    ):
        findings.extend(check)
    return findings


def check_gpu(python: str, socket: str, *, mib: int = 256, timeout: float = 300.0) -> Iterator[Finding]:
    """The GPU data path's findings, from the probe run in ``python`` (the engine's interpreter, with
    torch and skippyd installed) against the daemon on ``socket``."""
    command = [python, "-m", "skippyd.client.transfer.probe", "--socket", socket, "--mib", str(mib)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        yield Finding(FAIL, f"gpu: no Python at {python}", "--python PATH: the engine's interpreter")
        return
    except subprocess.TimeoutExpired:
        yield Finding(
            FAIL, f"gpu: the probe did not finish in {timeout:.0f} s", "--gpu-mib 64 (a smaller probe)"
        )
        return
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except ValueError:
        found = None
    if not isinstance(found, list):
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if "No module named skippyd" in done.stderr or "No module named 'skippyd" in done.stderr:
            yield Finding(FAIL, f"gpu: skippyd is not installed for {python}", "pip install skippyd there")
        else:
            yield Finding(FAIL, f"gpu: the probe failed: {why}", f"run it alone: {' '.join(command)}")
        return
    for item in found:
        if isinstance(item, dict) and item.get("level") in (OK, INFO, WARN, FAIL):
            yield Finding(str(item["level"]), f"gpu: {item.get('what', '')}", str(item.get("fix", "")))
