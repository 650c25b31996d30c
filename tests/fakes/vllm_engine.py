"""A fake vLLM token-only server for tests: vLLM 0.33's generate wire over real HTTP.

`async with FakeVllm() as fake:` serves `POST /inference/v1/generate` and
`POST /inference/v1/abort_requests` with uvicorn on 127.0.0.1 (a free port) at `fake.url`,
and the native OpenAI `POST /v1/completions` for token-ID prompts (the bridge's fallback
when the token-only route is missing: `Knobs.capability`), streamed or not, with
`token_ids` when `return_token_ids` asks for them.
Output is deterministic, the simulated engine's own toy model continuing the prompt over
"sentences" of token IDs; EOS comes at a sentence end unless `ignore_eos`. `fake.knobs`
shapes timing and failures and may be changed while requests run; `requests`, `aborted`,
`disconnected` and `running` are there to assert on, and `wait_until` waits for them.

The JSON mirrors what vLLM's pydantic models dump (field names and order, nulls), built here
independently of the bridge so that tests cross-check the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tokenizers import Tokenizer

from engines.sim import CorpusModel, Sequence, corpus_sentences
from tests.fakes.http import QuietServer, read_body, send_json, serve
from tokenway.obfuscation import Permutation
from tokenway.wire import SamplingParams

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATHS = ("/inference/v1/abort_requests", "/abort_requests")
HEALTH_PATH = "/health"
COMPLETIONS_PATH = "/v1/completions"
REQUEST_ID_PREFIX = "generate-tokens-"
COMPLETIONS_ID_PREFIX = "cmpl-"
COMPLETIONS_MAX_TOKENS = 16  # CompletionRequest's default when max_tokens is left out

# vLLM's SamplingParams fields a client may set (sampling_params.py); the fake rejects
# others, which vLLM would ignore, so a bridge that sends a misspelt field fails loudly.
SAMPLING_FIELDS = frozenset(
    "n presence_penalty frequency_penalty repetition_penalty temperature top_p top_k min_p "
    "seed stop stop_token_ids ignore_eos max_tokens min_tokens logprobs prompt_logprobs "
    "detokenize skip_special_tokens spaces_between_special_tokens include_stop_str_in_output "
    "logit_bias allowed_token_ids extra_args bad_words structured_outputs "
    "logprob_token_ids flat_logprobs stream_interval".split()
)
# CompletionRequest fields (completion/protocol.py) the fake knows; others are refused.
COMPLETION_FIELDS = frozenset(
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty "
    "seed stop stream stream_options temperature top_p user top_k min_p repetition_penalty "
    "stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens allowed_token_ids priority request_id cache_salt "
    "kv_transfer_params return_tokens_as_token_ids return_token_ids".split()
)


@dataclass
class Knobs:
    ttft: float = 0.0  # seconds before a request's first step
    itl: float = 0.0  # seconds between steps
    chunk_size: int = 1  # tokens per choice per event
    output_len: int = 20  # mean natural length before EOS
    max_model_len: int = 4096  # bounds max_tokens when a request leaves it out
    fail_status: int | None = None  # answer generate with this status (e.g. 503) …
    fail_first: int | None = None  # … for the first N requests only (None: always)
    capability: int | None = None  # 403, 404 or 501: no token-only route
    die_after: int | None = None  # close the connection after K token events, no finish
    die_first: int | None = None  # … in the first N requests only (None: in every one)
    error_after: int | None = None  # an error event (vLLM's GenerationError) after K events
    # That event's code (400: vLLM refusing the request, as it refuses a grammar it cannot
    # compile once its stream has begun), and what it or a `fail_status` answer says.
    error_status: int = 500
    error_message: str | None = None
    stall_after: int | None = None  # go silent after K events until aborted or left
    # Behind a proxy that keeps its own connection to the engine open: a run outlives its
    # client's disconnect, and only an abort call stops it.
    proxied: bool = False
    # A generate waits here, its id unknown to aborts (which are then no-ops, as vLLM's are
    # for an id it has not registered), until the event is set.
    queue_until: asyncio.Event | None = None
    abort_fail_first: int = 0  # answer the first N abort calls with a 503
    health: int = 200  # what GET /health answers (vLLM: 503 once its engine died)
    # As vLLM with --enable-prompt-tokens-details: usage says this many prompt tokens cached
    cached_tokens: int | None = None


@dataclass
class Received:
    """One generate call as the fake saw it, and what it answered."""

    body: dict[str, Any]
    headers: dict[str, str]
    client: tuple[str, int] | None = None  # the caller's address: one per connection
    path: str = GENERATE_PATH  # or COMPLETIONS_PATH: the native route
    # the id it ran under: generate-tokens- (or cmpl-) + request_id or X-Request-Id
    id: str = ""
    status: int = 200
    outputs: dict[int, list[int]] = field(default_factory=dict)  # tokens sent, per choice
    finish: dict[int, str] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None  # what a prefill answered with
    echoed: set[int] = field(default_factory=set)  # native choices that sent the prompt IDs

    @property
    def native(self) -> bool:
        return self.path == COMPLETIONS_PATH

    @property
    def prompt(self) -> list[int]:
        return self.body["prompt" if self.native else "token_ids"]

    @property
    def params(self) -> dict[str, Any]:
        """Sampling fields: nested on the generate route, top-level on the native one."""
        if self.native:
            return {"max_tokens": COMPLETIONS_MAX_TOKENS} | self.body
        return self.body["sampling_params"]


class _EngineDied(Exception):
    """Raised on purpose: uvicorn then closes the connection mid-response."""


class _HideDeliberateDeaths(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _EngineDied))


_DEATHS = _HideDeliberateDeaths()


@dataclass
class _Run:
    id: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    disconnected: bool = False

    async def pause(self, seconds: float) -> bool:
        """Wait `seconds`; True if the run was stopped meanwhile (or already)."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self.stop.wait()
        else:
            await asyncio.sleep(0)  # let the disconnect watcher and other streams run
        return self.stop.is_set()


def default_sentences(vocab_size: int, count: int = 64) -> list[list[int]]:
    """Runs of token IDs in [100, vocab_size), fixed across runs."""
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(4, 12))]
            for _ in range(count)]  # fmt: skip


class FakeVllm:
    def __init__(
        self,
        knobs: Knobs | None = None,
        *,
        eos_token_id: int = 2,
        vocab_size: int = 32000,
        sentences: list[list[int]] | None = None,
        engine_id: str = "fake-vllm-engine",
        max_num_seqs: int = 256,
        block_size: int = 16,
        tokenizer: Tokenizer | None = None,
        trained_on: Permutation | None = None,
    ) -> None:
        self.knobs = knobs or Knobs()
        self.trained_on = trained_on
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.model = CorpusModel(sentences or default_sentences(vocab_size))
        self.engine_id = engine_id  # the `remote_engine_id` a prefill answers with
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.tokenizer = tokenizer  # the native route's `text`; "" without one
        self.requests: list[Received] = []
        self.aborted: list[str] = []  # ids named by abort_requests answered 200, in order
        self.abort_calls = 0  # every abort_requests call, refused ones too
        self.health_checks = 0
        self.disconnected: list[str] = []  # ids whose client left before the end
        self.active: dict[str, _Run] = {}
        self.url = ""
        self._failed = 0
        self._blocks = 0
        self._changed = asyncio.Event()
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Tokenizer,
        eos_token_id: int,
        knobs: Knobs,
        trained_on: Permutation | None = None,
    ) -> FakeVllm:
        """A fake speaking a real model's vocabulary: readable corpus text, its EOS.

        `trained_on`: a model trained on that vocabulary permuted (token obfuscation), which
        speaks physical IDs only; such a server has no tokenizer for the native route's text.
        """
        if trained_on is not None:
            [eos_token_id] = trained_on.to_physical([eos_token_id])
        return cls(
            knobs,
            eos_token_id=eos_token_id,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            sentences=corpus_sentences(tokenizer),
            tokenizer=None if trained_on else tokenizer,
            trained_on=trained_on,
        )

    @property
    def running(self) -> int:
        return len(self.active)

    def reset(self, knobs: Knobs | None = None) -> None:
        """Fresh knobs and records, for the next test on a shared server."""
        self.knobs = knobs or Knobs()
        self.requests.clear()
        self.aborted.clear()
        self.abort_calls = 0
        self.disconnected.clear()
        self._failed = 0

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Until `predicate()` holds; it is checked whenever the fake's state changes."""
        async with asyncio.timeout(timeout):
            while True:
                changed = self._changed
                if predicate():
                    return
                await changed.wait()

    def expected(
        self, token_ids: list[int], sampling_params: dict[str, Any], index: int = 0
    ) -> tuple[list[int], str, int | None]:
        """The whole output of choice `index` for a request, as this fake generates it."""
        seq = self._sequence(token_ids, sampling_params, index)
        out: list[int] = []
        while True:
            ids, finish, reason = seq.step(1)
            out += ids
            if finish:
                return out, finish, reason

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> FakeVllm:
        logging.getLogger("uvicorn.error").addFilter(_DEATHS)
        self.url, self._server, self._task = serve(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None and self._task is not None
        for run in self.active.values():
            run.stop.set()
        self._server.should_exit = True
        await self._task

    def _bump(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in (GENERATE_PATH, COMPLETIONS_PATH) and method == "POST":
            await self._generate(scope, receive, send)
        elif path in ABORT_PATHS and method == "POST":
            await self._abort(receive, send)
        elif path == HEALTH_PATH and method == "GET":
            self.health_checks += 1
            self._bump()
            await send_json(send, self.knobs.health, {} if self.knobs.health == 200 else
                            {"error": "EngineDeadError"})  # fmt: skip
        elif path in (GENERATE_PATH, COMPLETIONS_PATH) or path in ABORT_PATHS:
            await send_json(send, 405, {"detail": "Method Not Allowed"})
        else:
            await send_json(send, 404, {"detail": "Not Found"})

    async def _abort(self, receive: Any, send: Any) -> None:
        body = await read_body(receive)
        try:
            ids = msgspec.json.decode(body).get("request_ids")
        except (msgspec.DecodeError, AttributeError) as exc:
            await send_json(send, 400, _error(400, "Bad Request", f"JSON decode error: {exc}"))
            return
        if ids is None:
            msg = "Missing 'request_ids' in request body"
            await send_json(send, 400, _error(400, "Bad Request", msg))
            return
        self.abort_calls += 1
        if self.abort_calls <= self.knobs.abort_fail_first:
            self._bump()
            msg = f"fake abort failure {self.abort_calls}"
            await send_json(send, 503, _error(503, "ServiceUnavailableError", msg))
            return
        for rid in [ids] if isinstance(ids, str) else ids:
            self.aborted.append(rid)
            run = self.active.get(rid)
            if run is not None:
                run.aborted = True
                run.stop.set()
        self._bump()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _generate(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        raw = await read_body(receive)
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = {"_undecodable": raw.decode("utf-8", "replace")}
        client = scope.get("client")
        rec = Received(
            body=body, headers=headers, client=tuple(client) if client else None,
            path=scope["path"],
        )  # fmt: skip
        self.requests.append(rec)
        self._bump()
        status, error = self._refusal(rec)
        if status:
            rec.status = status
            await send_json(send, status, error)
            return
        prefix = COMPLETIONS_ID_PREFIX if rec.native else REQUEST_ID_PREFIX
        # The native route makes up an id when none is given; generate requires one.
        given = headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex
        rec.id = prefix + str(given)
        if self.knobs.queue_until is not None:
            await self.knobs.queue_until.wait()
        run = self.active[rec.id] = _Run(rec.id)
        self._bump()
        died = False
        try:
            async with asyncio.TaskGroup() as group:
                watcher = None
                if not self.knobs.proxied:  # a proxy would not pass the disconnect on
                    watcher = group.create_task(self._watch_disconnect(receive, run))
                if body.get("stream"):
                    died = await self._stream(rec, run, send)
                else:
                    died = await self._whole(rec, run, send)
                if watcher is not None:
                    watcher.cancel()
        finally:
            del self.active[rec.id]
            if run.disconnected:
                self.disconnected.append(rec.id)
            self._bump()
        if died:
            raise _EngineDied(rec.id)

    def _refusal(self, rec: Received) -> tuple[int, dict[str, Any]]:
        """What vLLM would refuse before generating: (status, body), or (0, {})."""
        k, body = self.knobs, rec.body
        if rec.native:
            problem = self._invalid_native(body)
            return (400, _error(400, "BadRequestError", problem)) if problem else (0, {})
        if k.capability == 404:
            return 404, {"detail": "Not Found"}
        if k.capability == 501:
            msg = "The model does not support generate tokens API"
            return 501, _error(501, "NotImplementedError", msg)
        if k.capability == 403:
            msg = (
                "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them."
            )
            return 403, _error(403, "PermissionDeniedError", msg)
        if k.fail_status and (k.fail_first is None or self._failed < k.fail_first):
            self._failed += 1
            msg = k.error_message or f"fake engine failure {self._failed}"
            return k.fail_status, _error(k.fail_status, _error_type(k.fail_status), msg)
        if rec.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            msg = "Unsupported Media Type: Only 'application/json' is allowed"
            return 400, _error(400, "Bad Request", msg)
        problem = self._invalid(body)
        if problem:
            return 400, _error(400, "BadRequestError", problem)
        return 0, {}

    def _invalid(self, body: dict[str, Any]) -> str | None:
        token_ids = body.get("token_ids")
        if not isinstance(token_ids, list) or not token_ids:
            return "token_ids: at least one token is required"
        if not all(isinstance(t, int) and 0 <= t for t in token_ids):
            return "token_ids must not contain negative values"
        if not isinstance(body.get("request_id"), str):
            return "request_id: a string is required"
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            return "sampling_params: field required"
        unknown = sorted(set(params) - SAMPLING_FIELDS)
        if unknown:
            return f"sampling_params: unknown field(s) {unknown}"
        if body.get("output_mode", "tokens") != "tokens":
            return (
                f"output_mode={body['output_mode']!r} requires a tokenizer, but this server "
                "does not load one (--tokens-only or --skip-tokenizer-init)."
            )
        if params.get("stop"):
            return (
                "stop strings are not supported on a --tokens-only server because "
                "detokenization is disabled."
            )
        if params.get("n", 1) > self.max_num_seqs:
            return (
                f"sampling_params.n must be at most the server's max_num_seqs "
                f"({self.max_num_seqs}), got {params['n']}."
            )
        return None

    def _invalid_native(self, body: dict[str, Any]) -> str | None:
        """The native route with a token-ID prompt: what vLLM (or this fake) refuses."""
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return "prompt: the fake serves non-empty token-ID prompts only"
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            return f"prompt: token IDs must lie in [0, {self.vocab_size})"
        if not isinstance(body.get("request_id", ""), str):
            return "request_id: a string is required"
        unknown = sorted(set(body) - COMPLETION_FIELDS)
        if unknown:
            return f"unknown field(s) {unknown}"
        if body.get("stop"):
            return "stop strings are not simulated by the fake"
        if body.get("n", 1) > self.max_num_seqs:
            return f"n must be at most the server's max_num_seqs ({self.max_num_seqs})"
        return None

    async def _watch_disconnect(self, receive: Any, run: _Run) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        run.disconnected = True
        run.stop.set()

    def _sequences(self, rec: Received) -> list[tuple[int, Sequence]]:
        params = rec.params
        n = params.get("n", 1)
        for i in range(n):
            rec.outputs[i] = []
        return [(i, self._sequence(rec.prompt, params, i)) for i in range(n)]

    def _sequence(self, prompt: list[int], params: dict[str, Any], index: int) -> Sequence:
        if params.get("max_tokens") is None:  # vLLM's default: what the context leaves
            params = {**params, "max_tokens": self.knobs.max_model_len - len(prompt)}
        converted = msgspec.convert(params, SamplingParams, strict=False)
        return Sequence(
            self.model, self.eos_token_id, prompt, converted, index, self.knobs.output_len,
            self.trained_on,
        )  # fmt: skip

    def _dies(self, rec: Received) -> bool:
        first = self.knobs.die_first
        return first is None or self.requests.index(rec) < first

    def _step(
        self, rec: Received, index: int, seq: Sequence
    ) -> tuple[list[int], str | None, int | None]:
        ids, finish, reason = seq.step(max(self.knobs.chunk_size, 1))
        rec.outputs[index] += ids
        if finish:
            rec.finish[index] = finish
        return ids, finish, reason

    def _chunk(
        self, rec: Received, index: int, ids: list[int], finish: str | None, reason: int | None
    ) -> dict[str, Any]:
        """A stream event with one choice's delta, on the route the request came by."""
        if not rec.native:
            lp = self._logprobs(ids, rec.params) if finish != "abort" else None
            return _stream_event(rec.id, [_stream_choice(index, ids, finish, reason, lp)])
        choice = self._completion_choice(rec, index, ids, finish, reason)
        if rec.body.get("return_token_ids") and index not in rec.echoed:
            choice["prompt_token_ids"] = rec.prompt  # each choice's first event only
            rec.echoed.add(index)
        return {"id": rec.id, "object": "text_completion", "created": int(time.time()),
                "model": "fake", "choices": [choice], "kv_transfer_params": None}  # fmt: skip

    def _completion_choice(
        self, rec: Received, index: int, ids: list[int], finish: str | None, reason: int | None
    ) -> dict[str, Any]:
        """A CompletionResponse[Stream]Choice, as vLLM's completions route dumps it."""
        return {
            "index": index,
            "text": self.tokenizer.decode(ids) if self.tokenizer else "",
            "logprobs": self._completion_logprobs(rec, ids),
            "finish_reason": finish,
            "stop_reason": reason,
            "prompt_token_ids": None,
            "token_ids": ids if rec.body.get("return_token_ids") else None,
            "weight_versions": None,
        }

    async def _stream(self, rec: Received, run: _Run, send: Any) -> bool:
        """Server-sent events as vLLM's serve_tokens_stream_generator frames them.

        Returns True when the knobs say the engine dies here.
        """
        start = {"type": "http.response.start", "status": 200,
                 "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}  # fmt: skip
        await send(start)
        sequences = self._sequences(rec)
        events = 0
        stopped = await run.pause(self.knobs.ttft)
        while sequences and not stopped:
            for index, seq in list(sequences):
                k = self.knobs
                if k.die_after is not None and events >= k.die_after and self._dies(rec):
                    return True
                if k.error_after is not None and events >= k.error_after:
                    message = k.error_message or "Internal server error"
                    error = _error(k.error_status, _error_type(k.error_status), message)
                    await _event(send, error)
                    await _event(send, "[DONE]", last=True)
                    return False
                if k.stall_after is not None and events >= k.stall_after:
                    await run.stop.wait()
                    stopped = True
                    break
                ids, finish, reason = self._step(rec, index, seq)
                await _event(send, self._chunk(rec, index, ids, finish, reason))
                events += 1
                if finish:
                    sequences.remove((index, seq))
            if sequences and not stopped:
                stopped = await run.pause(self.knobs.itl)
        if run.disconnected:
            return False  # nobody to tell
        for index, _ in sequences:  # aborted: vLLM still sends each choice's finish
            rec.finish[index] = "abort"
            await _event(send, self._chunk(rec, index, [], "abort", None))
        if (rec.body.get("stream_options") or {}).get("include_usage"):
            if rec.native:
                usage = {"id": rec.id, "object": "text_completion", "created": int(time.time()),
                         "model": "fake", "choices": [], "usage": self._usage(rec)}  # fmt: skip
            else:
                usage = {"request_id": rec.id, "usage": self._usage(rec),
                         "output_mode": "tokens", "choices": []}  # fmt: skip
            await _event(send, usage)
        await _event(send, "[DONE]", last=True)
        return False

    async def _whole(self, rec: Received, run: _Run, send: Any) -> bool:
        """One GenerateTokensResponse, as vLLM's serve_tokens_full_generator builds it (or a
        CompletionResponse on the native route)."""
        sequences = self._sequences(rec)
        reasons: dict[int, int | None] = {}
        steps = 0
        stopped = await run.pause(self.knobs.ttft)
        while sequences and not stopped:
            k = self.knobs
            if k.die_after is not None and steps >= k.die_after and self._dies(rec):
                return True
            if k.stall_after is not None and steps >= k.stall_after:
                await run.stop.wait()
                break
            for index, seq in list(sequences):
                _, finish, reasons[index] = self._step(rec, index, seq)
                if finish:
                    sequences.remove((index, seq))
            steps += 1
            if sequences:
                stopped = await run.pause(k.itl)
        if run.disconnected:
            return False
        for index, _ in sequences:
            rec.finish[index] = "abort"
        usage = self._usage(rec)
        usage.setdefault("prompt_tokens_details", None)
        usage.update(completion_tokens_details=None)
        if rec.native:
            await send_json(send, 200, self._completion_response(rec, reasons, usage))
            return False
        choices = [
            {
                "index": index,
                "finish_reason": rec.finish[index],
                "stop_reason": reasons.get(index),
                "token_ids": ids,
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": self._logprobs(ids, rec.params),
            }
            for index, ids in sorted(rec.outputs.items())
        ]
        rec.kv_transfer_params = self._handed_over(rec)
        response = {
            "request_id": rec.id,
            "model": "fake",
            "created": int(time.time()),
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": rec.kv_transfer_params,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": choices,
        }
        await send_json(send, 200, response)
        return False

    def _completion_response(
        self, rec: Received, reasons: dict[int, int | None], usage: dict[str, Any]
    ) -> dict[str, Any]:
        choices = []
        for index, ids in sorted(rec.outputs.items()):
            choice = self._completion_choice(rec, index, ids, rec.finish[index], reasons.get(index))
            if rec.body.get("return_token_ids"):
                choice["prompt_token_ids"] = rec.prompt
            choices.append(choice | {"prompt_logprobs": None, "routed_experts": None})
        return {"id": rec.id, "object": "text_completion", "created": int(time.time()),
                "model": "fake", "choices": choices, "service_tier": None,
                "system_fingerprint": None, "usage": usage, "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None}  # fmt: skip

    def _handed_over(self, rec: Received) -> dict[str, Any] | None:
        """A prefill leg's answer, shaped like vLLM's NIXL connector's request_finished: only
        when asked to keep the KV for a remote decode and stopped by max_tokens."""
        asked = rec.body.get("kv_transfer_params") or {}
        if not asked.get("do_remote_decode") or rec.finish.get(0) != "length":
            return None
        blocks = math.ceil(len(rec.prompt) / self.block_size)
        first, self._blocks = self._blocks, self._blocks + blocks
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(first, first + blocks)),
            "remote_engine_id": self.engine_id,
            "remote_request_id": rec.id,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }

    def _usage(self, rec: Received) -> dict[str, Any]:
        prompt = len(rec.prompt)
        completion = sum(len(ids) for ids in rec.outputs.values())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}  # fmt: skip
        if self.knobs.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.knobs.cached_tokens}
        return usage

    def _completion_logprobs(self, rec: Received, ids: list[int]) -> dict[str, Any] | None:
        """Completions-shaped logprobs (vLLM's CompletionLogProbs): per token its name and
        logprob, and `logprobs + 1` candidates by name, the sampled token first; names are
        `token_id:<id>` with `return_tokens_as_token_ids`, else the token's text."""
        k = rec.body.get("logprobs")
        generated = self._logprobs(ids, {"logprobs": k + 1}) if k is not None else None
        if generated is None:
            return None

        def name(tid: int) -> str:
            if rec.body.get("return_tokens_as_token_ids") or self.tokenizer is None:
                return f"token_id:{tid}"
            return self.tokenizer.decode([tid])

        tokens = [name(c["token_id"]) for c in generated["content"]]
        offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {
            "text_offset": offsets,
            "token_logprobs": [c["logprob"] for c in generated["content"]],
            "tokens": tokens,
            "top_logprobs": [
                {name(t["token_id"]): t["logprob"] for t in c["top_logprobs"]}
                for c in generated["content"]
            ],
        }

    def _logprobs(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any] | None:
        """Generate-shaped logprobs: integer ids; `top_logprobs` is the sampled token first,
        then the rest of the top k (k entries, since the sampled token ranks first)."""
        k = params.get("logprobs")
        if k is None:
            return None
        content = []
        for tid in ids:
            lp = -0.25 - (tid % 7) / 8
            top = [{"token_id": tid, "logprob": lp, "rank": 1}]
            top += [{"token_id": (tid + j * 7919) % self.vocab_size, "logprob": lp - j,
                     "rank": j + 1} for j in range(1, k)]  # fmt: skip
            content.append({"token_id": tid, "logprob": lp, "rank": 1, "top_logprobs": top})
        return {"content": content}


# -- wire helpers ------------------------------------------------------------------------------


def _error_type(code: int) -> str:
    """The error type vLLM's error responses give a status."""
    types = {400: "BadRequestError", 422: "UnprocessableEntityError"}
    return types.get(code, "InternalServerError")


def _error(code: int, type_: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _stream_choice(
    index: int,
    ids: list[int],
    finish: str | None,
    reason: int | None,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {"index": index, "finish_reason": finish, "stop_reason": reason, "token_ids": ids,
            "routed_experts": None, "sampling_mask": None, "weight_versions": None,
            "logprobs": logprobs}  # fmt: skip


def _stream_event(request_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"request_id": request_id, "usage": None, "output_mode": "tokens", "choices": choices}


async def _event(send: Any, data: dict[str, Any] | str, last: bool = False) -> None:
    payload = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    body = b"data: " + payload + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": not last})
