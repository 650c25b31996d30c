"""Metrics every stage keeps, on the process's registry: how long each stage's part of the
work takes, and what went to the dead letters."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

STAGE_SECONDS = Histogram(
    "tokenway_stage_seconds",
    "One stage's part: render (a request, queued to the schedulers), derender and commit "
    "(one round of engine output, derendered, stored in TW_OUT)",
    ["stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
             0.5, 1.0, 2.5, 5.0, 10.0),
)  # fmt: skip
RENDER = STAGE_SECONDS.labels("render")
DERENDER = STAGE_SECONDS.labels("derender")
COMMIT = STAGE_SECONDS.labels("commit")
DEAD_LETTERS = Counter("tokenway_dead_letters", "Messages moved to TW_DLQ, by stage", ["stage"])
