"""transformers integration against a real ``skippyd serve``: capture a model's cache, restore, continue.

Four models with seeded random weights (tests/hfmodels.py): a Llama-style attention model (kind "kv"),
a pure Mamba model ("recurrent-only"), and two hybrids ("kv-recurrent"): Zamba2 (Mamba2 layers plus
layers that hold attention KV *and* a recurrent state) and Jamba (alternating Mamba and attention layers).

Tolerances. Every restore is first checked to be lossless: the restored tensors equal the captured ones
bit for bit, and the logits of a continuation on the restored cache equal, bit for bit, those of the same
continuation on the cache that never left the process. What remains between "restore and continue" and
"recompute everything" is transformers' own difference between a cached continuation and a full
prefill, float32 rounding of different kernels: one-token or short-query matmuls instead of one long
one, and for the recurrent layers a sequential recurrence instead of a parallel (associative or chunked)
scan. On these models (logits of magnitude ~10, std ~1.6) it measured at most 4e-6 for Llama, 8e-6 for
Mamba, 1.5e-4 for Zamba2 and 1.3e-4 for Jamba. ``TOL`` allows that with margin, and every test also shows
the check can fail: the same continuation without the restored prefix is off by more than ``100 * TOL``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import hfmodels
import torch
from daemonutil import DaemonProcess

import skippyd
from skippyd.errors import InvalidArgument, Mismatch
from skippyd.integrations import transformers as skt

MODELS = ["llama", "mamba", "zamba2", "jamba"]
HYBRIDS = ["zamba2", "jamba"]
PREFIX = 1024  # tokens captured
PROMPT = 1500  # tokens of the prompt that partially hits
CONT = 8  # tokens fed after an exact hit

# Largest |logit| difference allowed between "restore + continue" and "recompute everything" (see above).
TOL = {"llama": 1e-4, "mamba": 1e-4, "zamba2": 1e-3, "jamba": 1e-3}
KINDS = {"llama": "kv", "mamba": "recurrent-only", "zamba2": "kv-recurrent", "jamba": "kv-recurrent"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def client(hf_daemon: DaemonProcess) -> Iterator[skippyd.Client]:
    with hf_daemon.client() as c:
        yield c


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    return str(request.node.name)


@pytest.fixture(scope="module")
def reference(built: Callable[[str], Any]) -> Callable[[str], torch.Tensor]:
    """Logits of a full recompute of the whole prompt, ``[PROMPT, vocab]``, once per model."""
    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in cache:
            with torch.no_grad():
                cache[name] = built(name)(input_ids=hfmodels.prompt(PROMPT)[None]).logits[0]
        return cache[name]

    return get


def state_tensors(cache: Any) -> dict[str, torch.Tensor]:
    """Every tensor a DynamicCache holds, by layer (attention keys/values, conv and recurrent states)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if isinstance(t, torch.Tensor) and t.numel():
                out[f"{i}.{attr}"] = t
        for attr in ("conv_states", "recurrent_states"):
            for s, t in (getattr(layer, attr, None) or {}).items():
                if t is not None:
                    out[f"{i}.{attr}.{s}"] = t
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a.float() - b.float()).abs().max())


def prefilled(model: Any, tokens: torch.Tensor) -> Any:
    _, cache = skt.prefill(model, tokens)
    return cache


# ----------------------------------------------------------------------------------------- exact hit
@pytest.mark.parametrize("name", MODELS)
def test_restored_cache_continues_exactly_like_the_original_and_like_a_full_recompute(
    name: str, client: skippyd.Client, namespace: str, built: Any, reference: Any
) -> None:
    model = built(name)
    tokens = hfmodels.prompt(PROMPT)
    prefix, cont = tokens[:PREFIX], tokens[PREFIX : PREFIX + CONT]
    original = prefilled(model, prefix)
    result = skt.capture(client, model, original, tokens=prefix, namespace=namespace)
    assert result.token_count == PREFIX and result.l2

    hit = skt.restore(client, model, tokens=prefix, namespace=namespace)
    assert hit is not None
    restored, count = hit
    assert count == PREFIX
    assert type(restored) is type(original)
    want, got = state_tensors(original), state_tensors(restored)
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key

    after_restore, _ = skt.prefill(model, cont, cache=restored)
    after_original, _ = skt.prefill(model, cont, cache=original)
    assert torch.equal(after_restore, after_original)  # skippyd adds no error at all

    full = reference(name)[PREFIX : PREFIX + CONT]
    assert max_diff(after_restore[0], full) <= TOL[name]
    assert torch.equal(after_restore[0].argmax(-1), full.argmax(-1))
    without_prefix, _ = skt.prefill(model, cont)
    assert max_diff(without_prefix[0], full) > 100 * TOL[name]  # a lost prefix would be caught


@pytest.mark.parametrize("name", MODELS)
def test_entry_kind_and_meta_describe_the_cache(
    name: str, client: skippyd.Client, namespace: str, built: Any
) -> None:
    import transformers

    model = built(name)
    prefix = hfmodels.prompt(PROMPT)[:64]
    skt.capture(client, model, prefilled(model, prefix), tokens=prefix, namespace=namespace)
    prof = skt.profile(model)
    raw = client.restore(model=prof.model_id, state=prof.state, namespace=namespace, tokens=prefix)
    assert raw is not None
    assert raw.kind == KINDS[name] == prof.kind
    assert raw.meta["seen_tokens"] == 64 and raw.meta["format"] == skt.FORMAT_VERSION
    assert raw.meta["transformers"] == transformers.__version__
    assert raw.meta["dtype"] == "float32"
    assert [layer[0] for layer in raw.meta["layers"]] == [layer.kind for layer in prof.layers]
    recurrent = [k for k in raw.tensors if ".c" in k or ".r" in k]
    attention = [k for k in raw.tensors if k.endswith((".k", ".v"))]
    assert bool(recurrent) == (name != "llama")
    assert bool(attention) == (name != "mamba")


# ----------------------------------------------------------------------------------------- partial hit
@pytest.mark.parametrize("name", MODELS)
def test_partial_hit_restores_the_longest_captured_prefix_and_prefilling_the_rest_matches(
    name: str, client: skippyd.Client, namespace: str, built: Any, reference: Any
) -> None:
    """1,024 of 1,500 tokens come from skippyd; the other 476 are prefilled on top of them.

    Mamba and Jamba get the 476 tokens one per forward (``skt.prefill`` does it): their transformers
    mixers drop the cached recurrent state when fed several tokens at once.
    """
    model = built(name)
    tokens = hfmodels.prompt(PROMPT)
    for length in (512, PREFIX):  # two captured prefixes: the longer one must be chosen
        skt.capture(
            client, model, prefilled(model, tokens[:length]), tokens=tokens[:length], namespace=namespace
        )

    hit = skt.restore(client, model, tokens=tokens, namespace=namespace)
    assert hit is not None
    cache, count = hit
    assert count == PREFIX
    logits, cache = skt.prefill(model, tokens[count:], cache=cache)
    full = reference(name)[PREFIX:]
    assert logits.shape[1] == PROMPT - PREFIX
    assert max_diff(logits[0], full) <= TOL[name]
    assert torch.equal(logits[0].argmax(-1), full.argmax(-1))
    without_prefix, _ = skt.prefill(model, tokens[PREFIX:], logits_to_keep=1)
    assert max_diff(without_prefix[0, -1], full[-1]) > 100 * TOL[name]
    if name != "mamba":  # attention layers track the length; a pure recurrent cache has none
        assert cache.get_seq_length() == PROMPT


# ----------------------------------------------------------------------------------------- restart
RESTART_NS = "engine-restart"


@pytest.fixture(scope="module")
def restarted(hf_daemon: DaemonProcess, built: Any) -> Iterator[dict[str, tuple[dict[str, Any], Any]]]:
    """Captures every model's prefix here, then restores them all in one new process (an engine restart).

    The child (tests/hfmodels.py) builds each model from the same seed, restores the longest prefix of a
    prompt ``CONT`` tokens longer than the capture, feeds those ``CONT`` tokens and saves the logits.
    """
    tokens = hfmodels.prompt(PROMPT)[: PREFIX + CONT]
    with hf_daemon.client() as c:
        for name in MODELS:
            model = built(name)
            skt.capture(
                c, model, prefilled(model, tokens[:PREFIX]), tokens=tokens[:PREFIX], namespace=RESTART_NS
            )
    out = Path(tempfile.mkdtemp(prefix="sk-hf-restart-"))
    try:
        torch.save(tokens, out / "tokens.pt")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.run(
            [
                sys.executable, str(ROOT / "tests" / "hfmodels.py"),
                "--socket", str(hf_daemon.socket), "--models", ",".join(MODELS), "--namespace", RESTART_NS,
                "--tokens", str(out / "tokens.pt"), "--out", str(out),
            ],
            capture_output=True, text=True, timeout=110, env=env, check=False,
        )  # fmt: skip
        assert child.returncode == 0, child.stdout + child.stderr
        reports = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        yield {r["model"]: (r, torch.load(out / f"{r['model']}.pt")) for r in reports}
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("name", MODELS)
def test_restore_in_a_fresh_process_continues_like_a_full_recompute(
    name: str, restarted: dict[str, tuple[dict[str, Any], Any]], built: Any, reference: Any
) -> None:
    """An engine restart: a new process builds the same model from the same seed and restores."""
    model = built(name)
    report, logits = restarted[name]
    assert report["hit"] and report["token_count"] == PREFIX
    assert report["fingerprint"] == hfmodels.fingerprint(model)  # the same weights, rebuilt
    assert report["state"] == skt.state_id(model)  # the identity does not depend on the process
    full = reference(name)[PREFIX : PREFIX + CONT]
    assert logits.shape == (1, CONT, full.shape[-1])
    assert max_diff(logits[0], full) <= TOL[name]
    assert torch.equal(logits[0].argmax(-1), full.argmax(-1))
    tokens = hfmodels.prompt(PROMPT)
    without_prefix, _ = skt.prefill(model, tokens[PREFIX : PREFIX + CONT])
    assert max_diff(without_prefix[0], full) > 100 * TOL[name]


# ----------------------------------------------------------------------------------------- hybrids
def _attention_only_copy(model: Any, cache: Any, *, typed: bool) -> Any:
    """The attention KV of ``cache`` without any recurrent state (typed: the model's own layer kinds)."""
    from transformers import DynamicCache

    copy = DynamicCache(config=model.config) if typed else DynamicCache()
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            copy.update(keys.clone(), layer.values.clone(), i)
    return copy


def test_a_recurrent_cache_captured_under_more_tokens_than_it_has_seen_is_refused(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    """After generate() the last token was never run through the model: passing its sequences stored a
    Mamba state under one token too many, and a restore then continued from the wrong state (logits off
    by 5). A recurrent layer counts the tokens it has seen (transformers 5.25 and later)."""
    model = built("mamba")
    prefix = hfmodels.prompt(PROMPT)[:64]
    cache = prefilled(model, prefix[:63])
    seen = getattr(cache.layers[0], "cumulative_length_linear", None)
    if not isinstance(seen, torch.Tensor):
        pytest.skip("this transformers counts no recurrent tokens: tokens are trusted there")
    with pytest.raises(InvalidArgument, match="has seen 63 tokens but tokens has 64"):
        skt.capture(client, model, cache, tokens=prefix, namespace=namespace)
    assert skt.restore(client, model, tokens=prefix, namespace=namespace) is None
    skt.capture(client, model, cache, tokens=prefix[:63], namespace=namespace)
    restored = skt.restore(client, model, tokens=prefix, namespace=namespace)
    assert restored is not None and restored[1] == 63


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("damage", ["never-ran", "plain-kv-cache", "reset", "zeroed"])
def test_hybrid_capture_without_its_recurrent_state_is_refused(
    name: str, damage: str, client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built(name)
    prefix = hfmodels.prompt(PROMPT)[:256]
    cache = prefilled(model, prefix)
    linear = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]
    assert linear
    if damage == "never-ran":  # the model's layer kinds, KV filled in, recurrent layers untouched
        cache = _attention_only_copy(model, cache, typed=True)
    elif damage == "plain-kv-cache":  # a KV-only DynamicCache(): no recurrent layer at all
        cache = _attention_only_copy(model, cache, typed=False)
    elif damage == "reset":  # the recurrent half reset (zeroed, no previous state), the KV kept
        from transformers.cache_utils import LinearAttentionLayer

        for layer in linear:
            LinearAttentionLayer.reset(layer)
    else:
        for layer in linear:
            for state in layer.recurrent_states.values():
                state.zero_()
    # A cache without the model's recurrent layers does not fit it (Mismatch); one whose recurrent layers
    # hold nothing is an invalid capture (InvalidArgument). Either way nothing may be stored.
    expected, words = (
        (Mismatch, "DynamicCache") if damage == "plain-kv-cache" else (InvalidArgument, "recurrent")
    )
    with pytest.raises(expected, match=words):
        skt.capture(client, model, cache, tokens=prefix, namespace=namespace)
    assert skt.restore(client, model, tokens=prefix, namespace=namespace) is None  # nothing was stored


# ----------------------------------------------------------------------------------------- mismatch
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "change", [{"num_hidden_layers": 6}, {"hidden_size": 96}], ids=["more-layers", "wider"]
)
def test_restore_into_a_model_with_another_config_misses(
    name: str, change: dict[str, int], client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built(name)
    other = hfmodels.build(name, **change)
    prefix = hfmodels.prompt(PROMPT)[:128]
    # One model_id for both: only the state identity (derived from the config) tells them apart.
    skt.capture(client, model, prefilled(model, prefix), tokens=prefix, namespace=namespace, model_id="m")
    assert skt.state_id(other) != skt.state_id(model)
    assert skt.restore(client, other, tokens=prefix, namespace=namespace, model_id="m") is None
    assert skt.restore(client, model, tokens=prefix, namespace=namespace, model_id="m") is not None


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("forge_meta", [False, True], ids=["honest-meta", "forged-meta"])
def test_an_entry_that_does_not_fit_the_model_raises_mismatch(
    name: str, forge_meta: bool, client: skippyd.Client, namespace: str, built: Any
) -> None:
    """An entry filed under the wrong identity (a buggy or lying producer) is refused, never used.

    With its meta intact the config hash gives it away; with the meta forged to claim the other model's
    config, the tensor shapes do.
    """
    model = built(name)
    other = hfmodels.build(name, hidden_size=96)
    prefix = hfmodels.prompt(PROMPT)[:128]
    skt.capture(client, model, prefilled(model, prefix), tokens=prefix, namespace=namespace)
    mine, theirs = skt.profile(model), skt.profile(other)
    raw = client.restore(model=mine.model_id, state=mine.state, namespace=namespace, tokens=prefix)
    assert raw is not None
    meta = dict(raw.meta)
    if forge_meta:
        meta["config_hash"] = theirs.config_hash
    client.capture(
        model=theirs.model_id, state=theirs.state, namespace=namespace, tokens=prefix,
        tensors=raw.tensors, kind=raw.kind, meta=meta,
    )  # fmt: skip
    with pytest.raises(Mismatch):
        skt.restore(client, other, tokens=prefix, namespace=namespace)


def test_a_different_dtype_is_another_state_and_misses(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("llama")
    half = hfmodels.build("llama").to(torch.bfloat16)
    prefix = hfmodels.prompt(PROMPT)[:64]
    skt.capture(client, model, prefilled(model, prefix), tokens=prefix, namespace=namespace)
    assert ":float32:" in skt.state_id(model) and ":bfloat16:" in skt.state_id(half)
    assert skt.state_id(model).startswith(f"hf-cache-v{skt.FORMAT_VERSION}:llama:attn2:")
    assert skt.restore(client, half, tokens=prefix, namespace=namespace) is None


def test_capture_refuses_tokens_that_do_not_match_the_cache(
    client: skippyd.Client, namespace: str, built: Any
) -> None:
    model = built("llama")
    prefix = hfmodels.prompt(PROMPT)[:64]
    cache = prefilled(model, prefix)
    with pytest.raises(InvalidArgument, match="holds 64 tokens"):
        skt.capture(client, model, cache, tokens=prefix[:60], namespace=namespace)
    other = built("mamba")
    with pytest.raises((InvalidArgument, Mismatch)):
        skt.capture(client, other, cache, tokens=prefix, namespace=namespace)  # another model's cache
    assert skt.restore(client, model, tokens=prefix, namespace=namespace) is None


def test_default_model_id_names_the_checkpoint_or_the_config(built: Any) -> None:
    model = built("llama")
    assert skt.default_model_id(model).startswith("LlamaConfig@config:")
    assert skt.default_model_id(model) == skt.default_model_id(hfmodels.build("llama", seed=99))
    assert skt.default_model_id(model) != skt.default_model_id(hfmodels.build("llama", hidden_size=96))
    named = hfmodels.build("llama")
    named.config.name_or_path = "org/tiny-llama"
    assert skt.default_model_id(named) == "org/tiny-llama"


def test_a_bamba_continuation_on_a_restored_cache_matches_a_full_prefill(
    client: skippyd.Client, namespace: str
) -> None:
    """Bamba's forward numbers new tokens' positions from 0 whatever the cache holds: its rotary positions
    were wrong on top of a restored cache (logits 2 off, a third of the argmaxes wrong). skt.prefill gives
    it positions counted on from the cache's length."""
    import transformers as tf

    if not hasattr(tf, "BambaConfig"):
        pytest.skip("this transformers has no Bamba")
    torch.manual_seed(1)
    config = tf.BambaConfig(
        vocab_size=512, hidden_size=64, initializer_range=0.2, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16,
    )  # fmt: skip
    model = tf.BambaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    ids = hfmodels.prompt(40)
    with torch.no_grad():
        skt.capture(client, model, prefilled(model, ids[:20]), tokens=ids[:20], namespace=namespace)
        restored = skt.restore(client, model, tokens=ids, namespace=namespace)
        assert restored is not None and restored[1] == 20
        logits, _ = skt.prefill(model, ids[20:], cache=restored[0])
        full = model(input_ids=ids[None]).logits[0, 20:]
    assert max_diff(logits[0], full) <= 1e-4
    assert torch.equal(logits[0].argmax(-1), full.argmax(-1))
