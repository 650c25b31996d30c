"""Derender failover, caused for real (`--derender-placement pool`): a derender process is
killed mid-stream; the owner retries the same chunk with the same state on another worker and
the client sees the same text it would have seen without the fault. With no derender left,
the client gets a 502."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import time
from pathlib import Path

import httpx
import nats
import pytest

from tests.conftest import Stack, make_settings, start_stack
from tests.test_cli import free_port, logged, spawn, stop
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.wire import End, GenerateRequest
from workers.schedule.owned import Owned

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def derender_process(stack: Stack, data: Path, model: str) -> asyncio.subprocess.Process:
    """A `tokenway derender` process on `stack`'s bus as its role, once it serves (it logs
    so after subscribing)."""
    proc = await spawn("derender", "--data-dir", str(data), "--served-model-name", model,
                       env=stack.bus.env("derender"))  # fmt: skip
    await logged(proc, b"derender serving")
    return proc


async def stream_text(url: str, body: dict) -> tuple[str, str]:
    """The streamed text and the raw SSE tail."""
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            raw = b"".join([part async for part in resp.aiter_bytes()]).decode()
    docs = [json.loads(e.split("data: ", 1)[1]) for e in raw.split("\n\n") if "data: {" in e]
    return "".join(c["text"] for d in docs for c in d.get("choices", [])), raw[-200:]


class _Retried(logging.Handler):
    """Sets an event when the owner logs a derender retry."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "derender call failed" in record.getMessage():
            self.seen.set()


async def test_a_derender_worker_that_hangs_then_dies_mid_stream_loses_nothing(
    nats_url: str, tmp_path: Path
) -> None:
    # A model of its own: no other test's derender worker may answer for it.
    model = f"failover-{tmp_path.name}"
    settings = make_settings(tmp_path, derender_timeout=1.0, sim_itl=0.004, served_model_name=model,
                             derender_placement="pool")  # fmt: skip
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "sim"])
    doomed = await derender_process(stack, tmp_path, model)
    survivor = await derender_process(stack, tmp_path, model)
    retried = _Retried()
    owner_log = logging.getLogger("workers.schedule.derendering")
    owner_log.addHandler(retried)
    body = {"model": model, "prompt": "A long story", "max_tokens": 400, "ignore_eos": True,
            "seed": 5, "stream": True}  # fmt: skip
    try:
        expected, _ = await stream_text(stack.url, body)
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                parts = resp.aiter_bytes()
                received = [await anext(parts)]
                doomed.send_signal(signal.SIGSTOP)  # hangs: its calls time out
                async with asyncio.timeout(30):
                    await retried.seen.wait()  # the owner noticed and retried
                doomed.send_signal(signal.SIGKILL)  # then it dies for good
                received += [part async for part in parts]
        raw = b"".join(received).decode()
        docs = [json.loads(e.split("data: ", 1)[1]) for e in raw.split("\n\n") if "data: {" in e]
        assert "".join(c["text"] for d in docs for c in d["choices"]) == expected
        assert raw.endswith("data: [DONE]\n\n")
    finally:
        owner_log.removeHandler(retried)
        await stop(doomed, signal.SIGKILL)
        await stop(survivor, signal.SIGTERM)
        await stack.close()


async def test_with_no_derender_worker_the_client_gets_a_502(nats_url: str, tmp_path: Path) -> None:
    model = f"no-derender-{tmp_path.name}"
    settings = make_settings(
        tmp_path, derender_timeout=0.5, derender_retries=1, served_model_name=model,
        derender_placement="pool",
    )  # fmt: skip
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "sim"])
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.post(
                f"{stack.url}/v1/completions", json={"model": model, "prompt": "x"}
            )
        assert resp.status_code == 502
        assert "no derender worker" in resp.json()["error"]["message"]
    finally:
        await stack.close()


async def test_a_client_whose_ingress_dies_resumes_on_another_with_last_event_id(
    nats_url: str, tmp_path: Path
) -> None:
    model = f"resume-{tmp_path.name}"
    settings = make_settings(tmp_path, sim_itl=0.004, served_model_name=model)
    stack = await start_stack(
        nats_url, settings, ["ingress", "render", "schedule", "derender", "sim"]
    )
    port = str(free_port())
    doomed = await spawn(
        "ingress", "--data-dir", str(tmp_path), "--served-model-name", model, "--port", port,
        env=stack.bus.env("ingress"),
    )  # fmt: skip
    body = {"model": model, "prompt": "A long story", "max_tokens": 300, "ignore_eos": True,
            "seed": 9, "stream": True}  # fmt: skip
    try:
        await logged(doomed, b"listening on")
        expected, _ = await stream_text(stack.url, body)
        seen = b""
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with http.stream("POST", url, json=body) as resp:
                rid = resp.headers["x-tokenway-stream-id"]
                async for part in resp.aiter_bytes():
                    seen += part
                    if seen.count(b"\n\n") >= 5:
                        break
                doomed.send_signal(signal.SIGKILL)  # the ingress dies: no cancel goes out
            # As vLLM frames it: `data:` events only. The client counts the complete ones it
            # has and asks for the rest.
            assert not any(line.startswith(b"id:") for line in seen.split(b"\n"))
            complete = seen.decode().split("\n\n")[:-1]
            headers = {"Last-Event-ID": str(len(complete))}
            async with http.stream("GET", f"{stack.url}/v1/streams/{rid}", headers=headers) as resp:
                assert resp.status_code == 200
                rest = b"".join([part async for part in resp.aiter_bytes()]).decode()
        before = "\n\n".join(complete) + "\n\n"
        docs = [json.loads(e[len("data: ") :]) for e in (before + rest).split("\n\n")[:-2]]
        assert "".join(c["text"] for d in docs for c in d["choices"]) == expected  # no gap, no dup
        assert rest.endswith("data: [DONE]\n\n")
        async with httpx.AsyncClient() as http:
            missing = await http.get(f"{stack.url}/v1/streams/nosuchrequest")
        assert missing.status_code == 404
    finally:
        await stop(doomed, signal.SIGKILL)
        await stack.close()


async def test_a_new_owner_that_finds_the_end_stored_delivers_it_to_the_waiting_client(
    stack: Stack,
) -> None:
    """The last owner stored the end, then died before delivering it: the client's ingress
    would wait until the deadline. The owner that takes the request over delivers it."""
    schedule, router = stack.by_name["schedule"][0], stack.ingress.router
    rid, reply = f"end-{secrets.token_hex(4)}", stack.ingress.ingress_id
    slot = router.open(rid)
    try:
        nc = await nats.connect(stack.observer)
        try:  # stored, never delivered
            end = End(rid=rid, seq=1, payload=b"data: {}\n\n")
            await ledger.publish(nc.jetstream(), bus.out_subject(reply, rid), ledger.encode([end]),
                                 ledger.index_headers([end], reply=reply), within=5)  # fmt: skip
        finally:
            await nc.close()
        request = GenerateRequest(request_id=rid, token_ids=[1])
        r = Owned(rid=rid, reply=reply, request=request, deadline=time.time() + 60, msg=None)
        assert not await schedule._read_back(r)  # nothing left to run
        async with asyncio.timeout(10):
            [end] = await slot.take()
        assert (end.seq, end.kind, end.payload) == (1, h.KIND_END, b"data: {}\n\n")
    finally:
        router.close(rid)
