"""gpt-oss's prompt, rendered by its own renderer (harmony, from `oss-harmony`) as vLLM 0.33
renders a chat request for a model whose config says `gpt_oss`: no chat template.

The conversation becomes harmony's messages as vLLM makes them: a system message (the
reasoning effort, today's date), a developer message with the first system or developer
message's text as instructions and the function tools, then each message —

- an assistant turn that calls tools: its text on the commentary channel, its reasoning on
  the analysis channel, each call a commentary message to `functions.NAME` of content type
  `json` holding the arguments as sent;
- an assistant turn without calls: its reasoning (analysis), its text (final);
- a tool result: from `functions.NAME` (the name of the call its id answers) to the
  assistant, on the commentary channel;
- a later system or developer message: developer instructions; a user message as it is.

Analysis messages before the last final answer are dropped (a finished turn's reasoning is
not shown to the model again), and earlier calls are written with the header gpt-oss was
trained on (`assistant to=functions.X<|channel|>commentary json`), not the one oss-harmony
0.0.10 started to write.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    SystemContent,
    TextContent,
    ToolDescription,
    load_harmony_encoding,
)

from tokenway.api.openai import ChatCompletionRequest
from tokenway.api.openai import Message as ChatMessage
from tokenway.errors import InvalidRequest

EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
           "high": ReasoningEffort.HIGH}  # fmt: skip
# the formatting tokens a model's vocabulary must hold at harmony's ids
FORMATTING = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
              "<|call|>", "<|return|>")  # fmt: skip


@functools.cache
def encoding() -> HarmonyEncoding:
    """gpt-oss's encoding (o200k and harmony's tokens), loaded once per process."""
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@functools.cache
def _formatting_ids() -> dict[str, int]:
    """Harmony's formatting tokens' ids, read once."""
    enc = encoding()
    return {token: enc.encode(token, allowed_special="all")[0] for token in FORMATTING}


def check_vocabulary(vocab: Mapping[str, int]) -> None:
    """A gpt-oss model directory whose tokenizer gives harmony's tokens other ids would
    get prompts in another vocabulary than its own: refused when the renderer starts."""
    for token, ours in _formatting_ids().items():
        if vocab.get(token) != ours:
            raise ValueError(
                f"the model's tokenizer has {token} at {vocab.get(token)}, harmony at "
                f"{ours}: a gpt_oss model directory needs gpt-oss's tokenizer"
            )


def prompt_ids(req: ChatCompletionRequest, today: datetime.date | None = None) -> list[int]:
    """The prompt's token ids: the request's conversation rendered for the assistant's turn."""
    messages = list(req.messages)
    instructions = None
    if messages and messages[0].role in ("system", "developer"):
        instructions, messages = _text(messages[0]), messages[1:]
    conversation = [*_preamble(req, instructions, today), *_turns(messages)]
    rendered = encoding().render_conversation_for_completion(
        Conversation.from_messages(_without_old_analysis(conversation)),
        Role.ASSISTANT,
        config=RenderConversationConfig(auto_drop_analysis=False),
    )
    return _trained_call_headers(rendered)


def _preamble(
    req: ChatCompletionRequest, instructions: str | None, today: datetime.date | None
) -> list[Message]:
    effort = req.reasoning_effort
    if effort == "none":
        raise InvalidRequest(
            "Harmony does not support reasoning_effort='none'", param="reasoning_effort"
        )
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning_effort={effort!r} is not supported by Harmony. Supported values are: "
            "high, medium, low.",
            param="reasoning_effort",
        )
    system = SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(EFFORTS[effort])
    date = (today or datetime.date.today()).isoformat()
    out = [Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(date))]
    if instructions or req.tools:
        developer = DeveloperContent.new()
        if instructions is not None:
            developer = developer.with_instructions(instructions)
        if req.tools:
            developer = developer.with_function_tools(
                [
                    ToolDescription.new(
                        name=t.function.name,
                        description=t.function.description or "",
                        parameters=t.function.parameters,
                    )
                    for t in req.tools
                ]
            )
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    return out


def _text(msg: ChatMessage) -> str | None:
    """A message's text parts joined as vLLM flattens them (with nothing between)."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    return "".join(p.text for p in _parts(msg)) if msg.content else None


def _turns(messages: Sequence[ChatMessage]) -> list[Message]:
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or () if c.id}
    out: list[Message] = []
    for msg in messages:
        out.extend(_turn(msg, names))
    return out


def _turn(msg: ChatMessage, names: Mapping[str, str]) -> list[Message]:
    reasoning = msg.reasoning if msg.reasoning is not None else msg.reasoning_content
    if msg.role == "assistant" and msg.tool_calls:
        out = []
        if text := _text(msg):
            out.append(_assistant(text, "commentary"))
        if reasoning:
            out.append(_assistant(reasoning, "analysis"))
        for call in msg.tool_calls:
            arguments = call.function.arguments
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            out.append(
                _assistant(text or "", "commentary")
                .with_recipient(f"functions.{call.function.name}")
                .with_content_type("json")
            )
        return out
    if msg.role == "tool":
        name = names.get(msg.tool_call_id or "", "")
        author = Author.new(Role.TOOL, f"functions.{name}")
        result = Message.from_author_and_content(author, _text(msg) or "")
        return [result.with_channel("commentary").with_recipient("assistant")]
    if msg.role == "assistant":
        out = [_assistant(reasoning, "analysis")] if reasoning else []
        parts = _parts(msg)
        if parts[0].text:
            out.append(Message.from_role_and_contents(Role.ASSISTANT, parts).with_channel("final"))
        return out
    if msg.role in ("system", "developer"):
        text = _text(msg)
        if text is None:
            return []
        developer = DeveloperContent.new().with_instructions(text)
        return [Message.from_role_and_content(Role.DEVELOPER, developer)]
    return [Message.from_role_and_contents(Role.USER, _parts(msg))]


def _parts(msg: ChatMessage) -> list[TextContent]:
    """A message's content as harmony's text parts; a part of another kind is the
    request's 400 (vLLM would render it as no text)."""
    if msg.content is None or isinstance(msg.content, str):
        return [TextContent(text=msg.content or "")]
    for part in msg.content:
        if part.type != "text":
            raise InvalidRequest(
                f"content part of type {part.type!r} is not supported; only text parts are",
                param="messages",
            )
    return [TextContent(text=p.text or "") for p in msg.content]


def _assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _without_old_analysis(messages: list[Message]) -> list[Message]:
    """The analysis messages before the last final answer dropped."""
    finals = [
        i
        for i, m in enumerate(messages)
        if m.author.role == Role.ASSISTANT and m.channel == "final"
    ]
    last = max(finals, default=-1)
    return [m for i, m in enumerate(messages) if not (i < last and m.channel == "analysis")]


def _trained_call_headers(ids: list[int]) -> list[int]:
    """Earlier calls' headers as gpt-oss was trained on them: oss-harmony writes
    `<|start|>assistant<|channel|>commentary to=functions.X <|constrain|>json<|message|>`,
    which the model can echo with the recipient twice; vLLM writes them back as
    `<|start|>assistant to=functions.X<|channel|>commentary json<|message|>`."""
    enc, ids_of = encoding(), _formatting_ids()
    start, channel, constrain, message = (
        ids_of[t] for t in ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
    )
    out: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i] != start:
            out.append(ids[i])
            i += 1
            continue
        header = _header_at(ids, i, channel, constrain, message)
        if header is None:
            out.append(ids[i])
            i += 1
            continue
        end, (role, route, kind) = header
        written = route[:-1].split(" to=", 1) if route.endswith(" ") and " to=" in route else []
        if role != "assistant" or len(written) != 2 or not all(written) or not kind:
            out.extend(ids[i : end + 1])
        else:
            name, recipient = written
            out += [start, *enc.encode(f"assistant to={recipient}"), channel,
                    *enc.encode(f"{name} {kind}"), message]  # fmt: skip
        i = end + 1
    return out


def _header_at(
    ids: list[int], at: int, channel: int, constrain: int, message: int
) -> tuple[int, tuple[str, str, str]] | None:
    """The header starting at `at` (its <|message|>'s index; its role, what lies between
    <|channel|> and <|constrain|>, and the content type), when it has both markers."""
    try:
        end = ids.index(message, at + 1)
        chan = ids.index(channel, at + 1, end)
        cons = ids.index(constrain, chan + 1, end)
    except ValueError:
        return None
    enc = encoding()
    parts = (ids[at + 1 : chan], ids[chan + 1 : cons], ids[cons + 1 : end])
    role, route, kind = (enc.decode(p) for p in parts)
    return end, (role, route, kind)
