"""Every Redis key skippyd uses, built in this one place.

Layout (the prefix is configurable, default ``skippyd``; ``<s>`` is a warm-table shard, ``00``…)::

    {<prefix>:v2:registry}:nodes         HASH  node -> "<incarnation> <heartbeat ms> <ttl ms> <up|forgotten>"
    {<prefix>:v2:warm:<s>}:prefixes      HASH  8-byte chain hash -> "<tick> <node>"
    {<prefix>:v2:warm:<s>}:ages          ZSET  chain hash scored by tick (oldest-first eviction)
    {<prefix>:v2:warm:<s>}:clock         STRING one tick per ran() prompt of this shard
    {<prefix>:v2:warm:<s>}:nodes         HASH  this shard's copy of the registry (what route/warmest read)
    {<prefix>:v2:warm:<s>}:batch:<id>    STRING a ran() batch was applied here (expires; re-sending is safe)
    {<prefix>:v1:promo:<scope>}:obs      HASH  payload digest -> "<first seen ms> <hits> <terminal>"
    {<prefix>:v1:promo:<scope>}:ages     ZSET  payload digest scored by first seen ms

The part in braces is the Redis Cluster hash tag: every key one script touches shares a slot. The warm
table is split into ``shards`` slots (default :data:`WARM_SHARDS`); a prompt's shard follows from the
first hash of its block chain, which covers the model and the first block, so every prefix of one prompt
lives in one shard and different first blocks spread over the cluster. The node registry is its own slot;
every heartbeat also writes the node's record into each shard, so a lookup reads liveness in the slot it
searches (one round trip). Each promotion scope is its own slot. ``<scope>`` is a digest of the scope
name, never the raw text.

Schema version 1 kept the warm table and registry in one slot, ``{<prefix>:v1:warm}``;
``skippyd warm migrate`` moves a version-1 registry over (:attr:`RedisKeys.legacy_warm`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blake3 import blake3

from skippyd.errors import ConfigError

__all__ = ["SCHEMA_VERSION", "WARM_SHARDS", "RedisKeys", "WarmShard"]

SCHEMA_VERSION = 2
WARM_SHARDS = 16  # warm-table shards (hash slots); every daemon and router of one table must agree
MAX_WARM_SHARDS = 1024
_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_BATCH_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class WarmShard:
    """The keys of one warm-table shard (one Redis Cluster hash slot)."""

    tag: str

    @property
    def prefixes(self) -> str:
        return self.tag + ":prefixes"

    @property
    def ages(self) -> str:
        return self.tag + ":ages"

    @property
    def clock(self) -> str:
        return self.tag + ":clock"

    @property
    def nodes(self) -> str:
        return self.tag + ":nodes"

    def batch(self, batch_id: str) -> str:
        """The marker of one ``ran`` batch; ``batch_id`` is 32 lowercase hex digits made by skippyd."""
        if not _BATCH_ID.match(batch_id):
            raise ValueError("a batch id is 32 lowercase hex digits")
        return self.tag + ":batch:" + batch_id


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "skippyd"

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise ConfigError(f"invalid redis_prefix {self.prefix!r}: letters, digits and _.:- only")

    @property
    def base(self) -> str:
        return f"{self.prefix}:v{SCHEMA_VERSION}"

    @property
    def nodes(self) -> str:
        """The node registry (heartbeats, incarnations): ``nodes()``, ``heartbeat`` and ``forget``."""
        return "{" + self.base + ":registry}:nodes"

    def warm_shard(self, index: int, shards: int = WARM_SHARDS) -> WarmShard:
        if not 0 <= index < shards <= MAX_WARM_SHARDS:
            raise ValueError(f"warm shard {index} out of range for {shards} shards")
        width = len(str(shards - 1))
        return WarmShard("{" + f"{self.base}:warm:{index:0{width}d}" + "}")

    @staticmethod
    def warm_shard_index(first_hash: bytes, shards: int = WARM_SHARDS) -> int:
        """The shard of a prompt: its chain's first hash (model and first block) modulo ``shards``."""
        return int.from_bytes(first_hash[:8], "little") % shards

    @property
    def legacy_warm(self) -> WarmShard:
        """Schema version 1's single-slot warm table and registry (read by ``warm migrate`` only)."""
        return WarmShard("{" + f"{self.prefix}:v1:warm" + "}")

    def _promo(self, scope: str) -> str:
        return "{" + f"{self.prefix}:v1:promo:{blake3(scope.encode()).hexdigest()[:32]}" + "}"

    def promo_obs(self, scope: str) -> str:
        return self._promo(scope) + ":obs"

    def promo_ages(self, scope: str) -> str:
        return self._promo(scope) + ":ages"
