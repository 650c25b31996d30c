"""vLLM 0.33's render routes over HTTP: an OpenAI body → the prompt's token IDs.

A vLLM render server (`vllm launch render`, or any `vllm serve`) answers
`POST /v1/chat/completions/render` with one `GenerateRequest` and `POST /v1/completions/render`
with a list of them, one per prompt: `token_ids` plus the `sampling_params` it would run
(its model's generation-config defaults applied). Errors are `{"error": {"message", "type",
"param", "code"}}` with the status in `code`.

Every answer is sorted into one of three outcomes: a usable prompt, the request's own error
(400/422, raised as `InvalidRequest`/`Unprocessable` with the server's message), or
`RenderUnavailable` naming why the server could not be used (the caller renders locally).
"""

from __future__ import annotations

import httpx
import msgspec
from msgspec import Struct

from tokenway.vllm_sidecar import refusal, sidecar_http, snippet
from tokenway.wire import Api, SamplingParams

CHAT_PATH = "/v1/chat/completions/render"
COMPLETION_PATH = "/v1/completions/render"
# each API's render route: one prompt each, but completions' (a list of them)
PATHS = {
    "chat": CHAT_PATH,
    "completion": COMPLETION_PATH,
    "messages": "/v1/messages/render",
    "responses": "/v1/responses/render",
}
_HEADERS = {"content-type": "application/json"}


class RenderUnavailable(Exception):
    """The render server could not render this request; `reason` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RenderedPrompt(Struct):
    """The fields of vLLM's `GenerateRequest` that render takes; the rest are ignored."""

    token_ids: list[int]
    sampling_params: SamplingParams


_chat_reply = msgspec.json.Decoder(RenderedPrompt)
_completion_reply = msgspec.json.Decoder(list[RenderedPrompt])


def prompt_from_reply(api: Api, status: int, content: bytes, vocab_size: int) -> RenderedPrompt:
    """The prompt in a render server's answer, or why the answer cannot be used."""
    if status in (400, 422):
        raise refusal(status, content)
    if status != 200:
        reason = "server_error" if status >= 500 else "status"
        raise RenderUnavailable(reason, f"HTTP {status}: {snippet(content)}")
    try:
        if api != "completion":
            prompt = _chat_reply.decode(content)
        else:
            prompts = _completion_reply.decode(content)
            if len(prompts) != 1:
                raise RenderUnavailable("shape", f"{len(prompts)} prompts for one")
            prompt = prompts[0]
    except msgspec.ValidationError as exc:
        raise RenderUnavailable("shape", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise RenderUnavailable("undecodable", f"{exc}: {snippet(content)}") from exc
    if not prompt.token_ids:
        raise RenderUnavailable("empty", "no token_ids")
    bad = next((t for t in prompt.token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RenderUnavailable("vocab", f"token id {bad} is outside the vocabulary ({vocab_size})")
    return prompt


class VllmRenderClient:
    """One pooled, keep-alive HTTP client to a render server."""

    def __init__(self, url: str, vocab_size: int, connect_timeout: float, timeout: float) -> None:
        self.vocab_size = vocab_size
        self.http = sidecar_http(url, connect_timeout, timeout)

    async def render(self, api: Api, body: bytes) -> RenderedPrompt:
        """The client's body, as it sent it, to the matching render route."""
        try:
            resp = await self.http.post(PATHS[api], content=body, headers=_HEADERS)
        except httpx.TimeoutException as exc:
            raise RenderUnavailable("timeout", f"{type(exc).__name__}: {exc}") from exc
        except httpx.TransportError as exc:
            # Refused, reset, or closed before a whole answer: nothing to read.
            raise RenderUnavailable("connection", f"{type(exc).__name__}: {exc}") from exc
        return prompt_from_reply(api, resp.status_code, resp.content, self.vocab_size)

    async def aclose(self) -> None:
        await self.http.aclose()
