"""Engine logprobs (integer token ids) → OpenAI chat and completions logprobs, as vLLM 0.33.

The engine has no tokenizer, so each token's text is found here, the way vLLM's derender
resolves its generate logprobs: every id decoded on its own (special tokens kept), and a
token whose text ends in U+FFFD (part of a UTF-8 character) repaired from up to four earlier
*sampled* tokens: the token completing a character shows all of it, the ones before it show
"". `bytes` are the UTF-8 bytes of the token text. Logprobs of -inf or NaN become -9999.0.

Candidates come in the engine's order, the sampled token first and then the rest by rank, and
are cut as vLLM's endpoints cut them: chat keeps the first `top_logprobs` (the sampled token
among them), completions the first `logprobs + 1`; -1 keeps all.

Everything from the past that a chunk needs is in `LogprobState`, so results do not depend on
how the output was cut into chunks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec
from msgspec import Struct
from tokenizers import Tokenizer

from tokenway.wire import LogprobEntry, TokenLogprob

FLOOR = -9999.0  # what OpenAI shapes show for -inf (and vLLM for NaN)
CONTEXT_TOKENS = 4  # sampled ids the U+FFFD repair reads: enough for any UTF-8 character
REPLACEMENT = "\ufffd"


class LogprobState(Struct, array_like=True, omit_defaults=True):
    context_ids: list[int] = []  # the last sampled ids, at most CONTEXT_TOKENS
    text_offset: int = 0  # completions: where the next token's text starts in the output


class TopLogprob(Struct):
    """Chat `ChatCompletionLogProb`."""

    token: str
    logprob: float
    bytes_: list[int] | None = msgspec.field(default=None, name="bytes")


class ContentLogprob(Struct):
    """Chat `ChatCompletionLogProbsContent`: one output token and its candidates."""

    token: str
    logprob: float
    bytes_: list[int] | None = msgspec.field(default=None, name="bytes")
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct):
    """A chat choice's `logprobs`."""

    content: list[ContentLogprob] | None = None


class CompletionLogprobs(Struct):
    """A completions choice's `logprobs`, in vLLM's field order."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class TokenTexts:
    """Token text for logprobs. Stateless over requests; built once per tokenizer.

    Single-token texts are cached (bounded by the vocabulary); repairs are not, since they
    depend on the tokens before.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._marker = _leading_space_marker(tokenizer)
        self._cache: dict[int, tuple[str, bytes | None]] = {}

    def single(self, token_id: int) -> tuple[str, bytes | None]:
        """One id decoded alone; ("", None) for an id outside the vocabulary (vLLM)."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return "", None
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if self._marker is not None:
            text = _restore_leading_spaces(piece, text, self._marker)
        hit = (text, text.encode("utf-8", errors="replace"))
        self._cache[token_id] = hit
        return hit

    def resolve(self, token_id: int, context: Sequence[int]) -> tuple[str, list[int] | None]:
        """Text and bytes of a token that follows the sampled ids `context`."""
        text, raw = self.single(token_id)
        if text.endswith(REPLACEMENT):
            text = self._repair(token_id, context)
            return text, list(text.encode("utf-8"))
        return text, None if raw is None else list(raw)

    def _repair(self, token_id: int, context: Sequence[int]) -> str:
        """A partial character's text from the sampled tokens before it (vLLM's
        `_correct_decoded_token`): the shortest context that decodes cleanly with this token,
        minus the context's own clean text. "" while the character is still incomplete."""
        decode = self._tok.decode
        for n in range(1, min(len(context), CONTEXT_TOKENS) + 1):
            ctx = list(context[-n:])
            full = decode([*ctx, token_id], skip_special_tokens=False)
            if full.endswith(REPLACEMENT):
                continue
            # Trailing context tokens that were partial themselves showed "": their bytes
            # belong to this token's text.
            clean_end = len(ctx)
            while clean_end and self.single(ctx[clean_end - 1])[0].endswith(REPLACEMENT):
                clean_end -= 1
            prefix = decode(ctx[:clean_end], skip_special_tokens=False) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def chat_logprobs(
    texts: TokenTexts, entries: Sequence[LogprobEntry], top_n: int, state: LogprobState
) -> tuple[list[ContentLogprob], LogprobState]:
    """This chunk's `logprobs.content`: `top_n` is the request's `top_logprobs` (-1: all)."""
    cut = None if top_n == -1 else max(top_n, 0)
    context = list(state.context_ids)
    content: list[ContentLogprob] = []
    for entry in entries:
        token, token_bytes = texts.resolve(entry.token_id, context)
        top = []
        for cand in entry.top[:cut]:
            cand_token, cand_bytes = texts.resolve(cand.token_id, context)
            top.append(TopLogprob(cand_token, _clamp(cand.logprob), cand_bytes))
        content.append(ContentLogprob(token, _clamp(entry.logprob), token_bytes, top))
        _advance(context, entry.token_id)
    return content, LogprobState(context, state.text_offset)


def completion_logprobs(
    texts: TokenTexts, entries: Sequence[LogprobEntry], top_n: int, state: LogprobState
) -> tuple[CompletionLogprobs, LogprobState]:
    """This chunk's completions `logprobs`: `top_n` is the request's `logprobs` (-1: all).

    `text_offset` is absolute: each token starts where the previous token's text ended,
    counting from `state.text_offset` (set it to the echoed prompt's length, if any).
    """
    cut = None if top_n == -1 else max(top_n + 1, 0)
    context = list(state.context_ids)
    offset = state.text_offset
    out = CompletionLogprobs([], [], [], [])
    for entry in entries:
        token, _ = texts.resolve(entry.token_id, context)
        out.text_offset.append(offset)
        out.tokens.append(token)
        out.token_logprobs.append(_clamp(entry.logprob))
        out.top_logprobs.append(_top_dict(texts, entry.top[:cut], context) if entry.top else None)
        offset += len(token)
        _advance(context, entry.token_id)
    return out, LogprobState(context, offset)


def problem(state: LogprobState) -> str | None:
    """Why a state from the wire cannot be one this module produced, if so."""
    if len(state.context_ids) > CONTEXT_TOKENS or state.text_offset < 0:
        return "logprob state out of range"
    if any(not 0 <= t < 2**31 for t in state.context_ids):
        return "logprob state holds token ids out of range"
    return None


def _top_dict(
    texts: TokenTexts, cands: Sequence[TokenLogprob], context: Sequence[int]
) -> dict[str, float]:
    # Candidates whose texts are equal share one key: the last one's logprob, the first
    # one's place (vLLM builds the same dict).
    return {texts.resolve(c.token_id, context)[0]: _clamp(c.logprob) for c in cands}


def _clamp(logprob: float) -> float:
    # NaN fails the comparison too.
    return logprob if logprob >= FLOOR else FLOOR


def _advance(context: list[int], token_id: int) -> None:
    context.append(token_id)
    if len(context) > CONTEXT_TOKENS:
        del context[0]


def _leading_space_marker(tokenizer: Tokenizer) -> str | None:
    """The Metaspace marker ("▁") whose leading instance single-token decoding drops.

    Byte-level and other pre-tokenizers lose nothing: None.
    """
    pre = tokenizer.pre_tokenizer
    pre = json.loads(pre.__getstate__()) if pre is not None else {}  # not the whole tokenizer
    for item in [pre, *(pre.get("pretokenizers") or [])]:
        if item.get("type") == "Metaspace":
            return item.get("replacement", "▁")
    return None


def _restore_leading_spaces(piece: str, text: str, marker: str) -> str:
    markers = len(piece) - len(piece.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
