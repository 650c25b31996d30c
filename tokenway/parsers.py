"""The output parsers tokenway knows, named as `vllm serve` names them, and what marks reasoning.

A process's parsing abilities (`ParserFlags`) are chosen when it starts. Render decides from
them and the rendered prompt how a request's output starts (`start_mode`); derender then
parses the output with the same markers (workers/derender/reasoning.py, tools.py); the
simulated engine reads them to end a thinking budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tokenway.wire import ReasoningStart

TOOL_PARSERS: tuple[str, ...] = (
    "deepseek_v31",
    "deepseek_v32",
    "deepseek_v4",
    "glm45",
    "glm47",
    "hermes",
    "kimi_k2",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "minimax_m2",
    "mistral",
    "openai",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
    "seed_oss",
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
        others = {self.reasoning_parser, self.tool_call_parser} - {None, *HARMONY}
        if is_harmony(self.reasoning_parser, self.tool_call_parser) and others:
            raise ValueError(
                f"harmony's parsers ({', '.join(HARMONY)}) read gpt-oss's channels and go "
                f"with no other parser, not with {others.pop()!r}"
            )


# How a request's chat_template_kwargs switch a parser's reasoning on (vLLM reads them when it
# builds the parser for the request):
#   "always": no switch;
#   "opt_in": `thinking` or `enable_thinking` true, else off (deepseek_v3);
#   "enable_thinking": `enable_thinking`, on unless given and false (Qwen3Parser);
#   "either": `thinking` or `enable_thinking` true when either is given, on when neither is
#   (Glm47MoeParser, KimiK2Parser).
Switch = Literal["always", "opt_in", "enable_thinking", "either"]
# What the rendered prompt says about where the output starts:
#   "last_marker": its last reasoning marker token (is_reasoning_end of the <think> parsers);
#   "this_turn": a closing marker token after its last turn boundary token closes reasoning
#   (ParserEngine.set_prompt_token_ids), when the vocabulary has the boundary tokens;
#   "ignored": nothing, the output starts where the parser starts.
PromptRule = Literal["last_marker", "this_turn", "ignored"]


@dataclass(frozen=True, slots=True)
class ToolCallSpan:
    """Tool-call markup whose closer a parser drops from content unless a call is open."""

    opens: tuple[str, ...]
    closes: str


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One `--reasoning-parser`: where reasoning starts and ends in the output text, how the
    request and its prompt decide where the output starts, and what content still reads."""

    start: str
    end: str
    switch: Switch = "always"
    prompt: PromptRule = "ignored"
    starts_in_reasoning: bool = True  # where output starts when the prompt does not say
    # Markers that end reasoning and stay content, for the tool parser (a tool call's start).
    implicit_ends: tuple[str, ...] = ()
    # Whether content is still parsed (vLLM's parser engine): a later end marker is dropped;
    # otherwise (the <think> parsers) everything after reasoning is content as it is.
    parses_content: bool = False
    reopens: bool = False  # a start marker in content opens reasoning again
    tool_call: ToolCallSpan | None = None
    strips_whitespace: bool = False  # reasoning's trailing whitespace is not reasoning
    turn_boundaries: tuple[str, ...] = ()
    # Tokens the vocabulary must have, or vLLM refuses the model.
    required_tokens: tuple[str, ...] = ()
    off_without_start_token: bool = False  # no start token: the parser parses nothing
    prefix: str = ""  # put before the content, which is all of the output


_THINK = ReasoningFormat(
    THINK_START, THINK_END, prompt="last_marker", required_tokens=(THINK_START, THINK_END)
)
# vLLM's parser engine (parser/glm47_moe.py, kimi_k2.py, minimax_m2.py, mistral.py, seed_oss.py):
# the whole answer is one pass over the output text, with reasoning's trailing whitespace
# stripped (strip_trailing_reasoning_whitespace) but for the Qwen3 grammar's seed_oss.
_GLM = ReasoningFormat(
    THINK_START,
    THINK_END,
    switch="either",
    prompt="this_turn",
    implicit_ends=("<tool_call>",),
    parses_content=True,
    reopens=True,
    strips_whitespace=True,
    turn_boundaries=("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
)
_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": _THINK,
    "deepseek_v3": replace(_THINK, switch="opt_in"),
    # vLLM 0.33's Qwen3 grammar (parser/qwen3.py): it matches text, so it needs no tokens;
    # a call's <tool_call> ends reasoning, a later </think> is dropped, the prompt is read
    # back to the turn's start, reasoning's trailing whitespace stays.
    "qwen3": ReasoningFormat(
        THINK_START,
        THINK_END,
        switch="enable_thinking",
        prompt="this_turn",
        implicit_ends=("<tool_call>",),
        parses_content=True,
        turn_boundaries=("<|im_start|>", "<|im_end|>"),
    ),
    "glm45": _GLM,
    "glm47": _GLM,
    "kimi_k2": ReasoningFormat(
        THINK_START,
        THINK_END,
        switch="either",
        implicit_ends=("<|tool_calls_section_begin|>",),
        parses_content=True,
        strips_whitespace=True,
    ),
    # MiniMax M2 never writes <think>: its output starts in reasoning.
    "minimax_m2": ReasoningFormat(
        THINK_START,
        THINK_END,
        implicit_ends=("<minimax:tool_call>",),
        parses_content=True,
        tool_call=ToolCallSpan(
            opens=("<minimax:tool_call>", "<invoke name="), closes="</minimax:tool_call>"
        ),
        strips_whitespace=True,
    ),
    # The whole output is content, after the <think> the model did not write (owed from
    # the "open" start on).
    "minimax_m2_append_think": ReasoningFormat(THINK_START, THINK_END, prefix=THINK_START),
    # A Hugging Face tokenizer: [THINK] as a token, or no reasoning (vLLM's "text" encoding
    # needs mistral_common's tokenizer). The output starts in content.
    "mistral": ReasoningFormat(
        "[THINK]",
        "[/THINK]",
        starts_in_reasoning=False,
        implicit_ends=("[TOOL_CALLS]",),
        parses_content=True,
        reopens=True,
        strips_whitespace=True,
        required_tokens=("[TOOL_CALLS]",),
        off_without_start_token=True,
    ),
    "seed_oss": ReasoningFormat(
        "<seed:think>",
        "</seed:think>",
        switch="enable_thinking",
        prompt="this_turn",
        implicit_ends=("<seed:tool_call>",),
        parses_content=True,
        turn_boundaries=("<seed:bos>", "<seed:eos>"),
    ),
}
# gpt-oss's harmony format: vLLM names its one parser twice, as the tool parser `openai` and
# the reasoning parser `openai_gptoss`; either reads the output's channels (derender's
# harmony.py), which no marker table describes.
HARMONY_TOOLS = "openai"
HARMONY_REASONING = "openai_gptoss"
HARMONY = (HARMONY_REASONING, HARMONY_TOOLS)
MARKER_REASONING_PARSERS: tuple[str, ...] = tuple(_FORMATS)  # those a ReasoningFormat reads
REASONING_PARSERS: tuple[str, ...] = (*MARKER_REASONING_PARSERS, HARMONY_REASONING)


def is_harmony(reasoning_parser: str | None, tool_parser: str | None) -> bool:
    """Whether output is read as harmony's channels (either of its parsers named)."""
    return reasoning_parser == HARMONY_REASONING or tool_parser == HARMONY_TOOLS


def reasoning_format(parser: str) -> ReasoningFormat:
    """The reasoning parser's format; ValueError for a parser we do not know (or harmony's,
    which has none)."""
    found = _FORMATS.get(parser)
    if found is None:
        raise ValueError(
            f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}"
        )
    return found


def _thinking(switch: Switch, kwargs: Mapping[str, object]) -> bool:
    """Whether the request asked the parser to separate reasoning at all."""
    if switch == "opt_in":
        return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))
    if switch == "enable_thinking":
        # off starts in content and is_reasoning_end is always true: nothing is reasoning
        return bool(kwargs.get("enable_thinking", True))
    if switch == "either":
        thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
        return (thinking is None and enable is None) or bool(thinking) or bool(enable)
    return True


def start_mode(
    parser: str,
    prompt_token_ids: Sequence[int],
    chat_template_kwargs: Mapping[str, object],
    vocab: Mapping[str, int],
) -> ReasoningStart:
    """How the output starts: "off" (no parsing), "open" (in reasoning) or "closed" (content).

    Decided once, by render, from the rendered prompt, as vLLM's whole (non-streaming) answer
    decides it. Raises ValueError for an unknown parser, or for a model whose vocabulary
    lacks the tokens the parser needs. Harmony's output is read by its channels: "off" for
    the marker parsers.
    """
    if parser == HARMONY_REASONING:
        return "off"
    fmt = reasoning_format(parser)
    if not _thinking(fmt.switch, chat_template_kwargs):
        return "off"
    if any(t not in vocab for t in fmt.required_tokens):
        # basic_parsers.py: a <think>/</think> parser refuses a tokenizer without both
        # tokens; MistralParser one without [TOOL_CALLS].
        tokens = " and ".join(fmt.required_tokens)
        some = "tokens" if len(fmt.required_tokens) > 1 else "a token"
        raise ValueError(
            f"reasoning parser {parser!r} needs {tokens} as {some} of the model's vocabulary"
        )
    if fmt.off_without_start_token and fmt.start not in vocab:
        return "off"
    if fmt.prompt == "last_marker":
        # is_reasoning_end(prompt) in basic_parsers.py and parser/qwen3.py: the prompt's last
        # marker decides; abstract_parser.py parse_delta then skips reasoning parsing
        # altogether. No marker: deepseek_r1 takes output without <think> as reasoning
        # until </think> (deepseek_r1_reasoning_parser.py); qwen3 starts in REASONING.
        end = vocab.get(fmt.end)
        last = last_marker(prompt_token_ids, vocab.get(fmt.start), end)
        return "closed" if last is not None and last == end else "open"
    if fmt.prompt == "this_turn" and _closed_this_turn(fmt, prompt_token_ids, vocab):
        return "closed"
    return "open" if fmt.starts_in_reasoning else "closed"


def prompt_ends_reasoning(
    parser: str,
    prompt_token_ids: Sequence[int],
    chat_template_kwargs: Mapping[str, object],
    vocab: Mapping[str, int],
) -> bool:
    """Whether the engine's constraint applies from the first output token, as vLLM's
    `is_reasoning_end(prompt)` tells it (its structured-output gate, not its parse).

    The <think> parsers read the prompt's last marker, as `start_mode`. vLLM's parser
    engine reads back to the turn's start: an end token (or a call's start that is a
    token) says reasoning ended, a start token that it is open; none, that the engine
    still waits for reasoning, which is not the start the engine's whole answer takes for
    Kimi, MiniMax and Mistral. Harmony's always says so (its structural tag holds the
    channels)."""
    if parser == HARMONY_REASONING:
        return True
    mode = start_mode(parser, prompt_token_ids, chat_template_kwargs, vocab)
    fmt = reasoning_format(parser)
    if mode == "off" or not fmt.parses_content:
        return mode != "open"
    return _ended_this_turn(fmt, prompt_token_ids, vocab)


def _closed_this_turn(
    fmt: ReasoningFormat, prompt_token_ids: Sequence[int], vocab: Mapping[str, int]
) -> bool:
    """Whether the prompt's turn closed reasoning already (continue_final_message, a template
    that closes an empty block), as the whole answer reads it: without boundary tokens vLLM
    cannot tell this turn from an earlier one and does not look."""
    if not any(t in vocab for t in fmt.turn_boundaries):
        return False
    return _ended_this_turn(fmt, prompt_token_ids, vocab)


def _ended_this_turn(
    fmt: ReasoningFormat, prompt_token_ids: Sequence[int], vocab: Mapping[str, int]
) -> bool:
    """An end token (the end marker's and, with it, the implicit ends' that are tokens)
    after the turn's last start token, reading back to the turn's start."""
    end = vocab.get(fmt.end)
    if end is None:
        return False
    ends = {end, *(vocab[t] for t in fmt.implicit_ends if t in vocab)}
    start = vocab.get(fmt.start)
    boundaries = {vocab[t] for t in fmt.turn_boundaries if t in vocab}
    for token in reversed(prompt_token_ids):
        if token in ends:
            return True
        if token == start or token in boundaries:
            return False
    return False


def last_marker(
    prompt_token_ids: Sequence[int], start_id: int | None, end_id: int | None
) -> int | None:
    """The prompt's last reasoning marker (`start_id` or `end_id`), None without one: whether
    it leaves the output in reasoning, as parsers and a thinking budget read it."""
    markers = {start_id, end_id} - {None}
    return next((t for t in reversed(prompt_token_ids) if t in markers), None)
