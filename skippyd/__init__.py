"""skippyd: a KV-cache daemon for LLM serving hosts.

``import skippyd`` stays light: the client (torch) and the coordination layer (redis) load on first use,
so the daemon's own import path never pulls torch in.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import (
    BadFrame,
    Busy,
    ConfigError,
    ConnectionLost,
    CoordinationTimeout,
    CoordinationUnavailable,
    CorruptEntry,
    DigestMismatch,
    FrameTooLarge,
    InvalidArgument,
    Mismatch,
    NoDevice,
    NoSpace,
    NotConfigured,
    NotFound,
    PermissionDenied,
    ShuttingDown,
    SkippydError,
    StoreLocked,
    Timeout,
    TooLarge,
    UnsupportedDtype,
    VersionMismatch,
)

__version__ = "0.1.0"

_LAZY = {
    "Client": "skippyd.client",
    "AsyncClient": "skippyd.client",
    "BlockSpace": "skippyd.client.blockspace",
    "AsyncBlockSpace": "skippyd.client.blockspace",
    "BlocksPut": "skippyd.client.blockspace",
    "CaptureResult": "skippyd.client",
    "Hit": "skippyd.client",
    "Restored": "skippyd.client",
    "WarmTable": "skippyd.cluster.coordination",
    "Route": "skippyd.cluster.coordination",
    "Promotions": "skippyd.cluster.coordination",
    "Identity": "skippyd.keys",
    "cache_key": "skippyd.keys",
    "encode_tokens": "skippyd.keys",
}

__all__ = [
    "AsyncBlockSpace",
    "AsyncClient",
    "BadFrame",
    "BlockSpace",
    "BlocksPut",
    "Busy",
    "CaptureResult",
    "Client",
    "ConfigError",
    "ConnectionLost",
    "CoordinationTimeout",
    "CoordinationUnavailable",
    "CorruptEntry",
    "DigestMismatch",
    "FrameTooLarge",
    "Hit",
    "Identity",
    "InvalidArgument",
    "Mismatch",
    "NoDevice",
    "NoSpace",
    "NotConfigured",
    "NotFound",
    "PermissionDenied",
    "Promotions",
    "Restored",
    "Route",
    "ShuttingDown",
    "SkippydError",
    "StoreLocked",
    "Timeout",
    "TooLarge",
    "UnsupportedDtype",
    "VersionMismatch",
    "WarmTable",
    "__version__",
    "cache_key",
    "encode_tokens",
]

if TYPE_CHECKING:  # pragma: no cover
    from .client import AsyncClient, CaptureResult, Client, Hit, Restored
    from .cluster.coordination import Promotions, Route, WarmTable
    from .keys import Identity, cache_key, encode_tokens


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'skippyd' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
