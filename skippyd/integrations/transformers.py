"""Hugging Face transformers integration: store a model's prefix cache in skippyd and bring it back.

    from skippyd.integrations import transformers as skt

    out = model(input_ids, use_cache=True)                       # prefill the prompt
    skt.capture(client, model, out.cache, tokens=input_ids)      # store its cache
    ...
    hit = skt.restore(client, model, tokens=prompt)              # in any process on this host
    if hit is not None:
        cache, n = hit                                           # ``n`` tokens of ``prompt`` are covered
        logits, cache = skt.prefill(model, prompt[n:], cache=cache)

Works with the unified ``DynamicCache`` of transformers 5.x: attention layers (``DynamicLayer``, sliding
window layers), linear-attention / recurrent layers (``LinearAttentionLayer``: conv and recurrent states,
as in Mamba, Mamba2 and the mamba half of hybrids) and layers that hold both (Zamba2, Falcon-H1).

Blocks. A capture at token count T stores the attention KV of its whole blocks (``block_tokens``, default
256) as skippyd blocks, chained over the identity and every earlier token, and the rest as one small
entry at T that names them: the partial block's KV, sliding-window layers and, for recurrent layers, their
state at exactly T. Capturing turn N+1 of a conversation after turn N therefore writes only the new blocks
and a small entry; a restore of any captured T is exact (the entry, then its blocks); and an attention-only
model also restores the longest run of leading blocks any capture of the same prefix left, entry or not.
A block holds, for each attention layer in order, its keys then its values (``[1, heads, block_tokens,
head_dim]`` each); a model whose block would pass 64 MiB splits its layers over several block spaces.
``block_tokens=0`` stores one whole entry per capture instead.

The skippyd ``state`` string is derived from the model: a format version, the cache layer kinds, the
shape and dtype of every cached tensor (read off a one-token probe of the model, done once per model) and
a hash of its architecture config. A model whose config differs in anything that shapes or computes the
cache therefore looks under another identity and gets a clean miss; an entry that is found but does not
fit the model anyway (it was stored under a wrong identity) raises :class:`~skippyd.errors.Mismatch`.
The weights are *not* part of the identity: ``model_id`` must name them (it defaults to
``config.name_or_path``).

This module runs in the engine (client side); the daemon never imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from skippyd.client.blockspace import in_two
from skippyd.client.transfer.device import (
    resolve_device,
)  # the largest block: a model's layers are split below it
from skippyd.errors import InvalidArgument, Mismatch, NoSpace
from skippyd.protocol import MAX_BLOCK_BYTES

if TYPE_CHECKING:
    from transformers import DynamicCache

    from skippyd.client import CaptureResult, Client

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "FORMAT_VERSION",
    "POSITION_MODEL_TYPES",
    "STEPWISE_MODEL_TYPES",
    "LayerSpec",
    "ModelProfile",
    "TensorShape",
    "block_states",
    "capture",
    "default_model_id",
    "prefill",
    "profile",
    "restore",
    "state_id",
]

#: Bumped whenever the tensor naming, the meta layout or the rebuild changes: old entries then miss.
#: 2: the attention KV of whole blocks lives in blocks; the entry holds the tail and names them.
FORMAT_VERSION = 2

#: Tokens per block of attention KV (vLLM's and LMCache's usual chunk).
DEFAULT_BLOCK_TOKENS = 256


#: Shorter entries tried when the longest one's blocks have gone (evicted before it).
_FALLBACK_TRIES = 8

#: Model types whose recurrent mixers, in transformers 5.x, ignore the cached recurrent state when more than
#: one token is fed at once (their multi-token path runs the selective scan from a zero state; only the
#: one-token decode path reads the cache). :func:`prefill` feeds these one token at a time on top of a cache.
STEPWISE_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "jamba", "zamba"})
#: Model types whose forward numbers new tokens' positions from 0 whatever the cache holds (transformers
#: 5.25's Bamba: its rotary positions then went wrong after a restore, logits 2 off): ``prefill`` gives
#: them ``position_ids`` counted on from the cache's length.
POSITION_MODEL_TYPES = frozenset({"bamba"})

KIND_KV = "kv"
KIND_KV_RECURRENT = "kv-recurrent"
KIND_RECURRENT = "recurrent-only"

_ATTN_KINDS = frozenset({"attn", "sliding", "hybrid", "hybrid_sliding"})
_LINEAR_KINDS = frozenset({"linear", "hybrid", "hybrid_sliding"})
_SLIDING_KINDS = frozenset({"sliding", "hybrid_sliding"})

# Config entries that describe how a model is run or labelled, not what its cache holds.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "dtype",
        "torch_dtype",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_experts_implementation",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        "chunk_size_feed_forward",
        "pruned_heads",
        "num_logits_to_keep",
    }
)


# ----------------------------------------------------------------------------------------- profiles
@dataclass(frozen=True, slots=True)
class TensorShape:
    """One cached tensor as the model produces it: ``shape[seq_dim]`` grows with the tokens (-1: none)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    seq_dim: int


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One cache layer: its kind, its linear-attention state count, its window and its tensors."""

    kind: str
    states: int
    window: int | None
    tensors: tuple[TensorShape, ...]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What skippyd needs to know about a model's cache; computed once per model (and dtype)."""

    model_id: str
    state: str
    kind: str
    dtype: torch.dtype
    model_type: str
    config_hash: str
    layers: tuple[LayerSpec, ...]
    stepwise: bool


_profiles: weakref.WeakKeyDictionary[Any, ModelProfile] = weakref.WeakKeyDictionary()
_profiles_lock = threading.Lock()


def _layer_classes() -> dict[type, str]:
    from transformers import cache_utils as cu

    joined = _joined_classes()
    classes: dict[type, str] = {
        cu.DynamicLayer: "attn",
        joined[cu.DynamicLayer]: "attn",
        cu.DynamicSlidingWindowLayer: "sliding",
        cu.LinearAttentionLayer: "linear",
        cu.LinearAttentionAndFullAttentionLayer: "hybrid",
        joined[cu.LinearAttentionAndFullAttentionLayer]: "hybrid",
        cu.LinearAttentionAndSlidingWindowAttentionLayer: "hybrid_sliding",
    }
    dummy = getattr(cu, "DummyLayer", None)  # transformers 5.23 on; before it such layers were not made
    if dummy is not None:
        classes[dummy] = "dummy"
    return classes


def _pending_attr(name: str) -> Any:
    """A layer attribute read and written through its pieces: either joins them first."""

    def get(self: _JoinedKV) -> Any:
        if self._pieces is not None:
            self._join()
        return self.__dict__.get(name)

    def put(self: _JoinedKV, value: Any) -> None:
        if self._pieces is not None:
            self._join()
        self.__dict__[name] = value

    return property(get, put)


class _JoinedKV:
    """A cache layer whose keys and values are held as pieces (block views and the entry's tail) until
    they are first needed: the first ``update`` joins them with the new tokens in ONE ``torch.cat`` (what
    a plain layer's update copies anyway), any other read joins them alone. The joined tensors are the
    same bytes a plain layer holds, so a continuation computes exactly what it would have."""

    _pieces: tuple[list[Any], list[Any], int] | None = None  # until a layer holds some (tensors, _Stacked)

    def _hold(self, keys: list[Any], values: list[Any], length: int, event: Any = None) -> None:
        self.__dict__["_keys"] = self.__dict__["_values"] = None
        self.__dict__["_pieces"] = (keys, values, length)
        self.__dict__["_event"] = event  # on a CUDA device: passes once this layer's blocks have landed

    def _join(self, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None) -> None:
        assert self._pieces is not None
        keys, values, _ = self._pieces
        self.__dict__["_pieces"] = None
        event = self.__dict__.pop("_event", None)
        if event is not None:  # this layer's attention waits for its own bytes only (layerwise restore)
            torch.cuda.current_stream(keys[0].device).wait_event(event)
        self.__dict__["_keys"] = _cat_tokens([*keys, *([] if new_keys is None else [new_keys])])
        self.__dict__["_values"] = _cat_tokens([*values, *([] if new_values is None else [new_values])])

    keys = _pending_attr("_keys")
    values = _pending_attr("_values")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._pieces is not None:
            self._join(key_states, value_states)
            return self.__dict__["_keys"], self.__dict__["_values"]
        return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc]

    def get_seq_length(self) -> int:
        if self._pieces is not None:
            return self._pieces[2]
        return super().get_seq_length()  # type: ignore[misc, no-any-return]


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same bytes, a numpy dtype


@dataclass(frozen=True, slots=True)
class _Stacked:
    """One layer's keys (or values) in consecutive blocks of one device buffer, as ONE view: ``blocks[i]``
    is block ``i``'s ``[batch, heads, block_tokens, dim]`` piece (the rows of the buffer a restore to a
    device copies its blocks into). A layer holds one of these instead of a view per block: a restore
    builds a view per layer, not per layer and block, and the first forward joins it in one copy."""

    blocks: torch.Tensor  # [n, batch, heads, block_tokens, dim]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def tokens(self) -> int:
        return int(self.blocks.shape[0]) * int(self.blocks.shape[-2])

    def first(self) -> torch.Tensor:
        return self.blocks[0]

    def into(self, out: torch.Tensor) -> None:
        """Copies the blocks, in token order, into ``out`` (``[batch, heads, tokens, dim]``)."""
        n, width = int(self.blocks.shape[0]), int(self.blocks.shape[-2])
        out.unflatten(-2, (n, width)).copy_(self.blocks.movedim(0, -3))  # type: ignore[no-untyped-call]


def _first_piece(piece: Any) -> torch.Tensor:
    return piece.first() if isinstance(piece, _Stacked) else piece


def _cat_stacked(pieces: list[Any], device: torch.device | None) -> torch.Tensor:
    """``_cat_tokens`` of pieces some of which are :class:`_Stacked`: one copy each into the result."""
    first = _first_piece(pieces[0])
    shape = list(first.shape)
    widths = [p.tokens if isinstance(p, _Stacked) else int(p.shape[-2]) for p in pieces]
    shape[-2] = sum(widths)
    out = torch.empty(shape, dtype=first.dtype, device=first.device if device is None else device)
    at = 0
    for piece, width in zip(pieces, widths, strict=True):
        if isinstance(piece, _Stacked):
            piece.into(out[..., at : at + width, :])
        elif width:
            out[..., at : at + width, :].copy_(piece)
        at += width
    return out


def _cat_tokens(pieces: list[Any], device: torch.device | None = None) -> torch.Tensor:
    """``torch.cat(pieces, dim=-2)``, the same bytes, in one tensor on ``device`` (default: the first
    piece's). On the CPU the pieces are copied by numpy, split over two threads: torch.cat gathering many
    block-sized pieces out of shared memory measured 2-3x slower than these copies on the test machines;
    pieces already on ``device`` (blocks copied there by DMA) are gathered by one ``torch.cat``; elsewhere
    each piece is copied into its place once (a block view goes to the device directly)."""
    if any(isinstance(p, _Stacked) for p in pieces):
        return _cat_stacked(pieces, device)
    first = pieces[0]
    device = first.device if device is None else device
    if device.type != "cpu" and all(p.device == device for p in pieces):
        return torch.cat(pieces, dim=-2)  # on the device: one kernel gathers the pieces
    shape = list(first.shape)
    shape[-2] = sum(int(p.shape[-2]) for p in pieces)
    out = torch.empty(shape, dtype=first.dtype, device=device)
    raw = _RAW.get(first.element_size())
    if (
        device.type != "cpu"
        or raw is None
        or any(p.device.type != "cpu" or p.dtype != first.dtype for p in pieces)
    ):
        at = 0
        for piece in pieces:
            width = int(piece.shape[-2])
            out[..., at : at + width, :].copy_(piece)
            at += width
        return out
    into = out.view(raw).numpy()
    jobs = []
    at = 0
    for piece in pieces:
        width = int(piece.shape[-2])
        if width:
            jobs.append((into[..., at : at + width, :], piece.detach().view(raw).numpy()))
        at += width

    def run(part: list[tuple[Any, Any]]) -> None:
        for target, source in part:
            np.copyto(target, source)

    in_two(run, jobs, out.numel() * out.element_size())
    return out


_joined: dict[type, type] = {}


def _joined_classes() -> dict[type, type]:
    """The joined-on-first-use variants of the two full-attention layer classes (made once)."""
    if not _joined:
        from transformers import cache_utils as cu

        for base in (cu.DynamicLayer, cu.LinearAttentionAndFullAttentionLayer):
            _joined[base] = type(f"Joined{base.__name__}", (_JoinedKV, base), {"__module__": __name__})
    return _joined


def _layer_kind(layer: Any, index: int) -> str:
    kind = _layer_classes().get(type(layer))
    if kind is None:
        raise InvalidArgument(
            f"cache layer {index} is a {type(layer).__name__}, which skippyd cannot store "
            "(supported: DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer and their hybrids)"
        )
    return kind


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _clean_config(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            str(k): _clean_config(v) for k, v in sorted(value.items()) if str(k) not in _VOLATILE_CONFIG_KEYS
        }
    if isinstance(value, list | tuple):
        return [_clean_config(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return repr(value)


def _config_hash(config: Any) -> str:
    text = json.dumps(_clean_config(config.to_dict()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for param in model.parameters():
        return param.dtype  # type: ignore[no-any-return]
    return torch.float32


def _on_one_device(model: Any) -> None:
    """A model spread over several devices (``device_map``: each layer's KV lives on its layer's device)
    is refused with one clear line; skippyd's restore puts every layer on one device."""
    spread = set()
    for where in (getattr(model, "hf_device_map", None) or {}).values():
        if where in ("cpu", "disk"):  # (offloaded modules run on the main device: their KV is there)
            continue
        spread.add(str(torch.device("cuda", where) if isinstance(where, int) else torch.device(where)))
    if len(spread) > 1:
        raise InvalidArgument(
            f"the model is spread over several devices ({', '.join(sorted(spread))}, device_map); "
            "skt captures and restores the cache of a model on one device"
        )


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    for param in model.parameters():
        return param.device  # type: ignore[no-any-return]
    return torch.device("cpu")


def default_model_id(model: Any) -> str:
    """``config.name_or_path``; for a model built from a bare config, its class name and config hash."""
    config = model.config
    name = str(getattr(config, "name_or_path", "") or "")
    if name:
        return name
    return f"{type(config).__name__}@config:{_config_hash(config)[:16]}"


def _attn_tensor(t: torch.Tensor, name: str) -> TensorShape:
    # [batch, kv_heads, seq, head_dim]
    return TensorShape(name, t.dtype, tuple(int(d) for d in t.shape), t.dim() - 2)


#: The names a model's forward has taken its cache by: ``cache`` from transformers 5.24 on (the old
#: names still accepted there, deprecated), before it ``past_key_values`` and, for the Mamba family,
#: ``cache_params``. Passing the wrong one is silently ignored by some models (they start from scratch).
_CACHE_NAMES = ("cache", "past_key_values", "cache_params")
_cache_kwargs: dict[type, str] = {}


def _cache_kwarg(model: Any) -> str:
    """The keyword this model's forward takes its cache by (read from its signature once per class)."""
    kind = type(model)
    name = _cache_kwargs.get(kind)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = next((n for n in _CACHE_NAMES if n in params), _CACHE_NAMES[0])
        _cache_kwargs[kind] = name
    return name


def _returned_cache(out: Any) -> Any:
    """The cache a forward returned, under whichever name this transformers gives it."""
    for name in _CACHE_NAMES:
        found = getattr(out, name, None)
        if found is not None:
            return found
    return None


def _probe(model: Any) -> tuple[LayerSpec, ...]:
    """Runs one token through a fresh cache and reads every layer's kind, tensor shapes and dtypes."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.zeros((1, 1), dtype=torch.long, device=_model_device(model))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{_cache_kwarg(model): cache})
    returned = _returned_cache(out)
    if returned is not None and returned is not cache:
        cache = returned
    if not isinstance(cache, DynamicCache) or type(cache) is not DynamicCache:
        raise InvalidArgument(f"{type(model).__name__} does not use a plain DynamicCache")
    layers = []
    probed: list[Any] = list(cache.layers)
    for index, layer in enumerate(probed):
        kind = _layer_kind(layer, index)
        tensors: list[TensorShape] = []
        states = int(getattr(layer, "number_of_states", 0)) if kind in _LINEAR_KINDS else 0
        window = int(layer.sliding_window) if kind in _SLIDING_KINDS else None
        if kind in _ATTN_KINDS:
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
                raise InvalidArgument(f"the probe left attention layer {index} empty")
            tensors.append(_attn_tensor(layer.keys, f"{index}.k"))
            tensors.append(_attn_tensor(layer.values, f"{index}.v"))
        for s in range(states):
            conv = layer.conv_states[s] if layer.is_conv_states_initialized[s] else None
            rec = layer.recurrent_states[s] if layer.is_recurrent_states_initialized[s] else None
            if conv is None and rec is None:
                raise InvalidArgument(f"the probe left linear-attention layer {index} (state {s}) empty")
            if conv is not None:
                kernel = int(layer.conv_kernel_size[s])
                shape = (*(int(d) for d in conv.shape[:-1]), kernel)
                tensors.append(TensorShape(f"{index}.c{s}", conv.dtype, shape, -1))
            if rec is not None:
                tensors.append(TensorShape(f"{index}.r{s}", rec.dtype, tuple(int(d) for d in rec.shape), -1))
        layers.append(LayerSpec(kind, states, window, tuple(tensors)))
    if not layers:
        raise InvalidArgument(f"{type(model).__name__} produced a cache without layers")
    return tuple(layers)


def _summary(layers: tuple[LayerSpec, ...]) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.kind] = counts.get(layer.kind, 0) + 1
    return "+".join(f"{kind}{n}" for kind, n in counts.items())


def _kind_of(layers: tuple[LayerSpec, ...]) -> str:
    attn = any(layer.kind in _ATTN_KINDS for layer in layers)
    linear = any(layer.kind in _LINEAR_KINDS for layer in layers)
    if attn and linear:
        return KIND_KV_RECURRENT
    return KIND_RECURRENT if linear else KIND_KV


#: The first transformers release this module is tested with (scripts/transformers-floor-env.sh runs
#: the transformers tests on it); pyproject.toml's ``transformers`` extra declares the same floor.
MIN_TRANSFORMERS = (5, 17)


def _check_transformers() -> None:
    import transformers

    version = str(transformers.__version__)
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])
    if parts < MIN_TRANSFORMERS:
        floor = ".".join(map(str, MIN_TRANSFORMERS))
        raise InvalidArgument(
            f"transformers {version} is older than {floor}, the first release skippyd's integration is "
            f"tested with: pip install 'transformers>={floor},<6'"
        )


def _build_profile(model: Any) -> ModelProfile:
    _check_transformers()
    config = model.config
    dtype = _model_dtype(model)
    layers = _probe(model)
    config_hash = _config_hash(config)
    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    layout = [
        [
            layer.kind,
            layer.states,
            layer.window,
            [[t.name, _dtype_name(t.dtype), [-1 if i == t.seq_dim else d for i, d in enumerate(t.shape)]]
             for t in layer.tensors],
        ]
        for layer in layers
    ]  # fmt: skip
    spec = json.dumps(
        {"format": FORMAT_VERSION, "dtype": _dtype_name(dtype), "layers": layout, "config": config_hash},
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = hashlib.sha256(spec.encode()).hexdigest()[:32]
    state = f"hf-cache-v{FORMAT_VERSION}:{model_type}:{_summary(layers)}:{_dtype_name(dtype)}:{digest}"
    has_linear = any(layer.kind in _LINEAR_KINDS for layer in layers)
    return ModelProfile(
        model_id=default_model_id(model),
        state=state,
        kind=_kind_of(layers),
        dtype=dtype,
        model_type=model_type,
        config_hash=config_hash,
        layers=layers,
        stepwise=has_linear and model_type in STEPWISE_MODEL_TYPES,
    )


def profile(model: Any) -> ModelProfile:
    """The model's cache profile (probed once per model object and dtype, then remembered)."""
    dtype = _model_dtype(model)
    with _profiles_lock:
        known = _profiles.get(model)
        if known is not None and known.dtype == dtype:
            return known
        built = _build_profile(model)
        _profiles[model] = built
        return built


def block_states(model: Any, *, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[str]:
    """The ``state`` of every block space ``model``'s attention KV blocks live in (one, unless a block of
    every layer together would pass 64 MiB): what ``skippyd evict --blocks --state`` takes."""
    layout = _layout(profile(model), block_tokens)
    return [] if layout is None else [group.state for group in layout.groups]


def state_id(model: Any) -> str:
    """The skippyd ``state`` string of ``model``'s cache (format, layer kinds, shapes, dtype, config)."""
    return profile(model).state


# ----------------------------------------------------------------------------------------- blocks
_BLOCK_KINDS = frozenset({"attn", "hybrid"})  # full attention: the KV of token t never changes after t


@dataclass(frozen=True, slots=True)
class _Group:
    """Layers whose KV shares one block space (all of them, unless a block would pass 64 MiB)."""

    state: str
    layers: tuple[int, ...]
    block_bytes: int


@dataclass(frozen=True, slots=True)
class _Layout:
    block_tokens: int
    groups: tuple[_Group, ...]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(index for group in self.groups for index in group.layers)


def _tensor_bytes(t: TensorShape, tokens: int) -> int:
    count = 1
    for dim, size in enumerate(t.shape):
        count *= tokens if dim == t.seq_dim else size
    return count * t.dtype.itemsize


def _kv_bytes(spec: LayerSpec, tokens: int) -> int:
    """Bytes of one attention layer's keys plus values over ``tokens`` tokens."""
    return sum(_tensor_bytes(t, tokens) for t in spec.tensors[:2])


def _layout(prof: ModelProfile, block_tokens: int) -> _Layout | None:
    """How ``prof``'s attention KV is cut into blocks of ``block_tokens`` (None: no full-attention layer)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 1 <= block_tokens <= 65536:
        raise InvalidArgument(
            f"block_tokens must be an integer from 1 to 65536 (0: no blocks), not {block_tokens!r}"
        )
    layers = [i for i, spec in enumerate(prof.layers) if spec.kind in _BLOCK_KINDS]
    if not layers:
        return None
    groups: list[list[int]] = [[]]
    sizes = [0]
    for index in layers:
        size = _kv_bytes(prof.layers[index], block_tokens)
        if size > MAX_BLOCK_BYTES:
            raise InvalidArgument(
                f"block_tokens={block_tokens} makes one layer's block {size} bytes, more than a block may be "
                f"({MAX_BLOCK_BYTES}): use fewer tokens per block"
            )
        if sizes[-1] + size > MAX_BLOCK_BYTES:
            groups.append([])
            sizes.append(0)
        groups[-1].append(index)
        sizes[-1] += size
    return _Layout(
        block_tokens,
        tuple(
            _Group(f"{prof.state}:kv{group[0]}-{group[-1]}", tuple(group), size)
            for group, size in zip(groups, sizes, strict=True)
        ),
    )


@dataclass(frozen=True, slots=True)
class _Store:
    """Where one model's state lives: the client, the model id and the namespace."""

    client: Client
    model_id: str
    namespace: str

    def spaces(self, layout: _Layout) -> list[Any]:
        return [
            self.client.blocks(
                model=self.model_id, state=g.state, namespace=self.namespace, block_tokens=layout.block_tokens
            )
            for g in layout.groups
        ]

    def entry(self, prof: ModelProfile, tokens: Any, device: torch.device) -> Any:
        return self.client.restore(
            model=self.model_id, state=prof.state, namespace=self.namespace, tokens=tokens, device=device
        )


#: The CUDA simulator only (skippyd.client.transfer.sim): blocks restored to the CPU go the way CUDA ones do.
_CPU_AS_DEVICE = False


def _leading_blocks(  # noqa: PLR0917 - the restore's parts, passed through
    store: _Store,
    layout: _Layout,
    seq: Any,
    want: int,
    target: torch.device | None = None,
    events: dict[int, Any] | None = None,
    prof: ModelProfile | None = None,
) -> list[list[torch.Tensor]]:
    """The leading held blocks of ``seq`` (at most ``want``), the same run in every group: a group that
    holds fewer cuts the run for all. On the CPU zero-copy views; on a CUDA ``target`` slices of one
    device buffer per group that the blocks were copied into by DMA, layer by layer: ``events[i]`` passes
    once layer ``i``'s keys and values of every block have landed (nothing waits for them yet)."""
    views: list[list[torch.Tensor]] = []
    limit = want
    for group, space in zip(layout.groups, store.spaces(layout), strict=True):
        if not limit:
            break
        keys = space.keys(seq[: limit * layout.block_tokens])
        if target is not None and (target.type == "cuda" or (_CPU_AS_DEVICE and target.type == "cpu")):
            assert prof is not None and events is not None
            got = _blocks_on_device(space, keys, group, layout, prof, target, events)
        else:
            got = space.get(keys)
        for index, block in enumerate(got):
            if block.numel() != group.block_bytes:
                raise Mismatch(
                    f"block {index} of {group.state} holds {block.numel()} bytes, this model's blocks "
                    f"{group.block_bytes}"
                )
        limit = min(limit, len(got))
        views.append(got)
    return [group[:limit] for group in views] if limit else []


def _blocks_on_device(  # noqa: PLR0917 - the restore's parts, passed through
    space: Any,
    keys: list[bytes],
    group: _Group,
    layout: _Layout,
    prof: ModelProfile,
    device: torch.device,
    events: dict[int, Any],
) -> list[Any]:
    """The leading held blocks of ``keys`` copied into one buffer on ``device``, one slice per block, by
    DMA issued layer by layer (a layer's keys and values lie side by side in every block: one run per
    block and layer, or fewer where slots and slices are both consecutive); ``events[layer]`` is set for
    each layer of ``group``."""
    from skippyd.client.transfer.device import transfer

    if not keys:
        return []
    spans, at = [], 0
    for index in group.layers:
        size = _kv_bytes(prof.layers[index], layout.block_tokens)
        spans.append((at, at + size))
        at += size
    buffer = torch.empty((len(keys), group.block_bytes), dtype=torch.uint8, device=device)
    outs = list(buffer.unbind(0))
    with transfer().layered(spans) as copies:
        count = space.get_into(keys, outs)
    for index, event in zip(group.layers, copies.events, strict=False):
        events[index] = event
    return outs[:count]


def _block_pieces(
    prof: ModelProfile, layout: _Layout, views: list[list[torch.Tensor]]
) -> dict[int, tuple[list[Any], list[Any]]]:
    """Per attention layer, its keys and values over the blocks: ``[1, heads, block_tokens, dim]`` views,
    or, where a group's blocks are equally spaced rows of one buffer (a restore to a device copies them
    into one), one :class:`_Stacked` view per layer for all of them. Each layer's geometry in a block is
    worked out once, not per block (a 32k restore of a 32-layer model has 8192 such pieces)."""
    pieces: dict[int, tuple[list[Any], list[Any]]] = {i: ([], []) for i in layout.layers}
    for group, blocks in zip(layout.groups, views, strict=True):
        if not blocks:
            continue
        geometry = []
        offset = 0
        for index in group.layers:
            for which, t in enumerate(prof.layers[index].tensors[:2]):
                shape = list(t.shape)
                shape[t.seq_dim] = layout.block_tokens
                size = _tensor_bytes(t, layout.block_tokens)
                geometry.append((pieces[index][which], offset, size, t.dtype, shape))
                offset += size
        rows = _rows(blocks)
        if rows is not None:
            for into, offset, size, dtype, shape in geometry:
                into.append(_Stacked(rows[:, offset : offset + size].view(dtype).view(len(blocks), *shape)))
            continue
        for block in blocks:
            for into, offset, size, dtype, shape in geometry:
                into.append(block[offset : offset + size].view(dtype).view(shape))
    return pieces


def _rows(blocks: list[torch.Tensor]) -> torch.Tensor | None:
    """``blocks`` as one ``[n, nbytes]`` view when they are equally spaced rows of one CUDA buffer (what
    a restore to a device copies them into), else None."""
    first = blocks[0]
    if len(blocks) < 2 or not (first.is_cuda or _CPU_AS_DEVICE) or first.dim() != 1 or first.stride(0) != 1:
        return None
    base, nbytes = first.data_ptr(), first.numel()
    step = blocks[1].data_ptr() - base
    if step < nbytes:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, block in enumerate(blocks):
        if block.numel() != nbytes or block.data_ptr() != base + i * step or block.stride(0) != 1:
            return None
        if block.untyped_storage().data_ptr() != storage:
            return None
    return first.as_strided((len(blocks), nbytes), (step, 1))


# ----------------------------------------------------------------------------------------- tokens
def _tokens(tokens: Any, *, host: bool = True) -> tuple[Any, int]:
    """A 1-D view of ``tokens`` (a ``[1, n]`` batch is accepted) and its length. With ``host``, token ids
    on a device (an engine's ``input_ids``) come to the CPU here, once, before anything is queued: each
    key computation would otherwise copy them back, and such a copy waits for all the work queued on the
    stream (after a restore's copies are queued, for those too)."""
    if isinstance(tokens, torch.Tensor):
        t = tokens.detach()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise InvalidArgument(f"tokens must be one sequence (1-D or [1, n]), not shape {tuple(t.shape)}")
        if host and t.device.type != "cpu":
            t = t.cpu()
        return t, int(t.shape[0])
    module = type(tokens).__module__
    if module.startswith("numpy"):
        arr = tokens
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.ndim != 1:
            raise InvalidArgument(f"tokens must be one sequence (1-D or [1, n]), not shape {arr.shape}")
        return arr, int(arr.shape[0])
    if isinstance(tokens, bytes | bytearray | memoryview | str):
        raise InvalidArgument("tokens must be integers, not bytes or text")
    seq = tokens if isinstance(tokens, list | tuple) else list(tokens)
    return seq, len(seq)


# ----------------------------------------------------------------------------------------- capture
def _check_shape(tensor: torch.Tensor, spec: TensorShape, seq: int | None, where: str) -> None:
    want = list(spec.shape)
    if seq is not None and spec.seq_dim >= 0:
        want[spec.seq_dim] = seq
    if tensor.dtype != spec.dtype or list(tensor.shape) != want:
        raise Mismatch(
            f"{where}: tensor {spec.name} is {_dtype_name(tensor.dtype)}{list(tensor.shape)}, "
            f"this model's cache holds {_dtype_name(spec.dtype)}{want}"
        )


def _attn_len(spec: LayerSpec, tokens: int) -> int:
    if spec.kind in _SLIDING_KINDS:
        assert spec.window is not None
        return min(tokens, spec.window - 1)
    return tokens


def _collect(prof: ModelProfile, cache: Any, n: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """The tensors to store (named by layer) and the per-layer meta, after checking the cache fits."""
    from transformers import DynamicCache

    if not isinstance(cache, DynamicCache):
        raise InvalidArgument(f"cache must be a transformers DynamicCache, not {type(cache).__name__}")
    if len(cache.layers) != len(prof.layers):
        raise Mismatch(f"the cache has {len(cache.layers)} layers, the model {len(prof.layers)}")
    tensors: dict[str, torch.Tensor] = {}
    layers_meta: list[Any] = []
    layers: list[Any] = list(cache.layers)  # dispatched on kind below; their classes differ per kind
    for index, (layer, spec) in enumerate(zip(layers, prof.layers, strict=True)):
        kind = _layer_kind(layer, index)
        if kind != spec.kind:
            raise Mismatch(
                f"cache layer {index} is a {type(layer).__name__} ({kind}), the model's layer is "
                f"{spec.kind}: build it with DynamicCache(config=model.config) or let the model make it"
            )
        by_name = {t.name: t for t in spec.tensors}
        if kind in _ATTN_KINDS:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not layer.is_initialized or keys is None or values is None or keys.numel() == 0:
                raise InvalidArgument(f"attention layer {index} of the cache is empty")
            held = int(layer.cumulative_length) if kind in _SLIDING_KINDS else int(keys.shape[-2])
            if held != n:
                raise InvalidArgument(f"the cache holds {held} tokens but tokens has {n}")
            keep = _attn_len(spec, n)
            keys, values = keys[..., -keep:, :], values[..., -keep:, :]
            for name, t in ((f"{index}.k", keys), (f"{index}.v", values)):
                _check_shape(t, by_name[name], keep, "capture")
                tensors[name] = t
        for s in range(spec.states):
            if not layer.has_previous_state.get(s, False):
                raise InvalidArgument(
                    f"the recurrent state of layer {index} (state {s}) is missing: the cache has not run any "
                    "token through it; a hybrid's KV without its recurrent state is refused"
                )
            parts: list[torch.Tensor] = []
            name = f"{index}.c{s}"
            if name in by_name:
                conv = layer.conv_states.get(s) if layer.is_conv_states_initialized.get(s) else None
                if conv is None:
                    raise InvalidArgument(f"the conv state of layer {index} (state {s}) is missing")
                conv = conv[..., -by_name[name].shape[-1] :]  # a cache recording its past holds more
                _check_shape(conv, by_name[name], None, "capture")
                tensors[name] = conv
                parts.append(conv)
            name = f"{index}.r{s}"
            if name in by_name:
                rec = layer.recurrent_states.get(s) if layer.is_recurrent_states_initialized.get(s) else None
                if rec is None:
                    raise InvalidArgument(f"the recurrent state of layer {index} (state {s}) is missing")
                _check_shape(rec, by_name[name], None, "capture")
                tensors[name] = rec
                parts.append(rec)
            for part in parts:  # after even one token every conv and recurrent state holds non-zeros
                if not bool(torch.any(part != 0)):
                    raise InvalidArgument(
                        f"the recurrent state of layer {index} (state {s}) is empty (all zeros: reset?)"
                    )
        seen = getattr(layer, "cumulative_length_linear", None)  # transformers >= 5.25 counts linear tokens
        if spec.states and isinstance(seen, torch.Tensor) and int(seen) != n:
            raise InvalidArgument(f"the cache has seen {int(seen)} tokens but tokens has {n}")
        layers_meta.append([spec.kind, spec.states, spec.window])
    return tensors, layers_meta


def capture(
    client: Client,
    model: Any,
    cache: Any,
    *,
    tokens: Any,
    model_id: str | None = None,
    namespace: str = "",
    durable: bool | str = True,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> CaptureResult:
    """Stores ``cache``, the state of ``model`` after exactly ``tokens``, in skippyd.

    The attention KV of every whole block of ``block_tokens`` goes into skippyd's blocks (only the
    blocks not held yet are copied and sent), the rest into one entry at ``len(tokens)`` that names them;
    the result's ``blocks_stored``/``blocks_nbytes`` say what was newly written. ``block_tokens=0``
    stores everything as one entry.

    Refuses (``InvalidArgument``) a cache whose token count differs from ``tokens``, a batch other than
    one sequence, and any recurrent layer whose state is missing or empty, so a hybrid is never stored as
    KV only; a cache that was not made for this model is a ``Mismatch``. A recurrent layer's count of the
    tokens it has seen (transformers 5.25 and later) must match too: after ``generate()``, whose last token
    was never run through the model, pass the tokens the cache has seen, not ``sequences``. (On earlier
    releases a pure recurrent cache records no length, and ``tokens`` is trusted.) A model
    spread over several devices (``device_map``) is refused too (``InvalidArgument``).
    """
    _on_one_device(model)
    prof = profile(model)
    seq, n = _tokens(tokens)
    if n < 1:
        raise InvalidArgument("tokens must hold at least one token")
    layout = _layout(prof, block_tokens) if block_tokens != 0 else None
    tensors, layers_meta = _collect(prof, cache, n)
    import transformers

    mid = model_id or prof.model_id
    meta: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "model_type": prof.model_type,
        "dtype": _dtype_name(prof.dtype),
        "layers": layers_meta,
        "seen_tokens": n,
        "config_hash": prof.config_hash,
        "transformers": str(transformers.__version__),
        "torch": str(torch.__version__),
        "blocks": None,
    }
    count = n // layout.block_tokens if layout is not None else 0
    stored = present = nbytes = 0
    if layout is not None and count:
        span = layout.block_tokens
        for group, space in zip(layout.groups, _Store(client, mid, namespace).spaces(layout), strict=True):
            keys = space.keys(seq[: count * span])
            planes = [tensors[f"{index}.{part}"] for index in group.layers for part in ("k", "v")]
            for a, b in _put_chunks(planes, span, count):
                data = _capture_pieces(planes, span, a, b)
                try:
                    put = space.put(keys[a:b], data, durable=durable, parent=keys[a - 1] if a else None)
                except NoSpace:
                    if not a:
                        raise
                    break  # (as one put would: the blocks before are kept; a restore takes those)
                stored, present, nbytes = stored + put.stored, present + put.present, nbytes + put.nbytes
                if put.skipped:  # a block not stored: every later one would be a hole, so none is sent
                    break
        for index in layout.layers:  # the entry keeps the partial block
            for part in ("k", "v"):
                tensors[f"{index}.{part}"] = tensors[f"{index}.{part}"][..., count * span :, :]
        meta["blocks"] = {"tokens": layout.block_tokens, "count": count}
    result = client.capture(
        model=mid,
        state=prof.state,
        namespace=namespace,
        tokens=seq,
        tensors=tensors,
        kind=prof.kind,
        meta=meta,
        durable=durable,  # type: ignore[arg-type]
    )
    return dataclasses.replace(result, blocks_stored=stored, blocks_present=present, blocks_nbytes=nbytes)


#: The device memory a capture from a GPU cache lays its blocks out in at a time (:func:`_put_chunks`).
_DEVICE_CHUNK_BYTES = 256 << 20


def _on_device(plane: torch.Tensor) -> bool:
    return plane.device.type != "cpu" or _CPU_AS_DEVICE


def _put_chunks(planes: Sequence[torch.Tensor], span: int, count: int) -> list[tuple[int, int]]:
    """The runs of blocks ``[a, b)`` a capture puts at once: all of them from the CPU; from a device, as
    many as lay out in ``_DEVICE_CHUNK_BYTES`` of device memory (:func:`_capture_pieces`)."""
    if not planes or not _on_device(planes[0]):
        return [(0, count)]
    per_block = sum(p[..., :span, :].numel() * p.element_size() for p in planes)
    step = max(1, _DEVICE_CHUNK_BYTES // max(1, per_block))
    return [(a, min(count, a + step)) for a in range(0, count, step)]


def _capture_pieces(planes: Sequence[torch.Tensor], span: int, a: int, b: int) -> list[list[torch.Tensor]]:
    """Blocks ``a`` to ``b`` of the cache's planes (``[batch, heads, tokens, dim]`` each), one list of
    pieces a block, whose bytes are each plane's ``span`` tokens in order. From the CPU the pieces are
    strided views (``put`` lays each out as it copies it). On a device the chunk is laid out block by
    block in one buffer, one copy a plane: each block is one contiguous piece, and consecutive blocks
    follow each other, so the transfer's DMAs merge (else it would make a temporary and launch a copy
    for every block, layer and K/V: 8192 for 32k tokens of a 32-layer model)."""
    if not planes or not _on_device(planes[0]):
        return [[p[..., i * span : (i + 1) * span, :] for p in planes] for i in range(a, b)]
    n = b - a
    sizes = [p[..., :span, :].numel() * p.element_size() for p in planes]
    out = torch.empty((n, sum(sizes)), dtype=torch.uint8, device=planes[0].device)
    at = 0
    for plane, size in zip(planes, sizes, strict=True):
        blocks = plane[..., a * span : b * span, :].unflatten(-2, (n, span)).movedim(-3, 0)  # type: ignore[no-untyped-call]
        out[:, at : at + size].view(plane.dtype).view(blocks.shape).copy_(blocks)
        at += size
    return [[out[i]] for i in range(n)]


# ----------------------------------------------------------------------------------------- restore
def _check_entry(prof: ModelProfile, kind: str, meta: Mapping[str, Any], count: int) -> None:
    if kind != prof.kind:
        raise Mismatch(f"the entry is of kind {kind!r}, this model's cache is {prof.kind!r}")
    if meta.get("format") != FORMAT_VERSION:
        raise Mismatch(f"the entry has format {meta.get('format')!r}, this library reads {FORMAT_VERSION}")
    if meta.get("seen_tokens") != count:
        raise Mismatch(f"the entry says it saw {meta.get('seen_tokens')!r} tokens, the daemon {count}")
    layers = meta.get("layers")
    want = [[spec.kind, spec.states, spec.window] for spec in prof.layers]
    if layers != want:
        raise Mismatch("the entry's cache layers differ from this model's")
    if meta.get("dtype") != _dtype_name(prof.dtype) or meta.get("config_hash") != prof.config_hash:
        raise Mismatch("the entry was captured from a model with another dtype or config")


def _blocks_of(meta: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ``(block_tokens, count)`` an entry names, or None for an entry that holds everything."""
    info = meta.get("blocks")
    if info is None:
        return None
    tokens, count = (info.get("tokens"), info.get("count")) if isinstance(info, Mapping) else (None, None)
    if not (isinstance(tokens, int) and isinstance(count, int) and 1 <= tokens <= 65536 and count >= 1):
        raise Mismatch(f"the entry names its blocks as {info!r}")
    return tokens, count


@dataclass(slots=True)
class _Found:
    """What a restore rebuilds from: an entry (or none) and the views of the blocks before it."""

    count: int
    tail: Mapping[str, torch.Tensor]
    layout: _Layout | None
    blocks: int
    pieces: dict[int, tuple[list[Any], list[Any]]]  # per layer: block views, or one _Stacked
    events: dict[int, Any] = dataclasses.field(default_factory=dict)  # per layer, on a CUDA device


def _blocks_alone(
    prof: ModelProfile, layout: _Layout, views: list[list[torch.Tensor]], events: dict[int, Any]
) -> _Found | None:
    """A restore from a run of leading blocks and no entry (attention-only models), if there is a run."""
    if not views or not views[0]:
        return None
    count = len(views[0])
    pieces = _block_pieces(prof, layout, views)
    return _Found(count * layout.block_tokens, {}, layout, count, pieces, events)


def _find(
    store: _Store, prof: ModelProfile, seq: Any, *, target: torch.device, default: _Layout | None
) -> _Found | None:
    """The longest restorable prefix: an entry whose blocks are all held (a shorter entry if the longest
    one's blocks have gone) or, for an attention-only model, the longest leading run of blocks (of the
    entry's block size, or of ``default`` when no entry names blocks)."""
    blocks_alone = prof.kind == KIND_KV and all(spec.kind in _BLOCK_KINDS | {"dummy"} for spec in prof.layers)
    found: _Found | None = None
    alone: _Found | None = None
    n = len(seq)
    hit = store.entry(prof, seq, target)
    for _ in range(_FALLBACK_TRIES):
        if hit is None:
            break
        _check_entry(prof, hit.kind, hit.meta, hit.token_count)
        named = _blocks_of(hit.meta)
        if named is None:
            found = _Found(hit.token_count, hit.tensors, None, 0, {})
            break
        span, count = named
        layout = _layout(prof, span)
        if layout is None:
            raise Mismatch("the entry names blocks, but this model has no attention layer to hold them")
        want = max(count, n // span) if blocks_alone else count  # one get answers both questions
        events: dict[int, Any] = {}
        views = _leading_blocks(store, layout, seq, want, target, events, prof)
        run = _blocks_alone(prof, layout, views, events) if blocks_alone else None
        if run is not None and (alone is None or run.count > alone.count):
            alone = run
        if views and len(views[0]) >= count:
            pieces = run.pieces if run is not None else _block_pieces(prof, layout, views)  # (built once)
            found = _Found(hit.token_count, hit.tensors, layout, count, pieces, events)
            break
        if hit.token_count <= 1:  # its blocks have gone: a shorter entry may still be whole
            break
        hit = store.entry(prof, seq[: hit.token_count - 1], target)
    if blocks_alone and alone is None and default is not None and n >= default.block_tokens:
        events = {}
        views = _leading_blocks(store, default, seq, n // default.block_tokens, target, events, prof)
        alone = _blocks_alone(prof, default, views, events)
    if alone is not None and (found is None or alone.count > found.count):
        return alone
    return found


def restore(
    client: Client,
    model: Any,
    *,
    tokens: Any,
    model_id: str | None = None,
    namespace: str = "",
    device: str | torch.device | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> tuple[DynamicCache, int] | None:
    """The longest captured prefix of ``tokens`` as a ``DynamicCache`` ``model`` accepts, and its length.

    ``None`` on a miss. The caller feeds ``tokens[n:]`` on top of the cache (see :func:`prefill`, which
    steps one token at a time where transformers needs it). On the CPU the attention keys and values
    stay zero-copy views of the daemon's blocks and entry (copy-on-write: nothing written reaches the
    store) until the first forward joins them with its new tokens, in the one copy a cache's update makes
    anyway; on a device they are copied there. Conv and recurrent states are copied into the layers' own
    buffers, as transformers updates them in place. An entry whose blocks have been evicted is passed
    over for a shorter one; an attention-only model also restores the longest run of leading blocks of
    ``block_tokens`` (any capture's). An entry that does not fit the model raises
    :class:`~skippyd.errors.Mismatch`; a model spread over several devices (``device_map``) an
    :class:`~skippyd.errors.InvalidArgument`.
    """
    from transformers import DynamicCache

    _on_one_device(model)
    prof = profile(model)
    seq, n = _tokens(tokens)
    if n < 1:
        raise InvalidArgument("tokens must hold at least one token")
    default = _layout(prof, block_tokens) if block_tokens != 0 else None  # (checks the value too)
    target = resolve_device(device) if device is not None else _model_device(model)
    store = _Store(client, model_id or prof.model_id, namespace)
    found = _find(store, prof, seq, target=target, default=default)
    if found is None:
        return None
    count = found.count
    blocked = set(found.layout.layers) if found.layout is not None else set()
    span = found.blocks * (found.layout.block_tokens if found.layout is not None else 0)
    expected = {t.name for spec in prof.layers for t in spec.tensors}
    if (found.tail or not blocked) and set(found.tail) != expected:  # blocks alone: no entry, no tail
        raise Mismatch("the entry's tensors are not the ones this model's cache holds")
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(prof.layers):
        raise Mismatch(f"the model's cache has {len(cache.layers)} layers, its profile {len(prof.layers)}")
    joined = _joined_classes()
    layers: list[Any] = list(cache.layers)
    for index, (layer, spec) in enumerate(zip(layers, prof.layers, strict=True)):
        if _layer_kind(layer, index) != spec.kind:
            raise Mismatch(f"cache layer {index} is no longer a {spec.kind} layer")
        for t in spec.tensors:
            if t.name in found.tail:
                tail_len = count - span if index in blocked and t.seq_dim >= 0 else _attn_len(spec, count)
                _check_shape(found.tail[t.name], t, tail_len, "restore")
        if index in blocked:
            keys, values = found.pieces[index]
            keys, values = list(keys), list(values)
            if found.tail and count > span:
                keys.append(found.tail[f"{index}.k"])
                values.append(found.tail[f"{index}.v"])
            layer.lazy_initialization(_first_piece(keys[0]), _first_piece(values[0]))
            if target.type not in ("cpu", "cuda"):  # (pieces copied there one by one)
                layer.keys, layer.values = _cat_tokens(keys, target), _cat_tokens(values, target)
        elif spec.kind in _ATTN_KINDS:
            k, v = found.tail[f"{index}.k"], found.tail[f"{index}.v"]
            layer.lazy_initialization(k, v)  # sets device (and the window tensor) like a first update
            layer.keys, layer.values = k, v
            if spec.kind in _SLIDING_KINDS:
                layer.cumulative_length = count
        for s in range(spec.states):
            conv = found.tail.get(f"{index}.c{s}")
            rec = found.tail.get(f"{index}.r{s}")
            if conv is not None:
                layer.lazy_initialization(conv_states=conv, state_idx=s, conv_kernel_size=int(conv.shape[-1]))
                layer.conv_states[s].copy_(conv)
            if rec is not None:
                layer.lazy_initialization(recurrent_states=rec, state_idx=s)
                layer.recurrent_states[s].copy_(rec)
            layer.has_previous_state[s] = True
        seen = getattr(layer, "cumulative_length_linear", None)  # transformers >= 5.25 counts linear tokens
        if spec.states and isinstance(seen, torch.Tensor):
            seen.fill_(count)
        if index in blocked and target.type in ("cpu", "cuda"):  # last, once the layer is wholly set up
            held: Any = object.__new__(joined[type(layer)])  # the same layer, holding pieces
            held.__dict__.update(layer.__dict__)
            held._hold(keys, values, count, found.events.get(index))
            cache.layers[index] = held
    return cache, count


# ----------------------------------------------------------------------------------------- prefill
def _has_state(cache: Any) -> bool:
    for layer in cache.layers:
        if any(getattr(layer, "has_previous_state", {}).values()):
            return True
        if isinstance(layer, _JoinedKV) and layer.get_seq_length() > 0:  # without joining its pieces
            return True
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel() > 0:
            return True
    return False


def prefill(
    model: Any, tokens: Any, *, cache: Any = None, logits_to_keep: int = 0
) -> tuple[torch.Tensor, DynamicCache]:
    """Feeds ``tokens`` to ``model`` on top of ``cache`` (a fresh one if ``None``): ``(logits, cache)``.

    One forward pass, except for models in :data:`STEPWISE_MODEL_TYPES` continuing a cache that already
    holds state: their multi-token path drops the cached recurrent state (a transformers limitation), so
    they get one token per forward, which matches a full recompute; models in
    :data:`POSITION_MODEL_TYPES` get the new tokens' positions counted on from the cache's length.
    ``logits_to_keep`` > 0 keeps only the last that many positions' logits (``0``: all). Runs under
    ``torch.no_grad()``.
    """
    from transformers import DynamicCache

    prof = profile(model)
    seq, n = _tokens(tokens, host=False)  # (ids on the model's device stay there)
    if n == 0:
        raise InvalidArgument("prefill needs at least one token")
    ids = (seq if isinstance(seq, torch.Tensor) else torch.as_tensor(seq, dtype=torch.long)).to(
        _model_device(model), torch.long
    )
    ids = ids.reshape(1, n)
    if cache is None:
        cache = DynamicCache(config=model.config)
    extra: dict[str, Any] = {"logits_to_keep": logits_to_keep} if logits_to_keep > 0 else {}
    if getattr(model.config, "model_type", None) in POSITION_MODEL_TYPES and _has_state(cache):
        past = int(cache.get_seq_length())
        extra["position_ids"] = torch.arange(past, past + n, device=ids.device)[None]
    with torch.no_grad():
        if not (prof.stepwise and _has_state(cache)):
            out = model(input_ids=ids, use_cache=True, **{_cache_kwarg(model): cache}, **extra)
            return out.logits, cache
        keep = n if logits_to_keep <= 0 else min(n, logits_to_keep)
        kept: list[torch.Tensor] = []
        for i in range(n):
            out = model(input_ids=ids[:, i : i + 1], use_cache=True, **{_cache_kwarg(model): cache})
            if i >= n - keep:
                kept.append(out.logits[:, -1:])
        return torch.cat(kept, dim=1), cache
