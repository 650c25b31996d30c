"""The parsers a model directory's own chat template speaks, where vLLM needs flags.

A template that writes earlier tool calls and reasoning back into the prompt spells the
model's call syntax and reasoning markers: those pick the parsers (`--tool-call-parser` and
`--reasoning-parser` override them). A template that spells none picks none.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenway.parsers import REASONING_PARSERS, TOOL_PARSERS

# (what the template spells, the tool parser), first match wins: the more specific first
_TOOLS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<seed:tool_call>",), "seed_oss"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_start|>",), "llama4_pythonic"),
    (("<|python_tag|>",), "llama3_json"),
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("｜DSML｜function_calls",), "deepseek_v32"),
    (("｜DSML｜tool_calls",), "deepseek_v4"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v31"),
    (("<arg_key>", "<tool_call>"), "glm47"),
    (("<function=", "<parameter=", "<tool_call>"), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
)
# (what the template spells, the reasoning parser), first match wins
_REASONING: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<seed:think>",), "seed_oss"),
    (("[THINK]",), "mistral"),
    (("<think>", "<minimax:tool_call>"), "minimax_m2"),
    (("<think>", "<|im_assistant|>"), "kimi_k2"),
    (("<think>", "<arg_key>"), "glm45"),
    (("<think>", "<|im_start|>"), "qwen3"),
    (("<think>", "<｜Assistant｜>"), "deepseek_v3"),
)


def template_text(model_dir: Path) -> str:
    """Every chat template the directory holds, as one text (empty without any)."""
    texts = []
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        texts.append(jinja.read_text(encoding="utf-8", errors="replace"))
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        try:
            found = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str):
            texts.append(found)
        elif isinstance(found, list):  # named templates: [{"name": ..., "template": ...}]
            texts += [t["template"] for t in found if isinstance(t, dict) and "template" in t]
    return "\n".join(t for t in texts if isinstance(t, str))


def _pick(
    text: str, table: tuple[tuple[tuple[str, ...], str], ...], known: tuple[str, ...]
) -> str | None:
    return next(
        (name for needles, name in table if name in known and all(n in text for n in needles)), None
    )


def picked(model_dir: Path) -> tuple[str | None, str | None]:
    """(reasoning parser, tool parser) the directory's template speaks; None for either
    when it spells none tokenway knows."""
    text = template_text(model_dir)
    return _pick(text, _REASONING, REASONING_PARSERS), _pick(text, _TOOLS, TOOL_PARSERS)
