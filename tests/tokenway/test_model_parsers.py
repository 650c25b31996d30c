"""A model directory's chat template picks its parsers where vLLM needs flags; flags given
override it, and start-up says which were chosen and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import make_settings
from tokenway.model import default_model_dir
from tokenway.model_parsers import picked, template_text
from tokenway.parsers import REASONING_PARSERS, ParserFlags
from tokenway.served import parser_flags, parsers_said, served_models

# Fragments of what each family's own template writes back for earlier turns (not whole
# templates: the markers are what picks).
QWEN3_CODER = (
    "<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n<tool_call>\n<function="
    "{{ name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>\n</tool_call>"
)
QWEN3 = '<|im_start|>assistant\n<think>\n</think>\n<tool_call>\n{"name": "{{ name }}"}'
KIMI = "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
GLM = "[gMASK]<sop><|assistant|><think></think><tool_call>{{ name }}<arg_key>k</arg_key>"
MINIMAX = "]~b]ai\n<think>\n</think>\n<minimax:tool_call>\n<invoke name="
DSML_V4 = "<｜Assistant｜><think></think><｜DSML｜tool_calls>"
MISTRAL = "[INST]{{ m }}[/INST][THINK]{{ r }}[/THINK][TOOL_CALLS]{{ name }}[ARGS]{{ args }}"
SEED = "<seed:bos>assistant\n<seed:think>{{ r }}</seed:think><seed:tool_call>\n<function="
LLAMA4 = "<|header_start|>assistant<|header_end|>\n\n<|python_start|>[{{ name }}()]"


def model_dir(tmp_path: Path, template: str, how: str = "config") -> Path:
    """The bundled tokenizer with another chat template, stored as `how` says."""
    bundled = default_model_dir(tmp_path / "data")
    target = tmp_path / "model"
    target.mkdir()
    for f in bundled.iterdir():
        if f.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (target / f.name).write_bytes(f.read_bytes())
    config = json.loads((bundled / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if how == "config":
        config["chat_template"] = template
    elif how == "named":
        config["chat_template"] = [{"name": "default", "template": "x"},
                                   {"name": "tool_use", "template": template}]  # fmt: skip
    else:
        (target / "chat_template.jinja").write_text(template)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN3_CODER, ("qwen3", "qwen3_coder")),
        (QWEN3, ("qwen3", "hermes")),
        (KIMI, ("kimi_k2", "kimi_k2")),
        (MINIMAX, ("minimax_m2", "minimax_m2")),
        (DSML_V4, ("deepseek_v3", "deepseek_v4")),
        (MISTRAL, ("mistral", "mistral")),
        (SEED, ("seed_oss", "seed_oss")),
        (LLAMA4, (None, "llama4_pythonic")),
        ("{{ messages[0].content }}", (None, None)),
    ],
)
def test_a_template_picks_the_parsers_it_speaks(
    tmp_path: Path, template: str, expected: tuple[str | None, str | None]
) -> None:
    # a reasoning parser is picked only once tokenway has it
    reasoning = expected[0] if expected[0] in REASONING_PARSERS else None
    assert picked(model_dir(tmp_path, template)) == (reasoning, expected[1])


@pytest.mark.parametrize("how", ["config", "named", "file"])
def test_the_template_is_read_wherever_the_directory_keeps_it(tmp_path: Path, how: str) -> None:
    directory = model_dir(tmp_path, GLM, how)
    assert "<arg_key>" in template_text(directory)
    assert picked(directory)[1] == "glm47"


def test_flags_override_the_template_and_start_up_says_which_were_chosen(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, QWEN3_CODER)
    (model,) = served_models(make_settings(tmp_path, model_dir=str(directory)))
    flags = parser_flags(make_settings(tmp_path), model)
    assert flags == ParserFlags("qwen3", "qwen3_coder", enable_auto_tool_choice=True)
    said = parsers_said(make_settings(tmp_path), model)
    assert "tool-call parser qwen3_coder (its chat template's)" in said
    assert "reasoning parser qwen3 (its chat template's)" in said and "override" in said
    given = make_settings(tmp_path, tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                          enable_auto_tool_choice=False)  # fmt: skip
    assert parser_flags(given, model) == ParserFlags("deepseek_r1", "hermes")
    assert "tool-call parser hermes (as given)" in parsers_said(given, model)
    plain = model_dir(tmp_path / "plain", "{{ messages[0].content }}")
    (bare,) = served_models(make_settings(tmp_path, model_dir=str(plain)))
    assert parser_flags(make_settings(tmp_path), bare) == ParserFlags()
    assert "no reasoning parser, no tool-call parser" in parsers_said(make_settings(tmp_path), bare)
