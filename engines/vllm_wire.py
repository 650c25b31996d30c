"""vLLM's wire, both routes a bridge may call, decoded into one answer shape.

- The token-only generate route (vLLM 0.33 `protocol.py`: GenerateRequest,
  Generate[Tokens][Stream]Response): what every attempt uses.
- The OpenAI completions route (`/v1/completions`, CompletionRequest and
  Completion[Stream]Response) with a token-ID prompt: the native fallback for a server
  without the token-only route. Its answers are turned into the generate route's shape, so
  the engine handles one kind of answer.
"""

from __future__ import annotations

import contextlib

import msgspec
from msgspec import Struct

from tokenway.api.generate import Logprob, LogprobContent, Logprobs
from tokenway.wire import EngineWork, SamplingParams

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
COMPLETIONS_PATH = "/v1/completions"
HEALTH_PATH = "/health"
# vLLM's serving.py runs a generate request under this prefix + the request_id we send.
REQUEST_ID_PREFIX = "generate-tokens-"
# ... and a completions request under this prefix + request_id + the prompt's index.
COMPLETIONS_ID_PREFIX = "cmpl-"
# How the completions route names a logprob candidate when asked for IDs, not text.
TOKEN_ID_PLACEHOLDER = "token_id:"

# Our sampling fields that vLLM's SamplingParams takes and that matter for token output.
# Left out: `stop` (strings: derender matches them; a --tokens-only server rejects them),
# `prompt_logprobs` (no place for them in an engine step), and the detokenizer's knobs
# (`skip_special_tokens`, `spaces_between_special_tokens`, `include_stop_str_in_output`).
PASSED_SAMPLING_FIELDS = frozenset(
    "n temperature top_p top_k min_p seed max_tokens min_tokens stop_token_ids ignore_eos "
    "presence_penalty frequency_penalty repetition_penalty logprobs logit_bias "
    "structured_outputs thinking_token_budget".split()
)


# -- the generate route ---------------------------------------------------------------------


class VllmGenerateRequest(Struct, kw_only=True, omit_defaults=True):
    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, object]
    stream: bool
    output_mode: str  # always "tokens": no tokenizer on our engines' side
    stream_options: dict[str, bool] | None = None
    priority: int = 0
    kv_transfer_params: dict[str, object] | None = None
    cache_salt: str | None = None
    reasoning_ended: bool | None = None  # whether the grammar applies from the first token


class Choice(Struct):
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: Logprobs | None = None


class VllmErrorInfo(Struct):
    message: str = ""
    type: str = ""
    code: int | None = None


class PromptTokensDetails(Struct):
    cached_tokens: int | None = None


class Usage(Struct):
    completion_tokens: int | None = None
    # with --enable-prompt-tokens-details: the prompt tokens found in the prefix cache
    prompt_tokens_details: PromptTokensDetails | None = None

    @property
    def cached_tokens(self) -> int | None:
        details = self.prompt_tokens_details
        return None if details is None else details.cached_tokens


class Answer(Struct):
    """A stream event or a whole response; an error event is `{"error": {...}}`."""

    request_id: str | None = None
    choices: list[Choice] = []
    usage: Usage | None = None  # the closing stream event; whole responses
    kv_transfer_params: dict[str, object] | None = None  # whole responses only
    error: VllmErrorInfo | None = None


def vllm_sampling_params(params: SamplingParams) -> dict[str, object]:
    """Ours → vLLM's: only fields set away from their defaults, so vLLM's defaults (and its
    server-side `max_tokens`) apply to the rest."""
    fields = msgspec.to_builtins(params)  # omit_defaults: only what was set
    return {k: v for k, v in fields.items() if k in PASSED_SAMPLING_FIELDS}


def vllm_request(work: EngineWork, request_id: str, stream: bool) -> VllmGenerateRequest:
    return VllmGenerateRequest(
        request_id=request_id,
        token_ids=work.token_ids,
        # no detokenization: we want token IDs
        sampling_params=vllm_sampling_params(work.sampling_params) | {"detokenize": False},
        stream=stream,
        output_mode="tokens",
        stream_options={"include_usage": True} if stream else None,
        priority=work.priority,
        kv_transfer_params=work.kv_transfer_params,
        cache_salt=work.cache_salt,
        reasoning_ended=work.reasoning_ended,
    )


def error_message(body: bytes) -> str:
    """vLLM's `{"error": {"message": …}}`, FastAPI's `{"detail": …}`, or the body itself."""
    with contextlib.suppress(msgspec.DecodeError):
        doc = msgspec.json.decode(body)
        if isinstance(doc, dict):
            error = doc.get("error")
            if isinstance(error, dict) and "message" in error:
                return str(error["message"])
            if "detail" in doc:
                return str(doc["detail"])
    return body.decode("utf-8", "replace").strip()[:500] or "(empty body)"


_generate_decoder = msgspec.json.Decoder(Answer)


def decode_generate(data: str | bytes) -> Answer:
    return _generate_decoder.decode(data)


# -- the completions route (native fallback) ------------------------------------------------


def completions_request(work: EngineWork, request_id: str) -> dict[str, object]:
    """A streamed CompletionRequest whose prompt is the token IDs, answering with IDs.

    `max_tokens` always goes (null: up to the context), since this route's default is 16.
    `return_token_ids` puts each delta's IDs in its choice; `return_tokens_as_token_ids`
    names logprob candidates `token_id:<id>` rather than by text.
    """
    body: dict[str, object] = {
        "prompt": work.token_ids,
        **vllm_sampling_params(work.sampling_params),
        "max_tokens": work.sampling_params.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "request_id": request_id,
    }
    if work.sampling_params.logprobs is not None:
        body["return_tokens_as_token_ids"] = True
    if work.priority:
        body["priority"] = work.priority
    if work.kv_transfer_params is not None:
        body["kv_transfer_params"] = work.kv_transfer_params
    if work.cache_salt is not None:
        body["cache_salt"] = work.cache_salt
    return body


class _CompletionLogprobs(Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []


class _CompletionChoice(Struct):
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None


class _CompletionChunk(Struct):
    id: str | None = None
    choices: list[_CompletionChoice] = []
    usage: Usage | None = None
    kv_transfer_params: dict[str, object] | None = None
    error: VllmErrorInfo | None = None


_completion_decoder = msgspec.json.Decoder(_CompletionChunk)


def _placeholder_id(name: str) -> int:
    if not name.startswith(TOKEN_ID_PLACEHOLDER):
        raise ValueError(f"logprob candidate {name!r} is not named {TOKEN_ID_PLACEHOLDER}<id>")
    return int(name[len(TOKEN_ID_PLACEHOLDER) :])


def _completion_logprobs(ids: list[int], lp: _CompletionLogprobs) -> Logprobs:
    """Completions logprobs (per token: its logprob, candidates by name, sampled first) →
    the generate route's, without ranks (this route has none)."""
    if len(lp.token_logprobs) != len(ids) or len(lp.top_logprobs) != len(ids):
        raise ValueError(f"{len(lp.token_logprobs)} logprobs for {len(ids)} tokens")
    content = []
    for tid, logprob, top in zip(ids, lp.token_logprobs, lp.top_logprobs, strict=True):
        candidates = [Logprob(_placeholder_id(k), v) for k, v in (top or {}).items()]
        value = float("-inf") if logprob is None else logprob
        content.append(LogprobContent(tid, value, top_logprobs=candidates))
    return Logprobs(content=content)


def decode_completion(data: str | bytes) -> Answer:
    """One completions stream event, in the generate route's shape."""
    chunk = _completion_decoder.decode(data)
    choices = []
    for c in chunk.choices:
        if c.token_ids is None:
            raise ValueError(f"choice {c.index} carries no token_ids (return_token_ids unset?)")
        logprobs = None if c.logprobs is None else _completion_logprobs(c.token_ids, c.logprobs)
        choices.append(Choice(c.index, c.finish_reason, c.stop_reason, c.token_ids, logprobs))
    return Answer(
        request_id=chunk.id,
        choices=choices,
        usage=chunk.usage,
        kv_transfer_params=chunk.kv_transfer_params,
        error=chunk.error,
    )
