"""Helpers for L2 tests: entries of known bytes under readable names, and the tier seen as a map."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from skippyd.keys import Identity, cache_key, encode_tokens, prefix_keys
from skippyd.l2 import L2Tier, copy_into
from skippyd.payload import Entry, TensorDecl

IDENT = Identity("model-a", "state-v1", "")


def key_of(name: str, ident: Identity = IDENT) -> str:
    """A cache key derived from a readable name (its bytes become the tokens)."""
    return cache_key(ident, encode_tokens(list(name.encode())))


def admit(
    tier: L2Tier,
    *,
    key: str,
    identity: Identity | str,
    token_count: int,
    tensors: Sequence[TensorDecl],
    data: Sequence[Any],
    kind: str = "kv",
    meta: Mapping[str, Any] | None = None,
    expected_digest: str | None = None,
    origin: str = "capture",
) -> Entry:
    """Copies each tensor's bytes (``data[i]`` for ``tensors[i]``) into a new entry and commits it."""
    with tier.reserve(key=key, identity=identity, token_count=token_count, tensors=tensors, kind=kind,
                      meta=meta, origin=origin) as reservation:  # fmt: skip
        for spec, source in zip(reservation.tensors, data, strict=True):
            copy_into(reservation.data, spec.offset, spec.nbytes, source)
        return reservation.commit(expected_digest)


def admit_bytes(
    tier: L2Tier,
    name: str,
    nbytes: int,
    fill: int = 7,
    *,
    ident: Identity = IDENT,
    expected: str | None = None,
) -> Entry:
    data = bytes([fill]) * nbytes
    return admit(
        tier, key=key_of(name, ident), identity=ident, token_count=max(1, len(name)),
        tensors=[TensorDecl("x", "uint8", (nbytes,))], data=[data], expected_digest=expected,
    )  # fmt: skip


def get(tier: L2Tier, key: str) -> Entry | None:
    """The entry under ``key`` as a restore finds it (a hit: counted, recency moved; a miss: counted)."""
    held = tier.hold(key)
    if held is None:
        tier.count_miss()
        return None
    os.close(held.fd)
    return held.entry


def lookup(tier: L2Tier, ident: Identity, tokens: bytes) -> Entry | None:
    """The longest captured prefix of ``tokens`` in this tier alone (a hit moves recency)."""
    lengths = tier.prefix_lengths(ident.digest, len(tokens) // 4)
    for key in reversed(prefix_keys(ident, tokens, lengths)):
        held = tier.hold(key)
        if held is not None:
            os.close(held.fd)
            return held.entry
    tier.count_miss()
    return None


@contextlib.contextmanager
def borrow(tier: L2Tier, key: str) -> Iterator[tuple[Entry, memoryview]]:
    """A read-only view of an entry's data region, leased for the duration of the block."""
    held = tier.hold(key, hit=False)
    if held is None:
        raise KeyError(key)
    try:
        size = held.data_offset + held.entry.data_len
        mapping = mmap.mmap(held.fd, max(size, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(held.fd)
    view = memoryview(mapping)[held.data_offset : held.data_offset + held.entry.data_len]
    try:
        yield held.entry, view
    finally:
        view.release()
        mapping.close()


def keys_lru_first(tier: L2Tier) -> list[str]:
    return [item.entry.key for item in tier.entries()]


def size_of(nbytes: int, name: str = "x") -> int:
    """Tmpfs bytes of an :func:`admit_bytes` entry of ``nbytes``."""
    return L2Tier.file_size_for(token_count=max(1, len(name)), tensors=[TensorDecl("x", "uint8", (nbytes,))])


class Calls:
    """Counts the calls of ``owner.name`` (patched through ``monkeypatch``; the real one still runs)."""

    def __init__(self, monkeypatch: Any, owner: Any, name: str) -> None:
        self.count = 0
        real = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
