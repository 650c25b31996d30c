"""The ingress's own Prometheus metrics, on the process's registry beside every stage's: the
API's /metrics and the --metrics-port page are one page. Several ingresses may share a process
(`up`, the tests): they count into the same families, so each family is registered once."""

from __future__ import annotations

import weakref

from prometheus_client import Counter, Gauge

from ingress.body_rate import BodyRate

OTHER = "other"  # the `api` of every answer but the completion and tokenize routes

REQUESTS = Counter(
    "tokenway_requests", "Every answer, by route (api) and HTTP status", ["api", "status"]
)
ACTIVE = Gauge("tokenway_active_streams", "Open SSE streams")
_BODY_RATES: list[weakref.ref[BodyRate]] = []  # each live ingress's, summed on a scrape


def _bodies_waiting() -> float:
    _BODY_RATES[:] = [ref for ref in _BODY_RATES if ref() is not None]
    return sum(rate.waiting for ref in _BODY_RATES if (rate := ref()) is not None)


BODIES_WAITING = Gauge(
    "tokenway_bodies_waiting", "Request bodies waiting, unread, for their client's --max-body-rate"
)
BODIES_WAITING.set_function(_bodies_waiting)


class Metrics:
    """One ingress's handles on the process's families."""

    def __init__(self, body_rate: BodyRate) -> None:
        self.requests = REQUESTS
        self.active = ACTIVE
        _BODY_RATES.append(weakref.ref(body_rate))
