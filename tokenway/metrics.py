"""Metrics every stage keeps, on the process's registry: how long each stage's part of the
work takes, and what went to the dead letters."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# fmt: off
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0)
# fmt: on
STAGE_SECONDS = Histogram(
    "tokenway_stage_seconds",
    "One stage's part: render (a request, queued to the schedulers), engine_first_token "
    "(from the hand-off to an engine to its first output), derender and commit (one round "
    "of engine output, derendered, stored in TW_OUT), sse_write (one write to a client)",
    ["stage"],
    buckets=_BUCKETS,
)
LEDGER_ROUND = Histogram(
    "tokenway_ledger_round_records",
    "Ledger messages an owner's commit round stores together (one per request with output "
    "in it): the larger, the less each costs the server",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
RENDER = STAGE_SECONDS.labels("render")
ENGINE_FIRST_TOKEN = STAGE_SECONDS.labels("engine_first_token")
DERENDER = STAGE_SECONDS.labels("derender")
COMMIT = STAGE_SECONDS.labels("commit")
SSE_WRITE = STAGE_SECONDS.labels("sse_write")
DEAD_LETTERS = Counter("tokenway_dead_letters", "Messages moved to TW_DLQ, by stage", ["stage"])
BUS_ERRORS = Counter(
    "tokenway_bus_errors",
    "NATS errors after connecting (lost connections, slow consumers, server errors), by stage",
    ["stage"],
)
