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

from tests.workers.derender.test_parsing import assemble
from tests.workers.derender.test_parsing import ctx as chat_context
from tests.workers.derender.test_parsing import run as derender_run
from tests.workers.derender.texts import END_THINK, THINK, encode
from tokenway import parsers
from tokenway.api.bodies import decode_body
from tokenway.api.openai import ChatCompletionRequest
from tokenway.parsers import MARKER_REASONING_PARSERS, THINK_END, THINK_START
from tokenway.wire import ParseContext, ReasoningStart
from workers.derender import reasoning
from workers.derender.detok import Detokenizer, seed
from workers.derender.reasoning import ReasoningState
from workers.render.chat import apply_template
from workers.render.core import Renderer

PROPERTY = settings(max_examples=150, deadline=None)
VOCAB = {THINK_START: THINK, THINK_END: END_THINK}
# The parsers that read nothing after reasoning (the others are vLLM's parser engine's, below).
# the parsers whose content after reasoning is left as it is (the oracle's rules)
THINK_PARSERS = ("deepseek_r1", "deepseek_v3")


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
    parser=st.sampled_from(THINK_PARSERS),
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
    assert reasoning.problem("deepseek_r1", ReasoningState(in_reasoning=False, held="</"))
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
        # qwen3 reads the prompt back to its turn's start, a ChatML token this vocabulary
        # lacks: as vLLM 0.33, it cannot tell this turn's </think> and starts in reasoning
        ("qwen3", {}, "open"),
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


# -- vLLM's parser engine: glm45/glm47, kimi_k2, minimax_m2, mistral, seed_oss ---------------
# The whole answer's split, as vLLM 0.33's parser engine makes it in one pass over the output
# text (each case checked against vLLM's own extract_reasoning).

KIMI_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>"
)
GLM_CALL = "<tool_call>f\n<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
MINIMAX_CALL = '<minimax:tool_call><invoke name="f"></invoke></minimax:tool_call>'
SEED_CALL = "<seed:tool_call><function=f></function></seed:tool_call>"

ENGINE_GOLDEN: list[tuple[str, ReasoningStart, str, str, str]] = [
    # glm: starts in reasoning; <think> dropped, trailing whitespace of reasoning dropped
    ("glm45", "open", "Let me think.</think>The answer.", "Let me think.", "The answer."),
    ("glm45", "open", "<think>plan\n\n</think>\n\nanswer", "plan", "\n\nanswer"),
    ("glm45", "open", "a<think>b<think>c", "abc", ""),
    ("glm45", "open", "no end at all \n", "no end at all", ""),
    ("glm45", "open", " \n </think>answer", "", "answer"),
    # a tool call's start ends reasoning and stays content, for the tool parser
    ("glm45", "open", f"plan {GLM_CALL}", "plan", GLM_CALL),
    (
        "glm47",
        "open",
        "<think>plan</think><tool_call>f</tool_call>",
        "plan",
        "<tool_call>f</tool_call>",
    ),
    # in content a later </think> is dropped and <think> opens reasoning again; whitespace
    # between two blocks of reasoning is reasoning
    ("glm45", "open", "a</think>b</think>c", "a", "bc"),
    ("glm45", "open", "a \n</think>b<think> c \n</think>d", "a \n c", "bd"),
    ("glm45", "closed", "x</think>y<think>z", "z", "xy"),
    # kimi_k2: its tool-call section ends reasoning; a <think> in content is text
    ("kimi_k2", "open", "<think>plan</think>answer", "plan", "answer"),
    ("kimi_k2", "open", f"plan\n{KIMI_CALL}", "plan", KIMI_CALL),
    ("kimi_k2", "open", "a</think>b<think>c</think>d", "a", "b<think>cd"),
    ("kimi_k2", "open", "a<|tool_call_begin|>b", "a<|tool_call_begin|>b", ""),
    # minimax_m2: no <think> written; a call's closer that closes no call is dropped
    ("minimax_m2", "open", "plan\n</think>\nanswer", "plan", "\nanswer"),
    ("minimax_m2", "open", f"plan{MINIMAX_CALL}</minimax:tool_call>x", "plan", f"{MINIMAX_CALL}x"),
    ("minimax_m2", "open", "a</think>b</minimax:tool_call>c", "a", "bc"),
    (
        "minimax_m2",
        "open",
        'a</think><invoke name="f"></invoke></minimax:tool_call>',
        "a",
        '<invoke name="f"></invoke></minimax:tool_call>',
    ),
    ("minimax_m2", "open", 'a<invoke name="f">b', 'a<invoke name="f">b', ""),
    # minimax_m2_append_think: all content, after the <think> the prompt opened
    ("minimax_m2_append_think", "open", "plan</think>answer", "", "<think>plan</think>answer"),
    ("minimax_m2_append_think", "open", "", "", "<think>"),
    # mistral: starts in content, [THINK] opens reasoning wherever it comes
    ("mistral", "closed", "[THINK]plan \n[/THINK]answer", "plan", "answer"),
    ("mistral", "closed", "answer only", "", "answer only"),
    ("mistral", "closed", "a[THINK]b [/THINK]c[THINK]d [/THINK]e", "b d", "ace"),
    ("mistral", "closed", "[THINK]plan[TOOL_CALLS]f[ARGS]{}", "plan", "[TOOL_CALLS]f[ARGS]{}"),
    ("mistral", "closed", "x[/THINK]y", "", "xy"),
    # seed_oss: Qwen3's grammar with Seed's markers; its reasoning keeps trailing whitespace
    # qwen3 (checked against vLLM's own parser): reasoning keeps its trailing whitespace, a
    # call ends it, a later </think> is dropped and a later <think> is text
    ("qwen3", "open", "<think>plan \n</think>\n\nanswer", "plan \n", "\n\nanswer"),
    ("qwen3", "open", "plan<tool_call>\n<function=f>", "plan", "<tool_call>\n<function=f>"),
    ("qwen3", "open", "a</think>b</think>c<think>d", "a", "bc<think>d"),
    ("seed_oss", "open", "<seed:think>plan \n</seed:think>answer", "plan \n", "answer"),
    ("seed_oss", "open", f"plan{SEED_CALL}", "plan", SEED_CALL),
    ("seed_oss", "open", "a</seed:think>b</seed:think><seed:think>c", "a", "b<seed:think>c"),
    ("seed_oss", "open", "a<think>b</think>c", "a<think>b</think>c", ""),
    ("seed_oss", "closed", "x</seed:think>y", "", "xy"),
]


def engine_oracle(parser: str, mode: ReasoningStart, text: str) -> tuple[str, str]:
    """The format's rules, character by character on the whole text (independent of the
    incremental code), and reasoning's trailing whitespace stripped at the end."""
    fmt = parsers.reasoning_format(parser)
    if fmt.prefix:
        return "", (fmt.prefix if mode == "open" else "") + text
    if not fmt.parses_content:
        return oracle(mode, text)
    thought: list[str] = []
    answer: list[str] = []
    in_reasoning, in_call, i = mode == "open", False, 0
    call = fmt.tool_call
    while i < len(text):
        at = text.startswith
        if in_reasoning and at(fmt.start, i):
            i += len(fmt.start)
        elif at(fmt.end, i):
            i += len(fmt.end)
            in_reasoning = False
        elif in_reasoning and (ends := [m for m in fmt.implicit_ends if at(m, i)]):
            answer.append(ends[0])
            i += len(ends[0])
            in_reasoning, in_call = False, True
        elif not in_reasoning and fmt.reopens and at(fmt.start, i):
            i += len(fmt.start)
            in_reasoning = True
        elif not in_reasoning and call and (opens := [m for m in call.opens if at(m, i)]):
            answer.append(opens[0])
            i += len(opens[0])
            in_call = True
        elif not in_reasoning and call and at(call.closes, i):
            answer.append(call.closes if in_call else "")
            i += len(call.closes)
            in_call = False
        else:
            (thought if in_reasoning else answer).append(text[i])
            i += 1
    joined = "".join(thought)
    return joined.rstrip() if fmt.strips_whitespace else joined, "".join(answer)


ENGINE_PARSERS = [p for p in MARKER_REASONING_PARSERS if p not in THINK_PARSERS]


@pytest.mark.parametrize(("parser", "mode", "output", "thought", "answer"), ENGINE_GOLDEN)
def test_engine_parsers_split_golden_outputs_as_vllm_in_one_step_or_char_by_char(
    parser: str, mode: ReasoningStart, output: str, thought: str, answer: str
) -> None:
    assert parse(parser, mode, [output]) == (thought, answer)
    assert parse(parser, mode, list(output)) == (thought, answer)
    assert engine_oracle(parser, mode, output) == (thought, answer)


def test_every_new_parser_has_golden_outputs() -> None:
    assert {case[0] for case in ENGINE_GOLDEN} == set(ENGINE_PARSERS)


@pytest.mark.parametrize(("parser", "mode", "output", "thought", "answer"), ENGINE_GOLDEN)
def test_a_golden_output_cut_at_every_point_gives_the_same_split(
    parser: str, mode: ReasoningStart, output: str, thought: str, answer: str
) -> None:
    for a in range(len(output) + 1):
        for b in range(a, len(output) + 1):
            assert parse(parser, mode, cut(output, [a, b])) == (thought, answer), (a, b)


# Each family's markers, their fragments and near misses, with text and whitespace between.
_FAMILY_PIECES = {
    "<think>": ["<think>", "</think>", "<", "</", "<th", "think>", "</thi", "nk>"],
    "glm": ["<tool_call>", "</tool_call>", "<arg_key>", "<tool_", "call>"],
    "kimi": [
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_calls_sec",
        "tion_begin|>",
    ],
    "minimax": [
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        '<invoke name="',
        "<invoke name=",
        "</invoke>",
        "</minimax:",
        "tool_call>",
        '">',
    ],
    "mistral": ["[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]", "[", "[/", "[THI", "NK]", "{"],
    "seed": [
        "<seed:think>",
        "</seed:think>",
        "<seed:tool_call>",
        "<function=",
        "<seed:",
        "</seed:th",
        "ink>",
        "<think>",
    ],
}
_FAMILY = {
    "deepseek_r1": "<think>",
    "deepseek_v3": "<think>",
    "qwen3": "<think>",
    "glm45": "glm",
    "glm47": "glm",
    "kimi_k2": "kimi",
    "minimax_m2": "minimax",
    "minimax_m2_append_think": "minimax",
    "mistral": "mistral",
    "seed_oss": "seed",
}
_TEXT = ["a", "b c", " ", "\n", " \n\t", "\u3000", "思"]


@st.composite
def family_outputs(draw: st.DrawFn) -> tuple[str, ReasoningStart, str]:
    parser = draw(st.sampled_from(MARKER_REASONING_PARSERS))
    pieces = _FAMILY_PIECES[_FAMILY[parser]] + _FAMILY_PIECES["<think>"] + _TEXT
    output = "".join(draw(st.lists(st.sampled_from(pieces), max_size=30)))
    return parser, draw(st.sampled_from(["open", "closed"])), output


def test_every_parser_has_a_family_of_pieces() -> None:
    assert set(_FAMILY) == set(MARKER_REASONING_PARSERS)


@PROPERTY
@given(case=family_outputs(), points=st.lists(st.integers(0, 400), max_size=14))
def test_any_chunking_of_any_parsers_output_gives_what_one_step_gives(
    case: tuple[str, ReasoningStart, str], points: list[int]
) -> None:
    """The core property, for all parsers: the concatenated (reasoning, content) of any
    chunking is the one-step split, which is the format's rules on the whole text."""
    parser, mode, output = case
    whole = parse(parser, mode, [output])
    assert whole == engine_oracle(parser, mode, output)
    assert parse(parser, mode, cut(output, points)) == whole
    assert parse(parser, mode, list(output)) == whole


@settings(max_examples=60, deadline=None)
@given(case=family_outputs())
def test_any_two_cuts_give_what_one_step_gives(case: tuple[str, ReasoningStart, str]) -> None:
    parser, mode, output = case
    whole = parse(parser, mode, [output])
    for a in range(len(output) + 1):
        assert parse(parser, mode, cut(output, [a])) == whole, a


# -- trailing whitespace -------------------------------------------------------------------


def test_trailing_whitespace_is_held_until_more_reasoning_follows() -> None:
    thoughts, answers, states = run(
        "kimi_k2", "open", ["Plan: add.", " \n", "Then", " \n\n", "</think>4"]
    )
    assert thoughts == ["Plan: add.", "", " \nThen", "", "", ""]
    assert answers == ["", "", "", "", "4", ""]
    assert [s.blank for s in states] == ["", "", " \n", "", " \n\n", ""]


def test_whitespace_held_at_the_end_of_the_output_is_dropped() -> None:
    thoughts, _, states = run("glm47", "open", ["cut off \n"])
    assert thoughts == ["cut off", ""] and states[-1].blank == " \n"


def test_whitespace_between_two_blocks_waits_in_content_where_reasoning_reopens() -> None:
    thoughts, answers, states = run("glm45", "open", ["a \n</think>", "b", "<think>", "c"])
    assert states[2] == ReasoningState(in_reasoning=False, blank=" \n")
    assert "".join(thoughts) == "a \nc" and "".join(answers) == "b"
    # ... and where reasoning cannot reopen it is dropped with the end marker
    _, _, states = run("kimi_k2", "open", ["a \n</think>", "b"])
    assert states[1] == ReasoningState(in_reasoning=False)


def test_seed_oss_keeps_trailing_whitespace_as_vllm_does() -> None:
    assert parse("seed_oss", "open", ["plan \n", "</seed:think>x"]) == ("plan \n", "x")
    _, _, states = run("seed_oss", "open", ["plan \n"])
    assert states[1].blank == ""


def test_a_whitespace_run_longer_than_the_limit_keeps_its_head() -> None:
    """The held whitespace is bounded: of a longer run only the last MAX_BLANK characters are
    dropped (vLLM drops all of it), the same way however the output is cut."""
    run_of = " " * (reasoning.MAX_BLANK + 10)
    output = f"a{run_of}</think>b"
    whole = parse("minimax_m2", "open", [output])
    assert whole == ("a" + " " * 10, "b")
    assert parse("minimax_m2", "open", list(output)) == whole
    _, _, states = run("minimax_m2", "open", list(output))
    assert max(len(s.blank) for s in states) == reasoning.MAX_BLANK


# -- minimax_m2_append_think -----------------------------------------------------------------


def test_append_think_owes_its_start_marker_until_the_first_delta() -> None:
    thoughts, answers, states = run("minimax_m2_append_think", "open", ["plan", "</think>a"])
    assert answers == ["<think>plan", "</think>a", ""] and not any(thoughts)
    assert states[1] == ReasoningState(in_reasoning=False)
    assert reasoning.count("minimax_m2_append_think", "open", ["plan", "</think>"]) == 0


# -- counting reasoning tokens ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("parser", "mode", "pieces", "n"),
    [
        # the tokens whose text begins in reasoning, not the markers
        ("glm45", "open", ["<think>", "Two", " plus", "</think>", "4"], 2),
        ("glm45", "open", ["plan", " a</th", "ink>", "<think>", "b"], 3),  # reopened
        ("kimi_k2", "open", ["x", "<|tool_calls_section_begin|>", "y"], 1),
        ("minimax_m2", "open", ["a", "b", "</think>", "c"], 2),
        ("mistral", "closed", ["x", "[THINK]", "y", "z", "[/THINK]"], 2),
        ("seed_oss", "closed", ["x", "</seed:think>"], 0),
        ("seed_oss", "open", ["", "a", ""], 1),  # a special token skipped is no text
    ],
)
def test_engine_parsers_count_the_tokens_that_begin_in_reasoning(
    parser: str, mode: ReasoningStart, pieces: list[str], n: int
) -> None:
    assert reasoning.count(parser, mode, pieces) == n


# -- state: bounded, and forged states refused ------------------------------------------------


@PROPERTY
@given(case=family_outputs(), points=st.lists(st.integers(0, 400), max_size=14))
def test_every_state_a_step_leaves_is_small_and_accepted(
    case: tuple[str, ReasoningStart, str], points: list[int]
) -> None:
    parser, mode, output = case
    _, _, states = run(parser, mode, cut(output, points))
    for state in states:
        assert reasoning.problem(parser, state) is None
        assert len(_encode(state)) <= 32
        assert _decode(_encode(state)) == state


@pytest.mark.parametrize(
    ("parser", "state"),
    [
        ("glm45", ReasoningState(in_reasoning=True, blank="x")),  # not whitespace
        ("glm45", ReasoningState(in_reasoning=True, blank=" " * (reasoning.MAX_BLANK + 1))),
        ("kimi_k2", ReasoningState(in_reasoning=False, blank=" ")),  # kimi never reopens
        ("seed_oss", ReasoningState(in_reasoning=True, blank=" ")),  # seed keeps it
        ("deepseek_r1", ReasoningState(in_reasoning=True, blank=" ")),
        ("glm45", ReasoningState(in_reasoning=False, in_call=True)),  # glm tracks no calls
        ("minimax_m2", ReasoningState(in_reasoning=True, in_call=True)),
        ("minimax_m2", ReasoningState(in_reasoning=False, held="<think")),  # not read there
        ("mistral", ReasoningState(in_reasoning=True, held="<")),
        ("minimax_m2_append_think", ReasoningState(in_reasoning=True, held="<")),
    ],
)
def test_a_state_no_engine_parser_step_could_produce_is_refused(
    parser: str, state: ReasoningState
) -> None:
    assert reasoning.problem(parser, state)


@pytest.mark.parametrize(
    ("parser", "state"),
    [
        ("glm45", ReasoningState(in_reasoning=False, held="<thi", blank=" \n")),
        ("minimax_m2", ReasoningState(in_reasoning=False, held="</minimax:", in_call=True)),
        ("mistral", ReasoningState(in_reasoning=False, held="[/TH")),
        ("kimi_k2", ReasoningState(in_reasoning=True, held="<|tool_calls_", blank="\t")),
    ],
)
def test_states_engine_parser_steps_produce_are_accepted(
    parser: str, state: ReasoningState
) -> None:
    assert reasoning.problem(parser, state) is None


def test_no_marker_a_parser_reads_is_a_prefix_of_another_it_reads_there() -> None:
    """Then the leftmost marker is the only one there, as in vLLM's lexer (which waits when a
    complete terminal could still grow into a longer one)."""
    for parser in MARKER_REASONING_PARSERS:
        for in_reasoning in (True, False):
            read = [m for m, _ in reasoning._markers(parser, in_reasoning)]
            for a in read:
                assert not any(b != a and b.startswith(a) for b in read), (parser, a)


# -- the derender core: reasoning ended by a tool call, for the tool parser ------------------


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_glm_reasoning_ends_at_its_tool_call_which_the_tool_parser_reads(
    detok: Detokenizer, tokenizer: Tokenizer, size: int
) -> None:
    parse_ctx = ParseContext(
        reasoning_parser="glm45", reasoning_start="open", tool_choice="auto", tool_parser="glm45"
    )
    context = chat_context(stream=True, parse=parse_ctx)
    output = "Weather, then.\n" + "<tool_call>get_weather\n<arg_key>city</arg_key>"
    output += "<arg_value>Oslo</arg_value></tool_call>"
    ids = tokenizer.encode(output, add_special_tokens=False).ids
    docs, _ = derender_run(detok, context, [ids[i : i + size] for i in range(0, len(ids), size)])
    got = assemble(docs)
    assert got["reasoning"] == "Weather, then."
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert got["content"] == "" and got["finish"] == "tool_calls"


# -- start_mode of the engine parsers ------------------------------------------------------


@pytest.mark.parametrize(
    ("parser", "kwargs", "mode"),
    [
        # glm and kimi: `thinking` or `enable_thinking` when either is given, on without them
        ("glm45", {}, "open"),
        ("glm45", {"thinking": None}, "open"),
        ("glm45", {"thinking": False}, "off"),
        ("glm47", {"enable_thinking": False}, "off"),
        ("glm47", {"thinking": False, "enable_thinking": True}, "open"),
        ("kimi_k2", {}, "open"),
        ("kimi_k2", {"thinking": True}, "open"),
        ("kimi_k2", {"enable_thinking": 0}, "off"),
        # seed_oss: Qwen3's `enable_thinking`, on unless given and false (null is false)
        ("seed_oss", {}, "open"),
        ("seed_oss", {"thinking": False}, "open"),
        ("seed_oss", {"enable_thinking": False}, "off"),
        ("seed_oss", {"enable_thinking": None}, "off"),
        # no switch
        ("minimax_m2", {"thinking": False, "enable_thinking": False}, "open"),
        ("minimax_m2_append_think", {"enable_thinking": False}, "open"),
        ("mistral", {"thinking": False}, "closed"),
    ],
)
def test_the_thinking_switch_of_each_engine_parser(
    parser: str, kwargs: dict[str, object], mode: ReasoningStart
) -> None:
    vocab = {**VOCAB, "[THINK]": 5, "[/THINK]": 6, "[TOOL_CALLS]": 7}
    assert parsers.start_mode(parser, [9, 9], kwargs, vocab) == mode


GLM_VOCAB = {"<think>": 1, "</think>": 2, "<tool_call>": 3, "<|user|>": 4, "<|assistant|>": 5}
SEED_VOCAB = {"<seed:think>": 1, "</seed:think>": 2, "<seed:bos>": 6, "<seed:eos>": 7}


@pytest.mark.parametrize(
    ("parser", "vocab", "prompt", "mode"),
    [
        # an end token after the turn's last boundary closes reasoning; the turn's start
        # token or no marker at all leaves it open
        ("glm45", GLM_VOCAB, [4, 10, 5], "open"),
        ("glm45", GLM_VOCAB, [4, 10, 5, 1], "open"),
        ("glm45", GLM_VOCAB, [4, 10, 5, 1, 11, 2], "closed"),
        ("glm47", GLM_VOCAB, [4, 10, 5, 3], "closed"),  # a tool call's start ends it too
        ("glm45", GLM_VOCAB, [1, 11, 2, 4, 10, 5], "open"),  # an earlier turn's end
        ("glm45", GLM_VOCAB, [1, 2, 1], "open"),
        ("seed_oss", SEED_VOCAB, [6, 10, 7, 6, 11, 2], "closed"),
        ("seed_oss", SEED_VOCAB, [6, 11, 2, 7, 6, 10], "open"),
        # without boundary tokens vLLM cannot tell this turn from an earlier one: no look
        ("glm45", VOCAB, [THINK, 11, END_THINK], "open"),
        ("seed_oss", {"</seed:think>": 2}, [2], "open"),
        # nor without the end marker as a token
        ("glm45", {"<tool_call>": 3, "<|user|>": 4}, [4, 3], "open"),
        # the prompt is not read: the output starts where the parser starts
        ("kimi_k2", VOCAB, [THINK, 11, END_THINK], "open"),
        ("minimax_m2", VOCAB, [THINK, 11, END_THINK], "open"),
        ("minimax_m2_append_think", VOCAB, [END_THINK], "open"),
        ("mistral", {"[THINK]": 5, "[/THINK]": 6, "[TOOL_CALLS]": 7}, [5, 11], "closed"),
    ],
)
def test_the_prompt_closes_reasoning_only_in_its_own_turn(
    parser: str, vocab: dict[str, int], prompt: list[int], mode: ReasoningStart
) -> None:
    assert parsers.start_mode(parser, prompt, {}, vocab) == mode


def test_mistral_reasons_only_with_think_as_a_token_and_needs_its_tool_call_token() -> None:
    assert parsers.start_mode("mistral", [1], {}, {"[TOOL_CALLS]": 7}) == "off"
    with pytest.raises(ValueError, match=r"'mistral' needs \[TOOL_CALLS\] as a token"):
        parsers.start_mode("mistral", [1], {}, {"[THINK]": 5, "[/THINK]": 6})


@pytest.mark.parametrize(
    "parser", ["glm45", "glm47", "kimi_k2", "minimax_m2", "minimax_m2_append_think", "seed_oss"]
)
def test_a_rendered_prompt_that_closed_reasoning_leaves_engine_parsers_open(
    renderer: Renderer, parser: str
) -> None:
    """DeepSeek's template ends a prompt without thinking in </think>; vLLM's whole answer
    for these parsers starts in reasoning all the same (its vocabulary has none of their
    turn boundaries)."""
    ids = rendered(renderer)
    assert ids[-1] == END_THINK
    assert parsers.start_mode(parser, ids, {}, renderer.vocab) == "open"


def test_every_reasoning_parser_is_a_flag_value() -> None:
    for parser in MARKER_REASONING_PARSERS:
        parsers.ParserFlags(reasoning_parser=parser).check()
    with pytest.raises(ValueError, match=r"known: deepseek_r1, .*, seed_oss"):
        parsers.ParserFlags(reasoning_parser="granite").check()


# A vocabulary with each family's markers as tokens (a model's own tokenizer has them).
GATE_VOCAB = {t: i for i, t in enumerate(
    ["<think>", "</think>", "<|im_start|>", "<|im_end|>", "[THINK]", "[/THINK]", "[TOOL_CALLS]",
     "<|tool_calls_section_begin|>", "<minimax:tool_call>", "x"]
)}  # fmt: skip


def ids(*tokens: str) -> list[int]:
    return [GATE_VOCAB[t] for t in tokens]


@pytest.mark.parametrize(
    ("parser", "prompt", "kwargs", "ended", "start"),
    [
        # the <think> parsers: the prompt's last marker, both ways
        ("deepseek_r1", ids("x", "</think>"), {}, True, "closed"),
        ("deepseek_r1", ids("</think>", "x", "<think>"), {}, False, "open"),
        # the engine grammars read back to the turn's start; Kimi's and MiniMax's whole
        # answer still starts in reasoning, while their constraint applies at once
        ("kimi_k2", ids("x", "</think>", "x"), {}, True, "open"),
        ("minimax_m2", ids("</think>"), {}, True, "open"),
        ("kimi_k2", ids("x"), {}, False, "open"),
        ("qwen3", ids("</think>", "<|im_end|>", "<|im_start|>", "x"), {}, False, "open"),
        ("qwen3", ids("<|im_start|>", "x", "<think>", "x", "</think>"), {}, True, "closed"),
        ("qwen3", ids("x"), {"enable_thinking": False}, True, "off"),
        # Mistral starts in content but waits for reasoning to end before constraining
        ("mistral", ids("x"), {}, False, "closed"),
        ("mistral", ids("[THINK]", "x", "[/THINK]"), {}, True, "closed"),
    ],
)  # fmt: skip
def test_the_constraint_gate_reads_the_prompt_as_vllm_tells_its_engine(
    parser: str, prompt: list[int], kwargs: dict[str, object], ended: bool, start: str
) -> None:
    """vLLM's `is_reasoning_end(prompt)` (whether structured output applies from the first
    token) and its whole answer's start are two rules for the parser-engine families."""
    assert parsers.prompt_ends_reasoning(parser, prompt, kwargs, GATE_VOCAB) is ended
    assert parsers.start_mode(parser, prompt, kwargs, GATE_VOCAB) == start
