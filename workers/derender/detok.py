"""Incremental detokenization with vLLM's prefix/read-offset semantics, over token IDs.

The window holds the tokens from `prefix_offset` on. Each new token decodes the window;
text is released only when it grew past the prefix and does not end in U+FFFD (a partial
UTF-8 sequence that the next token may complete). On release the window slides, so it
stays a few tokens long however long the output gets.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from tokenway.wire import SEED_TOKENS
from workers.derender.logprobs import TokenTexts
from workers.derender.state import DetokState

# Of the prompt's last tokens (`SEED_TOKENS`), how many the window starts with.
SEED_PREFIX = 5
REPLACEMENT = "\ufffd"


def seed(prompt_tail: Sequence[int]) -> DetokState:
    tail = list(prompt_tail[-SEED_TOKENS:])
    read = len(tail)
    prefix = max(read - SEED_PREFIX, 0)
    return DetokState(tokens=tail[prefix:], prefix_offset=0, read_offset=read - prefix)


class Detokenizer:
    """Stateless over requests: the per-request window lives in `DetokState`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.texts = TokenTexts(tokenizer)  # per-token strings for logprobs, cached
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Decoding with skip_special_tokens drops these wherever they stand, so a skipped
        # one can stay out of the window: a run of them then cannot grow it.
        self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    def step(
        self, state: DetokState, new_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> tuple[str, DetokState]:
        pieces, state = self.pieces(state, new_ids, skip_special_tokens)
        return "".join(pieces), state

    def pieces(
        self, state: DetokState, new_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> tuple[list[str], DetokState]:
        """The text each new token releases (often "", e.g. inside a multi-byte character)."""
        decode = self._tok.decode
        tokens = list(state.tokens)
        prefix, read = state.prefix_offset, state.read_offset
        out: list[str] = []
        prefix_text: str | None = None
        for tid in new_ids:
            if not 0 <= tid < self.vocab_size:
                raise ValueError(
                    f"token id {tid} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
            if skip_special_tokens and tid in self._special:
                out.append("")
                continue
            tokens.append(tid)
            if prefix_text is None:
                prefix_text = decode(tokens[prefix:read], skip_special_tokens=skip_special_tokens)
            text = decode(tokens[prefix:], skip_special_tokens=skip_special_tokens)
            if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT):
                out.append("")
                continue
            out.append(text[len(prefix_text) :])
            prefix, read = read, len(tokens)
            prefix_text = None
        # Drop what no later decode reads, so the window stays bounded.
        if prefix:
            tokens = tokens[prefix:]
            read -= prefix
            prefix = 0
        return out, DetokState(tokens=tokens, prefix_offset=prefix, read_offset=read)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
