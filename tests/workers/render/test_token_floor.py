"""The fewest tokens a text can encode to (`token_floor`): never more than the tokenizer
gives, and far enough past a context to refuse a huge prompt before it is tokenized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tokenway.errors import InvalidRequest
from tokenway.model import load_model_info
from tokenway.wire import Api, RenderRequest
from workers.render.core import Renderer
from workers.render.token_floor import TokenFloor


@pytest.fixture(scope="module")
def floor(tokenizer: Tokenizer) -> TokenFloor:
    return TokenFloor(tokenizer)


def count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


# Where the vocabulary's long tokens are (runs of spaces, dots, dashes, digits), the
# template's special tokens, and text of every width in UTF-8.
PIECES = [" ", "  ", "\n", "\t", ".", "-", "=", "*", "_", "/", "0", "7", "a", "Z", "word",
          " the", "é", "中文", "😀", "｜", "▁", "<｜User｜>", "<｜Assistant｜>", "</think>",
          "<｜tool▁calls▁begin｜>", '{"type": "string"}', "\r\n"]  # fmt: skip
texts = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(PIECES), st.integers(1, 300)).map(lambda p: p[0] * p[1]),
        st.text(max_size=40),
    ),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_the_floor_is_never_above_the_count(
    floor: TokenFloor, tokenizer: Tokenizer, text: str
) -> None:
    assert floor(text) <= count(tokenizer, text)


def test_the_floor_of_a_long_text_is_as_sound_across_its_chunks(
    floor: TokenFloor, tokenizer: Tokenizer
) -> None:
    """A text over many of the floor's steps: the pairs at their edges are counted too."""
    text = ("  ...--== 0123 word\n" * 40_000) + "中文😀" * 20_000
    least = floor(text)
    assert 0 < least <= count(tokenizer, text)
    assert least > len(text.encode()) / 128  # tighter than bytes / the longest token


def test_7_mb_of_words_is_certainly_past_a_131072_token_context(floor: TokenFloor) -> None:
    assert floor("word " * 1_400_000) > 300_000


def _spec(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "tokenizer.json").read_text())


def _variant(spec: dict[str, Any], change: str) -> dict[str, Any]:
    if change == "normalizer":
        spec["normalizer"] = {"type": "NFKC"}
    elif change == "stripping added token":
        spec["added_tokens"][0]["rstrip"] = True
    elif change == "prefix space":
        spec["pre_tokenizer"]["pretokenizers"][-1]["add_prefix_space"] = True
    elif change == "removing pre-tokenizer":
        spec["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Whitespace"})
    elif change == "no byte level":
        spec["pre_tokenizer"]["pretokenizers"].pop()
    return spec


@pytest.mark.parametrize(
    "change",
    ["normalizer", "stripping added token", "prefix space", "removing pre-tokenizer",
     "no byte level"],
)  # fmt: skip
def test_a_tokenizer_the_bound_does_not_hold_for_has_a_floor_of_nothing(
    model_dir: Path, change: str
) -> None:
    """Each would let a token cover more than the bytes of its vocabulary entry."""
    other = Tokenizer.from_str(json.dumps(_variant(_spec(model_dir), change)))
    assert TokenFloor(other)("word " * 100_000) == 0


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [("chat", {"messages": [{"role": "user", "content": "word " * 10_000}]}, "messages"),
     ("responses", {"input": "word " * 10_000}, "input"),
     ("completion", {"prompt": ["hi", "word " * 10_000]}, "prompt")],
)  # fmt: skip
def test_a_prompt_certainly_past_the_context_is_refused_before_it_is_tokenized(
    model_dir: Path, api: Api, body: dict[str, Any], param: str
) -> None:
    renderer = Renderer(load_model_info(model_dir, max_model_len=1000), "deepseek-v4")
    request = RenderRequest(api=api, request_id="r", body=json.dumps(body).encode(), created=1)
    with pytest.raises(InvalidRequest) as info:
        renderer.render(request)
    error = info.value
    assert "maximum context length is 1000 tokens" in error.message
    assert "has at least" in error.message and error.param == param
    assert error.code == "context_length_exceeded"
