"""Helpers for L2 tests: entries of known bytes under readable names."""

from __future__ import annotations

from skippyd.keys import Identity, cache_key, encode_tokens
from skippyd.l2 import L2Entry, L2Tier
from skippyd.payload import TensorDecl

IDENT = Identity("model-a", "state-v1", "")


def key_of(name: str, ident: Identity = IDENT) -> str:
    """A cache key derived from a readable name (its bytes become the tokens)."""
    return cache_key(ident, encode_tokens(list(name.encode())))


def admit_bytes(
    tier: L2Tier,
    name: str,
    nbytes: int,
    fill: int = 7,
    *,
    ident: Identity = IDENT,
    expected: str | None = None,
) -> L2Entry:
    data = bytes([fill]) * nbytes
    return tier.admit(
        key=key_of(name, ident),
        identity=ident,
        token_count=max(1, len(name)),
        tensors=[TensorDecl("x", "uint8", (nbytes,))],
        data=[data],
        expected_digest=expected,
    )


def size_of(nbytes: int, name: str = "x") -> int:
    """Tmpfs bytes of an :func:`admit_bytes` entry of ``nbytes``."""
    return L2Tier.file_size_for(token_count=max(1, len(name)), tensors=[TensorDecl("x", "uint8", (nbytes,))])
