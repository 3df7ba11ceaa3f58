"""Every error skippyd raises, each with a stable ``code`` that crosses the socket unchanged.

The daemon answers a failed request with ``{"code": ..., "message": ...}``; the client rebuilds the
same class from the code, so ``except skippyd.NoSpace`` works alike in-process and over the wire.
Codes are part of the protocol (docs/protocol.md): never rename one, only add.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BadFrame",
    "Busy",
    "ConfigError",
    "ConnectionLost",
    "CoordinationTimeout",
    "CoordinationUnavailable",
    "CorruptEntry",
    "DigestMismatch",
    "FrameTooLarge",
    "InvalidArgument",
    "Mismatch",
    "NoDevice",
    "NoSpace",
    "NotConfigured",
    "NotFound",
    "PermissionDenied",
    "ShuttingDown",
    "SkippydError",
    "StoreLocked",
    "Timeout",
    "TooLarge",
    "UnsupportedDtype",
    "VersionMismatch",
    "describe",
    "error_from_wire",
]


class SkippydError(Exception):
    """Base of every skippyd error. ``code`` is stable and travels over the socket."""

    code: str = "internal"
    _registry: ClassVar[dict[str, type[SkippydError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in SkippydError._registry:
                raise TypeError(f"error code {code!r} is already taken")
            SkippydError._registry[code] = cls

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.message,))


class InvalidArgument(SkippydError, ValueError):
    """A request or argument is malformed: wrong type, range or shape."""

    code = "invalid_argument"


class UnsupportedDtype(InvalidArgument):
    """A tensor's dtype is not in skippyd's dtype table."""

    code = "unsupported_dtype"


class BadFrame(SkippydError):
    """A frame on the socket is malformed: wrong magic, truncated, or not decodable."""

    code = "bad_frame"


class FrameTooLarge(BadFrame):
    """A frame announces a body larger than the protocol's limit."""

    code = "frame_too_large"


class VersionMismatch(SkippydError):
    """The peer speaks a protocol version this side does not."""

    code = "version_mismatch"


class TooLarge(SkippydError):
    """An entry is larger than the tier can ever hold (its whole budget or the entry limit)."""

    code = "too_large"


class NoSpace(SkippydError, OSError):
    """The tmpfs or disk under a tier is full; nothing was stored."""

    code = "no_space"


class DigestMismatch(SkippydError):
    """The bytes do not hash to the digest they were admitted or stored under."""

    code = "digest_mismatch"


class CorruptEntry(SkippydError):
    """A stored entry failed verification and was dropped."""

    code = "corrupt"


class NotFound(SkippydError, LookupError):
    """No such entry, staging buffer or node."""

    code = "not_found"


class NotConfigured(SkippydError):
    """The operation needs a part the daemon was started without (e.g. Redis)."""

    code = "not_configured"


class CoordinationUnavailable(SkippydError):
    """Redis did not answer in time or refused; the daemon keeps serving from its tiers."""

    code = "coordination_unavailable"


class CoordinationTimeout(CoordinationUnavailable):
    """Redis did not answer in time: the command may or may not have run (so it is never re-sent)."""


class PermissionDenied(SkippydError, PermissionError):
    """The peer's credentials are not allowed to use this daemon."""

    code = "permission_denied"


class Busy(SkippydError):
    """A bounded resource (staging memory, queue, connection slots) is exhausted; retry later."""

    code = "busy"


class Timeout(SkippydError, TimeoutError):
    """The operation did not finish in time."""

    code = "timeout"


class ConnectionLost(SkippydError, ConnectionError):
    """The daemon is not reachable or closed the connection."""

    code = "connection_lost"


class StoreLocked(SkippydError):
    """Another live process owns this directory (its lock file is held)."""

    code = "store_locked"


class ConfigError(SkippydError, ValueError):
    """A configuration value is invalid; the message names the key."""

    code = "config"


class Mismatch(SkippydError, ValueError):
    """A restored state does not fit the model or cache it is restored into."""

    code = "mismatch"


class NoDevice(InvalidArgument):
    """A device was asked for that this process cannot use (no CUDA, or no such CUDA device)."""

    code = "no_device"


class ShuttingDown(SkippydError):
    """The daemon is stopping and takes no new work."""

    code = "shutting_down"


def describe(value: Any, limit: int = 48) -> str:
    """A short, safe rendering of a value a client sent, for error messages: never recursive, never
    longer than about ``limit`` characters (a client's value may be nested 1,000 deep or 16 MiB long)."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value[:limit])
    elif isinstance(value, bytes | bytearray | memoryview):
        return f"{len(value)} bytes"
    elif isinstance(value, list | tuple) and len(value) <= 8 and all(type(v) is int for v in value):
        text = repr(list(value))  # (a few numbers, say the protocol versions a client offers: shown)
    elif isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)}"
    else:
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_from_wire(body: Any) -> SkippydError:
    """Rebuilds the error a peer sent as ``{"code", "message"}``; unknown codes stay readable."""
    if not isinstance(body, dict):
        return BadFrame(f"error reply is not a map: {type(body).__name__}")
    code = body.get("code")
    message = body.get("message")
    if not isinstance(code, str):
        return BadFrame("error reply without a code")
    text = message if isinstance(message, str) else ""
    cls = SkippydError._registry.get(code)
    if cls is None:
        err = SkippydError(text or code)
        err.code = code
        return err
    return cls(text)


SkippydError._registry["internal"] = SkippydError
