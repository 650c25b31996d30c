"""The end-to-end benchmark runs in a tiny configuration, so it cannot rot. Nothing about speed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench import (
    batch_interference,
    derender,
    derender_route,
    e2e,
    ledger_read,
    ledger_writer,
    owner_memory,
    soak,
)
from tests.conftest import Stack
from tokenway import ledger
from tokenway.model import default_model_dir, load_model_info
from tokenway.parsers import REASONING_PARSERS, TOOL_PARSERS

in_session_loop = pytest.mark.asyncio(loop_scope="session")

CONCURRENCY, MAX_TOKENS = 4, 10
ROOT = str(Path(__file__).resolve().parents[1])


@in_session_loop
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
        "ledger",
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
    assert set(memory) == {*e2e.processes(cfg), "total"}
    for name in e2e.processes(cfg):
        assert memory[name]["idle_kb"] > 0 and memory[name]["loaded_kb"] > 0, name
        assert isinstance(memory[name]["per_stream_kb"], float)

    nats = report["nats"]
    assert nats["sse_chunks"] >= CONCURRENCY * 2  # at least content + usage per stream
    for key in ("in_msgs", "out_msgs", "in_msgs_per_chunk", "out_msgs_per_token"):
        assert nats[key] > 0, key
    assert set(report["cpu"]) == {*e2e.processes(cfg), "bench client"}
    # Every stream commits; a round stores at most one message per request.
    ledger = report["ledger"]
    assert ledger["records"] >= CONCURRENCY and ledger["rounds"] > 0
    assert 1 <= ledger["records_per_round"] <= CONCURRENCY

    assert "TTFT p50" in e2e.render_table(report)


@in_session_loop
async def test_the_direct_path_delivers_text_as_a_client_gets_it(tmp_path: Path) -> None:
    """A token inside a multi-byte character releases no text, on the direct path as
    through a server: it is no delivery (stream 0's output has such characters early)."""
    cfg = e2e.BenchConfig(concurrency=1, max_tokens=12, itl=0.001, ttft=0.0)
    model = load_model_info(default_model_dir(tmp_path))
    tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    engine = e2e.direct_engine(cfg, model, tokenizer)
    (trace,) = await e2e.run_direct(cfg, engine, e2e.rendered_prompts(cfg, model))
    assert trace.error is None and trace.tokens == 12
    assert 0 < len(trace.deliveries) < trace.tokens


@in_session_loop
@pytest.mark.timeout(60)
async def test_tiny_owner_memory_benchmark_reports_every_process() -> None:
    cfg = e2e.BenchConfig(
        concurrency=3, max_tokens=40, chunk_size=8, idle_seconds=0.2, warmup=1,
        sample_interval=0.05,
    )  # fmt: skip
    report = await owner_memory.run(cfg)

    streams = report["pipeline"]["streams"]
    assert streams["errors"] == 0, streams["first_error"]
    assert streams["output_tokens"] == 3 * 40
    memory = report["pipeline"]["memory"]
    assert set(memory) == set(e2e.processes(cfg))
    for name, row in memory.items():
        assert 0 < row["idle_kb"] <= row["peak_kb"], name
        assert row["at_100pct_kb"] > 0, name  # the clients counted every token as it came

    own = report["in_process"]
    assert own["streams"] == 3 and own["bytes_per_stream"]["owned"] > 0
    assert set(own["bytes_per_token"]) == {"at_25pct", "at_50pct", "at_75pct", "at_100pct"}
    for share, per_token in own["bytes_per_token"].items():
        assert per_token >= 4, share  # an array('i') holds 4 bytes a token, at least
    assert "per committed token" in owner_memory.render_table(report)


def test_a_least_squares_fit_recovers_a_line() -> None:
    assert owner_memory.fit([(0, 5), (10, 45), (20, 85), (30, 125)]) == (5.0, 4.0)
    assert owner_memory.fit([(0, 5), (10, 45)]) is None  # too few points to tell noise
    assert owner_memory.fit([(7, 5), (7, 6), (7, 7)]) is None  # no spread in x


@in_session_loop
@pytest.mark.timeout(60)
async def test_tiny_ledger_writer_benchmark_stores_on_both_framings() -> None:
    """`run` raises when a publish is not stored; both framings report a cost."""
    result = await ledger_writer.run(streams=3, rounds=2)
    assert set(result) == {"hpub", "nats-py"} and all(v > 0 for v in result.values())


@in_session_loop
@pytest.mark.timeout(60)
async def test_tiny_ledger_read_benchmark_reads_one_request_within_its_own_output() -> None:
    """A request of 100 tokens among 20 others: its read takes its index and a segment's
    worth of rounds, where a record per event took one read per token."""
    result = await ledger_read.run(tokens=100, others=20)
    assert result["per_event"]["records_read"] == 100
    assert result["rounds"]["records_read"] <= 100 // ledger.SEGMENT_TOKENS + ledger.SEGMENT_TOKENS
    assert result["rounds"]["records_stored"] < result["per_event"]["records_stored"] * 21 / 4


@in_session_loop
@pytest.mark.timeout(90)
async def test_tiny_batch_interference_benchmark_reports_both_runs() -> None:
    cfg = e2e.BenchConfig(concurrency=CONCURRENCY, max_tokens=MAX_TOKENS, warmup=2)
    report = await batch_interference.run(cfg, lines=40, line_tokens=8, concurrency=8, rounds=2)
    for side in ("alone", "with_batch"):
        assert report[side]["errors"] == 0, report[side]["first_error"]
        assert report[side]["output_tokens"] == 2 * CONCURRENCY * MAX_TOKENS  # both rounds
    assert report["batch"]["lines_answered"] >= 4 and report["batch"]["lines_per_s"] > 0
    assert set(report["ttft_ratio"]) == {"p50", "p99"}
    assert "ttft p50" in batch_interference.table(report)


@in_session_loop
@pytest.mark.timeout(120)
async def test_a_tiny_soak_reports_every_process_and_its_growth() -> None:
    args = argparse.Namespace(code=ROOT, minutes=0.06, warmup_minutes=0.02, clients=2,
                              sample=1.0, itl=0.001, json=None)  # fmt: skip
    report = await soak.run(args)
    assert report["requests"] > 0 and report["errors"] == {}, report["outcomes"]
    assert set(report["growth_after_warmup_mb"]) == {"up", "nats-server"}
    assert len(report["samples"]) >= 2 and all(s["up"] > 0 for s in report["samples"])
    assert "growth after the warm-up" in soak.table(report)


@in_session_loop
async def test_tiny_derender_route_benchmark_carries_a_state_that_stays_small(
    stack: Stack,
) -> None:
    result = await derender_route.run(stack.url, None, tokens=120)
    ours = result["tokenway"]
    assert result["tokens"] == ours["calls"] == 120 and ours["text_chars"] > 0
    assert ours["state_bytes_late"] < 2 * ours["state_bytes_early"]


def test_tiny_derender_benchmark_measures_every_parser_with_a_state_that_stays_small() -> None:
    # run() also derenders each tool row whole and raises unless it is the write_file call
    report = derender.run(1_200)
    assert set(report) == {
        "plain",
        *(f"reasoning {p}" for p in REASONING_PARSERS),
        *(f"tool {p}" for p in TOOL_PARSERS),
    }
    for name, row in report.items():
        assert row["tokens"] >= 1_200 and row["chunk1_tok_s"] > 0 and row["chunk8_tok_s"] > 0
        sizes = row["state_bytes"]
        assert set(sizes) == {100, 1_000, "end"}, name
        assert max(sizes.values()) <= sizes[100] + 64, (name, sizes)
    assert "| tool qwen3_coder |" in derender.table(report)
