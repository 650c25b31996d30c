"""Responses output from derender's core: what its usage counts (issue 31)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.workers.derender.texts import encode
from tokenway.wire import DerenderEntry, OutputContext, ParseContext, ReasoningStart
from workers.derender.core import derender
from workers.derender.detok import Detokenizer

PROMPT = [0, 128803, 6366, 128804]  # BOS <｜User｜>hi<｜Assistant｜>


def run(detok: Detokenizer, ids: list[int], start: ReasoningStart, stream: bool) -> Any:
    """The response for `ids`, whole or as a stream's `response.completed` holds it."""
    ctx = OutputContext(
        api="responses", response_id="resp_r1", model="deepseek-v4", prompt_tokens=4,
        prompt_tail=PROMPT, stream=stream,
        parse=ParseContext(reasoning_parser="deepseek_v3", reasoning_start=start),
    )  # fmt: skip
    result = derender(detok, DerenderEntry(context=ctx, token_ids=ids, finish_reason="length"))
    if not stream:
        return json.loads(result.chunks[0])
    last = result.chunks[-1].decode().split("data: ", 1)[1]
    return json.loads(last)["response"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_are_the_output_tokens_of_the_reasoning(
    detok: Detokenizer, tokenizer: Tokenizer, stream: bool
) -> None:
    """As vLLM counts them: the tokens between the reasoning's markers, not the markers
    themselves, nor the answer after them; none where the output does not reason."""
    thought = encode(tokenizer, ["Let me think about the capital of France."])
    answer = encode(tokenizer, ["It is Paris."])
    end = tokenizer.token_to_id("</think>")
    start = tokenizer.token_to_id("<think>")
    cases = [
        ("open", [*thought, end, *answer], len(thought)),
        ("open", [start, *thought, end, *answer], len(thought)),  # a start marker again
        ("open", thought, len(thought)),  # cut while reasoning
        ("closed", [*answer, end, *answer], 0),
        ("off", [*thought, end, *answer], 0),
    ]
    for mode, ids, reasoning in cases:
        usage = run(detok, ids, mode, stream)["usage"]
        assert usage["output_tokens"] == len(ids)
        assert usage["output_tokens_details"] == {"reasoning_tokens": reasoning}, (mode, ids)
