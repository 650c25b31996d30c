"""A batch or RL job publishing vLLM's token-only generate body straight to
`tw.sched.<model>`, with no tokenway output context: the answer is whole (id, model,
created, usage), every vLLM field the body sets is honoured, and what render would refuse
is refused before any engine runs it."""

from __future__ import annotations

import asyncio
import json
import secrets

import msgspec
import nats
import pytest

from tests.conftest import Stack
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.ledger_follow import Follow
from tokenway.wire import (
    Delivered,
    Failed,
    GenerateRequest,
    SamplingParams,
    StreamOptions,
    StructuredOutputs,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [6366, 33, 1040, 285]


async def publish(stack: Stack, request: GenerateRequest) -> list[Delivered]:
    """Publish as a direct client does; every output event up to the terminal one, read
    from the ledger as it is stored."""
    reply, rid = f"job{secrets.token_hex(3)}", request.request_id
    nc = await nats.connect(stack.observer)
    follow = Follow(nc.jetstream(), bus.out_subject(reply, rid), rid)
    try:
        await follow.open()
        payload, headers = msgspec.msgpack.encode(request), ledger.Identity(rid, reply).headers()
        await nc.jetstream().publish(bus.sched_subject(stack.model), payload, headers=headers)
        got: list[Delivered] = []
        async with asyncio.timeout(30):
            async for events in follow.events():
                got += events
        return got
    finally:
        await follow.close()
        await nc.close()


def body(**params: object) -> GenerateRequest:
    given = {"max_tokens": 8, "seed": 3, "ignore_eos": True, **params}
    sampling = msgspec.convert(given, SamplingParams)
    return GenerateRequest(request_id=secrets.token_hex(8), token_ids=PROMPT,
                           sampling_params=sampling)  # fmt: skip


def received(stack: Stack, rid: str) -> int:
    return sum(w.request_id == rid for b in stack.by_name["engine"] for w in b.engine.received)


async def test_a_token_only_body_gets_a_whole_response_with_ids_and_logprobs(
    stack: Stack,
) -> None:
    request = msgspec.structs.replace(body(n=2, logprobs=1), return_token_ids=True)
    (msg,) = await publish(stack, request)
    assert msg.kind == h.KIND_RESPONSE
    doc = json.loads(msg.payload)
    assert doc["id"] == f"cmpl-{request.request_id}" and doc["object"] == "text_completion"
    assert doc["model"] == stack.model and doc["created"] > 0
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    for choice in doc["choices"]:
        ids, lp = choice["token_ids"], choice["logprobs"]
        assert len(ids) == 8 and len(lp["token_logprobs"]) == 8
        assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])  # the top one, the sampled
        assert choice["finish_reason"] == "length"


async def test_its_stop_strings_and_stream_options_are_honoured(stack: Stack) -> None:
    (whole,) = await publish(stack, body(max_tokens=30))
    text = json.loads(whole.payload)["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    before = text[: text.index(stop)]
    (stopped,) = await publish(stack, body(max_tokens=30, stop=[stop]))
    choice = json.loads(stopped.payload)["choices"][0]
    assert choice["text"] == before and choice["finish_reason"] == "stop"
    streamed = msgspec.structs.replace(
        body(max_tokens=30), stream=True, stream_options=StreamOptions(include_usage=True)
    )
    msgs = await publish(stack, streamed)
    assert {m.kind for m in msgs[:-1]} == {h.KIND_CHUNK}
    assert msgs[-1].kind == h.KIND_END
    docs = [json.loads(e[len("data: ") :]) for m in msgs for e in m.payload.decode().split("\n\n")
            if e.startswith("data: {")]  # fmt: skip
    assert "".join(c["text"] for d in docs for c in d["choices"]) == text
    assert docs[-1]["usage"]["prompt_tokens"] == 4 and not docs[-1]["choices"]
    assert {d["id"] for d in docs} == {f"cmpl-{streamed.request_id}"}


@pytest.mark.parametrize(
    ("change", "status", "param", "says"),
    [
        ({"token_ids": [6366, 10**6]}, 400, "token_ids", "outside the vocabulary"),
        ({"model": "another"}, 404, "model", "does not exist"),
        ({"sampling_params": SamplingParams(n=0)}, 400, "sampling_params.n", "at least 1"),
        ({"sampling_params": SamplingParams(max_tokens=10**7)}, 400,
         "sampling_params.max_tokens", "maximum context length"),
        ({"sampling_params": SamplingParams(structured_outputs=StructuredOutputs(
            grammar='start: "' + "t" * 70_000 + '"'))}, 400,
         "sampling_params.structured_outputs", "--max-grammar-bytes"),
        # a constraint of no kind made the engine fail every attempt, breakers struck
        ({"sampling_params": SamplingParams(structured_outputs=StructuredOutputs())}, 400,
         "sampling_params.structured_outputs", "gives no constraint"),
    ],
    ids=["vocabulary", "model", "n", "budget", "grammar", "no-kind"],
)  # fmt: skip
async def test_what_render_would_refuse_is_an_error_event_before_any_engine_runs(
    stack: Stack, change: dict, status: int, param: str, says: str
) -> None:
    request = msgspec.structs.replace(body(), **change)
    (msg,) = await publish(stack, request)
    assert msg.kind == h.KIND_ERROR and isinstance(msg, Failed) and msg.status == status
    error = json.loads(msg.payload)["error"]
    assert error["param"] == param and says in error["message"], error
    assert received(stack, request.request_id) == 0


async def test_a_grammar_that_recurses_deep_is_compiled_on_a_stack_with_room(stack: Stack) -> None:
    """Within the limits, a grammar whose rules chain 3,000 deep reaches the engine: it compiles
    it on a big stack (on a thread's own it segfaulted, and every stage of `up` with it)."""
    chain = "\n".join(f'r{i}: "t" r{i + 1}?' for i in range(3000))
    grammar = f'start: r0\n{chain}\nr3000: "t"'
    request = body(max_tokens=4, ignore_eos=False,
                   structured_outputs=StructuredOutputs(grammar=grammar))  # fmt: skip
    (msg,) = await publish(stack, request)
    assert msg.kind == h.KIND_RESPONSE, msg.payload
    assert set(json.loads(msg.payload)["choices"][0]["text"]) <= {"t"}
