"""OpenAI request bodies (plus vLLM's common extras) as msgspec structs.

Decoding validates (`tokenway.api.bodies.decode_body`): the ingress answers 400 on a body
that does not decode, and the render stage decodes the same bytes again to build the tokenized
request. Unknown fields are ignored, as vLLM and OpenAI do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from tokenway.errors import InvalidRequest
from tokenway.limits import DEFAULT_LIMITS, RequestLimits, check_decoded, check_text
from tokenway.wire import StructuredOutputs, TokenId

PosInt = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# What the wire (msgpack) and the engines carry: vLLM bounds seeds to a signed 64-bit int.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TopK = Annotated[int, Meta(ge=-1, le=2**63 - 1)]  # -1 or 0: off, as vLLM takes it
NonNegInt = Annotated[int, Meta(ge=0, le=2**63 - 1)]
_T = TypeVar("_T")


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Struct, kw_only=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class Message(Struct, kw_only=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an assistant turn's reasoning, for templates that write it back (vLLM's name, and
    # the older one it still reads)
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class JsonSchemaFormat(Struct, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True, omit_defaults=True):
    """OpenAI's `response_format`, and vLLM's structural tags (both of its forms)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: Any = None  # a structural tag
    structures: list[dict[str, Any]] | None = None  # a structural tag, its older form
    triggers: list[str] | None = None


class StreamOptionsBody(Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class Sampling(Struct, kw_only=True):
    """Sampling fields vLLM takes on every generating API it serves, its Responses route
    included (where all but OpenAI's own are its extras)."""

    seed: Int64 | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None


def sampling_of(req: Sampling) -> dict[str, Any]:
    """A request's `Sampling` fields, for the chat request it translates to."""
    return {name: getattr(req, name) for name in Sampling.__struct_fields__}


class _Common(Sampling, kw_only=True):
    """Fields shared by chat and completions, with vLLM's extras."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    stream_options: StreamOptionsBody | None = None
    user: str | None = None
    # vLLM extras
    min_tokens: NonNegInt = 0
    # tokens per streamed chunk (at least the server's `--stream-interval`)
    stream_interval: PosInt | None = None
    spaces_between_special_tokens: bool = True
    return_token_ids: bool | None = None
    request_id: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's older spellings of structured outputs (0.33 dropped them: here they still work)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's effort; the template gets it (and, unless the client set it, the thinking
    # switch it implies): `with_effort`
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    thinking_token_budget: NonNegInt | None = None  # enforced by the engine, as vLLM's


# One prompt (text or token IDs) or several; msgspec allows one list type per union.
PromptInput = str | list[str | TokenId | list[TokenId]]


class CompletionRequest(_Common, kw_only=True):
    prompt: PromptInput
    max_tokens: PosInt | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: PosInt | None = None
    add_special_tokens: bool = True


def with_effort(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """A chat request's `reasoning_effort` in its template kwargs, as vLLM 0.33 puts it
    there: as itself, and as `enable_thinking` (off for "none") unless the client set that;
    the reasoning parsers read the same kwargs."""
    effort = req.reasoning_effort
    if effort is None:
        return req
    kwargs = dict(req.chat_template_kwargs or {})
    if "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort != "none"
    kwargs["reasoning_effort"] = effort
    req.chat_template_kwargs = kwargs
    return req


def thinking_switch(on: bool) -> dict[str, Any]:
    """`chat_template_kwargs` that turn a template's thinking on or off, in both spellings
    templates use (DeepSeek's `thinking`, Qwen's `enable_thinking`)."""
    return {"thinking": on, "enable_thinking": on}


def template_kwargs(
    switch: dict[str, Any] | None, client: dict[str, Any] | None
) -> dict[str, Any] | None:
    """An API's thinking switch under the client's own `chat_template_kwargs`, which win
    where both name a key (as vLLM merges them)."""
    if switch is None and client is None:
        return None
    return {**(switch or {}), **(client or {})}


# Lax, as vLLM's pydantic models are: `min_tokens: 0.0` or `"max_tokens": "5"` is taken
# (a number with a fraction in an integer field still is not).
ChatDecoder = msgspec.json.Decoder(ChatCompletionRequest, strict=False)
CompletionDecoder = msgspec.json.Decoder(CompletionRequest, strict=False)
OpenAIRequest = ChatCompletionRequest | CompletionRequest

# How deep the free-form JSON of a request (tool schemas, template kwargs, KV transfer
# parameters, response formats) may nest: far above any real schema, far below the depth
# at which walking it (the chat template, a re-encoding) runs out of stack.
MAX_DEPTH = 64


class TokenizeCompletionRequest(Struct, kw_only=True):
    """`POST /tokenize` with a prompt, as vLLM takes it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Struct, kw_only=True):
    """`POST /tokenize` with messages: the prompt the chat template makes of them."""

    model: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template adds
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class _Shape(Struct):
    """Which `/tokenize` body this is, and which model it names, read without decoding the
    rest."""

    messages: msgspec.Raw = msgspec.Raw()  # empty: no messages
    model: msgspec.Raw = msgspec.Raw()


TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest
_TOKENIZE_CHAT = msgspec.json.Decoder(TokenizeChatRequest, strict=False)
_TOKENIZE_PROMPT = msgspec.json.Decoder(TokenizeCompletionRequest, strict=False)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest, strict=False)


def _shape(body: bytes) -> _Shape:
    """The shape of a `/tokenize` or `/detokenize` body; an empty one for a body that does
    not decode (its own decoder then says what is wrong with it)."""
    try:
        return msgspec.json.decode(body, type=_Shape)
    except (msgspec.DecodeError, RecursionError):
        return _Shape()


def named_model(body: bytes) -> str | None:
    """The model a `/tokenize` or `/detokenize` body names, where it names one as a string."""
    raw = _shape(body).model
    try:
        return msgspec.json.decode(raw, type=str) if raw else None
    except msgspec.DecodeError:  # null, or not a string: its own decoder says so
        return None


def decode_tokenize(body: bytes, bounds: RequestLimits = DEFAULT_LIMITS) -> TokenizeRequest:
    """A `/tokenize` body: messages (chat) or a prompt, as vLLM tells them apart; its tools
    held to `bounds`."""
    if not _shape(body).messages:
        return decoded(_TOKENIZE_PROMPT, body)
    check_text("tokenize", body, bounds)
    req = decoded(_TOKENIZE_CHAT, body)
    check_decoded("tokenize", req, bounds)
    return req


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    return decoded(_DETOKENIZE, body)


def decoded(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    """`body` decoded and checked for depth; a malformed one is an `InvalidRequest`."""
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as exc:
        param = str(exc).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(exc) else None
        raise InvalidRequest(f"invalid request: {exc}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise not_json(body, exc) from exc
    except RecursionError:
        raise InvalidRequest(f"request body nests deeper than {MAX_DEPTH} levels") from None
    check_depth(req)
    return req


# Half of a UTF-16 pair: a `\uD800`-`\uDBFF` escape without a `\uDC00`-`\uDFFF` one after
# it, or one of those without the first before it. An even run of backslashes before it (none)
# makes it an escape, not the text `\\ud800`.
_LONE_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*"
    rb"(\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)
_MARK = "\x00lone surrogate\x00"  # in a string that holds no text: where the escape was


def not_json(body: bytes, exc: msgspec.DecodeError) -> InvalidRequest:
    """A body that does not decode, as the client's 400. msgspec reads a lone surrogate's
    escape at the end of a string as "Input data was truncated", which sends a client looking
    for a body cut short: that one is named, with its byte and the field it is in."""
    lone = _LONE_SURROGATE.search(body)
    if lone is None:
        return InvalidRequest(f"request body is not valid JSON: {exc}")
    param = _field_of(body, lone)
    return InvalidRequest(
        f"request body is not valid JSON: {lone.group(1).decode()} at byte {lone.start(1)}"
        f"{f' in {param}' if param else ''} is a lone UTF-16 surrogate, half of a pair that "
        "stands for no character; a character past U+FFFF is escaped as a pair "
        "(\\ud83d\\ude00) or sent as UTF-8",
        param=param,
    )


def _replaced(lone: re.Match[bytes]) -> bytes:
    """The escape `lone` found as U+FFFD, the backslashes before it kept."""
    return lone.group(0)[: lone.start(1) - lone.start(0)] + rb"\ufffd"


def _field_of(body: bytes, lone: re.Match[bytes]) -> str | None:
    """The field holding the escape `lone` found (`messages[0].content`), read from the body
    with a mark in its place; None when the body does not decode even so, or at the top."""
    marked = body[: lone.start(1)] + msgspec.json.encode(_MARK)[1:-1] + body[lone.end(1) :]
    marked = _LONE_SURROGATE.sub(_replaced, marked)  # any other lone one
    try:
        doc = msgspec.json.decode(marked)
    except (msgspec.DecodeError, RecursionError):
        return None
    todo: list[tuple[str, object]] = [("", doc)]
    while todo:  # a walk without recursion: the body may nest deep
        path, value = todo.pop()
        if isinstance(value, str) and _MARK in value:
            return path or None
        if isinstance(value, dict):
            if any(_MARK in key for key in value):
                return path or None
            todo.extend((f"{path}.{k}" if path else k, v) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def check_depth(req: object) -> None:
    """Every free-form value of `req` within `MAX_DEPTH` (else the client's 400)."""
    for param, value in _free_form(req):
        check_nesting(param, value)


def check_nesting(param: str, value: object) -> None:
    """A free-form value nested past `MAX_DEPTH` is the client's 400."""
    if _depth(value, MAX_DEPTH) > MAX_DEPTH:
        raise InvalidRequest(f"{param} nests deeper than {MAX_DEPTH} levels", param=param)


# Free-form fields, on whichever API's request has them (Responses and Messages too).
_FREE_FORM = (
    "kv_transfer_params",
    "response_format",
    "structured_outputs",
    "guided_json",
    "chat_template_kwargs",
)


def _free_form(req: object) -> list[tuple[str, object]]:
    """The free-form JSON of a request body, by parameter."""
    fields = [(name, getattr(req, name)) for name in _FREE_FORM if hasattr(req, name)]
    if isinstance(req, ChatCompletionRequest | TokenizeChatRequest):
        fields += [
            (f"tools[{i}].function.parameters", t.function.parameters)
            for i, t in enumerate(req.tools or [])
        ]
        fields += [
            (f"messages[{i}].tool_calls", m.tool_calls)
            for i, m in enumerate(req.messages)
            if m.tool_calls
        ]
    return fields


def _depth(value: object, limit: int) -> int:
    """How deep `value` nests (a scalar: 0), counted no further than past `limit`."""
    if limit < 0:
        return 1
    items: Iterable[object]
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, list | tuple):
        items = value
    elif isinstance(value, Struct):
        items = [getattr(value, f) for f in value.__struct_fields__]
    else:
        return 0
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)
