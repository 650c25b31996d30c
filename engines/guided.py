"""The simulated engine's output under a structured-outputs constraint (llguidance).

The toy model's own next token goes out wherever the grammar allows it; where the grammar
forces tokens (a key's name, a closing quote) those go; elsewhere an allowed token is
picked that brings the document to its end: its fill first, closing tokens once the
document has run a while, the end of sequence once the grammar accepts. So a JSON schema
gets valid JSON of that schema, a choice one of its options, a forced tool a call that
parses. Where a structural tag opens a call's arguments, the model writes them as an object
of the tool's parameters (engines/arguments.py) for as long as the grammar allows it; where
the engine says the model means to call a tool (`--sim-tool-calls`, a user's turn), it
writes the tag's trigger and the call's opening itself, then ends after the call. Where
the request's reasoning is still open (`reasoning_ended: false`), a short free reasoning
and its end marker come first.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator

from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from engines.arguments import chosen, openings, planned, triggers
from engines.bridge import Refused
from tokenway.aio import on_big_stack
from tokenway.constraints import grammar
from tokenway.tag_grammar import Unsupported
from tokenway.wire import StructuredOutputs

# Pieces a document is filled and closed with, in the order they are tried.
_FILL = ("a", "e", "x", "1", "2", " the", " data", "-", "_", ".")
_CLOSE = ('"', "}", "]", ")", '"}', '"]', "}]", "0", "true", ",")
PATIENCE = 24  # tokens of a document before closing tokens are tried first
REASONING = 12  # tokens of free reasoning before a constrained answer, where it is open

_TOKEN_REF = re.compile(r"<\[(\d+)\]>")  # a Lark grammar's reference to one token
_lock = threading.Lock()
_tokenizers: dict[int, tuple[Tokenizer, LLTokenizer, dict[str, int]]] = {}


def ll_tokenizer(tokenizer: Tokenizer, eos: int) -> tuple[LLTokenizer, dict[str, int]]:
    """llguidance's view of the vocabulary, and its added tokens by their text: built once
    per tokenizer (about a second)."""
    with _lock:
        held = _tokenizers.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
            held = _tokenizers[id(tokenizer)] = (
                tokenizer,
                LLTokenizer(tokenizer.to_str(), eos_token=eos),
                added,
            )
        return held[1], held[2]


async def matcher(tokenizer: Tokenizer, eos: int, so: StructuredOutputs) -> Guide:
    """What decodes under `so` (built off the loop: the vocabulary and the grammar both
    take a while); `Refused` for a constraint this engine cannot decode, the request's own
    400 (one render let through, being valid for vLLM, or one that reached the engine
    unchecked, from a direct publisher)."""
    vocab, added = await asyncio.to_thread(ll_tokenizer, tokenizer, eos)
    try:
        text = await on_big_stack(grammar, so, added)
    except Unsupported as exc:
        raise Refused(f"the simulated engine cannot decode this constraint: {exc}") from None
    except (ValueError, TypeError, RuntimeError) as exc:  # what the compilers raise
        raise Refused(f"the constraint is not valid: {exc}") from None
    m = await on_big_stack(LLMatcher, vocab, text)
    if m.is_error():
        raise Refused(f"the constraint does not compile: {m.get_error()}")
    # The added tokens a structural tag asks for, the ones that close its structure first.
    marks = list(dict.fromkeys(int(i) for i in reversed(_TOKEN_REF.findall(text))))
    tag = json.loads(so.structural_tag) if so.structural_tag else None
    calls, opened_by = (list(openings(tag)), list(triggers(tag))) if tag else ([], [])
    return Guide(m, vocab, eos, marks, calls, list(added), opened_by)


class Guide:
    """Turns the toy model's (token, wants_stop) pairs into ones the grammar allows.

    `calls`: (begin, schema) where a structural tag opens a call's arguments;
    `specials`: the added tokens' texts, which the prompt's reading leaves out of names;
    `triggers`: the texts that open a structural tag's calls from free text."""

    def __init__(
        self,
        m: LLMatcher,
        vocab: LLTokenizer,
        eos: int,
        marks: list[int],
        calls: list[tuple[str, object]],
        specials: list[str],
        triggers: list[str],
    ) -> None:
        self.m = m
        self.vocab = vocab
        self.eos = eos
        self.marks = marks  # a structural tag's tokens, tried before closing pieces
        single = [vocab.tokenize_str(piece) for piece in (*_FILL, *_CLOSE)]
        ids = [t[0] if len(t) == 1 else -1 for t in single]
        self.fill = [t for t in ids[: len(_FILL)] if t >= 0]
        self.close = [t for t in ids[len(_FILL) :] if t >= 0]
        self.made = 0
        self.calls = [(begin.encode(), schema) for begin, schema in calls]
        self.specials = specials
        self.longest = max((len(begin) for begin, _ in self.calls), default=0)
        self.written = b""  # the output's end, as long as the longest opening
        self.plan = b""  # what the model means to write next: a call's arguments
        self.prompt: list[int] = []
        self.key = 0
        # what opens a call from free text, where a call's opening does not begin with it
        self.trigger = triggers[0].encode() if triggers else b""
        self.calling = False  # a call is planned: the model ends once it is written

    def tokens(
        self,
        model: Iterator[tuple[int, bool]],
        prompt: list[int],
        seed: int,
        think_end: int | None = None,
        asked: list[int] | None = None,
    ) -> Iterator[tuple[int, bool]]:
        """With `think_end`, the reasoning is still open: the model reasons freely for a
        while and closes it with that token (or sooner, where it closes it itself), and the
        grammar applies from there on (as vLLM's engine holds a constraint back until
        reasoning ends). `prompt` and `seed` are what a call's arguments are planned from.
        With `asked` (a user's turn), the model means to call a tool a structural tag opens,
        the one the turn names or the first, and to end once its call is written."""
        self.prompt, self.key = prompt, hash((seed, len(prompt)))
        if asked is not None and self.calls:
            begins = [begin.decode() for begin, _ in self.calls]
            begin = self.calls[chosen(begins, self.vocab.decode_str(asked), self.specials)][0]
            self.plan = begin if begin.startswith(self.trigger) else self.trigger + begin
            self.calling = True
        if think_end is not None:
            for _ in range(REASONING):
                tid = next(model)[0]
                yield tid, False
                if tid == think_end:
                    break
            else:
                yield think_end, False
        for own, _ in model:
            if self.m.is_stopped():  # the document is whole: only its end is left
                yield self.eos, True
                continue
            tid = self._pick(own)
            if not self.m.consume_token(tid):
                raise RuntimeError(f"the grammar took no token: {self.m.get_error()}")
            self.made += 1
            if self.calls:
                self._follow(tid)
            yield tid, tid == self.eos

    def _follow(self, tid: int) -> None:
        """Advances the plan by the token written (or drops it, where the grammar wrote
        something else), and plans a call's arguments where its opening was just written."""
        piece = self.vocab.decode_bytes([tid])
        self.plan = self.plan[len(piece) :] if self.plan.startswith(piece) else b""
        self.written = (self.written + piece)[-self.longest :]
        if self.plan:
            return
        for begin, schema in self.calls:
            if self.written.endswith(begin):
                prompt = self.vocab.decode_str(self.prompt)
                text = planned(begin.decode(), schema, prompt, self.specials, self.key + self.made)
                self.plan = text.encode()
                return

    def _pick(self, own: int) -> int:
        forced = self.m.compute_ff_tokens()
        if forced:
            return forced[0]
        if self.plan:
            tid = self.vocab.tokenize_bytes(self.plan)[0]
            if self.m.validate_tokens([tid]) == 1:
                return tid
            self.plan = b""  # the grammar wants otherwise: it leads from here
        closing = self.made >= PATIENCE or self.calling
        if not closing and self.m.validate_tokens([own]) == 1:
            return own
        order = (
            [self.eos, *self.marks, *self.close, *self.fill]
            if closing
            else [*self.fill, *self.close]
        )
        for tid in order:
            if (tid != self.eos or self.m.is_accepting()) and self.m.validate_tokens([tid]):
                return tid
        mask = int.from_bytes(self.m.compute_bitmask(), "little")
        if not mask:
            raise RuntimeError(f"the grammar allows no token: {self.m.get_error()}")
        return (mask & -mask).bit_length() - 1  # the lowest allowed ID
