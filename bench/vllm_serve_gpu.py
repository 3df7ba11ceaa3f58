"""End to end on a GPU host: vLLM generating with SkippydTier behind its OffloadingConnector, one run.

    SKIPPYD_DAEMON_PYTHON=.venv/bin/python PYTHONPATH=. $(scripts/vllm-env.sh) -m bench.vllm_serve_gpu \\
        --model /path/to/a/small/model

A long prompt is generated once by a first vLLM engine (its prefix is offloaded to its CPU primary tier and
cascaded into skippyd), then the engine is shut down and a second one, with an empty GPU cache and an
empty primary tier, generates the same prompt: its prefix can only come from skippyd. The table shows the
time to the first token of each (one-token generations), the second engine's external hit, and whether
the greedy outputs are equal. Needs a CUDA device and the model on local disk (no download).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import BenchDaemon, fmt_time, machine, table, write_section


def _engine(model: str, socket: Path, cpu_bytes: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    tier = {"type": "SkippydTier", "module_path": "skippyd.integrations.vllm", "socket": str(socket)}
    return LLM(
        model=model,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.5,
        max_model_len=8192,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                "secondary_tiers": [tier],
            },
        ),
    )  # fmt: skip


def _ttft(llm: Any, prompt: str) -> tuple[float, str]:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    first = time.perf_counter() - start
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    return first, out[0].outputs[0].text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a local model directory (nothing is downloaded)")
    parser.add_argument("--prompt-words", type=int, default=3000)
    parser.add_argument("--cpu-bytes", type=int, default=2 << 30)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    try:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench.vllm_serve_gpu: no CUDA device here; it runs on a GPU host only")
    except ImportError:
        sys.exit("bench.vllm_serve_gpu: run it in vLLM's environment (scripts/vllm-env.sh)")
    if not Path(args.model).is_dir():
        sys.exit(f"bench.vllm_serve_gpu: {args.model} is not a local model directory")
    words = " ".join(f"item-{i % 97} of the long shared context," for i in range(args.prompt_words))
    prompt = f"{words}\nSummarise the list above in one sentence:"
    workdir = Path(tempfile.mkdtemp(prefix="skvg-", dir="/tmp"))
    daemon = BenchDaemon(workdir / "d", budget="8GiB").start()
    try:
        first = _engine(args.model, daemon.socket, args.cpu_bytes)
        cold, cold_text = _ttft(first, prompt)
        del first
        gc.collect()
        second = _engine(args.model, daemon.socket, args.cpu_bytes)  # empty GPU cache, empty primary tier
        warm, warm_text = _ttft(second, prompt)
        del second
    finally:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [
        ["first engine (nothing cached)", fmt_time(cold), "-"],
        ["second engine (prefix from skippyd)", fmt_time(warm), f"{cold / warm:.1f}×"],
    ]
    text = (
        f"`{Path(args.model).name}`, a {args.prompt_words * 7}-word prompt, one-token generation; outputs "
        f"{'equal' if cold_text == warm_text else 'DIFFERENT'}:\n\n"
        + table(["engine", "TTFT", "speedup"], rows)
    )
    print(text)
    if args.write_docs:
        write_section(
            "vllm_gpu", f"Machine: {machine()}. `python -m bench.vllm_serve_gpu`, one run.\n\n{text}"
        )


if __name__ == "__main__":
    main()
