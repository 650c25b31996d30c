"""A fake vLLM render server for tests: vLLM 0.33's render and derender routes over real HTTP,
with faults.

`async with FakeVllmRender(renderer) as fake:` serves `POST /v1/chat/completions/render` and
`POST /v1/completions/render` with uvicorn on 127.0.0.1 at `fake.url`. It renders with
tokenway's own local `Renderer`, so a healthy answer holds exactly the token IDs local
rendering gives, in vLLM's JSON (a `GenerateRequest`, or a list of one for completions); a
request the renderer refuses is a 400 with its message, as vLLM answers. The derender routes
(`/v1/chat/completions/derender`, `/v1/completions/derender`) derender with tokenway's local
core, so their text is the local backend's; the fake's `stream_state` is vLLM-shaped JSON
holding the local core's state (`{"tw": base64, "pad": ...}`), and a streaming request with
stop strings is refused as vLLM refuses it. `fake.knobs` injects faults (into every route)
and may change between requests; `fake.calls` records every request. `stop()` closes
the port (and every kept-alive connection) and `start()` opens the same port again.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from tokenizers import Tokenizer

from tests.fakes.http import (
    QuietServer,
    read_body,
    send_body,
    send_json,
    serve,
)
from tokenway.api import openai_output
from tokenway.errors import TokenwayError
from tokenway.wire import (
    Api,
    DerenderEntry,
    GenerateRequest,
    LogprobEntry,
    OutputContext,
    RenderRequest,
    TokenLogprob,
)
from workers.derender.core import derender
from workers.derender.detok import Detokenizer
from workers.derender.vllm_http import CHAT_PATH as DERENDER_CHAT_PATH
from workers.derender.vllm_http import COMPLETION_PATH as DERENDER_COMPLETION_PATH
from workers.render.core import Renderer
from workers.render.vllm_http import CHAT_PATH, COMPLETION_PATH

# die: start a 200 answer, then close the connection mid-body; hang: answer nothing until
# the server stops; garbage: a 200 that is not JSON; shape: JSON without token_ids;
# empty: no token IDs; vocab: a token ID past the vocabulary.
Fault = Literal["die", "hang", "garbage", "shape", "empty", "vocab"]

_ROUTES: dict[str, Api] = {
    CHAT_PATH: "chat", COMPLETION_PATH: "completion",
    DERENDER_CHAT_PATH: "chat", DERENDER_COMPLETION_PATH: "completion",
}  # fmt: skip
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError"}


@dataclass
class Knobs:
    fault: Fault | None = None
    status: int | None = None  # answer with this status (5xx, or 400/422) and `message`
    times: int | None = None  # fault/status for this many requests only (None: every one)
    message: str = "fake render failure"
    # Prepended to every prompt: a valid rendering that local rendering never gives, so a test
    # can tell whose tokens reached the engine.
    prefix: list[int] = field(default_factory=list)
    # Sampling parameters the server adds, as a model's generation config would.
    params: dict[str, Any] = field(default_factory=dict)
    # Characters added to every derender stream_state, as vLLM's parser path grows it.
    state_pad: int = 0


@dataclass
class Call:
    api: Api
    body: dict[str, Any]
    derender: bool = False


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
        self.detok = Detokenizer(
            Tokenizer.from_file(str(renderer.builder.info.path / "tokenizer.json"))
        )
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
        self._released = asyncio.Event()
        self.url, self._server, self._task = serve(self, self.port)
        self.port = int(self.url.rsplit(":", 1)[1])

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
        api: Api | None = _ROUTES.get(scope["path"])
        if api is None or scope["method"] != "POST":
            await send_json(send, 404, {"detail": "Not Found"})
            return
        raw = await read_body(receive)
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            await send_json(send, 400, error_doc(400, f"JSON decode error: {exc}"))
            return
        derender = scope["path"] in (DERENDER_CHAT_PATH, DERENDER_COMPLETION_PATH)
        self.calls.append(Call(api, body, derender))
        k = self.knobs
        if k.times is not None:
            if k.times <= 0:
                k.fault = k.status = None  # the faults were used up: healthy from now on
            k.times -= 1
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
        elif derender:
            await self._derender(api, body, send)
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

    async def _derender(self, api: Api, body: dict[str, Any], send: Any) -> None:
        """One derender call, answered by tokenway's local core in vLLM's shapes."""
        request = body.get("chat_request") or body.get("completion_request") or {}
        stream = bool(body.get("stream"))
        if stream and request.get("stop"):
            message = "stop strings are not supported by streaming derender"
            await send_json(send, 400, error_doc(400, message))
            return
        if stream or api == "chat":
            gen = body["generate_chunk" if stream else "generate_response"]
            tail, prompt_tokens = body["prompt_token_ids"], body["prompt_tokens"]
        else:  # lists, one per prompt: tokenway sends one
            keys = ("generate_responses", "prompt_token_ids", "prompt_tokens")
            gen, tail, prompt_tokens = (body[k][0] for k in keys)
        raw = msgspec.json.encode(request)
        rendered = self.renderer.render(
            RenderRequest(api=api, request_id="fake", body=raw, created=0)
        )
        ctx = msgspec.structs.replace(
            rendered.context,
            response_id=gen["request_id"],
            created=int(time.time()),
            stream=stream,
            prompt_tokens=prompt_tokens,
            prompt_tail=tail,
            include_usage=gen.get("usage") is not None,
            continuous_usage_stats=True,
            closing_usage=False,
        )
        state = (body.get("stream_state") or {}).get("tw")
        if not gen["choices"]:  # the generate route's closing usage chunk
            doc = openai_output.usage_chunk(ctx, gen["usage"]["completion_tokens"])
            await send_json(send, 200, {"chunk": msgspec.json.decode(doc), "stream_state": {}})
            return
        choice = gen["choices"][0]
        entry = DerenderEntry(
            context=msgspec.structs.replace(ctx, index_base=choice["index"]),
            state=base64.b64decode(state) if state else None,
            token_ids=choice["token_ids"], prompt_token_ids=gen.get("prompt_token_ids"),
            logprobs=_logprobs(choice.get("logprobs")), finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
        )  # fmt: skip
        result = derender(self.detok, entry)  # raises on what vLLM would answer 400 to
        if not stream:
            await send_json(send, 200, msgspec.json.decode(result.chunks[0]))
            return
        docs = [msgspec.json.decode(c) for c in result.chunks]
        doc = _one_chunk(docs) if docs else _empty_chunk(ctx, api, choice["index"])
        new_state = {
            "tw": base64.b64encode(result.state or b"").decode(),
            "pad": "x" * self.knobs.state_pad,
        }
        await send_json(send, 200, {"chunk": doc, "stream_state": new_state})


def _logprobs(doc: dict[str, Any] | None) -> list[LogprobEntry] | None:
    if doc is None:
        return None

    def top(e: dict[str, Any]) -> list[TokenLogprob]:
        return [TokenLogprob(t["token_id"], t["logprob"], t.get("rank")) for t in e["top_logprobs"]]

    return [
        LogprobEntry(e["token_id"], e["logprob"], e.get("rank"), top(e)) for e in doc["content"]
    ]


def _one_chunk(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's derender route answers one chunk a call: the role rides on the first chunk
    with output (its chat route, like tokenway's core, sends it in a chunk of its own)."""
    first, *rest = docs
    delta = first["choices"][0].get("delta") if first["choices"] else None
    if not rest or delta != {"role": "assistant", "content": ""}:
        return first
    doc = rest[0]
    doc["choices"][0]["delta"] = {"role": "assistant", **doc["choices"][0]["delta"]}
    if first.get("prompt_token_ids") is not None:
        doc["prompt_token_ids"] = first["prompt_token_ids"]
    return doc


def _empty_chunk(ctx: OutputContext, api: Api, index: int) -> dict[str, Any]:
    """vLLM answers every call with a chunk, also when the tokens showed nothing yet."""
    if api == "chat":
        choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        kind = "text_completion"
    return {"id": ctx.response_id, "object": kind, "created": ctx.created, "model": ctx.model,
            "choices": [choice], "usage": None}  # fmt: skip
