"""A tenant's share of the shared stores, through the `openai` SDK on the session's pipeline:
files (uploads, and its batches' parts and outputs) and stored responses are counted per
tenant across ingresses and the batch runner, refused past the quota with a 400 naming it,
given back when deleted or expired, and shown by `tokenway status`."""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack, guarded_bus, keyed_settings, make_settings, start_stack
from tests.test_batches import chat_line, finished, jsonl
from tests.test_status import status
from tokenway import bus
from tokenway.quota import CODE, FILES, RESPONSES, Kept, Quota, QuotaExceeded, Tally
from tokenway.quota_book import QuotaBook
from tokenway.response_store import NotStored, ResponseStore, Stored

pytestmark = pytest.mark.asyncio(loop_scope="session")

FILE = b"x" * 999 + b"\n"  # 1,000 bytes


class Tenant:
    """A tenant of its own (so that no other test's files count against it) and its key."""

    def __init__(self, shares: str) -> None:
        self.name = f"q{secrets.token_hex(4)}"
        self.key = f"sk-{self.name}-0123456789abcdef"
        self.line = f"{self.name} {self.key} {shares}\n"

    def client(self, ingress: Stack) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{ingress.url}/v1", api_key=self.key, max_retries=0)


TIGHT = Tenant("files_bytes=3000 files_count=10 responses_count=2")
ROOMY = Tenant("files_bytes=1000000")
OUTGROWN = Tenant("files_bytes=1300")  # an input file fits, its batch's output does not
RIVAL = Tenant("")  # the defaults


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ingresses(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Stack, Stack]]:
    """Two ingresses with the tenants' keys, beside the session pipeline's."""
    keys = "".join(t.line for t in (TIGHT, ROOMY, OUTGROWN, RIVAL))
    settings = keyed_settings(stack, tmp_path_factory.mktemp("quotas"), keys)
    one = await start_stack(stack.settings.nats, settings, ["ingress"])
    two = await start_stack(stack.settings.nats, settings, ["ingress"])
    yield one, two
    await one.close()
    await two.close()


async def kept(stack: Stack, tenant: str) -> Kept:
    """The tenant's usage as the bucket holds it (read as the tests' observer)."""
    nc = await nats.connect(stack.observer)
    try:
        return await QuotaBook(await bus.stored_kv(nc.jetstream(), stack.settings)).kept(tenant)
    finally:
        await nc.close()


async def upload(client: openai.AsyncOpenAI, data: bytes = FILE) -> str | openai.APIStatusError:
    try:
        return (await client.files.create(file=("f.jsonl", io.BytesIO(data)),
                                          purpose="batch")).id  # fmt: skip
    except openai.APIStatusError as exc:
        return exc


async def test_a_tenants_files_are_counted_across_ingresses_and_refused_past_its_quota(
    stack: Stack, ingresses: tuple[Stack, Stack]
) -> None:
    one, two = (TIGHT.client(i) for i in ingresses)
    # six uploads at once through both ingresses: the quota holds three of 1,000 bytes
    tried = await asyncio.gather(*(upload(c) for c in (one, two) * 3))
    made = [t for t in tried if isinstance(t, str)]
    refused = [t for t in tried if not isinstance(t, str)]
    assert len(made) == 3 and len(refused) == 3
    error = refused[0]
    assert error.status_code == 400 and isinstance(error, openai.BadRequestError)
    body = error.body
    assert isinstance(body, dict) and body["code"] == CODE and body["param"] == "file"
    assert body["type"] == "BadRequestError"  # as every 400 here is typed (vLLM's names)
    assert "3000 bytes of files (files_bytes)" in body["message"]
    assert "you keep 3 files of 3000 bytes" in body["message"]
    assert (await kept(stack, TIGHT.name)).used(FILES, 0) == Tally(3, 3000)
    # another tenant's room is its own
    assert isinstance(await upload(RIVAL.client(ingresses[0])), str)
    # a delete gives the room back, on either ingress
    await two.files.delete(made[0])
    assert isinstance(await upload(one), str)
    assert isinstance(await upload(two), openai.BadRequestError)
    assert {f.id for f in (await one.files.list()).data} >= set(made[1:])


async def test_a_tenants_stored_responses_are_counted_and_a_delete_gives_room_back(
    stack: Stack, ingresses: tuple[Stack, Stack]
) -> None:
    one, two = (TIGHT.client(i) for i in ingresses)
    ask = {"model": stack.model, "input": "hi", "max_output_tokens": 3}
    first = await one.responses.create(**ask)
    await two.responses.create(**ask)
    with pytest.raises(openai.BadRequestError) as over:
        await one.responses.create(**ask)
    body = over.value.body
    assert isinstance(body, dict) and body["code"] == CODE and body["param"] == "store"
    assert "2 stored responses (responses_count)" in body["message"]
    await two.responses.create(**ask, store=False)  # keeps nothing: not refused
    await two.responses.delete(first.id)
    third = await one.responses.create(**ask)
    assert (await two.responses.retrieve(third.id)).id == third.id
    assert (await kept(stack, TIGHT.name)).used(RESPONSES, time.time()).count == 2


async def test_stored_responses_give_their_room_back_as_they_expire(tmp_path: Path) -> None:
    """The responses bucket drops each response at its max age; the tenant's usage comes
    back with it, so that a tenant at its quota is not locked out for ever."""
    async with guarded_bus(tmp_path / "nats") as own:
        nc = await nats.connect(own.watch)
        try:
            settings = make_settings(tmp_path, responses_max_age=2.0)
            store = await ResponseStore.bind(nc.jetstream(), settings)
            share = Quota(responses_count=2)
            for i in range(2):
                kept = Stored(response=msgspec.Raw(b'{"output": []}'), input=[], tenant="acme")
                await store.put(f"resp_{i}", kept, share)
            with pytest.raises(QuotaExceeded):
                await store.admits("acme", share)
            async with asyncio.timeout(10):
                while True:  # the max age passing is what is waited for
                    try:
                        await store.admits("acme", share)
                        break
                    except QuotaExceeded:
                        await asyncio.sleep(0.2)
                for i in range(2):  # the bucket dropped them, as the usage says
                    while True:
                        try:
                            await store.get(f"resp_{i}", "acme")
                        except NotStored:
                            break
                        await asyncio.sleep(0.2)
            assert (await store.book.kept("acme")).used(RESPONSES, time.time()) == Tally(0, 0)
        finally:
            await nc.close()


async def test_a_batchs_parts_and_output_count_for_its_tenant(
    stack: Stack, ingresses: tuple[Stack, Stack]
) -> None:
    """The runner's parts count while it runs, its output and error files once it ends,
    and a tenant whose quota the output outgrows gets a failed batch saying why."""
    client = ROOMY.client(ingresses[0])
    data = jsonl([chat_line(i) for i in range(3)])
    file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")  # fmt: skip
    done = await finished(client, batch.id)
    assert done.status == "completed" and done.output_file_id and not done.error_file_id
    output = (await client.files.content(done.output_file_id)).content
    usage = (await kept(stack, ROOMY.name)).used(FILES, 0)
    assert usage == Tally(2, len(data) + len(output))  # the parts were given back
    code, out, err = await status(stack, "--json")
    assert code == 0, err
    (shown,) = [t for t in json.loads(out)["stored"] if t["tenant"] == ROOMY.name]
    assert shown["files"] == {"count": 2, "bytes": len(data) + len(output),
                              "count_limit": 10_000, "bytes_limit": 1_000_000}  # fmt: skip
    _, text, _ = await status(stack)
    assert "\nstored (per tenant)\n" in text and ROOMY.name in text

    tight = OUTGROWN.client(ingresses[1])
    file = await tight.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await tight.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")  # fmt: skip
    failed = await finished(tight, batch.id)
    assert failed.status == "failed" and failed.errors and failed.errors.data
    (why,) = failed.errors.data
    assert why.code == CODE and "files_bytes" in (why.message or "")
    assert (await kept(stack, OUTGROWN.name)).used(FILES, 0) == Tally(1, len(data))
    rest = b"y" * (1300 - len(data))  # the quota, full
    big = await tight.files.create(file=("b.jsonl", io.BytesIO(rest)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="files_bytes"):  # no room: no batch
        await tight.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")  # fmt: skip


async def test_a_keyless_deployment_has_one_quota_shared_by_every_client(
    stack: Stack, tmp_path: Path
) -> None:
    before = (await kept(stack, "")).used(FILES, 0).count
    settings = make_settings(tmp_path, tenant_files_count=before + 2)
    keyless = await start_stack(stack.settings.nats, settings, ["ingress"])
    try:
        clients = [openai.AsyncOpenAI(base_url=f"{keyless.url}/v1", api_key=f"anyone-{i}",
                                      max_retries=0) for i in range(3)]  # fmt: skip
        made = [await upload(c) for c in clients]
        assert isinstance(made[0], str) and isinstance(made[1], str)
        assert isinstance(made[2], openai.BadRequestError) and "files_count" in str(made[2])
        await clients[2].files.delete(made[0])  # anyone's is everyone's
    finally:
        await keyless.close()
