"""The vLLM bridge: an `Engine` over vLLM 0.33's token-in/token-out HTTP route.

A vLLM server started with `--tokens-only` (or `vllm serve --enable-scale-out`) serves
`POST /inference/v1/generate` (`output_mode: "tokens"`) and `POST /inference/v1/abort_requests`.
One attempt is one generate call: streamed as server-sent events, one choice per event, or
— for a P/D prefill leg only — one JSON response, because vLLM's stream events have no
`kv_transfer_params` field and the prefill leg exists to return them.

vLLM runs (and aborts) a request under `generate-tokens-<request_id>`; each attempt sends its
own `request_id` (`<rid>-<attempt>`), so an abort never hits another attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import msgspec
from msgspec import Struct

from engines.bridge import Emit, Engine
from tokenway.config import Settings
from tokenway.wire import (
    EngineInfo,
    EngineWork,
    FinishReason,
    LogprobEntry,
    Role,
    SamplingParams,
    TokenLogprob,
)

log = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
# vLLM's serving.py runs a generate request under this prefix + the request_id we send.
REQUEST_ID_PREFIX = "generate-tokens-"

# Our sampling fields that vLLM's SamplingParams takes and that matter for token output.
# Left out: `stop` (strings: derender matches them; a --tokens-only server rejects them),
# `prompt_logprobs` (no place for them in an engine step), and the detokenizer's knobs
# (`skip_special_tokens`, `spaces_between_special_tokens`, `include_stop_str_in_output`).
PASSED_SAMPLING_FIELDS = frozenset(
    "n temperature top_p top_k min_p seed max_tokens min_tokens stop_token_ids ignore_eos "
    "presence_penalty frequency_penalty repetition_penalty logprobs logit_bias".split()
)

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",  # vLLM's repetition detection; stop_reason says what repeated
}
_JSON_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


# -- failures the owner may want to tell apart (the Bridge sends `<class>: <message>`) ------


class VllmError(Exception):
    """vLLM failed this attempt."""


class VllmUnavailable(VllmError):
    """No connection (refused, unreachable, connect timeout): nothing ran on the engine."""


class VllmCapabilityMissing(VllmError):
    """The server has no token-only route: 404/501, or 403 when scale-out is disabled."""


class VllmHttpError(VllmError):
    """vLLM answered with an error status, or sent an error event mid-stream."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class VllmTimeout(VllmError):
    """No first token, or no next token, within the configured time."""


class VllmStreamBroken(VllmError):
    """The answer ended before every choice finished: the engine died or dropped us."""


class VllmBadResponse(VllmError):
    """The answer does not follow vLLM's generate wire."""


# -- vLLM's wire (protocol.py: GenerateRequest, Generate[Tokens][Stream]Response) ----------


class VllmGenerateRequest(Struct, kw_only=True, omit_defaults=True):
    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, object]
    stream: bool
    output_mode: str  # always "tokens": no tokenizer on our engines' side
    stream_options: dict[str, bool] | None = None
    priority: int = 0
    kv_transfer_params: dict[str, object] | None = None
    cache_salt: str | None = None


class _Logprob(Struct):
    token_id: int
    logprob: float
    rank: int | None = None


class _LogprobContent(_Logprob):
    top_logprobs: list[_Logprob] = []


class _Logprobs(Struct):
    content: list[_LogprobContent] | None = None


class _Choice(Struct):
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None


class _ErrorInfo(Struct):
    message: str = ""
    type: str = ""
    code: int | None = None


class _Usage(Struct):
    completion_tokens: int | None = None


class _Answer(Struct):
    """A stream event or a whole response; an error event is `{"error": {...}}`."""

    request_id: str | None = None
    choices: list[_Choice] = []
    usage: _Usage | None = None  # the closing stream event; whole responses
    kv_transfer_params: dict[str, object] | None = None  # whole responses only
    error: _ErrorInfo | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_Answer)


def vllm_sampling_params(params: SamplingParams) -> dict[str, object]:
    """Ours → vLLM's: only fields set away from their defaults, so vLLM's defaults (and its
    server-side `max_tokens`) apply to the rest; no detokenization, we want token IDs."""
    fields = msgspec.to_builtins(params)  # omit_defaults: only what was set
    out: dict[str, object] = {k: v for k, v in fields.items() if k in PASSED_SAMPLING_FIELDS}
    out["detokenize"] = False
    return out


def hands_kv_over(work: EngineWork) -> bool:
    """A P/D prefill leg: the engine is asked to keep the KV for a remote decode."""
    return bool(work.kv_transfer_params and work.kv_transfer_params.get("do_remote_decode"))


def vllm_request(work: EngineWork, request_id: str, stream: bool) -> VllmGenerateRequest:
    return VllmGenerateRequest(
        request_id=request_id,
        token_ids=work.token_ids,
        sampling_params=vllm_sampling_params(work.sampling_params),
        stream=stream,
        output_mode="tokens",
        stream_options={"include_usage": True} if stream else None,
        priority=work.priority,
        kv_transfer_params=work.kv_transfer_params,
        cache_salt=work.cache_salt,
    )


def _logprobs(lp: _Logprobs | None) -> list[LogprobEntry] | None:
    """vLLM's per-token entries (sampled token first in `top_logprobs`) → ours, as they are."""
    if lp is None or lp.content is None:
        return None
    out = []
    for c in lp.content:
        top = [TokenLogprob(token_id=t.token_id, logprob=t.logprob, rank=t.rank)
               for t in c.top_logprobs]  # fmt: skip
        out.append(LogprobEntry(token_id=c.token_id, logprob=c.logprob, rank=c.rank, top=top))
    return out


def _error_message(body: bytes) -> str:
    """vLLM's `{"error": {"message": …}}`, FastAPI's `{"detail": …}`, or the body itself."""
    with contextlib.suppress(msgspec.DecodeError):
        doc = msgspec.json.decode(body)
        if isinstance(doc, dict):
            error = doc.get("error")
            if isinstance(error, dict) and "message" in error:
                return str(error["message"])
            if "detail" in doc:
                return str(doc["detail"])
    return body.decode("utf-8", "replace").strip()[:500] or "(empty body)"


# -- the engine ------------------------------------------------------------------------------


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


@dataclass
class _Attempt:
    request_id: str  # what we send
    vllm_id: str  # what vLLM runs it under, and what abort names
    open: set[int]  # choices not finished yet
    waiting: str = "first token"  # which timeout applies now
    events: int = 0
    tokens: int = 0


class VllmEngine:
    """One vLLM server; one pooled HTTP client with a connection per running request."""

    def __init__(self, endpoint: VllmEndpoint) -> None:
        self.endpoint = endpoint
        self.url = endpoint.url.rstrip("/")
        self.running = 0
        self.client = httpx.AsyncClient(
            base_url=self.url,
            # Connect is bounded here; waiting for tokens by the deadlines in `generate`.
            timeout=httpx.Timeout(None, connect=endpoint.connect_timeout),
            # One connection per running request, plus a few so aborts never wait for one.
            limits=httpx.Limits(
                max_connections=endpoint.max_seqs + 8,
                max_keepalive_connections=endpoint.max_seqs,
            ),
            trust_env=False,  # an engine is on the cluster network, never behind a proxy
        )

    def info(self) -> EngineInfo:
        e = self.endpoint
        return EngineInfo(
            id=e.id, model=e.model, role=e.role, max_seqs=e.max_seqs, running=self.running
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        n = max(work.sampling_params.n, 1)
        request_id = f"{work.rid}-{work.attempt}"
        a = _Attempt(request_id, REQUEST_ID_PREFIX + request_id, open=set(range(n)))
        self.running += n
        try:
            with self._failures(a):
                if hands_kv_over(work):
                    await self._whole(work, a, emit)
                else:
                    await self._stream(work, a, emit)
        except (asyncio.CancelledError, VllmTimeout):
            # Aborted, or silent past its deadline: either way vLLM should stop working on it.
            await self._abort(a.vllm_id)
            raise
        finally:
            self.running -= n

    async def _stream(self, work: EngineWork, a: _Attempt, emit: Emit) -> None:
        body = _encoder.encode(vllm_request(work, a.request_id, stream=True))
        loop = asyncio.get_running_loop()
        done = False
        async with asyncio.timeout(self.endpoint.first_token_timeout) as deadline:
            async with self.client.stream(
                "POST", GENERATE_PATH, content=body, headers=_JSON_HEADERS
            ) as resp:
                if resp.status_code != 200:
                    self._raise_status(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank event separators
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True  # read on to the body's end, so the connection is reused
                        continue
                    self._on_answer(a, _decode(data, self.url), emit, None)
                    a.events += 1
                    a.waiting = "token"
                    deadline.reschedule(loop.time() + self.endpoint.token_timeout)
        if a.open:
            how = "sent [DONE]" if done else "closed the stream"
            raise VllmStreamBroken(
                f"vLLM at {self.url} {how} for {a.vllm_id} after {a.events} events without "
                f"finishing choice(s) {sorted(a.open)}"
            )

    async def _whole(self, work: EngineWork, a: _Attempt, emit: Emit) -> None:
        """Non-streaming, for the prefill leg: only a whole response has kv_transfer_params."""
        body = _encoder.encode(vllm_request(work, a.request_id, stream=False))
        async with asyncio.timeout(self.endpoint.first_token_timeout):
            resp = await self.client.post(GENERATE_PATH, content=body, headers=_JSON_HEADERS)
        if resp.status_code != 200:
            self._raise_status(resp.status_code, resp.content)
        answer = _decode(resp.content, self.url)
        a.events += 1
        self._on_answer(a, answer, emit, answer.kv_transfer_params)
        if a.open:
            raise VllmBadResponse(
                f"vLLM at {self.url} answered {a.vllm_id} without choice(s) {sorted(a.open)}"
            )

    def _on_answer(
        self, a: _Attempt, answer: _Answer, emit: Emit, kv: dict[str, object] | None
    ) -> None:
        if answer.error is not None:
            status = answer.error.code or 500
            raise VllmHttpError(
                f"vLLM at {self.url} failed {a.vllm_id} mid-stream ({status} "
                f"{answer.error.type}): {answer.error.message}",
                status,
            )
        if answer.request_id:
            a.vllm_id = answer.request_id
        usage = answer.usage.completion_tokens if answer.usage else None
        if usage is not None and not answer.choices and usage != a.tokens:
            log.warning(
                "vLLM at %s counts %d tokens for %s, but %d arrived",
                self.url, usage, a.vllm_id, a.tokens,
            )  # fmt: skip
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
            emit(
                choice.token_ids or [],
                finish,
                choice.stop_reason,
                _logprobs(choice.logprobs),
                choice.index,
                kv,
            )

    def _raise_status(self, status: int, body: bytes) -> None:
        message = f"vLLM at {self.url} answered HTTP {status} on {GENERATE_PATH}: "
        message += _error_message(body)
        if status in (403, 404, 501):
            hint = " (start vLLM with --tokens-only or --enable-scale-out)"
            raise VllmCapabilityMissing(message + hint)
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
        except httpx.ConnectTimeout as exc:
            raise VllmUnavailable(
                f"no connection to vLLM at {self.url} within "
                f"engine_connect_timeout={e.connect_timeout}s"
            ) from exc
        except httpx.ConnectError as exc:
            raise VllmUnavailable(f"cannot connect to vLLM at {self.url}: {exc}") from exc
        except httpx.TransportError as exc:
            if a.open:
                raise VllmStreamBroken(
                    f"vLLM at {self.url} dropped {a.vllm_id} after {a.events} events without "
                    f"finishing choice(s) {sorted(a.open)}: {type(exc).__name__}: {exc}"
                ) from exc
            # Every choice had finished: only the closing usage event or [DONE] was lost.
            log.debug("vLLM at %s: %s ended untidily: %r", self.url, a.vllm_id, exc)

    async def _abort(self, vllm_id: str) -> None:
        """Tell vLLM to free the request now; bounded, since the attempt is being cancelled."""
        body = _encoder.encode({"request_ids": [vllm_id]})
        try:
            async with asyncio.timeout(self.endpoint.connect_timeout):
                resp = await self.client.post(ABORT_PATH, content=body, headers=_JSON_HEADERS)
        except (TimeoutError, httpx.HTTPError) as exc:
            log.warning("vLLM at %s: abort of %s failed: %r", self.url, vllm_id, exc)
            return
        if resp.status_code != 200:
            log.warning(
                "vLLM at %s: abort of %s answered HTTP %d: %s",
                self.url, vllm_id, resp.status_code, _error_message(resp.content),
            )  # fmt: skip


def _decode(data: str | bytes, url: str) -> _Answer:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise VllmBadResponse(f"vLLM at {url} sent an undecodable answer: {exc}") from exc


# -- what the CLI calls ---------------------------------------------------------------------


def token_safe(text: str) -> str:
    """An id usable as a NATS subject token: `[A-Za-z0-9_-]` only."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-") or "vllm"


def engine_id_for(url: str) -> str:
    parts = urlsplit(url)
    return token_safe(f"vllm-{parts.hostname or 'localhost'}-{parts.port or 80}")


def vllm_urls(value: str | None) -> list[str]:
    """`--vllm-url` values: one or more URLs, separated by commas or spaces."""
    urls = [u.rstrip("/") for u in re.split(r"[,\s]+", value or "") if u]
    for url in urls:
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ValueError(f"--vllm-url must be http(s)://host:port, got {url!r}")
    return urls


def vllm_engines(settings: Settings, served_model_name: str) -> list[Engine]:
    """One engine per vLLM URL; ids from `--engine-id` (suffixed when several) or host:port."""
    urls = vllm_urls(settings.vllm_url)
    if not urls:
        raise ValueError("no vLLM server given: pass --vllm-url http://host:port")
    engines: list[Engine] = []
    for i, url in enumerate(urls):
        if settings.engine_id:
            id_ = token_safe(settings.engine_id + (f"-{i}" if len(urls) > 1 else ""))
        else:
            id_ = engine_id_for(url)
        endpoint = VllmEndpoint(
            url=url,
            id=id_,
            model=served_model_name,
            role=settings.engine_role,
            max_seqs=settings.engine_max_seqs,
            connect_timeout=settings.engine_connect_timeout,
            first_token_timeout=settings.engine_first_token_timeout,
            token_timeout=settings.engine_token_timeout,
        )
        engines.append(VllmEngine(endpoint))
    return engines
