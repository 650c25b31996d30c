"""The bus in one table: every subject, its stream, the durable consumer that drains it.

This module is the only place that spells subject, stream and consumer names. The table
provisions JetStream idempotently at start-up and doubles as the contract for direct
publishers (batch/RL jobs): publish a `RenderRequest` to `render_subject(model, batch=True)`
or a `GenerateRequest` to `sched_subject(model, batch=True)` (a tenant's job: on its lane,
`tenant=`) with the `Tw-Rid`/`Tw-Reply` headers, and read results from the ledger:
`out_subject(reply, rid)`, the request's index, then its owner's records on
`round_subject(reply, owner)` (`tokenway.ledger_follow`), or live from `sse_subject(reply)`
(msgpack `Delivery` messages, each holding what a writer just stored for that reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.api import PubAck
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from tokenway.aio import cancel_and_wait, wait_any
from tokenway.config import Settings
from tokenway.credentials import connect_options
from tokenway.errors import CannotStart
from tokenway.metrics import BUS_ERRORS

log = logging.getLogger(__name__)

RENDER_STREAM = "TW_RENDER"
SCHED_STREAM = "TW_SCHED"
OUT_STREAM = "TW_OUT"
DLQ_STREAM = "TW_DLQ"
ADVISORY_STREAM = "TW_ADVISORIES"
ENGINES_BUCKET = "tw-engines"
ENGINES_STREAM = f"KV_{ENGINES_BUCKET}"  # the stream JetStream keeps the bucket in
ENGINES_KEYS = f"$KV.{ENGINES_BUCKET}.>"  # where a bucket write is published
TENANTS_BUCKET = "tw-tenants"  # each limited tenant's usage (`tokenway.tenancy`)
TENANTS_STREAM = f"KV_{TENANTS_BUCKET}"
TENANTS_KEYS = f"$KV.{TENANTS_BUCKET}.>"
FILES_BUCKET = "tw-files"  # Batch API files (an object store: `tokenway.batch_store`)
FILES_STREAM = f"OBJ_{FILES_BUCKET}"
FILES_SUBJECTS = f"$O.{FILES_BUCKET}.>"
BATCHES_BUCKET = "tw-batches"  # Batch API batches, one record each
BATCHES_STREAM = f"KV_{BATCHES_BUCKET}"
BATCHES_KEYS = f"$KV.{BATCHES_BUCKET}.>"
RESPONSES_BUCKET = "tw-responses"  # stored Responses API responses, with their input
RESPONSES_STREAM = f"KV_{RESPONSES_BUCKET}"
RESPONSES_KEYS = f"$KV.{RESPONSES_BUCKET}.>"
STORED_BUCKET = "tw-stored"  # each tenant's usage of the two stores above (`tokenway.quota`)
STORED_STREAM = f"KV_{STORED_BUCKET}"
STORED_KEYS = f"$KV.{STORED_BUCKET}.>"
JS_API = "$JS.API"
ANY = None  # in a subject function: every model (a wildcard), as permissions name them

DERENDER_QUEUE = "derender"
RENDER_QUEUE = "render"  # render workers answering `tokenize_subject` calls

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def token(name: str) -> str:
    """A model or id as one subject token (also valid in consumer names)."""
    return _UNSAFE.sub("_", name) or "_"


# A batch lane's last token: `_` where tokenway's own stages publish (the batch runner,
# render, owners, ops), else the tenant whose client publishes there (`tenant_reply`).
SHARED_LANE = "_"
TENANT_REPLIES = "tenant"  # the first token of every tenant client's reply


def _lane(stage: str, model: str | None, batch: bool, tenant: str | None) -> str:
    """A queue's subject: interactive requests on `tw.<stage>.<model>`, a batch job's on
    `tw.<stage>.<model>.batch.<lane>`, which its stage takes from only while the first is
    empty. A tenant's lane is the only one its client may publish to (`lane_tenant`)."""
    subject = f"tw.{stage}.{'*' if model is ANY else token(model)}"
    if not batch:
        return subject
    return f"{subject}.batch.{'*' if tenant is ANY else tenant or SHARED_LANE}"


def render_subject(model: str | None, batch: bool = False, tenant: str | None = "") -> str:
    return _lane("render", model, batch, tenant)


def sched_subject(model: str | None, batch: bool = False, tenant: str | None = "") -> str:
    return _lane("sched", model, batch, tenant)


def lane_tenant(subject: str) -> str | None:
    """The tenant whose client published on this batch lane; None on every other queue
    subject, where only tokenway's own stages publish and the headers are theirs."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[3] == "batch" and parts[4] != SHARED_LANE:
        return parts[4]
    return None


def tenant_reply(tenant: str, job: str) -> str:
    """Where a tenant's client has its output go: `tenant.<tenant>.<job>`, so its ledgers
    (`tw.out.tenant.<tenant>.<job>.<rid>`) are the tenant's alone to read."""
    return f"{TENANT_REPLIES}.{tenant}.{token(job)}"


def tenant_replies(tenant: str) -> str:
    """Every reply of the tenant's clients (a wildcard, as permissions name them)."""
    return f"{TENANT_REPLIES}.{tenant}.*"


def owns_reply(tenant: str, reply: str) -> bool:
    """Whether `reply` is one of `tenant_replies(tenant)`."""
    parts = reply.split(".")
    return len(parts) == 3 and parts[:2] == [TENANT_REPLIES, tenant] and token(parts[2]) == parts[2]


def out_subject(reply: str, rid: str) -> str:
    return f"tw.out.{reply}.{rid}"


def round_subject(reply: str, owner: str) -> str:
    """An owner's round records for one reply (`tokenway.ledger`): per reply, so a tenant's
    client reads its own requests' output under `tw.out.tenant.<tenant>.>` and nobody
    else's; `o` and the owner are two tokens, so no request's own subject is one."""
    return f"tw.out.{reply}.o.{owner}"


OUTPUTS = "tw.out.>"  # every ledger (what `TW_OUT` stores)
DELIVERIES = "tw.sse.>"  # every live delivery


def sse_subject(reply: str) -> str:
    """Where ledger writers deliver what they stored for `reply`, live (`Delivery`)."""
    return f"tw.sse.{reply}"


def tok_subject(owner: str) -> str:
    return f"tw.tok.{owner}"


def engine_subject(engine_id: str, verb: str) -> str:
    """Engine ids are subject tokens by construction (`*` listens to every engine)."""
    return f"tw.engine.{engine_id}.{verb}"


def derender_subject(model: str | None) -> str:
    return f"tw.derender.{'*' if model is ANY else token(model)}"


def tokenize_subject(model: str | None) -> str:
    """Core request/reply (`TokenizeCall` → `TokenizeAnswer`): nothing to keep or replay."""
    return f"tw.tokenize.{'*' if model is ANY else token(model)}"


OWNERS_SUBJECT = "tw.owners"  # core request, every owner answers (`tokenway status`)


def inbox_prefix(role: str) -> str:
    """Where a role's replies arrive (JetStream answers, acks, request replies): its own
    inboxes, which no other role may read."""
    return f"_INBOX.{role}"


def cancel_subject(reply: str, rid: str) -> str:
    """Tells the request's owner to stop it; an owner stops only the request that both
    names belong to, so whoever may publish for one reply cancels only its own."""
    return f"tw.cancel.{reply}.{rid}"


CANCELS = "tw.cancel.>"  # every cancel (what owners listen to)


def cancelled(subject: str) -> tuple[str, str]:
    """The reply and the request id a cancel subject names."""
    reply, _, rid = subject.removeprefix("tw.cancel.").rpartition(".")
    return reply, rid


# vLLM's abort_requests, told to every ingress: each cancels its own generate requests the
# ids name (as `Abort`), the owner ending their output "abort"
ABORTS = "tw.abort"


def orphan_subject(key: str = "*") -> str:
    """A new owner tells every engine bridge to drop the request's work for the dead one
    (`key`: the request's, `ledger.request_key`, never its client-chosen rid)."""
    return f"tw.orphan.{key}"


def handover_subject(model: str | None) -> str:
    """A stopping owner tells the model's other owners where each request it hands back
    stands (`wire.HandOver`), so the one taking it over need not read its ledger back."""
    return f"tw.handover.{'*' if model is ANY else token(model)}"


def dlq_subject(stage: str) -> str:
    return f"tw.dlq.{stage}"


def rid_of(subject: str) -> str:
    """The request id is the last token of per-request subjects."""
    return subject.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class StreamSpec:
    config: jsapi.StreamConfig
    carries: str


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    durable: str
    filter_subject: str
    handler: str  # the stage that drains it (documentation for operators)
    ack_wait: float
    max_deliver: int
    max_ack_pending: int


def streams(s: Settings) -> list[StreamSpec]:
    """Every stream is bounded by age and bytes/messages with an explicit discard policy."""
    file = jsapi.StorageType.FILE
    return [
        # Created first so that max-deliveries advisories of later consumers are kept.
        StreamSpec(
            jsapi.StreamConfig(
                name=ADVISORY_STREAM,
                subjects=[
                    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>",
                    "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>",
                ],
                retention=jsapi.RetentionPolicy.LIMITS,
                max_age=s.dlq_max_age,
                max_msgs=100_000,
                max_bytes=64 << 20,
                discard=jsapi.DiscardPolicy.OLD,
                storage=file,
                num_replicas=s.replicas,
            ),
            "what feeds the dead-letter mover",
        ),
        StreamSpec(
            jsapi.StreamConfig(
                name=RENDER_STREAM,
                subjects=["tw.render.>"],
                retention=jsapi.RetentionPolicy.WORK_QUEUE,
                max_msgs=s.queue_max_msgs,
                max_bytes=s.queue_max_bytes,
                max_age=s.queue_max_age,
                discard=jsapi.DiscardPolicy.NEW,  # full → publish fails → 429
                duplicate_window=120.0,
                storage=file,
                num_replicas=s.replicas,
            ),
            "OpenAI request bodies",
        ),
        StreamSpec(
            jsapi.StreamConfig(
                name=SCHED_STREAM,
                subjects=["tw.sched.>"],
                retention=jsapi.RetentionPolicy.WORK_QUEUE,
                max_msgs=s.queue_max_msgs,
                max_bytes=s.queue_max_bytes,
                max_age=s.queue_max_age,
                discard=jsapi.DiscardPolicy.NEW,
                duplicate_window=120.0,
                storage=file,
                num_replicas=s.replicas,
            ),
            "tokenized requests",
        ),
        StreamSpec(
            jsapi.StreamConfig(
                name=OUT_STREAM,
                subjects=[OUTPUTS],
                retention=jsapi.RetentionPolicy.LIMITS,
                max_age=s.out_max_age,
                max_bytes=s.out_max_bytes,
                discard=jsapi.DiscardPolicy.OLD,
                # Dedupe ids live in server memory: keep the window short on the hot stream.
                duplicate_window=30.0,
                storage=file,
                num_replicas=s.replicas,
            ),
            "committed client-visible chunks: the ledger",
        ),
        StreamSpec(
            jsapi.StreamConfig(
                name=DLQ_STREAM,
                subjects=["tw.dlq.>"],
                retention=jsapi.RetentionPolicy.LIMITS,
                max_age=s.dlq_max_age,
                max_bytes=s.dlq_max_bytes,
                discard=jsapi.DiscardPolicy.OLD,
                storage=file,
                num_replicas=s.replicas,
            ),
            "messages that could not be processed, with reason and provenance",
        ),
    ]


def _durable(stage: str, model: str, batch: bool) -> str:
    """`render-<model>`, `batch-render-<model>`: no model's name makes one the other's."""
    return f"{'batch-' if batch else ''}{stage}-{token(model)}"


def render_consumer(s: Settings, model: str, batch: bool = False) -> ConsumerSpec:
    return ConsumerSpec(
        stream=RENDER_STREAM,
        durable=_durable("render", model, batch),
        filter_subject=render_subject(model, batch, ANY),  # a batch lane: every tenant's
        handler="workers.render.service",
        ack_wait=s.ack_wait,
        max_deliver=s.max_deliver,
        max_ack_pending=s.max_inflight,
    )


def sched_consumer(s: Settings, model: str, batch: bool = False) -> ConsumerSpec:
    return ConsumerSpec(
        stream=SCHED_STREAM,
        durable=_durable("schedule", model, batch),
        filter_subject=sched_subject(model, batch, ANY),  # a batch lane: every tenant's
        handler="workers.schedule.service",
        ack_wait=s.owner_ack_wait,
        max_deliver=s.max_deliver,
        max_ack_pending=s.max_inflight * 4,
    )


def seeds(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222`: every server to try (the cluster adds the others)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def redacted(url: str) -> str:
    """The URL for a log line: a `user:password@` or `token@` in it shown as `***@`."""
    return _USERINFO.sub(r"\1***@", url)


_USERINFO = re.compile(r"([a-z]+://)[^/@,]+@")


# A connection trying to get back to NATS fails an attempt every 0.5 s: its first failure is
# said, then one line this often (ten stages under `up` said 20 lines a second).
OUTAGE_SAID_EVERY = 30.0


async def connect(
    url: str,
    name: str,
    settings: Settings | None = None,
    *,
    reconnected: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    noted: Callable[[Exception], Awaitable[None]] | None = None,
    **options: Any,
) -> NATS:
    """A service connection over a seed list: reconnect forever, notice a dead server
    within seconds; `reconnected` runs after each reconnect (subscriptions are back by then).
    The settings' credentials authenticate it (`tokenway.credentials`), or `options`
    (nats-py's: `nkeys_seed`, `inbox_prefix`, `tls`...); `noted` hears every error of the
    server once connected (a permissions violation among them).

    What happens to it is one log line each, naming the server and the reason: a failed
    attempt, an error, a disconnection, a reconnection. Reaching NATS the first time takes
    at most the settings' connect timeout (30 s without settings; then `CannotStart`); a set
    `stop` ends the attempt at once, and so does a server refusing the credentials or this
    process's inboxes (`CannotStart` both: `cannot connect to nats://host:port: reason`).
    """
    timeout = settings.connect_timeout if settings is not None else 30.0
    options = {**(connect_options(settings) if settings is not None else {}), **options}
    nc = NATS()
    last: list[BaseException] = []
    # The server's refusal of us, when it comes (a reset may follow it): of the credentials
    # while connecting, of our inboxes while they are tried (`try_inboxes`).
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    errors = BUS_ERRORS.labels(name.removeprefix("tokenway-").split("-", 1)[0])  # its stage
    at = [redacted(url)]  # the server connected to: what a disconnection lost
    up = asyncio.Event()  # connected, and its inboxes ours: errors are a running stage's now

    outage = [0, 0.0]  # reconnect attempts failed, and when the last of them was said

    async def failed(exc: Exception) -> None:  # nats-py would log a traceback each time
        last[:] = [exc]
        if up.is_set():  # reconnects, slow consumers, server errors
            errors.inc()
            if noted is not None:
                await noted(exc)
            if nc.is_reconnecting:  # an attempt every 0.5 s: said once, then now and then
                outage[0] += 1
                if outage[0] > 1 and time.monotonic() - outage[1] < OUTAGE_SAID_EVERY:
                    return
                outage[1] = time.monotonic()
                log.warning(
                    "%s: cannot reach NATS at %s: %s (attempt %d; said again every "
                    "%gs until it is back)",
                    name,
                    _server(nc, url),
                    reason(exc),
                    outage[0],
                    OUTAGE_SAID_EVERY,
                )
                return
            log.warning("%s: NATS error at %s: %s", name, _server(nc, url), reason(exc))
            return
        log.warning("%s cannot reach NATS at %s: %s", name, _server(nc, url), reason(exc))
        if (_refusal(exc) or violation(exc)) and not refused.done():
            refused.set_result(exc)

    async def lost() -> None:
        if not nc.is_closed:  # (closing calls it too)
            log.warning("%s: disconnected from %s", name, at[0])

    async def back() -> None:
        at[0] = _server(nc, url)
        log.warning("%s: reconnected to %s (after %d failed attempts)", name, at[0], outage[0])
        outage[0] = 0
        if reconnected is not None:
            await reconnected()

    async def connected() -> NATS:
        await nc.connect(
            servers=seeds(url),
            name=name,
            connect_timeout=2,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # stubs say int; seconds work
            ping_interval=5,
            max_outstanding_pings=3,
            disconnected_cb=lost,
            reconnected_cb=back,
            error_cb=failed,
            **options,
        )
        at[0] = _server(nc, url)
        await try_inboxes(nc)
        return nc

    attempt = asyncio.ensure_future(connected())
    waits: set[asyncio.Future[Any]] = {attempt, refused}
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stopping is not None:
        waits.add(stopping)
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this start is called off: its attempt ends with it
        await nc.close()
        await cancel_and_wait(attempt)
        raise
    finally:
        if stopping is not None:
            await cancel_and_wait(stopping)
    if attempt.done() and not refused.done() and attempt.exception() is None:
        up.set()
        return attempt.result()
    ended = attempt.done()  # (before the cancel, which ends it too once the close yields)
    attempt.cancel()
    where = _server(nc, url)
    await nc.close()
    await cancel_and_wait(attempt)
    if stop is not None and stop.is_set():
        raise CannotStart(f"stopped while connecting to {where}")
    if refused.done() or ended:  # refused, or its inboxes not tried (a reset)
        failure = refused.result() if refused.done() else attempt.exception()
        assert failure is not None  # an attempt that ended well, not refused, returned above
        raise CannotStart(f"cannot connect to {where}: {reason(failure)}")
    cause = f": {reason(last[0])}" if last else ""
    raise CannotStart(f"cannot connect to {where}{cause} (for {timeout:g}s)")


async def try_inboxes(nc: NATS) -> None:
    """Subscribe to one of this connection's inboxes and back: a server that denies them
    (another role's seed, an inbox prefix not the role's) has said so (the error callback
    ran) before it answers the flush, where every request would time out later instead.
    Twice: nats-py writes a flush's PING ahead of commands it still buffers (the SUB)."""
    sub = await nc.subscribe(nc.new_inbox())
    await nc.flush(timeout=10)
    await nc.flush(timeout=10)
    await sub.unsubscribe()


def _server(nc: NATS, url: str) -> str:
    """`nats://host:port` of the server `nc` is connected to or trying (nats-py tells the
    one it tries in no public attribute); the seed list when neither is known yet."""
    server = nc.connected_url or getattr(getattr(nc, "_current_server", None), "uri", None)
    if server is None or server.hostname is None:
        return redacted(url)
    return f"{server.scheme}://{server.hostname}:{server.port}"  # no credentials in it


def reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words: the server's (an authorization or
    permissions violation, naming the subject) or the socket's."""
    if isinstance(exc, nats.errors.AuthorizationError):
        return "Authorization Violation (the server refused this process's credentials)"
    if isinstance(exc, nats.errors.UnexpectedEOF):
        return "connection closed by the server (unexpected EOF)"
    if isinstance(exc, nats.errors.StaleConnectionError):
        return "stale connection (no answer to pings)"
    if isinstance(exc, nats.errors.NoServersError):
        return "no server answered"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return "timeout"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).removeprefix("nats: ").strip().strip("'")  # nats-py's: 'the server's'
    if "authorization violation" in text.lower():
        return "Authorization Violation (the server refused this process's credentials)"
    return text or type(exc).__name__


def violation(exc: Exception) -> bool:
    """The server denies this connection a subject it tried (its inboxes, at start)."""
    return "permissions violation" in str(exc).lower()


async def unless_denied(
    nc: NATS, url: str, work: Awaitable[object], denied: asyncio.Future[Exception]
) -> None:
    """`work` on `nc` (a start-up's), ended at once when the server denies it a subject
    (`denied`, set from `connect`'s `noted`): `CannotStart` naming the server and the
    subject, where each denied request would time out and be tried again instead."""
    task = asyncio.ensure_future(work)
    waits: set[asyncio.Future[Any]] = {task, denied}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:  # denied, or this start cancelled: the work ends here too
        await cancel_and_wait(task)
    if denied.done():
        where = _server(nc, url)
        await nc.close()
        raise CannotStart(f"cannot connect to {where}: {reason(denied.result())}")
    task.result()


def _refusal(exc: Exception) -> bool:
    """The server will not have us as we are: wrong or missing credentials, or a TLS peer
    that fails verification. Trying again changes nothing."""
    if isinstance(exc, nats.errors.AuthorizationError | ssl.SSLCertVerificationError):
        return True
    return "authorization violation" in str(exc).lower()


# Stream-full answers from a `discard: new` stream.
_FULL_CODES = {10077, 10047, 10028}
PUBLISH_TRY = 2.0  # seconds one try of a stored publish waits for its ack


def is_stream_full(exc: APIError) -> bool:
    return exc.err_code in _FULL_CODES or "maximum" in (exc.description or "")


def transient(exc: BaseException) -> bool:
    """NATS away, or JetStream without a leader or an answer for a moment (a cluster
    electing one, a server restarting): the call may be made again. A refusal is an answer,
    and so is a payload over the bus limit (the client refuses it before sending)."""
    if isinstance(exc, APIError):
        return exc.code == 503 and not is_stream_full(exc)
    return isinstance(exc, nats.errors.Error) and not isinstance(exc, nats.errors.MaxPayloadError)


def _retrying(within: float, retried: Callable[[BaseException], bool] = transient) -> AsyncRetrying:
    """While a call's failure is `retried` (`transient`), for up to `within` seconds,
    backing off."""
    return AsyncRetrying(
        stop=stop_after_delay(within),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        retry=retry_if_exception(retried),
        reraise=True,
    )


_NO_PLACEMENT = 10005  # "no suitable peers for placement": a cluster peer is away for now


def _placeable(exc: BaseException) -> bool:
    """Transient, or a replicated stream a cluster cannot place while a peer restarts."""
    return transient(exc) or (isinstance(exc, APIError) and exc.err_code == _NO_PLACEMENT)


async def publish_stored(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], within: float
) -> PubAck:
    """A publish into a stream, made again while it is `transient`, for up to `within`
    seconds (then its last error). Its headers carry a message id or a fence, so a retry of
    a publish that was stored after all is not stored twice."""
    try:  # the usual case, without the cost of a retry loop
        return await js.publish(subject, payload, headers=headers, timeout=PUBLISH_TRY)
    except nats.errors.Error as exc:
        if not transient(exc):
            raise
        log.warning("publish to %s failed (%r); retrying", subject, exc)
    async for attempt in _retrying(within):
        with attempt:
            return await js.publish(subject, payload, headers=headers, timeout=PUBLISH_TRY)
    raise AssertionError("unreachable: tenacity reraises")


async def drain(nc: NATS) -> None:
    """A stage's last word to NATS: what it published is flushed and what it received is
    handled (a drain); with NATS away there is nothing to drain into, so just close."""
    try:
        await nc.drain()
    except nats.errors.Error as exc:
        log.warning("NATS connection closed without draining (%r)", exc)
        # Under uvloop the dead socket refuses nats-py's last flush with a RuntimeError.
        with contextlib.suppress(RuntimeError):
            await nc.close()


async def ack_surely(msg: Msg, within: float) -> None:
    """An ack the server confirms, sent again while it is `transient`, for up to `within`
    seconds: a lost ack hands a finished request to another owner, who then only finds its
    end stored (what happens anyway if this one gives up)."""
    try:
        async for attempt in _retrying(within):
            with attempt:
                await msg.ack_sync(timeout=PUBLISH_TRY)
    except nats.errors.Error as exc:
        log.warning("ack of %s not confirmed (%r): it will be redelivered", msg.subject, exc)


# The streams JetStream keeps the buckets in: made by `provision_streams` beside `streams`.
BUCKET_STREAMS = (
    ENGINES_STREAM,
    TENANTS_STREAM,
    FILES_STREAM,
    BATCHES_STREAM,
    RESPONSES_STREAM,
    STORED_STREAM,
)
MAX_DEFAULT_REPLICAS = 3  # a quorum that outlives one lost server; more only when asked


def default_replicas(server_info: Mapping[str, Any]) -> int:
    """The replicas a stream gets unless `--replicas` says otherwise: the servers of the
    cluster as the server's INFO advertises them to clients (`connect_urls`, its own among
    them), up to 3; 1 on a lone server. A cluster that advertises none (`no_advertise`)
    gets 3: placing them fails loudly on fewer servers, where R1 would lose the ledger
    quietly."""
    if not server_info.get("cluster"):
        return 1
    advertised = len(set(server_info.get("connect_urls") or ()))
    return min(MAX_DEFAULT_REPLICAS, advertised or MAX_DEFAULT_REPLICAS)


def replicas_for(stream: str, existing: int | None, asked: int, explicit: bool) -> int:
    """The replicas `stream` gets: those asked where it is new or has fewer (JetStream
    scales a stream up); never fewer than it has. An explicit setting below them is
    refused (CannotStart); a default below them (a server away as the process starts, a
    5-node cluster's R5) keeps them."""
    if existing is None or asked >= existing:
        return asked
    if explicit:
        raise CannotStart(
            f"stream {stream} has {existing} replicas and --replicas {asked} would lower them "
            f"(a lost server would lose what fewer hold); provision never lowers replicas: "
            f"pass --replicas {existing} (or TOKENWAY_REPLICAS={existing}), or leave it out"
        )
    return existing


@dataclass(frozen=True)
class Provisioned:
    """What provisioning did to one stream (or a bucket's): `created`, `updated` (the
    fields that changed) or `unchanged`."""

    stream: str
    action: str
    replicas: int
    was: int | None = None  # its replicas before, where it existed
    fields: tuple[str, ...] = ()

    def line(self) -> str:
        changed = ", ".join(
            f"{f} (R{self.was} → R{self.replicas})" if f == "num_replicas" else f
            for f in self.fields
        )
        return f"{self.stream:<18} {self.action:<10} R{self.replicas}" + (
            f"  {changed}" if changed else ""
        )


# Values a stream config sends that the server replaces with its own default.
_SERVER_FILLS = {"duplicate_window": 0}


def _changed(wanted: jsapi.StreamConfig, current: jsapi.StreamConfig) -> tuple[str, ...]:
    """The fields of `wanted` (those it sets) that `current` holds otherwise."""
    have = current.as_dict()
    return tuple(
        k
        for k, v in wanted.as_dict().items()
        if k != "name" and have.get(k) != v and not (k in _SERVER_FILLS and v == _SERVER_FILLS[k])
    )


async def _info(js: JetStreamContext, name: str) -> jsapi.StreamInfo | None:
    try:
        return await js.stream_info(name)
    except NotFoundError:
        return None


async def _ensure_stream(
    js: JetStreamContext, config: jsapi.StreamConfig, info: jsapi.StreamInfo | None
) -> Provisioned:
    assert config.name is not None and config.num_replicas is not None
    if info is None:
        try:
            await js.add_stream(config)
            return Provisioned(config.name, "created", config.num_replicas)
        except BadRequestError as exc:
            if exc.err_code != 10058:  # made meanwhile by another process, otherwise
                raise
            info = await js.stream_info(config.name)
    was = info.config.num_replicas or 1
    fields = _changed(config, info.config)
    if fields:
        await js.update_stream(config)
        return Provisioned(config.name, "updated", config.num_replicas, was, fields)
    return Provisioned(config.name, "unchanged", was, was)


async def _ensure_bucket(
    js: JetStreamContext, name: str, replicas: int, info: jsapi.StreamInfo | None
) -> Provisioned:
    """A bucket's stream, made by its bucket's function (`info`: as it was before): raised
    to `replicas` where it has fewer; its other limits are its provisioner's."""
    if info is None:
        return Provisioned(name, "created", replicas)
    was = info.config.num_replicas or 1
    if was >= replicas:
        return Provisioned(name, "unchanged", was, was)
    config = info.config
    config.num_replicas = replicas
    await js.update_stream(config)
    return Provisioned(name, "updated", replicas, was, ("num_replicas",))


async def provision_streams(js: JetStreamContext, s: Settings) -> list[Provisioned]:
    """Create or update every stream and bucket; safe to call from every process. Replicas
    are `s.replicas`, or the cluster's size (`default_replicas`); they are never lowered:
    a stream with more than `--replicas` asks is refused (CannotStart) before anything
    changes. Each stream's outcome is logged and returned. A cluster that cannot place a
    replica yet (a peer restarting) is waited for, up to the connect timeout."""
    server = js._nc._server_info
    asked = s.replicas or default_replicas(server)
    if asked > 1 and not server.get("cluster"):  # the server's answer would be a bare 10074
        raise CannotStart(
            f"--replicas {asked} needs a JetStream cluster; server {server.get('server_name')} "
            "runs alone and keeps one copy of each stream (leave --replicas out)"
        )
    async for attempt in _retrying(s.connect_timeout, _placeable):
        with attempt:
            configs = [spec.config for spec in streams(s)]
            names = [*(c.name or "" for c in configs), *BUCKET_STREAMS]
            before = {name: await _info(js, name) for name in names}
            wanted = {
                name: replicas_for(
                    name,
                    (info.config.num_replicas or 1) if info else None,
                    asked,
                    explicit=s.replicas > 0,
                )
                for name, info in before.items()
            }
            done = []
            for config in configs:
                config = dataclasses.replace(config, num_replicas=wanted[config.name or ""])
                done.append(await _ensure_stream(js, config, before[config.name or ""]))
            made = msgspec.structs.replace(s, replicas=asked)  # what a new bucket gets
            for bucket in (
                tenants_kv,
                files_store,
                batches_kv,
                responses_kv,
                stored_kv,
                engines_kv,
            ):
                await bucket(js, made)
            for name in BUCKET_STREAMS:
                done.append(await _ensure_bucket(js, name, wanted[name], before[name]))
            for p in done:
                log.log(
                    logging.DEBUG if p.action == "unchanged" else logging.INFO,
                    "stream %s",
                    p.line(),
                )
            log.info("%s", provisioned_summary(done))
            return done
    raise AssertionError("unreachable: tenacity reraises")


def provisioned_summary(done: list[Provisioned]) -> str:
    """One line: how many streams were made, changed and found as they were, and their
    replicas."""
    counts = {a: sum(p.action == a for p in done) for a in ("created", "updated", "unchanged")}
    kinds = sorted({p.replicas for p in done})
    replicas = f"all R{kinds[0]}" if len(kinds) == 1 else "R" + ", R".join(map(str, kinds))
    return (
        f"provisioned {len(done)} streams: {counts['created']} created, "
        f"{counts['updated']} updated, {counts['unchanged']} unchanged; {replicas}"
    )


PROVISION_POLL = 2.0  # seconds at most between looks for the streams a stage waits for


async def wait_for_streams(js: JetStreamContext, s: Settings, stop: asyncio.Event) -> None:
    """For a process that does not provision: until every stream and the registry exist, as
    `tokenway provision` makes them (a stage started first waits, where exiting would
    crash-loop its container). One line says what it waits for; it looks again at growing
    intervals up to PROVISION_POLL; a set `stop` ends the wait (`CannotStart`)."""
    names = [spec.config.name or "" for spec in streams(s)]
    delay, told = 0.1, False
    for name in [*names, ENGINES_STREAM, TENANTS_STREAM, STORED_STREAM]:
        while True:
            try:
                await js.stream_info(name)
                break
            except NotFoundError:
                if not told:
                    log.warning(
                        "waiting for stream %s: run `tokenway provision` (the provision "
                        "role's credentials) to create the streams, or let this process do it "
                        "(--provision)",
                        name,
                    )
                    told = True
            await wait_any(stop, timeout=delay)
            if stop.is_set():
                raise CannotStart(f"stopped while waiting for stream {name} to be provisioned")
            delay = min(delay * 2, PROVISION_POLL)
    if told:
        log.info("the streams are provisioned: starting")


async def _bucket(js: JetStreamContext, config: jsapi.KeyValueConfig) -> KeyValue:
    """A bucket bound as it is when it exists (whoever provisioned it chose its limits; a
    process configured otherwise must not fail on that), created otherwise."""
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        return await js.create_key_value(config)


async def kv_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """A bucket's keys as the server holds them at one instant: its stream's subjects (a
    key whose latest is a delete marker among them). nats-py's `KeyValue.keys()` lists them
    with a watch, which misses a key whose entry is replaced as the watch begins (a
    heartbeating engine, 7 listings in 100). The server answers a page of subjects at a
    time, and nats-py's `stream_info` reads the first only: read page by page."""
    prefix, subject = f"$KV.{bucket}.", f"{js._prefix}.STREAM.INFO.KV_{bucket}"
    keys: list[str] = []
    while True:
        ask = json.dumps({"subjects_filter": f"{prefix}>", "offset": len(keys)}).encode()
        page = json.loads((await js._nc.request(subject, ask, timeout=10)).data)
        if "error" in page:
            raise APIError.from_error(page["error"])
        found = (page.get("state") or {}).get("subjects") or {}
        keys += [s.removeprefix(prefix) for s in found]
        if not found or len(keys) >= page.get("total", 0):
            return keys


async def engines_kv(js: JetStreamContext, s: Settings) -> KeyValue:
    """The engine registry. Limit markers make an expired heartbeat visible to watchers as
    a delete: no polling."""
    return await _bucket(
        js,
        jsapi.KeyValueConfig(
            bucket=ENGINES_BUCKET,
            history=1,
            ttl=s.engine_ttl,
            limit_marker_ttl=s.engine_ttl,
            max_bytes=16 << 20,
            storage=jsapi.StorageType.FILE,  # a server restart keeps the registry
            replicas=s.replicas,
        ),
    )


async def tenants_kv(js: JetStreamContext, s: Settings) -> KeyValue:
    """Tenants' usage: one small record per limited tenant, read directly by any replica."""
    return await _bucket(
        js,
        jsapi.KeyValueConfig(
            bucket=TENANTS_BUCKET,
            history=1,
            max_bytes=64 << 20,
            storage=jsapi.StorageType.FILE,  # a restart forgets no lease or spent budget
            replicas=s.replicas,
            direct=True,
        ),
    )


async def files_store(js: JetStreamContext, s: Settings) -> ObjectStore:
    """The Batch API's files (`tokenway.batch_store`), bounded (`TOKENWAY_FILES_MAX_BYTES`)."""
    try:
        return await js.object_store(FILES_BUCKET)
    except BucketNotFoundError:
        config = jsapi.ObjectStoreConfig(
            max_bytes=s.files_max_bytes, storage=jsapi.StorageType.FILE, replicas=s.replicas
        )
        return await js.create_object_store(FILES_BUCKET, config=config)


async def batches_kv(js: JetStreamContext, s: Settings) -> KeyValue:
    """The Batch API's batches, one record each, changed compare-and-set."""
    return await _bucket(
        js,
        jsapi.KeyValueConfig(
            bucket=BATCHES_BUCKET,
            history=1,
            max_bytes=256 << 20,
            storage=jsapi.StorageType.FILE,
            replicas=s.replicas,
        ),
    )


async def responses_kv(js: JetStreamContext, s: Settings) -> KeyValue:
    """Stored responses (`tokenway.response_store`): each kept `TOKENWAY_RESPONSES_MAX_AGE`,
    the bucket bounded by `TOKENWAY_RESPONSES_MAX_BYTES` (full, it stores no more: each
    tenant has its share, `tokenway.quota`)."""
    return await _bucket(
        js,
        jsapi.KeyValueConfig(
            bucket=RESPONSES_BUCKET,
            history=1,
            ttl=s.responses_max_age,
            max_bytes=s.responses_max_bytes,
            storage=jsapi.StorageType.FILE,
            replicas=s.replicas,
            direct=True,
        ),
    )


async def stored_kv(js: JetStreamContext, s: Settings) -> KeyValue:
    """Tenants' usage of the files and responses stores: one small record per tenant,
    changed compare-and-set by the ingresses and batch runners (`tokenway.quota_book`)."""
    return await _bucket(
        js,
        jsapi.KeyValueConfig(
            bucket=STORED_BUCKET,
            history=1,
            max_bytes=64 << 20,
            storage=jsapi.StorageType.FILE,
            replicas=s.replicas,
            direct=True,
        ),
    )


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> None:
    await js.add_consumer(
        spec.stream,
        jsapi.ConsumerConfig(
            durable_name=spec.durable,
            filter_subject=spec.filter_subject,
            ack_policy=jsapi.AckPolicy.EXPLICIT,
            deliver_policy=jsapi.DeliverPolicy.ALL,
            ack_wait=spec.ack_wait,
            max_deliver=spec.max_deliver,
            max_ack_pending=spec.max_ack_pending,
            description=f"drained by {spec.handler}",
        ),
    )


async def pull(js: JetStreamContext, spec: ConsumerSpec) -> JetStreamContext.PullSubscription:
    await ensure_consumer(js, spec)
    return await js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)


DRAIN_WAIT = 0.05  # seconds a fetch of what is pending waits for it


async def fetch(sub: JetStreamContext.PullSubscription, want: int, wait: float) -> list[Msg]:
    """The first message as soon as it is there, then whatever else is already waiting.

    nats.py's batch fetch holds a lone message until the batch fills or the pull expires;
    fetching one first, then exactly as many as the consumer says are pending, never does.
    """
    try:
        msgs = await sub.fetch(1, timeout=wait)
    except TimeoutError:  # nats-py's is one too
        return []
    pending = msgs[0].metadata.num_pending
    if want > 1 and pending:
        try:
            msgs += await sub.fetch(min(want - 1, pending), timeout=DRAIN_WAIT)
        except (TimeoutError, nats.errors.Error):
            pass  # another worker took them, or NATS went away: the next fetch tells
    return msgs
