"""Ingress shell: one NATS connection, one output router, uvicorn serving the API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from ingress.app import IngressContext, create_app
from ingress.ledger_read import LedgerReader
from ingress.router import OutputRouter
from tokenway import bus
from tokenway.config import Settings
from tokenway.model import ModelInfo
from tokenway.registry import EngineRegistry

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process owner handles signals and sets `should_exit`


class IngressService:
    name = "ingress"

    def __init__(self, settings: Settings, model: ModelInfo, served_model_name: str) -> None:
        self.settings = settings
        self.model = model
        self.served = served_model_name
        self.ingress_id = settings.resolved_ingress_id()
        self.started = asyncio.Event()
        self.server: _Server | None = None
        self.router: OutputRouter | None = None
        self.registry: EngineRegistry | None = None

    @property
    def url(self) -> str:
        assert self.server is not None and self.server.servers
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def _reconnected(self) -> None:
        if self.router is not None:
            await self.router.reconnected()

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = await bus.connect(
            nats_url, f"tokenway-ingress-{self.ingress_id}", reconnected=self._reconnected
        )
        kv = await bus.engines_kv(nc.jetstream(), self.settings)
        self.registry = registry = EngineRegistry(kv, self.served, self.settings.engine_ttl)
        self.router = router = OutputRouter(nc, self.ingress_id)
        await router.start()
        ctx = IngressContext(
            nc=nc,
            router=router,
            registry=registry,
            ledger=LedgerReader(nc.jetstream(), self.settings.request_timeout),
            model=self.served,
            model_root=str(self.model.path),
            context_length=self.model.context_length,
            request_timeout=self.settings.request_timeout,
        )
        config = uvicorn.Config(
            create_app(ctx),
            host=self.settings.host,
            port=self.settings.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self.server = server = _Server(config)
        async with asyncio.TaskGroup() as group:
            group.create_task(registry.run(stop))
            serving = group.create_task(server.serve())
            # uvicorn exposes its startup only as a flag
            while not server.started and not serving.done():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            if not server.started:
                raise RuntimeError(f"ingress could not listen on {config.host}:{config.port}")
            self.started.set()
            log.info("ingress %s listening on %s", self.ingress_id, self.url)
            await stop.wait()
            server.should_exit = True
        await router.stop()
        await nc.drain()
