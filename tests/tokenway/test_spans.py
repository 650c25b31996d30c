"""Where `--otlp-endpoint` sends spans, and what it refuses."""

from __future__ import annotations

import pytest

from tokenway import spans


def test_the_traces_path_is_added_to_a_collectors_base_url_only() -> None:
    assert spans.traces_url("http://otel:4318") == "http://otel:4318/v1/traces"
    assert spans.traces_url("http://otel:4318/") == "http://otel:4318/v1/traces"
    assert spans.traces_url("https://otel/custom/traces") == "https://otel/custom/traces"
    with pytest.raises(ValueError, match="--otlp-endpoint must be http"):
        spans.traces_url("otel:4317")


def test_spans_are_off_until_configured() -> None:
    span = spans.start("render", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert span is spans.OFF and span.traceparent() is None
