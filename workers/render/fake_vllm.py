"""A fake vLLM render server for tests: vLLM 0.33's render routes over real HTTP, with faults.

`async with FakeVllmRender(renderer) as fake:` serves `POST /v1/chat/completions/render` and
`POST /v1/completions/render` with uvicorn on 127.0.0.1 at `fake.url`. It renders with
tokenway's own local `Renderer`, so a healthy answer holds exactly the token IDs local
rendering gives, in vLLM's JSON (a `GenerateRequest`, or a list of one for completions); a
request the renderer refuses is a 400 with its message, as vLLM answers. `fake.knobs` injects
faults and may change between requests; `fake.calls` records every request. `stop()` closes
the port (and every kept-alive connection) and `start()` opens the same port again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import uvicorn

from engines.fake_http import QuietServer, read_body, send_body, send_json
from tokenway.errors import TokenwayError
from tokenway.wire import Api, GenerateRequest, RenderRequest
from workers.render.core import Renderer
from workers.render.vllm_http import CHAT_PATH, COMPLETION_PATH

# die: start a 200 answer, then close the connection mid-body; hang: answer nothing until
# the server stops; garbage: a 200 that is not JSON; shape: JSON without token_ids;
# empty: no token IDs; vocab: a token ID past the vocabulary.
Fault = Literal["die", "hang", "garbage", "shape", "empty", "vocab"]

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError"}


@dataclass
class Knobs:
    fault: Fault | None = None
    status: int | None = None  # answer with this status (5xx, or 400/422) and `message`
    message: str = "fake render failure"
    # Prepended to every prompt: a valid rendering that local rendering never gives, so a test
    # can tell whose tokens reached the engine.
    prefix: list[int] = field(default_factory=list)
    # Sampling parameters the server adds, as a model's generation config would.
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Call:
    api: Api
    body: dict[str, Any]


class _Died(Exception):
    """Raised on purpose after the answer started: uvicorn then closes the connection."""


class _HideDeliberateDeaths(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Died))


_DEATHS = _HideDeliberateDeaths()


def error_doc(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def vllm_generate_request(api: Api, generate: GenerateRequest, body: dict[str, Any]) -> dict:
    """`generate` as vLLM's render route dumps its GenerateRequest (every field, nulls too)."""
    stream = bool(body.get("stream"))
    params = msgspec.to_builtins(generate.sampling_params)
    if params.get("max_tokens") == 16:
        del params["max_tokens"]  # vLLM's own default, so its omit_defaults leaves it out
    params.update(output_kind=1 if stream else 2, skip_clone=True)  # DELTA / FINAL_ONLY
    parse_context = None
    if api == "chat":
        parse_context = {
            "tools": body.get("tools"),
            "tool_choice": body.get("tool_choice", "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "include_reasoning": body.get("include_reasoning", True),
            "chat_template_kwargs": body.get("chat_template_kwargs") or {},
            "history_tool_call_cnt": 0,
        }
    return {
        "request_id": f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{generate.request_id}",
        "token_ids": generate.token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": params,
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": body.get("return_token_ids"),
        "output_mode": "tokens",
        "parse_context": parse_context,
        "stream": stream,
        "stream_options": body.get("stream_options") if stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": body.get("kv_transfer_params"),
        "ec_transfer_params": None,
    }


class FakeVllmRender:
    def __init__(self, renderer: Renderer, knobs: Knobs | None = None) -> None:
        self.renderer = renderer
        self.knobs = knobs or Knobs()
        self.calls: list[Call] = []
        self.url = ""
        self.port = 0
        self._released = asyncio.Event()  # ends hanging answers
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    def reset(self, knobs: Knobs | None = None) -> None:
        self.knobs = knobs or Knobs()
        self.calls.clear()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on a free port, or on the port of the last `stop()`."""
        logging.getLogger("uvicorn.error").addFilter(_DEATHS)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._released = asyncio.Event()
        config = uvicorn.Config(
            self, interface="asgi3", http="h11", lifespan="off", log_config=None,
            log_level="warning", access_log=False, timeout_graceful_shutdown=2,
        )  # fmt: skip
        self._server = QuietServer(config)
        # Connections queue on the bound socket until uvicorn accepts them: no wait needed.
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))

    async def stop(self) -> None:
        """Close the port and every connection: from now on, connections are refused."""
        assert self._server is not None and self._task is not None
        self._released.set()
        self._server.should_exit = True
        await self._task

    async def __aenter__(self) -> FakeVllmRender:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        api: Api | None = {CHAT_PATH: "chat", COMPLETION_PATH: "completion"}.get(scope["path"])
        if api is None or scope["method"] != "POST":
            await send_json(send, 404, {"detail": "Not Found"})
            return
        raw = await read_body(receive)
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            await send_json(send, 400, error_doc(400, f"JSON decode error: {exc}"))
            return
        self.calls.append(Call(api, body))
        k = self.knobs
        if k.status is not None:
            await send_json(send, k.status, error_doc(k.status, k.message))
        elif k.fault == "hang":
            await self._released.wait()
            await send_json(send, 503, error_doc(503, "shutting down"))
        elif k.fault == "die":
            start = {"type": "http.response.start", "status": 200,
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", b"4096")]}  # fmt: skip
            await send(start)
            await send(
                {"type": "http.response.body", "body": b'{"request_id": ', "more_body": True}
            )
            raise _Died("closing the connection mid-answer")
        elif k.fault == "garbage":
            await send_body(send, 200, b"<html><body>upstream gone</body></html>", b"text/html")
        else:
            await self._render(api, raw, body, send)

    async def _render(self, api: Api, raw: bytes, body: dict[str, Any], send: Any) -> None:
        k = self.knobs
        try:
            generate = self.renderer.render(
                RenderRequest(api=api, request_id="fake", body=raw, created=0)
            )
        except TokenwayError as exc:
            await send_json(send, exc.status, error_doc(exc.status, exc.message, exc.param))
            return
        doc = vllm_generate_request(api, generate, body)
        doc["token_ids"] = k.prefix + doc["token_ids"]
        doc["sampling_params"].update(k.params)
        if k.fault == "shape":
            doc["prompt_token_ids"] = doc.pop("token_ids")
        elif k.fault == "empty":
            doc["token_ids"] = []
        elif k.fault == "vocab":
            doc["token_ids"].append(self.renderer.builder.info.vocab_size + 7)
        await send_json(send, 200, doc if api == "chat" else [doc])
