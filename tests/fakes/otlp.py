"""An OTLP/HTTP trace collector: `POST /v1/traces` with protobuf bodies, as the SDK's
exporter sends them, decoded into the spans they carry."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.fakes.http import read_body, send_body, serve


@dataclass
class Received:
    name: str
    kind: int  # the protobuf's: 1 internal, 2 server, 3 client
    trace_id: str
    span_id: str
    parent: str  # "" for a root
    attributes: dict[str, Any]
    error: str  # the status message of a span that failed, else ""
    events: list[str]
    service: str


@dataclass
class Collector:
    spans: list[Received] = field(default_factory=list)
    url: str = ""
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aenter__(self) -> Collector:
        self.url, self._server, self._task = serve(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        await self._task

    async def until(self, count: int, trace_id: str, timeout: float = 30) -> list[Received]:
        """The spans of `trace_id`, once `count` of them arrived."""
        async with asyncio.timeout(timeout):
            while len(found := [s for s in self.spans if s.trace_id == trace_id]) < count:
                self._changed.clear()
                await self._changed.wait()
        return found

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/traces" or scope["method"] != "POST":
            await send_body(send, 404, b"", b"text/plain")
            return
        export = ExportTraceServiceRequest.FromString(await read_body(receive))
        for resource in export.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scoped in resource.scope_spans:
                for span in scoped.spans:
                    self.spans.append(Received(
                        name=span.name, kind=span.kind, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        error=span.status.message, events=[e.name for e in span.events],
                        service=attrs.get("service.name", ""),
                    ))  # fmt: skip
        self._changed.set()
        await send_body(send, 200, ExportTraceServiceRequest().SerializeToString(),
                        b"application/x-protobuf")  # fmt: skip


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value"))
