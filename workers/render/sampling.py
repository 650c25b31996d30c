"""OpenAI request fields → vLLM sampling parameters (their budget: tokenway/sampling.py)."""

from __future__ import annotations

import msgspec

from tokenway.api.openai import ChatCompletionRequest, CompletionRequest
from tokenway.errors import InvalidRequest
from tokenway.wire import GenerateRequest, Prompt, SamplingParams, StructuredOutputs


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def reject_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Features whose output stage is not built yet: refuse clearly rather than ignore."""
    if any(not s for s in _stops(req.stop)):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    if isinstance(req, ChatCompletionRequest) and req.echo:
        raise InvalidRequest("echo is not supported for chat yet", param="echo")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequest("best_of is not supported", param="best_of")


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens or req.max_tokens
    return req.max_tokens


def requested_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many top candidates per token (0: the sampled one only); None: no logprobs."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    structured_outputs: StructuredOutputs | None = None,
) -> SamplingParams:
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=_stops(req.stop),
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias,
        logprobs=requested_logprobs(req),
        structured_outputs=structured_outputs,
        thinking_token_budget=req.thinking_token_budget
        if isinstance(req, ChatCompletionRequest)
        else None,
    )


# What derender and the scheduler act on: the engine must be asked exactly what the request's
# OutputContext and budget say, whoever rendered the prompt.
OUTPUT_FIELDS = (
    "n",
    "max_tokens",
    "min_tokens",
    "stop",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


def keep_output_fields(remote: SamplingParams, ours: SamplingParams) -> SamplingParams:
    """A render server's sampling parameters (its generation-config defaults included), with
    the fields tokenway's own output stage acts on taken from tokenway's parse."""
    return msgspec.structs.replace(remote, **{name: getattr(ours, name) for name in OUTPUT_FIELDS})


# What each output token adds to a whole (non-streaming) response at the least: a byte of
# text, its ID listed when asked for, its logprob entry (the token, its number, an offset)
# and every top candidate's.
_LEAST_TEXT, _LEAST_ID, _LEAST_LOGPROB, _LEAST_CANDIDATE = 1, 2, 20, 15


def _must(budget: int | None, params: SamplingParams) -> int:
    """Tokens a choice generates whatever the model does: all of its budget without EOS."""
    if params.ignore_eos:
        return budget or 0
    return min(params.min_tokens, budget) if budget else params.min_tokens


def least_response_bytes(request: GenerateRequest) -> int:
    """How big the request's whole response will be at the least: what its choices must
    generate (`min_tokens`, or `max_tokens` with `ignore_eos`) times the least per token."""
    params, ctx = request.sampling_params, request.context
    budgets = [p.max_tokens or params.max_tokens for p in request.prompts or ()]
    must = sum(_must(b, params) for b in budgets or [params.max_tokens])
    per_token = _LEAST_TEXT + _LEAST_ID * ctx.return_token_ids
    if ctx.logprobs is not None:
        per_token += _LEAST_LOGPROB + _LEAST_CANDIDATE * ctx.logprobs
    return max(params.n, 1) * must * per_token


def tokens_charged(request: GenerateRequest) -> int:
    """What a tenant's tokens-per-minute limit is charged: every prompt plus its budget
    (the context left where no max_tokens was asked for) for each of the n choices."""
    params, n = request.sampling_params, max(request.sampling_params.n, 1)
    prompts = request.prompts or [Prompt(token_ids=request.token_ids)]
    return sum(len(p.token_ids) + (p.max_tokens or params.max_tokens or 0) * n for p in prompts)
