"""gpt-oss's prompt as vLLM renders it, through harmony (held to vLLM's render server on the
vLLM tier: tests/vllm/test_gptoss_family.py), and what render refuses for it."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.conftest import make_settings
from tokenway.api import responses
from tokenway.api.openai import ChatCompletionRequest
from tokenway.api.responses import ResponsesRequest
from tokenway.errors import InvalidRequest
from tokenway.parsers import ParserFlags
from tokenway.served import parser_flags, parsers_said, served_models
from workers.render import harmony, structured
from workers.render.core import Renderer
from workers.render.parse import call_tags, parse_context

DAY = datetime.date(2026, 12, 6)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
FUNCTION = {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}
TOOLS = [{"type": "function", "function": FUNCTION}]
HARMONY = ParserFlags("openai_gptoss", "openai", enable_auto_tool_choice=True)


def chat(*messages: dict[str, Any], **fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": list(messages), **fields}
    return msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)


def rendered(req: ChatCompletionRequest) -> str:
    return harmony.encoding().decode(harmony.prompt_ids(req, DAY))


def test_a_tool_loop_renders_as_gpt_oss_was_trained_on_it() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    req = chat(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning": "Need it.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        tools=TOOLS,
        reasoning_effort="high",
    )
    text = rendered(req)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Current date: 2026-12-06\n\nReasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "type get_weather = (_: {\ncity?: string,\n}) => any;" in text
    assert text.endswith(
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|>"
        # the header gpt-oss was trained on, not the one oss-harmony writes
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
        "<|start|>functions.get_weather<|channel|>commentary to=assistant<|message|>sunny<|end|>"
        "<|start|>assistant"
    )


def test_an_answered_turns_reasoning_is_not_shown_again() -> None:
    req = chat(
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."},
        {"role": "user", "content": "Bye"},
    )
    text = rendered(req)
    assert "Greet back." not in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>" in text
    assert "Calls to these tools" not in text and "<|start|>developer" not in text


@pytest.mark.parametrize(
    ("effort", "said"),
    [("none", "Harmony does not support reasoning_effort='none'"),
     ("minimal", "reasoning_effort='minimal' is not supported by Harmony")],
)  # fmt: skip
def test_an_effort_harmony_has_no_word_for_is_the_clients_400(effort: str, said: str) -> None:
    with pytest.raises(InvalidRequest, match=said) as err:
        harmony.prompt_ids(chat({"role": "user", "content": "x"}, reasoning_effort=effort))
    assert err.value.param == "reasoning_effort"


def test_a_part_that_is_not_text_is_refused_not_rendered_as_nothing() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(InvalidRequest, match="image_url"):
        harmony.prompt_ids(chat(image))


def test_a_forced_call_and_an_answers_format_are_held_to_harmonys_channels() -> None:
    """The tag vLLM builds (held to it byte for byte on the tier): a call's header in either
    order after optional analysis and commentary; a format on the final answer."""
    req = chat({"role": "user", "content": "x"}, tools=TOOLS, tool_choice="required")
    tag = json.loads(structured.constraint(req, call_tags(HARMONY), True).structural_tag)
    analysis, commentary, calls = tag["format"]["elements"]
    assert analysis["type"] == commentary["type"] == "optional"
    begins = [t["begin"] for t in calls["elements"]]
    assert " to=functions.get_weather<|channel|>commentary json<|message|>" in begins
    assert "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" in begins
    assert not any("final<|message|>" in b for b in begins)  # no answer instead of a call
    plan = parse_context(req, [], HARMONY, {})
    assert plan is not None and plan.tool_choice == "required"  # read as harmony's calls
    answer = chat({"role": "user", "content": "x"}, response_format={"type": "json_object"})
    tag = json.loads(structured.constraint(answer, call_tags(HARMONY), True).structural_tag)
    finals = [t["begin"] for t in tag["format"]["elements"][-1]["elements"]]
    assert finals == [f"<|channel|>final{c}<|message|>" for c in (" json", " <|constrain|>json")]
    plan = parse_context(chat({"role": "user", "content": "x"}), [], HARMONY, {})
    assert plan is not None and plan.tool_choice == "none"  # channels are read even so


def test_a_tokenizer_that_is_not_gpt_osss_is_refused_at_start(renderer: Renderer) -> None:
    with pytest.raises(ValueError, match="needs gpt-oss's tokenizer"):
        harmony.check_vocabulary(renderer.vocab)


def test_a_gpt_oss_directory_picks_harmonys_parsers_and_refuses_others(
    tmp_path: Path, model_dir: Path
) -> None:
    directory = tmp_path / "gpt-oss"
    shutil.copytree(model_dir, directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    (model,) = served_models(make_settings(tmp_path, model_dir=str(directory)))
    assert parser_flags(make_settings(tmp_path), model) == HARMONY
    assert "reasoning parser openai_gptoss (gpt-oss's" in parsers_said(
        make_settings(tmp_path), model
    )
    with pytest.raises(SystemExit, match="harmony's parsers"):  # one of them with another
        parser_flags(make_settings(tmp_path, tool_call_parser="hermes"), model)
    others = make_settings(tmp_path, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    with pytest.raises(SystemExit, match=r"is gpt-oss .*harmony's, read by"):
        parser_flags(others, model)


def test_a_responses_requests_effort_reaches_the_system_message() -> None:
    """Found holding tokenway's Responses render to vLLM's for gpt-oss: `reasoning.effort`
    set only the template's thinking switch, which harmony does not read."""
    body = {"model": "m", "input": "Hi", "reasoning": {"effort": "high"}}
    req = responses.to_chat(msgspec.json.decode(json.dumps(body).encode(), type=ResponsesRequest))
    assert "Reasoning: high" in rendered(req)
    body["reasoning"] = {"effort": "minimal"}
    req = responses.to_chat(msgspec.json.decode(json.dumps(body).encode(), type=ResponsesRequest))
    with pytest.raises(InvalidRequest) as err:
        harmony.prompt_ids(req)
    assert responses.CHAT_PARAMS[err.value.param or ""] == "reasoning.effort"
