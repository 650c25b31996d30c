"""The real-vLLM tier: a vLLM server on a tiny random-weight model, and tokenway in front of it.

`.ci/vllm-tier` builds a venv with vLLM and the tiny model, then runs
`python -m pytest -m vllm tests/vllm` with:

- `TOKENWAY_TEST_VLLM_PYTHON`: the vLLM venv's python (vLLM never loads into this process);
- `TOKENWAY_TEST_VLLM_MODEL`: the tiny model directory (`tests/vllm/make_tiny_model.py`);
- `TOKENWAY_TEST_VLLM_LOG` (optional): where the server's output goes;
- `TOKENWAY_TEST_VLLM_QWEN_MODEL` (optional): a Qwen3.6 model directory with Qwen's real
  tokenizer (`tests/vllm/make_qwen_model.py`; test_qwen_family.py builds it when unset);
- `TOKENWAY_TEST_VLLM_GPTOSS_MODEL` (optional): a gpt-oss model directory with gpt-oss's
  tokenizer, rebuilt from the harmony package vLLM installs (`tests/vllm/make_gptoss_model.py`).

Without the first two, every test marked `vllm` is skipped and nothing is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from bench.vllm_serve import VllmServer, free_port, launched, server_command
from tests.conftest import Bus, Stack, make_settings, provisioned_bus, start_stack, wait_engines

PYTHON_ENV = "TOKENWAY_TEST_VLLM_PYTHON"
MODEL_ENV = "TOKENWAY_TEST_VLLM_MODEL"
LOG_ENV = "TOKENWAY_TEST_VLLM_LOG"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 32768  # the tiny model's positions: a long request takes minutes here
TOOL_PARSER = "deepseek_v31"  # the tiny model has DeepSeek's tokenizer
TOOL_PARSING = ["--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER]
REASONING_PARSER = "deepseek_v3"  # reasoning where the template's `thinking` is on
# The parser, and the markers a `thinking_token_budget` ends reasoning with (vLLM takes a
# budget only with both; deepseek_v3 names no markers until a request turns thinking on).
REASONING = [
    "--reasoning-parser", REASONING_PARSER,
    "--reasoning-config", '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}',
]  # fmt: skip


def _configured() -> tuple[Path, Path] | None:
    python, model = os.environ.get(PYTHON_ENV), os.environ.get(MODEL_ENV)
    if not python or not model:
        return None
    return Path(python), Path(model)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _configured() is not None:
        return
    skip = pytest.mark.skip(
        reason=f"no real vLLM: {PYTHON_ENV} and {MODEL_ENV} are unset (.ci/vllm-tier sets them)"
    )
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


# A model builder's (make_*_model.py) exit status when the package it reads is not installed,
# and how long a build may take.
NO_PACKAGE = 3
BUILD_TIMEOUT = 600


def built_model(env: str, builder: Path) -> Path:
    """A model directory the tier builds: `$env` (`.ci/vllm-tier` exports it), else `builder`
    run with the vLLM venv's python into the tier's cache; a skip without the package."""
    configured = os.environ.get(env)
    if configured:
        return Path(configured)
    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(f"no real vLLM: {PYTHON_ENV} is unset")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenway"
    built = subprocess.run(
        [python, str(builder), "--models-dir", str(cache / "models")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if built.returncode == NO_PACKAGE:
        pytest.skip(f"no model directory from {builder.name}: {built.stderr.strip()}")
    assert built.returncode == 0, built.stderr
    return Path(built.stdout.strip().splitlines()[-1])


def _log_path(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    configured = os.environ.get(LOG_ENV)
    if configured:
        return Path(configured).with_name(f"{Path(configured).stem}-{name}.log")
    return tmp_path_factory.mktemp("vllm") / f"{name}.log"


def _require_vllm() -> tuple[Path, Path]:
    configured = _configured()
    if configured is None:
        pytest.skip(f"no real vLLM: {PYTHON_ENV} and {MODEL_ENV} are unset")
    return configured


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """`python -m vllm.entrypoints.openai.api_server --enable-scale-out` on the tiny model,
    with the tool and reasoning parsers tokenway's stack is given (`TOOL_PARSING`,
    `REASONING`): both hold tool calls to its structural tag and parse alike. It yields the
    CPU to this process (tokenway's stages, the tests' clients): on two cores vLLM's CPU
    engine starved them for a minute while it streamed on, and a client never saw its first
    chunk."""
    python, model = _require_vllm()
    port = free_port()
    log = Path(os.environ.get(LOG_ENV) or tmp_path_factory.mktemp("vllm") / "server.log")
    command = server_command(python, model, port, SERVED_NAME, MAX_MODEL_LEN, True)
    command += TOOL_PARSING + REASONING
    with launched(command, port, model, log, yield_cpu=True) as server:
        yield server


@contextlib.contextmanager
def render_server(
    tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str, model: Path | None = None
) -> Iterator[VllmServer]:
    """vLLM's GPU-less render server (`vllm launch render`) on the tiny model (or `model`),
    with `flags`."""
    python, tiny = _require_vllm()
    model = model or tiny
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.launchers.render.entry",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1",
        "--port", str(port),
        *flags,
    ]  # fmt: skip
    with launched(command, port, model, _log_path(tmp_path_factory, name), yield_cpu=True) as s:
        yield s


@pytest.fixture(scope="session")
def vllm_render_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The render server with the parsers tokenway's tier stack is given."""
    with render_server(tmp_path_factory, "render", *TOOL_PARSING, *REASONING) as server:
        yield server


@dataclass
class VllmStack:
    """tokenway's stages in front of the real engine: the stack and the bridges that feed it."""

    stack: Stack
    bridges: list
    server: VllmServer

    @property
    def url(self) -> str:
        return self.stack.url


# Not the suite's 3 s: here a CPU-bound vLLM shares two cores with NATS and every stage,
# and a heartbeat late by seconds would fail requests as "engine gone". The registry keeps
# the TTL its bucket was provisioned with, so the tier has a bus of its own.
ENGINE_TTL = 15.0


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_bus(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bus]:
    async with provisioned_bus(tmp_path_factory.mktemp("vllm-bus"), engine_ttl=ENGINE_TTL) as b:
        yield b


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_stack(
    vllm_bus: Bus, vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmStack]:
    """ingress, render, schedule, derender and a `VllmEngine` bridge, serving `tiny`."""
    from engines.bridge import Bridge
    from engines.vllm_http import vllm_engines

    settings = make_settings(
        tmp_path_factory.mktemp("vllm-data"),
        model_dir=str(vllm_server.model_dir),
        served_model_name=SERVED_NAME,
        tool_call_parser=TOOL_PARSER,
        enable_auto_tool_choice=True,
        reasoning_parser=REASONING_PARSER,
        vllm_url=vllm_server.url,
        engine_id="vllm-tier",
        engine_ttl=ENGINE_TTL,
    )
    stack = await start_stack(
        vllm_bus.observer, settings, ["ingress", "render", "schedule", "derender"]
    )
    engines = vllm_engines(stack.settings, [SERVED_NAME])
    bridges = [Bridge(stack.role("engine"), engine) for engine in engines]
    stop = asyncio.Event()
    runs = [asyncio.create_task(b.run(stack.settings.nats, stop), name=b.id) for b in bridges]
    try:
        await wait_engines(stack.ingress.registry, len(bridges))
        yield VllmStack(stack=stack, bridges=bridges, server=vllm_server)
    finally:
        stop.set()
        await asyncio.gather(*runs)
        for engine in engines:
            await engine.aclose()
        await stack.close()
