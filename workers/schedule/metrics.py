"""Request metrics as vLLM names them (`vllm:` → `tokenway:`, the same `model_name` label),
kept by the schedule worker that owns each request: it sees the request from its arrival in
TW_SCHED to its last committed chunk. On the process's registry: `up`'s `/metrics` page,
or `--metrics-port` where a stage runs on its own."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tokenway.metrics import ENGINE_FIRST_TOKEN
from workers.schedule.owned import Cancelled, Owned

# vLLM's own buckets for these families, so dashboards built for it read the same.
# fmt: off
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
            60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
_MODEL = ["model_name"]

TTFT = Histogram(
    "tokenway:time_to_first_token_seconds",
    "From the request's arrival at the schedulers to its engine's first output token",
    _MODEL,
    buckets=_TTFT,
)
ITL = Histogram(
    "tokenway:inter_token_latency_seconds",
    "Between two engine steps of one request's output",
    _MODEL,
    buckets=_ITL,
)
E2E = Histogram(
    "tokenway:e2e_request_latency_seconds",
    "From the request's arrival at the schedulers to its end",
    _MODEL,
    buckets=_LATENCY,
)
QUEUE = Histogram(
    "tokenway:request_queue_time_seconds",
    "From the request's arrival at the schedulers to its hand-off to an engine",
    _MODEL,
    buckets=_LATENCY,
)
PROMPT_TOKENS = Counter("tokenway:prompt_tokens", "Prompt tokens of requests started", _MODEL)
GENERATION_TOKENS = Counter(
    "tokenway:generation_tokens", "Output tokens committed to clients", _MODEL
)
RUNNING = Gauge("tokenway:num_requests_running", "Requests on an engine now", _MODEL)
WAITING = Gauge("tokenway:num_requests_waiting", "Requests waiting for an engine", _MODEL)
SUCCESS = Counter(
    "tokenway:request_success",
    "Requests that ended with output, by why they ended (every choice's reason)",
    [*_MODEL, "finished_reason"],
)
FAILURE = Counter(
    "tokenway:request_failure", "Requests that ended with an error, by status", [*_MODEL, "status"]
)
RELAYS = Counter("tokenway:relays", "Attempts continued on another engine after one failed", _MODEL)
TAKEOVERS = Counter(
    "tokenway:takeovers", "Requests picked up from the ledger after their owner stopped", _MODEL
)


class Observed:
    """One model's children of the families above, looked up once rather than per token."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.ttft = TTFT.labels(model)
        self.itl = ITL.labels(model)
        self.e2e = E2E.labels(model)
        self.prompt_tokens = PROMPT_TOKENS.labels(model)
        self.generation_tokens = GENERATION_TOKENS.labels(model)
        self.relays = RELAYS.labels(model)
        self.takeovers = TAKEOVERS.labels(model)

    def output(self, r: Owned, now: float) -> None:
        """An engine step brought some of the request's output (`now`: that step's time,
        the same for every choice it carries; its tokens are counted per step, `step`)."""
        if r.first_token is None:
            r.first_token = now
            r.span.event("first token")
            self.ttft.observe(max(now - r.arrived, 0.0))
            ENGINE_FIRST_TOKEN.observe(max(now - (r.dispatched or r.arrived), 0.0))
            self.prompt_tokens.inc(len(r.request.token_ids))
        elif now != r.last_token:
            self.itl.observe(now - r.last_token)
        r.last_token = now

    def step(self, tokens: int) -> None:
        if tokens:
            self.generation_tokens.inc(tokens)

    def ended(self, r: Owned, now: float) -> None:
        self.e2e.observe(max(now - r.arrived, 0.0))
        if r.error is not None:
            FAILURE.labels(self.model, str(r.error.status)).inc()
        elif isinstance(r.end, Cancelled):
            SUCCESS.labels(self.model, "abort").inc()
        else:
            for choice in r.choices:
                SUCCESS.labels(self.model, str(choice.finish)).inc()
