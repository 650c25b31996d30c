"""Fixtures: a real nats-server with JetStream, and the real stages wired to it in-process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest
import pytest_asyncio

from engines.sim import SimEngine
from program.stages import build_stages, serve
from tokenway import bus
from tokenway.client import Client
from tokenway.config import Settings
from tokenway.model import ModelInfo
from tokenway.nats_users import NatsUsers
from tokenway.natsd import EmbeddedNats
from tokenway.registry import EngineRegistry
from tokenway.served import served_models

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


# Tenants with a client user on the session's bus (`client-<tenant>`), as `up` makes one
# for each tenant its API keys name.
TENANTS = ("default", "acme", "rival", "batchco")


@dataclass(frozen=True)
class Bus:
    """Where a stack's stages connect, and as whom. A guarded bus lets in `up`'s role users
    only, plus the tests' observer, who may do everything (to watch the streams, and to
    cause the faults a test is about); an open one (no `users`) lets in anyone."""

    url: str  # where the roles connect: no credentials in it
    users: NatsUsers | None = None
    observer: str = ""  # `url` with the observer's credentials ("": `url`)
    natsd: EmbeddedNats | None = None  # the server, for a test that stops and starts it

    @property
    def watch(self) -> str:
        """Where a test's own connection goes: as the observer."""
        return self.observer or self.url

    def role(self, settings: Settings, name: str) -> Settings:
        """`settings` as a process of role `name` (a stage, `engine`, `ops`, `client-<tenant>`)
        has them on this bus."""
        settings = msgspec.structs.replace(settings, nats=self.url)
        return settings if self.users is None else self.users.settings(settings, name)

    def env(self, name: str) -> dict[str, str]:
        """The same for a process started as a command: its role's env file, as `up` writes
        it (`TOKENWAY_*`, the server's URL included)."""
        if self.users is None:
            return {"TOKENWAY_NATS": self.url}
        return env_file(self.users.directory / f"{name}.env")

    def client_options(self, tenant: str = "default") -> dict[str, object]:
        """`tokenway.client.Client.connect` keywords of a tenant's batch/RL job."""
        if self.users is None:
            return {}
        env = self.users.env(f"client-{tenant}")
        return {"tenant": tenant, "nkeys_seed": env["nats_nkey_file"],
                "inbox_prefix": env["nats_inbox_prefix"]}  # fmt: skip


def env_file(path: Path) -> dict[str, str]:
    """The variables of an env file (`NAME=value` lines, `#` comments), as a shell's
    `set -a; . FILE` loads them."""
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


# Each guarded server's Bus, by its URL and its observer's: a stack started on either runs
# every stage as its role, as `tokenway up` does (`start_stack`).
_buses: dict[str, Bus] = {}


@contextlib.asynccontextmanager
async def guarded_bus(tmp: Path, **server: object) -> AsyncIterator[Bus]:
    """A nats-server as `tokenway up` runs its own: the role users of `tokenway nats-auth`
    (with a client user per tenant of TENANTS), and an observer for the tests."""
    users = NatsUsers.prepare(tmp / "nats-auth", TENANTS)
    password = secrets.token_hex(16)
    everyone = [*users.authorization["users"], {"user": "observer", "password": password}]
    config = {"authorization": {"users": everyone}}
    async with nats_server(tmp / "jetstream", config=config, **server) as s:  # type: ignore[arg-type]
        users.write_env(s.url)
        observer = s.url.replace("nats://", f"nats://observer:{password}@", 1)
        guarded = _buses[s.url] = _buses[observer] = Bus(s.url, users, observer, s)
        try:
            yield guarded
        finally:
            del _buses[s.url], _buses[observer]


@contextlib.asynccontextmanager
async def provisioned_bus(tmp: Path, **settings: object) -> AsyncIterator[Bus]:
    """A guarded bus whose streams and buckets are provisioned with `settings` (as `up`
    does before any stage starts): what a bucket keeps, such as the engines' TTL, is the
    provisioner's choice."""
    async with guarded_bus(tmp / "nats") as b:
        provision = b.role(make_settings(tmp / "provision", **settings), "provision")
        nc = await bus.connect(b.url, "tokenway-provision", provision)
        await bus.provision_streams(nc.jetstream(), provision)
        await nc.close()
        yield b


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def session_bus(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bus]:
    """The session's bus, provisioned with the suite's settings."""
    async with provisioned_bus(tmp_path_factory.mktemp("session")) as b:
        yield b


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def nats_url(session_bus: Bus) -> str:
    """The session's bus as a test connects to it: as the observer. Stacks started on it run
    their stages as their roles."""
    return session_bus.observer


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
    bus: Bus
    by_name: dict[str, list] = field(default_factory=dict)

    def role(self, name: str) -> Settings:
        """This stack's settings as a process of role `name` has them."""
        return self.bus.role(self.settings, name)

    @property
    def observer(self) -> str:
        """Where a test's own connection to this stack's bus goes."""
        return self.bus.watch

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

    async def direct(self, tenant: str = "default", **options: Any) -> Client:
        """A tenant's batch/RL job on this stack's bus, let in as `up` lets one in: as the
        tenant's `client-<tenant>` user (`options`: `Client.connect`'s)."""
        return await Client.connect(self.settings.nats or "", self.model,
                                    **self.bus.client_options(tenant), **options)  # fmt: skip

    async def close(self) -> None:
        self.stop.set()
        await self.task


async def start_stack(
    nats: str,
    settings: Settings,
    names: list[str],
    users: NatsUsers | None = None,
    *,
    open_bus: bool = False,
) -> Stack:
    """Each stage connects as its role (and the provision role provisions), as under
    `tokenway up`: with `users`, or the users of a guarded bus (`nats` its URL or its
    observer's). `open_bus` runs them with the URL's own credentials instead (a test says
    why)."""
    bus = _buses.get(nats)
    if bus is None or open_bus:
        bus = Bus(nats, users)
    elif users is not None:
        bus = dataclasses.replace(bus, users=users)
    settings = msgspec.structs.replace(settings, nats=bus.url)
    stages = build_stages(settings, names, bus.users)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stages, stop, users=bus.users))
    stack = Stack(settings=settings, stages=stages, stop=stop, task=task, bus=bus)
    for stage in stages:
        stack.by_name.setdefault(stage.name, []).append(stage)
        if isinstance(getattr(stage, "engine", None), SimEngine):
            recording(stage.engine)
    if "ingress" in stack.by_name:
        started = asyncio.ensure_future(stack.ingress.started.wait())
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        if "sim" in names:
            await wait_engines(stack.ingress.registry, len(stack.by_name["engine"]))
    return stack


def keyed_settings(stack: Stack, folder: Path, keys: str, **overrides: object) -> Settings:
    """`stack`'s settings with the API keys `keys` (an --api-key-file's lines, written into
    `folder`) and `overrides`: for an ingress of tenants beside the session's pipeline."""
    key_file = folder / "keys"
    key_file.write_text(keys)
    return msgspec.structs.replace(stack.settings, api_key_file=str(key_file), **overrides)


@contextlib.asynccontextmanager
async def keyed_ingress(stack: Stack, folder: Path, keys: str) -> AsyncIterator[Stack]:
    """An ingress with the API keys `keys` on `stack`'s bus, in front of its pipeline."""
    settings = keyed_settings(stack, folder, keys)
    ingress = await start_stack(stack.settings.nats, settings, ["ingress"])
    try:
        yield ingress
    finally:
        await ingress.close()


def recording(engine: SimEngine) -> SimEngine:
    """`engine`, keeping every attempt's work it is sent (in `received`) for the test."""
    engine.received = []
    return engine


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


@pytest_asyncio.fixture(loop_scope="session")
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the session's stack."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        yield client
