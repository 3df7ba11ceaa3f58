"""The transformers integration on blocks, against a real ``skippyd serve``.

A capture stores the attention KV of its whole blocks as skippyd blocks and the rest (the partial
block, recurrent state at exactly T) as one small entry naming them. These tests prove what that buys
and that nothing is lost: a conversation's next turn writes only its new blocks, every captured length
restores exactly (the continuation's logits equal, bit for bit, those on the cache that never left the
process), an attention-only model restores the leading blocks another conversation left, an entry whose
blocks were evicted gives way to a shorter whole one, and a model whose block would pass the block limit
splits its layers over several block spaces. The models are tests/hfmodels.py's (Llama-style attention,
Zamba2 and Jamba hybrids).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers")

import itertools

import hfmodels
import torch
from daemonutil import DaemonProcess

import skippyd
from skippyd.errors import InvalidArgument
from skippyd.integrations import transformers as skt

B = skt.DEFAULT_BLOCK_TOKENS
CONT = 8
TOL = {"llama": 1e-4, "zamba2": 1e-3, "jamba": 1e-3}  # see tests/test_transformers.py


@pytest.fixture
def client(hf_daemon: DaemonProcess) -> Iterator[skippyd.Client]:
    with hf_daemon.client() as c:
        yield c


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    return str(request.node.name)


def prefilled(model: Any, tokens: torch.Tensor) -> Any:
    _, cache = skt.prefill(model, tokens)
    return cache


def continued(model: Any, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits, _ = skt.prefill(model, tokens, cache=cache)
    return logits


def recomputed(model: Any, tokens: torch.Tensor, count: int) -> torch.Tensor:
    """What continuing ``tokens[count:]`` gives on a cache prefilled here, never stored: the reference
    every restored continuation must equal bit for bit."""
    return continued(model, prefilled(model, tokens[:count]), tokens[count:])


def pieces_held(layer: Any) -> int:
    """How many pieces a restored layer still holds unjoined (0: joined into one tensor)."""
    return 0 if layer._pieces is None else len(layer._pieces[0])


def kv_bytes_per_token(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            total += 2 * keys[..., :1, :].numel() * keys.element_size()
    return total


def state_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        for attr in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, attr, None) or {}).values():
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def layer_tensors(cache: Any, length: int) -> list[torch.Tensor | None]:
    """Every layer's attention keys and values (the first ``length`` tokens) and recurrent state, in
    order: what a restore of ``length`` tokens must give back bit for bit."""
    out: list[torch.Tensor | None] = []
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            out.append(
                tensor[..., :length, :] if isinstance(tensor, torch.Tensor) and tensor.numel() else None
            )
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None) or {}
            out.extend(t for t in states.values() if isinstance(t, torch.Tensor))
    return out


@pytest.mark.parametrize("name", ["llama", "zamba2", "jamba"])
def test_a_next_turn_writes_only_its_new_blocks_and_every_captured_length_restores_exactly(
    name: str, client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built(name)
    tokens = hfmodels.prompt(1200)
    turns = [300, 700, 1100]
    written_before = client.stats()["ops"]["block_bytes_written"]
    written = 0
    captured: dict[int, Any] = {}
    for earlier, length in zip([0, *turns], turns, strict=False):
        cache = captured[length] = prefilled(model, tokens[:length])
        result = skt.capture(client, model, cache, tokens=tokens[:length], namespace=namespace)
        assert (result.blocks_stored, result.blocks_present) == (length // B - earlier // B, earlier // B)
        per_token = kv_bytes_per_token(cache)
        assert result.blocks_nbytes == result.blocks_stored * B * per_token
        # the entry is the tail only: the partial block's KV and the recurrent state
        assert result.nbytes <= (length % B) * per_token + state_bytes(cache) + 64 * 1024
        written += result.blocks_nbytes
    assert client.stats()["ops"]["block_bytes_written"] - written_before == written  # no block twice

    for length in turns:
        query = tokens[: length + CONT]
        hit = skt.restore(client, model, tokens=query, namespace=namespace)
        assert hit is not None
        cache, count = hit
        assert count == length
        # Bit for bit what was captured: each whole block as the turn that first stored it held it (a
        # later turn's prefill may differ in the last bits: the kernels block a longer sequence
        # differently), the partial block and the recurrent state as this turn held them.
        owner = {b: min(t for t in turns if t // B > b) for b in range(length // B)}
        ours = layer_tensors(captured[length], length)
        for index, restored in enumerate(layer_tensors(cache, length)):
            want = ours[index]
            if want is not None and want.dim() == 4 and want.shape[-2] == length:  # attention KV
                blocks = []
                for b in range(length // B):
                    piece = layer_tensors(captured[owner[b]], length)[index]
                    assert piece is not None
                    blocks.append(piece[..., b * B : (b + 1) * B, :])
                want = torch.cat([*blocks, want[..., length // B * B :, :]], dim=-2)
            assert (restored is None) == (want is None), (length, index)
            if want is not None:
                assert restored is not None and torch.equal(restored, want), (length, index)
        logits = continued(model, cache, query[length:])
        reference = recomputed(model, query, length)
        assert float((logits - reference).abs().max()) <= TOL[name], length
        if all(owner[b] == length for b in owner):  # every byte from this turn's own prefill: exact
            assert torch.equal(logits, reference), length


def test_a_capture_from_a_device_cache_lays_each_planes_blocks_out_at_once_in_chunks_that_chain(
    client: skippyd.Client, namespace: str, built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a GPU cache a chunk of blocks is laid out block by block in one buffer, one copy a plane (one
    contiguous piece a block, consecutive blocks one after another: their DMAs merge, where a piece a
    block, layer and K/V made a temporary and a copy each); the chunks bound the device memory that
    takes and are put as one chain (each names the block before it); what is stored is the same bytes.
    The device is stood in for by the CPU here (tests/test_cuda.py runs it on a GPU)."""
    model = built("llama")
    tokens = hfmodels.prompt(5 * B + 3)
    cache = prefilled(model, tokens)
    per_block = kv_bytes_per_token(cache) * B
    monkeypatch.setattr(skt, "_on_device", lambda _plane: True)
    monkeypatch.setattr(skt, "_DEVICE_CHUNK_BYTES", 2 * per_block)  # two blocks a chunk
    puts: list[tuple[int, bool, bool]] = []
    real = skippyd.BlockSpace.put

    def spy(self: Any, keys: Any, data: Any, **kwargs: Any) -> Any:
        pieces = [block[0] for block in data]  # one piece a block, the blocks one after another
        follow = all(len(block) == 1 and block[0].is_contiguous() for block in data) and all(
            x.data_ptr() + x.numel() == y.data_ptr() for x, y in itertools.pairwise(pieces)
        )
        puts.append((len(keys), kwargs.get("parent") is not None, follow))
        return real(self, keys, data, **kwargs)

    monkeypatch.setattr(skippyd.BlockSpace, "put", spy)
    result = skt.capture(client, model, cache, tokens=tokens, namespace=namespace)
    assert puts == [(2, False, True), (2, True, True), (1, True, True)]
    assert result.blocks_stored == 5
    hit = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert hit is not None and hit[1] == len(tokens)
    for restored, want in zip(
        layer_tensors(hit[0], len(tokens)), layer_tensors(cache, len(tokens)), strict=True
    ):
        assert (restored is None) == (want is None)
        if want is not None:
            assert restored is not None and torch.equal(restored, want)


def test_a_device_capture_whose_later_chunk_finds_no_room_keeps_what_came_before_and_sends_no_more(
    client: skippyd.Client, namespace: str, built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As one put would: blocks stored before a chunk that finds no room (or skips a block, after which
    every later block would be a hole) are kept, the capture goes on to its entry, and no later chunk is
    laid out or sent; a first chunk without room is the capture's ``NoSpace``."""
    from skippyd.errors import NoSpace

    model = built("llama")
    tokens = hfmodels.prompt(5 * B + 3)
    cache = prefilled(model, tokens)
    monkeypatch.setattr(skt, "_on_device", lambda _plane: True)
    monkeypatch.setattr(skt, "_DEVICE_CHUNK_BYTES", 2 * kv_bytes_per_token(cache) * B)
    real = skippyd.BlockSpace.put
    sent: list[int] = []

    def full_after(first: int) -> Any:
        def put(self: Any, keys: Any, data: Any, **kwargs: Any) -> Any:
            sent.append(len(keys))
            if len(sent) > first:
                raise NoSpace("no room")
            return real(self, keys, data, **kwargs)

        return put

    monkeypatch.setattr(skippyd.BlockSpace, "put", full_after(1))
    result = skt.capture(client, model, cache, tokens=tokens, namespace=namespace)
    assert sent == [2, 2] and result.blocks_stored == 2 and result.l2
    sent.clear()
    monkeypatch.setattr(skippyd.BlockSpace, "put", full_after(0))
    with pytest.raises(NoSpace):
        skt.capture(client, model, cache, tokens=tokens, namespace=namespace + "-2")
    assert sent == [2]


def test_a_model_spread_over_several_devices_is_refused_in_one_clear_line(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    """A ``device_map`` model keeps each layer's KV on its layer's device; skt's restore puts them all on
    one, which would fail inside the forward: refused before anything is read or stored."""
    import copy

    model = copy.copy(built("llama"))
    tokens = hfmodels.prompt(B + 3)
    cache = prefilled(model, tokens)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": 1}
    with pytest.raises(InvalidArgument, match=r"spread over several devices \(cuda:0, cuda:1, device_map\)"):
        skt.capture(client, model, cache, tokens=tokens, namespace=namespace)
    with pytest.raises(InvalidArgument, match="spread over several devices"):
        skt.restore(client, model, tokens=tokens, namespace=namespace)
    # one device, however it is named, with modules offloaded to the CPU or disk (they run on it)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": "cuda:0", "lm_head": "cpu", "x": "disk"}
    skt.capture(client, model, cache, tokens=tokens, namespace=namespace)


def test_restored_attention_is_joined_by_the_first_forward_not_before(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("llama")
    tokens = hfmodels.prompt(3 * B + 40)
    skt.capture(
        client,
        model,
        prefilled(model, tokens[: 3 * B + 32]),
        tokens=tokens[: 3 * B + 32],
        namespace=namespace,
    )
    hit = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert hit is not None
    cache, count = hit
    assert count == 3 * B + 32
    layer = cache.layers[0]
    assert isinstance(layer, skt._JoinedKV) and pieces_held(layer) == 4  # 3 blocks + the tail: no copy yet
    assert cache.get_seq_length() == count and pieces_held(layer) == 4  # the length needs no join
    logits = continued(model, cache, tokens[count:])
    joined = layer.keys
    assert pieces_held(layer) == 0 and isinstance(joined, torch.Tensor)
    assert joined.shape[-2] == len(tokens) and joined.is_contiguous()
    assert torch.equal(logits, recomputed(model, tokens, count))


@pytest.mark.parametrize("name", ["llama", "zamba2"])
def test_a_restored_and_continued_cache_is_captured_like_any_other(
    name: str, client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built(name)
    tokens = hfmodels.prompt(760)
    skt.capture(client, model, prefilled(model, tokens[:300]), tokens=tokens[:300], namespace=namespace)
    hit = skt.restore(client, model, tokens=tokens[:750], namespace=namespace)
    assert hit is not None and hit[1] == 300
    _, cache = skt.prefill(model, tokens[300:750], cache=hit[0])  # the engine's next turn
    result = skt.capture(client, model, cache, tokens=tokens[:750], namespace=namespace)
    assert (result.blocks_stored, result.blocks_present) == (1, 1)
    again = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert again is not None and again[1] == 750
    assert torch.equal(continued(model, again[0], tokens[750:]), continued(model, cache, tokens[750:]))


def test_an_attention_model_restores_the_leading_blocks_another_conversation_left(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("llama")
    first = hfmodels.prompt(700)
    skt.capture(client, model, prefilled(model, first), tokens=first, namespace=namespace)
    other = torch.cat([first[:600], hfmodels.prompt(300, seed=99)])  # shares 600 tokens, not the entry
    hit = skt.restore(client, model, tokens=other, namespace=namespace)
    assert hit is not None
    cache, count = hit
    assert count == 2 * B  # the whole blocks of the shared 600 tokens
    logits = continued(model, cache, other[count:])
    assert torch.equal(logits, recomputed(model, other, count))
    with torch.no_grad():
        full = model(input_ids=other[None]).logits[0, count:]
    assert float((logits[0] - full).abs().max()) <= TOL["llama"]


def test_a_hybrid_never_restores_blocks_without_its_recurrent_state(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("zamba2")
    first = hfmodels.prompt(700)
    skt.capture(client, model, prefilled(model, first), tokens=first, namespace=namespace)
    other = torch.cat([first[:600], hfmodels.prompt(300, seed=99)])
    assert skt.restore(client, model, tokens=other, namespace=namespace) is None


@pytest.mark.parametrize("name", ["llama", "zamba2"])
def test_an_entry_whose_blocks_were_evicted_gives_way_to_a_shorter_whole_one(
    name: str, client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built(name)
    tokens = hfmodels.prompt(700)
    for length in (100, 600):  # 100 tokens: no whole block, all in its entry; 600: two blocks + a tail
        skt.capture(
            client, model, prefilled(model, tokens[:length]), tokens=tokens[:length], namespace=namespace
        )
    prof = skt.profile(model)
    for state in skt.block_states(model):
        assert client.evict(model=prof.model_id, state=state, namespace=namespace, blocks=True) == 2
    hit = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert hit is not None
    cache, count = hit
    assert count == 100
    expected = recomputed(model, tokens[:108], 100)
    assert torch.equal(continued(model, cache, tokens[100:108]), expected)


def test_block_tokens_zero_stores_one_whole_entry_and_restores_it(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("zamba2")
    tokens = hfmodels.prompt(600)
    cache = prefilled(model, tokens[:520])
    result = skt.capture(client, model, cache, tokens=tokens[:520], namespace=namespace, block_tokens=0)
    assert result.blocks_stored == 0 and result.nbytes >= 520 * kv_bytes_per_token(cache)
    hit = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert hit is not None and hit[1] == 520
    expected = recomputed(model, tokens, 520)
    assert torch.equal(continued(model, hit[0], tokens[520:]), expected)


def test_a_model_whose_block_would_pass_the_limit_splits_its_layers_over_block_spaces(
    client: skippyd.Client, namespace: str, built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = built("llama")  # two attention layers
    tokens = hfmodels.prompt(2 * B + 50)
    cache = prefilled(model, tokens[: 2 * B + 10])
    one_layer = kv_bytes_per_token(cache) // 2 * B
    monkeypatch.setattr(skt, "MAX_BLOCK_BYTES", one_layer)  # room for one layer's block, not two
    states = skt.block_states(model)
    assert len(states) == 2 and states[0].endswith(":kv0-0") and states[1].endswith(":kv1-1")
    result = skt.capture(client, model, cache, tokens=tokens[: 2 * B + 10], namespace=namespace)
    assert result.blocks_stored == 4  # two blocks in each space
    hit = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert hit is not None and hit[1] == 2 * B + 10
    expected = recomputed(model, tokens, 2 * B + 10)
    assert torch.equal(continued(model, hit[0], tokens[2 * B + 10 :]), expected)
    monkeypatch.setattr(skt, "MAX_BLOCK_BYTES", one_layer - 1)
    with pytest.raises(InvalidArgument, match="fewer tokens per block"):
        skt.capture(client, model, cache, tokens=tokens[: 2 * B + 10], namespace=namespace)


def test_block_tokens_out_of_range_is_refused_with_one_clear_line(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("llama")
    tokens = hfmodels.prompt(40)
    bad: Any
    for bad in (-1, 65537, True, 2.5):
        with pytest.raises(InvalidArgument, match="block_tokens must be an integer"):
            skt.capture(
                client, model, prefilled(model, tokens), tokens=tokens, namespace=namespace, block_tokens=bad
            )


def test_a_restore_the_cuda_way_holds_one_view_per_layer_and_continues_exactly(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    """Through the CUDA simulator (skippyd.client.transfer.sim: CPU tensors sent the way CUDA ones go), a
    restore copies the blocks into one buffer layer by layer, each layer holds ONE view of its keys in
    every block (not one per block) and an event, and the first forward joins it: the continuation's
    logits equal those on the cache that never left the process, bit for bit."""
    from skippyd.client.transfer.sim import simulated

    model = built("llama")
    tokens = hfmodels.prompt(3 * B + 40)
    skt.capture(
        client,
        model,
        prefilled(model, tokens[: 3 * B + 32]),
        tokens=tokens[: 3 * B + 32],
        namespace=namespace,
    )
    with simulated() as sim:
        hit = skt.restore(client, model, tokens=tokens, namespace=namespace, device="cpu")
        assert hit is not None
        cache, count = hit
        assert count == 3 * B + 32
        layers = [layer for layer in cache.layers if isinstance(layer, skt._JoinedKV)]
        assert layers and all(pieces_held(layer) == 2 for layer in layers)  # the 3 blocks' view + the tail
        assert all(isinstance(layer.__dict__["_pieces"][0][0], skt._Stacked) for layer in layers)
        assert sim.batch is not None and sim.batch.calls == len(layers) + 1  # one a layer, one the tail
        assert sim.rec.count("register") >= 1 and sum(sim.host) == 0  # by "DMA", nothing through the host
        logits = continued(model, cache, tokens[count:])
        sim.transfer.drain()
    assert torch.equal(logits, recomputed(model, tokens, count))
