"""A vLLM server beside tokenway over HTTP (a render or a derender server): one pooled client
to it, and how its answers that are not the one asked for read."""

from __future__ import annotations

import httpx
import msgspec
from msgspec import Struct

from tokenway.errors import InvalidRequest, TokenwayError, Unprocessable


class _ErrorInfo(Struct):
    message: str
    param: str | None = None


class _ErrorBody(Struct):
    error: _ErrorInfo


_error_reply = msgspec.json.Decoder(_ErrorBody)


def snippet(content: bytes) -> str:
    return content[:300].decode("utf-8", "replace").strip() or "(empty body)"


def refusal(status: int, content: bytes) -> TokenwayError:
    """A 400/422 from the server: the request's own error, with the server's message."""
    try:
        error = _error_reply.decode(content).error
        message, param = error.message, error.param
    except msgspec.DecodeError:
        message, param = f"the server refused the request: {snippet(content)}", None
    return (Unprocessable if status == 422 else InvalidRequest)(message, param=param)


def sidecar_http(url: str, connect_timeout: float, timeout: float) -> httpx.AsyncClient:
    """One pooled, keep-alive client to a vLLM server beside us (render or derender)."""
    return httpx.AsyncClient(
        base_url=url.rstrip("/"),
        timeout=httpx.Timeout(timeout, connect=connect_timeout),
        trust_env=False,  # a sidecar on the cluster network, never behind a proxy
    )
