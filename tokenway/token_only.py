"""A token-only request (vLLM's generate body, token IDs in) made ready for an owner: the
output context render writes for a text request, made from the vLLM fields, or the request
refused before any engine runs it.

Two take it: the schedule stage, for a request published straight to `tw.sched.<model>`
without a context, whose answer is a completions response (`text_completion` objects: its
`id` is `cmpl-` and the request id); and render, for `POST /inference/v1/generate`, whose
answer is vLLM's generate response (`tokenway.api.generate`). In both, `model` is the served
name, `created` the moment it was taken, `usage` counts the prompt; `stream`,
`stream_options`, `return_token_ids` and every output field of the sampling parameters (`n`,
`stop`, `logprobs`, `min_tokens`, the detokenizer's flags) are honoured as vLLM's generate
route honours them. What render would have refused is refused with the same words: another
model, token IDs outside the vocabulary, a budget past the context, `n` below 1, a
constraint past the request limits (`tokenway.limits`).
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from tokenway.constraints import check_form
from tokenway.errors import InvalidRequest, check_model
from tokenway.limits import DEFAULT_LIMITS, RequestLimits, check_constraint
from tokenway.model import ModelInfo
from tokenway.sampling import budget, output_options
from tokenway.wire import SEED_TOKENS, GenerateRequest, OutputContext, Prompt


def is_direct(request: GenerateRequest) -> bool:
    """Published without render's output context (render always names the response)."""
    return not request.context.response_id


def completed(
    request: GenerateRequest,
    model: str,
    info: ModelInfo,
    clip: bool = False,
    limits: RequestLimits = DEFAULT_LIMITS,
    *,
    api: Literal["completion", "generate"] = "completion",
    response_id: str = "",
    stream_interval: int = 1,
) -> GenerateRequest:
    """The request with the context render would have given it; `InvalidRequest` (or
    `ModelNotFound`) for what it would have refused. `response_id`: the answer's id
    (else `cmpl-` and the request id)."""
    check_model(request.model or None, model)
    params = request.sampling_params
    if params.structured_outputs is not None:  # what an engine could not decode (or a bug's)
        check_form(params.structured_outputs, "sampling_params.structured_outputs")
    check_constraint(params.structured_outputs, limits, "sampling_params.structured_outputs")
    if params.n < 1:
        raise InvalidRequest(f"n must be at least 1, got {params.n}.", param="sampling_params.n")
    prompts = [request.token_ids, *(p.token_ids for p in request.prompts or ())]
    bad = next((t for ids in prompts for t in ids if t >= info.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary", param="token_ids")

    def left(ids: list[int], asked: int | None) -> int:
        return budget(
            len(ids),
            asked,
            info.context_length,
            clip,
            prompt_param="token_ids",
            budget_param="sampling_params.max_tokens",
        )

    several = None
    if request.prompts:  # token_ids is the first prompt's, as render sends them
        several = [
            Prompt(
                token_ids=p.token_ids,
                max_tokens=left(p.token_ids, p.max_tokens or params.max_tokens),
            )
            for p in request.prompts
        ]
    params = msgspec.structs.replace(params, max_tokens=left(request.token_ids, params.max_tokens))
    if params.min_tokens > (params.max_tokens or 0):
        raise InvalidRequest(
            f"min_tokens must be less than or equal to max_tokens={params.max_tokens}, "
            f"got {params.min_tokens}.",
            param="sampling_params.min_tokens",
        )
    opts = request.stream_options
    context = OutputContext(
        api=api,
        response_id=response_id or f"cmpl-{request.request_id}",
        model=model,
        created=int(time.time()),
        prompt_tokens=len(request.token_ids),
        prompt_tail=request.token_ids[-SEED_TOKENS:],
        stream=request.stream,
        stream_interval=stream_interval,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage_stats=bool(opts and opts.continuous_usage_stats),
        return_token_ids=bool(request.return_token_ids),
        **output_options(params),
    )
    return msgspec.structs.replace(
        request, model=model, sampling_params=params, prompts=several, context=context
    )
