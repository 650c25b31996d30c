"""Hypothesis strategies for model output text, and helpers to encode and chunk it."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
SPECIALS = [EOS, BOS, USER, THINK, END_THINK]
REPLACEMENT = "\ufffd"

# Grapheme clusters that span several code points, most of them several tokens each.
SEQUENCES = [
    "👩‍👩‍👧‍👦",  # family: ZWJ sequence
    "👨🏽‍💻",  # skin tone + ZWJ
    "🏳️‍🌈",  # variation selector + ZWJ
    "🇯🇵",  # regional indicator pair (flag)
    "🇫🇷🇩🇪",
    "1️⃣",  # keycap
    "e\u0301",  # combining acute
    "a\u0308\u0323",  # two combining marks
    "ก\u0e31\u0e49",  # Thai with marks
    "<think>",  # added tokens inside text
    "<｜User｜>",
]
_chars = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.sampled_from(" \n\t"),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0xAC00, max_codepoint=0xD7A3),  # Hangul
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
    st.characters(exclude_characters=REPLACEMENT, exclude_categories=("Cs",)),
    st.sampled_from(SEQUENCES),
)
texts = st.lists(_chars, max_size=24).map("".join)
# An output is a list of segments: text (encoded on its own) or one special token id.
segments = st.lists(st.one_of(texts, st.sampled_from(SPECIALS)), max_size=6)
# How the output is cut into engine chunks: all at once, one token each, or random sizes.
chunkings = st.one_of(
    st.just([1 << 30]), st.just([1]), st.lists(st.integers(1, 6), min_size=1, max_size=8)
)
# Prompts end on a complete character (some on special tokens, as chat prompts do).
prompts = st.one_of(
    st.sampled_from(
        [
            "",
            "Hi",
            "你好，世界",
            "👩‍👩‍👧‍👦",
            "e\u0301",
            "<｜User｜>Write a poem.<｜Assistant｜></think>",
            "<｜User｜>想一想<｜Assistant｜><think>",
        ]
    ),
    texts,
)

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encode(tokenizer: Tokenizer, parts: Sequence[str | int]) -> list[int]:
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
        else:
            ids += tokenizer.encode(part, add_special_tokens=False).ids
    return ids


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Cut `ids` into chunks whose sizes cycle through `sizes`."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[k % len(sizes)]
        chunks.append(ids[i : i + size])
        i += size
        k += 1
    return chunks
