"""A tenant's batch and RL jobs on the bus (`tokenway.client` as the `client-<tenant>`
NATS user), on the bus as `tokenway up` guards it: the client runs,
reads and cancels its own requests, and nothing it publishes on its lane reaches another
client's request or runs as another tenant."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy

from tests.conftest import Stack
from tests.test_cli import spawn
from tokenway import bus
from tokenway import headers as h
from tokenway.wire import DeadLetter, GenerateRequest, RenderRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "deepseek-v4"


@pytest_asyncio.fixture(loop_scope="session")
async def observer(stack: Stack) -> AsyncIterator[NATS]:
    """The test's connection, which may read everything (the session's stack runs every
    stage as its role, and lets in `client-<tenant>` users as `up` does)."""
    nc = await nats.connect(stack.observer)
    yield nc
    await nc.close()


def chat(text: str, max_tokens: int = 6) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


async def tenant_of(js: nats.js.JetStreamContext, reply: str, rid: str) -> str:
    last = await js.get_last_msg(bus.OUT_STREAM, bus.out_subject(reply, rid))
    return (last.headers or {}).get(h.TENANT, "")


async def test_a_tenants_client_runs_reads_and_cancels_its_own_requests(
    stack: Stack, observer: NATS
) -> None:
    async with await stack.direct("acme") as tw:
        assert tw.reply.startswith("tenant.acme.")
        done = await tw.run(chat("hello"))
        assert done["choices"][0]["message"]["content"]
        params = SamplingParams(max_tokens=4, logprobs=0, seed=3)
        tokens = await tw.run(
            GenerateRequest(request_id="", token_ids=[6366, 33], sampling_params=params,
                            return_token_ids=True), rid="acme-tokens",
        )  # fmt: skip
        assert len(tokens["choices"][0]["token_ids"]) == 4
        many = {rid: r async for rid, r in tw.submit_many([chat(f"#{i}") for i in range(3)])}
        assert len(many) == 3 and all(isinstance(r, dict) for r in many.values())
        # a request on its lane is the lane's tenant's, whatever its headers claim
        rid = "acme-claims-rival"
        claim = RenderRequest(
            api="chat", request_id=rid, created=0, body=json.dumps(chat("hi")).encode()
        )
        await tw.js.publish(bus.render_subject(MODEL, True, "acme"),
                            msgspec.msgpack.encode(claim),
                            headers={h.MSG_ID: rid, h.RID: rid, h.REPLY: tw.reply,
                                     h.TENANT: "rival"})  # fmt: skip
        assert (await tw.result(rid))["object"] == "chat.completion"
        assert await tenant_of(observer.jetstream(), tw.reply, rid) == "acme"
        assert await tenant_of(observer.jetstream(), tw.reply, "acme-tokens") == "acme"

        schedule = stack.by_name["schedule"][0]
        endless = {**chat("an endless tale", 100_000), "ignore_eos": True, "stream": True}
        rid = await tw.submit(endless)
        async for _ in tw.outputs(rid):
            break  # it runs
        assert schedule.owned(tw.reply, rid) is not None
        await tw.cancel(rid)
        async with asyncio.timeout(10):
            await schedule.empty.wait()


async def test_nothing_on_a_tenants_lane_reaches_another_clients_request(
    stack: Stack, observer: NATS
) -> None:
    """While an HTTP client streams, tenant acme's client names that request's reply, then
    its id on acme's own reply, then cancels it from its own reply: the first is a dead
    letter, the second acme's own request (answered on acme's ledger), the cancel is
    nobody's, and the stream runs on."""
    schedule = stack.by_name["schedule"][0]
    letters = await observer.jetstream().subscribe(
        bus.dlq_subject("*"), stream=bus.DLQ_STREAM, ordered_consumer=True,
        deliver_policy=DeliverPolicy.NEW,
    )  # fmt: skip
    endless = {"prompt": "A long tale", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with await stack.direct("acme") as tw:
        own = await tw.submit(endless)  # acme's own, to cancel last
        async for _ in tw.outputs(own):
            break
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", f"{stack.url}/v1/completions", json=endless) as r:
                victim = r.headers["x-tokenway-stream-id"]
                ingress = stack.ingress.router.ingress_id
                lines = r.aiter_lines()  # held: a dropped iterator closes the response
                assert (await anext(lines)).startswith("data: ")  # it streams

                hijack = RenderRequest(
                    api="completion",
                    request_id=victim,
                    created=0,
                    body=json.dumps({"prompt": "mine"}).encode(),
                )
                await tw.js.publish(bus.render_subject(MODEL, True, "acme"),
                                    msgspec.msgpack.encode(hijack),
                                    headers={h.MSG_ID: "hijack-1", h.RID: victim,
                                             h.REPLY: ingress})  # fmt: skip
                letter = msgspec.json.decode((await letters.next_msg(10)).data, type=DeadLetter)
                assert letter.stage == "render" and "not one of its own" in letter.reason

                same_id = GenerateRequest(
                    request_id=victim,
                    token_ids=[6366, 33],
                    sampling_params=SamplingParams(max_tokens=2),
                )
                await tw.js.publish(bus.sched_subject(MODEL, True, "acme"),
                                    msgspec.msgpack.encode(same_id),
                                    headers={h.MSG_ID: "hijack-2", h.RID: victim,
                                             h.REPLY: tw.reply})  # fmt: skip
                answer = await tw.result(victim, timeout=10)
                assert [c["finish_reason"] for c in answer["choices"]] == ["length"]

                mine = schedule.owned(tw.reply, own)
                assert mine is not None
                await tw.cancel(victim)  # on acme's reply: not the stream's
                await tw.cancel(own)  # after it on the same subscription: once this one ends,
                async with asyncio.timeout(10):  # the owner has taken the first
                    await mine.ended.wait()
                theirs = schedule.owned(ingress, victim)
                assert theirs is not None and not theirs.ended.is_set()
        # the HTTP client left: its request ends too
        async with asyncio.timeout(10):
            await schedule.empty.wait()
    await letters.unsubscribe()


async def test_nats_auth_writes_a_client_user_for_each_tenant_of_the_key_file(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("acme sk-acme-0123456789abcdef\nrival sk-rival-0123456789abcdef\n")
    proc = await spawn("nats-auth", str(tmp_path / "auth"), "--api-key-file", str(keys),
                       "--tenant", "batchco")  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    written = sorted(p.stem for p in (tmp_path / "auth").glob("client-*.nk"))
    assert written == ["client-acme", "client-batchco", "client-rival"]
    env = (tmp_path / "auth" / "client-acme.env").read_text()
    assert "TOKENWAY_NATS_INBOX_PREFIX=_INBOX.client-acme" in env
    bad = await spawn("nats-auth", str(tmp_path / "auth"), "--tenant", "no.dots")
    _, err = await bad.communicate()
    assert bad.returncode != 0 and b"tenant 'no.dots'" in err
