"""Tenants cannot starve each other: limits on concurrent requests and tokens per minute,
shared by two ingresses in front of the session's pipeline, a request without `max_tokens`
that no longer holds an engine's budget for as long as it runs, and tenants taking turns
for an engine in the owner's waiting line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
import pytest_asyncio

from tests.conftest import Stack, keyed_settings, make_settings, start_stack
from tokenway import bus
from tokenway import headers as h
from tokenway.tenancy import Usage

FLOOD, METERED, CALM = ("sk-flood-0123456789abcdef", "sk-metered-0123456789abcdef",
                        "sk-calm-0123456789abcdef")  # fmt: skip
CHAT = [{"role": "user", "content": "Tell me everything."}]

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ingresses(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Stack, Stack]]:
    """Two ingresses with the same keys: `flood` may run 2 requests at once, `metered` start
    600 tokens a minute, `calm` is unlimited."""
    keys = f"flood {FLOOD} concurrent=2\nmetered {METERED} tokens_per_minute=600\ncalm {CALM}\n"
    settings = keyed_settings(stack, tmp_path_factory.mktemp("tenants"), keys)
    one = await start_stack(stack.settings.nats, settings, ["ingress"])
    two = await start_stack(stack.settings.nats, settings, ["ingress"])
    yield one, two
    await one.close()
    await two.close()


def _http(stack: Stack, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def _body(**extra: object) -> dict[str, object]:
    return {"model": "deepseek-v4", "messages": CHAT, **extra}


# A stream that runs until its client leaves: it holds its slot all along.
ENDLESS = _body(stream=True, max_tokens=100_000, ignore_eos=True)


@contextlib.asynccontextmanager
async def _running(stack: Stack, key: str, body: dict[str, object]) -> AsyncIterator[None]:
    """A streamed request, open once its first chunk arrived (it is admitted and running);
    leaving the block closes it, as a client that goes away."""
    async with (
        _http(stack, key) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        chunks = r.aiter_bytes()  # kept: leaving an iteration would close the stream
        assert (await anext(chunks)).startswith(b"data: ")
        yield


async def _leases(stack: Stack, tenant: str, count: int) -> None:
    """Until the tenant's record in the bucket shows `count` running requests (read by the
    test's observer: the ingress may not read it)."""
    nc = await nats.connect(stack.observer)
    kv = await nc.jetstream().key_value(bus.TENANTS_BUCKET)
    watcher = await kv.watch(tenant)
    try:
        async with asyncio.timeout(30):
            while True:
                entry = await watcher.updates(timeout=30)
                if entry is not None and entry.value:
                    if len(msgspec.msgpack.decode(entry.value, type=Usage).leases) == count:
                        return
    finally:
        await watcher.stop()
        await nc.close()


async def test_a_tenants_concurrency_is_one_count_across_ingresses(
    ingresses: tuple[Stack, Stack],
) -> None:
    one, two = ingresses
    async with _running(one, FLOOD, ENDLESS), _running(two, FLOOD, ENDLESS):
        for ingress in (one, two):
            async with _http(ingress, FLOOD) as http:
                resp = await http.post("/v1/chat/completions", json=_body(max_tokens=4))
            assert resp.status_code == 429, resp.text
            assert resp.headers["retry-after"] == "1"
            error = resp.json()["error"]
            assert error["type"] == "RateLimitError" and error["code"] == "rate_limit_exceeded"
            assert "2 concurrent" in error["message"]
        async with _http(one, CALM) as http:  # another tenant is not held up by it
            resp = await http.post("/v1/chat/completions", json=_body(max_tokens=4))
        assert resp.status_code == 200, resp.text
    # Both streams left: their owners gave the slots back.
    await _leases(one, "flood", 0)
    async with _http(two, FLOOD) as http:
        resp = await http.post("/v1/chat/completions", json=_body(max_tokens=4))
    assert resp.status_code == 200, resp.text


async def test_a_tenant_at_its_limit_on_one_ingress_is_refused_there_before_render(
    ingresses: tuple[Stack, Stack],
) -> None:
    """An ingress that itself runs a tenant's limit of requests refuses the next one at once:
    nothing is queued, so a flood's refusals cost render and the bus nothing."""
    one, _ = ingresses
    nc = await nats.connect(one.observer)
    queued = await nc.subscribe(bus.render_subject(bus.ANY))
    await nc.flush()  # the server holds the subscription before anything is published
    try:
        async with _running(one, FLOOD, ENDLESS), _running(one, FLOOD, ENDLESS):
            async with _http(one, FLOOD) as http:
                resp = await http.post("/v1/chat/completions", json=_body(max_tokens=4))
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
            assert "2 concurrent" in resp.json()["error"]["message"]
            async with _http(one, CALM) as http:
                calm = await http.post("/v1/chat/completions", json=_body(max_tokens=4))
            assert calm.status_code == 200
        # what the ingress queued, in order: the two streams, then the calm request alone
        tenants = [(await queued.next_msg(timeout=10)).headers[h.TENANT] for _ in range(3)]
        assert tenants == ["flood", "flood", "calm"]
    finally:
        await nc.close()


async def test_a_flooding_tenant_gets_429s_and_the_others_their_answers(
    ingresses: tuple[Stack, Stack],
) -> None:
    """The flooding tenant runs its limit (one stream on each ingress) while its burst and
    another tenant's requests arrive at once. Without those streams held open, how many of
    the burst ran depended on how fast each ended: under load, sometimes all of them."""
    one, two = ingresses

    async def ask(ingress: Stack, key: str) -> int:
        async with _http(ingress, key) as http:
            resp = await http.post("/v1/chat/completions", json=_body(max_tokens=30))
        return resp.status_code

    async with _running(one, FLOOD, ENDLESS), _running(two, FLOOD, ENDLESS):
        flood = [ask((one, two)[i % 2], FLOOD) for i in range(24)]
        calm = [ask((one, two)[i % 2], CALM) for i in range(6)]
        statuses = await asyncio.gather(*flood, *calm)
    assert statuses[24:] == [200] * 6
    assert statuses[:24] == [429] * 24
    await _leases(one, "flood", 0)  # the streams left: their slots are free for what follows


async def test_tokens_per_minute_are_charged_prompt_plus_max_tokens_times_n(
    ingresses: tuple[Stack, Stack],
) -> None:
    one, two = ingresses
    async with _http(one, METERED) as http:
        for ingress in (one, two):  # 2 × (the prompt + 250) of 600
            async with _http(ingress, METERED) as other:
                resp = await other.post("/v1/chat/completions", json=_body(max_tokens=250))
            assert resp.status_code == 200, resp.text
        resp = await http.post("/v1/chat/completions", json=_body(max_tokens=50, n=2))
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        assert "600 tokens per minute" in resp.json()["error"]["message"]
        # No max_tokens: it is charged the context it may fill, which no minute allows.
        resp = await http.post("/v1/chat/completions", json=_body())
        assert resp.status_code == 400, resp.text
        context = one.ingress.models[0].info.context_length
        assert f"needs {context} tokens" in resp.json()["error"]["message"]


async def test_a_request_without_max_tokens_leaves_room_for_others(stack: Stack) -> None:
    """n=8 without max_tokens may fill the whole context eight times over: all the budget
    of the session's engine. It holds what it uses, so a request behind it still runs."""
    endless = _body(stream=True, n=8, ignore_eos=True)
    async with _running(stack, "-", endless), _http(stack, "-") as http:
        async with asyncio.timeout(60):  # held back, it would wait out its deadline
            resp = await http.post("/v1/chat/completions", json=_body())
        assert resp.status_code == 200, resp.text


async def test_a_calm_tenant_takes_the_next_free_slot_before_a_floods_queue(
    stack: Stack, tmp_path: Path
) -> None:
    """An engine of 2 sequences and 10 of one tenant's requests waiting for it: another
    tenant's request, sent after them all, starts as the next slot frees. It once waited
    behind every one of them, in arrival order."""
    keys = tmp_path / "keys"
    keys.write_text(f"flood {FLOOD}\ncalm {CALM}\n")
    settings = make_settings(tmp_path, api_key_file=str(keys), sim_max_seqs=2, sim_itl=0.005,
                             served_model_name="turns")  # fmt: skip
    turns = await start_stack(
        stack.settings.nats, settings, ["ingress", "render", "schedule", "sim"]
    )
    nc = await nats.connect(stack.observer)
    queued = await nc.subscribe(bus.sched_subject("turns"))  # sees each rendered request
    body = {"model": "turns", "messages": CHAT, "max_tokens": 100, "ignore_eos": True}
    ended: list[str] = []

    async def ask(key: str, tenant: str) -> None:
        async with _http(turns, key) as http:
            resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        ended.append(tenant)

    try:
        floods = [asyncio.create_task(ask(FLOOD, "flood")) for _ in range(12)]
        for _ in floods:  # every one rendered and queued for the owner
            await queued.next_msg(timeout=30)
        await ask(CALM, "calm")
        await asyncio.gather(*floods)
        # The two running before it, and at most the one that took the other freed slot.
        assert ended.index("calm") <= 3, ended
    finally:
        await nc.close()
        await turns.close()
