"""systemd's notification protocol (``Type=notify``): READY, STOPPING, WATCHDOG, STATUS, start timeout.

Messages go to the datagram socket in ``$NOTIFY_SOCKET`` (an abstract one when it starts with ``@``);
without it every call is a no-op that returns False, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["extend_start_timeout", "notify", "watchdog_interval"]

log = logging.getLogger("skippyd.systemd")


def notify(state: str) -> bool:
    """Sends ``state`` (``READY=1``, ``STOPPING=1``, ``WATCHDOG=1``, ``STATUS=…``, newline-separated)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("could not notify systemd (%s): %s", state.split("=", maxsplit=1)[0], exc)
        return False
    return True


def watchdog_interval() -> float:
    """Half of ``$WATCHDOG_USEC`` in seconds when the watchdog is meant for this process, else 0."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return 0.0
    try:
        return max(0.05, int(usec) / 1e6 / 2)
    except ValueError:
        return 0.0


def extend_start_timeout(seconds: float, status: str) -> bool:
    """Asks for ``seconds`` more to start (a long L2 verification), with a status line to show."""
    return notify(f"STATUS={status}\nEXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")
