"""vLLM's derender routes' bodies (`POST /v1/chat/completions/derender`,
`/v1/completions/derender`): a whole generate response, or one streamed generate event and
the `stream_state` the last call answered, with the request that was rendered. One path
takes both shapes, told apart by `stream`.

`stream_state` keeps vLLM's keys, so a client that carries vLLM's object carries tokenway's;
tokenway's own state rides in one more key, `tokenway` (base64), which vLLM's server would
ignore. A state without it, or whose content no derender made, is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from tokenway.api.generate import Logprobs
from tokenway.api.openai import NonNegInt, decoded
from tokenway.wire import MAX_PROMPT_TOKENS, TokenId

MAX_CHOICES = 128  # what vLLM's generate route gives one request at most here (its n)
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]


class GenerateChoice(Struct, kw_only=True):
    index: Annotated[int, Meta(ge=0, lt=MAX_CHOICES)] = 0
    finish_reason: Literal["stop", "length", "abort", "repetition"] | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds | None = None
    logprobs: Logprobs | None = None


class GenerateUsage(Struct, kw_only=True):
    prompt_tokens: NonNegInt = 0
    completion_tokens: NonNegInt = 0


class GenerateResponse(Struct, kw_only=True):
    """A whole `tokens`-mode generate response (what derender reads of it)."""

    request_id: str = ""
    choices: Annotated[list[GenerateChoice], Meta(max_length=MAX_CHOICES)] = []
    prompt_token_ids: TokenIds | None = None
    output_mode: Literal["tokens"] = "tokens"


class GenerateChunk(Struct, kw_only=True):
    """One streamed generate event: one choice's tokens, or the closing usage."""

    request_id: str = ""
    choices: Annotated[list[GenerateChoice], Meta(max_length=1)] = []
    usage: GenerateUsage | None = None
    prompt_token_ids: TokenIds | None = None
    output_mode: Literal["tokens"] = "tokens"


class StreamState(Struct, kw_only=True):
    """vLLM's `DerenderStreamState` keys, and tokenway's own state."""

    prev_tokens: Annotated[list[str], Meta(max_length=1024)] = []
    prefix_offset: NonNegInt = 0
    read_offset: NonNegInt = 0
    role_sent: bool = False
    logprob_context_token_ids: Annotated[list[int], Meta(max_length=4)] = []
    logprob_text_offset: NonNegInt = 0
    output_token_ids: list[int] = []
    output_chunk_lens: list[int] = []
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = []
    tokenway: Annotated[str, Meta(max_length=32 * 1024)] | None = None


class _Common(Struct, kw_only=True):
    stream: bool | None = False
    model: str | None = None


class ChatDerender(_Common, kw_only=True):
    """Whole (`generate_response`) or streamed (`generate_chunk`, `stream_state`)."""

    generate_response: GenerateResponse | None = None
    generate_chunk: GenerateChunk | None = None
    stream_state: StreamState | None = None
    prompt_tokens: NonNegInt | None = None
    prompt_token_ids: TokenIds | None = None
    chat_request: dict[str, Any] | None = None


class CompletionDerender(_Common, kw_only=True):
    """Whole: a response per prompt, with their prompt counts and IDs."""

    generate_responses: Annotated[list[GenerateResponse], Meta(max_length=1024)] = []
    prompt_tokens: list[NonNegInt] = []
    prompt_token_ids: list[TokenIds | None] = []
    completion_request: dict[str, Any] | None = None


class CompletionStreamDerender(_Common, kw_only=True):
    generate_chunk: GenerateChunk
    stream_state: StreamState | None = None
    prompt_tokens: NonNegInt | None = None
    prompt_token_ids: TokenIds | None = None
    completion_request: dict[str, Any] | None = None


class _Mode(Struct):
    stream: bool | None = False


_CHAT = msgspec.json.Decoder(ChatDerender)
_COMPLETION = msgspec.json.Decoder(CompletionDerender)
_COMPLETION_STREAM = msgspec.json.Decoder(CompletionStreamDerender)
_MODE = msgspec.json.Decoder(_Mode)


def decode_chat(body: bytes) -> ChatDerender:
    return decoded(_CHAT, body)


def decode_completion(body: bytes) -> CompletionDerender | CompletionStreamDerender:
    """The batch shape, or with `stream: true` the streaming one (vLLM's union)."""
    if decoded(_MODE, body).stream:
        return decoded(_COMPLETION_STREAM, body)
    return decoded(_COMPLETION, body)
