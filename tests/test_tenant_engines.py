"""What one tenant's request may do to the engines another tenant's run on: name no KV blocks
of theirs to pull (`kv_transfer_params`), and time no prompt of theirs in a shared prefix
cache (`cache_salt`). Two tenants' API keys on an ingress in front of the session's pipeline,
their direct clients, the session's own keyless ingress (an open deployment, as it was), and
a deployment whose tenants trust each other."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio

from engines.sim import SimEngine
from tests.conftest import Stack, keyed_ingress
from tests.test_scheduling import pipeline, sim
from tokenway.client import RequestFailed
from tokenway.wire import EngineWork, GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY_ACME, KEY_RIVAL = "sk-acme-engines-0123456789ab", "sk-rival-engines-0123456789ab"
KEYS = f"acme {KEY_ACME}\nrival {KEY_RIVAL}\n"
# What a P/D decode engine pulls remote KV by (vLLM's NIXL connector): a prefill engine's
# blocks, named by its engine id, host and port, and the request that holds them there.
FOREIGN_KV = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-theirs-0", "remote_block_ids": [3, 4, 5],
    "remote_host": "10.0.0.5", "remote_port": 5600,
}  # fmt: skip
ROUTED = re.compile(r"request (\S+) .*→ engine \S+ \(overlap (\d+)/(\d+) blocks")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """An ingress with the keys of two tenants, acme and rival, on the session's bus."""
    async with keyed_ingress(stack, tmp_path_factory.mktemp("engines"), KEYS) as ingress:
        yield ingress


def _client(url: str, key: str = "-") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def _complete(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], **extra: object
) -> None:
    await client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body=extra)


def _engine(stack: Stack) -> SimEngine:
    (bridge,) = stack.by_name["engine"]
    return bridge.engine


def _prompt() -> list[int]:
    """Four blocks of token IDs no other test sends."""
    base = secrets.randbelow(50_000)
    return [1000 + (base + i * 7919) % 60_000 for i in range(64)]


def _sent(engine: SimEngine, prompt: list[int]) -> list[EngineWork]:
    assert engine.received is not None
    return [w for w in engine.received if w.token_ids == prompt]


def _overlaps(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    """Each request's routing: how many of its prompt's blocks the owner counted as cached."""
    found = (ROUTED.search(r.getMessage()) for r in caplog.records)
    return {m[1]: int(m[2]) for m in found if m}


async def test_a_tenants_kv_transfer_params_never_reach_an_engine(
    keyed: Stack, stack: Stack
) -> None:
    """With tenants, a client's `kv_transfer_params` could make a decode engine pull a prefill
    engine's blocks that hold another tenant's prompt: a 400 naming the parameter, from an
    API key's request and from a tenant's direct job alike, and no engine sees them. The
    keyless ingress passes them on as before (an external P/D coordinator sends them)."""
    prompt = _prompt()
    async with _client(keyed.url, KEY_ACME) as acme:
        with pytest.raises(openai.BadRequestError) as refused:
            await _complete(acme, keyed.model, prompt, kv_transfer_params=FOREIGN_KV)
    assert refused.value.body["param"] == "kv_transfer_params", refused.value.body
    async with await stack.direct("rival") as tw:
        job = GenerateRequest(request_id="", token_ids=prompt, kv_transfer_params=FOREIGN_KV,
                              sampling_params=SamplingParams(max_tokens=2))  # fmt: skip
        with pytest.raises(RequestFailed) as failed:
            await tw.run(job, rid=f"kv-{secrets.token_hex(4)}")
    assert failed.value.status == 400 and failed.value.error["param"] == "kv_transfer_params"
    assert _sent(_engine(stack), prompt) == []

    async with _client(stack.url) as anyone:
        await _complete(anyone, stack.model, prompt, kv_transfer_params=FOREIGN_KV)
    assert [w.kv_transfer_params for w in _sent(_engine(stack), prompt)] == [FOREIGN_KV]


async def test_two_tenants_identical_prompts_share_no_cached_prefix(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """acme's and rival's jobs send one prompt, plain and with the same `cache_salt`: the
    engine gets a salt of each tenant's own for each (never another tenant's), and the owner
    counts no block of one tenant's as cached for the other, while acme's second run finds
    its own first run's prefix."""
    caplog.set_level(logging.INFO, logger="workers.schedule")
    prompt, tag = _prompt(), secrets.token_hex(4)
    runs = [("acme", None), ("rival", None), ("acme", None), ("rival", "team"), ("acme", "team")]
    rids = [f"salt-{tenant}-{k}-{tag}" for k, (tenant, _) in enumerate(runs)]
    for rid, (tenant, salt) in zip(rids, runs, strict=True):
        async with await stack.direct(tenant) as tw:
            job = GenerateRequest(request_id="", token_ids=prompt, cache_salt=salt,
                                  sampling_params=SamplingParams(max_tokens=2))  # fmt: skip
            await tw.run(job, rid=rid)
    overlaps = _overlaps(caplog)
    assert [overlaps[rid] for rid in rids] == [0, 0, 4, 0, 0], overlaps
    salts = [w.cache_salt for w in _sent(_engine(stack), prompt)]
    assert len(salts) == 5 and None not in salts and "team" not in salts
    assert salts[0] == salts[2] and len(set(salts)) == 4, salts


async def test_a_keyless_deployment_shares_the_prefix_cache_as_before(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """No keys: one tenant, every client. An unsalted prompt goes to the engine unsalted
    and is found cached the second time; a salted one is kept apart from it."""
    caplog.set_level(logging.INFO, logger="workers.schedule")
    prompt = _prompt()
    async with _client(stack.url) as anyone:
        for salt in (None, None, "mine"):
            await _complete(
                anyone, stack.model, prompt, **({} if salt is None else {"cache_salt": salt})
            )
    assert list(_overlaps(caplog).values())[-3:] == [0, 4, 0]
    salts = [w.cache_salt for w in _sent(_engine(stack), prompt)]
    assert salts[:2] == [None, None] and salts[2] is not None


async def test_tenants_that_trust_each_other_share_the_cache_and_pass_kv_params(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--share-prefix-cache` and `--trust-client-kv-transfer`: two tenants' identical
    prompts are one prefix to the owner and the engine, and a tenant's kv_transfer_params
    reach the engine."""
    caplog.set_level(logging.INFO, logger="workers.schedule")
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    settings = {"api_key_file": str(keys), "share_prefix_cache": True,
                "trust_client_kv_transfer": True}  # fmt: skip
    prompt = _prompt()
    async with pipeline(nats_url, tmp_path, [sim("trusting")], **settings) as (stack, (engine,)):
        for key in (KEY_ACME, KEY_RIVAL):
            async with _client(stack.url, key) as client:
                await _complete(client, stack.model, prompt, kv_transfer_params=FOREIGN_KV)
        assert list(_overlaps(caplog).values()) == [0, 4]
        sent = _sent(engine, prompt)
        assert [(w.cache_salt, w.kv_transfer_params) for w in sent] == [(None, FOREIGN_KV)] * 2
