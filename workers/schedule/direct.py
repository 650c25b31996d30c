"""A request published straight to `tw.sched.<model>` as vLLM's token-only generate body,
without the output context render writes: the schedule stage makes that context from the
vLLM fields, or refuses the request before any engine runs it.

The answer is a completions response (`text_completion` objects): its `id` is `cmpl-` and
the request id, `model` the served name, `created` the moment it was taken, `usage` counts
the prompt; `stream`, `stream_options`, `return_token_ids` and every output field of the
sampling parameters (`n`, `stop`, `logprobs`, `min_tokens`, the detokenizer's flags) are
honoured as vLLM's generate route honours them. What render would have refused is refused
here, with the same words: another model, token IDs outside the vocabulary, a budget past
the context, `n` below 1, a constraint past the request limits (`tokenway.limits`).
"""

from __future__ import annotations

import time

import msgspec

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
) -> GenerateRequest:
    """The request with the context render would have given it; `InvalidRequest` (or
    `ModelNotFound`) for what it would have refused."""
    check_model(request.model or None, model)
    params = request.sampling_params
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
        api="completion",
        response_id=f"cmpl-{request.request_id}",
        model=model,
        created=int(time.time()),
        prompt_tokens=len(request.token_ids),
        prompt_tail=request.token_ids[-SEED_TOKENS:],
        stream=request.stream,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage_stats=bool(opts and opts.continuous_usage_stats),
        return_token_ids=bool(request.return_token_ids),
        **output_options(params),
    )
    return msgspec.structs.replace(
        request, model=model, sampling_params=params, prompts=several, context=context
    )
