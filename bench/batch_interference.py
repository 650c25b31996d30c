"""Interactive latency while a batch runs: rounds of N interactive streams through the
pipeline alone, then the same rounds while a B-line Batch API batch runs on the same
engines, in one run.

The pipeline runs as separate processes (`bench/e2e.py`'s), with a batch runner; the
batch is submitted through `POST /v1/files` and `POST /v1/batches` and is running (lines
answered) before the second measurement starts. Target: interactive TTFT p50 with the
batch ≤ 1.2× without.

    python bench/batch_interference.py --concurrency 32 --max-tokens 64 --batch-lines 10000 \
        [--batch-concurrency 64] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.e2e import (
    BenchConfig,
    Pipeline,
    arg_parser,
    bench_config,
    open_clients,
    run_async,
    run_load,
    running_pipeline,
    stop_on_sigterm,
    summarize,
    warm_up,
)

BATCH_PROMPT = "Batch line {i}: summarize the history of tokenization in one paragraph."


def batch_file(lines: int, max_tokens: int) -> bytes:
    """Lines of half to one and a half times `max_tokens` each: lines of one length would
    start and end in lockstep, in waves a real batch does not make."""
    return b"".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": BATCH_PROMPT.format(i=i)}],
                 "max_tokens": max_tokens // 2 + (i * 7919) % (max_tokens + 1),
                 "ignore_eos": True, "seed": i},
    }).encode() + b"\n" for i in range(lines))  # fmt: skip


async def start_batch(http: httpx.AsyncClient, url: str, data: bytes) -> str:
    files = {"file": ("bench.jsonl", data, "application/jsonl")}
    up = await http.post(f"{url}/v1/files", files=files, data={"purpose": "batch"})
    up.raise_for_status()
    made = await http.post(f"{url}/v1/batches", json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    })  # fmt: skip
    made.raise_for_status()
    return made.json()["id"]


async def batch_state(http: httpx.AsyncClient, url: str, batch_id: str) -> dict[str, Any]:
    return (await http.get(f"{url}/v1/batches/{batch_id}")).json()


async def answered(http: httpx.AsyncClient, url: str, batch_id: str) -> int:
    return (await batch_state(http, url, batch_id))["request_counts"]["completed"]


async def measured(
    cfg: BenchConfig, pipeline: Pipeline, clients: list[httpx.AsyncClient], rounds: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """`rounds` interactive loads, one after the other, summarized together (one burst
    meets a batch at one moment of its cycle; several meet it at several), and the cores
    each process used meanwhile (this one, the load's clients, as `bench`)."""
    before, began, mine = pipeline.cpu(), time.perf_counter(), time.process_time()
    traces = []
    for _ in range(rounds):
        traces += (await run_load(cfg, pipeline, clients)).traces
    wall = time.perf_counter() - began
    after = pipeline.cpu()
    cores = {name: (after[name] - before[name]) / wall for name in after}
    cores["bench"] = (time.process_time() - mine) / wall
    return summarize(traces), cores


async def run(
    cfg: BenchConfig, lines: int, line_tokens: int, concurrency: int, rounds: int
) -> dict:
    with tempfile.TemporaryDirectory(prefix="tw-bench-batch-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            pipeline = await stack.enter_async_context(running_pipeline(cfg, Path(tmp)))
            tokenway = [sys.executable, "-m", "program.cli"]
            pipeline._spawn("batch", [*tokenway, "batch", "run", "--nats", pipeline.nats_url,
                                      "--data-dir", str(pipeline.data_dir),
                                      "--batch-concurrency", str(concurrency)])  # fmt: skip
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=60.0))
            clients = await open_clients(stack, max(cfg.concurrency, cfg.warmup))
            await warm_up(cfg, pipeline, clients)
            alone, cores_alone = await measured(cfg, pipeline, clients, rounds)

            batch_id = await start_batch(http, pipeline.url, batch_file(lines, line_tokens))
            began = time.monotonic()
            running = min(concurrency, lines) // 2  # answered: the batch is in full swing
            while await answered(http, pipeline.url, batch_id) < running:  # noqa: ASYNC110
                await asyncio.sleep(0.2)  # another process's progress: polled
            during, cores_during = await measured(cfg, pipeline, clients, rounds)
            state = await batch_state(http, pipeline.url, batch_id)
            await http.post(f"{pipeline.url}/v1/batches/{batch_id}/cancel")
            elapsed = time.monotonic() - began
    done = state["request_counts"]["completed"]
    batch = {"batch_lines": lines, "batch_line_tokens": line_tokens,
             "batch_concurrency": concurrency, "rounds": rounds}  # fmt: skip
    ratios = {q: during["ttft_ms"][q] / alone["ttft_ms"][q] for q in ("p50", "p99")}
    return {
        "config": asdict(cfg) | batch,
        "alone": alone,
        "with_batch": during,
        "batch": {"lines_answered": done, "lines_per_s": done / elapsed if elapsed else 0.0},
        "ttft_ratio": ratios,
        "cores": {"alone": cores_alone, "with_batch": cores_during},
    }


def table(r: dict[str, Any]) -> str:
    rows = [f"{'':24}{'alone':>12}{'with batch':>12}{'ratio':>8}"]
    for metric in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            a, b = r["alone"][metric][q], r["with_batch"][metric][q]
            rows.append(f"{metric[:-3] + ' ' + q + ' (ms)':24}{a:12.1f}{b:12.1f}"
                        f"{(b / a if a else 0):8.2f}")  # fmt: skip
    rows.append(f"{'errors':24}{r['alone']['errors']:12}{r['with_batch']['errors']:12}")
    for name, used in r["cores"]["alone"].items():
        rows.append(f"{'cores ' + name:24}{used:12.2f}{r['cores']['with_batch'][name]:12.2f}")
    rows.append(f"batch: {r['batch']['lines_answered']} lines answered, "
                f"{r['batch']['lines_per_s']:.1f} lines/s")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    defaults = BenchConfig(concurrency=32, max_tokens=64)
    p: argparse.ArgumentParser = arg_parser(__doc__.split("\n\n")[0], defaults)
    p.add_argument("--batch-lines", type=int, default=10_000)
    p.add_argument("--batch-line-tokens", type=int, default=32)
    p.add_argument("--batch-concurrency", type=int, default=256,
                   help="the runner's lines in flight (TOKENWAY_BATCH_CONCURRENCY)")  # fmt: skip
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interactive loads measured alone, and again with the batch (5)",
    )
    args = p.parse_args(argv)
    stop_on_sigterm()
    report = run_async(run(bench_config(args), args.batch_lines, args.batch_line_tokens,
                           args.batch_concurrency, args.rounds))  # fmt: skip
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
