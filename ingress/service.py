"""Ingress shell: one NATS connection, one output router, uvicorn serving the API."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Iterator, Sequence

import uvicorn

from ingress.aborts import Aborts
from ingress.app import IngressContext, create_app
from ingress.auth import ApiKeys
from ingress.body_rate import BodyRate
from ingress.completions import RenderBeside
from ingress.connections import Guard, GuardedProtocol
from ingress.cors import Cors
from ingress.ledger_read import LedgerReader
from ingress.models import Catalog
from tokenway import bus
from tokenway.aio import Lazy, grace
from tokenway.batch_store import BatchStore
from tokenway.config import Settings
from tokenway.errors import CannotStart, Unavailable
from tokenway.ledger_room import LedgerRoom
from tokenway.limits import RequestLimits
from tokenway.output_router import OutputRouter
from tokenway.quota import Quota
from tokenway.registry import EngineRegistry, bucket_ttl
from tokenway.response_store import ResponseStore
from tokenway.served import ServedModel
from tokenway.tenancy import Limits

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process owner handles signals and sets `should_exit`


def listen(host: str, port: int) -> socket.socket:
    """The bound socket uvicorn serves on: bound here, a taken port is our error to report
    (uvicorn's own bind exits the process, leaving an embedded nats-server behind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotStart(f"the ingress cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class IngressService:
    name = "ingress"

    def __init__(self, settings: Settings, models: Sequence[ServedModel]) -> None:
        self.settings = settings
        # ValueError when the keys given are unusable: refuse to start rather than run open
        self.keys = ApiKeys.load(
            settings.api_key,
            settings.api_key_file,
            settings.open_routes,
            Limits(
                concurrent=settings.tenant_concurrency,
                tokens_per_minute=settings.tenant_tokens_per_minute,
            ),
            Quota(
                files_bytes=settings.tenant_files_bytes,
                files_count=settings.tenant_files_count,
                responses_bytes=settings.tenant_responses_bytes,
                responses_count=settings.tenant_responses_count,
            ),
        )
        self.cors = Cors.load(settings)
        # each request head's deadline, and the connections one address may hold
        self.guard = Guard(
            settings.header_timeout, settings.max_connections_per_address, settings.max_header_bytes
        )
        # each client's pace of request bodies: a bucket holds one largest body at least
        rate = settings.max_body_rate
        self.body_rate = BodyRate(rate, max(rate, settings.max_request_bytes))
        self.models = models
        self.ingress_id = settings.resolved_ingress_id()
        self.started = asyncio.Event()
        self.draining = asyncio.Event()  # stopping: new requests are refused
        self.server: _Server | None = None
        self.router: OutputRouter | None = None
        self.registry: EngineRegistry | None = None
        self.ledger_room: LedgerRoom | None = None
        # model → a render stage the program runs in this process (`--render-placement
        # ingress`): its requests skip the render queue
        self.render_beside: dict[str, RenderBeside] = {}

    @property
    def url(self) -> str:
        assert self.server is not None and self.server.servers
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def _reconnected(self) -> None:
        if self.router is not None:
            await self.router.reconnected()

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        sock = listen(self.settings.host, self.settings.port)  # a taken port fails first
        nc = await bus.connect(
            nats_url,
            f"tokenway-ingress-{self.ingress_id}",
            self.settings,
            reconnected=self._reconnected,
            stop=stop,
        )
        kv = await bus.engines_kv(nc.jetstream(), self.settings)
        served = [m.name for m in self.models]
        ttl = await bucket_ttl(kv, self.settings.engine_ttl)
        self.registry = registry = EngineRegistry(kv, served, ttl)
        self.router = router = OutputRouter(nc, self.ingress_id, self.settings.stream_buffer_bytes)
        await router.start()
        aborts = Aborts(nc, self.ingress_id)
        await aborts.start()
        self.ledger_room = ledger_room = LedgerRoom(nc, self.settings.out_reserve)
        ctx = IngressContext(
            nc=nc,
            router=router,
            ledger=LedgerReader(nc.jetstream(), self.settings.request_timeout),
            catalog=Catalog(self.models, registry),
            request_timeout=self.settings.request_timeout,
            bus_retry=self.settings.bus_retry,
            draining=self.draining,
            max_request_bytes=self.settings.max_request_bytes,
            body_timeout=self.settings.body_timeout,
            keys=self.keys,
            batch_store=Lazy(lambda: BatchStore.bind(nc.jetstream(), self.settings)),
            response_store=Lazy(lambda: ResponseStore.bind(nc.jetstream(), self.settings)),
            file_max_bytes=self.settings.file_max_bytes,
            cors=self.cors,
            request_limits=RequestLimits.of(self.settings),
            ledger_room=ledger_room,
            body_rate=self.body_rate,
            render_beside=self.render_beside,
            aborts=aborts,
        )
        config = uvicorn.Config(
            create_app(ctx),
            host=self.settings.host,
            port=self.settings.port,
            http=functools.partial(GuardedProtocol, guard=self.guard),  # type: ignore[arg-type]
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            access_log=self.settings.access_log,
        )
        if self.settings.access_log:  # one line per response, on stdout
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self.server = server = _Server(config)
        async with asyncio.TaskGroup() as group:
            group.create_task(registry.run(stop))
            group.create_task(ledger_room.run(stop))
            serving = group.create_task(server.serve(sockets=[sock]))
            # uvicorn exposes its startup only as a flag
            while not server.started and not serving.done():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            if not server.started:
                raise RuntimeError(f"ingress could not listen on {config.host}:{config.port}")
            self.started.set()
            log.info("ingress %s listening on %s", self.ingress_id, self.url)
            await stop.wait()
            await self._drain(router, grace(stop, self.settings.drain_timeout))
            server.should_exit = True
        await aborts.stop()
        await router.stop()
        await bus.drain(nc)

    async def _drain(self, router: OutputRouter, within: float) -> None:
        """Refuse new requests, give open streams `within` seconds to finish, then end each
        one left with an error event naming the shutdown (and where to resume it)."""
        self.draining.set()
        log.info("ingress %s draining: %d open streams", self.ingress_id, len(router.slots))
        try:
            await asyncio.wait_for(router.idle.wait(), within)
        except TimeoutError:
            router.cut(
                lambda rid: Unavailable(
                    f"the server is shutting down; resume with GET /v1/streams/{rid} "
                    "(Last-Event-ID: the data events received) on another ingress"
                ).info()
            )
