"""The end-to-end benchmark runs in a tiny configuration, so it cannot rot. Nothing about speed."""

from __future__ import annotations

import pytest

from bench import e2e

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONCURRENCY, MAX_TOKENS = 4, 10


@pytest.mark.timeout(60)
async def test_tiny_benchmark_reports_every_figure() -> None:
    cfg = e2e.BenchConfig(
        concurrency=CONCURRENCY, max_tokens=MAX_TOKENS, idle_seconds=0.2, warmup=2
    )
    report = await e2e.run(cfg)

    assert set(report) == {
        "config",
        "machine",
        "direct",
        "pipeline",
        "overhead",
        "memory",
        "nats",
        "cpu",
    }
    for path in ("direct", "pipeline"):
        side = report[path]
        assert side["errors"] == 0, side["first_error"]
        assert side["output_tokens"] == CONCURRENCY * MAX_TOKENS
        assert side["tokens_per_s"] > 0
        for metric in ("ttft_ms", "itl_ms", "tpot_ms"):
            assert side[metric]["p50"] > 0 and side[metric]["p99"] > 0, (path, metric)
    assert set(report["overhead"]) >= {"ttft_p50", "ttft_p99", "itl_p50", "itl_p99"}
    assert report["overhead"]["tokens_per_s_ratio"] > 0

    memory = report["memory"]
    assert set(memory) == {*e2e.PROCESSES, "total"}
    for name in e2e.PROCESSES:
        assert memory[name]["idle_kb"] > 0 and memory[name]["loaded_kb"] > 0, name
        assert isinstance(memory[name]["per_stream_kb"], float)

    nats = report["nats"]
    assert nats["sse_chunks"] >= CONCURRENCY * 2  # at least content + usage per stream
    for key in ("in_msgs", "out_msgs", "in_msgs_per_chunk", "out_msgs_per_token"):
        assert nats[key] > 0, key
    assert set(report["cpu"]) == {*e2e.PROCESSES, "bench client"}

    assert "TTFT p50" in e2e.render_table(report)
