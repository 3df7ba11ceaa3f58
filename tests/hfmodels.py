"""Small transformers models with seeded random weights (no downloads), shared by tests and a child process.

Run as a script it is the "restarted engine" of the fresh-process test: it builds each model from the same
seed, restores the prompt's prefix from the daemon, feeds the rest and saves the logits.

    python tests/hfmodels.py --socket S --models llama,mamba --tokens FILE --out DIR [--namespace NS]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

SEED = 1234
VOCAB = 512

# Random weights at the library's default scale (std 0.02) give near-uniform logits in which a lost
# prefix hardly shows; a larger scale makes every token of the prefix move the continuation's logits.
_INIT = 0.2


def _quiet() -> None:
    # transformers says once per kernel that it falls back to its PyTorch reference implementation
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")


def config(name: str, **overrides: Any) -> Any:
    """The config of test model ``name`` (``llama``, ``mamba``, ``zamba2`` or ``jamba``)."""
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "initializer_range": _INIT}
    if name == "llama":
        kw = {
            **common,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
        }
        return tf.LlamaConfig(**{**kw, **overrides})
    if name == "mamba":
        kw = {**common, "num_hidden_layers": 2, "state_size": 8}
        return tf.MambaConfig(**{**kw, **overrides})
    if name == "zamba2":
        layers = overrides.pop("num_hidden_layers", 4)
        kinds = (["linear_attention", "hybrid"] * layers)[:layers]
        kw = {
            **common,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "layers_block_type": kinds,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mamba_d_state": 8,
            "n_mamba_heads": 4,
            "mamba_ngroups": 1,
            "mamba_expand": 2,
            "chunk_size": 128,
            "num_mem_blocks": 1,
            "max_position_embeddings": 4096,
        }
        return tf.Zamba2Config(**{**kw, **overrides})
    if name == "jamba":
        kw = {
            **common,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 2,
            "mamba_d_state": 8,
            "mamba_expand": 2,
        }
        return tf.JambaConfig(**{**kw, **overrides})
    raise ValueError(f"unknown test model {name!r}")


def build(name: str, *, seed: int = SEED, **overrides: Any) -> Any:
    """Test model ``name`` in eval mode, float32, its weights drawn from ``seed``."""
    import transformers as tf

    _quiet()
    cfg = config(name, **overrides)
    classes = {
        "llama": tf.LlamaForCausalLM,
        "mamba": tf.MambaForCausalLM,
        "zamba2": tf.Zamba2ForCausalLM,
        "jamba": tf.JambaForCausalLM,
    }
    torch.manual_seed(seed)
    return classes[name](cfg).eval()


def fingerprint(model: Any) -> str:
    """A digest of every weight, to show two processes built the same model."""
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prompt(n: int, *, seed: int = 7) -> torch.Tensor:
    """``n`` random token ids (1-D, int64)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=gen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--models", required=True, help="comma-separated test model names")
    parser.add_argument("--tokens", required=True, help="torch.save'd 1-D token tensor: the whole prompt")
    parser.add_argument("--out", required=True, help="directory for each model's <name>.pt logits")
    parser.add_argument("--namespace", default="")
    args = parser.parse_args(argv)

    import skippyd
    from skippyd.integrations import transformers as skt

    tokens = torch.load(args.tokens)
    failed = 0
    with skippyd.Client(args.socket) as client:
        for name in args.models.split(","):
            model = build(name)
            report: dict[str, Any] = {"model": name, "fingerprint": fingerprint(model), "hit": False}
            hit = skt.restore(client, model, tokens=tokens, namespace=args.namespace)
            if hit is None:
                failed += 1
            else:
                cache, count = hit
                logits, _ = skt.prefill(model, tokens[count:], cache=cache)
                torch.save(logits, Path(args.out) / f"{name}.pt")
                report.update(hit=True, token_count=count, state=skt.state_id(model))
            print(json.dumps(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
