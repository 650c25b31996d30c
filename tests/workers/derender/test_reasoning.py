"""Reasoning parsers: vLLM 0.33's split of an output into reasoning and content, O(delta)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import pairwise

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.workers.derender.texts import END_THINK, THINK, encode
from tokenway import parsers
from tokenway.api.bodies import decode_body
from tokenway.api.openai import ChatCompletionRequest
from tokenway.parsers import REASONING_PARSERS, THINK_END, THINK_START
from tokenway.wire import ReasoningStart
from workers.derender import reasoning
from workers.derender.detok import Detokenizer, seed
from workers.derender.reasoning import ReasoningState
from workers.render.chat import apply_template
from workers.render.core import Renderer

PROPERTY = settings(max_examples=150, deadline=None)
VOCAB = {THINK_START: THINK, THINK_END: END_THINK}


def run(
    parser: str, mode: ReasoningStart, chunks: Sequence[str]
) -> tuple[list[str], list[str], list[ReasoningState]]:
    """Feed the chunks, then finish: every reasoning and content delta, and every state."""
    state = reasoning.start(mode)
    assert state is not None
    thoughts, answers, states = [], [], [state]
    for chunk in chunks:
        thought, answer, state = reasoning.step(parser, state, chunk)
        thoughts.append(thought)
        answers.append(answer)
        states.append(state)
    thought, answer = reasoning.finish(parser, state)
    return [*thoughts, thought], [*answers, answer], states


def parse(parser: str, mode: ReasoningStart, chunks: Sequence[str]) -> tuple[str, str]:
    thoughts, answers, _ = run(parser, mode, chunks)
    return "".join(thoughts), "".join(answers)


def cut(text: str, points: Sequence[int]) -> list[str]:
    bounds = [0, *sorted({min(p, len(text)) for p in points}), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def oracle(mode: ReasoningStart, text: str) -> tuple[str, str]:
    """The rules, stated on the whole text at once (independent of the incremental code)."""
    if mode != "open":
        return "", text
    head, found, tail = text.partition(THINK_END)
    return head.replace(THINK_START, ""), tail if found else ""


# -- golden outputs ------------------------------------------------------------------------

# (parser, mode, output, reasoning, content)
GOLDEN: list[tuple[str, ReasoningStart, str, str, str]] = [
    # deepseek_r1: output without a start marker is reasoning until </think>
    ("deepseek_r1", "open", "abc</think>xyz", "abc", "xyz"),
    ("deepseek_r1", "open", "The answer is 4.", "The answer is 4.", ""),
    (
        "deepseek_r1",
        "open",
        "<think>Let me add.</think>\n\nIt is 4.",
        "Let me add.",
        "\n\nIt is 4.",
    ),
    ("deepseek_r1", "open", "</think>Just the answer.", "", "Just the answer."),
    ("deepseek_r1", "open", "Only thoughts</think>", "Only thoughts", ""),
    ("deepseek_r1", "open", "", "", ""),
    # a <think> while already in reasoning is dropped; reasoning goes on
    ("deepseek_r1", "open", "a<think>b<think>c</think>d", "abc", "d"),
    # after </think> nothing is parsed: a second <think> block is content, markers and all
    ("deepseek_r1", "open", "a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    # things that look like markers but are not
    ("deepseek_r1", "open", "<thinking></thin>x</think", "<thinking></thin>x</think", ""),
    ("deepseek_r1", "open", "a<</think>>b", "a<", ">b"),
    # the prompt closed reasoning: all content, markers included
    ("deepseek_r1", "closed", "Plain answer.", "", "Plain answer."),
    ("deepseek_r1", "closed", "<think>x</think>y", "", "<think>x</think>y"),
    # deepseek_v3 with thinking is deepseek_r1
    ("deepseek_v3", "open", "<think>hmm</think>ok", "hmm", "ok"),
    ("deepseek_v3", "open", "hmm</think>ok", "hmm", "ok"),
    ("deepseek_v3", "closed", "ok</think>", "", "ok</think>"),
    # qwen3 with enable_thinking: starts in reasoning whether or not the output has <think>
    ("qwen3", "open", "<think>\nsteps\n</think>\n\nanswer", "\nsteps\n", "\n\nanswer"),
    ("qwen3", "open", "steps</think>answer", "steps", "answer"),
    ("qwen3", "open", "no end marker at all", "no end marker at all", ""),
    ("qwen3", "closed", "answer<think>", "", "answer<think>"),
]


@pytest.mark.parametrize(("parser", "mode", "output", "thought", "answer"), GOLDEN)
def test_golden_outputs_split_as_vllm_splits_them_in_one_step_or_char_by_char(
    parser: str, mode: ReasoningStart, output: str, thought: str, answer: str
) -> None:
    assert parse(parser, mode, [output]) == (thought, answer)
    assert parse(parser, mode, list(output)) == (thought, answer)
    assert oracle(mode, output) == (thought, answer)


@PROPERTY
@given(
    case=st.sampled_from(GOLDEN),
    points=st.lists(st.integers(min_value=0, max_value=64), max_size=10),
)
def test_any_chunking_of_a_golden_output_gives_the_same_split(
    case: tuple[str, ReasoningStart, str, str, str], points: list[int]
) -> None:
    parser, mode, output, thought, answer = case
    assert parse(parser, mode, cut(output, points)) == (thought, answer)


def test_off_means_no_state_and_no_parsing() -> None:
    assert reasoning.start("off") is None
    assert reasoning.start("open") == ReasoningState(in_reasoning=True)
    assert reasoning.start("closed") == ReasoningState(in_reasoning=False)


# -- markers split across deltas -----------------------------------------------------------


def test_an_end_marker_split_across_deltas_is_held_then_closes_reasoning() -> None:
    thoughts, answers, states = run("deepseek_r1", "open", ["Hm, 2+2", "</th", "in", "k>4"])
    assert thoughts == ["Hm, 2+2", "", "", "", ""]
    assert answers == ["", "", "", "4", ""]
    assert [s.held for s in states] == ["", "", "</th", "</thin", ""]


def test_a_start_marker_split_across_deltas_is_dropped() -> None:
    assert parse("qwen3", "open", ["x<", "thi", "nk>y"]) == ("xy", "")


def test_a_held_tail_that_never_becomes_a_marker_is_released_as_reasoning() -> None:
    thoughts, answers, states = run("deepseek_r1", "open", ["so a </", "b"])
    assert thoughts == ["so a ", "</b", ""]
    assert states[1].held == "</"
    # ... and at the end of the output, by finish
    thoughts, answers, states = run("deepseek_r1", "open", ["cut off at </thin"])
    assert thoughts == ["cut off at ", "</thin"] and answers == ["", ""]


# -- chunking invariance -------------------------------------------------------------------

# Text made of marker fragments, so that near-markers, split markers and real ones all occur.
_pieces = st.sampled_from(
    [THINK_START, THINK_END, "<", "</", "<th", "think", "</thi", "nk>", ">", "/", "a", " ", "思"]
)
outputs = st.lists(_pieces, max_size=30).map("".join)


@PROPERTY
@given(
    parser=st.sampled_from(REASONING_PARSERS),
    mode=st.sampled_from(["open", "closed"]),
    output=outputs,
    points=st.lists(st.integers(min_value=0, max_value=250), max_size=12),
)
def test_any_chunking_gives_what_one_step_gives(
    parser: str, mode: ReasoningStart, output: str, points: list[int]
) -> None:
    whole = parse(parser, mode, [output])
    assert whole == oracle(mode, output)
    assert parse(parser, mode, cut(output, points)) == whole


@PROPERTY
@given(
    thought=st.text(alphabet="abc <>/", max_size=40),
    answer=st.text(alphabet="0123 <>/think", max_size=40),
    points=st.lists(st.integers(min_value=0, max_value=100), max_size=12),
)
def test_reasoning_and_content_never_mix(thought: str, answer: str, points: list[int]) -> None:
    """Every delta is one or the other, so dropping reasoning (include_reasoning=false)
    leaves exactly the answer."""
    output = f"{thought}{THINK_END}{answer}"
    thoughts, answers, _ = run("deepseek_r1", "open", cut(output, points))
    assert "".join(answers) == answer
    assert "".join(thoughts) == thought
    for t, a in zip(thoughts, answers, strict=True):
        assert not set(t) & set("0123")
        assert not set(a) & set("abc")


# -- bounded state -------------------------------------------------------------------------

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ReasoningState).decode


@pytest.mark.parametrize(
    "output",
    [
        "x" * 10_000,
        "</thin" * 2_000,  # a partial marker at the end of every delta
        "<think>" * 1_500,
        "y" * 10_000 + "</think>" + "z" * 10_000,
    ],
)
def test_state_stays_small_however_long_the_output(output: str) -> None:
    for size in (1, 7, 10_000):
        chunks = [output[i : i + size] for i in range(0, len(output), size)]
        _, _, states = run("deepseek_r1", "open", chunks)
        for state in states:
            raw = _encode(state)
            assert len(raw) <= 16
            assert _decode(raw) == state
            assert reasoning.problem("deepseek_r1", state) is None


def test_a_state_no_step_could_produce_is_refused() -> None:
    assert reasoning.problem("qwen3", ReasoningState(in_reasoning=True, held="x" * 100))
    assert reasoning.problem("qwen3", ReasoningState(in_reasoning=False, held="</"))
    assert reasoning.problem("qwen3", ReasoningState(in_reasoning=True, held="</")) is None


# -- real tokens ---------------------------------------------------------------------------


def test_marker_tokens_survive_skip_special_tokens_and_split_the_output(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    """<think>/</think> are added but not special tokens: detokenized text keeps them."""
    ids = [
        THINK,
        *encode(tokenizer, ["Two plus two."]),
        END_THINK,
        *encode(tokenizer, ["It is 4."]),
    ]
    window = seed([])
    state = reasoning.start("open")
    assert state is not None
    thought = answer = ""
    for tid in ids:  # one token per delta, as an engine streams them
        text, window = detok.step(window, [tid], skip_special_tokens=True)
        t, a, state = reasoning.step("deepseek_r1", state, text)
        thought, answer = thought + t, answer + a
    t, a = reasoning.finish("deepseek_r1", state)
    assert (thought + t, answer + a) == ("Two plus two.", "It is 4.")


# -- start_mode ----------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def rendered(renderer: Renderer, **kwargs: object) -> list[int]:
    """The prompt ids render makes for HISTORY: the default model's chat template, tokenized."""
    body: dict[str, object] = {"messages": HISTORY}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    req = decode_body("chat", json.dumps(body).encode())
    assert isinstance(req, ChatCompletionRequest)
    text = apply_template(renderer.tokenizer, req)
    return renderer.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("parser", "kwargs", "mode"),
    [
        ("deepseek_r1", {"thinking": True}, "open"),  # generation prompt ends with <think>
        ("deepseek_r1", {}, "closed"),  # … with </think>
        ("deepseek_r1", {"thinking": False}, "closed"),
        ("deepseek_v3", {"thinking": True}, "open"),
        ("deepseek_v3", {"enable_thinking": True}, "open"),
        ("deepseek_v3", {}, "off"),  # identity parser: all content
        ("deepseek_v3", {"thinking": False}, "off"),
        ("qwen3", {"enable_thinking": True}, "open"),
        ("qwen3", {"thinking": True}, "open"),  # qwen3 thinks unless told not to
        ("qwen3", {}, "closed"),  # … but this template closed reasoning in the prompt
        ("qwen3", {"enable_thinking": False}, "off"),
    ],
)
def test_start_mode_follows_the_last_marker_of_the_rendered_prompt(
    renderer: Renderer, parser: str, kwargs: dict[str, object], mode: ReasoningStart
) -> None:
    ids = rendered(renderer, **kwargs)
    assert END_THINK in ids  # the history's assistant turn closed its (empty) reasoning
    assert ids[-1] == (
        THINK if kwargs.get("thinking") or kwargs.get("enable_thinking") else END_THINK
    )
    assert parsers.start_mode(parser, ids, kwargs, renderer.vocab) == mode


def test_a_prompt_without_markers_starts_in_reasoning(renderer: Renderer) -> None:
    ids = renderer.tokenizer.encode("Plain prompt, no template.", add_special_tokens=True)
    assert THINK not in ids and END_THINK not in ids
    for parser in ("deepseek_r1", "qwen3"):
        assert parsers.start_mode(parser, ids, {"thinking": True}, renderer.vocab) == "open"


def test_unknown_parser_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, deepseek_v3, qwen3"):
        parsers.start_mode("granite", [1, 2], {}, VOCAB)
    with pytest.raises(ValueError, match="'granite'"):
        reasoning.step("granite", ReasoningState(in_reasoning=True), "x")
    with pytest.raises(ValueError, match="'granite'"):
        reasoning.finish("granite", ReasoningState(in_reasoning=True))


def test_deepseek_parsers_need_the_markers_as_tokens_qwen3_does_not() -> None:
    with pytest.raises(ValueError, match="<think> and </think>"):
        parsers.start_mode("deepseek_r1", [1, 2], {}, {})
    assert parsers.start_mode("deepseek_v3", [1, 2], {}, {}) == "off"
    assert parsers.start_mode("qwen3", [1, 2], {}, {}) == "open"
