"""The L3 durable tier on local disk: the store and its index (:mod:`.store`), the manifest format and
object names (:mod:`.manifest`), the directory layout (:mod:`.layout`) and recovery (:mod:`.reconcile`)."""

from __future__ import annotations

from .manifest import SEGMENT_BYTES, Manifest, object_id
from .reconcile import Reconciliation
from .store import L3Ref, L3Stats, L3Store

__all__ = ["SEGMENT_BYTES", "L3Ref", "L3Stats", "L3Store", "Manifest", "Reconciliation", "object_id"]
