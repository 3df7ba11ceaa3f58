"""Every Redis key skippyd uses, built in this one place.

Layout (schema version 1; the prefix is configurable, default ``skippyd``)::

    {<prefix>:v1:warm}:prefixes        HASH  8-byte chain hash -> "<tick> <node>"
    {<prefix>:v1:warm}:ages            ZSET  chain hash scored by tick (oldest-first eviction)
    {<prefix>:v1:warm}:clock           STRING one tick per ran() prompt
    {<prefix>:v1:warm}:nodes           HASH  node -> "<incarnation> <heartbeat ms> <ttl ms> <up|forgotten>"
    {<prefix>:v1:warm}:batch:<id>      STRING a ran() batch was applied (expires; makes re-sending safe)
    {<prefix>:v1:promo:<scope>}:obs    HASH  payload digest -> "<first seen ms> <hits> <terminal>"
    {<prefix>:v1:promo:<scope>}:ages   ZSET  payload digest scored by first seen ms

The part in braces is the Redis Cluster hash tag: every key one script touches shares a slot. The warm
table is one slot (its eviction is global, as the seed's is); each promotion scope is its own slot, so
scopes spread over a cluster. ``<scope>`` is a digest of the scope name, never the raw text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blake3 import blake3

from .errors import ConfigError

__all__ = ["SCHEMA_VERSION", "RedisKeys"]

SCHEMA_VERSION = 1
_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_BATCH_ID = re.compile(r"^[0-9a-f]{32}$")


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
    def _warm(self) -> str:
        return "{" + self.base + ":warm}"

    @property
    def warm_prefixes(self) -> str:
        return self._warm + ":prefixes"

    @property
    def warm_ages(self) -> str:
        return self._warm + ":ages"

    @property
    def warm_clock(self) -> str:
        return self._warm + ":clock"

    @property
    def nodes(self) -> str:
        return self._warm + ":nodes"

    def warm_batch(self, batch_id: str) -> str:
        """The marker of one ``ran`` batch; ``batch_id`` is 32 lowercase hex digits made by skippyd."""
        if not _BATCH_ID.match(batch_id):
            raise ValueError("a batch id is 32 lowercase hex digits")
        return self._warm + ":batch:" + batch_id

    def _promo(self, scope: str) -> str:
        return "{" + f"{self.base}:promo:{blake3(scope.encode()).hexdigest()[:32]}" + "}"

    def promo_obs(self, scope: str) -> str:
        return self._promo(scope) + ":obs"

    def promo_ages(self, scope: str) -> str:
        return self._promo(scope) + ":ages"
