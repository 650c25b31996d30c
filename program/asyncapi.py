"""The bus's contract as an AsyncAPI 3.0 document (`tokenway asyncapi` prints it).

Addresses come from `tokenway.bus`'s subject functions and streams, payload schemas from the
msgspec structs of `tokenway.wire` (their JSON Schema), so the document cannot drift from
what the stages publish. Each channel says which stream keeps it (none: core NATS, gone if
nobody listens), who sends and who receives, the headers, and the encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenway import __version__, bus
from tokenway import headers as h
from tokenway.batches import Record
from tokenway.quota import Kept
from tokenway.response_store import Stored
from tokenway.tenancy import Usage
from tokenway.wire import (
    Abort,
    DeadLetter,
    Delivery,
    DerenderCall,
    DerenderReply,
    EngineAbort,
    EngineInfo,
    EngineWork,
    ErrorInfo,
    GenerateRequest,
    HandOver,
    OwnerInfo,
    RenderRequest,
    Takeover,
    TokenizeAnswer,
    TokenizeCall,
    TokenStep,
)

MSGPACK, JSON, SSE = "application/msgpack", "application/json", "text/event-stream"

# Header → what it says, for the messages that carry it.
REQUEST_HEADERS = {
    h.RID: "The request id (with `Tw-Reply`, its `Nats-Msg-Id`: JetStream drops a resubmission "
    "within the stream's two-minute duplicate window).",
    h.REPLY: "Where the output goes: the ledger subject is `tw.out.<Tw-Reply>.<Tw-Rid>`.",
    h.MSG_ID: "`<Tw-Reply>.<Tw-Rid>`, for JetStream's de-duplication (another job may pick "
    "the same rid).",
    h.DEADLINE: "Optional: epoch seconds after which the request ends with a 504.",
    h.TENANT: "The API key's tenant (set by the ingress).",
    h.LIMITS: "The tenant's limits (set by the ingress).",
    h.BATCH: 'Optional, "1": a batch job\'s request: full queues downstream are waited out '
    "instead of a 429, and owners start interactive requests first.",
    h.TRACEPARENT: "Optional W3C trace context, passed on to the engine.",
}
OUTPUT_HEADERS = {
    h.SEQ: "The `Tw-Seq` of the record's last event (events are numbered 1, 2, … with no "
    "gap), or of the request's last where it holds none (a change of owner).",
    h.KIND: f"Of the record's last event: `{h.KIND_CHUNK}` (also when absent) and "
    f"`{h.KIND_END}`: SSE `data:` events of a stream; `{h.KIND_RESPONSE}`: a whole JSON "
    f"response; `{h.KIND_ERROR}`: an OpenAI error body. The last three end the output.",
    h.EVENTS: "How many events the record holds.",
    h.STATUS: "Of an error: its HTTP status.",
    h.OWNER: "The round subject where the request's events after this record are.",
    h.OWNER_SEQ: "... after this stream sequence of it.",
    h.MSG_ID: "`<reply>.<rid>:<seq>`, for JetStream's de-duplication, on a record that "
    "names no expected last subject sequence (the fence refuses a fenced one sent twice).",
    h.TENANT: "The tenant whose request it is (`GET /v1/streams` serves only that tenant).",
}
ROUND_HEADERS = {
    h.KIND: f"`{h.KIND_ROUND}`: events of the owner's requests for this reply; "
    f"`{h.KIND_TAKEOVER}`: the requests another owner took from this one (`Takeover`).",
}


@dataclass(frozen=True)
class Channel:
    """One subject pattern of the bus, as the document describes it."""

    name: str
    address: str  # with {parameters}
    description: str
    payload: type | None  # a wire struct; None: an empty body or opaque bytes
    content_type: str = MSGPACK
    stream: str | None = None  # the JetStream stream that keeps it; None: core NATS
    senders: tuple[str, ...] = ()
    receivers: tuple[str, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)
    reply: type | None = None  # a core request's answer, on the NATS reply subject
    more: tuple[type, ...] = ()  # other payloads the channel carries


def _address(subject: Any, *names: str) -> str:
    """A subject function's pattern: called with placeholder tokens, read back as
    `{parameters}` (the functions turn any name into a valid token)."""
    marks = [f"PARAM{i}X" for i in range(len(names))]
    address = subject(*marks)
    for mark, name in zip(marks, names, strict=True):
        address = address.replace(mark, "{" + name + "}")
    return address


_LANES = (
    "`{lane}` is `_` where tokenway's own stages publish (the batch runner, render, owners), "
    "or a tenant's name: its client (the `client-<tenant>` NATS user) publishes there "
    "only, with a `Tw-Reply` of `tenant.<tenant>.<job>` (any other is dead-lettered), and "
    "the request is that tenant's whatever its headers say."
)


def _batch_lane(subject: Callable[[str | None, bool, str | None], str]) -> Callable[..., str]:
    return lambda model, lane: subject(model, True, lane)


def channels() -> list[Channel]:
    ingress, direct = "ingress", "direct clients (`tokenway.client`)"
    return [
        Channel(
            "render",
            _address(bus.render_subject, "model"),
            "OpenAI request bodies, one per request, for render to template and tokenize.",
            RenderRequest,
            stream=bus.RENDER_STREAM,
            senders=(ingress, direct),
            receivers=("render",),
            headers=REQUEST_HEADERS,
        ),
        Channel(
            "schedule",
            _address(bus.sched_subject, "model"),
            "Tokenized requests for their owner: vLLM's token-only generate body plus "
            "tokenway's output context. A body without one (`context.response_id` "
            "empty) gets it from the schedule stage, or an error event.",
            GenerateRequest,
            stream=bus.SCHED_STREAM,
            senders=("render", direct),
            receivers=("schedule",),
            headers=REQUEST_HEADERS,
        ),
        Channel(
            "render-batch",
            _address(_batch_lane(bus.render_subject), "model", "lane"),
            "A batch job's request bodies (`Tw-Batch: 1`), which render takes only "
            f"while `render` has none waiting. {_LANES}",
            RenderRequest,
            stream=bus.RENDER_STREAM,
            senders=(direct,),
            receivers=("render",),
            headers=REQUEST_HEADERS,
        ),
        Channel(
            "schedule-batch",
            _address(_batch_lane(bus.sched_subject), "model", "lane"),
            "A batch job's tokenized requests, which an owner takes only while "
            "`schedule` has none waiting and only as many as its engines can start. "
            f"{_LANES}",
            GenerateRequest,
            stream=bus.SCHED_STREAM,
            senders=("render", direct),
            receivers=("schedule",),
            headers=REQUEST_HEADERS,
        ),
        Channel(
            "output",
            _address(bus.out_subject, "reply", "rid"),
            "A request's index in the ledger: its first event, a segment of its events "
            "every 32 tokens, a change of owner, and its end with every event not indexed "
            "before, each record a `Delivery` of its events, kept for `TW_OUT`'s "
            "retention. The events after the last record are in the round records its "
            "`Tw-Owner` header names (`tokenway.ledger_follow` reads both, live or later; "
            "`tokenway.client` does). A tenant's client names its consumers, so that the "
            "create call names the subject: it may read `tw.out.tenant.<tenant>.>` only.",
            Delivery,
            stream=bus.OUT_STREAM,
            senders=("schedule", "render"),
            receivers=(ingress, direct),
            headers=OUTPUT_HEADERS,
        ),
        Channel(
            "rounds",
            _address(bus.round_subject, "reply", "owner"),
            "An owner's round records for one reply: each holds every event the owner "
            "committed for that reply's requests in one round (the same bytes are then "
            "delivered live), fenced on the subject's last sequence. An owner taking a "
            "request over stores a `Takeover` here first: the old owner's next round "
            "record is refused.",
            Delivery,
            stream=bus.OUT_STREAM,
            senders=("schedule",),
            receivers=(ingress, direct),
            headers=ROUND_HEADERS,
            more=(Takeover,),
        ),
        Channel(
            "delivery",
            _address(bus.sse_subject, "reply"),
            "What the ledger's writer just stored for a reply, live: a lost one shows as "
            "a gap in `Tw-Seq`, which the reader reads back from the ledger.",
            Delivery,
            senders=("schedule",),
            receivers=(ingress,),
        ),
        Channel(
            "tokens",
            _address(bus.tok_subject, "owner"),
            "Everything one engine step made for one owner.",
            TokenStep,
            senders=("engine bridge",),
            receivers=("schedule",),
        ),
        Channel(
            "engine",
            _address(bus.engine_subject, "engine", "verb"),
            "Work for an engine (`generate`: `EngineWork`) and aborts of it (`abort`: "
            "`EngineAbort`).",
            EngineWork,
            senders=("schedule",),
            receivers=("engine bridge",),
            more=(EngineAbort,),
        ),
        Channel(
            "orphan",
            _address(bus.orphan_subject, "key"),
            "A new owner's word to every bridge: drop the request's work for the old one "
            "(`key`: the request's, a digest of its reply and rid, as in `EngineWork.rid`).",
            EngineAbort,
            senders=("schedule",),
            receivers=("engine bridge",),
        ),
        Channel(
            "handover",
            _address(bus.handover_subject, "model"),
            "A stopping owner's word to the model's other owners: where a request it "
            "hands back to `TW_SCHED` stands, so the one taking it over reads one ledger "
            "message (to check) instead of all of them.",
            HandOver,
            senders=("schedule",),
            receivers=("schedule",),
        ),
        Channel(
            "cancel",
            _address(bus.cancel_subject, "reply", "rid"),
            "The client left: its owner stops the request, if the request has both "
            "names (a tenant's client cancels its own only). An empty body; a `Cancel` "
            "with `abort` for vLLM's abort_requests: the output so far ends, finished "
            '"abort", and its client is told.',
            None,
            content_type="application/octet-stream",
            senders=(ingress, direct),
            receivers=("schedule",),
        ),
        Channel(
            "abort",
            bus.ABORTS,
            "vLLM's `POST /inference/v1/abort_requests`, told to every ingress: each "
            "cancels (with `abort`) its own generate requests of the tenant whose "
            "responses the ids name.",
            Abort,
            senders=(ingress,),
            receivers=(ingress,),
        ),
        Channel(
            "derender",
            _address(bus.derender_subject, "model"),
            "Token deltas to turn into OpenAI output (`--derender-placement pool`).",
            DerenderCall,
            senders=("schedule",),
            receivers=("derender",),
            reply=DerenderReply,
        ),
        Channel(
            "tokenize",
            _address(bus.tokenize_subject, "model"),
            "`/tokenize` and `/detokenize`, answered by a render worker.",
            TokenizeCall,
            senders=(ingress,),
            receivers=("render",),
            reply=TokenizeAnswer,
        ),
        Channel(
            "owners",
            bus.OWNERS_SUBJECT,
            "`tokenway status`: every owner answers with what it holds. An empty body.",
            None,
            content_type="application/octet-stream",
            senders=("ops",),
            receivers=("schedule",),
            reply=OwnerInfo,
        ),
        Channel(
            "dead-letters",
            _address(bus.dlq_subject, "stage"),
            "Messages no worker could process, with the reason and where they came from.",
            DeadLetter,
            content_type=JSON,
            stream=bus.DLQ_STREAM,
            senders=("every stage", "dead-letter mover"),
            receivers=("ops",),
        ),
        Channel(
            "engine-registry",
            bus.ENGINES_KEYS.replace(">", "{engine}"),
            f"The `{bus.ENGINES_BUCKET}` key-value bucket: each engine's heartbeat.",
            EngineInfo,
            stream=bus.ENGINES_STREAM,
            senders=("engine bridge",),
            receivers=(ingress, "schedule"),
        ),
        Channel(
            "tenants",
            bus.TENANTS_KEYS.replace(">", "{tenant}"),
            f"The `{bus.TENANTS_BUCKET}` key-value bucket: each limited tenant's usage "
            "(its rate and its requests' slots), written compare-and-set.",
            Usage,
            stream=bus.TENANTS_STREAM,
            senders=("render", "schedule"),
            receivers=("render", "schedule"),
        ),
        Channel(
            "batches",
            bus.BATCHES_KEYS.replace(">", "{batch}"),
            f"The `{bus.BATCHES_BUCKET}` key-value bucket: each Batch API batch (OpenAI's "
            "batch object, its tenant, its runner's lease), written compare-and-set.",
            Record,
            content_type=JSON,
            stream=bus.BATCHES_STREAM,
            senders=(ingress, "batch runner"),
            receivers=(ingress, "batch runner"),
        ),
        Channel(
            "responses",
            bus.RESPONSES_KEYS.replace(">", "{response}"),
            f"The `{bus.RESPONSES_BUCKET}` key-value bucket: each stored Responses API "
            "response with the conversation it answered and its tenant, kept "
            "`TOKENWAY_RESPONSES_MAX_AGE`.",
            Stored,
            content_type=JSON,
            stream=bus.RESPONSES_STREAM,
            senders=(ingress,),
            receivers=(ingress,),
        ),
        Channel(
            "stored",
            bus.STORED_KEYS.replace(">", "{tenant}"),
            f"The `{bus.STORED_BUCKET}` key-value bucket: what each tenant keeps in the "
            "files and responses stores (`_` for a keyless deployment's one tenant), and "
            "the quota it was last charged against, written compare-and-set.",
            Kept,
            stream=bus.STORED_STREAM,
            senders=(ingress, "batch runner"),
            receivers=(ingress, "batch runner", "ops"),
        ),
        Channel(
            "files",
            bus.FILES_SUBJECTS.replace(">", "{part}"),
            f"The `{bus.FILES_BUCKET}` object store: Batch API files (input, output, "
            "error), in JetStream's object-store layout; each object's description holds "
            "its OpenAI file object and tenant.",
            None,
            content_type="application/octet-stream",
            stream=bus.FILES_STREAM,
            senders=(ingress, "batch runner"),
            receivers=(ingress, "batch runner"),
        ),
    ]


_STRUCTS: tuple[type, ...] = (ErrorInfo,)  # referenced by the descriptions, not a channel's


def document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the bus."""
    chans = channels()
    types = [t for c in chans for t in (c.payload, c.reply, *c.more) if t is not None]
    _, schemas = msgspec.json.schema_components(
        [*dict.fromkeys(types), *_STRUCTS],
        schema_hook=_any,
        ref_template="#/components/schemas/{name}",
    )
    messages: dict[str, Any] = {}
    doc_channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for c in chans:
        messages[c.name] = _message(c.name, c.payload, c.content_type, c.headers, c.description)
        carried = [c.name]
        for other in c.more:
            carried.append(f"{c.name}-{other.__name__}")
            messages[carried[-1]] = _message(
                carried[-1], other, c.content_type, c.headers, other.__doc__ or other.__name__
            )
        entry: dict[str, Any] = {
            "address": c.address,
            "description": c.description + _kept(c.stream),
            "messages": {m: {"$ref": f"#/components/messages/{m}"} for m in carried},
        }
        params = [p.strip("{}") for p in c.address.split(".") if p.startswith("{")]
        if params:
            entry["parameters"] = {p: {"description": f"the {p}"} for p in params}
        doc_channels[c.name] = entry
        _operations(operations, c.name, c.senders, c.receivers)
        if c.reply is not None:  # a core request: the answer goes to the asker's inbox
            answer = f"{c.name}-reply"
            messages[answer] = _message(answer, c.reply, MSGPACK, {}, f"The {c.name} answer.")
            doc_channels[answer] = {
                "address": None,
                "description": f"The answer to a {c.name} request, on the NATS reply subject "
                "the request names (the asker's inbox, `_INBOX.<role>.…`).",
                "messages": {answer: {"$ref": f"#/components/messages/{answer}"}},
            }
            _operations(operations, answer, c.receivers, c.senders)
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "tokenway bus",
            "version": __version__,
            "description": (
                "The NATS subjects tokenway's stages and direct clients speak. Payloads are "
                "msgpack of the schemas below (tokenway/wire.py) unless a message says "
                "otherwise. A request goes to `tw.render.<model>` (an OpenAI body) or "
                "`tw.sched.<model>` (token IDs) with `Tw-Rid` and `Tw-Reply`; its output is "
                "its ledger `tw.out.<reply>.<rid>`. A full queue refuses the publish "
                "(JetStream's maximum-messages error): wait and publish again."
            ),
        },
        "defaultContentType": MSGPACK,
        "servers": {"nats": {"host": "localhost:4222", "protocol": "nats"}},
        "channels": doc_channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


def _operations(
    into: dict[str, Any], channel: str, senders: tuple[str, ...], receivers: tuple[str, ...]
) -> None:
    ref = {"$ref": f"#/channels/{channel}"}
    for action, who in (("send", senders), ("receive", receivers)):
        into[f"{action}-{channel}"] = {
            "action": action,
            "channel": ref,
            "summary": f"{', '.join(who)} {action}",
        }


def _any(kind: type) -> dict[str, Any]:
    """`object` (free JSON, e.g. `kv_transfer_params`' values) is any value."""
    if kind is object:
        return {"description": "any value"}
    raise NotImplementedError(kind)


def _kept(stream: str | None) -> str:
    if stream is None:
        return " Core NATS: not stored, lost when nobody listens."
    return f" Kept in the JetStream stream `{stream}`."


def _message(
    name: str, payload: type | None, content_type: str, headers: dict[str, str], about: str
) -> dict[str, Any]:
    message: dict[str, Any] = {"name": name, "contentType": content_type, "summary": about}
    if payload is not None:
        message["payload"] = {"$ref": f"#/components/schemas/{payload.__name__}"}
    else:
        message["payload"] = {"type": "string", "description": _opaque(content_type)}
    if headers:
        message["headers"] = {
            "type": "object",
            "properties": {k: {"type": "string", "description": v} for k, v in headers.items()},
        }
    return message


def _opaque(content_type: str) -> str:
    if content_type == SSE:
        return (
            "Stream chunks as SSE `data: <JSON>` events (chunk, end); a whole response "
            "or an error as one JSON document."
        )
    return "Bytes: empty, or an object's chunk."
