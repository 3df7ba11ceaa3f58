"""Identity keys: the documented BLAKE3 encoding, token normalisation, and one-pass prefix keys."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from blake3 import blake3

from skippyd import keys
from skippyd.keys import Identity, cache_key, encode_tokens, prefix_keys


def _lp(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def test_cache_key_is_blake3_of_the_documented_encoding() -> None:
    tokens = [1, 2, 3, 70000, 2**32 - 1]
    expected = blake3(
        b"skippyd/cache-key/v1\x00"
        + _lp("llama@sha256:abc")
        + _lp("kv-f16-v1")
        + _lp("tenant")
        + struct.pack("<5I", *tokens)
        + struct.pack("<Q", 5)
    ).hexdigest()
    ident = Identity("llama@sha256:abc", "kv-f16-v1", "tenant")
    assert cache_key(ident, encode_tokens(tokens)) == expected


@pytest.mark.parametrize(
    "other",
    [
        Identity("m2", "s", "n"),
        Identity("m", "s2", "n"),
        Identity("m", "s", "n2"),
        Identity("m", "s", ""),
    ],
)
def test_any_identity_field_changes_the_key(other: Identity) -> None:
    toks = encode_tokens([5, 6, 7])
    assert cache_key(Identity("m", "s", "n"), toks) != cache_key(other, toks)


def test_any_token_change_or_extra_token_changes_the_key() -> None:
    ident = Identity("m", "s")
    base = cache_key(ident, encode_tokens([1, 2, 3]))
    assert base != cache_key(ident, encode_tokens([1, 2, 4]))
    assert base != cache_key(ident, encode_tokens([1, 2, 3, 0]))
    assert base != cache_key(ident, encode_tokens([1, 2]))


def test_length_prefixes_keep_field_boundaries_apart() -> None:
    toks = encode_tokens([1])
    assert cache_key(Identity("ab", "c"), toks) != cache_key(Identity("a", "bc"), toks)
    assert cache_key(Identity("a", "b", "c"), toks) != cache_key(Identity("a", "bc", ""), toks)


def test_identity_digest_is_domain_separated_from_cache_keys() -> None:
    ident = Identity("m", "s")
    assert ident.digest != cache_key(ident, b"")
    assert keys.is_hex_digest(ident.digest)


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 1, 2**31, 2**32 - 1],
        (0, 1, 2**31, 2**32 - 1),
        np.array([0, 1, 2**31, 2**32 - 1], dtype=np.int64),
        np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint32),
    ],
)
def test_lists_and_numpy_tokens_encode_to_the_same_little_endian_bytes(tokens: Any) -> None:
    assert encode_tokens(tokens) == struct.pack("<4I", 0, 1, 2**31, 2**32 - 1)


def test_non_contiguous_numpy_tokens_encode_their_values() -> None:
    assert encode_tokens(np.arange(10, dtype=np.int32)[::2]) == struct.pack("<5I", 0, 2, 4, 6, 8)


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [2**32],
        [1.0],
        ["1"],
        b"\x01\x00\x00\x00",
        np.array([[1, 2]]),
        np.array([1.0, 2.0]),
        np.array([-5], dtype=np.int8),
        np.array([2**40], dtype=np.int64),
        42,
    ],
)
def test_tokens_outside_32_bits_or_not_integers_are_a_value_error(tokens: Any) -> None:
    with pytest.raises(ValueError):
        encode_tokens(tokens)


def test_identity_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="model"):
        Identity("", "s")
    with pytest.raises(ValueError, match="state"):
        Identity("m", "")
    with pytest.raises(ValueError, match="namespace"):
        Identity("m", "s", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="longer"):
        Identity("m" * 5000, "s")


def test_prefix_keys_equal_the_key_of_each_prefix() -> None:
    ident = Identity("m", "s", "ns")
    toks = encode_tokens(list(range(1000)))
    lengths = [0, 1, 63, 64, 65, 500, 1000]
    assert prefix_keys(ident, toks, lengths) == [cache_key(ident, toks[: n * 4]) for n in lengths]


def test_prefix_keys_hash_the_prompt_once_whatever_the_number_of_lengths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fed: list[int] = []

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def update(self, data: Any) -> None:
            fed.append(len(data))
            self.inner.update(data)

        def copy(self) -> Any:
            return self.inner.copy()

    real = Identity.key_hasher
    monkeypatch.setattr(Identity, "key_hasher", lambda self: Counting(real(self)))
    ident = Identity("m", "s")
    toks = encode_tokens(list(range(4096)))
    prefix_keys(ident, toks, list(range(1, 4097)))
    assert sum(fed) == len(toks), "every token byte is hashed exactly once"


def test_prefix_keys_reject_descending_or_out_of_range_lengths() -> None:
    ident = Identity("m", "s")
    toks = encode_tokens([1, 2, 3])
    with pytest.raises(ValueError, match="ascending"):
        prefix_keys(ident, toks, [2, 1])
    with pytest.raises(ValueError, match="ascending"):
        prefix_keys(ident, toks, [4])


def test_ragged_token_bytes_are_rejected() -> None:
    with pytest.raises(ValueError, match="multiple"):
        cache_key(Identity("m", "s"), b"\x01\x02\x03")


def test_the_warm_chain_c_extension_agrees_with_the_blake3_reference() -> None:
    import os

    from skippyd.keys import warm_chain, warm_chain_key, warm_chain_reference

    assert keys._c_chain is not None, "the C extension is built by the install"
    for block in (16, 64, 256):
        for count in (0, block - 1, block, 5 * block + 3, 300 * block):
            data = os.urandom(count * 4)
            key = warm_chain_key("m", block)
            expected = warm_chain_reference(key, data[: count // block * block * 4], block * 4)
            assert warm_chain("m", data, block) == expected
            assert len(expected) == count // block * keys.WARM_HASH_BYTES


@pytest.fixture(params=["c-extension", "blake3-package"])
def chain_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on both ways the chain is computed: the C extension, and the fallback without it."""
    if request.param == "blake3-package":
        monkeypatch.setattr(keys, "_c_chain", None)
    else:
        assert keys._c_chain is not None, "the C extension is built by the install"
    return str(request.param)


def test_the_c_extension_refuses_bad_arguments_instead_of_reading_past_them() -> None:
    assert keys._c_chain is not None
    with pytest.raises(ValueError, match="32 bytes"):
        keys._c_chain(b"k" * 31, b"\0" * 256, 256, 8)
    for block_bytes in (0, 65, 2048):
        with pytest.raises(ValueError, match="block_bytes"):
            keys._c_chain(b"k" * 32, b"\0" * 256, block_bytes, 8)
    for out_len in (0, 33):
        with pytest.raises(ValueError, match="out_len"):
            keys._c_chain(b"k" * 32, b"\0" * 256, 256, out_len)
    assert keys._c_chain(b"k" * 32, b"\0" * 300, 256, 8) == keys.warm_chain_reference(
        b"k" * 32, b"\0" * 256, 256
    )


def test_the_warm_chain_is_standard_blake3_keyed_hashing(chain_impl: str) -> None:
    from skippyd.keys import warm_chain, warm_chain_key

    toks = encode_tokens(list(range(128)))
    key = warm_chain_key("model-x", 64)
    d0 = blake3(toks[:256], key=key).digest()
    h0 = blake3(bytes(32) + d0, key=key).digest()
    d1 = blake3(toks[256:512], key=key).digest()
    h1 = blake3(h0 + d1, key=key).digest()
    w = keys.WARM_HASH_BYTES
    assert warm_chain("model-x", toks, 64) == h0[:w] + h1[:w]


def test_warm_chains_bind_the_model_the_block_size_and_every_earlier_block(chain_impl: str) -> None:
    from skippyd.keys import warm_chain

    a = encode_tokens(list(range(256)))
    b = encode_tokens([*range(63), 9999, *range(64, 256)])  # differs in the first block only
    w = keys.WARM_HASH_BYTES
    chain_a, chain_b = warm_chain("m", a), warm_chain("m", b)
    assert all(chain_a[i : i + w] != chain_b[i : i + w] for i in range(0, len(chain_a), w))
    assert warm_chain("m2", a)[:w] != chain_a[:w]
    assert warm_chain("m", a, block=32)[w : 2 * w] != chain_a[:w]
    with pytest.raises(ValueError, match="block"):
        warm_chain("m", a, block=65)


@pytest.mark.parametrize("use_c", [True, False], ids=["c-extension", "blake3-package"])
def test_block_keys_bind_to_their_space_the_same_with_or_without_the_extension_and_name_a_bad_key(
    use_c: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd.errors import InvalidArgument
    from skippyd.keys import bind_keys, block_space

    if use_c:
        assert keys._c_bind is not None, "the C extension is built by the install"
    else:
        monkeypatch.setattr(keys, "_c_bind", None)
    space = block_space("bind-model@sha256:1", "kv", "", 16)
    given = [b"a", b"k" * 64, bytes(range(32))]
    bound = bind_keys(space, given)
    assert bound == [blake3(bytes([len(k)]) + k, key=space.key).digest() for k in given]
    assert all(type(b) is bytes and len(b) == 32 for b in bound)
    assert bind_keys(block_space("bind-model@sha256:2", "kv", "", 16), given)[0] != bound[0]
    with pytest.raises(InvalidArgument, match="block key 1 must be 1 to 64 bytes, not 65"):
        bind_keys(space, [b"a", b"k" * 65])
    with pytest.raises(InvalidArgument, match="block key 2 must be 1 to 64 bytes, not a str"):
        bind_keys(space, [b"a", b"b", "c"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="block key 0 must be 1 to 64 bytes, not 0"):
        bind_keys(space, [b""])
