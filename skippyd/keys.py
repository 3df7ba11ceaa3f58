"""Token normalisation and the cryptographic keys every tier is addressed by.

Encodings (all BLAKE3, all versioned and domain-separated; see docs/format.md):

* token ids are unsigned 32-bit integers stored little-endian (``0 <= t < 2**32``);
* ``identity digest`` = BLAKE3(``IDENTITY_DOMAIN`` || lp(model) || lp(state) || lp(namespace));
* ``cache key`` = BLAKE3(``CACHE_KEY_DOMAIN`` || lp(model) || lp(state) || lp(namespace)
  || tokens || u64le(token_count)), where ``lp(s)`` is ``u32le(len(utf8(s))) || utf8(s)``.

The token field comes last and its count follows it, so the encoding stays injective while the keys of
every prefix length of a prompt come out of one forward pass over its bytes (:func:`prefix_keys`):
O(prompt + candidates), never O(prompt²).
"""

from __future__ import annotations

import contextlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from blake3 import blake3

from .errors import InvalidArgument

__all__ = [
    "CACHE_KEY_DOMAIN",
    "IDENTITY_DOMAIN",
    "MAX_BLOCK_KEY_BYTES",
    "MAX_IDENTITY_FIELD_BYTES",
    "TOKEN_BYTES",
    "WARM_HASH_BYTES",
    "BlockSpaceId",
    "Identity",
    "bind_keys",
    "block_keys",
    "block_space",
    "cache_key",
    "encode_tokens",
    "identity",
    "is_hex_digest",
    "prefix_keys",
    "token_count",
    "warm_chain",
    "warm_chain_key",
]

CACHE_KEY_DOMAIN = b"skippyd/cache-key/v1\x00"
IDENTITY_DOMAIN = b"skippyd/identity/v1\x00"
TOKEN_BYTES = 4
TOKEN_LIMIT = 1 << 32
MAX_IDENTITY_FIELD_BYTES = 4096
HEX_DIGEST_LEN = 64
_HEX = frozenset("0123456789abcdef")


def is_hex_digest(text: object) -> bool:
    """True for a 64-character lowercase hex string, the shape of every key and digest."""
    return isinstance(text, str) and len(text) == HEX_DIGEST_LEN and set(text) <= _HEX


def _field(name: str, value: object, *, allow_empty: bool) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a str, not {type(value).__name__}")
    raw = value.encode("utf-8")
    if not raw and not allow_empty:
        raise InvalidArgument(f"{name} must not be empty")
    if len(raw) > MAX_IDENTITY_FIELD_BYTES:
        raise InvalidArgument(f"{name} is longer than {MAX_IDENTITY_FIELD_BYTES} bytes")
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True)
class Identity:
    """What a cached state belongs to: the weights, the payload layout and the tenant/salt."""

    model: str
    state: str
    namespace: str = ""
    _prefix: Any = field(init=False, repr=False, compare=False)
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        encoded = (
            _field("model", self.model, allow_empty=False)
            + _field("state", self.state, allow_empty=False)
            + _field("namespace", self.namespace, allow_empty=True)
        )
        object.__setattr__(self, "_prefix", blake3(CACHE_KEY_DOMAIN + encoded))
        object.__setattr__(self, "digest", blake3(IDENTITY_DOMAIN + encoded).hexdigest())

    def key_hasher(self) -> Any:
        """A BLAKE3 hasher primed with everything of a cache key that comes before the tokens."""
        return self._prefix.copy()


@lru_cache(maxsize=4096)
def identity(model: str, state: str, namespace: str = "") -> Identity:
    """A shared :class:`Identity` (they are immutable; the daemon sees the same few over and over)."""
    return Identity(model, state, namespace)


def encode_tokens(tokens: Any) -> bytes:
    """Normalises prompt token ids to little-endian uint32 bytes.

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer torch tensor (any device).
    Anything else, or a value outside ``0 <= t < 2**32``, is a :class:`ValueError`.
    """
    if isinstance(tokens, bytes | bytearray | memoryview | str):
        raise InvalidArgument("tokens must be integers, not bytes or text")
    module = type(tokens).__module__
    if module.startswith("torch"):
        return _encode_torch(tokens)
    if module.startswith("numpy"):
        return _encode_numpy(tokens)
    if isinstance(tokens, Iterable):
        return _encode_sequence(tokens)
    raise InvalidArgument(f"tokens must be a sequence of ints, not {type(tokens).__name__}")


def _encode_sequence(tokens: Iterable[Any]) -> bytes:
    seq = tokens if isinstance(tokens, list | tuple) else list(tokens)
    try:
        packed = array("I", seq)
    except OverflowError as exc:
        raise InvalidArgument("every token id must fit in 32 bits (0 <= t < 2**32)") from exc
    except TypeError as exc:
        raise InvalidArgument(f"token ids must be ints: {exc}") from exc
    if packed.itemsize != TOKEN_BYTES:  # pragma: no cover - every Linux ABI has a 4-byte unsigned int
        raise RuntimeError("array('I') is not 32 bits on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _encode_numpy(tokens: Any) -> bytes:
    import numpy as np

    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"tokens must have an integer dtype, got {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= TOKEN_LIMIT:
            raise InvalidArgument("every token id must fit in 32 bits (0 <= t < 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def _encode_torch(tokens: Any) -> bytes:
    if tokens.dim() != 1:
        raise InvalidArgument(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or str(tokens.dtype) == "torch.bool":
        raise InvalidArgument(f"tokens must have an integer dtype, got {tokens.dtype}")
    return _encode_numpy(tokens.detach().to("cpu").numpy())


def token_count(token_bytes: bytes | memoryview) -> int:
    """How many tokens an encoded token buffer holds; a ragged buffer is an error."""
    size = len(token_bytes)
    if size % TOKEN_BYTES:
        raise InvalidArgument(f"token bytes must be a multiple of {TOKEN_BYTES}, got {size}")
    return size // TOKEN_BYTES


def cache_key(identity: Identity, token_bytes: bytes | memoryview) -> str:
    """The cache key of an entry: the state of ``identity`` after exactly these tokens."""
    count = token_count(token_bytes)
    hasher = identity.key_hasher()
    hasher.update(token_bytes)
    hasher.update(struct.pack("<Q", count))
    return str(hasher.hexdigest())


def prefix_keys(identity: Identity, token_bytes: bytes | memoryview, lengths: Sequence[int]) -> list[str]:
    """Cache keys of the first ``n`` tokens for every ``n`` in ``lengths``, in one pass.

    ``lengths`` must be ascending and within the prompt; the result is in the same order. Each key costs
    one hasher copy and a finalisation on top of hashing the prompt once.
    """
    count = token_count(token_bytes)
    view = memoryview(token_bytes).cast("B")
    hasher = identity.key_hasher()
    keys: list[str] = []
    done = 0
    for n in lengths:
        if n < done or n > count:
            raise InvalidArgument("prefix lengths must be ascending and within the prompt")
        if n > done:
            hasher.update(view[done * TOKEN_BYTES : n * TOKEN_BYTES])
            done = n
        final = hasher.copy()
        final.update(struct.pack("<Q", n))
        keys.append(final.hexdigest())
    return keys


# ----------------------------------------------------------------------------- warm-prefix chains

WARM_CHAIN_CONTEXT = "skippyd 2026-12-02 warm-prefix block chain v1"
#: Bytes of each block hash sent to Redis. Redis's Lua hashes every byte of every string a script
#: receives (≈ 1.5 ns a byte here), so the chain of a 128k-token prompt costs 25 µs of Redis time at 8
#: bytes a block against 50 µs at 16. 64 bits keep a targeted second preimage at 2^64 work, and a
#: collision could only misroute a request (a cache miss on the chosen node), never serve wrong bytes:
#: cache keys are full 256-bit BLAKE3.
WARM_HASH_BYTES = 8

_c_chain: Callable[[Any, Any, int, int], bytes] | None
_c_bind: Callable[[bytes, list[bytes]], list[bytes]] | None
try:  # the C extension (vendored BLAKE3, SIMD); the same values come from the blake3 package below
    from ._chain import bind_each as _c_bind
    from ._chain import chain as _c_chain
except ImportError:  # pragma: no cover - built wherever a C compiler was available at install
    _c_chain = None
    _c_bind = None


def warm_chain_key(model: str, block: int) -> bytes:
    """The 32-byte BLAKE3 key of a model's chain; the block size is bound in, so tables never mix sizes."""
    material = _field("model", model, allow_empty=False) + struct.pack("<I", block)
    return bytes(blake3(material, derive_key_context=WARM_CHAIN_CONTEXT).digest())


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block <= 0 or block % 16 or block > 256:
        raise InvalidArgument("block must be a multiple of 16 tokens, at most 256")


def warm_chain(model: str, token_bytes: bytes | memoryview, block: int = 64) -> bytes:
    """One 8-byte hash per whole block of the prompt, each chained over the model and every earlier block.

    ``h_j = BLAKE3_keyed(K, h_{j-1} || BLAKE3_keyed(K, block_j))`` with ``K`` = :func:`warm_chain_key`
    and ``h_{-1}`` = 32 zero bytes; the result is the first 8 bytes of every ``h_j``, concatenated (one
    binary argument for Redis). A trailing partial block is not part of any prefix.
    """
    _check_block(block)
    count = token_count(token_bytes)
    key = warm_chain_key(model, block)
    block_bytes = block * TOKEN_BYTES
    usable = count // block * block_bytes
    view = memoryview(token_bytes).cast("B")[:usable]
    if _c_chain is not None:
        return bytes(_c_chain(key, view, block_bytes, WARM_HASH_BYTES))
    return warm_chain_reference(key, view, block_bytes)


def warm_chain_reference(key: bytes, view: memoryview | bytes, block_bytes: int) -> bytes:
    """The chain with the ``blake3`` package alone (what the C extension must agree with)."""
    out = bytearray()
    previous = bytes(32)
    data = memoryview(view).cast("B")
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        digest = blake3(data[start : start + block_bytes], key=key).digest()
        previous = blake3(previous + digest, key=key).digest()
        out += previous[:WARM_HASH_BYTES]
    return bytes(out)


# ----------------------------------------------------------------------------- block spaces

BLOCK_SPACE_CONTEXT = "skippyd 2026-12-03 block space v1"
MAX_BLOCK_KEY_BYTES = 64
MAX_BLOCK_TOKENS = 1 << 16


@dataclass(frozen=True)
class BlockSpaceId:
    """Where blocks live: one identity and one block size. ``key`` (32 bytes) keys every BLAKE3 of the
    space: its chained block keys and the binding of every key a client names, so the same engine hash
    under another model, state, namespace or block size is another block."""

    identity: Identity
    block_tokens: int
    key: bytes = field(init=False, repr=False, compare=False)
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.block_tokens, int)
            or isinstance(self.block_tokens, bool)
            or not 1 <= self.block_tokens <= MAX_BLOCK_TOKENS
        ):
            raise InvalidArgument(f"block_tokens must be an integer from 1 to {MAX_BLOCK_TOKENS}")
        material = bytes.fromhex(self.identity.digest) + struct.pack("<I", self.block_tokens)
        key = bytes(blake3(material, derive_key_context=BLOCK_SPACE_CONTEXT).digest())
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "digest", blake3(b"space", key=key).hexdigest())


@lru_cache(maxsize=4096)
def block_space(model: str, state: str, namespace: str, block_tokens: int) -> BlockSpaceId:
    return BlockSpaceId(identity(model, state, namespace), block_tokens)


def block_keys(space: BlockSpaceId, token_bytes: bytes | memoryview) -> list[bytes]:
    """One 32-byte key per WHOLE block of the tokens, each chained over the space and every earlier block:
    ``h_j = BLAKE3_keyed(S, h_{j-1} || BLAKE3_keyed(S, block_j))``, ``h_{-1}`` = 32 zero bytes, ``S`` the
    space's key (the warm-prefix chain's construction with another key and full-length links)."""
    count = token_count(token_bytes)
    block_bytes = space.block_tokens * TOKEN_BYTES
    usable = count // space.block_tokens * block_bytes
    view = memoryview(token_bytes).cast("B")[:usable]
    if _c_chain is not None and block_bytes % 64 == 0 and block_bytes <= 1024:
        packed = bytes(_c_chain(space.key, view, block_bytes, 32))
    else:
        out = bytearray()
        previous = bytes(32)
        for start in range(0, usable, block_bytes):
            digest = blake3(view[start : start + block_bytes], key=space.key).digest()
            previous = blake3(previous + digest, key=space.key).digest()
            out += previous
        packed = bytes(out)
    return [packed[i : i + 32] for i in range(0, len(packed), 32)]


def bind_keys(space: BlockSpaceId, keys: Sequence[bytes]) -> list[bytes]:
    """The key every tier stores a block under: ``BLAKE3_keyed(S, u8(len(k)) || k)`` of each client key
    ``k`` (1 to 64 bytes: skippyd's own from :func:`block_keys` or an engine's block hashes)."""
    listed = keys if isinstance(keys, list) else list(keys)
    if _c_bind is not None:  # (it checks every key as below: the loop only names the first bad one)
        with contextlib.suppress(TypeError, ValueError):
            return _c_bind(space.key, listed)
    for index, key in enumerate(listed):
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_BLOCK_KEY_BYTES:
            raise InvalidArgument(
                f"block key {index} must be 1 to {MAX_BLOCK_KEY_BYTES} bytes"
                + (f", not {len(key)}" if isinstance(key, bytes) else f", not a {type(key).__name__}")
            )
    return [bytes(blake3(bytes([len(k)]) + k, key=space.key).digest()) for k in listed]
