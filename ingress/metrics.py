"""The ingress's own Prometheus metrics (the page also carries the process's registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

OTHER = "other"  # the `api` of every answer but the completion and tokenize routes


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenway_requests", "Every answer, by route (api) and HTTP status", ["api", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.active = Gauge("tokenway_active_streams", "Open SSE streams", registry=self.registry)
        self.body_waiting = Gauge(
            "tokenway_bodies_waiting", "Request bodies waiting, unread, for their client's "
            "--max-body-rate", registry=self.registry,
        )  # fmt: skip
