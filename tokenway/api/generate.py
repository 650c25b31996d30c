"""vLLM's token-in/token-out generate route, `POST /inference/v1/generate`: the body a client
sends (vLLM 0.33's `GenerateRequest`) and the documents it gets back in vLLM's `tokens` output
mode (`GenerateTokensResponse`, its stream events and their closing usage event).

A body is checked here as far as it can be without the model: its shape and ranges, and the
fields tokenway cannot honour, refused by name rather than ignored. What vLLM's own render
server writes into a request it renders and its generate route ignores or overwrites
(`output_kind`, `skip_clone`, `detokenize`, `token_offsets`, `parse_context` outside its
`derender` mode, …) is taken and left, so a render server's answer posts here unchanged.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from tokenway.api.bodies import has_wide_int
from tokenway.api.openai import (
    Int64,
    NonNegInt,
    Penalty,
    PosInt,
    Temperature,
    TopK,
    TopP,
    check_nesting,
    decoded,
)
from tokenway.errors import InvalidRequest
from tokenway.wire import (
    MAX_PROMPT_TOKENS,
    LogprobEntry,
    SamplingParams,
    StructuredOutputs,
    TokenId,
    TokenLogprob,
)

# vLLM's engine ids for this route: the prefix and the request's base id
ID_PREFIX = "generate-tokens-"
OUTPUT_MODE = "tokens"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class GenerateSampling(Struct, kw_only=True):
    """vLLM's `SamplingParams` as its generate route reads them, with its ranges."""

    n: Annotated[int, Meta(ge=1, le=128)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    # absent or null: what the context leaves (vLLM's generate route: its server default)
    max_tokens: PosInt | None = None
    min_tokens: NonNegInt = 0
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream_interval: PosInt | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None
    thinking_token_budget: Annotated[int, Meta(ge=-1)] | None = None  # -1: no budget
    # vLLM's internals its render server writes and its generate route overwrites: taken, left
    detokenize: bool = True
    output_kind: int = 0
    skip_clone: bool = False
    flat_logprobs: bool = False
    output_text_buffer_length: int = 0
    skip_reading_prefix_cache: bool | None = None
    routed_experts_prompt_start: int = 0
    # vLLM 0.32's render puts the KV transfer parameters here; nothing else may be
    extra_args: dict[str, Any] | None = None
    # refused when set: nothing behind tokenway's engines acts on them
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: Any = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    repetition_detection: Any = None
    trace_decode_token_ids: Any = None
    watermarking: bool | None = None

    def carried(self) -> SamplingParams:
        """What travels to the engine (`stop` strings are refused before this)."""
        return SamplingParams(
            **{
                name: getattr(self, name)
                for name in SamplingParams.__struct_fields__
                if name not in _NOT_CARRIED
            },
            stop_token_ids=self.stop_token_ids or [],
            thinking_token_budget=None
            if self.thinking_token_budget == -1
            else self.thinking_token_budget,
        )


_NOT_CARRIED = frozenset({"stop", "stop_token_ids", "thinking_token_budget"})
# Set to anything but its default, each is refused: (the parameter, what it asks for)
_UNSUPPORTED = (
    ("prompt_logprobs", "prompt logprobs are"),
    ("prompt_logprob_token_ids", "prompt logprobs are"),
    ("prompt_logprob_start", "prompt logprobs are"),
    ("logprob_token_ids", "logprobs of chosen token ids are"),
    ("allowed_token_ids", "allowed_token_ids are"),
    ("bad_words", "bad_words are"),
    ("repetition_detection", "repetition detection is"),
    ("trace_decode_token_ids", "forced decoding is"),
    ("watermarking", "watermarking is"),
)


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateBody(Struct, kw_only=True):
    """vLLM's `GenerateRequest`, as a client (or a coordinator with a render server's
    answer) posts it."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    sampling_params: GenerateSampling
    request_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    reasoning_ended: bool | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    priority: Int64 = 0
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's render writes these: taken and left (parse_context is its derender mode's)
    token_offsets: Any = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    parse_context: dict[str, Any] | None = None
    # refused when set
    features: Any = None
    content_parts: Any = None
    ec_transfer_params: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


_decoder = msgspec.json.Decoder(GenerateBody)


def decode(body: bytes) -> GenerateBody:
    """A generate body, decoded and checked; what tokenway cannot do is the client's 400."""
    req = decoded(_decoder, body)
    for param in ("kv_transfer_params", "reasoning_parser_kwargs", "parse_context"):
        check_nesting(param, getattr(req, param))
    params = req.sampling_params
    check_nesting("sampling_params.extra_args", params.extra_args)
    check_nesting("sampling_params.structured_outputs", params.structured_outputs)
    _refuse_unsupported(req)
    extra = params.extra_args or {}
    if set(extra) - {"kv_transfer_params"}:
        raise InvalidRequest(
            f"sampling_params.extra_args may carry kv_transfer_params alone, not "
            f"{sorted(set(extra) - {'kv_transfer_params'})}",
            param="sampling_params.extra_args",
        )
    if req.kv_transfer_params is None and isinstance(extra.get("kv_transfer_params"), dict):
        req.kv_transfer_params = extra["kv_transfer_params"]  # where vLLM 0.32's render put it
    if has_wide_int(req.kv_transfer_params):  # carried to the engine as msgpack
        raise InvalidRequest(
            "kv_transfer_params holds an integer outside 64 bits", param="kv_transfer_params"
        )
    if params.seed == -1:
        params.seed = None
    return req


def _refuse_unsupported(req: GenerateBody) -> None:
    params = req.sampling_params
    if req.output_mode != OUTPUT_MODE:
        raise InvalidRequest(
            f"output_mode {req.output_mode!r} is not served here: tokenway's generate route "
            "answers token IDs (output_mode 'tokens'); for text, post the token IDs as the "
            "prompt of /v1/completions",
            param="output_mode",
        )
    if params.stop:
        raise InvalidRequest(
            "stop strings are not supported by the token-only generate route; use "
            "stop_token_ids, or /v1/completions with a token-ID prompt",
            param="sampling_params.stop",
        )
    for name in ("features", "content_parts"):
        if getattr(req, name) is not None:
            raise InvalidRequest("multimodal input is not supported", param=name)
    if req.ec_transfer_params is not None:
        raise InvalidRequest("encoder-cache transfer is not supported", param="ec_transfer_params")
    for name, what in _UNSUPPORTED:
        value = getattr(params, name)
        if value is not None and value != [] and value is not False:
            raise InvalidRequest(
                f"{what} not supported by tokenway's engines",
                param=f"sampling_params.{name}",
            )


def request_id(base: str) -> str:
    """The id a response answers under, as vLLM names its engine request."""
    return ID_PREFIX + base


# -- what the route answers -------------------------------------------------------------------


def _clamped(logprob: float) -> float:
    """-inf and NaN as vLLM writes them."""
    return logprob if math.isfinite(logprob) else -9999.0


class Logprob(Struct):
    """vLLM's generate logprob (by token ID; the engine bridge reads the same wire)."""

    token_id: int
    logprob: float
    rank: int | None = None


class LogprobContent(Logprob):
    top_logprobs: list[Logprob] = []


class Logprobs(Struct):
    content: list[LogprobContent] | None = None


def logprobs(entries: list[LogprobEntry]) -> Logprobs:
    """The engine's entries as vLLM 0.33 answers them: every candidate the engine gave, the
    sampled token first."""
    return Logprobs(
        [
            LogprobContent(
                e.token_id,
                _clamped(e.logprob),
                e.rank,
                [Logprob(t.token_id, _clamped(t.logprob), t.rank) for t in e.top],
            )
            for e in entries
        ]
    )


class TokensChoice(Struct, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]
    routed_experts: None = None
    sampling_mask: None = None
    weight_versions: None = None
    logprobs: Logprobs | None = None


class CachedTokens(Struct):
    cached_tokens: int


class PromptTokensDetails(CachedTokens):
    """A whole response's (vLLM writes its null keys there)."""

    created_cache_tokens: None = None
    multimodal_tokens: None = None


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: None = None


class ClosingUsage(Struct, kw_only=True, omit_defaults=True):
    """The closing usage event's: vLLM leaves out what is null there."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: CachedTokens | None = None


class StreamEvent(Struct, kw_only=True):
    request_id: str
    usage: Usage | ClosingUsage | None
    prompt_token_ids: list[int] | UnsetType = UNSET  # the first event's, when asked
    output_mode: str = OUTPUT_MODE
    choices: list[TokensChoice]


class Response(Struct, kw_only=True):
    request_id: str
    model: str
    created: int
    usage: Usage
    prompt_logprobs: None = None
    prompt_token_id_logprobs: None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: None = None
    metrics: None = None
    kv_transfer_params: dict[str, object] | None = None
    ec_transfer_params: None = None
    output_mode: str = OUTPUT_MODE
    choices: list[TokensChoice]


def logprob_entries(lp: Logprobs | None) -> list[LogprobEntry] | None:
    """vLLM's per-token entries (sampled token first in `top_logprobs`) → ours, as they are."""
    if lp is None or lp.content is None:
        return None
    return [
        LogprobEntry(
            token_id=c.token_id,
            logprob=c.logprob,
            rank=c.rank,
            top=[
                TokenLogprob(token_id=t.token_id, logprob=t.logprob, rank=t.rank)
                for t in c.top_logprobs
            ],
        )
        for c in lp.content
    ]
