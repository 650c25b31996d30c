"""A stage run as OS processes beside the rest of the pipeline in-process, with timing
short enough that losing one is noticed within seconds: for tests that kill processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import Stack, make_settings, start_stack, wait_engines
from tests.test_cli import free_port, logged, spawn, stop

ITL = 0.01  # engine seconds per token
STAGES = ["ingress", "render", "schedule", "derender", "sim"]
# How soon each kind of loss is noticed: a request moves on after its ack wait, an engine
# leaves the registry after its TTL, a derender call is retried after its timeout.
TIMING = {"ack_wait": 2.0, "engine_ttl": 1.0, "derender_timeout": 1.0, "sim_itl": ITL}
ENV = {f"TOKENWAY_{k.upper()}": str(v) for k, v in TIMING.items()}
# What a stage process logs once it serves.
READY = {"engine": b"serving", "schedule": b"owning", "derender": b"derender serving",
         "render": b"render serving", "ingress": b"listening on"}  # fmt: skip


@dataclass
class StageProcesses:
    """The in-process stack, the stage processes beside it, and where clients connect."""

    stack: Stack
    tmp: Path
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    url: str = ""  # where the clients connect

    async def spawn(self, stage: str, *extra: str) -> asyncio.subprocess.Process:
        args = ["engine", "sim"] if stage == "engine" else [stage]
        proc = await spawn(  # as its role, with the env file `up` writes for it
            *args, "--data-dir", str(self.tmp), "--served-model-name", self.stack.model, *extra,
            env={**ENV, **self.stack.bus.env(stage)},
        )  # fmt: skip
        self.procs.append(proc)
        await logged(proc, READY[stage])
        return proc


@contextlib.asynccontextmanager
async def stage_processes(
    nats_url: str, tmp: Path, stage: str, processes: int
) -> AsyncIterator[StageProcesses]:
    model = f"{stage}-procs-{tmp.name}"
    # Derender processes only matter to owners that call the pool.
    pool = {"derender_placement": "pool"} if stage == "derender" else {}
    settings = make_settings(tmp, served_model_name=model, request_timeout=20.0, **TIMING, **pool)
    # The faulted stage runs as processes only; the clients' ingress also runs in-process.
    absent = {"engine": "sim", "ingress": ""}.get(stage, stage)
    names = [s for s in STAGES if s != absent]
    stack = await start_stack(nats_url, settings, names)
    c = StageProcesses(stack, tmp, url=stack.url)
    try:
        if stage == "ingress":  # the clients' ingress: the one that will die
            for _ in range(processes):
                port = free_port()
                await c.spawn(stage, "--port", str(port))
                c.url = f"http://127.0.0.1:{port}"
        else:  # side by side: each takes seconds to load
            await asyncio.gather(*(c.spawn(stage) for _ in range(processes)))
        if stage == "engine":
            await wait_engines(stack.ingress.registry, processes)
        yield c
    finally:
        for proc in c.procs:
            await stop(proc, signal.SIGKILL)
        await stack.close()
