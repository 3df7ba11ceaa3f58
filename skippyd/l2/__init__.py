"""The L2 hot tier in tmpfs: the tier and its index (:mod:`.tier`), its file pool (:mod:`.pool`) and
recovery at start (:mod:`.adopt`)."""

from __future__ import annotations

from .pool import File, FilePool, PoolStats
from .tier import Held, L2Stats, L2Tier, Listed, Reservation, copy_and_hash, copy_into

__all__ = [
    "File",
    "FilePool",
    "Held",
    "L2Stats",
    "L2Tier",
    "Listed",
    "PoolStats",
    "Reservation",
    "copy_and_hash",
    "copy_into",
]
