"""Token obfuscation and the native fallback through the whole pipeline, on a real bus.

One front (ingress, render, derender) serves a model of its own; each test runs the schedule
stage and the engines it needs, keyed or not, so the same client request can be compared
across settings. Obfuscated engines are models trained on the permuted vocabulary: they
speak physical IDs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import openai
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from engines.bridge import Bridge, Engine
from engines.sim import SimConfig, SimEngine
from engines.vllm_http import VllmEndpoint, VllmEngine
from engines.vllm_wire import COMPLETIONS_PATH, GENERATE_PATH
from program.stages import build_stages
from tests.conftest import Stack, make_settings, recording, start_stack
from tests.fakes.vllm_engine import FakeVllm, Knobs
from tokenway import bus
from tokenway.block_hashes import block_hashes
from tokenway.obfuscation import Permutation
from tokenway.registry import EngineRegistry
from tokenway.wire import EngineInfo, EngineReply, EngineWork, SamplingParams
from workers.schedule.service import ScheduleService

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "obfuscated-model"
KEY = "tokenway-test-key-0123456789"
OTHER_KEY = "a-different-key-9876543210"
CHAT = [{"role": "user", "content": "Tell me about keyed permutations."}]
PROMPT = "A prompt long enough to fill a few KV blocks, so that affinity has whole blocks " * 2


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def front(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    settings = make_settings(tmp_path_factory.mktemp("obf"), served_model_name=MODEL)
    stack = await start_stack(nats_url, settings, ["ingress", "render", "derender"])
    yield stack
    await stack.close()


@pytest.fixture(scope="module")
def tokenizer(front: Stack) -> Tokenizer:
    return Tokenizer.from_file(str(front.ingress.models[0].info.path / "tokenizer.json"))


def permutation(front: Stack, key: str) -> Permutation:
    return Permutation(key.encode(), front.ingress.models[0].info.vocab_size)


@pytest.fixture(scope="module")
def perm(front: Stack) -> Permutation:
    return permutation(front, KEY)


def client(front: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="-", max_retries=0)


@contextlib.asynccontextmanager
async def scheduler(front: Stack, key: str | None) -> AsyncIterator[ScheduleService]:
    settings = msgspec.structs.replace(front.settings, obfuscation_key=key)
    stack = await start_stack(front.settings.nats or "", settings, ["schedule"])
    try:
        yield stack.by_name["schedule"][0]
    finally:
        await stack.close()


async def registry_until(
    registry: EngineRegistry, done: Callable[[list[EngineInfo]], bool], timeout: float = 20
) -> None:
    async with asyncio.timeout(timeout):
        while True:
            changed = registry.changed.waiter()
            if done([e for e in registry.alive() if e.model == MODEL]):  # not other tests'
                return
            await changed.wait()


@contextlib.asynccontextmanager
async def bridged(front: Stack, *engines: tuple[Engine, Permutation | None]) -> AsyncIterator[None]:
    """Engines behind bridges (keyed by their permutation), registered, then gone again."""
    stop = asyncio.Event()
    bridges = [Bridge(front.role("engine"), engine, obf) for engine, obf in engines]
    tasks = [asyncio.create_task(b.run(front.settings.nats or "", stop)) for b in bridges]
    registry = front.ingress.registry
    try:
        await registry_until(registry, lambda alive: len(alive) == len(engines))
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await registry_until(registry, lambda alive: not alive)


def sim(front: Stack, tokenizer: Tokenizer, id: str, trained_on: Permutation | None) -> SimEngine:
    config = SimConfig(
        id=id, model=MODEL, eos_token_id=front.ingress.models[0].info.eos_token_ids[0],
        ttft=0, itl=0.001, output_len=30,
    )  # fmt: skip
    return recording(SimEngine(config, tokenizer, trained_on=trained_on))


async def chat_text(front: Stack, seed: int) -> str:
    stream = await client(front).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, seed=seed, stream=True
    )  # type: ignore[arg-type]
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def completion(front: Stack, seed: int, **extra: object) -> openai.types.CompletionChoice:
    resp = await client(front).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, seed=seed, logprobs=2,
        extra_body={"return_token_ids": True, **extra},
    )  # fmt: skip
    return resp.choices[0]


def ids_of(choice: openai.types.CompletionChoice, field: str) -> list[int]:
    return (choice.model_extra or {})[field]


# -- obfuscation with simulated engines --------------------------------------------------


async def test_the_engine_sees_only_physical_ids_and_the_client_the_same_text(
    front: Stack, tokenizer: Tokenizer, perm: Permutation
) -> None:
    async with scheduler(front, None), bridged(front, (sim(front, tokenizer, "plain", None), None)):
        plain_chat = await chat_text(front, seed=7)
        first = await completion(front, seed=11)
        stop = ids_of(first, "token_ids")[5]  # a stop token ID that the output meets
        plain = await completion(front, seed=11, stop_token_ids=[stop])
    prompt = ids_of(plain, "prompt_token_ids")
    engine = sim(front, tokenizer, "keyed", perm)
    async with scheduler(front, KEY) as owner, bridged(front, (engine, perm)):
        keyed_chat = await chat_text(front, seed=7)
        keyed = await completion(front, seed=11, stop_token_ids=[stop])
        outside = front.ingress.models[0].info.vocab_size + 5
        with pytest.raises(openai.BadRequestError, match=f"token ID {outside}, outside"):
            await completion(front, seed=11, stop_token_ids=[outside])  # never sent on
        # KV affinity hashed what the engine caches: the physical prompt (while it is there).
        size = front.settings.kv_block_size
        physical = block_hashes(perm.to_physical(prompt), size)
        semantic = block_hashes(prompt, size)
        assert owner.dispatcher is not None and len(physical) >= 2
        index, now = owner.dispatcher.index, time.monotonic()
        assert index.overlap("keyed", physical, now) == len(physical)
        assert index.overlap("keyed", semantic, now) == 0
    # The client sees exactly what it sees without obfuscation, IDs included (semantic).
    assert keyed_chat == plain_chat and plain_chat
    assert (keyed.text, keyed.finish_reason) == (plain.text, plain.finish_reason)
    assert keyed.model_extra["stop_reason"] == plain.model_extra["stop_reason"] == stop
    assert ids_of(keyed, "token_ids") == ids_of(plain, "token_ids")
    assert keyed.logprobs.tokens == plain.logprobs.tokens  # type: ignore[union-attr]
    # The engine saw the physical prompt and stop ID, never the semantic ones.
    assert len(engine.received) == 2
    work = engine.received[-1]
    assert work.token_ids == perm.to_physical(prompt) != prompt
    assert work.sampling_params.stop_token_ids == perm.to_physical([stop]) != [stop]
    assert all(w.obfuscation == perm.fingerprint and not w.native_ok for w in engine.received)


@pytest.mark.parametrize(
    ("scheduler_key", "engine_key"),
    [(KEY, None), (KEY, OTHER_KEY), (None, KEY)],
    ids=["keyed-owner-plain-engine", "other-key", "plain-owner-keyed-engine"],
)
async def test_no_request_reaches_an_engine_keyed_otherwise_and_the_client_is_told(
    front: Stack, tokenizer: Tokenizer, scheduler_key: str | None, engine_key: str | None
) -> None:
    obf = permutation(front, engine_key) if engine_key else None
    engine = sim(front, tokenizer, "mismatch", obf)
    async with scheduler(front, scheduler_key), bridged(front, (engine, obf)):
        with pytest.raises(openai.APIStatusError) as info:
            await completion(front, seed=1)
    assert info.value.status_code == 503
    message = info.value.body["message"]  # type: ignore[index]
    assert "uses this scheduler's token obfuscation" in message and "1 registered" in message
    assert engine.started == 0


async def test_a_bridge_declines_work_mapped_for_another_key(
    front: Stack, tokenizer: Tokenizer, perm: Permutation
) -> None:
    """The last guard, for an owner whose registry view is stale: nothing reaches the engine."""
    engine = sim(front, tokenizer, "guard", perm)
    nc = await bus.connect(front.observer, "obf-test")
    try:
        async with bridged(front, (engine, perm)):
            for fingerprint in (None, permutation(front, OTHER_KEY).fingerprint):
                work = EngineWork(
                    rid="g", attempt=1, owner="nobody", token_ids=[1, 2],
                    sampling_params=SamplingParams(), obfuscation=fingerprint,
                )  # fmt: skip
                msg = await nc.request(
                    bus.engine_subject("guard", "generate"), msgspec.msgpack.encode(work), 10
                )
                reply = msgspec.msgpack.decode(msg.data, type=EngineReply)
                assert not reply.accepted and f"uses key {perm.fingerprint}" in (reply.error or "")
    finally:
        await nc.close()
    assert engine.started == 0


# -- vLLM: obfuscation and the native fallback ---------------------------------------------


def vllm(fake: FakeVllm, id: str) -> VllmEngine:
    return VllmEngine(VllmEndpoint(url=fake.url, id=id, model=MODEL, max_seqs=8))


async def test_a_vllm_engine_sees_physical_ids_and_never_falls_back_to_native_when_keyed(
    front: Stack, tokenizer: Tokenizer, perm: Permutation
) -> None:
    eos = front.ingress.models[0].info.eos_token_ids[0]
    plain_fake = FakeVllm.for_tokenizer(tokenizer, eos, Knobs(itl=0.001, output_len=30))
    keyed_fake = FakeVllm.for_tokenizer(
        tokenizer, eos, Knobs(itl=0.001, output_len=30), trained_on=perm
    )
    async with plain_fake, keyed_fake:
        plain_engine, keyed_engine = vllm(plain_fake, "vllm-plain"), vllm(keyed_fake, "vllm-keyed")
        async with scheduler(front, None), bridged(front, (plain_engine, None)):
            plain = await completion(front, seed=5)
            # No token-only route, nothing committed, no key: the native route serves it.
            plain_fake.knobs.capability = 404
            native = await completion(front, seed=5)
        assert [r.path for r in plain_fake.requests] == [
            GENERATE_PATH, GENERATE_PATH, COMPLETIONS_PATH,
        ]  # fmt: skip
        assert (native.text, native.finish_reason) == (plain.text, plain.finish_reason)
        assert ids_of(native, "token_ids") == ids_of(plain, "token_ids")
        assert plain_fake.requests[-1].body["prompt"] == ids_of(plain, "prompt_token_ids")

        async with scheduler(front, KEY), bridged(front, (keyed_engine, perm)):
            keyed = await completion(front, seed=5)
            keyed_fake.knobs.capability = 404
            with pytest.raises(openai.APIStatusError) as info:
                await completion(front, seed=5)
        assert (keyed.text, ids_of(keyed, "token_ids")) == (plain.text, ids_of(plain, "token_ids"))
        prompt = ids_of(plain, "prompt_token_ids")
        # The refused attempt is retried (nothing was committed) until relays run out.
        calls = 2 + front.settings.relay_attempts
        assert [r.body["token_ids"] for r in keyed_fake.requests] == [
            perm.to_physical(prompt)
        ] * calls
        # Fail closed: an explicit error, and the native route was never called.
        assert info.value.status_code == 502
        assert "fallback is not allowed" in info.value.body["message"]  # type: ignore[index]
        assert [r.path for r in keyed_fake.requests] == [GENERATE_PATH] * calls
        await plain_engine.aclose()
        await keyed_engine.aclose()


async def test_one_process_hands_its_key_to_the_schedule_and_engine_stages_it_runs(
    front: Stack, perm: Permutation
) -> None:
    """As `tokenway up --obfuscation-key …` builds them: one permutation for all, and the
    simulated model is one trained on it (it says EOS in physical IDs)."""
    settings = msgspec.structs.replace(front.settings, obfuscation_key=KEY, sim_engines=2)
    owner, *bridges = build_stages(settings, ["schedule", "sim"])
    assert isinstance(owner, ScheduleService) and owner.obfuscation is not None
    assert owner.obfuscation.fingerprint == perm.fingerprint
    assert len(bridges) == 2
    for bridge in bridges:
        assert isinstance(bridge, Bridge) and bridge.obfuscation is owner.obfuscation
        assert bridge.info().obfuscation == perm.fingerprint
        assert isinstance(bridge.engine, SimEngine)
        assert [bridge.engine.eos_token_id] == perm.to_physical(
            front.ingress.models[0].info.eos_token_ids
        )
    plain = build_stages(front.settings, ["schedule"])[0]
    assert isinstance(plain, ScheduleService) and plain.obfuscation is None
