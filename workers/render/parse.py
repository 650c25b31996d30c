"""Where a chat request's parse plan is decided: which reasoning and tool parsing derender runs.

Mirrors `vllm serve`'s flags: `--reasoning-parser`, `--tool-call-parser` and
`--enable-auto-tool-choice` say what the server can parse; the request's `tools`,
`tool_choice`, `parallel_tool_calls`, `include_reasoning` and `chat_template_kwargs` say what
this request wants. The plan travels to derender in `OutputContext.parse`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenway import parsers
from tokenway.api.openai import ChatCompletionRequest, NamedToolChoice, Tool
from tokenway.errors import InvalidRequest
from tokenway.parsers import ParserFlags
from tokenway.tool_params import MARKUP_PARSERS, types_of
from tokenway.wire import ParseContext, StructuredOutputs, ToolParams
from workers.render import tool_tags
from workers.render.structured import ToolTags


def call_tags(flags: ParserFlags) -> ToolTags | None:
    """How tool calls are constrained: in the tool parser's syntax (a structural tag), or
    None for the tools' JSON schema."""
    parser = flags.tool_call_parser
    if parser not in tool_tags.PARSERS or not flags.strict_tool_calling:
        return None
    return ToolTags(parser, tool_tags.default_level(parser, flags.tool_strict_level))


# vLLM 0.33's parsers built on its parser engine have the output decoded with its special
# tokens (a family's markers may be special tokens, skipped otherwise); hermes and kimi_k2
# only where the request may call a tool.
_ENGINE_REASONING = frozenset(
    ("glm45", "glm47", "kimi_k2", "minimax_m2", "mistral", "qwen3", "seed_oss")
)
_ENGINE_TOOLS = MARKUP_PARSERS - {"kimi_k2"}
_WITH_TOOLS = frozenset(("hermes", "kimi_k2"))


def keeps_special_tokens(req: ChatCompletionRequest, flags: ParserFlags) -> bool:
    """Whether this request's output is decoded with special tokens for its parsers.

    vLLM adjusts a request for its parsers when a reasoning parser is set or the request
    may call a tool; each parser's adjustment then decides."""
    calls = bool(req.tools) and req.tool_choice != "none"
    if flags.reasoning_parser in _ENGINE_REASONING:
        return True
    parser = flags.tool_call_parser
    if parser in _ENGINE_TOOLS:
        return calls or flags.reasoning_parser is not None
    return parser in _WITH_TOOLS and calls


def params_of(tools: Sequence[Tool]) -> list[ToolParams]:
    """Each function tool's parameter types, as a markup parser reads its calls."""
    out = []
    for tool in tools:
        params = tool.function.parameters or {}
        props = params.get("properties") if isinstance(params, dict) else None
        types = {k: types_of(v) for k, v in props.items()} if isinstance(props, dict) else {}
        out.append(ToolParams(name=tool.function.name, types=types))
    return out


def check_tool_choice(req: ChatCompletionRequest) -> None:
    """A `tool_choice` the request's `tools` cannot meet is the client's 400, as vLLM 0.33
    refuses it: checked before anything reads the tools for the call it forces."""
    choice = req.tool_choice
    if req.tools is not None and not req.tools:
        raise InvalidRequest("`tools` must not be an empty array", param="tools")
    if choice not in (None, "none") and not req.tools:
        raise InvalidRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not name:
            raise InvalidRequest(
                "tool_choice.function.name must not be empty", param="tool_choice.function.name"
            )
        if not any(t.function.name == name for t in req.tools or ()):
            raise InvalidRequest(
                f"The tool {name!r} in `tool_choice` is not among the request's `tools`",
                param="tool_choice",
            )


def _tool_choice(req: ChatCompletionRequest, flags: ParserFlags) -> ParseContext:
    check_tool_choice(req)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return ParseContext(tool_choice="named", tool_name=name, parallel_tool_calls=parallel)
    if choice == "auto":
        if not (flags.enable_auto_tool_choice and flags.tool_call_parser):
            raise InvalidRequest(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        parser = flags.tool_call_parser
        tools = params_of(req.tools or ()) if parser in MARKUP_PARSERS else []
        return ParseContext(
            tool_choice="auto", tool_parser=parser, parallel_tool_calls=parallel, tools=tools
        )
    return ParseContext(tool_choice=choice, parallel_tool_calls=parallel)


def _read_as_sent(
    plan: ParseContext,
    req: ChatCompletionRequest,
    flags: ParserFlags,
    sent: StructuredOutputs | None,
) -> None:
    """A forced call the engine is held to a structural tag for comes in the tool parser's
    syntax, which that parser reads (whoever built the tag: render, or a render server),
    with the tools' parameter types where its calls are markup, as for "auto"."""
    tagged = sent is not None and sent.structural_tag is not None
    parser = flags.tool_call_parser
    if plan.tool_choice in ("named", "required") and tagged and parser in tool_tags.PARSERS:
        plan.tool_parser, plan.native_calls = parser, True
        if parser in MARKUP_PARSERS:
            plan.tools = params_of(req.tools or ())


def parse_context(
    req: ChatCompletionRequest,
    prompt_ids: Sequence[int],
    flags: ParserFlags,
    vocab: Mapping[str, int],
    sent: StructuredOutputs | None = None,
) -> ParseContext | None:
    """The parse plan, or None when derender has nothing to parse (plain content). `sent`:
    the constraint the engine gets."""
    plan = _tool_choice(req, flags)
    _read_as_sent(plan, req, flags, sent)
    plan.include_reasoning = req.include_reasoning
    if flags.reasoning_parser:
        plan.reasoning_parser = flags.reasoning_parser
        plan.reasoning_start = parsers.start_mode(
            flags.reasoning_parser, prompt_ids, req.chat_template_kwargs or {}, vocab
        )
    if parsers.is_harmony(flags.reasoning_parser, flags.tool_call_parser):
        plan.tool_parser = flags.tool_call_parser  # channels are read whatever the choice
        return plan
    if plan.tool_parser == "mistral" and "[ARGS]" not in vocab:
        plan.calls_listed = True  # vLLM's test of a tokenizer before v11
    if plan.reasoning_start == "off" and plan.tool_choice == "none":
        return None
    return plan
