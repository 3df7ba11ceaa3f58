"""The entry format: dtype table, aligned layout, header checksums and the payload digest."""

from __future__ import annotations

import pytest
from blake3 import blake3

from skippyd import payload
from skippyd.errors import CorruptEntry, UnsupportedDtype
from skippyd.payload import Entry, TensorDecl, decode_fixed, decode_header, encode_header, plan_layout

CONTRACT_DTYPES = [
    "float32",
    "float16",
    "float64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
]


def test_dtype_table_covers_every_contract_dtype() -> None:
    assert set(CONTRACT_DTYPES) <= set(payload.DTYPES)
    assert all(size in (1, 2, 4, 8, 16) for size in payload.DTYPES.values())


def test_layout_aligns_every_tensor_to_4k_in_table_order_without_overlap() -> None:
    decls = [
        TensorDecl("a", "float32", (3,)),
        TensorDecl("b", "bfloat16", (2, 4097)),
        TensorDecl("empty", "int64", (0, 5)),
        TensorDecl("scalar", "float64", ()),
    ]
    specs, data_len = plan_layout(decls)
    assert [s.name for s in specs] == ["a", "b", "empty", "scalar"]
    end = 0
    for spec in specs:
        assert spec.offset % 4096 == 0
        assert spec.offset >= end
        end = spec.offset + spec.nbytes
    assert [s.nbytes for s in specs] == [12, 2 * 4097 * 2, 0, 8]
    assert data_len == end


def test_unknown_dtype_duplicate_names_and_bad_shapes_are_rejected() -> None:
    with pytest.raises(UnsupportedDtype):
        payload.check_decl("x", "float128", [1])
    with pytest.raises(ValueError, match="unique"):
        plan_layout([TensorDecl("x", "int8", (1,)), TensorDecl("x", "int8", (1,))])
    with pytest.raises(ValueError, match="dims"):
        payload.check_decl("x", "int8", [-1])
    with pytest.raises(ValueError, match="dims"):
        payload.check_decl("x", "int8", [True])


def test_meta_must_be_json_and_small() -> None:
    assert payload.check_meta({"b": [1, 2.5, None], "a": "x"}) == {"a": "x", "b": [1, 2.5, None]}
    with pytest.raises(ValueError, match="JSON"):
        payload.check_meta({"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        payload.check_meta({"x": float("nan")})
    with pytest.raises(ValueError, match="larger"):
        payload.check_meta({"x": "y" * 70000})
    with pytest.raises(ValueError, match="dict"):
        payload.check_meta([1])


def _header() -> tuple[Entry, bytes, int]:
    specs, data_len = plan_layout([TensorDecl("k", "float16", (2, 3)), TensorDecl("v", "int8", (5,))])
    header = Entry(
        key="a" * 64,
        identity="b" * 64,
        token_count=7,
        kind="kv-recurrent",
        digest="c" * 64,
        meta={"layers": 2},
        tensors=tuple(specs),
        data_len=data_len,
        created_ns=123,
    )
    raw, data_offset = encode_header(header)
    return header, raw, data_offset


def test_header_round_trips_and_data_starts_page_aligned() -> None:
    header, raw, data_offset = _header()
    assert raw.startswith(b"SKIPPYD\x00")
    assert data_offset % 4096 == 0 and data_offset >= len(raw)
    fixed = decode_fixed(raw)
    assert decode_header(fixed, raw[64:]) == header


def _decode(raw: bytes) -> Entry:
    fixed = decode_fixed(raw)
    return decode_header(fixed, raw[64 : 64 + fixed.header_len])


def test_a_flipped_bit_anywhere_in_the_header_is_detected() -> None:
    _, raw, _ = _header()
    for index in range(len(raw)):
        damaged = bytearray(raw)
        damaged[index] ^= 0x01
        with pytest.raises(CorruptEntry):
            _decode(bytes(damaged))


def test_payload_digest_is_blake3_of_the_tensor_bytes_in_table_order() -> None:
    specs, data_len = plan_layout([TensorDecl("a", "uint8", (3,)), TensorDecl("b", "uint8", (2,))])
    region = bytearray(data_len)
    region[0:3] = b"abc"
    region[specs[1].offset : specs[1].offset + 2] = b"de"
    region[10] = 0xFF  # padding is not part of the content
    assert payload.payload_digest(region, specs) == blake3(b"abcde").hexdigest()
