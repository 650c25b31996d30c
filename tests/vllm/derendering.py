"""One chat derender call, answered by vLLM's render server and by tokenway's derender route
core (in process, the same code the render worker runs): the tier's parser tests hold the
two to each other on the same token IDs."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.vllm_serve import VllmServer
from workers.derender.backend import LocalBackend
from workers.render import derender_routes
from workers.render.core import Renderer

# vLLM's render server, and tokenway's renderer and derender core for the same flags
Parts = tuple[VllmServer, Renderer, LocalBackend]


STEPS = (1, 3, 7)  # tokens per event of the streams held to a whole answer


def whole_call(
    ids: list[int], finish: str, request: dict[str, Any], prompt: list[int]
) -> dict[str, Any]:
    """A non-streaming derender call of `ids` (one choice) for the chat request `request`."""
    whole = {"request_id": "generate-tokens-w", "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids}]}  # fmt: skip
    return {"generate_response": whole, "prompt_token_ids": prompt, "chat_request": request}


async def theirs(server: VllmServer, call: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/derender", json=call)
        assert resp.status_code == 200, resp.text
        return resp.json()


async def ours(parts: Parts, call: dict[str, Any]) -> Any:
    """tokenway's answer, as its JSON would read."""
    _, renderer, derenderer = parts
    body = json.dumps(call).encode()
    answer = await derender_routes.answer(renderer, derenderer, "chat_derender", body)
    return json.loads(json.dumps(answer))


@dataclass(frozen=True)
class Streamed:
    """A derender stream as a client assembles it (None where a part never came)."""

    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments), in index order
    finish: str | None


async def streamed(
    ask: Callable[[dict[str, Any]], Awaitable[Any]],
    ids: list[int],
    step: int,
    *,
    finish: str,
    request: dict[str, Any],
    prompt: list[int],
) -> Streamed:
    """A server's stream of `ids`, `step` at a time, each call carrying the last call's
    `stream_state` (`ask`: one call to vLLM or to tokenway), assembled."""
    state, thought, text, last = None, "", "", None
    calls: dict[int, tuple[str, str]] = {}
    for start in range(0, len(ids), step):
        end = start + step >= len(ids)
        choice = {"index": 0, "token_ids": ids[start : start + step],
                  "finish_reason": finish if end else None}  # fmt: skip
        call = {"stream": True, "stream_state": state, "chat_request": request,
                "generate_chunk": {"request_id": "generate-tokens-s", "choices": [choice]},
                "prompt_token_ids": prompt}  # fmt: skip
        answer = await ask(call)
        state = answer["stream_state"]
        (delta_choice,) = answer["chunk"]["choices"]
        delta = delta_choice["delta"]
        thought += delta.get("reasoning") or ""
        text += delta.get("content") or ""
        for t in delta.get("tool_calls") or []:
            name, args = calls.get(t["index"], ("", ""))
            calls[t["index"]] = (name + (t["function"].get("name") or ""),
                                 args + (t["function"].get("arguments") or ""))  # fmt: skip
        last = delta_choice["finish_reason"] or last
    return Streamed(thought or None, text or None, [calls[i] for i in sorted(calls)], last)


async def our_streams(
    parts: Parts, ids: list[int], *, finish: str, request: dict[str, Any], prompt: list[int]
) -> list[Streamed]:
    """tokenway's streams of `ids` at each of STEPS tokens per event, assembled."""
    return [
        await streamed(
            lambda call: ours(parts, call), ids, step, finish=finish, request=request, prompt=prompt
        )
        for step in STEPS
    ]
