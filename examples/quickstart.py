"""The README's first steps: capture one prompt prefix into the daemon and restore it.

Run it against a daemon started by ``scripts/run.sh`` (in the checkout: the client finds it through
``./.skippyd``), or set ``SKIPPYD_SOCKET``:

    .venv/bin/python examples/quickstart.py

Needs only skippyd and torch (``scripts/setup.sh`` installs both into ``.venv``).
"""

from __future__ import annotations

import torch

import skippyd


def main() -> None:
    with skippyd.Client() as client:
        tokens = list(range(1000))  # the prompt's token ids
        kv = {"k": torch.randn(8, 1000, 64), "v": torch.randn(8, 1000, 64, dtype=torch.bfloat16)}
        result = client.capture(model="demo-model", state="kv-bf16-v1", tokens=tokens, tensors=kv)
        print(f"captured {result.nbytes} bytes under {result.digest[:16]} (durable: {result.durability})")

        hit = client.restore(model="demo-model", state="kv-bf16-v1", tokens=[*tokens, 42, 43])
        assert hit is not None and torch.equal(hit.tensors["k"], kv["k"])
        print(f"restored {hit.token_count} tokens from {hit.source} in {hit.timings['total_ms']:.2f} ms")


if __name__ == "__main__":
    main()
