"""How much of skippyd's shared memory the device transfer keeps ready (client side; no torch).

A GPU engine's working set of prefixes is a large part of the daemon's L2: every slab it reads is kept
mapped (one open file each, to notice when the daemon removes it) and registered with CUDA, so a restore
of a prefix read before neither maps nor registers again (registering costs ≈ 0.05-0.1 s a GiB). Both
are bounded, least recently used first:

* **kept files**: 256, slabs and entry files alike (8 GiB of 32 MiB slabs); ``SKIPPYD_KEPT_FILES`` sets
  it (at least 16; each is an open file: keep it under a quarter of ``ulimit -n``).
* **registered bytes**: 64 GiB; ``SKIPPYD_PIN_LIMIT`` sets it (a size: ``256GiB``; at least 1 MiB).

Why not more by default: registering pins pages. Those of a slot the daemon punches (and of a file it
removes) stay pinned, outside the daemon's budget, until this process looks again: about once a second
while it transfers (:meth:`~skippyd.client.transfer.device.DeviceTransfer.sweep_punched`), and once a second
on the idle sweeper's thread when it does not
(:meth:`~skippyd.client.transfer.device.DeviceTransfer.sweep_idle`). The bounds cap that memory meanwhile.
Raise them for a working set larger than 8 GiB where the host has the room.

A value that does not parse is :class:`~skippyd.errors.ConfigError`, naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from skippyd.config import parse_size
from skippyd.errors import ConfigError

__all__ = ["KEPT_FILES_ENV", "PIN_LIMIT_ENV", "kept_files", "pin_limit"]

KEPT_FILES_ENV = "SKIPPYD_KEPT_FILES"
PIN_LIMIT_ENV = "SKIPPYD_PIN_LIMIT"

_KEPT_LEAST, _KEPT_DEFAULT = 16, 256
_PIN_LEAST, _PIN_DEFAULT = 1 << 20, 64 << 30


def kept_files(environ: Mapping[str, str] | None = None) -> int:
    """How many files' mappings the device transfer keeps (see the module)."""
    text = (os.environ if environ is None else environ).get(KEPT_FILES_ENV, "").strip()
    if not text:
        return _KEPT_DEFAULT
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{KEPT_FILES_ENV}={text!r} is not a whole number") from None
    if value < _KEPT_LEAST:
        raise ConfigError(f"{KEPT_FILES_ENV}={value} is below {_KEPT_LEAST}")
    return value


def pin_limit(environ: Mapping[str, str] | None = None) -> int:
    """How many bytes the device transfer keeps registered with CUDA (see the module)."""
    text = (os.environ if environ is None else environ).get(PIN_LIMIT_ENV, "").strip()
    if not text:
        return _PIN_DEFAULT
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"{PIN_LIMIT_ENV}: {exc}") from None
    if value < _PIN_LEAST:
        raise ConfigError(f"{PIN_LIMIT_ENV}={text} is below 1MiB")
    return value
