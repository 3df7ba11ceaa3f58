"""How much of skippyd's shared memory the device transfer keeps ready (client side; no torch).

A GPU engine's working set of prefixes is a large part of the daemon's L2: every slab it reads is kept
mapped (one open file each, to notice when the daemon removes it) and registered with CUDA, so a restore
of a prefix read before neither maps nor registers again (registering costs ≈ 0.05-0.1 s a GiB). Both
are bounded, least recently used first; the bounds follow the host by default:

* **kept files**: a quarter of this process's open-file limit (``ulimit -n``; vLLM raises it to 65,535),
  at least 256 and at most 16,384. ``SKIPPYD_KEPT_FILES`` sets it (at least 16).
* **registered bytes**: half of the host's memory, at least 64 GiB. Registering the daemon's memory
  pins pages that are already resident (its tmpfs), so the bound is on pages a punched slot leaves
  pinned until the next reply naming its slab says so (docs/protocol.md, slot maps).
  ``SKIPPYD_PIN_LIMIT`` sets it (a size: ``256GiB``; at least 1 MiB).

A value that does not parse is :class:`~skippyd.errors.ConfigError`, naming the variable.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping

from skippyd.config import parse_size
from skippyd.errors import ConfigError

__all__ = ["KEPT_FILES_ENV", "PIN_LIMIT_ENV", "kept_files", "pin_limit"]

KEPT_FILES_ENV = "SKIPPYD_KEPT_FILES"
PIN_LIMIT_ENV = "SKIPPYD_PIN_LIMIT"

_KEPT_LEAST, _KEPT_DEFAULT_LEAST, _KEPT_DEFAULT_MOST = 16, 256, 16384
_PIN_LEAST, _PIN_DEFAULT_LEAST = 1 << 20, 64 << 30


def kept_files(environ: Mapping[str, str] | None = None, soft_limit: int | None = None) -> int:
    """How many files' mappings the device transfer keeps (see the module)."""
    text = (os.environ if environ is None else environ).get(KEPT_FILES_ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{KEPT_FILES_ENV}={text!r} is not a whole number") from None
        if value < _KEPT_LEAST:
            raise ConfigError(f"{KEPT_FILES_ENV}={value} is below {_KEPT_LEAST}")
        return value
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        soft_limit = 1 << 20
    return max(_KEPT_DEFAULT_LEAST, min(_KEPT_DEFAULT_MOST, soft_limit // 4))


def pin_limit(environ: Mapping[str, str] | None = None, memory: int | None = None) -> int:
    """How many bytes the device transfer keeps registered with CUDA (see the module)."""
    text = (os.environ if environ is None else environ).get(PIN_LIMIT_ENV, "").strip()
    if text:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise ConfigError(f"{PIN_LIMIT_ENV}: {exc}") from None
        if value < _PIN_LEAST:
            raise ConfigError(f"{PIN_LIMIT_ENV}={text} is below 1MiB")
        return value
    if memory is None:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(_PIN_DEFAULT_LEAST, memory // 2)
