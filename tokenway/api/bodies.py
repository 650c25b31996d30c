"""What a client's body becomes: any API's body, decoded and held to its bounds, as the chat or
completion request it is (a Responses or Messages body is the chat request it translates to).
Apart from `tokenway.api.openai` because it takes in the API translations, which build on that
module's structs."""

from __future__ import annotations

from tokenway.api import anthropic, responses
from tokenway.api.openai import (
    ChatDecoder,
    CompletionDecoder,
    OpenAIRequest,
    check_depth,
    decoded,
    with_effort,
)
from tokenway.errors import InvalidRequest
from tokenway.limits import DEFAULT_LIMITS, RequestLimits, check_decoded, check_text


def decode_body(api: str, body: bytes, bounds: RequestLimits = DEFAULT_LIMITS) -> OpenAIRequest:
    """Validate an OpenAI body (a Responses or an Anthropic Messages body: the chat request
    it is) and hold it to `bounds`; a malformed one is the client's 400 (`InvalidRequest`)."""
    check_text(api, body, bounds)
    if api in ("messages", "responses"):
        if api == "messages":
            req: OpenAIRequest = anthropic.to_chat(decoded(anthropic.MessagesDecoder, body))
        else:
            req = responses.to_chat(decoded(responses.ResponsesDecoder, body))
        check_depth(req)  # its tool schemas and inputs, as chat carries them
    elif api == "chat":
        req = with_effort(decoded(ChatDecoder, body))
    else:
        req = decoded(CompletionDecoder, body)
    check_decoded(api, req, bounds)
    if has_wide_int(req.kv_transfer_params):  # carried to the engine as msgpack
        raise InvalidRequest(
            "kv_transfer_params holds an integer outside 64 bits", param="kv_transfer_params"
        )
    return req


def has_wide_int(value: object) -> bool:
    """Whether an integer msgpack cannot carry (outside -2**63 .. 2**64 - 1) is in `value`
    (already bounded in depth)."""
    if isinstance(value, dict):
        return any(has_wide_int(v) for v in value.values())
    if isinstance(value, list):
        return any(has_wide_int(v) for v in value)
    return isinstance(value, int) and not -(2**63) <= value < 2**64
