"""Least privilege on the bus: what each role may publish and subscribe to, built from the
bus table (`tokenway.bus`), so that the permissions follow the subjects they name.

A role is what one kind of process does: a stage (ingress, render, schedule, derender, an
engine bridge, the dead-letter mover), an operator's `tokenway dlq` (ops), or whoever
creates the streams (provision, the only role that may create, change or delete one).
Every role has inboxes of its own (`bus.inbox_prefix`), so no role reads another's
JetStream answers or request replies, and each talks to JetStream only about its own
streams and consumers. `tokenway nats-auth` writes these as a nats-server configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenway import bus

# Every tokenway stream; their names and limits are no secret to any role.
_STREAMS = (
    bus.RENDER_STREAM,
    bus.SCHED_STREAM,
    bus.OUT_STREAM,
    bus.DLQ_STREAM,
    bus.ADVISORY_STREAM,
    bus.ENGINES_STREAM,
    bus.TENANTS_STREAM,
    bus.FILES_STREAM,
    bus.BATCHES_STREAM,
    bus.RESPONSES_STREAM,
    bus.STORED_STREAM,
)


@dataclass(frozen=True)
class Role:
    name: str
    does: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False  # answers requests (on the requester's reply subject)
    tenant: str = ""  # a client role's tenant

    @property
    def inbox(self) -> str:
        return bus.inbox_prefix(self.name)


def _api(verb: str, *args: str) -> str:
    return ".".join((bus.JS_API, verb, *args))


def _consumes(stream: str) -> tuple[str, ...]:
    """Drains a durable pull consumer of `stream`: makes it, fetches, acknowledges."""
    return (
        _api("CONSUMER.DURABLE.CREATE", stream, "*"),
        _api("CONSUMER.INFO", stream, "*"),
        _api("CONSUMER.MSG.NEXT", stream, "*"),
        f"$JS.ACK.{stream}.>",
    )


def _lanes(
    subject: Callable[[str | None, bool, str | None], str], tenant: str | None = ""
) -> tuple[str, str]:
    """A queue's two lanes: interactive requests and a batch job's (the shared batch lane,
    or a tenant's: `bus.ANY` for every one)."""
    return subject(bus.ANY, False, ""), subject(bus.ANY, True, tenant)


def _reads(stream: str) -> tuple[str, ...]:
    """Reads `stream` through short-lived consumers of its own (ordered or pull)."""
    return (
        _api("CONSUMER.CREATE", stream),
        _api("CONSUMER.CREATE", stream, ">"),
        _api("CONSUMER.INFO", stream, "*"),
        _api("CONSUMER.DELETE", stream, "*"),
        _api("CONSUMER.MSG.NEXT", stream, "*"),
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",  # an ordered consumer's flow control
    )


def _gets(stream: str) -> str:
    """Reads single messages of `stream` by sequence or subject."""
    return _api("STREAM.MSG.GET", stream)


_INFO = tuple(_api("STREAM.INFO", name) for name in _STREAMS)
_REGISTRY = _reads(bus.ENGINES_STREAM)  # watches the engine registry
# Tenants' usage: read a record, write it back compare-and-set (`tokenway.tenant_book`).
_TENANTS = (bus.TENANTS_KEYS, _api("DIRECT.GET", bus.TENANTS_STREAM, ">"))
# Tenants' usage of the stores: read a record, write it back compare-and-set
# (`tokenway.quota_book`), by whoever writes a file or a stored response.
_STORED = (bus.STORED_KEYS, _api("DIRECT.GET", bus.STORED_STREAM, ">"))
# every reply's, a tenant client's (`tenant.<tenant>.<job>`) included
_LEDGER_WRITE = (bus.OUTPUTS, bus.DELIVERIES, _gets(bus.OUT_STREAM))
# The Batch API's files and batches (`tokenway.batch_store`): objects are written in chunks
# and read through ordered consumers; a batch record is read, watched, written back. nats-py's
# object store finds its stream by subject before it reads an object (STREAM.NAMES: only names).
_BATCH_STORE = (
    bus.FILES_SUBJECTS,
    *_reads(bus.FILES_STREAM),
    _gets(bus.FILES_STREAM),
    _api("STREAM.NAMES"),
    _api("STREAM.PURGE", bus.FILES_STREAM),
    bus.BATCHES_KEYS,
    *_reads(bus.BATCHES_STREAM),
    _gets(bus.BATCHES_STREAM),
    *_STORED,
)
# What the batch runner does as a direct client (`tokenway.client`): queue its lines
# (OpenAI bodies) on their tenants' lanes, read their ledgers, cancel them.
_DIRECT = (bus.render_subject(bus.ANY, True, bus.ANY), bus.CANCELS, *_reads(bus.OUT_STREAM))
_CANCEL_ANY = bus.cancel_subject("*", "*")  # a request of a reply of its own (one token)


def client(tenant: str) -> Role:
    """A tenant's batch/RL job on the bus (`tokenway.client` with `tenant=`): it queues
    requests on the tenant's batch lanes only, and reads and cancels only those whose reply
    is the tenant's (`bus.tenant_reply`); render and the owners check both names."""
    replies = bus.tenant_replies(tenant)
    return Role(
        f"client-{tenant}",
        f"tenant {tenant}'s batch and RL jobs, publishing straight to the bus",
        publish=(
            bus.render_subject(bus.ANY, True, tenant),
            bus.sched_subject(bus.ANY, True, tenant),
            bus.cancel_subject(replies, "*"),
            # its own consumers (`tokenway.out_reader`): made on its ledgers alone
            _api("CONSUMER.CREATE", bus.OUT_STREAM, "*", bus.out_subject(replies, ">")),
            _api("CONSUMER.MSG.NEXT", bus.OUT_STREAM, "*"),
            _api("CONSUMER.DELETE", bus.OUT_STREAM, "*"),
        ),
        subscribe=(bus.sse_subject(replies),),
        tenant=tenant,
    )


def roles(tenants: Sequence[str] = ()) -> list[Role]:
    """Every stage's role, and a client role for each of `tenants`."""
    return [*_stages(), *map(client, tenants)]


def _stages() -> list[Role]:
    return [
        Role(
            "provision",
            "creates and updates the streams and the engine registry (`tokenway up`, "
            "`tokenway provision`)",
            publish=(_api(">"),),
            subscribe=(),
        ),
        Role(
            "ingress",
            "takes HTTP requests: queues them for render, streams their output, cancels",
            publish=(
                bus.render_subject(bus.ANY),
                bus.tokenize_subject(bus.ANY),
                _CANCEL_ANY,
                bus.ABORTS,
                *_reads(bus.OUT_STREAM),
                _gets(bus.OUT_STREAM),
                *_REGISTRY,
                *_BATCH_STORE,  # the Files and Batch APIs
                bus.RESPONSES_KEYS,  # stored responses: written, deleted, read
                _gets(bus.RESPONSES_STREAM),
                _api("DIRECT.GET", bus.RESPONSES_STREAM, ">"),
                *_INFO,
            ),
            subscribe=(bus.sse_subject("*"), bus.ABORTS),
        ),
        Role(
            "batch",
            "the batch runner: runs the Batch API's batches line by line as a direct client",
            # it reads where TW_OUT's oldest running request begins, as the ingress does
            publish=(*_DIRECT, _gets(bus.OUT_STREAM), *_BATCH_STORE, *_INFO),
            subscribe=(),
        ),
        Role(
            "render",
            "tokenizes queued requests and queues them for the schedulers; answers /tokenize",
            publish=(
                *_consumes(bus.RENDER_STREAM),
                *_lanes(bus.sched_subject),
                *_LEDGER_WRITE,
                bus.dlq_subject("render"),
                *_TENANTS,
                *_INFO,
            ),
            subscribe=(bus.tokenize_subject(bus.ANY),),
            responds=True,
        ),
        Role(
            "schedule",
            "owns requests: dispatches them to engines, derenders, commits their output",
            publish=(
                *_consumes(bus.SCHED_STREAM),
                *_LEDGER_WRITE,
                _gets(bus.SCHED_STREAM),
                *_lanes(bus.sched_subject),  # a multi-prompt request's prompts
                bus.engine_subject("*", "*"),
                bus.orphan_subject(),
                bus.handover_subject(bus.ANY),
                _CANCEL_ANY,  # a multi-prompt request's prompts
                bus.derender_subject(bus.ANY),
                bus.dlq_subject("schedule"),
                *_TENANTS,
                *_REGISTRY,
                *_INFO,
            ),
            subscribe=(
                bus.tok_subject("*"),
                bus.CANCELS,
                bus.sse_subject("*"),
                bus.OWNERS_SUBJECT,
                bus.handover_subject(bus.ANY),
            ),
            responds=True,  # to `tokenway status`
        ),
        Role(
            "derender",
            "turns token IDs into OpenAI chunks for schedulers that call the pool",
            publish=_INFO,  # a process checks at start that the streams are there
            subscribe=(bus.derender_subject(bus.ANY),),
            responds=True,
        ),
        Role(
            "engine",
            "an engine bridge: runs generate calls, streams their tokens, keeps its registry entry",
            publish=(bus.tok_subject("*"), bus.ENGINES_KEYS, *_INFO),
            subscribe=(bus.engine_subject("*", "*"), bus.orphan_subject()),
            responds=True,
        ),
        Role(
            "dlq",
            "the dead-letter mover: copies exhausted messages to TW_DLQ, removes them",
            publish=(
                *_consumes(bus.ADVISORY_STREAM),
                bus.dlq_subject("*"),
                *(_gets(q) for q in (bus.RENDER_STREAM, bus.SCHED_STREAM)),
                *(_api("STREAM.MSG.DELETE", q) for q in (bus.RENDER_STREAM, bus.SCHED_STREAM)),
                *_INFO,
            ),
            subscribe=(),
        ),
        Role(
            "ops",
            "`tokenway dlq`: lists, shows, replays and purges dead letters; `tokenway status`",
            publish=(
                *_reads(bus.DLQ_STREAM),
                *(_api("CONSUMER.LIST", q) for q in (bus.RENDER_STREAM, bus.SCHED_STREAM)),
                *_REGISTRY,
                _gets(bus.ENGINES_STREAM),
                _api("DIRECT.GET", bus.ENGINES_STREAM, ">"),
                *_reads(bus.BATCHES_STREAM),  # `tokenway status`: the batches
                _gets(bus.BATCHES_STREAM),
                *_reads(bus.STORED_STREAM),  # and what each tenant keeps
                _api("DIRECT.GET", bus.STORED_STREAM, ">"),
                _gets(bus.DLQ_STREAM),
                _api("STREAM.PURGE", bus.DLQ_STREAM),
                bus.dlq_subject(">"),  # replay markers
                *_lanes(bus.render_subject, bus.ANY),
                *_lanes(bus.sched_subject, bus.ANY),  # replays
                bus.OWNERS_SUBJECT,
                *_INFO,
            ),
            subscribe=(),
        ),
    ]


def server_users(keys: dict[str, str], tenants: Sequence[str] = ()) -> list[dict[str, object]]:
    """The `authorization.users` of a nats-server configuration: each role's nkey (its
    public key in `keys`) with exactly its permissions."""
    users: list[dict[str, object]] = []
    for role in roles(tenants):
        permissions: dict[str, object] = {
            # An empty allow list would allow everything: nothing is a deny of everything.
            "publish": {"allow": list(role.publish)} if role.publish else {"deny": [">"]},
            "subscribe": {"allow": [*role.subscribe, f"{role.inbox}.>"]},
        }
        if role.responds:
            permissions["allow_responses"] = True
        users.append({"nkey": keys[role.name], "permissions": permissions})
    return users
