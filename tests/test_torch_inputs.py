"""What the client side takes from torch: token tensors as token ids, and torch's own item sizes for
every dtype of the entry format (the daemon never imports torch; these are the client's checks)."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
from test_payload import CONTRACT_DTYPES

from skippyd import payload
from skippyd.client.tensors import torch_dtype
from skippyd.keys import encode_tokens


@pytest.mark.parametrize(
    "tokens",
    [
        torch.tensor([0, 1, 2**31, 2**32 - 1], dtype=torch.int64),
        torch.tensor([0, 1, 2**31, 2**32 - 1], dtype=torch.int64)[::1],
    ],
)
def test_torch_tokens_encode_to_the_same_little_endian_bytes_as_lists(tokens: Any) -> None:
    assert encode_tokens(tokens) == encode_tokens([0, 1, 2**31, 2**32 - 1])
    assert encode_tokens(tokens) == struct.pack("<4I", 0, 1, 2**31, 2**32 - 1)


def test_non_contiguous_torch_tokens_encode_their_values() -> None:
    t = torch.arange(10, dtype=torch.int32)[::2]
    assert encode_tokens(t) == struct.pack("<5I", 0, 2, 4, 6, 8)


@pytest.mark.parametrize(
    "tokens", [torch.tensor([1.0]), torch.tensor([True]), torch.tensor([[1]]), torch.tensor([-1])]
)
def test_torch_tokens_that_are_not_32_bit_ids_are_a_value_error(tokens: Any) -> None:
    with pytest.raises(ValueError):
        encode_tokens(tokens)


@pytest.mark.parametrize("name", CONTRACT_DTYPES)
def test_dtype_table_covers_every_contract_dtype_with_torch_item_sizes(name: str) -> None:
    assert payload.DTYPES[name] == torch.empty(0, dtype=torch_dtype(name)).element_size()


def test_every_dtype_in_the_table_has_the_item_size_torch_reports() -> None:
    for name, size in payload.DTYPES.items():
        dt = getattr(torch, name, None)
        if dt is not None:
            assert torch.empty(0, dtype=dt).element_size() == size, name
