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

import hashlib
import json
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from skippyd.errors import InvalidArgument, Mismatch

if TYPE_CHECKING:
    from transformers import DynamicCache

    from skippyd.client import CaptureResult, Client

__all__ = [
    "FORMAT_VERSION",
    "STEPWISE_MODEL_TYPES",
    "LayerSpec",
    "ModelProfile",
    "TensorShape",
    "capture",
    "default_model_id",
    "prefill",
    "profile",
    "restore",
    "state_id",
]

#: Bumped whenever the tensor naming, the meta layout or the rebuild changes: old entries then miss.
FORMAT_VERSION = 1

#: Model types whose recurrent mixers, in transformers 5.x, ignore the cached recurrent state when more than
#: one token is fed at once (their multi-token path runs the selective scan from a zero state; only the
#: one-token decode path reads the cache). :func:`prefill` feeds these one token at a time on top of a cache.
STEPWISE_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "jamba", "zamba"})

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

    return {
        cu.DynamicLayer: "attn",
        cu.DynamicSlidingWindowLayer: "sliding",
        cu.LinearAttentionLayer: "linear",
        cu.LinearAttentionAndFullAttentionLayer: "hybrid",
        cu.LinearAttentionAndSlidingWindowAttentionLayer: "hybrid_sliding",
        cu.DummyLayer: "dummy",
    }


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


def _probe(model: Any) -> tuple[LayerSpec, ...]:
    """Runs one token through a fresh cache and reads every layer's kind, tensor shapes and dtypes."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.zeros((1, 1), dtype=torch.long, device=_model_device(model))
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
    returned = getattr(out, "cache", None)
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


def _build_profile(model: Any) -> ModelProfile:
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


def state_id(model: Any) -> str:
    """The skippyd ``state`` string of ``model``'s cache (format, layer kinds, shapes, dtype, config)."""
    return profile(model).state


# ----------------------------------------------------------------------------------------- tokens
def _tokens(tokens: Any) -> tuple[Any, int]:
    """A 1-D view of ``tokens`` (a ``[1, n]`` batch is accepted) and its length."""
    if isinstance(tokens, torch.Tensor):
        t = tokens.detach()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise InvalidArgument(f"tokens must be one sequence (1-D or [1, n]), not shape {tuple(t.shape)}")
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
    durable: bool = True,
) -> CaptureResult:
    """Stores ``cache``, the state of ``model`` after exactly ``tokens``, in skippyd.

    Refuses (``InvalidArgument``) a cache whose token count differs from ``tokens``, a batch other than
    one sequence, and any recurrent layer whose state is missing or empty, so a hybrid is never stored as
    KV only; a cache that was not made for this model is a ``Mismatch``. A pure recurrent cache records
    no length, so there ``tokens`` is trusted: pass exactly the tokens the cache has seen.
    """
    prof = profile(model)
    seq, n = _tokens(tokens)
    if n < 1:
        raise InvalidArgument("tokens must hold at least one token")
    tensors, layers_meta = _collect(prof, cache, n)
    import transformers

    meta = {
        "format": FORMAT_VERSION,
        "model_type": prof.model_type,
        "dtype": _dtype_name(prof.dtype),
        "layers": layers_meta,
        "seen_tokens": n,
        "config_hash": prof.config_hash,
        "transformers": str(transformers.__version__),
        "torch": str(torch.__version__),
    }
    return client.capture(
        model=model_id or prof.model_id,
        state=prof.state,
        namespace=namespace,
        tokens=seq,
        tensors=tensors,
        kind=prof.kind,
        meta=meta,
        durable=durable,
    )


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


def restore(
    client: Client,
    model: Any,
    *,
    tokens: Any,
    model_id: str | None = None,
    namespace: str = "",
    device: str | torch.device | None = None,
) -> tuple[DynamicCache, int] | None:
    """The longest captured prefix of ``tokens`` as a ``DynamicCache`` ``model`` accepts, and its length.

    ``None`` on a miss. The caller feeds ``tokens[n:]`` on top of the cache (see :func:`prefill`, which
    steps one token at a time where transformers needs it). Attention keys and values are zero-copy views
    of the daemon's entry on the CPU (copy-on-write: nothing written reaches the cache); conv and
    recurrent states are copied into the layers' own buffers, as transformers updates them in place.
    An entry that does not fit the model raises :class:`~skippyd.errors.Mismatch`.
    """
    from transformers import DynamicCache

    prof = profile(model)
    seq, n = _tokens(tokens)
    if n < 1:
        raise InvalidArgument("tokens must hold at least one token")
    target = torch.device(device) if device is not None else _model_device(model)
    hit = client.restore(
        model=model_id or prof.model_id, state=prof.state, namespace=namespace, tokens=seq, device=target
    )
    if hit is None:
        return None
    count = hit.token_count
    _check_entry(prof, hit.kind, hit.meta, count)
    expected = {t.name for spec in prof.layers for t in spec.tensors}
    if set(hit.tensors) != expected:
        raise Mismatch("the entry's tensors are not the ones this model's cache holds")
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(prof.layers):
        raise Mismatch(f"the model's cache has {len(cache.layers)} layers, its profile {len(prof.layers)}")
    layers: list[Any] = list(cache.layers)
    for index, (layer, spec) in enumerate(zip(layers, prof.layers, strict=True)):
        if _layer_kind(layer, index) != spec.kind:
            raise Mismatch(f"cache layer {index} is no longer a {spec.kind} layer")
        for t in spec.tensors:
            _check_shape(hit.tensors[t.name], t, _attn_len(spec, count), "restore")
        if spec.kind in _ATTN_KINDS:
            keys, values = hit.tensors[f"{index}.k"], hit.tensors[f"{index}.v"]
            layer.lazy_initialization(keys, values)  # sets device (and the window tensor) like a first update
            layer.keys, layer.values = keys, values
            if spec.kind in _SLIDING_KINDS:
                layer.cumulative_length = count
        for s in range(spec.states):
            conv = hit.tensors.get(f"{index}.c{s}")
            rec = hit.tensors.get(f"{index}.r{s}")
            if conv is not None:
                layer.lazy_initialization(conv_states=conv, state_idx=s, conv_kernel_size=int(conv.shape[-1]))
                layer.conv_states[s].copy_(conv)
            if rec is not None:
                layer.lazy_initialization(recurrent_states=rec, state_idx=s)
                layer.recurrent_states[s].copy_(rec)
            layer.has_previous_state[s] = True
    return cache, count


# ----------------------------------------------------------------------------------------- prefill
def _has_state(cache: Any) -> bool:
    for layer in cache.layers:
        if any(getattr(layer, "has_previous_state", {}).values()):
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
    they get one token per forward, which matches a full recompute. ``logits_to_keep`` > 0 keeps only the
    last that many positions' logits (``0``: all). Runs under ``torch.no_grad()``.
    """
    from transformers import DynamicCache

    prof = profile(model)
    seq, n = _tokens(tokens)
    if n == 0:
        raise InvalidArgument("prefill needs at least one token")
    ids = (seq if isinstance(seq, torch.Tensor) else torch.as_tensor(seq, dtype=torch.long)).to(
        _model_device(model), torch.long
    )
    ids = ids.reshape(1, n)
    if cache is None:
        cache = DynamicCache(config=model.config)
    extra: dict[str, Any] = {"logits_to_keep": logits_to_keep} if logits_to_keep > 0 else {}
    with torch.no_grad():
        if not (prof.stepwise and _has_state(cache)):
            out = model(input_ids=ids, cache=cache, use_cache=True, **extra)
            return out.logits, cache
        keep = n if logits_to_keep <= 0 else min(n, logits_to_keep)
        kept: list[torch.Tensor] = []
        for i in range(n):
            out = model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
            if i >= n - keep:
                kept.append(out.logits[:, -1:])
        return torch.cat(kept, dim=1), cache
