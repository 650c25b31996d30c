"""One settings object, built once at start-up: CLI flags > `TOKENWAY_*` env vars > defaults."""

from __future__ import annotations

import os
import secrets
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

ENV_PREFIX = "TOKENWAY_"
# A direct publisher's tenant (`tokenway.client.Client.from_env`), beside its credentials in
# the `client-<tenant>.env` file `tokenway nats-auth` and `up` write.
TENANT_ENV = f"{ENV_PREFIX}TENANT"
_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}

# Secrets: an empty variable is a deployment whose secret went missing, which must refuse
# to start, never run as if obfuscation or API keys were off. An empty `open_routes` opens
# nothing.
NATS_CREDENTIALS = (
    "nats_user",
    "nats_password",
    "nats_password_file",
    "nats_token",
    "nats_token_file",
    "nats_nkey_file",
    "nats_creds",
    "nats_tls_ca",
    "nats_tls_cert",
    "nats_tls_key",
)
_EMPTY_IS_SET = frozenset(
    {
        "obfuscation_key",
        "obfuscation_key_file",
        "api_key",
        "api_key_file",
        "open_routes",
        *NATS_CREDENTIALS,
    }
)

PositiveFloat = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]


def _default_data_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tokenway")


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    # where things are
    # nats://host:port, or a comma-separated seed list; None: `up` embeds a server
    nats: str | None = None
    connect_timeout: PositiveFloat = 30.0  # give up reaching NATS at start after this long
    nats_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # `up`'s embedded server; 0: a free one
    # NATS credentials (`tokenway.credentials`): one of user + password, a token, an nkey
    # seed file or a .creds file (JWT), with or without TLS. Secrets: files or env vars.
    nats_user: str | None = None
    nats_password: str | None = None
    nats_password_file: str | None = None
    nats_token: str | None = None
    nats_token_file: str | None = None
    nats_nkey_file: str | None = None  # an nkey seed, `SU...`
    nats_creds: str | None = None  # a .creds file: user JWT and seed (`nsc generate creds`)
    nats_tls_ca: str | None = None  # CA to trust for the server's certificate
    nats_tls_cert: str | None = None  # client certificate (with its key) for mutual TLS
    nats_tls_key: str | None = None
    # where this process's replies arrive; None: a stage run alone uses its role's own
    # (`bus.inbox_prefix`), as a role's `.env` of `tokenway nats-auth` sets it; `up`, _INBOX
    nats_inbox_prefix: str | None = None
    # create or update the streams at start; off, a process only checks that they exist
    # (a least-privilege role may not touch them: `tokenway provision` does)
    provision: bool = True
    data_dir: str = msgspec.field(default_factory=lambda: _default_data_dir(os.environ))
    model_dir: str | None = None  # None: the bundled DeepSeek-V4 tokenizer directory
    served_model_name: str | None = None
    # several models, or one under a name (`tokenway.served`): comma-separated NAME=DIR, or
    # NAME for the bundled tokenizer; in place of model_dir and served_model_name
    models: str = ""
    max_model_len: PositiveInt | None = None
    # "on": a max_tokens that does not fit the context is clipped to what fits (else a 400)
    context_budget: Literal["on", "off"] = "off"
    # output parsing, named as `vllm serve` names it; None: the bundled model's defaults
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool | None = None
    # tool calls constrained to the tool parser's own syntax (a structural tag), as vLLM does
    # by default (its VLLM_ENFORCE_STRICT_TOOL_CALLING); off: forced calls to the tools' JSON
    # schema. vLLM's --tool-strict-level: which arguments follow their tool's schema.
    strict_tool_calling: bool = True
    tool_strict_level: Literal["auto", "function", "parameter"] = "auto"
    # who renders: "local" (the model directory's tokenizer) or "vllm" (a vLLM render server at
    # render_url, falling back to the local tokenizer when it fails)
    render_backend: Literal["local", "vllm"] = "local"
    render_url: str | None = None
    render_connect_timeout: PositiveFloat = 2.0
    render_timeout: PositiveFloat = 10.0  # for the render server's whole reply
    # where an ingress's requests are rendered: "pool" (the render workers, over TW_RENDER)
    # or "ingress" (a render stage in the ingress's process, `up`'s default: one stored hop
    # less); the render workers take what is published on `tw.render.*` either way
    render_placement: Literal["ingress", "pool"] = "pool"
    # who derenders: "local" (the model directory's tokenizer) or "vllm" (a vLLM derender
    # server at derender_url, default render_url; never falls back: states differ)
    derender_backend: Literal["local", "vllm"] = "local"
    # where: "owner" (in each schedule worker, for its own requests) or "pool" (the derender
    # workers, over the bus: a backend that scales apart from the owners)
    derender_placement: Literal["owner", "pool"] = "owner"
    derender_url: str | None = None
    derender_connect_timeout: PositiveFloat = 2.0
    derender_server_timeout: PositiveFloat = 5.0  # whole reply; below derender_timeout

    # ingress
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    ingress_id: str | None = None
    access_log: bool = False  # a line per HTTP response (uvicorn's), on stdout
    # a request body above this is a 413, refused before it is read (the bus carries
    # max_payload, 8 MiB, with the request's envelope around it)
    max_request_bytes: PositiveInt = 8_000_000
    body_timeout: PositiveFloat = 30.0  # a request body not all there by then: a 408
    # bytes a second of request bodies one client (its tenant, or its address where no key
    # is asked for) may send; faster, its next body waits unread (`ingress.body_rate`; 0: no
    # bound). A loop of 7 MB bodies kept the ingress busy at 300 MB/s; 32 MiB/s is room
    # for 80 agent turns of 400 KB a second from one client
    max_body_rate: NonNegativeInt = 32 << 20
    # what one request may make the process build (`tokenway.limits`), checked by ingress
    # and render before anything is templated, tokenized or compiled: past one, a 400
    max_tools: PositiveInt = 1024  # tools in one request (OpenAI's own cap: 128)
    max_schema_bytes: PositiveInt = 1 << 20  # JSON text of all of a request's schemas
    max_schema_nodes: PositiveInt = 65_536  # JSON values in all of a request's schemas
    max_grammar_bytes: PositiveInt = 64 * 1024  # its regexes, grammars, choices, patterns
    # a request head (request line and headers) not all there this long after it began (or
    # after the connection opened): a 408, and the connection closed
    header_timeout: PositiveFloat = 10.0
    # a request head (request line and headers) over this is a 431, the connection closed:
    # headers of long tokens and cookies fit many times over (nginx takes 32 KiB, h11 16)
    max_header_bytes: PositiveInt = 64 * 1024
    # connections one client address may hold open at once; past it, a 429 (0: no cap).
    # `vllm bench serve --max-concurrency 512` holds 512 from one address, and a proxy in
    # front holds one per request in flight for all its clients: 1024 leaves them room.
    max_connections_per_address: NonNegativeInt = 1024
    # output bytes an ingress holds for one stream whose client reads slower than it is made;
    # past them, the rest is read back from TW_OUT as the client catches up
    stream_buffer_bytes: PositiveInt = 1 << 20
    # API keys (secret: prefer the file or the env var to the flag). None of either: open.
    api_key: str | None = None  # comma-separated keys of the tenant "default"
    api_key_file: str | None = None  # `TENANT KEY [concurrent=N] [tokens_per_minute=N]` per line
    open_routes: str = "ready,metrics"  # served without a key, besides /health ("none")
    # CORS for browsers (`ingress.cors`): comma-separated or a JSON list; no origin: off
    allowed_origins: str = ""
    allowed_methods: str = "*"
    allowed_headers: str = "*"
    allow_credentials: bool = False
    # each tenant's limits where its key-file lines set none (0: no limit)
    tenant_concurrency: NonNegativeInt = 0
    tenant_tokens_per_minute: NonNegativeInt = 0
    # each tenant's share of the files and stored-responses stores, where its key-file lines
    # give none (0: no limit): a quarter of each store's default size, so that no one tenant
    # fills a store for all (a keyless deployment has one, shared by every client)
    tenant_files_bytes: NonNegativeInt = 1 << 30
    tenant_files_count: NonNegativeInt = 10_000
    tenant_responses_bytes: NonNegativeInt = 256 << 20
    tenant_responses_count: NonNegativeInt = 100_000

    # bus sizing: every stream is bounded
    queue_max_msgs: PositiveInt = 10_000
    queue_max_bytes: PositiveInt = 1 << 30
    queue_max_age: PositiveFloat = 3600.0
    out_max_age: Annotated[float, Meta(ge=3600)] = 3600.0
    # the Batch API: files kept (all, and one), and each runner's lines in flight
    files_max_bytes: PositiveInt = 4 << 30
    file_max_bytes: PositiveInt = 200 << 20
    batch_concurrency: PositiveInt = 256
    batch_lease: PositiveFloat = 30.0  # a runner's hold on a batch, renewed while it runs
    out_max_bytes: PositiveInt = 1 << 30
    # the share of TW_OUT kept for the output of requests already running: new requests
    # are refused (503) while less room than this is left before the ledger would discard
    # a running request's records (`tokenway.ledger_room`)
    out_reserve: Annotated[float, Meta(gt=0, lt=1)] = 0.25
    # stored Responses API responses (`store: true`): how long each is kept, and all of them
    responses_max_age: PositiveFloat = 7 * 86400.0
    responses_max_bytes: PositiveInt = 1 << 30
    dlq_max_age: PositiveFloat = 7 * 86400.0
    dlq_max_bytes: PositiveInt = 1 << 30
    max_payload: PositiveInt = 8 * 1024 * 1024  # embedded server's max_payload
    # each stream's and bucket's replicas; 0: the cluster's size as its server advertises
    # it, up to 3 (`bus.default_replicas`). Provision never lowers a stream's replicas.
    replicas: Annotated[int, Meta(ge=0, le=5)] = 0

    # request lifecycle
    request_timeout: PositiveFloat = 600.0  # default deadline (`Tw-Deadline`)
    derender_timeout: PositiveFloat = 10.0
    derender_retries: Annotated[int, Meta(ge=0)] = 2  # same chunk, same state, another worker
    engine_timeout: PositiveFloat = 10.0  # bridge accept / abort replies
    # after an engine fails an attempt, continue from the committed output this many times
    relay_attempts: Annotated[int, Meta(ge=0)] = 3
    stream_interval: Annotated[int, Meta(ge=1)] = 1  # tokens per streamed chunk, at least
    relay_backoff: Annotated[float, Meta(ge=0)] = 0.05  # seconds, times the relay's number
    ack_wait: PositiveFloat = 30.0  # render, dead-letter mover: work without progress acks
    # How long a request stays with a schedule worker that stopped acknowledging progress:
    # a dead owner's requests go to another worker this long after its last progress ack
    # (sent every quarter of it, for every request it owns).
    owner_ack_wait: PositiveFloat = 2.0
    # how long a stage retries a stored publish while JetStream has no leader or no answer
    # for it (an election in a cluster), before it reports the stage unavailable
    bus_retry: PositiveFloat = 10.0
    # on SIGTERM/SIGINT: how long open streams and owned requests get to finish
    drain_timeout: Annotated[float, Meta(ge=0)] = 20.0
    max_deliver: PositiveInt = 5
    max_inflight: PositiveInt = 1024  # requests one schedule worker owns at once
    # requests (sequences) a schedule worker pulls beyond its engines' room, so that its
    # waiting line holds other tenants' requests to give turns to (0: only what fits)
    owner_lookahead: Annotated[int, Meta(ge=0)] = 64
    # the share of each engine's sequences and KV tokens that a batch job's requests leave
    # free, so that an interactive request finds room at once instead of waiting for a line
    batch_headroom: Annotated[float, Meta(ge=0, lt=1)] = 0.125
    # while interactive requests run on an owner (and for a second after): the share of
    # each engine that its batch requests may take, so that they leave the CPU too
    batch_busy_share: Annotated[float, Meta(ge=0, le=1)] = 0.25
    engine_ttl: PositiveFloat = 5.0  # registry entries vanish this long after the last beat
    engine_wait: PositiveFloat = 10.0  # with no live engine for the model, a 503 after this
    # multi-prompt requests (fan-out): how many one schedule worker owns at once (more: 429),
    # output events held per prompt until every prompt's stream has begun (more: an error),
    # and whole-request retries when a prompt fails before any output was sent
    max_fanout: PositiveInt = 64
    fanout_buffer: PositiveInt = 1024
    fanout_retries: Annotated[int, Meta(ge=0)] = 1

    # routing: KV-cache affinity and circuit breakers
    kv_block_size: PositiveInt = 16  # must equal the engines' KV block size
    # engine tokens a sequence holds ahead of its output (charged again each time it
    # outgrows them, up to its max_tokens): what it needs soon, not all it may ever produce
    decode_reserve: PositiveInt = 1024
    affinity_ttl: PositiveFloat = 300.0  # how long a routed prefix counts as cached there
    prefill_scale: PositiveFloat = 1.0  # weight of uncached prompt blocks against load
    breaker_threshold: PositiveInt = 3  # consecutive engine failures that open its breaker
    breaker_backoff: PositiveFloat = 1.0  # first open period; doubles per trip
    breaker_max_backoff: PositiveFloat = 60.0
    # tenants and the engines they share (`workers.schedule.isolation`): where requests have
    # a tenant, each tenant's prompts are salted apart in the engines' prefix caches unless
    # the tenants trust each other (on: one cache for all), and a client's
    # kv_transfer_params (which name KV blocks on the engines) are a 400 unless the
    # clients are trusted P/D coordinators (on: passed on)
    share_prefix_cache: bool = False
    trust_client_kv_transfer: bool = False

    # simulated engine
    sim_engines: Annotated[int, Meta(ge=0)] | None = None  # None: `up` runs 1 (0 with vllm_url)
    sim_max_seqs: PositiveInt = 256
    sim_chunk_size: PositiveInt = 1
    sim_ttft: Annotated[float, Meta(ge=0)] = 0.02
    sim_itl: Annotated[float, Meta(ge=0)] = 0.01
    sim_output_len: PositiveInt = 200  # mean natural length before EOS
    sim_roles: str = ""  # comma-separated role per simulated engine (default: all union)
    sim_tool_calls: bool = False  # a user's turn with tools is answered with a call (agent tests)

    # engine bridges (`tokenway engine vllm`)
    engine_id: str | None = None  # default: derived from the URL or random
    engine_role: Literal["union", "prefill", "decode"] = "union"
    engine_max_seqs: PositiveInt = 256
    vllm_url: str | None = None  # http://host:port of a vLLM server with --enable-scale-out
    engine_connect_timeout: PositiveFloat = 5.0
    engine_first_token_timeout: PositiveFloat = 600.0  # a long prefill or a queue at the engine
    engine_token_timeout: PositiveFloat = 60.0  # between two chunks of one stream

    # token obfuscation (schedule and engine stages): a keyed permutation of token IDs
    # between schedulers and engines. Secret: prefer the file or the env var to the flag.
    obfuscation_key: str | None = None
    obfuscation_key_file: str | None = None

    log_level: str = "info"
    # an OTLP/HTTP collector (`http://host:4318`) for each stage's spans; None: no spans
    otlp_endpoint: str | None = None
    # this process's Prometheus page (the stages' metrics); None: none but `up`'s /metrics
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    metrics_host: str = "127.0.0.1"

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser()

    def resolved_ingress_id(self) -> str:
        return self.ingress_id or f"i{secrets.token_hex(4)}"


def given(name: str, flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> bool:
    """Whether a flag or `TOKENWAY_<NAME>` sets `name` (as `load_settings` reads them): a
    setting left unset may follow from what the process is (its role, `program.cli`)."""
    env = os.environ if env is None else env
    value = env.get(ENV_PREFIX + name.upper())
    in_env = value is not None and (value != "" or name in _EMPTY_IS_SET)
    return flags.get(name) is not None or in_env


def load_settings(
    flags: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Merge sources: a flag left at None falls through to `TOKENWAY_<NAME>`, then the default.

    An empty variable counts as unset, except for the secrets in `_EMPTY_IS_SET`."""
    env = os.environ if env is None else env
    merged: dict[str, object] = {"data_dir": _default_data_dir(env)}
    hints = typing.get_type_hints(Settings)
    for name in Settings.__struct_fields__:
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None and (value != "" or name in _EMPTY_IS_SET):
            # msgspec reads "true" as a bool only where the type is plain bool.
            is_bool = bool in typing.get_args(hints[name]) and value.lower() in _BOOLS
            merged[name] = _BOOLS[value.lower()] if is_bool else value
    for name, given in (flags or {}).items():
        if given is not None and name in Settings.__struct_fields__:
            merged[name] = given
    try:
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"tokenway: invalid setting: {exc}") from exc
