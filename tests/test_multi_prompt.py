"""Multi-prompt completions end to end: one sub-request per prompt, merged into one answer
with global choice indexes, one usage and one [DONE]; failures and departures cancel and
release every sibling."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import openai
import pytest

from tests.conftest import Stack
from tests.test_scheduling import client, model, pipeline, sim
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.wire import GenerateRequest, OutputContext, Prompt, SamplingParams
from workers.schedule.fanout import Parent

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS: list[Any] = ["Once upon a time", "The bus carries", [6366, 33, 1040]]


def sse(raw: str) -> list[dict]:
    """The documents of the `data:` events, in order ([DONE] left out)."""
    return [json.loads(e[len("data: ") :]) for e in raw.split("\n\n") if e.startswith("data: {")]


async def committed(stack: Stack, rid: str) -> list[list[dict]]:
    """The documents of each event the request's ledger holds, in order."""
    nc = await nats.connect(stack.observer)
    try:
        found = await ledger.read(nc.jetstream(), stack.ingress.ingress_id, rid)
        return [sse(e.payload.decode()) for e in (found.events if found else [])]
    finally:
        await nc.close()


async def post_stream(url: str, body: dict) -> tuple[str, str]:
    """The raw SSE text and the request id."""
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            raw = b"".join([part async for part in resp.aiter_bytes()]).decode()
            return raw, resp.headers["x-tokenway-stream-id"]


def by_index(docs: list[dict]) -> dict[int, dict[str, Any]]:
    """Per choice index: its text, token ids, prompt ids, logprob tokens and finish."""
    out: dict[int, dict[str, Any]] = {}
    for doc in docs:
        for c in doc["choices"]:
            o = out.setdefault(c["index"], {"text": "", "ids": [], "prompt": None, "lp": []})
            o["text"] += c["text"]
            o["ids"] += c.get("token_ids") or []
            o["prompt"] = o["prompt"] or c.get("prompt_token_ids")
            o["lp"] += (c.get("logprobs") or {}).get("tokens", [])
            o["finish"] = c["finish_reason"] or o.get("finish")
    return out


async def leftovers_gone(stack: Stack) -> None:
    """Every sub-request released, its capacity and routes gone, the request acked."""
    schedule = stack.by_name["schedule"][0]
    async with asyncio.timeout(20):
        await schedule.empty.wait()
        for engine in stack.by_name.get("engine", []):
            await engine.idle.wait()
        await stack.ingress.router.idle.wait()
    assert not schedule.fanout.router.slots
    assert not schedule.dispatcher.seqs and not schedule.dispatcher.tokens


async def test_streamed_prompts_merge_with_global_indexes_one_usage_and_one_done(
    stack: Stack,
) -> None:
    usage = {"include_usage": True, "continuous_usage_stats": True}
    common = {"max_tokens": 12, "seed": 4, "stream": True, "echo": True, "logprobs": 1,
              "return_token_ids": True, "ignore_eos": True, "stream_options": usage}  # fmt: skip
    raw, _ = await post_stream(stack.url, {"prompt": PROMPTS, **common})
    assert raw.count("data: [DONE]") == 1 and raw.endswith("data: [DONE]\n\n")
    docs = sse(raw)
    merged = by_index([d for d in docs if d["choices"]])
    assert sorted(merged) == [0, 1, 2]
    prompt_total = completion_total = 0
    for k, prompt in enumerate(PROMPTS):
        alone_raw, _ = await post_stream(stack.url, {"prompt": prompt, **common})
        alone_docs = sse(alone_raw)
        alone = by_index([d for d in alone_docs if d["choices"]])[0]
        assert merged[k] == alone  # text (echo included), token ids, prompt ids, logprobs
        alone_usage = alone_docs[-1]["usage"]
        prompt_total += alone_usage["prompt_tokens"]
        completion_total += alone_usage["completion_tokens"]
        # continuous usage: each chunk counts its own prompt and choice, as vLLM does
        for d in docs:
            if d["choices"] and d["choices"][0]["index"] == k:
                assert d["usage"]["prompt_tokens"] == alone_usage["prompt_tokens"]
    final = docs[-1]
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": prompt_total, "completion_tokens": completion_total,
                              "total_tokens": prompt_total + completion_total}  # fmt: skip
    assert sum(1 for d in docs if not d["choices"]) == 1  # one usage chunk, at the end


async def test_non_streamed_prompts_with_n_merge_into_one_response(stack: Stack) -> None:
    openai_client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
    kwargs = dict(model="deepseek-v4", max_tokens=9, seed=11, n=2)
    resp = await openai_client.completions.create(prompt=PROMPTS, **kwargs)
    assert [c.index for c in resp.choices] == list(range(6))  # prompt × n
    prompt_total = completion_total = 0
    for k, prompt in enumerate(PROMPTS):
        alone = await openai_client.completions.create(prompt=prompt, **kwargs)
        got = resp.choices[2 * k : 2 * k + 2]
        assert [c.text for c in got] == [c.text for c in alone.choices]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in alone.choices]
        prompt_total += alone.usage.prompt_tokens
        completion_total += alone.usage.completion_tokens
    assert resp.usage.prompt_tokens == prompt_total
    assert resp.usage.completion_tokens == completion_total
    assert resp.usage.total_tokens == prompt_total + completion_total
    await leftovers_gone(stack)


async def test_a_merged_stream_resumes_from_the_ledger(stack: Stack) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 10, "seed": 2, "stream": True}
    raw, rid = await post_stream(stack.url, body)
    async with httpx.AsyncClient(timeout=30) as http:
        resumed = await http.get(f"{stack.url}/v1/streams/{rid}", headers={"Last-Event-ID": "1"})
    assert resumed.status_code == 200
    assert sse(resumed.text) == sse(raw)[1:]
    assert resumed.text.count("data: [DONE]") == 1


async def test_nothing_is_sent_before_every_prompt_has_begun(nats_url: str, tmp_path: Path) -> None:
    # Room for two sequences: the third prompt waits until the first two are done.
    async with pipeline(nats_url, tmp_path, [sim("two-seqs", max_seqs=2)]) as (stack, _):
        body = {"model": model(stack), "prompt": PROMPTS, "max_tokens": 6, "stream": True,
                "ignore_eos": True}  # fmt: skip
        _, rid = await post_stream(stack.url, body)
        first_docs = (await committed(stack, rid))[0]
        # The first ledger message holds the first two prompts' whole output and the third's start.
        finished = {c["index"] for d in first_docs for c in d["choices"] if c["finish_reason"]}
        assert finished == {0, 1}
        assert 2 in {c["index"] for d in first_docs for c in d["choices"]}


async def test_a_prompt_waiting_too_long_for_its_siblings_overflows_explicitly(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("overflow", max_seqs=2)]
    async with pipeline(nats_url, tmp_path, engines, fanout_buffer=3, fanout_retries=0) as (
        stack,
        _,
    ):
        with pytest.raises(openai.APIStatusError) as info:
            await client(stack).completions.create(
                model=model(stack), prompt=PROMPTS, max_tokens=20, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        assert info.value.status_code == 502
        assert "more than 3 output events waited" in str(info.value)
        await leftovers_gone(stack)


async def test_a_prompt_failing_before_output_retries_the_whole_request(
    nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nats_url, tmp_path, [sim("fails-once", fail_first=1)]) as (stack, (e,)):
        resp = await client(stack).completions.create(
            model=model(stack), prompt=PROMPTS, max_tokens=5
        )
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert e.started > 3  # a prompt failed, the request ran again
        await leftovers_gone(stack)


async def test_a_prompt_failing_ends_the_request_with_an_explicit_error(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("fails-always", fail_first=100)]
    # No relays either: each would wait out the failing engine's breaker back-off.
    async with pipeline(nats_url, tmp_path, engines, fanout_retries=0, relay_attempts=0) as (
        stack,
        _,
    ):
        with pytest.raises(openai.APIStatusError) as info:
            await client(stack).completions.create(model=model(stack), prompt=PROMPTS, max_tokens=5)
        assert info.value.status_code == 502
        assert "prompt " in str(info.value) and "simulated failure" in str(info.value)
        await leftovers_gone(stack)


async def test_a_prompt_failing_after_output_ends_the_stream_with_an_error_event(
    nats_url: str, tmp_path: Path
) -> None:
    # The first prompt to start fails after 30 tokens; by then every stream has begun. No
    # relays: that prompt's own owner cannot continue it, so the whole request ends.
    engines = [dataclasses.replace(sim("fails-later", fail_after=30), itl=0.005)]
    async with pipeline(nats_url, tmp_path, engines, relay_attempts=0) as (stack, (engine,)):
        body = {"model": model(stack), "prompt": PROMPTS, "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        raw, _ = await post_stream(stack.url, body)
        events = sse(raw)
        error = events[-1]
        assert "simulated failure after 30 tokens" in error["error"]["message"]
        assert error["error"]["message"].startswith("prompt ")
        assert len(events) > 1 and raw.count("data: [DONE]") == 1
        assert engine.started == 3  # no retry after output
        await leftovers_gone(stack)
        assert engine.running == 0  # the siblings were aborted, not left to run


def texts(raw: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for doc in sse(raw):
        for c in doc.get("choices", []):
            out[c["index"]] = out.get(c["index"], "") + c["text"]
    return out


async def test_a_prompt_whose_engine_fails_after_output_is_relayed_within_the_merge(
    nats_url: str, tmp_path: Path
) -> None:
    """Each prompt is an ordinary request to its owner: an engine failure is relayed there,
    and the merged stream never notices."""
    engines = [dataclasses.replace(sim("fails-once", fail_after=30), itl=0.005)]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (engine,)):
        body = {"model": model(stack), "prompt": PROMPTS, "max_tokens": 120, "stream": True,
                "ignore_eos": True, "seed": 5}  # fmt: skip
        relayed, _ = await post_stream(stack.url, body)
        assert engine.started == 4  # three prompts and one relay
        clean, _ = await post_stream(stack.url, body)
        assert texts(relayed) == texts(clean) and len(texts(clean)) == 3
        assert relayed.count("data: [DONE]") == 1 and '"error"' not in relayed
        await leftovers_gone(stack)


async def test_a_client_leaving_cancels_and_releases_every_prompt(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule = stack.by_name["schedule"][0]
    fanned, finish = schedule.fanout.router.ingress_id, schedule._finish
    at_exit: list[list[str]] = []  # its prompts still owned as the request lets go

    async def watched(r: Any) -> None:
        if isinstance(r, Parent):
            at_exit.append([o.rid for o in schedule.requests.values() if o.reply == fanned])
        await finish(r)

    monkeypatch.setattr(schedule, "_finish", watched)
    body = {"prompt": PROMPTS, "stream": True, "max_tokens": 100_000, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            async for part in resp.aiter_bytes():
                assert b"data: " in part
                break  # the client leaves after its first chunk
        owned = schedule.requests.values()
        assert any(isinstance(r, Parent) for r in owned), "still owned while it streams"
    await leftovers_gone(stack)
    # The fan-out waits for its prompts' release before it lets go itself.
    assert at_exit == [[]]


async def test_a_direct_publisher_sends_several_prompts_and_reads_one_response(
    stack: Stack, nats_url: str
) -> None:
    reply, rid = "batch-multi", f"job{secrets.token_hex(4)}"
    request = GenerateRequest(
        request_id=rid,
        token_ids=[6366, 33],
        sampling_params=SamplingParams(max_tokens=4, seed=1, ignore_eos=True),
        context=OutputContext(response_id=f"cmpl-{rid}", model="deepseek-v4"),
        prompts=[Prompt(token_ids=[6366, 33]), Prompt(token_ids=[1040], max_tokens=2)],
    )
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        out = await js.subscribe(bus.out_subject(reply, rid), stream=bus.OUT_STREAM,
                                 ordered_consumer=True)  # fmt: skip
        await js.publish(bus.sched_subject("deepseek-v4"), msgspec.msgpack.encode(request),
                         headers=ledger.Identity(rid, reply).headers())  # fmt: skip
        msg = await out.next_msg(timeout=30)
    finally:
        await nc.close()
    (whole,) = ledger.events_of(rid, msg)
    assert whole.kind == h.KIND_RESPONSE
    doc = json.loads(whole.payload)
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert doc["usage"]["prompt_tokens"] == 3 and doc["usage"]["completion_tokens"] == 6
