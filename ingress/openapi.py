"""The ingress's OpenAPI document: FastAPI's for its own routes, and the routes served as
plain ASGI (completions, tokenize; FastAPI cannot see them) described from the msgspec
structs that decode their bodies: what a client or a fuzzer needs to know to call them."""

from __future__ import annotations

from typing import Any

import msgspec

from ingress.aborts import AbortBody
from ingress.completions import NO, YES
from tokenway.api import anthropic, derender, generate, responses
from tokenway.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tokenway.errors import ErrorBody

_REF = "#/components/schemas/{name}"
_ANTHROPIC = ("createMessage", "countMessageTokens")  # its routes answer its error shape
# What a completion route answers besides 200; every one an OpenAI error body.
_ERRORS = {
    "400": "the body does not decode, or asks for what the model or the engines cannot do",
    "401": "no key, or a wrong one",
    "404": "no such model",
    "405": "not a POST",
    "408": "the body did not arrive within --body-timeout",
    "413": "the body is over --max-request-bytes",
    "429": "a full queue, or the key's tenant past its limits (see Retry-After)",
    "502": "an engine or a stage failed the request",
    "503": "no engine, or the bus cannot take the request now (see Retry-After)",
    "504": "no answer before the request's deadline",
}
_ROUTES = {
    "/v1/chat/completions": ("createChatCompletion", "ChatCompletionRequest", "Chat completion"),
    "/v1/completions": ("createCompletion", "CompletionRequest", "Completion"),
    "/v1/responses": ("createResponse", "ResponsesRequest", "Response"),
    "/v1/messages": ("createMessage", "MessagesRequest", "Anthropic message"),
    "/v1/messages/count_tokens": (
        "countMessageTokens",
        "CountTokensRequest",
        "Input tokens of an Anthropic message",
    ),
    "/tokenize": ("tokenize", "TokenizeRequest", "Token IDs of a prompt or of chat messages"),
    "/detokenize": ("detokenize", "DetokenizeRequest", "The text of token IDs"),
    "/v1/chat/completions/render": (
        "renderChatCompletion",
        "ChatCompletionRequest",
        "vLLM's token-only GenerateRequest a chat completion renders to",
    ),
    "/v1/completions/render": (
        "renderCompletion",
        "CompletionRequest",
        "vLLM's token-only GenerateRequests a completion renders to, one per prompt",
    ),
    "/v1/messages/render": (
        "renderMessage",
        "MessagesRequest",
        "vLLM's token-only GenerateRequest an Anthropic message renders to",
    ),
    "/v1/responses/render": (
        "renderResponse",
        "ResponsesRequest",
        "vLLM's token-only GenerateRequest a Responses request renders to (stateless)",
    ),
    "/v1/chat/completions/derender": (
        "derenderChatCompletion",
        "ChatDerender",
        "A generate response (or one streamed event and its stream_state) as a chat completion",
    ),
    "/v1/completions/derender": (
        "derenderCompletion",
        "CompletionDerenderRequest",
        "Generate responses (or one streamed event and its stream_state) as a completion",
    ),
    "/inference/v1/generate": (
        "generate",
        "GenerateBody",
        "vLLM's token-in/token-out generate: token IDs (and logprobs) out",
    ),
    "/inference/v1/abort_requests": (
        "abortRequests",
        "AbortBody",
        "End generate requests by their ids, each with its output so far (an empty 200)",
    ),
}
_BODIES = [
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    anthropic.AnthropicError,
    responses.ResponsesRequest,
    generate.GenerateBody,
    AbortBody,
    derender.ChatDerender,
    derender.CompletionDerender,
    derender.CompletionStreamDerender,
]


def _operation(operation_id: str, body: str, summary: str) -> dict[str, Any]:
    shape = "AnthropicError" if operation_id in _ANTHROPIC else "ErrorBody"
    error = {"application/json": {"schema": {"$ref": _REF.format(name=shape)}}}
    return {
        "operationId": operation_id,
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name=body)}}},
        },
        "responses": {
            "200": {
                "description": "the whole response, or with `stream: true` its SSE events",
                "content": {"application/json": {}, "text/event-stream": {}},
            },
            **{status: {"description": why, "content": error} for status, why in _ERRORS.items()},
        },
    }


def _resume_parameters(rid_pattern: str) -> list[dict[str, Any]]:
    """What `GET /v1/streams/{rid}` reads besides its path (its handler reads the headers
    itself, so FastAPI cannot describe them)."""
    return [
        {
            "name": "rid",
            "in": "path",
            "required": True,
            "schema": {"type": "string", "pattern": f"^{rid_pattern}$"},
        },
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "the number of `data:` events the client already has",
            "schema": {"type": "string", "pattern": "^[0-9]+$"},
        },
        {
            "name": "X-Tokenway-Event-Ids",
            "in": "header",
            "required": False,
            "description": "1/true/yes/on: number each event in an `id:` line",
            "schema": {"type": "string", "enum": sorted((YES | NO) - {""})},
        },
    ]


def with_completions(document: dict[str, Any], rid_pattern: str) -> dict[str, Any]:
    """FastAPI's document with the plain ASGI routes and their schemas added, and the
    resume route's parameters as its handler checks them."""
    _, schemas = msgspec.json.schema_components(_BODIES, ref_template=_REF)
    schemas["TokenizeRequest"] = {
        "anyOf": [
            {"$ref": _REF.format(name=s.__name__)}
            for s in (TokenizeChatRequest, TokenizeCompletionRequest)
        ]
    }
    schemas["CompletionDerenderRequest"] = {
        "anyOf": [
            {"$ref": _REF.format(name=s.__name__)}
            for s in (derender.CompletionDerender, derender.CompletionStreamDerender)
        ]
    }
    document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
    paths = document.setdefault("paths", {})
    for path, (operation_id, body, summary) in _ROUTES.items():
        paths[path] = {"post": _operation(operation_id, body, summary)}
    paths["/v1/streams/{rid}"]["get"]["parameters"] = _resume_parameters(rid_pattern)
    return document
