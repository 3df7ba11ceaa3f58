"""Finding the daemon: which socket a client uses, and the runtime file a serving daemon leaves behind.

A serving daemon writes ``<state_dir>/daemon.json`` (its socket, pid, node, version) once its socket is
published, and removes it when it stops. A client given no socket looks, in order, at:

1. ``$SKIPPYD_SOCKET``;
2. the nearest ``.skippyd/daemon.json`` in the working directory or one of its parents: the daemon
   ``scripts/run.sh`` started in this checkout (its state directory is ``./.skippyd``);
3. ``/run/skippyd/skippyd.sock``, the system service's socket.

Commands that work on a stopped daemon's files (``skippyd l3 fsck``) and are given no state directory
use the nearest ``.skippyd`` directory in the working directory or one of its parents
(:func:`local_state_dir`), else the system's ``/var/lib/skippyd``.

Nothing here imports torch or redis: the CLI, the client and the daemon all use it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_SOCKET",
    "LOCAL_STATE_DIR",
    "RUNTIME_FILE",
    "discover_local",
    "local_state_dir",
    "read_runtime",
    "remove_runtime",
    "resolve_socket_path",
    "write_runtime",
]

DEFAULT_SOCKET = "/run/skippyd/skippyd.sock"
#: The state directory ``scripts/run.sh`` uses, under the checkout.
LOCAL_STATE_DIR = ".skippyd"
RUNTIME_FILE = "daemon.json"
_MAX_RUNTIME_BYTES = 64 << 10


def resolve_socket_path(path: str | os.PathLike[str] | None = None) -> str:
    """The socket to use: the argument, else ``$SKIPPYD_SOCKET``, else the daemon of the checkout the
    working directory is in (``.skippyd/daemon.json``), else /run/skippyd/skippyd.sock."""
    if path is not None:
        return os.fspath(path)
    env = os.environ.get("SKIPPYD_SOCKET")
    if env:
        return env
    local = discover_local()
    if local is not None:
        return str(local["socket"])
    return DEFAULT_SOCKET


def discover_local(start: Path | None = None) -> dict[str, Any] | None:
    """The runtime file of the nearest ``.skippyd`` state directory at or above ``start`` (default: the
    working directory), when it names a socket that exists."""
    try:
        here = (start or Path.cwd()).absolute()
    except OSError:  # the working directory was removed
        return None
    for directory in (here, *here.parents):
        info = read_runtime(directory / LOCAL_STATE_DIR)
        if info is not None and Path(str(info["socket"])).exists():
            return info
    return None


def local_state_dir(start: Path | None = None) -> Path | None:
    """The nearest ``.skippyd`` directory at or above ``start`` (default: the working directory): the
    state directory ``scripts/run.sh`` uses in a checkout, whether or not its daemon runs."""
    try:
        here = (start or Path.cwd()).absolute()
    except OSError:
        return None
    for directory in (here, *here.parents):
        candidate = directory / LOCAL_STATE_DIR
        if candidate.is_dir() and not candidate.is_symlink():
            return candidate
    return None


def read_runtime(state_dir: Path) -> dict[str, Any] | None:
    """What ``write_runtime`` left in ``state_dir``, or None (missing, unreadable, not ours)."""
    try:
        with (state_dir / RUNTIME_FILE).open("rb") as handle:
            raw = handle.read(_MAX_RUNTIME_BYTES)
        info = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("socket"), str):
        return None
    return info


def write_runtime(state_dir: Path, info: dict[str, Any]) -> None:
    """Atomically (temporary file + rename) records where this daemon serves."""
    state_dir.mkdir(parents=True, exist_ok=True)
    temp = state_dir / f".{RUNTIME_FILE}.{os.getpid()}"
    temp.write_text(json.dumps(info, sort_keys=True, indent=2) + "\n")
    os.chmod(temp, 0o644)
    os.rename(temp, state_dir / RUNTIME_FILE)


def remove_runtime(state_dir: Path, pid: int) -> None:
    """Removes the runtime file if it is still this process's (a newer daemon may have replaced it)."""
    info = read_runtime(state_dir)
    if info is not None and info.get("pid") == pid:
        with contextlib.suppress(FileNotFoundError):
            (state_dir / RUNTIME_FILE).unlink()
