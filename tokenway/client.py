"""Publishing straight to the bus: a Python client for batch and RL jobs.

    async with await Client.connect("nats://127.0.0.1:4222", model="deepseek-v4") as tw:
        done = await tw.run({"prompt": "Once upon a time", "max_tokens": 16})
        tokens = await tw.run(GenerateRequest(request_id="r1", token_ids=[6366, 33],
                                              sampling_params=SamplingParams(logprobs=1)))
        async for rid, result in tw.submit_many(bodies, concurrency=64):
            ...

A request is an OpenAI body (a dict or an encoded JSON body: `messages` make it a chat
completion, else a completion), rendered like an HTTP request, or a `GenerateRequest`:
vLLM's token-only body, which skips render (the schedule stage fills in its output
context). Its output is the request's ledger on `TW_OUT`: its index,
`tw.out.<reply>.<rid>`, then its owner's round records for the reply
(`tokenway.ledger_follow` reads both): read live, or later within the stream's retention.
`reply` names the job (one per client unless given); the request id is the caller's or a
fresh one.

A tenant's job (`tenant=`, connected as the tenant's `client-<tenant>` NATS user) queues on
its tenant's batch lanes, and its reply is `tenant.<tenant>.<job>`: the user may read and
cancel nothing else, and its requests are the tenant's (`tokenway.roles.client`).

A full queue (the bounded `TW_RENDER`/`TW_SCHED` streams refuse new messages) is waited
out and retried, never an error to the caller: here for the queue published to, and at
render for the schedule queue behind it (the `Tw-Batch` header asks it to). A request id
is run once: JetStream drops a resubmission within its two-minute duplicate window, and
`submit` sees a ledger already begun for the id and publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError

from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.aio import Signal, cancel_and_wait
from tokenway.config import ENV_PREFIX, TENANT_ENV, load_settings
from tokenway.credentials import connect_options
from tokenway.errors import CannotStart
from tokenway.ledger_follow import Follow
from tokenway.out_reader import Reader
from tokenway.wire import TERMINAL_KINDS, Api, Delivered, Failed, GenerateRequest, RenderRequest

Request = dict[str, Any] | bytes | GenerateRequest
T = TypeVar("T")

log = logging.getLogger(__name__)
_BACKOFF, _MAX_BACKOFF = 0.05, 2.0  # seconds between tries while a queue is full


class RequestFailed(Exception):
    """The request ended in an error event: its HTTP status and OpenAI error object."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"{status}: {error.get('message', error)}")
        self.status = status
        self.error = error


@dataclass(frozen=True)
class Output:
    """One message of a request's output, as its ledger holds it."""

    kind: str  # `h.KIND_CHUNK`, `KIND_END`, `KIND_RESPONSE` or `KIND_ERROR`
    body: bytes  # stream chunks as SSE `data: …` events, else one JSON document
    seq: int  # its place in the request's output, from 1
    status: int = 200

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS

    def documents(self) -> list[dict[str, Any]]:
        """The JSON documents it carries (stream chunks: each event's)."""
        if self.kind in (h.KIND_RESPONSE, h.KIND_ERROR):
            return [json.loads(self.body)]
        events = self.body.decode().split("\n\n")
        return [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]


class Refused(PermissionError):
    """The bus refused what this client sent: its NATS user may not publish there (another
    tenant's lane, a reply not its own, or no client user at all)."""


class Client:
    """Submit requests to tokenway's bus and read their output (see the module's text)."""

    def __init__(
        self,
        nc: NATS,
        model: str,
        reply: str | None = None,
        tenant: str = "",
        refused: asyncio.Future[Exception] | None = None,
        admission: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`refused`: set by the connection with the server's first refusal of anything
        this client sent (`connect` wires it), which fails every call from then on.
        `admission`: awaited before each new request is queued (the batch runner waits
        there while `TW_OUT` is nearly full of running requests' records)."""
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.model = model
        self.tenant = tenant
        job = reply or f"job{secrets.token_hex(6)}"
        # a tenant's reply given back whole (another process reading its `reply`) is kept
        mine = not tenant or bus.owns_reply(tenant, job)
        self.reply = job if mine else bus.tenant_reply(tenant, job)
        self.waits = 0  # publishes that found the queue full (or NATS away) and waited
        self.waited = Signal()  # fired at each
        self._refused = refused or asyncio.get_running_loop().create_future()
        self._admission = admission

    @classmethod
    async def connect(
        cls,
        servers: str | list[str],
        model: str,
        reply: str | None = None,
        tenant: str = "",
        **options: Any,
    ) -> Client:
        """Connect to NATS (`options`: nats-py's, e.g. `nkeys_seed`, `inbox_prefix`, `tls`).
        Credentials the server refuses raise `CannotStart` at once."""
        refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def noted(exc: Exception) -> None:
            # A denied publish is answered on the connection, never on the publish (whose
            # ack would only time out): it fails what waits for it here instead.
            if "permissions violation" in str(exc).lower() and not refused.done():
                refused.set_result(exc)

        url = servers if isinstance(servers, str) else ",".join(servers)
        nc = await bus.connect(url, "tokenway-client", noted=noted, **options)
        return cls(nc, model, reply, tenant, refused)

    @classmethod
    async def from_env(
        cls, model: str, reply: str | None = None, env: Mapping[str, str] | None = None
    ) -> Client:
        """Connect as the environment says, the way every tokenway process reads it:
        `TOKENWAY_NATS`, the credentials (`TOKENWAY_NATS_NKEY_FILE`, `_CREDS`, `_USER`...),
        `TOKENWAY_NATS_INBOX_PREFIX` and `TOKENWAY_TENANT`. `tokenway up` writes them for
        each tenant's jobs in `<data-dir>/nats-auth/client-<tenant>.env`."""
        env = os.environ if env is None else env
        s = load_settings(env=env)
        if s.nats is None:
            raise CannotStart(
                f"{ENV_PREFIX}NATS is not set: load the environment file `tokenway up` wrote "
                "for your tenant's jobs, <data-dir>/nats-auth/client-<tenant>.env"
            )
        tenant = env.get(TENANT_ENV, "")
        return await cls.connect(s.nats, model, reply, tenant, **connect_options(s))

    async def _unless_refused(self, work: Awaitable[T]) -> T:
        """`work`, or `Refused` the moment the server refuses something of this client's."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, self._refused}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await cancel_and_wait(task)  # this call was cancelled: its work ends with it
            raise
        if task.done() and not task.cancelled():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise Refused(
            f"NATS refused this client ({self._refused.result()}): its user may not do this; a "
            f"tenant's job connects as the tenant's client user (`Client.from_env` with its "
            f"client-<tenant>.env) and publishes as that tenant (tenant={self.tenant!r} here)"
        )

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.nc.close()

    async def submit(self, request: Request, rid: str | None = None) -> str:
        """Queue the request; its id. A full queue is waited out; an id whose output has
        begun is not published again."""
        rid, subject, payload = self._prepared(request, rid)
        if not await self._unless_refused(self._begun(rid)):
            await self._publish(rid, subject, payload)
        return rid

    def _prepared(self, request: Request, rid: str | None) -> tuple[str, str, bytes]:
        """The request's id, the subject it is queued on and its payload."""
        if isinstance(request, GenerateRequest):
            rid = rid or request.request_id
            subject = bus.sched_subject(request.model or self.model, True, self.tenant)
            payload = msgspec.msgpack.encode(msgspec.structs.replace(request, request_id=rid))
            return rid, subject, payload
        raw = request if isinstance(request, bytes) else json.dumps(request).encode()
        body = json.loads(raw)
        api: Api = "chat" if "messages" in body else "completion"
        rid = rid or secrets.token_hex(12)
        subject = bus.render_subject(body.get("model") or self.model, True, self.tenant)
        render = RenderRequest(api=api, request_id=rid, body=raw, created=int(time.time()))
        return rid, subject, msgspec.msgpack.encode(render)

    async def _publish(self, rid: str, subject: str, payload: bytes) -> None:
        if self._admission is not None:
            await self._admission()
        headers = ledger.Identity(rid, self.reply, tenant=self.tenant, batch=True).headers()
        wait = _BACKOFF
        while True:
            try:
                await self._unless_refused(self.js.publish(subject, payload, headers=headers))
                return
            except nats.errors.Error as exc:
                full = isinstance(exc, APIError) and bus.is_stream_full(exc)
                if not (full or bus.transient(exc)):
                    raise
            self.waits += 1
            self.waited.fire()
            await asyncio.sleep(wait)  # the queue drains as workers take from it
            wait = min(wait * 2, _MAX_BACKOFF)

    async def outputs(self, rid: str, timeout: float | None = None) -> AsyncGenerator[Output, None]:
        """The request's output from its first message to its end, live or stored
        (`timeout`: seconds to wait for each next message; None waits as long as it takes)."""
        follow = Follow(self.js, bus.out_subject(self.reply, rid), rid)
        try:
            await self._unless_refused(follow.open())
            events = follow.events()
            try:
                while True:
                    async with asyncio.timeout(timeout):
                        batch = await anext(events)
                    for event in batch:
                        yield _output(event)
                        if event.terminal:
                            return
            finally:
                await events.aclose()
        finally:
            await follow.close()

    async def result(self, rid: str, timeout: float | None = None) -> dict[str, Any]:
        """The whole response of a request that did not stream; `RequestFailed` for an
        error event, ValueError for a streamed request (read its `outputs`)."""
        async with contextlib.aclosing(self.outputs(rid, timeout)) as outputs:  # read, closed
            async for out in outputs:
                if out.terminal:
                    if isinstance(done := outcome(rid, out), RequestFailed):
                        raise done
                    return done
        raise AssertionError("unreachable: outputs() ends with a terminal message")

    async def run(self, request: Request, rid: str | None = None) -> dict[str, Any]:
        """Submit and wait for the whole response."""
        return await self.result(await self.submit(request, rid))

    async def cancel(self, rid: str) -> None:
        """Tell the request's owner to stop it (nothing more is generated for it)."""
        await self.nc.publish(bus.cancel_subject(self.reply, rid), b"")
        await self.nc.flush()

    async def submit_many(
        self,
        requests: Iterable[Request | tuple[str, Request]],
        concurrency: int = 64,
        finished: Finished | None = None,
    ) -> AsyncGenerator[tuple[str, dict[str, Any] | RequestFailed], None]:
        """Run every request, at most `concurrency` at a time; each one's id and response
        (or its `RequestFailed`) as it finishes. Give `(rid, request)` pairs to name them:
        running the same ids again runs nothing twice (one that ended before is answered
        from its ledger at once). The results come through one reader of the reply's
        ledgers (`finished`, else one of its own), not a consumer per request."""
        done: asyncio.Queue[tuple[str, dict[str, Any] | RequestFailed]] = asyncio.Queue()
        async with contextlib.AsyncExitStack() as stack:
            reader = finished
            if reader is None:
                reader = await stack.enter_async_context(self.finished())
            await reader.caught_up()

            async def one(rid: str | None, request: Request) -> None:
                rid, subject, payload = self._prepared(request, rid)
                if not reader.began(rid):
                    await self._publish(rid, subject, payload)
                await done.put((rid, outcome(rid, await reader.wait(rid))))

            async with asyncio.TaskGroup() as group:
                running = 0
                for item in requests:
                    if running >= concurrency:  # a finished one makes room for the next
                        yield await done.get()
                        running -= 1
                    rid, request = item if isinstance(item, tuple) else (None, item)
                    group.create_task(one(rid, request))
                    running += 1
                for _ in range(running):
                    yield await done.get()

    @contextlib.asynccontextmanager
    async def finished(self) -> AsyncIterator[Finished]:
        """A reader of how this client's requests ended (`Finished`), open while in use."""
        reader = Finished(self.js, self.reply)
        await self._unless_refused(reader.start())
        try:
            yield reader
        finally:
            await reader.stop()

    async def _begun(self, rid: str) -> bool:
        """Whether the request's ledger holds output already (it ran, or runs)."""
        reader = Reader(self.js, bus.out_subject(self.reply, rid), DeliverPolicy.LAST)
        try:
            return await reader.open() > 0
        finally:
            await reader.close()


class Finished:
    """How each request under one reply ended, from one reader of its ledgers: every
    ledger's last message when it starts (what ran before, say before a takeover), then
    each one stored since. Many requests' results cost one consumer, not one each."""

    def __init__(self, js: JetStreamContext, reply: str) -> None:
        self._reader = Reader(js, bus.out_subject(reply, "*"), DeliverPolicy.LAST_PER_SUBJECT)
        self._began: set[str] = set()
        self._ended: dict[str, Output] = {}  # ended before anyone waited for it
        self._waiting: dict[str, asyncio.Future[Output]] = {}
        self._current = asyncio.Event()  # what was stored before the start is read
        self._task: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None  # why the reader stopped, if it did

    async def start(self) -> None:
        if not await self._reader.open():
            self._current.set()  # nothing stored: else the backlog's last message says so
        self._task = asyncio.create_task(self._read(), name=f"finished {self._reader.subject}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._reader.close()
        for waiter in self._waiting.values():
            waiter.cancel()

    async def caught_up(self) -> None:
        """Wait until what the ledgers held at the start is read."""
        await self._current.wait()

    def began(self, rid: str) -> bool:
        """Whether the request's ledger holds output (it ran, or runs); once caught up."""
        return rid in self._began

    def take(self, rid: str) -> Output | None:
        """The request's terminal output, if it ended (it is handed out once)."""
        return self._ended.pop(rid, None)

    async def wait(self, rid: str) -> Output:
        """The request's terminal output, once it ends."""
        if (out := self.take(rid)) is not None:
            return out
        if self._failed is not None:
            raise self._failed
        waiter = self._waiting[rid] = asyncio.get_running_loop().create_future()
        try:
            return await waiter
        finally:
            self._waiting.pop(rid, None)

    async def _read(self) -> None:
        """Every end, to its waiter; if reading cannot go on (the connection closed), the
        reason to every waiter, now and later, rather than a wait for ever."""
        try:
            await self._ends()
        except Exception as exc:
            self._failed = exc
            self._current.set()
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(exc)

    async def _ends(self) -> None:
        async for msg in self._reader.messages():
            rid = bus.rid_of(msg.subject)
            self._began.add(rid)
            if msg.metadata.num_pending == 0:
                self._current.set()
            try:
                events = ledger.events_of(rid, msg)
            except (KeyError, ValueError) as exc:
                log.error("ledger record on %s unreadable: %r", msg.subject, exc)
                continue
            if not events or not events[-1].terminal:
                continue
            out = _output(events[-1])
            waiter = self._waiting.get(rid)
            if waiter is not None and not waiter.done():
                waiter.set_result(out)
            else:
                self._ended[rid] = out


def _output(event: Delivered) -> Output:
    status = event.status if isinstance(event, Failed) else 200
    return Output(kind=event.kind, body=event.payload, seq=event.seq, status=status)


def outcome(rid: str, out: Output) -> dict[str, Any] | RequestFailed:
    """A terminal output as the whole response, or the `RequestFailed` of an error event;
    ValueError for the end of a streamed request."""
    if out.kind == h.KIND_ERROR:
        doc = out.documents()[0]
        return RequestFailed(out.status, doc.get("error", doc))
    if out.kind == h.KIND_RESPONSE:
        return out.documents()[0]
    raise ValueError(f"request {rid} streamed its output: read it with outputs()")
