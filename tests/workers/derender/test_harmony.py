"""gpt-oss's harmony output read as vLLM's harmony parser reads a whole answer, and the same
answer for every chunking (tests/vllm/test_gptoss_family.py holds it to vLLM's own)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.workers.derender.test_parsing import assemble, ctx, run
from tokenway.parsers import ParserFlags
from tokenway.wire import ParseContext
from workers.derender import harmony, tools
from workers.derender.detok import Detokenizer

BOTH = ParseContext(reasoning_parser="openai_gptoss", tool_parser="openai", tool_choice="auto")
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
NEXT = "<|start|>assistant"


def analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}{END}"


def final(text: str) -> str:
    return f"{NEXT}<|channel|>final<|message|>{text}"


def call(name: str, args: str, header: str = "new") -> str:
    if header == "legacy":
        return f"{NEXT} to=functions.{name}<|channel|>commentary json<|message|>{args}{CALL}"
    return (
        f"{NEXT}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}{CALL}"
    )


def read(pieces: list[str], c: ParseContext = BOTH) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls) of an output given in `pieces`."""
    state, thought, content, deltas = harmony.HarmonyState(), [], [], []
    for piece in pieces:
        t, text, more, state = harmony.step(c, state, piece, "chatcmpl-1")
        thought.append(t)
        content.append(text)
        deltas += more
    t, text, more = harmony.finish(c, state, "chatcmpl-1")
    calls = [
        (x["function"]["name"], x["function"]["arguments"]) for x in tools.merge(deltas + more)
    ]
    return "".join([*thought, t]), "".join([*content, text]), calls


ZURICH = '{"city" :"Zürich",  "days":3}'
OUTPUTS = {
    "an answer": (analysis("User wants weather.") + final("Sunny."),
                  ("User wants weather.", "Sunny.", [])),
    "a call, unicode escaped as json.dumps writes it": (
        analysis("Need it.") + call("get_weather", ZURICH),
        ("Need it.", "", [("get_weather", '{"city": "Z\\u00fcrich", "days": 3}')])),
    "a call in the trained header": (
        analysis("x") + call("search", '{"q": 1}', "legacy"), ("x", "", [("search", '{"q": 1}')])),
    "a preamble and two calls": (
        analysis("A") + f"{NEXT}<|channel|>commentary<|message|>Checking.{END}"
        + call("a", "{}") + call("b", '{"k": [1, 2]}'),
        ("A", "Checking.", [("a", "{}"), ("b", '{"k": [1, 2]}')])),
    "messages of a kind joined with a newline, empty ones none": (
        analysis("one") + NEXT + analysis("") + NEXT + analysis("two")
        + final("") + END + final("ok"),
        ("one\ntwo", "ok", [])),
    "cut in a header: given back as written": (
        analysis("Hm.") + f"{NEXT}<|channel|>fin", ("Hm.", "<|start|>assistant<|channel|>fin", [])),
    "cut in a call's arguments: what came": (
        analysis("Hm.") + call("s", '{"q": "Os')[: -len(CALL)], ("Hm.", "", [("s", '{"q": "Os')])),
    "no channel at all: the text": ("Hello there", ("", "Hello there", [])),
    "a call's arguments of another content type, as written": (
        f"<|channel|>commentary to=functions.run code<|message|>print( 1 ){CALL}",
        ("", "", [("run", "print( 1 )")])),
    "text between messages, a built-in tool, another role: no message": (
        analysis("a") + "stray" + f"{NEXT}<|channel|>commentary to=browser.search<|message|>q{END}"
        + f"<|start|>user<|message|>hi{END}"
        + f"{NEXT}<|channel|>commentary to=python code<|message|>1{END}" + final("b"),
        ("a", "b", [])),
    "a header harmony cannot read: its message dropped": (
        f"<|channel|>final a b c<|message|>lost{END}" + final("kept"), ("", "kept", [])),
    "a bare recipient is a function": (
        f"<|channel|>commentary to=lookup<|message|>{{}}{CALL}", ("", "", [("lookup", "{}")])),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_an_output_reads_as_vllms_whole_answer_for_every_chunking(case: str) -> None:
    text, expected = OUTPUTS[case]
    assert read([text]) == expected
    assert read(list(text)) == expected  # a character at a time
    for size in (2, 3, 5, 8):
        assert read([text[i : i + size] for i in range(0, len(text), size)]) == expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(OUTPUTS)), st.lists(st.integers(0, 400), max_size=12))
def test_random_cuts_give_the_whole_answer(case: str, points: list[int]) -> None:
    text, expected = OUTPUTS[case]
    edges = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    assert read([text[a:b] for a, b in itertools.pairwise(edges)]) == expected


def test_without_the_reasoning_parser_analysis_is_dropped_and_without_tools_calls() -> None:
    text = analysis("secret") + call("a", "{}") + final("shown")
    assert read([text], ParseContext(tool_parser="openai", tool_choice="auto")) == (
        "", "shown", [("a", "{}")])  # fmt: skip
    none = ParseContext(reasoning_parser="openai_gptoss", tool_parser="openai", tool_choice="none")
    assert read([text], none) == ("secret", "shown", [])


def test_one_call_when_parallel_calls_are_off() -> None:
    single = ParseContext(reasoning_parser="openai_gptoss", tool_parser="openai",
                          tool_choice="auto", parallel_tool_calls=False)  # fmt: skip
    assert read([call("a", "{}")[len(NEXT) :] + call("b", "{}")], single)[2] == [("a", "{}")]


def test_a_header_that_never_ends_streams_as_content_and_the_state_stays_bounded() -> None:
    """A model ignoring the format: past MAX_HEADER characters without <|message|>, the text
    is content, streamed (harmony would wait for the end; vLLM then gives it back whole)."""
    text = "word " * 400 + "<|message|>more"
    state, shown = harmony.HarmonyState(), ""
    for i in range(0, len(text), 7):
        _, content, _, state = harmony.step(BOTH, state, text[i : i + 7], "r")
        shown += content
        assert len(state.header) <= harmony.MAX_HEADER
    assert shown + harmony.finish(BOTH, state, "r")[1] == text


def test_reasoning_tokens_are_those_of_analysis_and_calls() -> None:
    pieces = ["<|channel|>", "analysis", "<|message|>", "a", "b", END, "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "c"]  # fmt: skip
    assert harmony.count(BOTH, pieces) == 2


def test_the_parsers_go_together_and_a_gpt_oss_model_takes_no_other() -> None:
    ParserFlags("openai_gptoss", "openai", True).check()
    ParserFlags("openai_gptoss").check()
    with pytest.raises(ValueError, match="harmony's parsers"):
        ParserFlags("openai_gptoss", "hermes", True).check()


def test_the_core_streams_harmony_as_a_client_assembles_it(
    tokenizer: Tokenizer, detok: Detokenizer
) -> None:
    """Through the whole derender core (the markers as text in the bundled vocabulary): a
    call's finish says tool_calls, and a whole answer without a final message has no
    content (null)."""
    text = analysis("Need it.") + call("get_weather", '{"city": "Oslo"}')
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")  # the output stopped: its end token
    ids = [*tokenizer.encode(text, add_special_tokens=False).ids, eos]
    docs, _ = run(
        detok, ctx(parse=BOTH, stream=True), [ids[i : i + 3] for i in range(0, len(ids), 3)]
    )
    got = assemble(docs)
    assert (got["content"], got["reasoning"], got["finish"]) == ("", "Need it.", "tool_calls")
    (slot,) = got["calls"].values()
    assert (slot["name"], slot["arguments"]) == ("get_weather", '{"city": "Oslo"}')
    whole_docs, _ = run(detok, ctx(parse=BOTH), [ids])
    message = whole_docs[0]["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] == "Need it."
    assert whole_docs[0]["choices"][0]["finish_reason"] == "tool_calls"
