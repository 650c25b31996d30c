"""`POST /tokenize`, `/detokenize` and vLLM's render and derender routes in vLLM's shapes,
answered by a render worker with the tokenizer and chat template it renders with, so the IDs
are the ones a request would get."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from tokenway.api.openai import (
    ChatCompletionRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeResponse,
    decode_detokenize,
    decode_tokenize,
)
from tokenway.derendering import Derenderer
from tokenway.errors import (
    InvalidRequest,
    TokenwayError,
    Unavailable,
    check_model,
    error_body,
    internal,
)
from tokenway.wire import Api, RenderRequest, TokenizeAnswer, TokenizeCall
from workers.render import derender_routes, harmony
from workers.render.backend import worked
from workers.render.chat import apply_template
from workers.render.core import Renderer
from workers.render.scale_out import Rendered, reasoning_fields, rendered

log = logging.getLogger(__name__)

_calls = msgspec.msgpack.Decoder(TokenizeCall)
# vLLM's render routes, by the API whose request each renders
RENDERS: dict[str, Api] = {
    "chat_render": "chat",
    "completion_render": "completion",
    "messages_render": "messages",
    "responses_render": "responses",
}


class _Stateless(msgspec.Struct):
    previous_response_id: str | None = None


_stateless = msgspec.json.Decoder(_Stateless)
# What the answer's envelope (its msgpack framing and headers) may take of the bus payload.
_ENVELOPE_BYTES = 1024


def tokenize(
    renderer: Renderer, call: TokenizeCall
) -> TokenizeResponse | DetokenizeResponse | Rendered | list[Rendered]:
    """The answer to one call; `InvalidRequest`/`ModelNotFound` for the client's mistakes."""
    tok = renderer.tokenizer
    api = RENDERS.get(call.route)
    if api is not None:
        if api == "responses" and _stateless.decode(call.body).previous_response_id:
            raise InvalidRequest(
                "previous_response_id is not supported by the stateless render endpoint.",
                param="previous_response_id",
            )
        request = RenderRequest(
            api=api,
            request_id=call.rid,
            body=call.body,
            created=int(time.time()),
            client_request_id=call.client_id or None,
        )
        builder = dataclasses.replace(renderer.builder, as_render_server=True)
        parsed = builder.parse(request)
        ids = renderer.prompt_ids(parsed.req, api)
        generate = builder.build(request, parsed, ids, renderer.vocab)
        reasoning = reasoning_fields(api, parsed.req, builder.flags, ids[0], renderer.vocab)
        each = rendered(generate, call.body, reasoning)
        return each if api == "completion" else each[0]
    if call.route == "detokenize":
        req = decode_detokenize(call.body)
        check_model(req.model, renderer.builder.model)
        bad = next((t for t in req.tokens if t >= renderer.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary", param="tokens")
        # transformers types decode as `str | list[str]`; one list of ids decodes to one str
        return DetokenizeResponse(prompt=tok.decode(req.tokens))  # type: ignore[arg-type]
    body = decode_tokenize(call.body, renderer.builder.limits)
    check_model(body.model, renderer.builder.model)
    if isinstance(body, TokenizeChatRequest) and renderer.harmony:  # as the chat route
        chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools)
        tokens = harmony.prompt_ids(chat)
    else:
        text = apply_template(tok, body) if isinstance(body, TokenizeChatRequest) else body.prompt
        tokens = tok.encode(text, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=renderer.builder.info.context_length,
        tokens=tokens,
        # typed `str | list[str]`: a list of ids converts to a list of tokens
        token_strs=tok.convert_ids_to_tokens(tokens) if body.return_token_strs else None,  # type: ignore[arg-type]
    )


async def answer(
    renderer: Renderer,
    data: bytes,
    max_payload: int,
    derenderer: Callable[[], Awaitable[Derenderer]] | None = None,
) -> TokenizeAnswer:
    """A call's HTTP answer, errors included; a big one is worked off the event loop.
    `derenderer`: gives what answers vLLM's derender routes (none: not answered here)."""
    try:
        call = _calls.decode(data)
        if call.route == "chat_derender" or call.route == "completion_derender":
            if derenderer is None:
                raise Unavailable("this render worker answers no derender route")
            doc = await derender_routes.answer(renderer, await derenderer(), call.route, call.body)
        else:
            doc = await worked(len(call.body), tokenize, renderer, call)
        body = msgspec.json.encode(doc)
        if len(body) + _ENVELOPE_BYTES > max_payload:
            raise InvalidRequest(
                f"the answer ({len(body)} bytes) exceeds the bus payload limit of "
                f"{max_payload} bytes; send less at once"
            )
        return TokenizeAnswer(status=200, body=body)
    except msgspec.DecodeError as exc:
        info = InvalidRequest(f"undecodable tokenize call: {exc}").info()
    except TokenwayError as exc:
        info = exc.info()
    except Exception:  # a bug: the client still hears of it
        log.exception("tokenize failed for %s", call.rid)
        info = internal(call.rid)
    return TokenizeAnswer(status=info.status, body=error_body(info))
