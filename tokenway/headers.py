"""Header names and the `Tw-Stream-State` codec. Only this package spells header names."""

from __future__ import annotations

import base64
import binascii

MSG_ID = "Nats-Msg-Id"
RID = "Tw-Rid"
SEQ = "Tw-Seq"
ATTEMPT = "Tw-Attempt"
STREAM_STATE = "Tw-Stream-State"
TOKENS = "Tw-Tokens"
TOKEN_COUNT = "Tw-Token-Count"  # a whole response's: how many output tokens it holds
DEADLINE = "Tw-Deadline"
REPLY = "Tw-Reply"
KIND = "Tw-Kind"
STATUS = "Tw-Status"
TENANT = "Tw-Tenant"  # the API key's tenant, set by the ingress
LIMITS = "Tw-Limits"  # that tenant's limits (`tokenway.tenancy.Limits`), set by the ingress
RETRY_AFTER = "Tw-Retry-After"  # of a 429 error: seconds until the client may try again
BATCH = "Tw-Batch"  # "1": a batch job's request: it waits out full queues and yields to others
EVENTS = "Tw-Events"  # an index record's: how many events it holds
OWNER = "Tw-Owner"  # an index record's: the round subject its request's next events are on
OWNER_SEQ = "Tw-Owner-Seq"  # ... after this sequence of it
TRACEPARENT = "traceparent"  # W3C Trace Context, from the client (or the ingress) to the engine

# Optimistic concurrency: stored only if the subject's last message has this sequence.
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when it does not

# Output kinds on TW_OUT (the `Tw-Kind` header).
KIND_CHUNK = "chunk"  # stream chunk(s); more follow
KIND_END = "end"  # last stream chunk(s); the client then gets [DONE]
KIND_RESPONSE = "response"  # a complete non-streaming response body
KIND_ERROR = "error"  # an OpenAI error body; `Tw-Status` holds the HTTP status
KIND_ROUND = "round"  # an owner's round record: events of many requests
KIND_TAKEOVER = "takeover"  # requests taken from the owner of the round subject

# A state is a few hundred bytes; anything far above that is tampering or a bug.
MAX_STATE_BYTES = 16 * 1024


class StateError(ValueError):
    """A `Tw-Stream-State` that cannot be decoded or is out of bounds."""


def encode_state(state: bytes) -> str:
    return base64.urlsafe_b64encode(state).rstrip(b"=").decode()


def decode_state(text: str) -> bytes:
    """The state's bytes; what they hold is derender's business."""
    if len(text) > MAX_STATE_BYTES:
        raise StateError(f"stream_state is {len(text)} bytes, over the {MAX_STATE_BYTES} limit")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise StateError(f"malformed stream_state: {exc}") from exc


def encode_tokens(token_ids: list[int]) -> str:
    """`Tw-Tokens`: the chunk's output token IDs, comma separated (readable in `nats sub`)."""
    return ",".join(map(str, token_ids))


def decode_tokens(text: str) -> list[int]:
    return [int(t) for t in text.split(",")] if text else []
