"""vLLM's render routes' answer (`POST /v1/chat/completions/render`, `/v1/completions/render`,
`/v1/messages/render`, `/v1/responses/render`): the token-only `GenerateRequest` the request
renders to, in vLLM's JSON shape, made from the same render core that queues requests for
tokenway's own owners. As vLLM names and streams them: a Messages request's id is a chat's
(`chatcmpl-`) and its stream asks for usage on every chunk; a Responses request's id is its
body's `request_id` (else `resp_` and a fresh one, never the client's `X-Request-Id`) and it
names no stream options.

Pure: a rendered `wire.GenerateRequest` in, vLLM's objects out (one per prompt of a
completions request). Deliberately unlike vLLM 0.32: `max_tokens` is always written, where
vLLM leaves out a value equal to its default (16) and a generate server then fills the
context with output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
from msgspec import Struct

from tokenway.api.anthropic import MESSAGE_ID_PREFIX
from tokenway.api.openai import ChatCompletionRequest, OpenAIRequest
from tokenway.parsers import ParserFlags
from tokenway.wire import Api, GenerateRequest, SamplingParams, StreamOptions
from workers.render.core import reasoning_ended

CHAT_PREFIX = "chatcmpl-"


class Streamed(Struct, kw_only=True):
    """Stream options as vLLM's render writes them: both keys."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class Rendered(Struct, kw_only=True):
    """vLLM's `GenerateRequest` as its render server answers it (every field written)."""

    request_id: str
    token_ids: list[int]
    token_offsets: None = None
    features: None = None
    content_parts: None = None
    sampling_params: dict[str, Any]  # as vLLM serializes them (`sampling_json`)
    model: str | None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool = False
    stream_options: Streamed | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, object] | None = None
    ec_transfer_params: None = None


# The float parameters vLLM's serialization keeps even at their defaults, and those its
# greedy sampling (a temperature under 1e-5) resets to their defaults, which it leaves out
_FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature")
_GREEDY_RESET = ("top_p", "top_k", "min_p")
_GREEDY = 1e-5


def sampling_json(params: SamplingParams, stream: bool, extra_args: bool) -> dict[str, Any]:
    """The sampling parameters as vLLM 0.33's render serializes them: what differs from its
    defaults, its floats always, empty lists for its stop lists, and the fields its
    generate route overwrites (`output_kind`, `skip_clone`, …). Deliberately unlike it,
    `max_tokens` is always written (vLLM leaves out a 16). `extra_args`: written empty (a
    Responses request's, which vLLM always writes)."""
    out: dict[str, Any] = msgspec.to_builtins(params)
    for name in (*_FLOATS, "top_p", "min_p"):
        out[name] = float(getattr(params, name))
    if params.temperature < _GREEDY:
        for name in _GREEDY_RESET:
            out.pop(name, None)
    out.setdefault("stop", [])
    out.setdefault("stop_token_ids", [])
    out["bad_words"] = []
    out["output_kind"] = 1 if stream else 2  # vLLM's delta and final-only outputs
    out["skip_clone"] = True
    out["skip_reading_prefix_cache"] = params.prompt_logprobs is not None
    held = max((len(s) for s in params.stop), default=0) - 1
    if held > 0 and not params.include_stop_str_in_output:
        out["output_text_buffer_length"] = held  # the text a stop string may still need
    if extra_args:
        out["extra_args"] = {}
    so = params.structured_outputs
    if so is not None:  # dumped whole, the state vLLM keeps in it too
        fields = msgspec.structs.asdict(so)
        out["structured_outputs"] = fields | {"_backend": None, "_backend_was_auto": False}
    return out


class _Named(Struct):
    model: str | None = None
    request_id: str | None = None  # a Responses request's own id


_named = msgspec.json.Decoder(_Named)
# A Messages stream's options, as vLLM's conversion to a chat request sets them
_MESSAGES_STREAM = StreamOptions(include_usage=True, continuous_usage_stats=True)


Reasoning = tuple[bool | None, dict[str, Any] | None]  # vLLM's reasoning_ended and kwargs


def reasoning_fields(
    api: Api,
    req: OpenAIRequest,
    flags: ParserFlags,
    prompt_ids: Sequence[int],
    vocab: Mapping[str, int],
) -> Reasoning:
    """vLLM's `reasoning_ended` (whether structured output applies from the first token) for
    a chat or Messages render (a Responses render leaves it to the engine, as vLLM's), and
    with a reasoning parser `reasoning_parser_kwargs`: the template kwargs the request
    rendered with (its own, its API's thinking switch, then the generation-prompt
    switches), which the engine's reasoning parser reads. Not vLLM's spelling of them: its
    server adds defaults of its own (`cohere_format`) and says a thinking switch as
    `reasoning_effort`; these are the kwargs that rendered the prompt."""
    parser = flags.reasoning_parser
    ended = None if api == "responses" else reasoning_ended(req, parser, prompt_ids, vocab)
    if not isinstance(req, ChatCompletionRequest) or not flags.reasoning_parser:
        return ended, None
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs |= {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }
    return ended, {"chat_template_kwargs": kwargs}


def rendered(
    generate: GenerateRequest, body: bytes, reasoning: Reasoning = (None, None)
) -> list[Rendered]:
    """One per prompt, in order (chat, Messages and Responses requests have one). `model` is
    the body's, as sent (null when it named none), as vLLM answers it."""
    named = _named.decode(body)
    model, ctx = named.model, generate.context
    base = ctx.response_id
    if ctx.api == "messages":
        base = CHAT_PREFIX + base.removeprefix(MESSAGE_ID_PREFIX)
        if generate.stream:
            generate = msgspec.structs.replace(generate, stream_options=_MESSAGES_STREAM)
    elif ctx.api == "responses":
        base = named.request_id or base
        generate = msgspec.structs.replace(generate, stream_options=None)
    if generate.prompts is None:
        one = _one(generate, base, generate.token_ids, generate.sampling_params, model)
        one.reasoning_ended, one.reasoning_parser_kwargs = reasoning
        return [one]
    return [
        _one(
            generate,
            f"{base}-{i}",
            p.token_ids,
            msgspec.structs.replace(generate.sampling_params, max_tokens=p.max_tokens),
            model,
        )
        for i, p in enumerate(generate.prompts)
    ]


def _one(
    g: GenerateRequest, rid: str, ids: list[int], params: SamplingParams, model: str | None
) -> Rendered:
    opts = g.stream_options
    return Rendered(
        request_id=rid,
        token_ids=ids,
        sampling_params=sampling_json(params, g.stream, g.context.api == "responses"),
        model=model,
        return_token_ids=g.return_token_ids,
        stream=g.stream,
        stream_options=None
        if opts is None
        else Streamed(
            include_usage=opts.include_usage, continuous_usage_stats=opts.continuous_usage_stats
        ),
        cache_salt=g.cache_salt,
        priority=g.priority,
        kv_transfer_params=g.kv_transfer_params,
    )
