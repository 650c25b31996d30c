"""The fewest tokens a text can encode to, found without encoding it: a prompt certainly past
the context is refused before the tokenizer spends about 140 bytes of memory per byte of it
(a 7 MB prompt took 1 GB and 6 s to learn it was 2 million tokens).

For a byte-level BPE tokenizer without a normalizer, and with no added token that strips
the whitespace beside it, the tokens of a text cut its UTF-8 bytes into pieces, each the
bytes of one vocabulary entry. So if byte i lies in a token of length L, the count is
sum(1/L over the bytes). A token of two or more bytes that covers byte i holds the pair of
bytes before it or the pair after it; so L is at most u(i), the longest vocabulary entry
holding either pair (1 where none does), and the count is at least sum(1/u(i)). That is a
lower bound for every text, whatever the pre-tokenizer does (it only cuts the text
further). For DeepSeek's vocabulary it is about a third of the count for JSON, and of the
count for 7 MB of words a fifth: 314,000 tokens, far past a 131,072 context.

Where a tokenizer is not of that kind the floor is 0: it refuses nothing.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
from tokenizers import Tokenizer

_CHUNK = 1 << 18  # bytes of text per step: its arrays take a few MB


def _byte_alphabet() -> dict[str, int]:
    """The printable stand-ins byte-level BPE spells its vocabulary with, to their bytes
    (GPT-2's table: printable Latin-1 bytes stand for themselves, the others shift past 255)."""
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in alphabet.values())
    alphabet.update((chr(256 + i), b) for i, b in enumerate(shifted))
    return alphabet


class TokenFloor:
    """`floor(text)`: at most the number of tokens `tokenizer` encodes `text` to (added
    special tokens apart). The pair table is built on the first call (half a second)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._building = threading.Lock()
        self._longest: np.ndarray | None = None  # by pair (first byte × 256 + second)
        self._sound: bool | None = None

    def __call__(self, text: str) -> int:
        longest = self._table()
        if longest is None:
            return 0
        data = text.encode()
        total = 0.0
        for start in range(0, len(data), _CHUNK):
            lead = min(start, 1)  # a byte either side: the pairs across the chunk's edges
            window = np.frombuffer(data[start - lead : start + _CHUNK + 1], np.uint8)
            pairs = longest[(window[:-1].astype(np.uint16) << 8) | window[1:]]
            ending = np.concatenate(([1], pairs))  # per byte: the longest holding the pair
            starting = np.concatenate((pairs, [1]))  # that ends at it, or starts at it
            bound = np.maximum(ending, starting)[lead : lead + _CHUNK]
            counts = np.bincount(bound)
            total += float((counts[1:] / np.arange(1, len(counts))).sum())
        return int(total * (1 - 1e-9))  # under the sum's rounding: never above the count

    def _table(self) -> np.ndarray | None:
        with self._building:
            if self._sound is None:
                self._longest = _pair_table(json.loads(self._tokenizer.to_str()))
                self._sound = self._longest is not None
            return self._longest


def _pair_table(spec: dict[str, Any]) -> np.ndarray | None:
    """For each pair of bytes, the length of the longest token holding it (1: none); None
    where the bound would not hold for this tokenizer."""
    model, normalizer = spec.get("model") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    if normalizer and not (normalizer.get("type") == "Sequence" and not normalizer["normalizers"]):
        return None  # a normalizer may shorten the text
    if not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # such a token covers the whitespace beside it too
    alphabet = _byte_alphabet()
    vocab = model.get("vocab") or {}
    if not set(alphabet) <= set(vocab):
        return None  # a byte no token spells: an unknown token may stand for a long run
    pieces = []
    for entry in vocab:
        try:
            pieces.append(bytes(alphabet[ch] for ch in entry))
        except KeyError:  # not in the byte alphabet: an added token's own text
            pieces.append(entry.encode())
    pieces += [t["content"].encode() for t in added]
    longest = np.ones(1 << 16, np.uint16)
    lengths = np.array([len(p) for p in pieces])
    joined = np.frombuffer(b"".join(pieces), np.uint8).astype(np.uint16)
    pairs = (joined[:-1] << 8) | joined[1:]
    within = np.ones(len(pairs), bool)  # a pair across two pieces is no token's
    within[(np.cumsum(lengths) - 1)[:-1]] = False
    owner = np.minimum(np.repeat(lengths, lengths)[:-1], 0xFFFF).astype(np.uint16)
    np.maximum.at(longest, pairs[within], owner[within])
    return longest


def _keeps_every_byte(pre: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer is byte-level and only cuts the text: nothing removed,
    nothing added (no prefix space)."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    byte_level = False
    for step in steps:
        if not step:
            return False  # no pre-tokenizer
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                return False
            byte_level = True
        elif kind in ("Split", "Punctuation"):
            if step.get("behavior") == "Removed":
                return False
        elif kind != "Digits":
            return False
    return byte_level
