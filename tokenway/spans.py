"""OpenTelemetry spans of each stage's part of a request, exported over OTLP/HTTP.

Off unless `--otlp-endpoint` is given (and the `otel` extra installed): `start` then hands
back `OFF`, which does nothing, and the request's `traceparent` travels on unchanged
(`tokenway.trace`). On, the ingress's span is the client's child (or a trace's root), and
render's, the owner's and each engine attempt's are children of the hop before them that
handed the request on: ingress → render and schedule, schedule → generate → the engine's
own spans (vLLM joins with the bridge's `traceparent`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

# the SDK's, once `configure` ran (imported only then: the extra may not be installed)
_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_kinds: Any = None


class Span:
    """A span that is not recorded: tracing is off."""

    def traceparent(self) -> str | None:
        """The context a next hop's span is a child of; None when off."""
        return None

    def set(self, **attributes: str | int | float | bool) -> None:
        pass

    def event(self, name: str) -> None:
        pass

    def end(self, error: str | None = None) -> None:
        pass


OFF = Span()


class _Recorded(Span):
    def __init__(self, span: Any) -> None:
        self._span = span

    def traceparent(self) -> str:
        ctx = self._span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def set(self, **attributes: str | int | float | bool) -> None:
        self._span.set_attributes({f"tokenway.{k}": v for k, v in attributes.items()})

    def event(self, name: str) -> None:
        self._span.add_event(name)

    def end(self, error: str | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


def start(
    name: str, parent: str | None, kind: str = "internal", **attributes: str | int | float | bool
) -> Span:
    """A span of `name`, child of the W3C `parent` (a trace's root without one)."""
    if _tracer is None:
        return OFF
    context = _propagator.extract({"traceparent": parent}) if parent else None
    span = _tracer.start_span(
        name,
        context=context,
        kind=_kinds[kind.upper()],
        attributes={f"tokenway.{k}": v for k, v in attributes.items()},
    )
    return _Recorded(span)


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP collector's traces URL: `endpoint` as given when it names a path, else
    the collector's base with the standard `/v1/traces`."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp-endpoint must be http(s)://host:port[/path], got {endpoint!r}")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def configure(endpoint: str, service: str = "tokenway") -> None:
    """Spans from now on, batched to the collector at `endpoint` (by a thread of the SDK's)."""
    global _tracer, _provider, _propagator, _kinds
    url = traces_url(endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        raise ValueError(
            f"--otlp-endpoint needs the OpenTelemetry SDK: pip install 'tokenway[otel]' ({exc})"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _provider, _tracer = provider, provider.get_tracer("tokenway")
    _propagator, _kinds = TraceContextTextMapPropagator(), SpanKind


def shutdown() -> None:
    """Export what is left and stop: spans after this are not recorded."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
