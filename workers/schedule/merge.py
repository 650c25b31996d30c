"""Multi-prompt output, merged: one sub-stream per prompt in, one request's output out.

Pure: the fan-out shell feeds it what each prompt's sub-request committed (in order, per
prompt) and asks what the request commits next. Sub-streams already carry their global
choice indexes (derender numbers them from `index_base`), so chunk bytes pass through
untouched; the merge decides *when* they go out and how the output closes:
- nothing goes out before every prompt's stream has begun (its first event arrived): until
  then a failing prompt can still be retried as a whole request, nothing having been shown;
- streaming: whatever arrived goes out as one coalesced chunk; the last prompt's end closes
  the stream, after one usage chunk summing every prompt when `include_usage` (vLLM's sums:
  each prompt's tokens once, every choice's output tokens);
- non-streaming: every prompt's response merged into one (choices by index, usage summed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tokenway import headers as h
from tokenway.api.openai_output import combine_responses, usage_chunk
from tokenway.errors import DeadlineExceeded
from tokenway.output_router import Event
from tokenway.sse import frame
from tokenway.wire import ErrorInfo, Failed, OutputContext

_json = msgspec.json.Decoder()


@dataclass(slots=True)
class SubStream:
    started: bool = False  # its first event arrived
    done: bool = False  # its last event arrived
    tokens: int = 0  # output tokens it committed, over all its choices
    held: list[Event] = field(default_factory=list)  # arrived, not yet merged out


@dataclass(frozen=True, slots=True)
class Output:
    kind: str  # a `Tw-Kind`
    payload: bytes


class Merge:
    def __init__(self, ctx: OutputContext, prompt_tokens: int, prompts: int, limit: int) -> None:
        self.ctx = ctx
        self.prompt_tokens = prompt_tokens  # every prompt's, summed
        self.limit = limit  # events held per prompt before every stream has begun
        self.subs = [SubStream() for _ in range(prompts)]
        self.error: ErrorInfo | None = None
        self.ended = False

    @property
    def established(self) -> bool:
        return all(s.started for s in self.subs)

    def add(self, k: int, event: Event) -> None:
        """Prompt `k`'s next committed event."""
        sub = self.subs[k]
        if self.error is not None or self.ended or sub.done:
            return
        if isinstance(event, Failed):
            self.error = sub_error(k, event)
            return
        if len(sub.held) >= self.limit:
            self.fail(k, f"more than {self.limit} output events waited for the other prompts")
            return
        sub.started = True
        sub.done = event.terminal
        sub.tokens += event.tokens
        sub.held.append(event)

    def fail(self, k: int, why: str) -> None:
        if self.error is None:
            self.error = ErrorInfo(
                message=f"prompt {k}: {why}", type="ServiceUnavailableError", status=502
            )

    def take(self) -> Output | None:
        """What the request commits now, if anything."""
        if self.error is not None or self.ended or not self.established:
            return None
        done = all(s.done for s in self.subs)
        if not self.ctx.stream:
            if not done:
                return None
            self.ended = True
            docs = [e.payload for s in self.subs for e in s.held]
            return Output(h.KIND_RESPONSE, combine_responses(docs, same_prompt=False))
        payload = b"".join(e.payload for s in self.subs for e in s.held)
        for s in self.subs:
            s.held.clear()
        if not done:
            return Output(h.KIND_CHUNK, payload) if payload else None
        self.ended = True
        if self.ctx.include_usage:
            totals = msgspec.structs.replace(self.ctx, prompt_tokens=self.prompt_tokens)
            completion = sum(s.tokens for s in self.subs)
            payload += frame([usage_chunk(totals, completion)])
        return Output(h.KIND_END, payload)


def sub_error(k: int, event: Failed) -> ErrorInfo:
    """A prompt's error event as the request's error, saying which prompt failed."""
    try:
        body = _json.decode(event.payload)["error"]
        message, kind = str(body["message"]), str(body["type"])
        param, code = body.get("param"), body.get("code")
    except (msgspec.DecodeError, KeyError, TypeError):
        message, kind = event.payload.decode(errors="replace"), "EngineError"
        param = code = None
    return ErrorInfo(
        message=f"prompt {k}: {message}",
        type=kind,
        status=event.status,
        param=param,
        code=str(code) if code is not None and code != event.status else None,
    )


def retryable(error: ErrorInfo) -> bool:
    """Worth a whole-request retry (before any output): a failing stage or engine, not the
    request itself (4xx) nor its deadline."""
    return error.status >= 500 and error.status != DeadlineExceeded.status
