"""Stored responses at the ingress: a Responses request's conversation (its stored
predecessor's, when it names one, and its own input), kept with its response once that is
made; and the routes that read and delete them (`GET /v1/responses/{id}`, its
`input_items`, `DELETE`)."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from tokenway import sse
from tokenway.api.openai import not_json
from tokenway.api.responses import COMPLETED, RESPONSE_ID_PREFIX
from tokenway.errors import InvalidRequest, ModelNotFound, TokenwayError, error_body
from tokenway.quota import UNLIMITED, Quota
from tokenway.response_store import NotStored, ResponseStore, Stored

log = logging.getLogger(__name__)

_ID = re.compile(re.escape(RESPONSE_ID_PREFIX) + r"[A-Za-z0-9_-]{1,128}")
_decode = msgspec.json.Decoder()
_json = msgspec.json.Encoder()
_FINAL = sse.NAMED + COMPLETED.encode() + b"\n"  # a stream's last event, whatever its status


@dataclass(frozen=True)
class Conversation:
    """A Responses request as render gets it: its body (the stored conversation it
    continues put before its input), what it continues, and what to keep if it asks."""

    body: bytes
    previous: str | None  # the stored response it continues
    items: list[dict[str, Any]]  # the whole conversation it answers, as items with ids
    store: bool
    tenant: str
    quota: Quota  # the tenant's: what it keeps is counted against it

    async def keep(self, store: ResponseStore, response: bytes) -> None:
        """Keep the response with the conversation it answered (when it asked to be)."""
        if not self.store:
            return
        doc = _decode.decode(response)
        kept = Stored(response=msgspec.Raw(response), input=self.items, tenant=self.tenant)
        try:
            await store.put(doc["id"], kept, self.quota)
        except Exception as exc:  # the answer stands; only a follow-up will miss it
            log.warning("response %s could not be stored: %r", doc.get("id"), exc)


def _items(given: Any) -> list[dict[str, Any]]:
    """A request's input as items as OpenAI lists them: each with an id, a message's text
    as a part (an input that is neither text nor a list: none, for validation to refuse)."""
    items: list[dict[str, Any]]
    if isinstance(given, str):
        items = [{"type": "message", "role": "user", "content": given}]
    else:
        listed = given if isinstance(given, list) else []
        items = [dict(item) for item in listed if isinstance(item, dict)]
    for item in items:
        kind = item.setdefault("type", "message")
        item.setdefault("id", f"{'msg' if kind == 'message' else 'item'}_{secrets.token_hex(12)}")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
    return items


async def conversation(
    store: ResponseStore, body: bytes, tenant: str, quota: Quota = UNLIMITED
) -> Conversation:
    """The body render gets and what to keep of it; `previous_response_id` resolved here,
    on any ingress (another tenant's, or one past the store's age, is a 404). A request
    asking to be stored while its tenant keeps all its quota allows is refused here,
    before it runs (`QuotaExceeded`)."""
    try:
        doc = _decode.decode(body)
    except msgspec.DecodeError as exc:
        raise not_json(body, exc) from exc
    if not isinstance(doc, dict):
        raise InvalidRequest("a Responses request is a JSON object")
    items = _items(doc.get("input") or [])
    previous = doc.pop("previous_response_id", None)
    if previous is not None:
        if not isinstance(previous, str) or not _ID.fullmatch(previous):
            raise InvalidRequest(
                f"{str(previous)[:80]!r} is not a response id", param="previous_response_id"
            )
        try:
            before = await store.get(previous, tenant)
        except NotStored:
            raise ModelNotFound(
                f"Previous response with id {previous!r} not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None
        answered = _decode.decode(before.response).get("output", [])
        items = [*before.input, *answered, *items]
        doc["input"] = items
        body = _json.encode(doc)
    keep = doc.get("store") is not False
    if keep:
        await store.admits(tenant, quota)
    return Conversation(body, previous, items, keep, tenant, quota)


def final_response(payload: bytes) -> bytes | None:
    """The response a stream's closing events hold (its `response.completed` event's), if
    these bytes end one."""
    for event in payload.split(b"\n\n"):
        if event.startswith(_FINAL):
            data = event.split(b"\ndata: ", 1)[1]
            return _json.encode(_decode.decode(data)["response"])
    return None


# What OpenAI's `include` takes (its ResponseIncludable): none of it adds to items kept here.
_INCLUDABLE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
        "message.output_text.logprobs",
    }
)
MAX_PAGE, DEFAULT_PAGE = 100, 20


def input_page(items: list[dict[str, Any]], query: list[tuple[str, str]]) -> dict[str, Any]:
    """A page of a response's input items as OpenAI lists them, for the query's `order`
    (`desc`, newest first, where unsaid), `limit` (1..100, 20), `after` (an item id the page
    starts past, in that order) and `before` (the older APIs' cursor: the page that ends
    just before it); `include` is checked and adds nothing. A value OpenAI refuses is a
    400 naming it."""
    asked = dict(query)  # the last of a repeated parameter
    order = asked.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be 'asc' or 'desc', not {order[:40]!r}", param="order")
    limit = asked.get("limit", str(DEFAULT_PAGE))
    if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_PAGE:
        raise InvalidRequest(
            f"limit must be an integer from 1 to {MAX_PAGE}, not {limit[:40]!r}", param="limit"
        )
    for name, value in query:
        if name in ("include", "include[]") and value not in _INCLUDABLE:
            raise InvalidRequest(
                f"include: {value[:80]!r} is not one of {', '.join(sorted(_INCLUDABLE))}",
                param="include",
            )
    listed = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in listed]
    start, end = 0, len(listed)
    for cursor in ("after", "before"):
        if (at := asked.get(cursor)) is None:
            continue
        if at not in ids:
            raise InvalidRequest(
                f"{cursor}: no input item {at[:80]!r} in this response", param=cursor
            )
        if cursor == "after":
            start = ids.index(at) + 1
        else:
            end = ids.index(at)
    window, size = listed[start:end], int(limit)
    page = window[-size:] if "before" in asked and "after" not in asked else window[:size]
    return {
        "object": "list",
        "data": page,
        "has_more": len(window) > len(page),
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


def _error(exc: TokenwayError) -> Response:
    return Response(error_body(exc.info()), status_code=exc.status, media_type="application/json")


def _missing(response_id: str) -> Response:
    return _error(
        ModelNotFound(
            f"No response found with id {response_id[:80]!r}.",
            param="response_id",
            code="response_not_found",
        )
    )


def add_routes(app: FastAPI, store: Callable[[], Awaitable[ResponseStore]]) -> None:
    async def stored(request: Request, response_id: str) -> Stored | Response:
        if not _ID.fullmatch(response_id):
            return _missing(response_id)
        try:
            return await (await store()).get(response_id, request.scope["state"]["tenant"])
        except NotStored:
            return _missing(response_id)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        """A stored response, as its client got it."""
        found = await stored(request, response_id)
        if isinstance(found, Response):
            return found
        return Response(bytes(found.response), media_type="application/json")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        """The conversation a stored response answered, a page at a time (`input_page`)."""
        found = await stored(request, response_id)
        if isinstance(found, Response):
            return found
        try:
            page = input_page(found.input, request.query_params.multi_items())
        except InvalidRequest as exc:
            return _error(exc)
        return Response(_json.encode(page), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        if not _ID.fullmatch(response_id):
            return _missing(response_id)
        try:  # it reads the record once, to check whose it is
            await (await store()).delete(response_id, request.scope["state"]["tenant"])
        except NotStored:
            return _missing(response_id)
        gone = {"id": response_id, "object": "response", "deleted": True}
        return Response(_json.encode(gone), media_type="application/json")
