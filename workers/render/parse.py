"""Where a chat request's parse plan is decided: which reasoning and tool parsing derender runs.

Mirrors `vllm serve`'s flags: `--reasoning-parser`, `--tool-call-parser` and
`--enable-auto-tool-choice` say what the server can parse; the request's `tools`,
`tool_choice`, `parallel_tool_calls`, `include_reasoning` and `chat_template_kwargs` say what
this request wants. The plan travels to derender in `OutputContext.parse`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenway.errors import InvalidRequest
from tokenway.protocol import ChatCompletionRequest, NamedToolChoice
from tokenway.wire import ParseContext
from workers.derender import reasoning, tools


@dataclass(frozen=True)
class ParserFlags:
    """The server's parsing abilities, named as `vllm serve` names them."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def check(self) -> None:
        """Refuse unknown parser names at start-up, not on the first request."""
        if self.reasoning_parser and self.reasoning_parser not in reasoning.PARSERS:
            raise ValueError(
                f"unknown --reasoning-parser {self.reasoning_parser!r}; "
                f"known: {', '.join(reasoning.PARSERS)}"
            )
        if self.tool_call_parser and self.tool_call_parser not in tools.PARSERS:
            raise ValueError(
                f"unknown --tool-call-parser {self.tool_call_parser!r}; "
                f"known: {', '.join(tools.PARSERS)}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def _tool_choice(req: ChatCompletionRequest, flags: ParserFlags) -> ParseContext:
    choice = req.tool_choice
    if req.tools is not None and not req.tools:
        raise InvalidRequest("`tools` must not be an empty array", param="tools")
    if choice is None:
        choice = "auto" if req.tools else "none"
    if choice != "none" and not req.tools:
        raise InvalidRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not any(t.function.name == name for t in req.tools or ()):
            raise InvalidRequest(
                f"The tool {name!r} in `tool_choice` is not among the request's `tools`",
                param="tool_choice",
            )
        return ParseContext(tool_choice="named", tool_name=name, parallel_tool_calls=parallel)
    if choice == "auto":
        if not (flags.enable_auto_tool_choice and flags.tool_call_parser):
            raise InvalidRequest(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        return ParseContext(
            tool_choice="auto", tool_parser=flags.tool_call_parser, parallel_tool_calls=parallel
        )
    return ParseContext(tool_choice=choice, parallel_tool_calls=parallel)


def parse_context(
    req: ChatCompletionRequest,
    prompt_ids: Sequence[int],
    flags: ParserFlags,
    vocab: Mapping[str, int],
) -> ParseContext | None:
    """The parse plan, or None when derender has nothing to parse (plain content)."""
    plan = _tool_choice(req, flags)
    plan.include_reasoning = req.include_reasoning
    if flags.reasoning_parser:
        plan.reasoning_parser = flags.reasoning_parser
        plan.reasoning_start = reasoning.start_mode(
            flags.reasoning_parser, prompt_ids, req.chat_template_kwargs or {}, vocab
        )
    if plan.reasoning_start == "off" and plan.tool_choice == "none":
        return None
    return plan
