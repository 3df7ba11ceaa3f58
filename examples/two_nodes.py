"""Two skippyd nodes sharing one Redis, and a tiny head that places each chat turn on the warm node.

    python examples/two_nodes.py [--conversations 4] [--turns 3]

Needs ``redis-server`` on the PATH and transformers 5.x beside skippyd and torch: ``scripts/setup.sh
--dev`` installs both (then run ``.venv/bin/python examples/two_nodes.py``), or ``apt-get install
redis-server`` and ``pip install -e '.[transformers]'`` with ``torch==2.13.0`` in your own environment.

Starts a private ``redis-server`` on a unix socket in a temporary directory and two daemons,
``node-a`` and ``node-b``, each with ``--redis-url <that redis> --node <name>`` (and its own socket, L2
and state directory, as two hosts would have). The head asks the cluster's warm-prefix table
(``skippyd.WarmTable.from_url(url).warmest(model, tokens)``) which live node last ran the longest prefix
of the turn's prompt and sends the turn there; with no warm prefix (at least two 64-token blocks) it
picks the least-loaded node (fewest tokens prefilled so far). The "engine" of a node is a small
transformers model: it restores what its own daemon holds, prefills the rest, captures the prompt's
cache, and tells its daemon ``ran(model, tokens)``; the daemon feeds the warm table in batches, so the
head polls ``warmest`` briefly until the table knows. The daemons run ``--no-warm-on-capture``, so the
table learns only from ``ran``.

At the end ``node-b`` stops; once its heartbeats have expired, the turns that were warm on it go to
``node-a`` (and prefill in full there: its cache lived on the other host).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

import skippyd
from skippyd.cluster.redis_embedded import EmbeddedRedis
from skippyd.integrations import transformers as skt

VOCAB = 32000
NODES = ("node-a", "node-b")


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """The shared Redis: a private redis-server on a unix socket (skippyd's embedded one, AOF off)."""
    server = EmbeddedRedis(workdir, appendonly=False)
    try:
        yield server.start()
    finally:
        server.stop()


@dataclass
class Node:
    name: str
    socket: Path
    shm: Path
    proc: subprocess.Popen[bytes]
    client: skippyd.Client | None = None
    prefilled: int = 0  # the head's load measure

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        shutil.rmtree(self.shm, ignore_errors=True)


def start_node(name: str, workdir: Path, redis_url: str) -> Node:
    root = workdir / name
    root.mkdir()
    sock = root / "d.sock"
    shm = Path(tempfile.mkdtemp(prefix=f"skippyd-{name}-", dir="/dev/shm"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippyd", "serve", "--socket", str(sock), "--state-dir", str(root / "state"),
         "--shm-dir", str(shm), "--l2-budget", "256MiB", "--redis-url", redis_url, "--node", name,
         "--heartbeat", "500ms", "--node-ttl", "2s", "--no-warm-on-capture", "--log-level", "warning"],
    )  # fmt: skip
    node = Node(name, sock, shm, proc)
    deadline = time.monotonic() + 30
    while not (sock.exists() and skippyd.Client(sock, timeout=2).ping()):
        if time.monotonic() > deadline or proc.poll() is not None:
            node.stop()
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.05)
    node.client = skippyd.Client(sock, timeout=60)
    return node


def build() -> Any:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    )  # fmt: skip
    model: Any = tf.LlamaForCausalLM(cfg)
    return model.eval()


def run_turn(model: Any, node: Node, prompt: list[int], reply_tokens: int) -> tuple[int, float, list[int]]:
    """One turn on ``node``'s engine: restore, prefill the rest, capture, decode; (restored, TTFT, reply)."""
    assert node.client is not None
    start = time.perf_counter()
    cache, restored = None, 0
    hit = skt.restore(node.client, model, tokens=prompt[:-1])
    if hit is not None:
        cache, restored = hit
    logits, cache = skt.prefill(model, prompt[restored:], cache=cache, logits_to_keep=1)
    reply = [int(logits[0, -1].argmax())]
    ttft = time.perf_counter() - start
    node.prefilled += len(prompt) - restored
    skt.capture(node.client, model, cache, tokens=prompt, durable=False)
    while len(reply) < reply_tokens:
        logits, cache = skt.prefill(model, [reply[-1]], cache=cache, logits_to_keep=1)
        reply.append(int(logits[0, -1].argmax()))
    return restored, ttft, reply


def place(
    table: skippyd.WarmTable, nodes: dict[str, Node], model_id: str, prompt: list[int]
) -> tuple[Node, str]:
    warm = table.warmest(model_id, prompt)
    if warm is not None and warm[0] in nodes:
        return nodes[warm[0]], f"warm: it ran the first {warm[1]} tokens (whole 64-token blocks)"
    loads = ", ".join(f"{n.name} {n.prefilled:,}" for n in nodes.values())
    node = min(nodes.values(), key=lambda n: (n.prefilled, n.name))
    why = "no live node ran 2+ blocks of it" if warm is None else f"warm node {warm[0]} is gone"
    return node, f"{why}: least loaded (tokens prefilled: {loads})"


def wait_warm(
    table: skippyd.WarmTable, model_id: str, prompt: list[int], node: str, limit: float = 5.0
) -> float:
    """Seconds until the warm table names ``node`` for ``prompt`` (the daemon sends ``ran`` in batches)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        warm = table.warmest(model_id, prompt)
        if warm is not None and warm[0] == node:
            return time.monotonic() - start
        time.sleep(0.02)
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    model = build()
    model_id = skt.profile(model).model_id
    gen = torch.Generator().manual_seed(3)

    def message() -> list[int]:
        return torch.randint(
            0, VOCAB, (int(torch.randint(150, 260, (1,), generator=gen)),), generator=gen
        ).tolist()

    histories = [message() for _ in range(args.conversations)]  # each conversation's opening context
    workdir = Path(tempfile.mkdtemp(prefix="sk-2n-", dir="/tmp"))
    nodes: dict[str, Node] = {}
    try:
        with redis_server(workdir) as url:
            for name in NODES:
                nodes[name] = start_node(name, workdir, url)
            table = skippyd.WarmTable.from_url(url)
            print(f"redis {url}; nodes {', '.join(NODES)}; model {model_id}\n")
            print(f"{'turn':>4} {'conv':>4} {'prompt':>6}  {'node':6}  {'restored':>8} {'TTFT':>9}  "
                  f"{'table lag':>9}  why")  # fmt: skip

            def play(turn: int, live: dict[str, Node]) -> None:
                for c in range(args.conversations):
                    prompt = histories[c] + message()
                    node, why = place(table, live, model_id, prompt)
                    restored, ttft, reply = run_turn(model, node, prompt, args.reply_tokens)
                    assert node.client is not None
                    node.client.ran(model=model_id, tokens=prompt)
                    lag = wait_warm(table, model_id, prompt, node.name)
                    print(f"{turn:>4} {c + 1:>4} {len(prompt):>6}  {node.name:6}  {restored:>8} "
                          f"{ttft * 1e3:>7.1f}ms  {lag * 1e3:>7.0f}ms  {why}")  # fmt: skip
                    histories[c] = prompt + reply

            for turn in range(1, args.turns + 1):
                play(turn, nodes)

            print("\nstopping node-b; waiting for its heartbeats to expire ...")
            nodes["node-b"].stop()
            deadline = time.monotonic() + 15
            while any(n.node == "node-b" for n in table.nodes()) and time.monotonic() < deadline:
                time.sleep(0.1)
            print(f"live nodes: {', '.join(n.node for n in table.nodes())}\n")
            play(args.turns + 1, {"node-a": nodes["node-a"]})
            table.close()
    finally:
        for node in nodes.values():
            node.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
