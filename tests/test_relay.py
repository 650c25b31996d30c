"""Relay, caused for real: an engine closes its socket mid-stream, an engine process is
killed, the schedule worker owning the stream is killed or frozen. Each time the client's
stream goes on on the same connection, and what it assembles equals a fault-free run: no
duplicated and no missing text, consecutive event ids, one [DONE], every token counted
once."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import anthropic
import httpx
import msgspec
import nats
import openai
import pytest
from tokenizers import Tokenizer

from engines.bridge import Bridge, Emit, Refused
from engines.sim import SimConfig, SimEngine
from engines.vllm_http import VllmEndpoint, VllmEngine
from tests.conftest import make_settings, resolve_model, start_stack, wait_engines
from tests.fakes.vllm_engine import FakeVllm, Knobs
from tests.ledgers import stored_once
from tests.stages import ITL, stage_processes
from tests.streams import Streamed, post, until
from tests.test_cli import logged
from tests.test_scheduling import model, pipeline, sim
from tokenway import bus, ledger
from tokenway.aio import Signal
from tokenway.wire import Chunk, EngineWork
from workers.schedule.owned import first_attempt

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def stream(
    url: str, body: dict, after: int = 0, fault: Callable[[], Awaitable[None]] | None = None
) -> Streamed:
    """Stream `body`; once `after` events arrived, cause `fault`, then read to the end."""
    out, progress = Streamed(), Signal()
    async with httpx.AsyncClient(timeout=60) as http:
        reading = asyncio.create_task(post(http, url, body, out, progress))
        if fault is not None:
            await until(progress, lambda: len(out.times) >= after)
            await fault()
        await reading
    return out


def body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": "Tell the long story of a token.", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "seed": 11,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def ledger_of(nats_url: str, rid: str) -> list[tuple[int, int]]:
    """(Tw-Seq, attempt) of each event of a request's ledger, in order, each stored once."""
    return [(e.seq, e.attempt) for e in await stored_once(nats_url, rid)]


def assert_same_stream(got: Streamed, expected: Streamed, max_tokens: int) -> None:
    assert got.text == expected.text and got.text
    assert got.ids == list(range(1, len(got.ids) + 1))  # no gap, no duplicate
    assert got.done == 1
    assert got.usage is not None and got.usage == expected.usage
    assert got.usage["completion_tokens"] == max_tokens


async def test_an_engine_closing_its_socket_mid_stream_is_relayed(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both engines die in their first request: the stream relays twice, ending where the
    first engine began, each relay prompt being the prompt plus what was committed."""
    model = f"relay-{tmp_path.name}"
    settings = make_settings(tmp_path, served_model_name=model)
    resolved, served = resolve_model(settings)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    eos = resolved.eos_token_ids[0]
    knobs = dict(itl=0.002, die_after=12, die_first=1)
    fakes = [FakeVllm.for_tokenizer(tokenizer, eos, Knobs(**knobs)) for _ in range(2)]  # type: ignore[arg-type]
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "derender"])
    engines = []
    stop_bridges = asyncio.Event()
    try:
        for i, fake in enumerate(fakes):
            await fake.__aenter__()
            endpoint = VllmEndpoint(url=fake.url, id=f"relay-{i}", model=served, max_seqs=8)
            engines.append(VllmEngine(endpoint))
        as_engine = stack.role("engine")
        bridges = [
            asyncio.create_task(Bridge(as_engine, e).run(stack.settings.nats, stop_bridges))
            for e in engines
        ]
        await wait_engines(stack.by_name["schedule"][0].registry, 2)
        got = await stream(stack.url, body(served, 60))
        # Each attempt's prompt is longer than the last: the client's own, then each relay's
        # (which engine takes relay 2 is the router's choice: both have failed once).
        original, relay1, relay2 = sorted(
            (r.body for f in fakes for r in f.requests), key=lambda b: len(b["token_ids"])
        )
        first, second = sorted(fakes, key=lambda f: len(f.requests[0].body["token_ids"]))
        prompt = original["token_ids"]
        # The fault-free output, as the first engine would have made it alone.
        whole, _, _ = first.expected(prompt, original["sampling_params"])
        assert got.text == tokenizer.decode(whole)
        assert got.ids == list(range(1, len(got.ids) + 1)) and got.done == 1
        assert got.usage == {"prompt_tokens": len(prompt), "completion_tokens": 60,
                             "total_tokens": len(prompt) + 60}  # fmt: skip
        # Relay 1 on the other engine (the first one failed it); each is prompt + committed.
        assert relay1 == second.requests[0].body
        for relay in (relay1, relay2):
            done = len(relay["token_ids"]) - len(prompt)
            assert done > 0 and relay["token_ids"] == prompt + whole[:done]
            assert relay["sampling_params"]["max_tokens"] == 60 - done
        assert len(relay2["token_ids"]) > len(relay1["token_ids"])
        assert len(relays(caplog)) == 2
        stop_bridges.set()
        await asyncio.gather(*bridges)
    finally:
        stop_bridges.set()
        for engine, fake in zip(engines, fakes, strict=False):
            await engine.aclose()
            await fake.__aexit__(None, None, None)
        await stack.close()


def relays(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "relaying after" in r.getMessage()]


async def test_an_engine_process_killed_mid_stream_is_relayed(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with stage_processes(nats_url, tmp_path, "engine", processes=1) as c:
        model, (first,) = c.stack.model, c.procs
        registry = c.stack.by_name["schedule"][0].registry
        await wait_engines(registry, 1)
        expected = await stream(c.url, body(model, 400))

        async def kill() -> None:
            await c.spawn("engine")
            await wait_engines(registry, 2)
            first.send_signal(signal.SIGKILL)  # no goodbye: its registry entry times out

        got = await stream(c.url, body(model, 400), after=5, fault=kill)
        assert_same_stream(got, expected, 400)
        [relay] = relays(caplog)
        assert "stopped heartbeating" in relay


async def test_the_owner_killed_mid_stream_is_taken_over_from_the_ledger(
    nats_url: str, tmp_path: Path
) -> None:
    """The schedule worker owning a stream is SIGKILLed; JetStream redelivers the request to
    another worker, which reads the ledger back, aborts the orphaned engine work and relays."""
    async with stage_processes(nats_url, tmp_path, "schedule", processes=1) as c:
        model, (first,) = c.stack.model, c.procs
        expected = await stream(c.url, body(model, 400))
        (sim,) = c.stack.by_name["engine"]

        async def kill() -> None:
            await c.spawn("schedule")
            first.send_signal(signal.SIGKILL)

        got = await stream(c.url, body(model, 400), after=5, fault=kill)
        assert_same_stream(got, expected, 400)
        # The dead owner's engine sequence was aborted, not left to run out.
        async with asyncio.timeout(10):
            await sim.idle.wait()
        assert sim.engine.started == 3  # fault-free, the killed owner's, the takeover's


async def test_an_owner_frozen_past_its_ack_wait_is_fenced_off_the_ledger(
    nats_url: str, tmp_path: Path
) -> None:
    """SIGSTOP the owner: its request moves to another worker, which takes it over and
    commits. Woken up, the stale owner finds the request's ledger written by another (before
    it would relay, since the engine dropped its attempt for the new owner), or has a write
    of tokens in hand refused by the ledger's fence; either way it lets the request go and
    the client's stream stays exactly the fault-free one."""
    async with stage_processes(nats_url, tmp_path, "schedule", processes=1) as c:
        model, (stale,) = c.stack.model, c.procs
        expected = await stream(c.url, body(model, 400))
        got, progress = Streamed(), Signal()
        async with httpx.AsyncClient(timeout=60) as http:
            reading = asyncio.create_task(post(http, c.url, body(model, 400), got, progress))
            await until(progress, lambda: len(got.times) >= 5)
            second = await c.spawn("schedule")
            stale.send_signal(signal.SIGSTOP)  # tokens keep coming for it, unread
            await logged(second, b"taken over")
            frozen_at = len(got.times)
            await until(progress, lambda: len(got.times) > frozen_at + 3)  # the new owner's
            stale.send_signal(signal.SIGCONT)
            await logged(stale, b"letting it go")
            await reading
        assert_same_stream(got, expected, 400)
        # Nothing of the stale owner's was stored (what deduplication and the ingress's
        # repeated-Tw-Seq drop would hide from the client): every Tw-Seq once, and the
        # attempts, whose high bits are the ownership epoch, never going back.
        stored = await ledger_of(nats_url, got.rid)
        seqs, attempts = [s for s, _ in stored], [a for _, a in stored]
        assert seqs == list(range(1, len(seqs) + 1))
        assert attempts == sorted(attempts) and attempts[-1] >= first_attempt(2)


async def test_an_owner_woken_after_a_takeover_leaves_the_engine_to_the_new_one(
    nats_url: str, tmp_path: Path
) -> None:
    """Issue 34: the owner of eight streams is frozen for three times its hold, its peer
    takes them over, then it wakes. It must learn what it lost before it touches the engine,
    and its attempts must never share a name with the new owner's (the engine knows work by
    request and attempt): once the clients leave, the engine ends every sequence, none left
    running for an owner that no longer has the request."""
    async with stage_processes(nats_url, tmp_path, "schedule", processes=1) as c:
        model, (stale,) = c.stack.model, c.procs
        (sim,) = c.stack.by_name["engine"]
        long = body(model, 100_000)
        streams, progress = [Streamed() for _ in range(8)], Signal()
        async with httpx.AsyncClient(timeout=60) as http:
            reading = [asyncio.create_task(post(http, c.url, long, s, progress)) for s in streams]
            await until(progress, lambda: all(len(s.times) >= 5 for s in streams))
            second = await c.spawn("schedule")
            stale.send_signal(signal.SIGSTOP)
            for _ in streams:
                await logged(second, b"taken over")
            # Frozen on: three holds, counted in the new owner's output (at one token per
            # ITL), past any engine TTL and registry horizon the stale owner kept.
            holds = round(3 * c.stack.settings.owner_ack_wait / ITL)
            due = {id(s): len(s.times) + holds for s in streams}
            await until(progress, lambda: all(len(s.times) >= due[id(s)] for s in streams))
            stale.send_signal(signal.SIGCONT)
            for _ in streams:  # refused by the ledger's fence, or found so before relaying
                await logged(stale, b"letting it go")
            for task in reading:  # the clients leave
                task.cancel()
            await asyncio.gather(*reading, return_exceptions=True)
        async with asyncio.timeout(15):
            await sim.idle.wait()
        assert sim.engine.info().running == 0
        assert not any(s.cut for s in streams)


class Refusing(SimEngine):
    """Holds each request until `go`, then refuses it (the request's own fault, a 400)."""

    def __init__(self, config: SimConfig, tokenizer: Tokenizer) -> None:
        super().__init__(config, tokenizer)
        self.arrived, self.go = asyncio.Event(), asyncio.Event()

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        self.arrived.set()
        await self.go.wait()
        raise Refused("the engine refuses this request")


async def test_an_error_the_fence_refuses_leaves_the_request_to_its_new_owner(
    nats_url: str, tmp_path: Path
) -> None:
    """The double fault the woken-owner fix left: a peer took the request over and committed
    (its ledger moved), and before this owner learned of it, its request failed with nothing
    to relay. The fence refuses its error event: the request is the new owner's, so this
    one must neither give back the tenant's slot the new owner runs under nor ack the
    message the new owner holds (it did both: the tenant could run one more than its limit)."""
    key, tenant = "sk-double-0123456789abcdef", "default"
    s = make_settings(tmp_path, served_model_name=f"model-{tmp_path.name}", api_key=key,
                      tenant_concurrency=1, tenant_tokens_per_minute=10**6)  # fmt: skip
    stack = await start_stack(nats_url, s, ["ingress", "render", "schedule"])
    tokenizer = Tokenizer.from_file(str(stack.ingress.models[0].info.path / "tokenizer.json"))
    engine = Refusing(dataclasses.replace(sim("refusing"), model=stack.model), tokenizer)
    stop = asyncio.Event()
    bridge = asyncio.create_task(
        Bridge(stack.role("engine"), engine).run(stack.settings.nats or "", stop)
    )
    schedule = stack.by_name["schedule"][0]
    try:
        await wait_engines(schedule.registry, 1)
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)
        hello = [{"role": "user", "content": "hi"}]
        asking = asyncio.create_task(
            client.chat.completions.create(model=stack.model, messages=hello, max_tokens=5)
        )
        await engine.arrived.wait()
        (r,) = schedule.requests.values()
        nc = await nats.connect(stack.observer)
        try:  # the peer's commit: what a takeover stores first
            first = [Chunk(rid=r.rid, seq=1, payload=b"data: {}\n\n")]
            hdrs = ledger.index_headers(first, reply=r.reply, after=0)
            await ledger.publish(nc.jetstream(), bus.out_subject(r.reply, r.rid),
                                 ledger.encode(first), hdrs, within=5)  # fmt: skip
            engine.go.set()
            async with asyncio.timeout(10):
                await schedule.empty.wait()
            js = nc.jetstream()
            usage = msgspec.msgpack.decode((await (await bus.tenants_kv(js, s)).get(tenant)).value)
            assert r.rid in usage.get("leases", {}), usage  # the new owner's slot, still taken
            spec = bus.sched_consumer(s, stack.model)
            held = await js.consumer_info(spec.stream, spec.durable)
            assert held.num_ack_pending == 1  # the new owner's message, not acked
        finally:
            await nc.close()
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
    finally:
        stop.set()
        await bridge
        await stack.close()


async def test_a_pd_decode_leg_failing_mid_stream_relays_both_legs_on_the_replay_prompt(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("pre", "prefill"), sim("dec", "decode", fail_after=20)]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (prefill, decode)):
        relayed = await stream(stack.url, body(model(stack), 60))
        clean = await stream(stack.url, body(model(stack), 60))
        assert_same_stream(relayed, clean, 60)
        # The decode leg died after 20 tokens; the relay prefilled prompt + what was
        # committed, then decoded from there, with the new prefill's KV hand-over.
        first, replay = prefill.received[0], prefill.received[1]
        done = len(replay.token_ids) - len(first.token_ids)
        assert 0 < done <= 20 and replay.token_ids[: len(first.token_ids)] == first.token_ids
        assert decode.received[1].token_ids == replay.token_ids
        assert decode.received[1].sampling_params.max_tokens == 60 - done
        kv = [w.kv_transfer_params for w in decode.received[:2]]
        assert all(kv) and kv[0] != kv[1]


def _events(raw: str) -> list[dict]:
    """The JSON of each `data:` line of a named-event stream."""
    return [json.loads(line[len("data: ") :]) for line in raw.splitlines()
            if line.startswith("data: ")]  # fmt: skip


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_messages_or_responses_stream_is_relayed_like_a_chat(
    nats_url: str, tmp_path: Path, api: str
) -> None:
    """The engine that runs the stream fails after 20 of its tokens; another goes on: the
    client's events add up to the answer a fault-free request gets whole."""
    engines = [sim("a-flaky", fail_after=20), sim("b-steady")]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (flaky, steady)):
        ask = {"model": model(stack), "stream": True}
        if api == "messages":
            path = "/v1/messages"
            ask |= {"max_tokens": 60, "messages": [{"role": "user", "content": "A long tale."}]}
        else:
            path = "/v1/responses"
            ask |= {"max_output_tokens": 60, "input": "A long tale.", "store": False}
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            streamed = _events((await http.post(path, json=ask)).text)
            whole = (await http.post(path, json={**ask, "stream": False})).json()
        assert flaky.started >= 1 and steady.started >= 1  # it was relayed
    if api == "messages":
        text = "".join(e["delta"]["text"] for e in streamed if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "text_delta")  # fmt: skip
        assert text == whole["content"][0]["text"] and text
        assert streamed[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"] > 20
    else:
        text = "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta")
        final = streamed[-1]["response"]
        assert text == final["output"][0]["content"][0]["text"] == whole["output"][0][
            "content"][0]["text"] and text  # fmt: skip
        assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] > 20
        assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_stream_that_cannot_go_on_ends_with_an_error_its_sdk_raises(
    nats_url: str, tmp_path: Path, api: str
) -> None:
    """A constrained stream is never relayed after output: its engine failing mid-stream
    ends it with an error event in the API's own shape, which the API's SDK raises."""
    async with pipeline(nats_url, tmp_path, [sim("fails-later", fail_after=10)]) as (stack, _):
        schema = {"type": "object", "properties": {"a": {"type": "string"}}}
        if api == "messages":
            client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0)
            tool = {"name": "f", "input_schema": schema, "strict": True}
            with pytest.raises(anthropic.APIStatusError) as failed:
                async with client.messages.stream(
                    model=model(stack), max_tokens=60, tools=[tool],
                    tool_choice={"type": "tool", "name": "f"},
                    messages=[{"role": "user", "content": "Go."}],
                ) as stream:  # fmt: skip
                    async for _ in stream:
                        pass
            assert failed.value.body["error"]["type"] == "api_error"
        else:
            oa = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
            text = {"format": {"type": "json_schema", "name": "s", "schema": schema}}
            with pytest.raises(openai.APIError) as failed:
                async for _ in await oa.responses.create(
                    model=model(stack), input="Go.", max_output_tokens=60, text=text,
                    store=False, stream=True,
                ):  # fmt: skip
                    pass
        assert "simulated failure" in str(failed.value)


async def test_a_generate_stream_is_relayed_with_the_token_ids_a_fault_free_run_gives(
    nats_url: str, tmp_path: Path
) -> None:
    """vLLM's token-in/token-out route (an RL rollout's): the engine running the stream fails
    after 20 of its tokens and another goes on; the token IDs and their logprobs the client
    gets are those a fault-free request gets, none twice, none missing."""
    engines = [sim("a-flaky", fail_after=20), sim("b-steady")]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (flaky, steady)):
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            ids = (await http.post("/tokenize", json={"prompt": "A long tale."})).json()["tokens"]
            params = {"max_tokens": 60, "ignore_eos": True, "logprobs": 1}
            ask = {"token_ids": ids, "sampling_params": params, "stream": True,
                   "stream_options": {"include_usage": True}}  # fmt: skip
            raw = (await http.post("/inference/v1/generate", json=ask)).text
            whole = await http.post("/inference/v1/generate", json=ask | {"stream": False})
        assert flaky.started >= 1 and steady.started >= 1  # it was relayed
    streamed = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert raw.endswith("data: [DONE]\n\n")
    outputs, closing = streamed[:-1], streamed[-1]
    tokens = [t for e in outputs for t in e["choices"][0]["token_ids"]]
    logprobs = [c for e in outputs for c in e["choices"][0]["logprobs"]["content"]]
    (choice,) = whole.json()["choices"]
    assert tokens == choice["token_ids"] and len(tokens) == 60
    assert logprobs == choice["logprobs"]["content"]
    assert closing["usage"]["completion_tokens"] == 60
