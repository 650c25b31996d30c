"""Ids a client chooses name nothing of anyone else's: a Responses API response's id (which
names its stored record), a response id two requests share (`X-Request-Id`), and a direct
publisher's request id on the bus. Two tenants' keys on an ingress in front of the
session's pipeline, and the session's own keyless ingress (an open deployment)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import msgspec
import nats
import openai
import pytest
import pytest_asyncio
from openai.types.responses import Response

from tests.conftest import Stack, keyed_ingress
from tokenway import bus
from tokenway import headers as h
from tokenway.client import Output
from tokenway.response_store import AlreadyStored, NotStored, ResponseStore, Stored
from tokenway.wire import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY_ACME, KEY_RIVAL = "sk-acme-chosen-0123456789ab", "sk-rival-chosen-0123456789ab"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """An ingress with the keys of two tenants, acme and rival, on the session's bus."""
    keys = f"acme {KEY_ACME}\nrival {KEY_RIVAL}\n"
    async with keyed_ingress(stack, tmp_path_factory.mktemp("chosen"), keys) as ingress:
        yield ingress


def _client(stack: Stack, key: str = "-") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


def _as(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id}


async def _asked(client: openai.AsyncOpenAI, model: str, text: str, request_id: str) -> Response:
    """A whole (and stored) response."""
    return await client.responses.create(model=model, input=text, max_output_tokens=8,
                                         extra_headers=_as(request_id))  # fmt: skip


async def _streamed(client: openai.AsyncOpenAI, model: str, text: str, request_id: str) -> str:
    """A streamed (and stored) response's id, from its closing event."""
    stream = await client.responses.create(model=model, input=text, max_output_tokens=8,
                                           stream=True, extra_headers=_as(request_id))  # fmt: skip
    ids = [event.response.id async for event in stream if event.type == "response.completed"]
    assert len(ids) == 1
    return ids[0]


async def _said(client: openai.AsyncOpenAI, response_id: str) -> list[str]:
    """The texts of a stored response's input messages, oldest first."""
    items = [i async for i in client.responses.input_items.list(response_id, order="asc")]
    return [i.content[0].text for i in items if i.type == "message"]


async def test_another_tenant_cannot_replace_or_read_a_response_by_choosing_its_id(
    keyed: Stack,
) -> None:
    """rival sends acme's response id (less its `resp_`) as its X-Request-Id, whole and
    streamed: each of its responses is its own, and acme's stays acme's, to read, to list
    and to go on from."""
    async with _client(keyed, KEY_ACME) as acme, _client(keyed, KEY_RIVAL) as rival:
        raw = await acme.responses.with_raw_response.create(
            model=keyed.model, input="My name is Ada. Say hi.", max_output_tokens=8,
            extra_headers=_as("ada-1"),
        )  # fmt: skip
        assert raw.headers["x-request-id"] == "ada-1"  # echoed, as vLLM echoes it
        mine = raw.parse()
        chosen = mine.id.removeprefix("resp_")
        theirs = await _asked(rival, keyed.model, "I am Eve. Say hi.", chosen)
        streamed = await _streamed(rival, keyed.model, "I am Eve, streaming.", chosen)
        again = await acme.responses.retrieve(mine.id)
        assert again.id == mine.id and again.output_text == mine.output_text
        assert await _said(acme, mine.id) == ["My name is Ada. Say hi."]
        follow = await acme.responses.create(
            model=keyed.model, input="What is my name?", previous_response_id=mine.id
        )
        assert follow.previous_response_id == mine.id
        assert await _said(acme, follow.id) == ["My name is Ada. Say hi.", mine.output_text,
                                                "What is my name?"]  # fmt: skip

        assert mine.id not in (theirs.id, streamed)
        assert (await rival.responses.retrieve(theirs.id)).output_text == theirs.output_text
        assert await _said(rival, streamed) == ["I am Eve, streaming."]
        with pytest.raises(openai.NotFoundError):
            await rival.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            await rival.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError):
            await rival.responses.create(model=keyed.model, input="And?", max_output_tokens=4,
                                         previous_response_id=mine.id)  # fmt: skip


async def test_in_an_open_deployment_no_client_replaces_anothers_response(stack: Stack) -> None:
    """No keys: every client is the same tenant (""). A second client sending the first's
    X-Request-Id, or its response's id as one, or that id as the body's `request_id` (what
    vLLM names a response by), gets responses of its own."""
    async with _client(stack) as first, _client(stack) as second:
        mine = await _asked(first, stack.model, "Remember 41.", "shared-7")
        same = await _asked(second, stack.model, "Remember 99.", "shared-7")
        named = await _streamed(second, stack.model, "Remember 5.", mine.id.removeprefix("resp_"))
        bodied = await second.responses.create(model=stack.model, input="Remember 6.",
                                               extra_body={"request_id": mine.id})  # fmt: skip
        assert len({mine.id, same.id, named, bodied.id}) == 4
        again = await first.responses.retrieve(mine.id)
        assert again.output_text == mine.output_text
        assert await _said(first, mine.id) == ["Remember 41."]
        assert await _said(second, same.id) == ["Remember 99."]
        assert await _said(second, named) == ["Remember 5."]
        assert await _said(second, bodied.id) == ["Remember 6."]


async def test_a_tenant_sending_one_request_id_twice_keeps_both_responses(keyed: Stack) -> None:
    """Requests sharing an X-Request-Id each run (a retry that reuses one, say): each is
    stored as its own response, the later one replacing nothing."""
    async with _client(keyed, KEY_ACME) as acme:
        one, two = await asyncio.gather(
            *(_asked(acme, keyed.model, f"Attempt {i}.", "retry-3") for i in (1, 2))
        )
        assert one.id != two.id
        assert await _said(acme, one.id) == ["Attempt 1."]
        assert await _said(acme, two.id) == ["Attempt 2."]
        assert (await acme.responses.retrieve(one.id)).output_text == one.output_text


async def test_a_stored_response_is_never_replaced(stack: Stack) -> None:
    """Whatever makes the id, storing one twice keeps the first (read by the test's own
    connection, as the ingress stores them)."""
    nc = await nats.connect(stack.observer)
    try:
        store = await ResponseStore.bind(nc.jetstream(), stack.settings)
        response_id = f"resp_{secrets.token_hex(12)}"
        first = b'{"id": "%s", "output": []}' % response_id.encode()
        await store.put(response_id, Stored(response=msgspec.Raw(first), input=[], tenant="acme"))
        other = Stored(response=msgspec.Raw(b'{"output": []}'), input=[], tenant="rival")
        with pytest.raises(AlreadyStored):
            await store.put(response_id, other)
        assert bytes((await store.get(response_id, "acme")).response) == first
        with pytest.raises(NotStored):
            await store.get(response_id, "rival")
    finally:
        await nc.close()


async def test_requests_of_two_tenants_sharing_a_response_id_keep_their_own_choices(
    keyed: Stack,
) -> None:
    """acme and rival name their chat completions alike (`chatcmpl-<X-Request-Id>`, as vLLM
    names them), n = 2, all at once: each gets its own two choices, none of another's."""
    async with _client(keyed, KEY_ACME) as acme, _client(keyed, KEY_RIVAL) as rival:
        calls = [
            client.chat.completions.create(
                model=keyed.model, messages=[{"role": "user", "content": f"{who} {i}"}],
                n=2, max_tokens=3, seed=i, logprobs=True, extra_headers=_as("same-9"),
            )
            for i in range(4) for who, client in (("acme", acme), ("rival", rival))
        ]  # fmt: skip
        async with asyncio.timeout(30):
            done = await asyncio.gather(*calls)
    for answer in done:
        assert answer.id == "chatcmpl-same-9"
        assert [c.index for c in answer.choices] == [0, 1]
        assert all(c.finish_reason == "length" and len(c.logprobs.content) == 3
                   for c in answer.choices)  # fmt: skip


async def test_a_tenants_job_may_use_a_request_id_another_tenant_used(stack: Stack) -> None:
    """Request ids of direct publishers are each job's to choose: rival's jobs ran "twin-1"
    (a body) and "twin-2" (token IDs) a moment ago; acme's jobs naming theirs the same run
    and get their own answers."""
    prompt = GenerateRequest(request_id="", token_ids=[6366, 33],
                             sampling_params=SamplingParams(max_tokens=3))  # fmt: skip
    runs = {}
    for tenant in ("rival", "acme"):
        async with await stack.direct(tenant) as tw, asyncio.timeout(20):
            body = {"messages": [{"role": "user", "content": f"I am {tenant}."}], "max_tokens": 4}
            runs[tenant] = (await tw.run(body, rid="twin-1"), await tw.run(prompt, rid="twin-2"))
    for chat, tokens in runs.values():
        assert chat["choices"][0]["finish_reason"] == "length"
        assert tokens["choices"][0]["finish_reason"] == "length"


async def _last_seq(stack: Stack, reply: str, rid: str) -> int:
    """The `Tw-Seq` of the last message in a request's ledger now."""
    nc = await nats.connect(stack.observer)
    try:
        last = await nc.jetstream().get_last_msg(bus.OUT_STREAM, bus.out_subject(reply, rid))
        return int((last.headers or {})[h.SEQ])
    finally:
        await nc.close()


def _texts(outputs: list[Output]) -> str:
    return "".join(c["choices"][0]["text"] for o in outputs for c in o.documents() if c["choices"])


async def test_two_tenants_jobs_run_one_request_id_at_once_each_its_own(stack: Stack) -> None:
    """acme's and rival's jobs both name a request "hold-1" and run it at the same time on
    the one owner and engine: each streams its own output. acme cancelling its own stops its
    engine work only; rival's goes on streaming until rival cancels it. Then both name
    "twin-3" for whole answers at once: each gets its own (its prompt, echoed)."""
    (bridge,) = stack.by_name["engine"]
    endless = {"prompt": "A long tale", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with await stack.direct("acme") as acme, await stack.direct("rival") as rival:
        async with asyncio.timeout(20):
            for tw in (acme, rival):
                await tw.submit(endless, rid="hold-1")
            mine, theirs = acme.outputs("hold-1"), rival.outputs("hold-1")
            assert _texts([await anext(mine), await anext(theirs)])  # both stream
            running = list(bridge.tasks.values())
            assert len(running) == 2
            await acme.cancel("hold-1")
            _, (going,) = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            stored = await _last_seq(stack, rival.reply, "hold-1")
            while (out := await anext(theirs)).seq <= stored + 3:  # made after acme's ended
                assert not out.terminal
            assert not going.done()
            await rival.cancel("hold-1")
            await going
            await mine.aclose()
            await theirs.aclose()

            whole = {"max_tokens": 3, "echo": True}
            answers = await asyncio.gather(
                acme.run({"prompt": "I am acme.", **whole}, rid="twin-3"),
                rival.run({"prompt": "I am rival.", **whole}, rid="twin-3"),
            )
    texts = [a["choices"][0]["text"] for a in answers]
    assert texts[0].startswith("I am acme.") and texts[1].startswith("I am rival."), texts
