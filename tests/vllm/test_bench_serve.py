"""vLLM's own load generator, `vllm bench serve`, runs clean against tokenway in front of the
real engine, on chat and on completions: every request completes with the tokens it asked for.
It reads SSE as vLLM frames it, `data:` events only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import vllm_serve
from tests.vllm.conftest import PYTHON_ENV, SERVED_NAME, VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(420)]


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
async def test_vllm_bench_serve_runs_clean_against_tokenway(
    vllm_stack: VllmStack, backend: str
) -> None:
    load = vllm_serve.Load(backend=backend, num_prompts=12, concurrency=4, input_len=32,
                           output_len=16)  # fmt: skip
    result = await vllm_serve.run(
        Path(os.environ[PYTHON_ENV]), vllm_stack.url, SERVED_NAME, vllm_stack.server.model_dir,
        load, timeout=300,
    )  # fmt: skip
    assert result["failed"] == 0, [e for e in result["errors"] if e][:3]
    assert result["completed"] == load.num_prompts
    assert result["total_output_tokens"] == load.num_prompts * load.output_len
    assert result["median_ttft_ms"] > 0 and result["median_itl_ms"] > 0
