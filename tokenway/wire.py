"""Every payload that crosses an internal subject, as msgspec structs (msgpack on the wire).

New fields get defaults and go last, so old and new workers can talk during a rollout.
`GenerateRequest` and `SamplingParams` mirror vLLM 0.33's token-in/token-out
`GenerateRequest`, so a direct publisher can post the same body it would send to vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from tokenway import headers as h

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
# messages: Anthropic's, and responses: OpenAI's Responses API, each run as a chat;
# generate: vLLM's token-in/token-out route (`tokenway.api.generate`)
Api = Literal["chat", "completion", "messages", "responses", "generate"]
FinishReason = Literal["stop", "length", "abort", "error"]
Role = Literal["union", "prefill", "decode"]

# A prompt longer than this never fits any model we serve; it bounds decoding work.
MAX_PROMPT_TOKENS = 4 * 1024 * 1024


class StructuredOutputs(Struct, kw_only=True, omit_defaults=True):
    """vLLM's `StructuredOutputsParams`: one constraint (`json` a JSON schema, as an object
    or a string; `regex`; `choice`; `grammar`, EBNF or Lark; `json_object`; `structural_tag`,
    an xgrammar structural tag as a JSON string), with its options."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def kinds(self) -> list[str]:
        """The constraints set (exactly one in a valid request)."""
        kinds = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        return [k for k in kinds if getattr(self, k) is not None]


class SamplingParams(Struct, kw_only=True, omit_defaults=True):
    """vLLM's sampling parameters, as its generate route accepts them."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: tokens the model may reason before the engine ends its reasoning
    thinking_token_budget: Annotated[int, Meta(ge=0)] | None = None


class StreamOptions(Struct, kw_only=True, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


ReasoningStart = Literal["off", "open", "closed"]
ToolChoice = Literal["none", "auto", "required", "named"]


class ToolParams(Struct, array_like=True, omit_defaults=True):
    """A request's tool as a markup tool parser reads its calls: the name, and each
    parameter's JSON Schema types (what a parameter's raw text is converted to)."""

    name: str
    types: dict[str, list[str]] = {}


class ParseContext(Struct, kw_only=True, omit_defaults=True):
    """How derender parses a chat output: decided by render from the flags and the request."""

    reasoning_parser: str | None = None  # --reasoning-parser
    # "off": no reasoning parsing (all content); "open": the prompt leaves a reasoning block
    # open (its last marker starts one); "closed": output starts as content.
    reasoning_start: ReasoningStart = "off"
    include_reasoning: bool = True
    tool_parser: str | None = None  # --tool-call-parser, used for tool_choice "auto"
    tool_choice: ToolChoice = "none"
    tool_name: str | None = None  # the forced function for tool_choice "named"
    parallel_tool_calls: bool = True
    # a forced call ("named", "required") comes in `tool_parser`'s own syntax (a structural
    # tag constrained it), not as JSON: that parser reads it
    native_calls: bool = False
    # Mistral before v11 (a vocabulary without [ARGS]): calls are a JSON list after
    # [TOOL_CALLS], not NAME[ARGS]{...}
    calls_listed: bool = False
    # the request's tools, for a tool parser whose calls are markup (values as raw text,
    # typed by the tool's schema; calls to tools not listed dropped): empty for the others
    tools: list[ToolParams] = []


# How many last prompt tokens travel in `OutputContext.prompt_tail`: what derender seeds its
# detokenizer from, as vLLM does, so the first output token decodes in context.
SEED_TOKENS = 7


class OutputContext(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What derender needs from the original request to shape OpenAI output.

    Fixed for the life of a request (frozen: a change is a new context, made with
    `msgspec.structs.replace`); it travels with every derender call so that derender
    workers stay stateless.
    """

    api: Api = "completion"
    response_id: str = ""
    model: str = ""
    created: int = 0
    prompt_tokens: int = 0
    # Last prompt tokens: seed the detokenizer so the first output token's
    # leading space and multi-byte joins come out as a full decode would.
    prompt_tail: list[TokenId] = []
    stream: bool = False
    # the request's tokens per streamed chunk; the owner's `--stream-interval` may raise it
    stream_interval: int = 1
    include_usage: bool = False
    continuous_usage_stats: bool = False
    echo: bool = False  # completions: the prompt text leads the output
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop: list[str] = []  # stop strings: matched by derender on the output text
    min_tokens: int = 0  # no stop string counts before this many output tokens
    n: int = 1
    # chat: top_logprobs when logprobs is true (0 = only the sampled token); completions:
    # the `logprobs` number. None: no logprobs.
    logprobs: int | None = None
    parse: ParseContext | None = None  # chat only
    # Multi-prompt requests: each prompt runs as a sub-request whose choices are numbered
    # from `index_base` (prompt × n, as vLLM numbers them), and whose stream ends without
    # a usage chunk of its own (the fan-out owner closes the merged stream with one).
    index_base: int = 0
    closing_usage: bool = True
    # The client's body, as it sent it: set by render only for `--derender-backend vllm`,
    # whose derender server wants the original request (it rides on every derender call).
    request_body: bytes | None = None
    # A Responses request's fields its response object echoes (a JSON object).
    response_fields: bytes | None = None
    # Prompt tokens the engine read from its prefix cache, as the attempt that answered
    # reported them (set by the owner once known; None: the engine did not say).
    cached_tokens: int | None = None


# `Tw-Kind`s that end a request's output: an end, a whole response, an error.
TERMINAL_KINDS = frozenset({h.KIND_END, h.KIND_RESPONSE, h.KIND_ERROR})

# How many prompts one completions request may carry.
MAX_PROMPTS = 1024


class Prompt(Struct, kw_only=True, omit_defaults=True):
    """One prompt of a multi-prompt request."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    max_tokens: int | None = None  # its output budget; None: the request's `max_tokens`


class GenerateRequest(Struct, kw_only=True, omit_defaults=True):
    """A tokenized request on `tw.sched.<model>`: vLLM's GenerateRequest + output context.

    With `prompts` (a completions request with several prompts) the schedule worker that
    takes it fans out one sub-request per prompt and merges their output; `token_ids` then
    holds the first prompt, and `context.prompt_tokens` / `prompt_tail` are set per prompt
    by the fan-out.
    """

    request_id: str
    token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, object] | None = None
    return_token_ids: bool | None = None
    context: OutputContext = msgspec.field(default_factory=OutputContext)
    prompts: Annotated[list[Prompt], Meta(max_length=MAX_PROMPTS)] | None = None
    # With structured outputs: whether the prompt already ended the reasoning, so the
    # grammar applies from the first token (None: the engine judges from the prompt).
    reasoning_ended: bool | None = None


class RenderRequest(Struct, kw_only=True):
    """An OpenAI request body (JSON bytes, as the client sent them) on `tw.render.<model>`."""

    api: Api
    request_id: str
    body: bytes
    created: int
    client_request_id: str | None = None  # the client's X-Request-Id: its response's id
    # a Responses request's stored predecessor, whose conversation the ingress put before
    # its input (`ingress.responses`): its response says which it continues
    previous_response_id: str | None = None


# `/tokenize`, `/detokenize` and vLLM's render routes (`/v1/chat/completions/render`,
# `/v1/completions/render`): answered by a render worker, nothing queued.
TokenizeRoute = Literal[
    "tokenize",
    "detokenize",
    "chat_render",
    "completion_render",
    "messages_render",
    "responses_render",
    "chat_derender",
    "completion_derender",
]


class TokenizeCall(Struct, kw_only=True):
    """`POST /tokenize` or `/detokenize` (the JSON body as the client sent it), asked of a
    render worker on `tw.tokenize.<model>`."""

    route: TokenizeRoute
    body: bytes
    rid: str = ""  # the id its answer goes out under (X-Request-Id): what a bug is logged by
    client_id: str = ""  # the client's X-Request-Id: a render route's request id


class TokenizeAnswer(Struct, kw_only=True):
    """The HTTP answer: its status and JSON body (an OpenAI error body unless 200)."""

    status: int
    body: bytes


class EngineWork(Struct, kw_only=True, omit_defaults=True):
    """Owner → bridge on `tw.engine.<id>.generate`: run one attempt of a request."""

    # The request's key (`ledger.request_key`), not its id: clients choose ids, and two
    # requests' work, of two tenants, must never answer to one name at an engine. Its
    # `TokenDelta`s and `EngineAbort`s name the request by it too.
    rid: str
    attempt: int
    owner: str
    token_ids: list[TokenId]
    sampling_params: SamplingParams
    priority: int = 0
    kv_transfer_params: dict[str, object] | None = None
    cache_salt: str | None = None
    # The owner's word on the engine's native completions API as a fallback for a missing
    # token-only route: only while nothing of the request is committed (off: never).
    native_ok: bool = False
    # The obfuscation key fingerprint the owner mapped for (None: plain token IDs); a bridge
    # keyed differently declines the work.
    obfuscation: str | None = None
    traceparent: str | None = None  # the request's W3C Trace Context, for the engine's call
    reasoning_ended: bool | None = None  # `GenerateRequest.reasoning_ended`
    # The request's id as its client named it, for the engine's logs and spans only: it
    # names no work (`rid` does)
    request_id: str = ""


class EngineReply(Struct, kw_only=True, omit_defaults=True):
    """Bridge → owner: whether the engine took the work."""

    accepted: bool
    error: str | None = None


class EngineAbort(Struct, kw_only=True, omit_defaults=True):
    """Stop an attempt; on `tw.orphan.<rid>`, every attempt of the request (its key, as in
    `EngineWork.rid`) not run for `owner` (its new owner, after the last one died)."""

    rid: str
    attempt: int
    owner: str | None = None


class TokenLogprob(Struct, array_like=True, omit_defaults=True):
    """vLLM 0.33's generate logprob: integer token id, no text (the engine has no tokenizer)."""

    token_id: TokenId
    logprob: float
    rank: int | None = None


class LogprobEntry(Struct, array_like=True, omit_defaults=True):
    """One output token's logprob and its top candidates (sampled first, then by rank)."""

    token_id: TokenId
    logprob: float
    rank: int | None = None
    top: list[TokenLogprob] = []


class TokenDelta(Struct, kw_only=True, omit_defaults=True):
    """One sequence's output of one engine step; `seq` counts deltas per attempt from 0."""

    rid: str
    attempt: int
    seq: int
    token_ids: list[TokenId] = []
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, object] | None = None
    index: int = 0  # the choice, for n > 1
    logprobs: list[LogprobEntry] | None = None  # one per token in token_ids
    # With `error`: the engine refused the request itself (its parameters: a grammar it
    # cannot compile, a prompt it rejects), and this is the HTTP status it answered (4xx).
    # The request's own error then: it ends with it, never relayed nor held against the
    # engine. None: the engine failed the attempt.
    refused: int | None = None
    # How many of the attempt's prompt tokens the engine found in its prefix cache, on one
    # of its deltas (vLLM's closing usage says it, so its attempt's finish carries it).
    # None: the engine does not say.
    cached_tokens: int | None = None


class TokenStep(Struct, kw_only=True):
    """Bridge → owner on `tw.tok.<owner>`: everything one engine step made for one owner."""

    engine: str
    entries: list[TokenDelta]


class EngineInfo(Struct, kw_only=True, omit_defaults=True):
    """An engine's entry in the `tw-engines` KV registry, refreshed by heartbeats."""

    id: str
    model: str
    role: Role = "union"
    max_seqs: int = 256
    max_tokens: int = 1 << 20
    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    updated: float = 0.0
    obfuscation: str | None = None  # key fingerprint when the bridge maps token IDs
    leaving: bool = False  # its last entry: the bridge stops on purpose (a delete follows)


class HandOver(Struct, kw_only=True, omit_defaults=True):
    """A request as its stopping owner hands it back to `TW_SCHED`, everything committed:
    what a takeover would otherwise read back from the ledger, one message at a time."""

    key: str  # the request's (`ledger.request_key`)
    index_seq: int  # TW_OUT's sequence of its index's last record (which holds all of it)
    out_seq: int  # its last committed Tw-Seq
    attempt: int
    state: bytes | None = None  # the last committed stream_state (derender's)
    tokens: list[int] = []  # every committed output token ID, in order


class OwnerInfo(Struct, kw_only=True, omit_defaults=True):
    """A schedule worker's answer on `bus.OWNERS_SUBJECT`: what it owns right now."""

    id: str
    model: str
    owned: int  # requests it owns
    running: int  # of those, on an engine
    waiting: int  # of those, in its line for an engine
    tenants: dict[str, int] = {}  # sequences running per tenant ("" without API keys)
    draining: bool = False


# -- derender request-reply ----------------------------------------------------------------


class DerenderEntry(Struct, kw_only=True, omit_defaults=True):
    """One sequence's token delta to turn into OpenAI output.

    `state` is None on a request's first chunk. A non-streaming request is one entry
    with every output token and the finish reason.
    """

    context: OutputContext
    state: bytes | None = None  # opaque to all but derender
    token_ids: list[TokenId] = []
    # Only on a request's first derender (state None), and only for `echo`/`return_token_ids`:
    # the prompt never rides along with later chunks.
    prompt_token_ids: list[TokenId] | None = None
    index: int = 0  # the choice, for n > 1
    logprobs: list[LogprobEntry] | None = None  # one per token in token_ids
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Set (with nothing else) for the usage chunk that closes a stream of n > 1 choices.
    usage_total: int | None = None
    # A Responses stream's last entry: the choice's output before this delta, since the
    # stream's closing events hold the whole output (its state holds only a window).
    output_ids: list[TokenId] | None = None


class DerenderCall(Struct, kw_only=True):
    entries: list[DerenderEntry]


def responses_of(entries: Sequence[DerenderEntry]) -> list[range]:
    """A call's entries, one run per response: a whole (non-streaming) response's `n`
    choices side by side, as its owner takes them (at most `n`, of one id and prompt, none
    twice: a multi-prompt request's sub-requests share an id), and every other entry alone.
    Runs say which entries are one response's, not ids: a response's id is the client's to
    choose (its X-Request-Id), so two requests in one call, of one tenant or of two, may
    share one."""
    runs, start = [], 0
    while start < len(entries):
        ctx, end = entries[start].context, start + 1
        if not ctx.stream:
            seen = {entries[start].index}
            while end < min(len(entries), start + ctx.n):
                other = entries[end]
                same = (other.context.response_id, other.context.index_base, other.context.stream)
                if same != (ctx.response_id, ctx.index_base, False) or other.index in seen:
                    break
                seen.add(other.index)
                end += 1
        runs.append(range(start, end))
        start = end
    return runs


class ErrorInfo(Struct, kw_only=True, omit_defaults=True):
    """An OpenAI error, with the HTTP status it maps to."""

    message: str
    type: str = "BadRequestError"
    status: int = 400
    param: str | None = None
    code: str | None = None
    retry_after: int = 0  # of a refusal that passes (429): seconds until it may


class Derendered(Struct, kw_only=True, omit_defaults=True, tag_field="kind", tag="output"):
    """An entry's OpenAI JSON documents (stream chunks, or one response) and its next state."""

    chunks: list[bytes] = []
    state: bytes | None = None
    # Set when derender itself ended the output (a stop string): the owner then stops the
    # engine, and only the first `kept` tokens of the delta belong to the output.
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    kept: int | None = None


class DerenderFailed(Struct, kw_only=True, omit_defaults=True, tag_field="kind", tag="error"):
    """An entry derender could not turn into output: the request fails with `error`."""

    error: ErrorInfo


# Per entry of a call: its output, or why there is none. Told apart by their tag, which a
# derender worker of the version before the variants does not send: an owner cannot read its
# replies (`Pool` fails the call as the stage unavailable).
DerenderResult = Derendered | DerenderFailed


class DerenderReply(Struct, kw_only=True, omit_defaults=True):
    results: list[DerenderResult] = []
    error: ErrorInfo | None = None  # the call as a whole could not be decoded


class _Stored(Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind"):
    """One committed ledger event: its `Tw-Seq` and payload, and what a new owner resumes
    from (the attempt that made it); its variant (the tag, `kind`) is its `Tw-Kind`. The
    same struct is stored (an owner's round record, a request's index record) and delivered
    live (`Delivery`)."""

    rid: str
    seq: int
    payload: bytes
    attempt: int = 0
    terminal: ClassVar[bool] = True  # it ends the request's output

    @property
    def kind(self) -> str:
        """Its `Tw-Kind` (`h.KIND_*`)."""
        return str(self.__struct_config__.tag)


class _Output(_Stored, frozen=True):
    tokens: int = 0  # how many output token IDs it commits
    # A streamed chunk's token IDs and the stream_state after it: where a relay goes on.
    # (A whole response keeps neither: nothing goes on after it.)
    ids: list[int] = []
    state: bytes | None = None


class Chunk(_Output, frozen=True, tag=h.KIND_CHUNK):
    """Stream chunk(s); more follow."""

    terminal: ClassVar[bool] = False


class End(_Output, frozen=True, tag=h.KIND_END):
    """A stream's last chunk(s)."""


class Whole(_Output, frozen=True, tag=h.KIND_RESPONSE):
    """A whole response, of a request that does not stream."""


class Failed(_Stored, frozen=True, tag=h.KIND_ERROR):
    """An error event (`payload`: an OpenAI error body), which ends the request's output."""

    status: int  # `Tw-Status`: its HTTP status
    retry_after: int = 0  # `Tw-Retry-After` of an error that passes
    tokens: ClassVar[int] = 0  # it commits no output token


# A ledger writer of the version before the variants leaves a chunk's tag out: a reader
# cannot decode its delivery and reads the ledger back (`OutputRouter`).
Delivered = Chunk | End | Whole | Failed
# The output variants by `Tw-Kind`.
OUTPUTS: dict[str, type[Chunk | End | Whole]] = {
    h.KIND_CHUNK: Chunk,
    h.KIND_END: End,
    h.KIND_RESPONSE: Whole,
}


class Delivery(Struct, kw_only=True):
    """Events of one reply, in `Tw-Seq` order per request. The payload of every `TW_OUT`
    record: an owner's round record (every event of the round for that reply), which is
    also delivered live on `tw.sse.<reply>` once stored, and a request's index record."""

    events: list[Delivered]


class Takeover(Struct, kw_only=True):
    """Stored on an owner's round subject by the owner taking these requests from it: the
    old owner's next fenced round record is refused, and it lets them go."""

    rids: list[str]
    owner: str  # the new owner's round subject


class Cancel(Struct, kw_only=True, omit_defaults=True):
    """A cancel's payload on `tw.cancel.<reply>.<rid>`; an empty one: the client left, and
    nothing more is said to it."""

    # vLLM's abort_requests: the output so far ends, finished "abort", told to the client
    abort: bool = False


class Abort(Struct, kw_only=True):
    """vLLM's abort_requests on `tw.abort`: a tenant's generate requests, by the ids their
    responses answer under (`generate-tokens-…`)."""

    tenant: str
    ids: list[str]


class DeadLetter(Struct, kw_only=True, omit_defaults=True):
    """A message no worker could process, kept readable (JSON) in `TW_DLQ`."""

    stage: str
    subject: str
    reason: str
    delivered: int = 1
    headers: dict[str, str] = {}
    payload: bytes = b""
    time: float = 0.0
