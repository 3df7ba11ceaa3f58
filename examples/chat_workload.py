"""A multi-turn chat workload on the CPU, run without and then with skippyd: TTFT per turn and hit rate.

    python examples/chat_workload.py [--socket PATH] [--model attention|hybrid]
                                     [--conversations 8] [--turns 4] [--reply-tokens 8]

Needs transformers 5.x beside skippyd and torch: ``scripts/setup.sh --dev`` installs it into ``.venv``
(then run ``.venv/bin/python examples/chat_workload.py``), or ``pip install -e '.[transformers]'``
together with ``torch==2.13.0`` (the CPU build) in your own environment.

Each conversation starts from a shared system prompt; every turn appends a user message of 120-250 tokens
to the history (previous prompts and assistant replies), so prompts grow turn by turn. The model is a
small transformers model with seeded random weights (no downloads), so token ids are random too.

* without skippyd: every turn prefills its whole prompt;
* with skippyd: every turn restores the longest captured prefix of its prompt from the daemon, prefills
  only the rest, and captures its prompt's cache for the next turn.

TTFT is the time from the prompt to the first generated token (restore included). Turn 1 always misses
(only whole captured prompts are found, and no conversation's first prompt was seen before), so its two
columns differ by noise only. The replies generated
in the second run are checked against the first (greedy decoding: they must be the same tokens). Without
``--socket`` the script starts its own daemon in a temporary directory (no Redis) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

import skippyd
from skippyd.integrations import transformers as skt

VOCAB = 32000


def build(name: str) -> Any:
    """A small model with seeded random weights: Llama-style attention, or a Zamba2 hybrid."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "attention":
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        )  # fmt: skip
        model: Any = tf.LlamaForCausalLM(cfg)
        return model.eval()
    hybrid = tf.Zamba2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        layers_block_type=["linear_attention", "hybrid"] * 2, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_state=32, n_mamba_heads=8, mamba_ngroups=1, mamba_expand=2, chunk_size=128,
        num_mem_blocks=1, max_position_embeddings=8192,
    )  # fmt: skip
    model = tf.Zamba2ForCausalLM(hybrid)
    return model.eval()


@contextmanager
def own_daemon() -> Iterator[Path]:
    """``python -m skippyd serve`` in a temporary directory, without Redis; yields its socket."""
    workdir = Path(tempfile.mkdtemp(prefix="sk-chat-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="skippyd-chat-", dir="/dev/shm"))
    sock = workdir / "d.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippyd", "serve", "--socket", str(sock),
         "--state-dir", str(workdir / "state"), "--shm-dir", str(shm), "--redis-url", "none",
         "--l2-budget", "1GiB", "--node", "chat-example", "--log-level", "warning"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (sock.exists() and skippyd.Client(sock, timeout=2).ping()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the daemon did not start")
            time.sleep(0.05)
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft: float
    restored: int = 0
    reply: list[int] = field(default_factory=list)


def generate(model: Any, cache: Any, first: int, count: int) -> list[int]:
    """Greedy decoding: ``count`` tokens starting with ``first`` (already chosen from the prompt)."""
    reply = [first]
    while len(reply) < count:
        logits, cache = skt.prefill(model, [reply[-1]], cache=cache, logits_to_keep=1)
        reply.append(int(logits[0, -1].argmax()))
    return reply


def run(
    model: Any,
    client: skippyd.Client | None,
    *,
    scripts: list[list[list[int]]],
    system: list[int],
    reply_tokens: int,
    namespace: str,
    replies: dict[tuple[int, int], list[int]] | None,
) -> list[Turn]:
    """Plays every conversation turn by turn (turn-major, as concurrent users would arrive)."""
    histories = [list(system) for _ in scripts]
    turns: list[Turn] = []
    for t in range(len(scripts[0])):
        for c, script in enumerate(scripts):
            prompt = histories[c] + script[t]
            start = time.perf_counter()
            cache, restored = None, 0
            if client is not None:
                # The prompt's last token is always computed: its logits give the first reply token.
                hit = skt.restore(client, model, tokens=prompt[:-1], namespace=namespace)
                if hit is not None:
                    cache, restored = hit
            logits, cache = skt.prefill(model, prompt[restored:], cache=cache, logits_to_keep=1)
            first = int(logits[0, -1].argmax())
            ttft = time.perf_counter() - start
            if client is not None:  # an engine would do this off the critical path
                skt.capture(client, model, cache, tokens=prompt, namespace=namespace, durable=False)
            reply = generate(model, cache, first, reply_tokens)
            turns.append(Turn(c, t, len(prompt), ttft, restored, reply))
            # Both runs continue with the first run's replies, so their prompts are the same tokens.
            histories[c] = prompt + (replies[(c, t)] if replies is not None else reply)
    return turns


def render(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(out)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--socket", help="a running daemon's socket (default: start one here)")
    parser.add_argument("--model", choices=["attention", "hybrid"], default="attention")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--namespace", help="default: a fresh one, so earlier runs give no hits")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    model = build(args.model)
    gen = torch.Generator().manual_seed(42)
    system = torch.randint(0, VOCAB, (args.system_tokens,), generator=gen).tolist()
    scripts = [
        [
            torch.randint(
                0, VOCAB, (int(torch.randint(120, 251, (1,), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(args.turns)
        ]
        for _ in range(args.conversations)
    ]
    namespace = args.namespace or f"chat-{uuid.uuid4().hex[:12]}"
    # Warm-up (the first calls into torch and each kernel path are slow): a full-size prefill, a decode step.
    _, warm = skt.prefill(model, system + scripts[0][0], logits_to_keep=1)
    skt.prefill(model, system[:1], cache=warm, logits_to_keep=1)

    print(
        f"model: {args.model} ({type(model).__name__}, {skt.profile(model).kind}), {args.conversations} "
        f"conversations x {args.turns} turns, {args.reply_tokens}-token replies"
    )
    common: dict[str, Any] = {
        "scripts": scripts, "system": system, "reply_tokens": args.reply_tokens, "namespace": namespace,
    }  # fmt: skip
    baseline = run(model, None, replies=None, **common)
    replies = {(t.conversation, t.turn): t.reply for t in baseline}

    with own_daemon() if args.socket is None else _given(Path(args.socket)) as sock:
        print(f"daemon: {sock}, namespace {namespace}")
        with skippyd.Client(sock, timeout=60) as client:
            cached = run(model, client, replies=replies, **common)

    rows = []
    for t in range(args.turns):
        base = [x for x in baseline if x.turn == t]
        ours = [x for x in cached if x.turn == t]
        b, o = statistics.median(x.ttft for x in base), statistics.median(x.ttft for x in ours)
        mean_prompt = statistics.mean(x.prompt_tokens for x in ours)
        rows.append([
            str(t + 1), f"{mean_prompt:.0f}", ms(b), ms(o), f"{b / o:.1f}x",
            f"{sum(x.restored > 0 for x in ours)}/{len(ours)}",
            f"{sum(x.restored for x in ours) / sum(x.prompt_tokens for x in ours):.0%}",
        ])  # fmt: skip
    print()
    print(render(["turn", "mean prompt", "TTFT without (median)", "TTFT with skippyd (median)",
                  "speedup", "hits", "tokens restored"], rows))  # fmt: skip
    hits = sum(x.restored > 0 for x in cached)
    restored = sum(x.restored for x in cached)
    total = sum(x.prompt_tokens for x in cached)
    same = sum(b.reply == o.reply for b, o in zip(baseline, cached, strict=True))
    print()
    print(f"hit rate: {hits}/{len(cached)} turns ({hits / len(cached):.0%}); "
          f"{restored:,} of {total:,} prompt tokens restored ({restored / total:.0%})")  # fmt: skip
    print(
        f"total TTFT: {sum(x.ttft for x in baseline):.2f} s without, {sum(x.ttft for x in cached):.2f} s with"
    )
    print(f"replies identical to the run without skippyd: {same}/{len(cached)}")


@contextmanager
def _given(sock: Path) -> Iterator[Path]:
    yield sock


if __name__ == "__main__":
    main()
