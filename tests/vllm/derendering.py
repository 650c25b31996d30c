"""One chat derender call, answered by vLLM's render server and by tokenway's derender route
core (in process, the same code the render worker runs): the tier's parser tests hold the
two to each other on the same token IDs."""

from __future__ import annotations

import json
from typing import Any

import httpx

from bench.vllm_serve import VllmServer
from workers.derender.backend import LocalBackend
from workers.render import derender_routes
from workers.render.core import Renderer

# vLLM's render server, and tokenway's renderer and derender core for the same flags
Parts = tuple[VllmServer, Renderer, LocalBackend]


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
