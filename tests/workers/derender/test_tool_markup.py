"""Markup tool parsers (Qwen3-Coder, MiniMax-M2, GLM-4.5/4.7): the message they make, and
the same message for every chunking of the output."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.workers.derender.test_parsing import assemble
from tests.workers.derender.test_parsing import ctx as chat_context
from tests.workers.derender.test_parsing import run as derender_run
from tokenway.api.openai import ChatCompletionRequest, FunctionDef, Message, Tool
from tokenway.parsers import TOOL_PARSERS, ParserFlags
from tokenway.tool_params import MARKUP_PARSERS, coerce, types_of
from tokenway.wire import ParseContext, ToolParams
from workers.derender import tool_markup, tools
from workers.derender.detok import Detokenizer
from workers.render.parse import parse_context

WEATHER = ToolParams(
    name="get_weather",
    types={"city": ["string"], "days": ["integer"], "opts": ["object"], "hot": ["boolean"]},
)
SEARCH = ToolParams(name="search", types={"query": ["string"]})


def ctx(parser: str, parallel: bool = True) -> ParseContext:
    return ParseContext(
        tool_choice="auto",
        tool_parser=parser,
        parallel_tool_calls=parallel,
        tools=[WEATHER, SEARCH],
    )


def run(c: ParseContext, pieces: list[str]) -> tuple[str | None, list[dict]]:
    state = tools.start(c)
    content, deltas = [], []
    for piece in pieces:
        text, more, state = tools.step(c, state, piece, "chatcmpl-1")
        content.append(text)
        deltas += more
    text, more = tools.finish(c, state, "chatcmpl-1")
    content.append(text)
    calls = [
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
        for call in tools.merge(deltas + more)
    ]
    return "".join(content) or None, calls


def qwen_call(name: str, **args: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def minimax_call(name: str, **args: str) -> str:
    params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args.items())
    return f'<invoke name="{name}">\n{params}</invoke>\n'


def glm_call(name: str, **args: str) -> str:
    params = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()
    )
    return f"<tool_call>{name}\n{params}</tool_call>"


def kimi_call(name: str, index: int, args: str) -> str:
    head = f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
    return f"{head}{args}<|tool_call_end|>"


def dsml_call(name: str, **args: tuple[str, bool]) -> str:
    params = "".join(
        f'<｜DSML｜parameter name="{k}" string="{str(is_str).lower()}">{v}</｜DSML｜parameter>\n'
        for k, (v, is_str) in args.items()
    )
    return f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>\n'


DSML_TWO = dsml_call(
    "get_weather", city=("San Francisco", True), days=("3", False), opts=('{"unit": "c"}', False)
) + dsml_call("search", query=('東京 "tower"\n\nhistory', True))

CASES = {
    "qwen3_coder": "I will look.\n\n"
    + qwen_call("get_weather", city="San Francisco", days="3", opts='{"unit": "c"}')
    + "\n"
    + qwen_call("search", query='東京 "tower"\n\nhistory'),
    "minimax_m2": "I will look.\n<minimax:tool_call>\n"
    + minimax_call("get_weather", city="San Francisco", days="3", opts='{"unit": "c"}')
    + minimax_call("search", query='東京 "tower"\n\nhistory')
    + "</minimax:tool_call>",
    "deepseek_v32": "I will look.<｜DSML｜function_calls>\n"
    + DSML_TWO
    + "</｜DSML｜function_calls>",
    "deepseek_v4": "I will look.<｜DSML｜tool_calls>\n" + DSML_TWO + "</｜DSML｜tool_calls>",
    "glm47": "I will look.\n"
    + glm_call("get_weather", city="San Francisco", days="3", opts='{"unit": "c"}')
    + glm_call("search", query='東京 "tower"\n\nhistory'),
}
KIMI = (
    "I will look.<|tool_calls_section_begin|>"
    + kimi_call("get_weather", 0, ' {"city": "San Francisco", "days": 3, "opts": {"unit": "c"}}\n')
    + kimi_call("search", 1, json.dumps({"query": '東京 "tower"\n\nhistory'}, ensure_ascii=False))
    + "<|tool_calls_section_end|>"
)
EXPECTED_CALLS = [
    {
        "name": "get_weather",
        "arguments": '{"city": "San Francisco", "days": 3, "opts": {"unit": "c"}}',
    },
    {"name": "search", "arguments": '{"query": "東京 \\"tower\\"\\n\\nhistory"}'},
]


def test_every_markup_family_is_a_tool_parser_the_flags_take() -> None:
    assert set(tool_markup.FAMILIES) == MARKUP_PARSERS
    assert MARKUP_PARSERS <= set(TOOL_PARSERS)


@pytest.mark.parametrize("parser", sorted(CASES))
def test_text_then_two_calls_gives_content_and_typed_arguments(parser: str) -> None:
    # vLLM 0.33's whole answer: content before the call, stripped; values as the schema types
    # them (an integer, an object); strings escaped as JSON
    assert run(ctx(parser), [CASES[parser]]) == ("I will look.", EXPECTED_CALLS)
    for call in EXPECTED_CALLS:
        json.loads(call["arguments"])


def test_kimi_calls_are_json_as_written_and_keep_the_models_ids() -> None:
    c = ctx("kimi_k2")
    assert run(c, [KIMI]) == ("I will look.", EXPECTED_CALLS)
    state = tools.start(c)
    _, deltas, _ = tools.step(c, state, KIMI, "chatcmpl-1")
    # Kimi's templates write a call's id back into the prompt: the model's own is kept
    assert [d.id for d in deltas if d.id] == ["functions.get_weather:0", "functions.search:1"]


def test_kimi_keeps_content_as_written_before_calls_and_drops_what_follows() -> None:
    text = "Checking. \n<|tool_calls_section_begin|>" + kimi_call("search", 0, '{"query": "x"}')
    text += "<|tool_calls_section_end|>trailing"
    assert run(ctx("kimi_k2"), [text]) == (
        "Checking. \n",
        [{"name": "search", "arguments": '{"query": "x"}'}],
    )
    # a header without `:N` names no call
    bad = "<|tool_calls_section_begin|><|tool_call_begin|>search<|tool_call_argument_begin|>{}"
    assert run(ctx("kimi_k2"), [bad + "<|tool_call_end|>"]) == (None, [])


def test_dsml_values_are_typed_by_their_string_attribute_then_the_schema() -> None:
    # not marked a string: read as JSON (a number, an object), else kept as text; marked a
    # string but the schema says integer: converted; an unknown attribute is no parameter
    text = dsml_call("get_weather", city=("5", False), days=("7", True), opts=("not json", False))
    assert run(ctx("deepseek_v4"), [text])[1] == [
        {"name": "get_weather", "arguments": '{"city": "5", "days": 7, "opts": "not json"}'}
    ]
    odd = (
        '<｜DSML｜invoke name="search"><｜DSML｜parameter name="query" lang="en">x'
        "</｜DSML｜parameter></｜DSML｜invoke>"
    )
    assert run(ctx("deepseek_v32"), [odd])[1] == [{"name": "search", "arguments": "{}"}]


@pytest.mark.parametrize("parser", sorted(CASES))
def test_one_call_when_parallel_calls_are_off(parser: str) -> None:
    assert run(ctx(parser, parallel=False), [CASES[parser]]) == (
        "I will look.",
        EXPECTED_CALLS[:1],
    )


def test_whitespace_alone_before_a_call_is_no_content() -> None:
    # the issue's finding: reasoning then calls left "\n\n" where vLLM's whole answer has null
    text = "\n\n" + qwen_call("search", query="x")
    assert run(ctx("qwen3_coder"), [text]) == (
        None,
        [{"name": "search", "arguments": '{"query": "x"}'}],
    )


def test_text_without_a_call_keeps_its_whitespace() -> None:
    assert run(ctx("qwen3_coder"), ["\n\nNo tools needed.\n"]) == ("\n\nNo tools needed.\n", [])


def test_markers_that_mean_nothing_where_they_stand_are_text() -> None:
    text = "a > b and </function> and <parameter=x> stay."
    assert run(ctx("qwen3_coder"), [text]) == (text, [])


def test_a_call_to_a_tool_the_request_lacks_is_dropped_where_the_family_checks() -> None:
    unknown = minimax_call("rm_rf", path="/")
    text = f"<minimax:tool_call>{unknown}{minimax_call('search', query='x')}</minimax:tool_call>"
    assert run(ctx("minimax_m2"), [text]) == (
        None,
        [{"name": "search", "arguments": '{"query": "x"}'}],
    )
    # Qwen's parser takes any name (vLLM does not check it there)
    assert run(ctx("qwen3_coder"), [qwen_call("rm_rf", path="/")])[1] == [
        {"name": "rm_rf", "arguments": '{"path": "/"}'}
    ]


def test_a_call_without_arguments_has_an_empty_object() -> None:
    assert run(ctx("glm47"), ["<tool_call>search</tool_call>"]) == (
        None,
        [{"name": "search", "arguments": "{}"}],
    )


def test_a_value_without_its_closing_tag_ends_at_the_next_key() -> None:
    text = (
        "<tool_call><function=get_weather><parameter=city>Oslo"
        "<parameter=days>2</parameter></function></tool_call>"
    )
    assert run(ctx("qwen3_coder"), [text])[1] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    ]


def test_a_call_cut_by_max_tokens_is_closed_with_what_came() -> None:
    # decided: the call is reported with its arguments so far, closed as JSON (a stream
    # cannot take back what it sent; finish_reason "length" says it was cut)
    text = "<tool_call>\n<function=search>\n<parameter=query>\nweather in Os"
    assert run(ctx("qwen3_coder"), [text])[1] == [
        {"name": "search", "arguments": '{"query": "weather in Os"}'}
    ]


def test_a_value_that_is_not_its_type_stays_text() -> None:
    text = glm_call("get_weather", days="three", hot="1")
    assert run(ctx("glm47"), [text])[1] == [
        {"name": "get_weather", "arguments": '{"days": "three", "hot": true}'}
    ]


def test_a_typed_value_too_long_to_hold_streams_as_a_string() -> None:
    big = "[" + ",".join(["1"] * 3000) + "]"
    c = ctx("qwen3_coder")
    _, _, state = tools.step(c, tools.start(c), qwen_call("get_weather", opts=big[:-1]), "c")
    assert state.markup is not None and len(state.markup.value) <= tool_markup.MAX_TYPED
    assert run(c, [qwen_call("get_weather", opts=big)])[1] == [
        {"name": "get_weather", "arguments": json.dumps({"opts": big}, ensure_ascii=False)}
    ]


def test_schema_types_as_vllm_reads_them() -> None:
    assert sorted(types_of({"enum": ["a", 1, None, True]})) == [
        "boolean",
        "integer",
        "null",
        "string",
    ]
    assert types_of({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == ["integer", "null"]
    assert types_of({}) == ["string"]
    assert coerce("null", ["integer", "null"]) is None
    assert coerce("5.0", ["number"]) == 5 and coerce("2.5", ["float"]) == 2.5
    assert coerce("1e999", ["number"]) == "1e999"  # not finite: kept as text
    assert coerce("[1]", ["string", "array"]) == [1]


# -- every chunking gives the same message ---------------------------------------------------

ALL_CASES = [(p, CASES[p]) for p in CASES] + [
    ("qwen3_coder", "Sure." + qwen_call("get_weather", city="\n", days="x<y", hot="false")),
    ("qwen3_coder", "<function=search><parameter=query>a</para</parameter></function>tail"),
    (
        "minimax_m2",
        "<minimax:tool_call><invoke name='search'><parameter name=query>q</parameter></invoke>",
    ),
    (
        "glm45",
        "<tool_call> search \n<arg_key> query </arg_key>  <arg_value>v</arg_value></tool_call>",
    ),
    ("glm47", "Text only, with <arg_key> and </tool_call> in it."),
    ("kimi_k2", KIMI),
    ("mistral", "Look. [TOOL_CALLS]search[ARGS]{ \"query\" : \"a\\u00e9\" }[TOOL_CALLS]x{}"),
    ("seed_oss", "<seed:tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n"
     "</function>\n</seed:tool_call>"),
    ("kimi_k2", "  \n<|tool_calls_section_begin|>" + kimi_call("search", 0, '{"q": "}"}  ')),
    ("deepseek_v4", "<｜DSML｜tool>" + dsml_call("search", query=('a"b', False))),
    # the JSON parsers (tools.py) hold the same property
    ("hermes", '\n\n<tool_call>\n{"name":"search","arguments":{"query":"\\u00e9 1.50","n":1.50}}\n'
     '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
    ("deepseek_v31", "Look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
     '{"query": "x"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("pythonic", "[search(query='a\\'b\\x41\\u00e9', n=-2, l=[1, (2, 3)]), "
     'get_weather(city="""x""")]'),
    ("llama4_pythonic", "<|python_start|>[search(query=r'\\d+', q2=f'hi', "
     "m={'a': {1, 2}})]<|python_end|>"),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"query":"a;b"}}; '
     '{"name": "get_weather", "arguments": {"days": 2e1}}'),
]  # fmt: skip


def cut(text: str, points: list[int]) -> list[str]:
    edges = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize(("parser", "text"), ALL_CASES)
def test_one_character_at_a_time_equals_the_whole(parser: str, text: str) -> None:
    assert run(ctx(parser), list(text)) == run(ctx(parser), [text])


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(ALL_CASES), points=st.lists(st.integers(min_value=0), max_size=40))
def test_any_cut_equals_the_whole(case: tuple[str, str], points: list[int]) -> None:
    parser, text = case
    assert run(ctx(parser), cut(text, points)) == run(ctx(parser), [text])


def mistral_call(name: str, args: str, sep: str = "[ARGS]") -> str:
    return f"[TOOL_CALLS]{name}{sep}{args}"


def test_mistral_calls_one_marker_each_arguments_as_written() -> None:
    """`[TOOL_CALLS]NAME[ARGS]{...}` (or NAME{...}) per call, no closing marker; arguments
    as the model wrote them, up to the end of their first JSON value (vLLM's whole answer
    drops text after it); ids of nine letters and digits (Mistral's templates refuse others
    in a later turn)."""
    text = "I will look.\n" + mistral_call("get_weather", ' {"city":"San Francisco","days":3} ok')
    text += mistral_call("search", '{"query": "東京 }"}', sep="")
    c = ctx("mistral")
    assert run(c, [text]) == ("I will look.", [
        {"name": "get_weather", "arguments": '{"city":"San Francisco","days":3}'},
        {"name": "search", "arguments": '{"query": "東京 }"}'},
    ])  # fmt: skip
    _, deltas, _ = tools.step(c, tools.start(c), text, "chatcmpl-1")
    ids = [d.id for d in deltas if d.id]
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert ids[0] != ids[1]


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
def test_a_long_held_value_of_wide_characters_keeps_the_state_within_its_bound(
    detok: Detokenizer, tokenizer: Tokenizer, parser: str
) -> None:
    """A value held for conversion (an object-typed parameter; a pythonic list) of CJK text,
    three bytes a character: the stream's state must stay within what a chunk may carry
    (stream_state's 12 KiB), or the next chunk is refused and the request fails midway
    (4,076 such characters did). Past the hold's bound the value streams as a string."""
    body = json.dumps({"note": "東" * 4076}, ensure_ascii=False)
    if parser == "pythonic":
        text = f"[get_weather(opts={body})]"
    else:
        text = qwen_call("get_weather", opts=body)
    context = chat_context(stream=True, parse=ctx(parser))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    docs, _ = derender_run(detok, context, [ids[i : i + 16] for i in range(0, len(ids), 16)])
    (call,) = assemble(docs)["calls"].values()
    value = json.loads(call["arguments"])["opts"]
    assert value == body or value == json.loads(body)  # past the bound: its text


MISTRAL_LISTED = ParseContext(tool_choice="auto", tool_parser="mistral", calls_listed=True)
LISTED = {
    "text, then a list of two calls, then text dropped": (
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city":  "Zürich"}}, '
        '{"name": "search", "arguments": {"query": [1,2]}}] done',
        ("Checking. ", [("get_weather", '{"city": "Zürich"}'),
                        ("search", '{"query": [1, 2]}')])),
    "one call object, whitespace alone before it": (
        '\n [TOOL_CALLS] {"name": "search", "arguments": {}} {"name": "not read"}',
        (None, [("search", "{}")])),
    "items that are no calls skipped, a call without arguments": (
        '[TOOL_CALLS][{"name": "a"}, "junk", 3, {"name": "b", "arguments": {"x": null}}]',
        (None, [("a", "{}"), ("b", '{"x": null}')])),
    "brackets in text without the marker": ("[1, 2] and {x}", ("[1, 2] and {x}", [])),
}  # fmt: skip


def _listed(case: str) -> tuple[str, tuple[str | None, list[dict]]]:
    text, (content, calls) = LISTED[case]
    return text, (content, [{"name": n, "arguments": a} for n, a in calls])


@pytest.mark.parametrize("case", sorted(LISTED))
def test_mistral_calls_before_v11_are_a_json_list(case: str) -> None:
    """A vocabulary without [ARGS] (Mistral Small 3.x): vLLM's legacy extraction, held to
    vLLM's own on the tier (tests/vllm/test_tool_families.py)."""
    text, expected = _listed(case)
    assert run(MISTRAL_LISTED, [text]) == expected
    assert run(MISTRAL_LISTED, list(text)) == expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(LISTED)), st.lists(st.integers(0, 300), max_size=10))
def test_mistral_lists_read_the_same_at_any_cut(case: str, points: list[int]) -> None:
    text, expected = _listed(case)
    edges = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    assert run(MISTRAL_LISTED, [text[a:b] for a, b in itertools.pairwise(edges)]) == expected


def test_render_reads_a_vocabulary_without_args_as_mistral_before_v11() -> None:
    req = ChatCompletionRequest(model="m", messages=[Message(role="user", content="x")],
                                tools=[Tool(function=FunctionDef(name="f"))])  # fmt: skip
    flags = ParserFlags(None, "mistral", True)
    before = parse_context(req, [], flags, {"[TOOL_CALLS]": 5})
    after = parse_context(req, [], flags, {"[TOOL_CALLS]": 5, "[ARGS]": 6})
    assert before is not None and before.calls_listed
    assert after is not None and not after.calls_listed
