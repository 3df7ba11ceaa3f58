"""What the engine integrations (vLLM's tier, SGLang's HiCache backend) share on the client side: the
identity digest of a layout, options checked at engine start, errors as one log line, and second-hit
admission counted in Redis. Imports no engine."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from blake3 import blake3

import skippyd
from skippyd.client.blockspace import BlockSpace
from skippyd.errors import SkippydError

__all__ = [
    "SLOWEST_RATE",
    "Admission",
    "admission",
    "check_durable",
    "check_options",
    "layout_state",
    "why",
]

#: The slowest rate a load or a store that started is allowed beyond the lookup's ``timeout`` before it
#: is given up (bytes/s): generous, a first store into fresh tmpfs pages on a busy host is slow; a daemon
#: that stalled is found within ``timeout`` plus the job's bytes at this rate, not after a fixed 30 s.
SLOWEST_RATE = 32 << 20

log = logging.getLogger("skippyd.integrations")


def layout_state(prefix: str, version: int, layout: Mapping[str, Any]) -> str:
    """The ``state`` of an identity: ``{prefix}-v{version}:`` and a digest of everything that shapes the
    engine's bytes (never a process or engine id, so every worker of one layout shares them)."""
    canonical = json.dumps({"version": version, **layout}, sort_keys=True, separators=(",", ":"))
    return f"{prefix}-v{version}:{hashlib.sha256(canonical.encode()).hexdigest()[:32]}"


def check_options(who: str, options: Collection[str], allowed: Sequence[str]) -> None:
    """Refuses unknown options at engine start, naming them and what is taken."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{who}: unknown option(s) {', '.join(unknown)}; it takes {', '.join(allowed)}")


def check_durable(who: str, durable: Any) -> bool | str:
    if isinstance(durable, bool) or durable == "sync":
        return durable  # type: ignore[no-any-return]
    raise ValueError(f'{who}: durable must be true, false or "sync"')


def why(exc: BaseException) -> str:
    """An error as one line for the log, its traceback dropped: the traceback holds the frames of the
    failed copy, and with them views of the engine's memory that must not outlive the call (a log
    handler that keeps records would otherwise keep that memory alive)."""
    exc.__traceback__ = None
    return f"{type(exc).__name__}: {exc}"


def admission(who: str, redis_url: Any, scope: Any) -> Admission | None:
    """Second-hit admission counted in Redis across ``scope`` (None: every block is written)."""
    if not redis_url:
        if scope:
            raise ValueError(f"{who}: scope needs redis_url (second-hit admission is counted in Redis)")
        return None
    if not scope:
        raise ValueError(f"{who}: redis_url needs a scope: the engines that count offers together")
    return Admission(skippyd.Promotions.from_url(str(redis_url), scope=str(scope), timeout=1.0))


class Admission:
    """``Promotions.consider_many`` over a block space's keys, or the same rules in this process while
    Redis is away. An offer is counted per key bound to the space's identity: the same engine hash
    under another model, layout or rank is another block, offered on its own."""

    def __init__(self, promotions: Any) -> None:
        from skippyd.cluster.coordination import LocalPromotions

        self.promotions = promotions
        self.local = LocalPromotions(promotions.settings)

    def admitted(self, space: BlockSpace, keys: Sequence[bytes], block_bytes: int) -> int:
        """How many LEADING keys are admitted (offered at least twice within the window): a chain's
        admitted run ends at its first refusal."""
        bound = space.space.key
        items = [(blake3(k, key=bound).hexdigest(), space.block_tokens, block_bytes) for k in keys]
        try:
            answers: list[bool] = self.promotions.consider_many(items)
        except SkippydError as exc:
            log.warning("second-hit admission counted locally: %s", why(exc))
            answers = self.local.consider_many(items)
        return answers.index(False) if not all(answers) else len(answers)

    def close(self) -> None:
        self.promotions.close()
