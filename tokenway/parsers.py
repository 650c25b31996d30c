"""The output parsers tokenway knows, named as `vllm serve` names them, and what marks reasoning.

A process's parsing abilities (`ParserFlags`) are chosen when it starts. Render decides from
them and the rendered prompt how a request's output starts (`start_mode`); derender then
parses the output with the same markers (workers/derender/reasoning.py, tools.py); the
simulated engine reads them to end a thinking budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenway.wire import ReasoningStart

REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "deepseek_v3", "qwen3")
TOOL_PARSERS: tuple[str, ...] = (
    "deepseek_v31",
    "glm45",
    "glm47",
    "hermes",
    "minimax_m2",
    "qwen3_coder",
    "qwen3_xml",
)
# vLLM's --tool-strict-level: how much of a forced call a structural tag holds the model to
StrictLevel = Literal["auto", "function", "parameter"]

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ParserFlags:
    """The server's parsing abilities, named as `vllm serve` names them."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM's VLLM_ENFORCE_STRICT_TOOL_CALLING (on by default) and --tool-strict-level
    strict_tool_calling: bool = True
    tool_strict_level: StrictLevel = "auto"

    def check(self) -> None:
        """Refuse unknown parser names at start-up, not on the first request."""
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown --reasoning-parser {self.reasoning_parser!r}; "
                f"known: {', '.join(REASONING_PARSERS)}"
            )
        if self.tool_call_parser and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown --tool-call-parser {self.tool_call_parser!r}; "
                f"known: {', '.join(TOOL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True, slots=True)
class Markers:
    """Where a reasoning parser's reasoning starts and ends in the output text."""

    start: str
    end: str

    @property
    def longest(self) -> int:
        return max(len(self.start), len(self.end))

    def could_begin(self, tail: str) -> bool:
        """Whether `tail` is a proper prefix of a marker (it may complete in the next delta)."""
        return (len(tail) < len(self.start) and self.start.startswith(tail)) or (
            len(tail) < len(self.end) and self.end.startswith(tail)
        )


_THINK = Markers(THINK_START, THINK_END)
# Every parser we know marks reasoning with <think>…</think>.
_MARKERS: dict[str, Markers] = {"deepseek_r1": _THINK, "deepseek_v3": _THINK, "qwen3": _THINK}


def markers_of(parser: str) -> Markers:
    """The reasoning parser's markers; ValueError for a parser we do not know."""
    found = _MARKERS.get(parser)
    if found is None:
        raise ValueError(
            f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}"
        )
    return found


def _thinking(parser: str, kwargs: Mapping[str, object]) -> bool:
    """Whether the request asked this parser to separate reasoning at all."""
    if parser == "deepseek_v3":
        # deepseek_v3_reasoning_parser.py: `thinking` or `enable_thinking` picks the R1 parser,
        # otherwise the identity parser (everything is content).
        return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))
    if parser == "qwen3":
        # parser/qwen3.py (Qwen3Parser): `enable_thinking`, default on; off starts in content
        # and is_reasoning_end is always true, so nothing is ever reasoning.
        return bool(kwargs.get("enable_thinking", True))
    return True  # deepseek_r1 always parses


def start_mode(
    parser: str,
    prompt_token_ids: Sequence[int],
    chat_template_kwargs: Mapping[str, object],
    vocab: Mapping[str, int],
) -> ReasoningStart:
    """How the output starts: "off" (no parsing), "open" (in reasoning) or "closed" (content).

    Decided once, by render, from the rendered prompt. Raises ValueError for an unknown parser,
    or for deepseek parsers whose markers are not single tokens of the vocabulary.
    """
    markers = markers_of(parser)
    if not _thinking(parser, chat_template_kwargs):
        return "off"
    start_id, end_id = vocab.get(markers.start), vocab.get(markers.end)
    if parser != "qwen3" and (start_id is None or end_id is None):
        # basic_parsers.py: a <think>/</think> parser refuses a tokenizer without both tokens
        # (the qwen3 engine matches text, so it goes on and finds no marker in the prompt).
        raise ValueError(
            f"reasoning parser {parser!r} needs {markers.start} and {markers.end} as tokens "
            "of the model's vocabulary"
        )
    # is_reasoning_end(prompt) in basic_parsers.py and parser_engine.py: the prompt's last
    # marker decides; abstract_parser.py parse_delta then skips reasoning parsing altogether.
    # No marker in the prompt: deepseek_r1 takes output without <think> as reasoning until
    # </think> (deepseek_r1_reasoning_parser.py); qwen3 with thinking starts in REASONING.
    last = last_marker(prompt_token_ids, start_id, end_id)
    return "closed" if last is not None and last == end_id else "open"


def last_marker(
    prompt_token_ids: Sequence[int], start_id: int | None, end_id: int | None
) -> int | None:
    """The prompt's last reasoning marker (`start_id` or `end_id`), None without one: whether
    it leaves the output in reasoning, as parsers and a thinking budget read it."""
    markers = {start_id, end_id} - {None}
    return next((t for t in reversed(prompt_token_ids) if t in markers), None)
