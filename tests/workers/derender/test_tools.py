"""Tool-call parsing: every mode's golden cases, any chunking, real token deltas, the template."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tokenway.api.openai import ChatDecoder
from tokenway.errors import InvalidRequest
from tokenway.parsers import TOOL_PARSERS
from tokenway.wire import ParseContext
from workers.derender import tools
from workers.derender.detok import Detokenizer, seed
from workers.derender.tools import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    HERMES_BEGIN,
    HERMES_END,
    ToolCallDelta,
    ToolState,
)
from workers.render.chat import apply_template
from workers.render.core import Renderer

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RID = "chatcmpl-r1"
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")
PROMPT_TAIL = [0, 128803, 6366, 128804, 128822]  # BOS <｜User｜>hi<｜Assistant｜></think>
MARKERS = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)

DEEPSEEK = ParseContext(tool_choice="auto", tool_parser="deepseek_v31")
HERMES = ParseContext(tool_choice="auto", tool_parser="hermes")
REQUIRED = ParseContext(tool_choice="required")
NAMED = ParseContext(tool_choice="named", tool_name="get_weather")

# Quotes, escapes, brackets inside strings, nesting, numbers and non-ASCII in one object.
TRICKY = {
    "query": 'say "hi" to {them} [now] \\ back\\slash',
    "opts": {"tags": ["a", {"b": None}, []], "n": -1.5e3, "ok": True, "e": {}},
    "text": "naïve café — 你好 😀 </tool_call> \u2028",
}

Call = tuple[str, dict[str, Any]]


def deepseek_text(content: str, calls: list[Call], indent: int | None = None) -> str:
    body = "".join(
        f"{DS_CALL_BEGIN}{name}{DS_SEP}{json.dumps(args, ensure_ascii=False, indent=indent)}"
        f"{DS_CALL_END}"
        for name, args in calls
    )
    return f"{content}{DS_CALLS_BEGIN}{body}{DS_CALLS_END}" if calls else content


def hermes_text(content: str, calls: list[Call], indent: int | None = None) -> str:
    return content + "".join(
        f"{HERMES_BEGIN}\n"
        f"{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False, indent=indent)}"
        f"\n{HERMES_END}\n"
        for n, a in calls
    )


def required_text(calls: list[Call], indent: int | None = None) -> str:
    items = [{"name": n, "parameters": a} for n, a in calls]
    return json.dumps(items, ensure_ascii=False, indent=indent)


@dataclass
class Run:
    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)
    steps: list[list[ToolCallDelta]] = field(default_factory=list)  # per chunk, then finish
    state_sizes: list[int] = field(default_factory=list)
    state: ToolState | None = None


def run(ctx: ParseContext, chunks: list[str], rid: str = RID) -> Run:
    """Step chunk after chunk; the state crosses msgpack between steps, as on the wire."""
    state = tools.start(ctx)
    assert state is not None
    r = Run()
    parts = []
    for chunk in chunks:
        before, snapshot = state, msgspec.msgpack.encode(state)
        text, deltas, state = tools.step(ctx, state, chunk, rid)
        assert msgspec.msgpack.encode(before) == snapshot  # the step left its input alone
        raw = msgspec.msgpack.encode(state)
        r.state_sizes.append(len(raw))
        state = msgspec.msgpack.decode(raw, type=ToolState)
        parts.append(text)
        r.deltas += deltas
        r.steps.append(deltas)
    text, deltas = tools.finish(ctx, state, rid)
    parts.append(text)
    r.deltas += deltas
    r.steps.append(deltas)
    r.content, r.state = "".join(parts), state
    return r


def cut(text: str, sizes: list[int]) -> list[str]:
    """`text` in pieces whose sizes cycle through `sizes`."""
    pieces, i, k = [], 0, 0
    while i < len(text):
        pieces.append(text[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return pieces


def parsed(r: Run) -> list[Call]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in tools.merge(r.deltas)
    ]


@functools.cache
def _detokenizer(tokenizer: Tokenizer) -> Detokenizer:
    return Detokenizer(tokenizer)  # 0.7 s to build: once, not per example


def token_deltas(tokenizer: Tokenizer, text: str) -> list[str]:
    """`text` as derender sees it: encoded, then detokenized one token at a time."""
    detok = _detokenizer(tokenizer)
    state = seed(PROMPT_TAIL)
    out = []
    for tid in tokenizer.encode(text, add_special_tokens=False).ids:
        piece, state = detok.step(state, [tid])
        out.append(piece)
    assert "".join(out) == text
    return out


def check_shapes(ctx: ParseContext, r: Run) -> None:
    """vLLM's delta shapes; ids stable; arguments only appended."""
    forced = ctx.tool_choice in ("named", "required")
    seen: set[int] = set()
    for d in r.deltas:
        doc = msgspec.to_builtins(d)
        if d.index not in seen:
            seen.add(d.index)
            assert set(doc) == {"index", "id", "type", "function"}
            assert doc["type"] == "function"
            assert CALL_ID.fullmatch(doc["id"]) and doc["id"] == tools.call_id(RID, d.index)
            assert set(doc["function"]) == ({"name", "arguments"} if forced else {"name"})
        else:
            assert doc == {"index": d.index, "function": {"arguments": d.function.arguments}}
            assert d.function.arguments
    assert sorted(seen) == list(range(len(seen)))  # indexes from 0, none skipped


def same_result(ctx: ParseContext, text: str, sizes: list[int]) -> Run:
    whole, chunked = run(ctx, [text]), run(ctx, cut(text, sizes))
    assert chunked.content == whole.content
    assert tools.merge(chunked.deltas) == tools.merge(whole.deltas)
    check_shapes(ctx, chunked)
    check_shapes(ctx, whole)
    return chunked


# -- golden cases --------------------------------------------------------------------------

WEATHER: Call = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME: Call = ("get_time", {"tz": "Europe/Paris"})
GOLDEN: list[tuple[str, ParseContext, str, str, list[Call]]] = [
    ("deepseek plain", DEEPSEEK, "The answer is 42; a < b.", "The answer is 42; a < b.", []),
    ("deepseek plain, marker-like tail", DEEPSEEK, "x <｜tool▁call", "x <｜tool▁call", []),
    ("deepseek one", DEEPSEEK, deepseek_text("Let me check.", [WEATHER]), "Let me check.",
     [WEATHER]),
    ("deepseek two", DEEPSEEK, deepseek_text("", [WEATHER, TIME]), "", [WEATHER, TIME]),
    ("deepseek tricky", DEEPSEEK, deepseek_text("", [("q", TRICKY)]), "", [("q", TRICKY)]),
    ("deepseek pretty", DEEPSEEK, deepseek_text("", [("q", TRICKY)], indent=2), "",
     [("q", TRICKY)]),
    ("deepseek text after the block dropped", DEEPSEEK,
     deepseek_text("a", [WEATHER]) + "trailing", "a", [WEATHER]),
    ("hermes plain", HERMES, "No tools: x <tool", "No tools: x <tool", []),
    ("hermes one", HERMES, hermes_text("Let me check. ", [WEATHER]), "Let me check. ",
     [WEATHER]),
    ("hermes two", HERMES, hermes_text("", [WEATHER, TIME]), "", [WEATHER, TIME]),
    ("hermes tricky", HERMES, hermes_text("", [("q", TRICKY)]), "", [("q", TRICKY)]),
    ("hermes pretty", HERMES, hermes_text("", [("q", TRICKY)], indent=2), "", [("q", TRICKY)]),
    ("hermes arguments before name", HERMES,
     '<tool_call>{"arguments": {"name": "inner", "x": [1]}, "name": "f"}</tool_call>', "",
     [("f", {"name": "inner", "x": [1]})]),
    ("hermes no closing tag", HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}', "",
     [("f", {"a": 1})]),
    ("hermes text between and after calls dropped", HERMES,
     hermes_text("a", [WEATHER]) + "between" + hermes_text("", [TIME]) + "after", "a",
     [WEATHER, TIME]),
    ("required", REQUIRED, required_text([WEATHER, TIME]), "", [WEATHER, TIME]),
    ("required tricky pretty", REQUIRED, required_text([("q", TRICKY)], indent=2), "",
     [("q", TRICKY)]),
    ("named", NAMED, json.dumps(TRICKY, ensure_ascii=False), "", [("get_weather", TRICKY)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("ctx", "text", "content", "calls"),
    [case[1:] for case in GOLDEN],
    ids=[case[0] for case in GOLDEN],
)
def test_golden_output_parses_to_the_intended_content_and_calls(
    ctx: ParseContext, text: str, content: str, calls: list[Call]
) -> None:
    r = run(ctx, [text])
    assert r.content == content
    assert parsed(r) == calls
    check_shapes(ctx, r)
    assert not any(m in r.content for m in (*MARKERS, HERMES_BEGIN)) or not calls


@PROPERTY
@given(case=st.sampled_from(GOLDEN), sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_any_chunking_gives_the_non_streaming_result(case: Any, sizes: list[int]) -> None:
    _, ctx, text, content, calls = case
    r = same_result(ctx, text, sizes)
    assert r.content == content
    assert parsed(r) == calls


def test_one_character_at_a_time_splits_every_marker() -> None:
    for _, ctx, text, content, calls in GOLDEN:
        r = run(ctx, list(text))
        assert (r.content, parsed(r)) == (content, calls)
        check_shapes(ctx, r)


def test_auto_announces_the_name_alone_then_streams_arguments() -> None:
    text = deepseek_text("Hi", [WEATHER])
    chunks = [text[: text.index(DS_SEP) + len(DS_SEP)], text[text.index(DS_SEP) + len(DS_SEP) :]]
    r = run(DEEPSEEK, chunks)
    assert [msgspec.to_builtins(d) for d in r.steps[0]] == [
        {
            "index": 0,
            "id": tools.call_id(RID, 0),
            "type": "function",
            "function": {"name": "get_weather"},
        }
    ]
    assert [msgspec.to_builtins(d) for d in r.steps[1]] == [
        {"index": 0, "function": {"arguments": json.dumps(WEATHER[1])}}
    ]


def test_forced_calls_carry_arguments_in_their_first_delta() -> None:
    r = run(NAMED, ["", '{"city"', ': "Paris"}'])
    assert r.steps[0] == []
    assert msgspec.to_builtins(r.steps[1]) == [
        {
            "index": 0,
            "id": tools.call_id(RID, 0),
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city"'},
        }
    ]
    assert msgspec.to_builtins(r.steps[2]) == [
        {"index": 0, "function": {"arguments": ': "Paris"}'}}
    ]
    r = run(REQUIRED, ['[{"name": "get_time", "par', 'ameters": {"tz"', ': "UTC"}}]'])
    assert r.steps[0] == []
    assert msgspec.to_builtins(r.steps[1]) == [
        {
            "index": 0,
            "id": tools.call_id(RID, 0),
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz"'},
        }
    ]


def test_a_forced_call_in_the_parsers_syntax_is_read_as_auto_reads_it() -> None:
    """A structural tag held the engine to DeepSeek's markers: the parser reads them, with
    auto's deltas, and a named call still reports "stop" (nothing made up on empty output)."""
    for choice in (NAMED, REQUIRED):
        native = msgspec.structs.replace(choice, tool_parser="deepseek_v31", native_calls=True)
        text = deepseek_text("", [WEATHER])
        r = run(native, [text])
        assert parsed(r) == [WEATHER] and r.content == ""
        assert msgspec.to_builtins(r.steps[0])[0]["function"] == {"name": "get_weather"}
        assert tools.rewrites_finish(native, True) is (choice is REQUIRED)
        assert parsed(run(native, [])) == []


def test_named_tool_is_reported_even_for_empty_output() -> None:
    assert parsed(run(NAMED, [])) == [("get_weather", {})]


def test_parallel_tool_calls_false_reports_only_the_first_call() -> None:
    for ctx, text in [
        (DEEPSEEK, deepseek_text("a", [WEATHER, TIME])),
        (HERMES, hermes_text("a", [WEATHER, TIME])),
        (REQUIRED, required_text([WEATHER, TIME])),
    ]:
        single = msgspec.structs.replace(ctx, parallel_tool_calls=False)
        for chunks in ([text], list(text)):
            r = run(single, chunks)
            assert parsed(r) == [WEATHER]
            assert r.state is not None and r.state.phase == tools.Phase.DONE


def test_calls_without_a_name_are_dropped_and_missing_arguments_are_an_empty_object() -> None:
    text = (
        f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}broken{DS_CALL_END}"
        f"{DS_CALL_BEGIN}get_time{DS_SEP}{DS_CALL_END}{DS_CALLS_END}"
    )
    assert parsed(run(DEEPSEEK, [text])) == [("get_time", {})]
    text = '<tool_call>{"arguments": {"a": 1}}</tool_call><tool_call>{"name": "f"}</tool_call>'
    assert parsed(run(HERMES, [text])) == [("f", {})]


def test_ids_are_deterministic_per_response_and_index() -> None:
    assert tools.call_id(RID, 0) == tools.call_id(RID, 0)
    ids = {tools.call_id(rid, i) for rid in ("chatcmpl-a", "chatcmpl-b") for i in range(3)}
    assert len(ids) == 6 and all(CALL_ID.fullmatch(i) for i in ids)
    text = deepseek_text("", [WEATHER, TIME])
    assert tools.merge(run(DEEPSEEK, [text]).deltas) == tools.merge(
        run(DEEPSEEK, list(text)).deltas
    )


def test_merge_assembles_openai_tool_calls() -> None:
    r = run(DEEPSEEK, [deepseek_text("", [WEATHER])])
    assert tools.merge(r.deltas) == [
        {
            "id": tools.call_id(RID, 0),
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(WEATHER[1])},
        }
    ]
    assert tools.merge([]) == []


def test_start_says_when_no_tool_parsing_applies() -> None:
    assert tools.start(ParseContext()) is None
    assert tools.start(ParseContext(tool_choice="auto")) is None
    with pytest.raises(InvalidRequest, match="unknown tool parser 'nope'"):
        tools.start(ParseContext(tool_choice="auto", tool_parser="nope"))
    with pytest.raises(InvalidRequest, match="tool_name"):
        tools.start(ParseContext(tool_choice="named"))
    assert {"deepseek_v31", "hermes", "qwen3_coder", "minimax_m2", "glm47"} <= set(TOOL_PARSERS)


@pytest.mark.parametrize(
    ("ctx", "any_calls", "rewrite"),
    [
        (DEEPSEEK, True, True),
        (HERMES, True, True),
        (DEEPSEEK, False, False),
        (REQUIRED, True, True),
        (NAMED, True, False),  # OpenAI reports "stop" for a forced function
        (ParseContext(), False, False),
    ],
)
def test_finish_reason_becomes_tool_calls_when_vllm_rewrites_it(
    ctx: ParseContext, any_calls: bool, rewrite: bool
) -> None:
    assert tools.rewrites_finish(ctx, any_calls) is rewrite


def test_state_stays_small_however_long_the_arguments() -> None:
    """The largest state holds a marker's prefix (multi-byte in DeepSeek's markers)."""

    def largest(length: int) -> list[int]:
        args = {"text": "x" * length, "nested": [{"a": "}" * (length // 10)}]}
        cases = [
            (DEEPSEEK, deepseek_text("", [("f", args)])),
            (HERMES, hermes_text("", [("f", args)])),
            (REQUIRED, required_text([("f", args)])),
            (NAMED, json.dumps(args)),
            (HERMES, "a<b " * length),  # a long answer with no calls
        ]
        return [max(run(ctx, cut(text, [3, 5, 7])).state_sizes) for ctx, text in cases]

    # Bytes, for arguments of ~1 KB and ~33 KB: the same small bound.
    assert max(largest(1_000)) <= 64
    assert max(largest(30_000)) <= 64


def test_malformed_state_is_refused_on_decoding() -> None:
    raw = msgspec.msgpack.encode(ToolState(held="<"))
    assert msgspec.msgpack.decode(raw, type=ToolState).held == "<"
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([0, "<" * 100]), type=ToolState)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([42]), type=ToolState)


# -- generated outputs -----------------------------------------------------------------------

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=8), values, max_size=4)
calls_st = st.lists(st.tuples(names, arguments), max_size=3)
contents = st.text(max_size=30).filter(lambda t: "<tool_call>" not in t)
formats = st.sampled_from(["deepseek", "hermes", "required", "named"])


def build(
    fmt: str, content: str, calls: list[Call], indent: int | None
) -> tuple[ParseContext, str]:
    if fmt == "deepseek":
        return DEEPSEEK, deepseek_text(content, calls, indent)
    if fmt == "hermes":
        return HERMES, hermes_text(content, calls, indent)
    if fmt == "required":
        return REQUIRED, required_text(calls, indent)
    return NAMED, json.dumps(calls[0][1] if calls else {}, indent=indent)


def intended(fmt: str, content: str, calls: list[Call]) -> tuple[str, list[Call]]:
    if fmt == "named":
        return "", [("get_weather", calls[0][1] if calls else {})]
    if fmt == "required":
        return "", calls
    if calls and not content.strip():  # whitespace alone before calls is no content
        return "", calls
    return content, calls


@PROPERTY
@given(
    fmt=formats,
    content=contents,
    calls=calls_st,
    indent=st.sampled_from([None, 2]),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=6),
)
def test_generated_calls_parse_back_under_any_chunking(
    fmt: str, content: str, calls: list[Call], indent: int | None, sizes: list[int]
) -> None:
    ctx, text = build(fmt, content, calls, indent)
    r = same_result(ctx, text, sizes)
    assert (r.content, parsed(r)) == intended(fmt, content, calls)
    if calls and fmt in ("deepseek", "hermes"):
        assert not any(m in r.content for m in (*MARKERS, HERMES_BEGIN, HERMES_END))


@PROPERTY
@given(fmt=formats, content=contents, calls=calls_st)
def test_real_token_deltas_parse_like_the_whole_text(
    tokenizer: Tokenizer, fmt: str, content: str, calls: list[Call]
) -> None:
    ctx, text = build(fmt, content, calls, None)
    if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) != text:
        return  # text the tokenizer normalizes away cannot come out of the model
    r = run(ctx, token_deltas(tokenizer, text))
    assert (r.content, parsed(r)) == intended(fmt, content, calls)
    check_shapes(ctx, r)


# Marker and JSON fragments in any order: malformed output never breaks a step, and still
# parses the same under any chunking.
_FRAGMENTS = ['"name"', '"arguments"', '"parameters"', '"f"', "x", "1", "é", "<", "<tool"]
_atoms = st.sampled_from(
    [*MARKERS, HERMES_BEGIN, HERMES_END, *'{}[]"\\,: \n', *_FRAGMENTS, "<｜tool▁call"]
)
_contexts = [DEEPSEEK, HERMES, REQUIRED, NAMED]
_contexts += [msgspec.structs.replace(c, parallel_tool_calls=False) for c in _contexts[:3]]


@PROPERTY
@given(
    ctx=st.sampled_from(_contexts),
    text=st.lists(_atoms, max_size=40).map("".join),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=5),
)
def test_malformed_output_parses_the_same_under_any_chunking(
    ctx: ParseContext, text: str, sizes: list[int]
) -> None:
    r = same_result(ctx, text, sizes)
    if not ctx.parallel_tool_calls:
        assert len(tools.merge(r.deltas)) <= 1


def test_markers_are_single_tokens_but_hermes_tags_are_several(tokenizer: Tokenizer) -> None:
    for marker in MARKERS:
        assert len(tokenizer.encode(marker, add_special_tokens=False).ids) == 1
    assert len(tokenizer.encode(HERMES_BEGIN, add_special_tokens=False).ids) > 1
    text = hermes_text("Sure. ", [("q", TRICKY), WEATHER])
    pieces = token_deltas(tokenizer, text)
    assert not any(HERMES_BEGIN in p for p in pieces)  # the tag always arrives split
    r = run(HERMES, pieces)
    assert (r.content, parsed(r)) == ("Sure. ", [("q", TRICKY), WEATHER])


# -- the default model's chat template and the deepseek_v31 parser agree ---------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def chat_prompt(renderer: Renderer, messages: list[dict[str, Any]]) -> str:
    body = msgspec.json.encode({"messages": messages, "tools": TOOLS})
    return apply_template(renderer.tokenizer, ChatDecoder.decode(body))


def test_template_instructions_parse_with_the_deepseek_parser(
    renderer: Renderer, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(renderer, [{"role": "user", "content": "Weather in Paris?"}])
    assert prompt.endswith("<｜Assistant｜></think>")
    assert "### get_weather" in prompt and "### get_time" in prompt
    # The template's own example of the syntax reads as one call named NAME.
    example = prompt[prompt.index(DS_CALLS_BEGIN) : prompt.index(DS_CALLS_END) + len(DS_CALLS_END)]
    r = run(DEEPSEEK, [example])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tools.merge(r.deltas)] == [
        ("NAME", "ARGUMENTS")
    ]
    # An answer written the way the prompt asks parses into the intended calls.
    answer = deepseek_text("", [WEATHER, TIME])
    for chunks in ([answer], token_deltas(tokenizer, answer)):
        assert parsed(run(DEEPSEEK, chunks)) == [WEATHER, TIME]


def test_rendered_assistant_tool_calls_parse_back(renderer: Renderer, tokenizer: Tokenizer) -> None:
    calls = [WEATHER, ("get_time", TRICKY)]
    assistant = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": f"call-{i}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)},
            }
            for i, (n, a) in enumerate(calls)
        ],
    }
    messages = [
        {"role": "user", "content": "Weather and time?"},
        assistant,
        {"role": "tool", "content": "18C", "tool_call_id": "call-0"},
    ]
    prompt = chat_prompt(renderer, messages)
    turn = prompt.split("<｜Assistant｜></think>")[1].split("<｜end▁of▁sentence｜>")[0]
    for chunks in ([turn], token_deltas(tokenizer, turn)):
        r = run(DEEPSEEK, chunks)
        assert (r.content, parsed(r)) == ("Checking.", calls)


@pytest.mark.parametrize(
    ("ctx", "write"), [(DEEPSEEK, deepseek_text), (HERMES, hermes_text)], ids=["deepseek", "hermes"]
)
def test_whitespace_alone_before_calls_is_no_content(ctx: ParseContext, write: Any) -> None:
    """vLLM 0.33's whole answer gives null content where only whitespace precedes the calls
    (issue 36's finding: reasoning, then "\\n\\n", then two parallel hermes calls); text
    before a call, and whitespace without one, stay as written, for every chunking."""
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    for chunks in (
        [write("\n\n", calls)],
        list(write("\n\n", calls)),
        cut(write("\n\n", calls), [3]),
    ):
        r = run(ctx, chunks)
        assert (r.content, parsed(r)) == ("", calls)
    assert run(ctx, list(write("\n\nLet me check. ", calls))).content == "\n\nLet me check. "
    assert run(ctx, list("\n\n  \n")).content == "\n\n  \n"


RAW_ARGS = '{"city":"Par\\u00eds","n":1.50,"l":[ 1E2 ]}'


@pytest.mark.parametrize(
    ("ctx", "text"),
    [
        (HERMES, f'<tool_call>{{"name":"f","arguments":{RAW_ARGS}}}</tool_call>'),
        (REQUIRED, f'[{{"name":"f","parameters":{RAW_ARGS}}}]'),
    ],
    ids=["hermes", "required"],
)  # fmt: skip
def test_json_arguments_come_out_as_vllms_whole_answer_writes_them(
    ctx: ParseContext, text: str
) -> None:
    """vLLM 0.33's whole answer loads a hermes call's arguments (and a "required" call's
    parameters) and dumps them again: spacing, escapes and numbers as Python writes them.
    A stream of the model's raw text gave other arguments than the whole answer."""
    for chunks in ([text], list(text), cut(text, [5, 2])):
        (call,) = tools.merge(run(ctx, chunks).deltas)
        assert call["function"]["arguments"] == '{"city": "París", "n": 1.5, "l": [100.0]}'


LLAMA = ParseContext(tool_choice="auto", tool_parser="llama3_json")


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city":"Paris"}}; {"name": "get_time", '
        '"arguments": {"tz": "CET"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}};\n'
        '{"name": "get_time", "parameters": {"tz":"CET"}}',
    ],
    ids=["bare", "python-tag"],
)
def test_llama_json_calls_are_the_output(text: str) -> None:
    """Llama 3/4 open their output with the calls: each object's name and parameters (or
    arguments), written back as vLLM's whole answer writes them, for every chunking."""
    for chunks in ([text], list(text), cut(text, [4, 9])):
        r = run(LLAMA, chunks)
        assert r.content == ""
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in
                tools.merge(r.deltas)] == [("get_weather", '{"city": "Paris"}'),
                                           ("get_time", '{"tz": "CET"}')]  # fmt: skip


def test_llama_output_that_does_not_open_with_a_call_is_content() -> None:
    text = 'The weather: {"name": "get_weather", "parameters": {}} is a call shape.'
    for chunks in ([text], list(text)):
        r = run(LLAMA, chunks)
        assert (r.content, r.deltas) == (text, [])
    assert run(LLAMA, ["<|pyth"]).content == "<|pyth"
    one = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    single = ParseContext(tool_choice="auto", tool_parser="llama3_json", parallel_tool_calls=False)
    assert [c["function"]["name"] for c in tools.merge(run(single, [one]).deltas)] == ["a"]


PYTHONIC = ParseContext(tool_choice="auto", tool_parser="pythonic")
LLAMA4 = ParseContext(tool_choice="auto", tool_parser="llama4_pythonic")
PY_CALLS = (
    "[get_weather(city='S\\u00e3o Paulo', days=3, hot=True, at=-1.5, tags=('a', \"b\"), "
    "opts={'unit': None, 'hours': [6, 12]}, note='''line\\nnext'''), search(q=\"x \\\"y\\\"\", "
    "raw=r'C:\\dir', n=null)]"
)


def test_pythonic_calls_are_json_objects_of_their_keyword_arguments() -> None:
    """As vLLM reads each argument (Python literals; tuples as lists; JSON's null too),
    dumped as JSON, for every chunking; `<|python_start|>` may open Llama 4's list."""
    expected = [
        ("get_weather", '{"city": "São Paulo", "days": 3, "hot": true, "at": -1.5, '
         '"tags": ["a", "b"], "opts": {"unit": null, "hours": [6, 12]}, "note": "line\\nnext"}'),
        ("search", '{"q": "x \\"y\\"", "raw": "C:\\\\dir", "n": null}'),
    ]  # fmt: skip
    for ctx, text in ((PYTHONIC, PY_CALLS), (LLAMA4, "<|python_start|>" + PY_CALLS)):
        for chunks in ([text], list(text), cut(text, [2, 5, 1])):
            r = run(ctx, chunks)
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for c in tools.merge(r.deltas)]  # fmt: skip
            assert (r.content, calls) == ("", expected), chunks
            for _, args in calls:
                json.loads(args)


def test_pythonic_output_that_is_no_list_is_content() -> None:
    text = "I would call get_weather(city='Paris')."
    assert run(PYTHONIC, list(text)).content == text
    assert run(LLAMA4, ["<|python_"]).content == "<|python_"
    # positional arguments are ignored, as vLLM ignores them; a value that is no literal
    # comes out as its text
    r = run(PYTHONIC, list("[f(1, 'two', x=compute(3), y=[1, 2])]"))
    assert [c["function"]["arguments"] for c in tools.merge(r.deltas)] == [
        '{"x": "compute(3)", "y": [1, 2]}'
    ]


def test_a_pythonic_value_too_long_to_hold_comes_whole_as_its_text() -> None:
    """Past the hold's bound a value streams as a string of its text: nothing of it is lost
    (it was cut at the bound)."""
    numbers = "[" + ", ".join(str(i) for i in range(600)) + "]"
    text = f"[f(x={numbers}, y=2)]"
    for chunks in ([text], cut(text, [7])):
        (call,) = tools.merge(run(PYTHONIC, chunks).deltas)
        assert json.loads(call["function"]["arguments"]) == {"x": numbers, "y": 2}
