"""The vLLM bridge: an `Engine` over vLLM 0.33's token-in/token-out HTTP route.

A vLLM server started with `--tokens-only` (or `vllm serve --enable-scale-out`) serves
`POST /inference/v1/generate` (`output_mode: "tokens"`) and `POST /inference/v1/abort_requests`.
One attempt is one generate call: streamed as server-sent events, one choice per event, or
— for a P/D prefill leg only — one JSON response, because vLLM's stream events have no
`kv_transfer_params` field and the prefill leg exists to return them.

vLLM runs (and aborts) a request under `generate-tokens-<request_id>`; each attempt sends its
own `request_id` (`<key>-<attempt>`, the request's key: its reply's and id's, which no other
request's is, whoever chose the id), so an abort never hits another attempt or request.

**Aborts are confirmed.** vLLM answers `abort_requests` with 200 whatever it did: an id it has
not registered yet (the generate call still in its input queue) is silently ignored, and a
proxy in between may keep vLLM's side of a dropped connection open. So a cancelled attempt
keeps its stream open, asks vLLM to abort it, and re-asks with back-off until vLLM ends the
stream (its `finish_reason: "abort"` and `[DONE]`): that end is the confirmation that the
engine let the request go. Only after `abort_timeout` without one does the bridge drop the
connection (which vLLM also takes as an abort) and say so. A second cancel meanwhile (another
abort, the bridge stopping) does not interrupt this.

**Native fallback.** A server without the token-only route (404/501) still has the OpenAI
completions route, which takes a token-ID prompt and returns token IDs. An attempt whose
owner allows it (`EngineWork.native_ok`: nothing of the request committed yet, and no token
obfuscation) streams from there instead; any other attempt fails with the capability error.
The engine then sends such attempts straight to the native route for `NATIVE_REPROBE`
seconds before trying the token-only route again, so a server restarted with it is picked
up without a probe per request. A P/D prefill leg never goes native (its KV hand-over is
the token route's), and a native attempt is aborted by closing its connection, since the
abort route lives beside the missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from engines.bridge import Emit, Engine, Refused
from engines.http1 import ConnectFailed, Http1Client, Response, TransportError
from engines.vllm_wire import (
    ABORT_PATH,
    COMPLETIONS_ID_PREFIX,
    COMPLETIONS_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    REQUEST_ID_PREFIX,
    Answer,
    completions_request,
    decode_completion,
    decode_generate,
    error_message,
    vllm_request,
)
from tokenway import headers as h
from tokenway.aio import cancel_and_wait, uninterrupted
from tokenway.api.generate import logprob_entries
from tokenway.config import Settings
from tokenway.wire import EngineInfo, EngineWork, FinishReason, LogprobEntry, Role

log = logging.getLogger(__name__)

NATIVE_REPROBE = 60.0  # seconds native-allowed attempts skip a token route found missing
ABORT_RETRY = 0.25  # seconds a stream may go on after an abort before it is asked again
ABORT_RETRY_MAX = 2.0  # … doubling up to this
_NATIVE_STATUSES = (404, 501)  # no such route; 403 is a route switched off on purpose

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",  # vLLM's repetition detection; stop_reason says what repeated
}
_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


# -- failures the owner may want to tell apart (the Bridge sends `<class>: <message>`) ------


class VllmError(Exception):
    """vLLM failed this attempt."""


class VllmUnavailable(VllmError):
    """No connection (refused, unreachable, connect timeout): nothing ran on the engine."""


class VllmCapabilityMissing(VllmError):
    """The server has no token-only route: 404/501, or 403 when scale-out is disabled."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class VllmHttpError(VllmError):
    """vLLM answered with an error status, or sent an error event mid-stream."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class VllmRefused(VllmError, Refused):
    """vLLM refused the request itself (400, 413, 422: a grammar its backend cannot compile,
    a prompt it rejects), by its answer's status or, once the stream began, by an error
    event with that code: the request's fault, not the engine's."""


# vLLM's statuses for what is wrong with the request itself; any other is the engine's
# (5xx, and 401/403/404/429, which say how the server is set up or how busy it is).
REFUSALS = frozenset({400, 413, 422})


class VllmTimeout(VllmError):
    """No first token, or no next token, within the configured time."""


class VllmStreamBroken(VllmError):
    """The answer ended before every choice finished: the engine died or dropped us."""


class VllmBadResponse(VllmError):
    """The answer does not follow vLLM's wire."""


# -- the engine ------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def hands_kv_over(work: EngineWork) -> bool:
    """A P/D prefill leg: the engine is asked to keep the KV for a remote decode."""
    return bool(work.kv_transfer_params and work.kv_transfer_params.get("do_remote_decode"))


@dataclass(frozen=True)
class VllmEndpoint:
    url: str  # http://host:port of the vLLM server
    id: str
    model: str
    role: Role = "union"
    max_seqs: int = 256
    connect_timeout: float = 5.0
    first_token_timeout: float = 600.0
    token_timeout: float = 60.0
    abort_timeout: float = 10.0  # for vLLM to confirm an abort (see the module docstring)


# What one `emit` reports: token IDs, finish, stop reason, logprobs, choice, KV parameters.
_Step = tuple[
    list[int],
    FinishReason | None,
    int | str | None,
    list[LogprobEntry] | None,
    int,
    dict[str, object] | None,
]


@dataclass
class _Attempt:
    request_id: str  # what we send
    vllm_id: str  # what vLLM runs it under, and what abort names
    open: set[int]  # choices not finished yet
    waiting: str = "first token"  # which timeout applies now
    events: int = 0
    tokens: int = 0
    native: bool = False  # on the completions route: no abort route to call
    stopped: bool = False  # aborted: what vLLM still sends is read, never reported
    done: bool = False  # vLLM sent [DONE]
    last_event: float = 0.0  # loop time of the last event, for the token timeout
    traceparent: str | None = None  # the request's W3C trace, on to vLLM's own
    cached: int | None = None  # prompt tokens vLLM found in its prefix cache, once it says
    held: _Step | None = None  # the last finish, held for the usage event that says `cached`

    @property
    def headers(self) -> dict[str, str]:
        """Of its calls to vLLM."""
        if self.traceparent is None:
            return _JSON_HEADERS
        return {**_JSON_HEADERS, h.TRACEPARENT: self.traceparent}


class VllmEngine:
    """One vLLM server; a connection per running request, kept for the next while idle.

    The HTTP client is `engines.http1`'s, not a general one: every token of every running
    sequence is a read of its own, and that client parses it where it arrives."""

    def __init__(self, endpoint: VllmEndpoint) -> None:
        self.endpoint = endpoint
        self.url = endpoint.url.rstrip("/")
        self.running = 0
        self.token_route_missing_at: float | None = None  # monotonic time of the last 404/501
        # Connect is bounded here; waiting for tokens by the deadlines in `_stream`.
        self.client = Http1Client(
            self.url, connect_timeout=endpoint.connect_timeout, max_idle=endpoint.max_seqs
        )

    def info(self) -> EngineInfo:
        e = self.endpoint
        return EngineInfo(
            id=e.id, model=e.model, role=e.role, max_seqs=e.max_seqs, running=self.running
        )

    async def healthy(self) -> str | None:
        """vLLM's `/health` answers 200 while its engine runs (503 once it died)."""
        try:
            async with asyncio.timeout(self.endpoint.connect_timeout):
                resp = await self.client.request("GET", HEALTH_PATH)
        except (TimeoutError, TransportError) as exc:
            return f"{self.url}{HEALTH_PATH} did not answer: {exc!r}"
        if resp.status != 200:
            return f"{self.url}{HEALTH_PATH} answered HTTP {resp.status}"
        return None

    async def aclose(self) -> None:
        await self.client.aclose()

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        n = max(work.sampling_params.n, 1)
        request_id = f"{work.rid}-{work.attempt}"
        a = _Attempt(
            request_id,
            REQUEST_ID_PREFIX + request_id,
            open=set(range(n)),
            traceparent=work.traceparent,
        )
        self.running += n
        # The HTTP exchange runs in a task of its own, so that cancelling this one (the
        # owner's abort) leaves the stream open for vLLM to confirm the abort on.
        exchange = asyncio.ensure_future(self._exchange(work, a, emit))
        try:
            await asyncio.shield(exchange)
        except asyncio.CancelledError:
            await uninterrupted(self._stop(a, exchange))
            raise
        except VllmTimeout:  # silent past its deadline, its connection closed: free it anyway
            if not a.native:
                await uninterrupted(self._abort_until_answered(a))
            raise
        finally:
            self.running -= n

    async def _exchange(self, work: EngineWork, a: _Attempt, emit: Emit) -> None:
        with self._failures(a):
            if hands_kv_over(work):
                await self._whole(work, a, emit)
            elif work.native_ok and self._token_route_missing():
                await self._native(work, a, emit)
            else:
                await self._generate_or_native(work, a, emit)
        self._release(a, emit)  # the stream ended without its usage event

    def _token_route_missing(self) -> bool:
        since = self.token_route_missing_at
        return since is not None and time.monotonic() - since < NATIVE_REPROBE

    async def _generate_or_native(self, work: EngineWork, a: _Attempt, emit: Emit) -> None:
        body = _encoder.encode(vllm_request(work, a.request_id, stream=True))
        try:
            await self._stream(a, emit, GENERATE_PATH, body, decode_generate)
            return
        except VllmCapabilityMissing as exc:
            if exc.status not in _NATIVE_STATUSES:
                raise
            self.token_route_missing_at = time.monotonic()
            if not work.native_ok:
                raise VllmCapabilityMissing(
                    f"{exc}; the native {COMPLETIONS_PATH} fallback is not allowed for this "
                    "attempt (output was already committed, or token obfuscation is on)",
                    exc.status,
                ) from exc
            log.warning("%s; using the native %s route", exc, COMPLETIONS_PATH)
        await self._native(work, a, emit)

    async def _native(self, work: EngineWork, a: _Attempt, emit: Emit) -> None:
        a.native = True
        a.vllm_id = f"{COMPLETIONS_ID_PREFIX}{a.request_id}"
        body = _encoder.encode(completions_request(work, a.request_id))
        await self._stream(a, emit, COMPLETIONS_PATH, body, decode_completion)

    async def _stream(
        self,
        a: _Attempt,
        emit: Emit,
        path: str,
        body: bytes,
        decode: Callable[[str | bytes], Answer],
    ) -> None:
        loop = asyncio.get_running_loop()

        def on_line(line: bytes) -> None:
            if not line.startswith(b"data:"):
                return  # blank event separators
            data = line[5:].strip()
            if data == b"[DONE]":
                a.done = True  # read on to the body's end, so the connection is reused
                return
            self._on_answer(a, self._decode(decode, data), emit, None)
            a.events += 1
            a.waiting = "token"
            a.last_event = loop.time()

        call = asyncio.ensure_future(
            self.client.request("POST", path, body, headers=a.headers, on_line=on_line)
        )
        try:
            resp = await self._within_deadlines(a, call)
        finally:
            await cancel_and_wait(call)  # a deadline passed, or this attempt was cancelled: drop it
        if resp.status != 200:
            self._raise_status(resp.status, resp.body, path)
        if a.open:
            how = "sent [DONE]" if a.done else "closed the stream"
            raise VllmStreamBroken(
                f"vLLM at {self.url} {how} for {a.vllm_id} after {a.events} events without "
                f"finishing choice(s) {sorted(a.open)}"
            )

    async def _within_deadlines(self, a: _Attempt, call: asyncio.Future[Response]) -> Response:
        """The call's response, unless vLLM sends no first event within the first-token
        timeout or no next event within the token timeout (then TimeoutError). Checked
        against the time of the last event, so an event costs no timer of its own."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        token_timeout = self.endpoint.token_timeout
        while True:
            if a.events:
                left = a.last_event + token_timeout - loop.time()
            else:  # looked at again a token timeout on, in case the first event came
                left = started + self.endpoint.first_token_timeout - loop.time()
                left = min(left, token_timeout)
            if left <= 0:
                raise TimeoutError
            await asyncio.wait({call}, timeout=left)
            if call.done():
                return call.result()

    async def _whole(self, work: EngineWork, a: _Attempt, emit: Emit) -> None:
        """Non-streaming, for the prefill leg: only a whole response has kv_transfer_params."""
        body = _encoder.encode(vllm_request(work, a.request_id, stream=False))
        async with asyncio.timeout(self.endpoint.first_token_timeout):
            resp = await self.client.request("POST", GENERATE_PATH, body, headers=a.headers)
        if resp.status != 200:
            self._raise_status(resp.status, resp.body, GENERATE_PATH)
        answer = self._decode(decode_generate, resp.body)
        a.events += 1
        self._on_answer(a, answer, emit, answer.kv_transfer_params)
        if a.open:
            raise VllmBadResponse(
                f"vLLM at {self.url} answered {a.vllm_id} without choice(s) {sorted(a.open)}"
            )

    def _decode(self, decode: Callable[[str | bytes], Answer], data: str | bytes) -> Answer:
        try:
            return decode(data)
        except (msgspec.DecodeError, ValueError) as exc:
            raise VllmBadResponse(f"vLLM at {self.url} sent an undecodable answer: {exc}") from exc

    def _on_answer(
        self, a: _Attempt, answer: Answer, emit: Emit, kv: dict[str, object] | None
    ) -> None:
        if answer.error is not None:
            status = answer.error.code or 500
            message = (
                f"vLLM at {self.url} failed {a.vllm_id} mid-stream ({status} "
                f"{answer.error.type}): {answer.error.message}"
            )
            if status in REFUSALS:
                raise VllmRefused(message, status, answer.error.message)
            raise VllmHttpError(message, status)
        if answer.request_id:
            a.vllm_id = answer.request_id
        usage = answer.usage.completion_tokens if answer.usage else None
        if answer.usage is not None and answer.usage.cached_tokens is not None:
            a.cached = answer.usage.cached_tokens
        if usage is not None and not answer.choices and usage != a.tokens:
            log.warning(
                "vLLM at %s counts %d tokens for %s, but %d arrived",
                self.url,
                usage,
                a.vllm_id,
                a.tokens,
            )
        for choice in answer.choices:  # none in the closing usage event
            if choice.index not in a.open:
                raise VllmBadResponse(
                    f"vLLM at {self.url} sent choice {choice.index} of {a.vllm_id}, which is "
                    "not running"
                )
            finish = None
            if choice.finish_reason is not None:
                finish = _FINISH.get(choice.finish_reason)
                if finish is None:
                    raise VllmBadResponse(
                        f"vLLM at {self.url} finished {a.vllm_id} with unknown "
                        f"finish_reason {choice.finish_reason!r}"
                    )
                a.open.discard(choice.index)
            a.tokens += len(choice.token_ids or ())
            if a.stopped:  # the owner asked for nothing more
                continue
            lps = logprob_entries(choice.logprobs)
            step = (choice.token_ids or [], finish, choice.stop_reason, lps, choice.index, kv)
            if finish is not None and not a.open and answer.usage is None:
                a.held = step  # a stream's last finish: its usage event comes next
                continue
            emit(*step, cached_tokens=a.cached if finish is not None else None)
        if answer.usage is not None:
            self._release(a, emit)

    def _release(self, a: _Attempt, emit: Emit) -> None:
        """The held finish goes, with the prompt tokens cached, where vLLM said."""
        held, a.held = a.held, None
        if held is not None and not a.stopped:
            emit(*held, cached_tokens=a.cached)

    def _raise_status(self, status: int, body: bytes, path: str) -> None:
        reason = error_message(body)
        message = f"vLLM at {self.url} answered HTTP {status} on {path}: {reason}"
        if status in (403, 404, 501) and path == GENERATE_PATH:
            hint = " (start vLLM with --tokens-only or --enable-scale-out)"
            raise VllmCapabilityMissing(message + hint, status)
        if status in REFUSALS:
            raise VllmRefused(message, status, reason)
        raise VllmHttpError(message, status)

    @contextlib.contextmanager
    def _failures(self, a: _Attempt) -> Iterator[None]:
        """Transport failures and deadlines, named with the setting and value that applied."""
        e = self.endpoint
        try:
            yield
        except TimeoutError as exc:
            if not a.open:
                log.debug("vLLM at %s: %s did not close its stream in time", self.url, a.vllm_id)
                return
            if a.waiting == "first token":
                what = f"no first token within engine_first_token_timeout={e.first_token_timeout}s"
            else:
                what = (
                    f"no token within engine_token_timeout={e.token_timeout}s "
                    f"after {a.events} events"
                )
            raise VllmTimeout(f"vLLM at {self.url}: {what} for {a.vllm_id}") from exc
        except ConnectFailed as exc:
            if exc.timed_out:
                raise VllmUnavailable(
                    f"no connection to vLLM at {self.url} within "
                    f"engine_connect_timeout={e.connect_timeout}s"
                ) from exc
            raise VllmUnavailable(f"cannot connect to vLLM at {self.url}: {exc}") from exc
        except TransportError as exc:
            if a.open:
                raise VllmStreamBroken(
                    f"vLLM at {self.url} dropped {a.vllm_id} after {a.events} events without "
                    f"finishing choice(s) {sorted(a.open)}: {type(exc).__name__}: {exc}"
                ) from exc
            # Every choice had finished: only the closing usage event or [DONE] was lost.
            log.debug("vLLM at %s: %s ended untidily: %r", self.url, a.vllm_id, exc)

    async def _stop(self, a: _Attempt, exchange: asyncio.Future[None]) -> None:
        """The attempt was cancelled: have vLLM free it, confirmed by the end of its stream,
        within `abort_timeout`; then drop the connection."""
        a.stopped = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.endpoint.abort_timeout
        wait, asked = ABORT_RETRY, 0
        # A native attempt has no abort route: closing its connection is the abort.
        while not a.native and not exchange.done() and loop.time() < deadline:
            await self._abort(a.vllm_id)
            asked += 1
            await asyncio.wait({exchange}, timeout=min(wait, max(deadline - loop.time(), 0)))
            wait = min(wait * 2, ABORT_RETRY_MAX)
        if exchange.done():
            if asked > 1:
                log.info("vLLM at %s ended %s after %d aborts", self.url, a.vllm_id, asked)
            if not exchange.cancelled():
                exchange.exception()  # whatever ended it, the attempt is over
            return
        if not a.native:
            log.warning(
                "vLLM at %s did not end %s within %ss of %d aborts; dropping its connection",
                self.url,
                a.vllm_id,
                self.endpoint.abort_timeout,
                asked,
            )
        exchange.cancel()
        await asyncio.wait({exchange})

    async def _abort_until_answered(self, a: _Attempt) -> None:
        """An attempt whose stream is already closed: ask until vLLM says 200, bounded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.endpoint.abort_timeout
        wait = ABORT_RETRY
        while not await self._abort(a.vllm_id) and loop.time() + wait < deadline:
            await asyncio.sleep(wait)
            wait = min(wait * 2, ABORT_RETRY_MAX)

    async def _abort(self, vllm_id: str) -> bool:
        """One call asking vLLM to free the request; True when it answered 200."""
        body = _encoder.encode({"request_ids": [vllm_id]})
        try:
            async with asyncio.timeout(self.endpoint.connect_timeout):
                resp = await self.client.request("POST", ABORT_PATH, body, headers=_JSON_HEADERS)
        except (TimeoutError, TransportError) as exc:
            log.warning("vLLM at %s: abort of %s failed: %r", self.url, vllm_id, exc)
            return False
        if resp.status != 200:
            log.warning(
                "vLLM at %s: abort of %s answered HTTP %d: %s",
                self.url,
                vllm_id,
                resp.status,
                error_message(resp.body),
            )
            return False
        return True


# -- what the CLI calls ---------------------------------------------------------------------


def token_safe(text: str) -> str:
    """An id usable as a NATS subject token: `[A-Za-z0-9_-]` only."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-") or "vllm"


def engine_id_for(url: str) -> str:
    parts = urlsplit(url)
    return token_safe(f"vllm-{parts.hostname or 'localhost'}-{parts.port or 80}")


def vllm_urls(value: str | None, models: Sequence[str]) -> list[tuple[str, str]]:
    """`--vllm-url` values, separated by commas or spaces: `URL`, or `MODEL=URL` where the
    process serves several models; each with the model it serves."""
    urls = []
    for item in re.split(r"[,\s]+", value or ""):
        if not item:
            continue
        model, named, url = item.partition("=")
        if not named or "://" in model:  # a bare URL (an `=` of its own comes after ://)
            model, url = "", item
        url = url.rstrip("/")
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ValueError(f"--vllm-url must be [MODEL=]http(s)://host:port, got {item!r}")
        if not model and len(models) > 1:
            raise ValueError(f"several models are served: name the one of {url} as MODEL={url}")
        if model and model not in models:
            raise ValueError(f"--vllm-url {item}: {model!r} is not a served model")
        urls.append((model or models[0], url))
    return urls


def vllm_engines(settings: Settings, models: Sequence[str]) -> list[Engine]:
    """One engine per vLLM URL; ids from `--engine-id` (suffixed when several) or host:port."""
    urls = vllm_urls(settings.vllm_url, models)
    if not urls:
        raise ValueError("no vLLM server given: pass --vllm-url http://host:port")
    engines: list[Engine] = []
    for i, (model, url) in enumerate(urls):
        if settings.engine_id:
            id_ = token_safe(settings.engine_id + (f"-{i}" if len(urls) > 1 else ""))
        else:
            id_ = engine_id_for(url)
        endpoint = VllmEndpoint(
            url=url,
            id=id_,
            model=model,
            role=settings.engine_role,
            max_seqs=settings.engine_max_seqs,
            connect_timeout=settings.engine_connect_timeout,
            first_token_timeout=settings.engine_first_token_timeout,
            token_timeout=settings.engine_token_timeout,
        )
        engines.append(VllmEngine(endpoint))
    return engines
