"""What a request's sampling means to every stage that takes one in: its output budget within
the context, and the output options derender acts on. Render applies them to a rendered
request; the schedule's direct path to a request published with its token IDs."""

from __future__ import annotations

from typing import Any

from tokenway.errors import InvalidRequest
from tokenway.wire import SamplingParams


def budget(
    prompt_tokens: int,
    max_tokens: int | None,
    context_length: int,
    clip: bool = False,
    prompt_param: str = "messages",
    budget_param: str = "max_tokens",
) -> int:
    """The output budget: what the client asked for, or what is left of the context.

    With `clip` (`--context-budget on`) a budget that does not fit is cut to what does, so the
    scheduler's accounting and the engine's `max_tokens` agree; without it, that is a 400
    naming `prompt_param` or `budget_param`.
    """
    if prompt_tokens >= context_length:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens, but the prompt "
            f"has {prompt_tokens} tokens. Please shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None or (clip and prompt_tokens + max_tokens > context_length):
        return context_length - prompt_tokens
    if prompt_tokens + max_tokens > context_length:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens, but "
            f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
            param=budget_param,
            code="context_length_exceeded",
        )
    return max_tokens


def output_options(params: SamplingParams) -> dict[str, Any]:
    """The `OutputContext` fields derender takes from the sampling parameters."""
    return {
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "stop": params.stop,
        "min_tokens": params.min_tokens,
        "n": params.n,
        "logprobs": params.logprobs,
    }
