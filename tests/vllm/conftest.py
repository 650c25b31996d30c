"""The real-vLLM tier: a vLLM server on a tiny random-weight model, and tokenway in front of it.

`.ci/vllm-tier` builds a venv with vLLM and the tiny model, then runs
`python -m pytest -m vllm tests/vllm` with:

- `TOKENWAY_TEST_VLLM_PYTHON`: the vLLM venv's python (vLLM never loads into this process);
- `TOKENWAY_TEST_VLLM_MODEL`: the tiny model directory (`tests/vllm/make_tiny_model.py`);
- `TOKENWAY_TEST_VLLM_LOG` (optional): where the server's output goes.

Without the first two, every test marked `vllm` is skipped and nothing is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.conftest import Stack, make_settings, start_stack, wait_engines

PYTHON_ENV = "TOKENWAY_TEST_VLLM_PYTHON"
MODEL_ENV = "TOKENWAY_TEST_VLLM_MODEL"
LOG_ENV = "TOKENWAY_TEST_VLLM_LOG"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 32768  # the tiny model's positions: a long request takes minutes here
START_TIMEOUT = 300.0  # seen here: ready in about 55 s
STOP_TIMEOUT = 20.0
# The tiny model's KV cache needs little; a fixed size also skips vLLM's check that a share
# of the NUMA node's memory is free, which a busy CI machine can fail.
KV_CACHE_BYTES = 256 << 20
_PR_SET_PDEATHSIG = 1


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


@dataclass(frozen=True)
class VllmServer:
    url: str
    model_dir: Path
    log: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(python: Path, model: Path, port: int) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--enable-scale-out",
        "--host", "127.0.0.1",
        "--port", str(port),
        # Deterministic at temperature 0 whoever asks: float32 (no bf16 rounding between
        # batch shapes), no prefix cache (a cached prefix changes the prefill's shape).
        "--dtype", "float32",
        "--no-enable-prefix-caching",
        "--seed", "0",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        # Each request's arrival and abort in the log: the engine's side of what happened.
        "--enable-log-requests",
    ]  # fmt: skip


def _server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def _die_with_parent() -> None:
    """In the server's process: get SIGTERM when pytest dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_ready(server: VllmServer) -> None:
    """Until `/health` answers 200, the process dies, or START_TIMEOUT passes."""
    deadline = time.monotonic() + START_TIMEOUT
    with httpx.Client(base_url=server.url, timeout=2.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {server.process.returncode} before it was ready; "
                    f"{server.log}:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if http.get("/health").status_code == 200:
                    return
            time.sleep(0.5)  # an external process: nothing to wait on but its port
    raise RuntimeError(f"vLLM not ready after {START_TIMEOUT}s; {server.log}:\n{server.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (API server, engine core, worker), then SIGKILL."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def _launched(command: list[str], port: int, model: Path, log: Path) -> Iterator[VllmServer]:
    """A vLLM process in its own process group, from ready until stopped."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_server_env(),
            start_new_session=True,  # its own process group, stopped as one
            preexec_fn=_die_with_parent,  # a killed pytest leaves no vLLM behind
        )
    server = VllmServer(url=f"http://127.0.0.1:{port}", model_dir=model, log=log, process=process)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(process)


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
    """`python -m vllm.entrypoints.openai.api_server --enable-scale-out` on the tiny model."""
    python, model = _require_vllm()
    port = _free_port()
    log = Path(os.environ.get(LOG_ENV) or tmp_path_factory.mktemp("vllm") / "server.log")
    with _launched(_server_command(python, model, port), port, model, log) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_render_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM's GPU-less render server (`vllm launch render`) on the tiny model."""
    python, model = _require_vllm()
    port = _free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.launchers.render.entry",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    log = _log_path(tmp_path_factory, "render")
    with _launched(command, port, model, log) as server:
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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_stack(
    nats_url: str, vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmStack]:
    """ingress, render, schedule, derender and a `VllmEngine` bridge, serving `tiny`."""
    from engines.bridge import Bridge
    from engines.vllm_http import vllm_engines

    settings = make_settings(
        tmp_path_factory.mktemp("vllm-data"),
        model_dir=str(vllm_server.model_dir),
        served_model_name=SERVED_NAME,
        vllm_url=vllm_server.url,
        engine_id="vllm-tier",
        # Not the suite's 3 s: here a CPU-bound vLLM shares two cores with NATS and every
        # stage, and a heartbeat late by seconds would fail requests as "engine gone".
        engine_ttl=15.0,
    )
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "derender"])
    engines = vllm_engines(stack.settings, SERVED_NAME)
    bridges = [Bridge(stack.settings, engine) for engine in engines]
    stop = asyncio.Event()
    runs = [asyncio.create_task(b.run(nats_url, stop), name=b.id) for b in bridges]
    try:
        await wait_engines(stack.ingress.registry, len(bridges))
        yield VllmStack(stack=stack, bridges=bridges, server=vllm_server)
    finally:
        stop.set()
        await asyncio.gather(*runs)
        for engine in engines:
            await engine.aclose()
        await stack.close()
