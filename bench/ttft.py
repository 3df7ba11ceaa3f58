"""Time to first token on the CPU: a restored prefix from skippyd vs a full prefill, one run.

    python -m bench.ttft [--sizes 1024,4096,8192] [--new-tokens 1,32] [--reps 5] [--write-docs]

Two transformers models with seeded random weights, float32: an attention model (Llama-style, 8 layers,
hidden 512, 8 heads, 4 KV heads: 16 KiB of KV per token) and a hybrid (Zamba2: 4 Mamba2 layers and 4
layers holding both attention KV and a Mamba2 state, hidden 512). For each prefix length the request is
that prefix plus ``new`` tokens: 1 (an exact hit still computes the prompt's last token, whose logits
the cache does not hold) and 32 (a short new chat turn):

* full prefill: one forward over the whole prompt, logits of the last position, argmax;
* with skippyd: ``skt.restore`` (daemon lookup, zero-copy mapping of the entry, cache rebuilt), then a
  forward over the new tokens only on top of the restored cache, argmax.

Both columns come from this one run; the ratio is theirs. The first token of both paths is compared, and
the largest difference of their last logits is shown (float32 rounding of different kernels).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from bench._common import BenchDaemon, fmt_time, machine, median, table, write_section

MiB = 1 << 20
VOCAB = 32000


WHOLE = "whole-entries"  # the namespace the same prefixes are captured into as whole entries


def build(name: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    if name == "attention":
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16384,
        )  # fmt: skip
        llama: Any = tf.LlamaForCausalLM(cfg)
        return llama.eval()
    hybrid = tf.Zamba2Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        layers_block_type=["linear_attention", "hybrid"] * 4, num_attention_heads=8, num_key_value_heads=4,
        mamba_d_state=64, n_mamba_heads=16, mamba_ngroups=1, mamba_expand=2, chunk_size=256,
        num_mem_blocks=1, max_position_embeddings=16384,
    )  # fmt: skip
    zamba: Any = tf.Zamba2ForCausalLM(hybrid)
    return zamba.eval()


def _full(model: Any, prompt: torch.Tensor, runs: int) -> tuple[float, torch.Tensor]:
    times, logits = [], torch.empty(0)
    for _ in range(runs):
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=prompt[None], logits_to_keep=1).logits[0, -1]
        int(logits.argmax())
        times.append(time.perf_counter() - start)
    return median(times), logits


def _restored(
    model: Any, client: Any, prompt: torch.Tensor, size: int, reps: int, *, namespace: str = ""
) -> dict[str, Any]:
    from skippyd.integrations import transformers as skt

    restore_times, rest_times, ttft_times = [], [], []
    logits = torch.empty(0)
    for rep in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        hit = skt.restore(client, model, tokens=prompt, namespace=namespace)
        restored = time.perf_counter()
        assert hit is not None and hit[1] == size, "the prefix was not found"
        step, _ = skt.prefill(model, prompt[hit[1] :], cache=hit[0], logits_to_keep=1)
        int(step[0, -1].argmax())
        done = time.perf_counter()
        logits = step[0, -1]
        del hit, step
        if rep:
            restore_times.append(restored - start)
            rest_times.append(done - restored)
            ttft_times.append(done - start)
    return {
        "restore": median(restore_times), "rest": median(rest_times), "ttft": median(ttft_times),
        "logits": logits,
    }  # fmt: skip


def measure(name: str, client: Any, sizes: list[int], news: list[int], reps: int) -> list[dict[str, Any]]:
    from skippyd.integrations import transformers as skt

    model = build(name)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 64), generator=gen), logits_to_keep=1)  # warm-up
    results = []
    for size in sizes:
        base = torch.randint(0, VOCAB, (size + max(news),), generator=gen)
        _, cache = skt.prefill(model, base[:size], logits_to_keep=1)  # the earlier turn, then stored
        start = time.perf_counter()
        captured = skt.capture(client, model, cache, tokens=base[:size], durable=False)
        capture_s = time.perf_counter() - start
        # the same prefix as one whole entry (block_tokens=0), restored side by side in this run
        skt.capture(client, model, cache, tokens=base[:size], durable=False, namespace=WHOLE, block_tokens=0)
        del cache
        for new in news:
            prompt = base[: size + new]
            full_s, full_logits = _full(model, prompt, max(1, min(3, 4096 // size)))
            r = _restored(model, client, prompt, size, reps)
            whole = _restored(model, client, prompt, size, reps, namespace=WHOLE)
            assert torch.equal(whole.pop("logits"), r["logits"]), "blocks and whole entries differ"
            r["whole_ttft"] = whole["ttft"]
            logits = r.pop("logits")
            r.update(
                model=name, prefix=size, new=new, full=full_s, capture=capture_s, nbytes=captured.nbytes,
                block_bytes=captured.blocks_nbytes,
                same_first=int(logits.argmax()) == int(full_logits.argmax()),
                diff=float((logits - full_logits).abs().max()),
            )  # fmt: skip
            results.append(r)
            print(
                f"  {name} {size}+{new}: full {fmt_time(full_s)}, restored {fmt_time(r['ttft'])} "
                f"({full_s / r['ttft']:.0f}×)",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1024,4096,8192", help="prefix lengths in tokens")
    parser.add_argument("--new-tokens", default="1,32", help="tokens after the prefix (a list)")
    parser.add_argument("--reps", type=int, default=5, help="timed restores per point (median)")
    parser.add_argument(
        "--hybrid-max", type=int, default=8192, help="longest prefix to run the (slower) hybrid on"
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sizes = [int(s) for s in args.sizes.split(",")]
    news = [int(s) for s in args.new_tokens.split(",")]

    import transformers

    import skippyd

    workdir = Path(tempfile.mkdtemp(prefix="skb-", dir="/tmp"))
    results: list[dict[str, Any]] = []
    skipped = [s for s in sizes if s > args.hybrid_max]
    try:
        daemon = BenchDaemon(workdir).start()
        try:
            with skippyd.Client(daemon.socket, timeout=120) as client:
                for name, todo in (
                    ("attention", sizes),
                    ("hybrid", [s for s in sizes if s <= args.hybrid_max]),
                ):
                    results += measure(name, client, todo, news, args.reps)
        finally:
            daemon.cleanup()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [
        [
            "Llama-style, 8 layers" if r["model"] == "attention" else "Zamba2 hybrid, 8 layers",
            f"{r['prefix']:,}",
            str(r["new"]),
            fmt_time(r["full"]),
            fmt_time(r["restore"]),
            fmt_time(r["rest"]),
            fmt_time(r["ttft"]),
            f"{r['full'] / r['ttft']:.0f}×",
            f"{fmt_time(r['whole_ttft'])} ({r['full'] / r['whole_ttft']:.0f}×)",
            f"{r['block_bytes'] / MiB:.1f} + {r['nbytes'] / MiB:.1f} MiB",
            fmt_time(r["capture"]),
            "yes" if r["same_first"] else "NO",
            f"{r['diff']:.1e}",
        ]
        for r in results
    ]
    headers = ["model", "prefix", "new", "full prefill", "restore", "new-token prefill",
               "TTFT restored", "speedup", "whole entry: TTFT (speedup)",
               "blocks + entry", "capture", "same 1st token", "max |Δ logit|"]  # fmt: skip
    lines = [table(headers, rows)]
    for r in results:
        if r["model"] != "attention" or r["prefix"] != 4096:
            continue
        ratio = r["full"] / r["ttft"]
        verdict = "met" if ratio >= 50 else "NOT met"
        lines.append(
            f"Attention model, 4,096-token restored prefix + {r['new']} new token(s): TTFT "
            f"{fmt_time(r['ttft'])} vs {fmt_time(r['full'])} for the full prefill, {ratio:.0f}× lower "
            f"(target ≥ 50×: {verdict}); from one whole entry {fmt_time(r['whole_ttft'])}, "
            f"{r['full'] / r['whole_ttft']:.0f}×."
        )
    if skipped:
        lines.append(
            f"The hybrid was not run at {', '.join(f'{s:,}' for s in skipped)} tokens (--hybrid-max "
            f"{args.hybrid_max}): its full prefill is too slow on this CPU."
        )
    text = "\n\n".join(lines)
    header = (
        f"Machine: {machine()}. `python -m bench.ttft`, one run; transformers {transformers.__version__}, "
        f"torch {torch.__version__}, float32, {torch.get_num_threads()} threads. Each request is the "
        "prefix plus `new` tokens (the prompt's last token at least is always computed); full prefill: "
        f"median of up to 3 runs, restored: median of {args.reps} after a warm-up "
        "(restore = daemon lookup + zero-copy mapping + cache rebuild; "
        "new-token prefill = forward over the new tokens on the restored cache)."
    )
    print(header + "\n\n" + text)
    if args.write_docs:
        write_section("ttft", header + "\n\n" + text)


if __name__ == "__main__":
    main()
