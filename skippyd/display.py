"""How numbers read for people in ``status``, ``stats``, ``ls`` and ``top`` (sizes: :func:`human_size`)."""

from __future__ import annotations

from .config import human_size

__all__ = ["human_age", "human_size", "human_us", "plural"]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 entry``, ``2 entries``; ``1 block``, ``3 blocks``."""
    if count == 1:
        return f"{count} {word}"
    return f"{count} {many or (word[:-1] + 'ies' if word.endswith('y') else word + 's')}"


def human_us(micros: float) -> str:
    """A duration given in microseconds: ``850 µs``, ``1.2 ms``, ``1.05 s``."""
    if micros < 1000:
        return f"{micros:.0f} µs"
    if micros < 1_000_000:
        return f"{micros / 1000:.1f} ms"
    return f"{micros / 1e6:.2f} s"


def human_age(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
