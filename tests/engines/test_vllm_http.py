"""The vLLM bridge against a fake vLLM over real HTTP, and once through the whole pipeline."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import nats
import openai
import pytest
import pytest_asyncio
from nats.js.errors import KeyNotFoundError
from tokenizers import Tokenizer

from engines.bridge import Bridge, Refused
from engines.vllm_http import (
    NATIVE_REPROBE,
    VllmCapabilityMissing,
    VllmEndpoint,
    VllmEngine,
    VllmHttpError,
    VllmRefused,
    VllmStreamBroken,
    VllmTimeout,
    VllmUnavailable,
    engine_id_for,
    vllm_engines,
)
from engines.vllm_wire import COMPLETIONS_PATH, GENERATE_PATH, completions_request, vllm_request
from tests.conftest import Bus, make_settings, resolve_model, start_stack, wait_engines
from tests.engines.emits import Emits
from tests.fakes.vllm_engine import FakeVllm, Knobs
from tokenway import bus
from tokenway.registry import EngineRegistry
from tokenway.wire import EngineWork, SamplingParams, StructuredOutputs

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [21, 22, 23, 24, 25]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake() -> AsyncIterator[FakeVllm]:
    async with FakeVllm() as server:
        yield server


MakeEngine = Callable[..., VllmEngine]


@pytest_asyncio.fixture(loop_scope="session")
async def make_engine(fake: FakeVllm) -> AsyncIterator[MakeEngine]:
    """Engines on the (reset) fake; keyword arguments override the endpoint's fields."""
    fake.reset()
    made: list[VllmEngine] = []

    def make(**overrides: object) -> VllmEngine:
        fields: dict[str, object] = {"url": fake.url, "id": "vllm-test", "model": "m"}
        engine = VllmEngine(VllmEndpoint(**(fields | overrides)))  # type: ignore[arg-type]
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.aclose()


def work(
    rid: str = "r",
    attempt: int = 0,
    kv: dict[str, object] | None = None,
    native_ok: bool = False,
    **params: object,
) -> EngineWork:
    return EngineWork(
        rid=rid,
        attempt=attempt,
        owner="o1",
        token_ids=PROMPT,
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        kv_transfer_params=kv,
        native_ok=native_ok,
    )


async def run(engine: VllmEngine, w: EngineWork) -> Emits:
    emits = Emits()
    await engine.generate(w, emits)
    return emits


# -- the request ---------------------------------------------------------------------------


async def test_the_request_is_vllms_generate_request_with_only_fields_vllm_takes() -> None:
    w = work(
        "q", 3, kv={"do_remote_prefill": True}, n=2, seed=9, max_tokens=20, temperature=0.5,
        stop=["\n"], stop_token_ids=[7], logprobs=0, skip_special_tokens=False,
        include_stop_str_in_output=True, prompt_logprobs=1, logit_bias={"5": -1.0},
        thinking_token_budget=16,
    )  # fmt: skip
    w = msgspec.structs.replace(w, priority=-5)
    doc = msgspec.json.decode(msgspec.json.encode(vllm_request(w, "q-3", stream=True)))
    assert doc == {
        "request_id": "q-3",
        "token_ids": PROMPT,
        "sampling_params": {
            "n": 2, "temperature": 0.5, "seed": 9, "max_tokens": 20, "stop_token_ids": [7],
            "logprobs": 0, "logit_bias": {"5": -1.0}, "thinking_token_budget": 16,
            "detokenize": False,
        },
        "stream": True,
        "output_mode": "tokens",
        "stream_options": {"include_usage": True},
        "priority": -5,
        "kv_transfer_params": {"do_remote_prefill": True},
    }  # fmt: skip
    whole = msgspec.json.decode(msgspec.json.encode(vllm_request(work(), "r-0", stream=False)))
    assert whole["stream"] is False and "stream_options" not in whole
    assert whole["sampling_params"] == {"detokenize": False}  # vLLM's defaults for the rest


async def test_a_constraint_reaches_vllm_in_its_sampling_params() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    w = msgspec.structs.replace(
        work(structured_outputs=StructuredOutputs(json=schema)), reasoning_ended=True
    )
    doc = msgspec.json.decode(msgspec.json.encode(vllm_request(w, "r-0", stream=True)))
    assert doc["sampling_params"]["structured_outputs"] == {"json": schema}
    assert doc["reasoning_ended"] is True
    plain = msgspec.json.decode(msgspec.json.encode(vllm_request(work(), "r-0", stream=True)))
    assert "reasoning_ended" not in plain  # the engine judges from the prompt


async def test_each_attempt_runs_under_its_own_generate_tokens_id(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    engine = make_engine()
    await run(engine, work("rid", 0, max_tokens=1))
    await run(engine, work("rid", 1, max_tokens=1))
    assert [r.id for r in fake.requests] == ["generate-tokens-rid-0", "generate-tokens-rid-1"]
    assert fake.requests[0].headers["content-type"] == "application/json"
    # Each stream is read to its end, so the next request reuses the kept-alive connection.
    assert fake.requests[0].client == fake.requests[1].client


# -- streaming -----------------------------------------------------------------------------


async def test_tokens_arrive_per_step_in_order_and_the_last_carries_the_finish(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.chunk_size = 3
    emits = await run(make_engine(), work(max_tokens=7, ignore_eos=True))
    assert [(len(ids), f, r, i) for ids, f, r, i in emits.calls] == [
        (3, None, None, 0), (3, None, None, 0), (1, "length", None, 0),
    ]  # fmt: skip
    assert emits.tokens() == fake.expected(PROMPT, {"max_tokens": 7, "ignore_eos": True})[0]
    assert emits.kv == [None] * 3 and emits.logprobs == [None] * 3


async def test_eos_and_stop_token_ids_finish_with_stop_and_their_stop_reason(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    engine = make_engine()
    natural = await run(engine, work(seed=4))
    assert natural.calls[-1][1:3] == ("stop", None)
    assert natural.tokens()[-1] == fake.eos_token_id
    stop = natural.tokens()[3]
    stopped = await run(engine, work(seed=4, stop_token_ids=[stop]))
    assert stopped.calls[-1][1:3] == ("stop", stop)
    assert stopped.tokens() == natural.tokens()[: natural.tokens().index(stop) + 1]


async def test_logprobs_map_to_entries_with_integer_candidates(make_engine: MakeEngine) -> None:
    emits = await run(make_engine(), work(max_tokens=5, ignore_eos=True, logprobs=2))
    entries = [e for batch in emits.logprobs for e in batch or []]
    assert [e.token_id for e in entries] == emits.tokens()
    for e in entries:
        assert e.rank == 1 and [t.rank for t in e.top] == [1, 2]
        assert e.top[0].token_id == e.token_id and e.top[0].logprob == e.logprob


async def test_n_choices_arrive_with_their_indices(fake: FakeVllm, make_engine: MakeEngine) -> None:
    engine = make_engine()
    emits = await run(engine, work(n=3, seed=8, max_tokens=6, ignore_eos=True))
    params = {"n": 3, "seed": 8, "max_tokens": 6, "ignore_eos": True}
    for i in range(3):
        assert emits.tokens(i) == fake.expected(PROMPT, params, i)[0]
        assert [f for _, f, _, j in emits.calls if j == i][-1] == "length"
    assert engine.running == 0


async def test_the_prompt_tokens_vllm_found_cached_ride_on_the_last_finish(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    """vLLM says them in the usage event after every choice finished (with
    --enable-prompt-tokens-details): the last finish waits for it; on either route, streamed
    or whole. Without them, no count."""
    engine = make_engine()
    emits = await run(engine, work(n=2, seed=8, max_tokens=3, ignore_eos=True))
    assert emits.cached == [None] * len(emits.calls)
    fake.knobs.cached_tokens = 32
    emits = await run(engine, work(n=2, seed=8, max_tokens=3, ignore_eos=True))
    assert [f for _, f, _, _ in emits.calls].count("length") == 2
    assert emits.cached == [None] * (len(emits.calls) - 1) + [32]
    assert emits.calls[-1][1] == "length"
    native = await run(engine, work(native_ok=True, max_tokens=3))  # a prefill's whole answer
    whole = await run(make_engine(role="prefill"), work("p", kv={"do_remote_decode": True},
                                                        max_tokens=1))  # fmt: skip
    fake.knobs.capability = 404
    fallback = await run(make_engine(), work(native_ok=True, max_tokens=3))
    for said in (native, whole, fallback):
        assert said.cached[-1] == 32 and said.calls[-1][1] is not None


# -- P/D -----------------------------------------------------------------------------------


async def test_a_prefill_leg_is_one_response_whose_kv_transfer_params_are_emitted(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    kv_in = {"do_remote_decode": True}
    emits = await run(make_engine(role="prefill"), work("p", kv=kv_in, max_tokens=1))
    sent = fake.requests[-1]
    assert sent.body["stream"] is False and sent.body["kv_transfer_params"] == kv_in
    ((ids, finish, _, _),) = emits.calls
    assert len(ids) == 1 and finish == "length"
    assert emits.kv == [sent.kv_transfer_params]
    assert emits.kv[0]["do_remote_prefill"] is True  # type: ignore[index]


async def test_a_decode_leg_streams_and_hands_the_kv_transfer_params_to_vllm(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    kv = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    emits = await run(make_engine(role="decode"), work("d", kv=kv, max_tokens=4, ignore_eos=True))
    assert fake.requests[-1].body["kv_transfer_params"] == kv
    assert fake.requests[-1].body["stream"] is True
    assert len(emits.tokens()) == 4


# -- cancellation --------------------------------------------------------------------------


async def test_cancelling_aborts_the_request_at_vllm(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.stall_after = 2
    engine = make_engine()
    emits = Emits()
    task = asyncio.create_task(engine.generate(work("c", 2, ignore_eos=True, n=2), emits))
    await emits.first.wait()
    assert engine.info().running == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.aborted == ["generate-tokens-c-2"]  # abort reached vLLM before the re-raise
    # vLLM's own word that it let the request go: the stream it ended, read to [DONE].
    assert fake.requests[-1].finish == {0: "abort", 1: "abort"}
    assert fake.disconnected == [] and fake.running == 0
    assert engine.info().running == 0
    assert len(emits.calls) == 2  # nothing reported after the abort


async def cancelled(task: asyncio.Task[None]) -> None:
    with pytest.raises(asyncio.CancelledError):
        await task


# A proxy between the bridge and vLLM (which would abort on a disconnect) passes no disconnect
# on: only an abort call that vLLM acts on frees the engine.


async def test_an_abort_vllm_refuses_is_sent_again_until_vllm_ends_the_stream(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.reset(Knobs(proxied=True, stall_after=1, abort_fail_first=1))
    engine = make_engine()
    emits = Emits()
    task = asyncio.create_task(engine.generate(work("f", ignore_eos=True, max_tokens=50), emits))
    await emits.first.wait()
    task.cancel()
    await fake.wait_until(lambda: fake.abort_calls == 1)  # answered 503
    task.cancel()  # cancelled again (a second abort, the bridge stopping): the abort goes on
    await cancelled(task)
    assert fake.abort_calls == 2 and fake.aborted == ["generate-tokens-f-0"]
    assert fake.requests[-1].finish == {0: "abort"} and fake.running == 0


async def test_an_abort_before_vllm_knows_the_request_is_sent_again(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    queued = asyncio.Event()
    fake.reset(Knobs(proxied=True, stall_after=1, queue_until=queued))
    engine = make_engine()
    task = asyncio.create_task(engine.generate(work("q", ignore_eos=True, max_tokens=50), Emits()))
    await fake.wait_until(lambda: len(fake.requests) == 1)  # received, not yet registered
    task.cancel()
    await fake.wait_until(lambda: fake.aborted == ["generate-tokens-q-0"])  # a no-op, as vLLM's
    queued.set()  # the request starts after its abort
    await cancelled(task)
    assert fake.aborted[-1] == "generate-tokens-q-0" and len(fake.aborted) >= 2
    assert fake.requests[-1].finish == {0: "abort"} and fake.running == 0


async def test_an_abort_vllm_never_confirms_ends_by_dropping_the_connection(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    queued = asyncio.Event()  # never set here: every abort is a no-op
    fake.reset(Knobs(queue_until=queued, max_model_len=8))
    engine = make_engine(abort_timeout=0.5)
    task = asyncio.create_task(engine.generate(work("n", max_tokens=1), Emits()))
    await fake.wait_until(lambda: len(fake.requests) == 1)
    task.cancel()
    await cancelled(task)  # within the bound
    assert len(fake.aborted) >= 2 and set(fake.aborted) == {"generate-tokens-n-0"}
    assert engine.info().running == 0
    queued.set()  # the fake's handler finds its client gone
    await fake.wait_until(lambda: fake.disconnected == ["generate-tokens-n-0"])


# -- failures ------------------------------------------------------------------------------


async def test_a_5xx_raises_with_the_status_and_vllms_message(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.fail_status = 503
    with pytest.raises(VllmHttpError) as info:
        await run(make_engine(), work(max_tokens=3))
    assert info.value.status == 503
    assert "HTTP 503" in str(info.value) and "fake engine failure 1" in str(info.value)
    assert fake.url in str(info.value)


@pytest.mark.parametrize(
    ("knobs", "status"),
    [({"fail_status": 400}, 400), ({"fail_status": 422}, 422),
     ({"error_after": 0, "error_status": 400}, 400)],
    ids=["http-400", "http-422", "error-event-400"],
)  # fmt: skip
async def test_vllm_refusing_the_request_raises_refused_with_its_status_and_reason(
    fake: FakeVllm, make_engine: MakeEngine, knobs: dict, status: int
) -> None:
    """A grammar vLLM cannot compile is refused with a 400, by the status or, as vLLM 0.33
    does once its stream began, by an error event with that code: the request's fault,
    whose reason (vLLM's message, no URL in it) the client is told."""
    fake.reset(Knobs(**knobs, error_message="Invalid structural tag specification."))
    with pytest.raises(VllmRefused) as info:
        await run(make_engine(), work(max_tokens=3))
    assert isinstance(info.value, Refused) and info.value.status == status
    assert info.value.reason == "Invalid structural tag specification."
    assert fake.url in str(info.value)  # the log's message says which server


@pytest.mark.parametrize(
    "knobs",
    [{"fail_status": 500}, {"fail_status": 429}, {"fail_status": 401},
     {"error_after": 0, "error_status": 500}],
    ids=["http-500", "http-429", "http-401", "error-event-500"],
)  # fmt: skip
async def test_what_is_not_the_requests_fault_stays_the_engines(
    fake: FakeVllm, make_engine: MakeEngine, knobs: dict
) -> None:
    fake.reset(Knobs(**knobs))
    with pytest.raises(VllmHttpError) as info:
        await run(make_engine(), work(max_tokens=3))
    assert not isinstance(info.value, Refused)


async def test_an_error_event_mid_stream_raises(fake: FakeVllm, make_engine: MakeEngine) -> None:
    fake.knobs.error_after = 1
    emits = Emits()
    with pytest.raises(VllmHttpError, match=r"mid-stream .*Internal server error"):
        await make_engine().generate(work(max_tokens=9, ignore_eos=True), emits)
    assert len(emits.calls) == 1


async def test_an_engine_dying_mid_stream_raises_stream_broken(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.die_after = 2
    emits = Emits()
    with pytest.raises(VllmStreamBroken, match="after 2 events without finishing"):
        await make_engine().generate(work(max_tokens=9, ignore_eos=True), emits)
    assert len(emits.calls) == 2 and all(f is None for _, f, _, _ in emits.calls)


@pytest.mark.parametrize("status", [404, 501, 403])
async def test_no_token_only_route_raises_capability_missing(
    fake: FakeVllm, make_engine: MakeEngine, status: int
) -> None:
    fake.knobs.capability = status
    with pytest.raises(VllmCapabilityMissing, match=f"HTTP {status}"):
        await run(make_engine(), work(max_tokens=1))


async def test_no_first_token_in_time_raises_naming_the_timeout(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.stall_after = 0
    with pytest.raises(VllmTimeout) as info:
        await run(make_engine(first_token_timeout=0.2), work("t", max_tokens=5))
    message = str(info.value)
    assert "engine_first_token_timeout=0.2s" in message and fake.url in message
    await fake.wait_until(lambda: fake.running == 0)
    assert fake.aborted == ["generate-tokens-t-0"]  # the engine is told to stop too


async def test_a_stall_between_tokens_raises_naming_the_timeout(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.stall_after = 2
    emits = Emits()
    engine = make_engine(token_timeout=0.2)
    with pytest.raises(VllmTimeout) as info:
        await engine.generate(work(max_tokens=9, ignore_eos=True), emits)
    assert "engine_token_timeout=0.2s after 2 events" in str(info.value)
    assert fake.url in str(info.value) and len(emits.calls) == 2


async def test_a_refused_connection_raises_unavailable_naming_the_url(
    make_engine: MakeEngine,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine = make_engine(url=url)
    with pytest.raises(VllmUnavailable, match=f"cannot connect to vLLM at {url}"):
        await run(engine, work(max_tokens=1))
    assert engine.info().running == 0


# -- native fallback: the OpenAI completions route with token IDs ---------------------------


def paths(fake: FakeVllm) -> list[str]:
    return [r.path for r in fake.requests]


async def test_the_native_request_is_a_completion_request_with_token_ids() -> None:
    w = work("q", 2, native_ok=True, n=2, seed=9, stop_token_ids=[7], logprobs=1, stop=["x"])
    assert completions_request(w, "q-2") == {
        "prompt": PROMPT, "n": 2, "seed": 9, "stop_token_ids": [7], "logprobs": 1,
        "max_tokens": None,  # not this route's default of 16: up to the context
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        "request_id": "q-2", "return_tokens_as_token_ids": True,
    }  # fmt: skip


@pytest.mark.parametrize("status", [404, 501])
async def test_a_missing_token_route_falls_back_to_native_when_the_owner_allows(
    fake: FakeVllm, make_engine: MakeEngine, status: int
) -> None:
    fake.knobs.capability = status
    engine = make_engine()
    params = {"seed": 3, "max_tokens": 9, "ignore_eos": True}
    emits = await run(engine, work("f", native_ok=True, **params))
    assert paths(fake) == [GENERATE_PATH, COMPLETIONS_PATH]
    assert fake.requests[1].body["prompt"] == PROMPT and fake.requests[1].id == "cmpl-f-0"
    assert emits.tokens() == fake.expected(PROMPT, params)[0]
    assert emits.calls[-1][1] == "length" and engine.info().running == 0
    # Known missing now: the next allowed attempt goes native without asking the token route.
    again = await run(engine, work("g", native_ok=True, **params))
    assert paths(fake)[2:] == [COMPLETIONS_PATH] and again.tokens() == emits.tokens()


async def test_without_the_owners_permission_native_is_never_used(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.capability = 404
    engine = make_engine()
    await run(engine, work("a", native_ok=True, max_tokens=2))  # the route is known missing
    with pytest.raises(VllmCapabilityMissing, match="fallback is not allowed for this attempt"):
        await run(engine, work("b", native_ok=False, max_tokens=2))
    assert paths(fake) == [GENERATE_PATH, COMPLETIONS_PATH, GENERATE_PATH]


async def test_a_disabled_route_403_never_falls_back(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.capability = 403
    with pytest.raises(VllmCapabilityMissing, match="HTTP 403"):
        await run(make_engine(), work(native_ok=True, max_tokens=2))
    assert paths(fake) == [GENERATE_PATH]


async def test_the_token_route_is_probed_again_after_the_reprobe_interval(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.capability = 404
    engine = make_engine()
    await run(engine, work("a", native_ok=True, max_tokens=2))
    fake.knobs.capability = None  # vLLM restarted with --tokens-only
    assert engine.token_route_missing_at is not None
    engine.token_route_missing_at -= NATIVE_REPROBE + 1
    await run(engine, work("b", native_ok=True, max_tokens=2))
    assert paths(fake) == [GENERATE_PATH, COMPLETIONS_PATH, GENERATE_PATH]


async def test_native_logprobs_and_choices_map_like_the_token_routes(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.capability = 501
    params = {"n": 2, "seed": 5, "max_tokens": 4, "ignore_eos": True, "logprobs": 2}
    emits = await run(make_engine(), work(native_ok=True, **params))
    for i in range(2):
        assert emits.tokens(i) == fake.expected(PROMPT, params, i)[0]
    entries = [e for batch in emits.logprobs for e in batch or []]
    assert sorted(e.token_id for e in entries) == sorted(emits.tokens(0) + emits.tokens(1))
    for e in entries:  # logprobs + 1 candidates named by id, the sampled token first
        assert len(e.top) == 3 and e.top[0].token_id == e.token_id
        assert e.top[0].logprob == e.logprob and e.rank is None  # this route has no ranks


async def test_cancelling_a_native_attempt_closes_its_connection(
    fake: FakeVllm, make_engine: MakeEngine
) -> None:
    fake.knobs.capability = 404
    fake.knobs.stall_after = 1
    emits = Emits()
    task = asyncio.create_task(make_engine().generate(work("c", native_ok=True), emits))
    await emits.first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await fake.wait_until(lambda: fake.disconnected == ["cmpl-c-0"])
    assert fake.aborted == []  # no abort call: that route is missing with the token route


# -- identity and the CLI factory ----------------------------------------------------------


async def test_engines_come_one_per_url_with_token_safe_ids(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, vllm_url="http://10.0.0.7:8000, http://gpu-b.local:9000/", engine_role="decode"
    )
    a, b = vllm_engines(settings, ["served"])
    assert [a.info().id, b.info().id] == ["vllm-10-0-0-7-8000", "vllm-gpu-b-local-9000"]
    assert (a.info().model, a.info().role, a.info().max_seqs) == ("served", "decode", 256)
    named = vllm_engines(make_settings(tmp_path, vllm_url="http://h:1,http://h:2",
                                       engine_id="pool.a"), ["served"])  # fmt: skip
    assert [e.info().id for e in named] == ["pool-a-0", "pool-a-1"]
    assert engine_id_for("http://[::1]:8000") == "vllm-1-8000"
    with pytest.raises(ValueError, match="--vllm-url"):
        vllm_engines(make_settings(tmp_path), ["served"])
    with pytest.raises(ValueError, match="http"):
        vllm_engines(make_settings(tmp_path, vllm_url="grpc://h:1"), ["served"])


# -- end to end ----------------------------------------------------------------------------


async def test_chat_streams_through_the_pipeline_and_a_client_leaving_aborts_vllm(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = make_settings(tmp_path_factory.mktemp("vllm-e2e"), served_model_name="fake-vllm")
    model, served = resolve_model(settings)
    tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    fake = FakeVllm.for_tokenizer(
        tokenizer, model.eos_token_ids[0], Knobs(itl=0.001, output_len=30)
    )
    async with fake:
        stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "derender"])
        engine = VllmEngine(VllmEndpoint(url=fake.url, id="vllm-e2e", model=served, max_seqs=8))
        stop = asyncio.Event()
        bridged = Bridge(stack.role("engine"), engine)
        bridge = asyncio.create_task(bridged.run(stack.settings.nats, stop))
        try:
            await wait_engines(stack.ingress.registry, 1)
            client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
            messages = [{"role": "user", "content": "Tell me about token streams."}]
            stream = await client.chat.completions.create(
                model=served, messages=messages, max_tokens=200, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, usage = "", None
            async for chunk in stream:
                usage = chunk.usage or usage
                text += "".join(c.delta.content or "" for c in chunk.choices)
            (sent,) = fake.requests
            produced = sent.outputs[0]
            assert sent.finish == {0: "stop"} and produced[-1] == fake.eos_token_id
            assert text and text == tokenizer.decode(produced, skip_special_tokens=True)
            assert usage is not None and usage.completion_tokens == len(produced)
            assert usage.prompt_tokens == len(sent.body["token_ids"])

            fake.knobs.stall_after = 3
            stream = await client.chat.completions.create(
                model=served, messages=messages, max_tokens=2000, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for _ in stream:
                break  # the client leaves after its first chunk
            await stream.close()
            await fake.wait_until(lambda: len(fake.aborted) == 1)
            assert fake.aborted == [fake.requests[-1].id]
            await fake.wait_until(lambda: fake.running == 0)
        finally:
            stop.set()
            await bridge
            await engine.aclose()
            await stack.close()


async def test_the_bridge_is_registered_only_while_vllm_answers_its_health_check(
    fake: FakeVllm, make_engine: MakeEngine, session_bus: Bus, tmp_path: Path
) -> None:
    """A bridge in front of a vLLM that is not up yet (or whose engine died) would take
    requests that then hang: it joins the registry once `/health` answers 200, leaves it
    when it stops answering 200, and joins again when it does."""
    fake.reset(Knobs(health=503))
    name = f"health-{uuid.uuid4().hex[:8]}"
    engine = make_engine(id=name, model=name)
    settings = make_settings(tmp_path, engine_ttl=1.5)
    stop = asyncio.Event()
    running = asyncio.create_task(
        Bridge(session_bus.role(settings, "engine"), engine).run(session_bus.url, stop)
    )
    nc = await nats.connect(session_bus.watch)
    kv = await bus.engines_kv(nc.jetstream(), settings)
    registry = EngineRegistry(kv, [name], settings.engine_ttl)
    watching = asyncio.create_task(registry.run(stop))
    try:
        await fake.wait_until(lambda: fake.health_checks >= 2)  # two beats: vLLM not healthy
        with pytest.raises(KeyNotFoundError):
            await kv.get(name)
        fake.knobs.health = 200
        await wait_engines(registry, 1)
        fake.knobs.health = 503
        async with asyncio.timeout(10):
            while registry.alive():
                await registry.changed.waiter().wait()
        fake.knobs.health = 200
        await wait_engines(registry, 1)
    finally:
        stop.set()
        await asyncio.gather(running, watching)
        await nc.close()
