"""Owner memory: resident memory of every pipeline stage while N long streams run at once,
and the request owner's bookkeeping measured object by object in this process.

The pipeline runs as in `e2e.py` (nats-server and every stage its own process). The clients
ask for continuous usage stats, so the output tokens received so far are known at each RSS
sample; the RSS of each process is read at 25/50/75/100 % of the output and fitted against
the tokens while every stream is open: the slope is the bytes a process holds per output
token, the intercept (less the idle RSS) the bytes it holds per stream. The owner keeps the
committed output IDs of each stream as an `array('i')`, 4 bytes a token.

The in-process cross-check builds N real `Owned` requests (each with its un-acked message,
its decoded request and a real derender state), commits their output chunk by chunk as the
owner does, and measures the Python heap with `tracemalloc`.

    python -m bench.owner_memory --concurrency 1000 --max-tokens 4000 --chunk-size 16 \
        --itl 0.02 [--json out.json]

See bench/README.md for what each number means.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from tokenizers import Tokenizer

from bench import e2e
from bench.e2e import BenchConfig, Sample
from engines.sim import CorpusModel, corpus_sentences
from tokenway import bus
from tokenway.model import DEFAULT_MODEL_NAME, default_model_dir, load_model_info
from tokenway.wire import DerenderEntry, GenerateRequest, RenderRequest
from workers.derender.core import derender
from workers.derender.detok import Detokenizer
from workers.render.core import Renderer
from workers.schedule.owned import Owned

DEFAULTS = BenchConfig(
    concurrency=1000, max_tokens=4000, itl=0.02, chunk_size=16, idle_seconds=2.0,
    sample_interval=0.25,
)  # fmt: skip
CHECKPOINTS = (0.25, 0.5, 0.75, 1.0)  # shares of the output the RSS is reported at
MINDIE_BYTES_PER_TOKEN = 6.0  # MindIE's coordinator: ~6 MB per 1M cached tokens per stream


# -- the pipeline (separate processes) ---------------------------------------------------------


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares line through (x, y) points: (intercept, slope); None without spread."""
    n = len(points)
    if n < 3:
        return None
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def all_open(samples: list[Sample], cfg: BenchConfig) -> list[Sample]:
    """The samples taken while every stream was open: only the committed output grew."""
    return [s for s in samples if s.open_streams == cfg.concurrency]


def memory_by_output(
    samples: list[Sample], idle: dict[str, int], after: dict[str, int], cfg: BenchConfig
) -> dict[str, dict[str, Any]]:
    """Per process: RSS (kB) idle, at each checkpoint, at the peak and after the load; the
    fitted bytes per stream and per output token while every stream was open."""
    total, n = cfg.concurrency * cfg.max_tokens, cfg.concurrency
    window = all_open(samples, cfg)
    out: dict[str, dict[str, Any]] = {}
    for name in idle:
        row: dict[str, Any] = {"idle_kb": idle[name]}
        for share in CHECKPOINTS:
            at = next((s for s in samples if s.tokens >= share * total), None)
            row[f"at_{round(share * 100)}pct_kb"] = at.rss[name] if at else None
        row["peak_kb"] = max(s.rss[name] for s in samples)
        row["after_kb"] = after[name]
        line = fit([(s.tokens, s.rss[name] * 1024) for s in window])
        row["bytes_per_stream"] = None if line is None else (line[0] - idle[name] * 1024) / n
        row["bytes_per_token"] = None if line is None else line[1]
        row["peak_bytes_per_stream"] = (row["peak_kb"] - idle[name]) * 1024 / n
        out[name] = row
    return out


def fit_window(samples: list[Sample], cfg: BenchConfig) -> dict[str, Any]:
    """Which samples the fit used: those with every stream open, and their output span."""
    window, total = all_open(samples, cfg), cfg.concurrency * cfg.max_tokens
    return {
        "samples": len(window),
        "from_share": window[0].tokens / total if window else None,
        "to_share": window[-1].tokens / total if window else None,
    }


async def run_pipeline(cfg: BenchConfig) -> dict[str, Any]:
    machine = e2e.machine_load()
    with tempfile.TemporaryDirectory(prefix="tw-owner-memory-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            pipeline = await stack.enter_async_context(e2e.running_pipeline(cfg, Path(tmp)))
            clients = await e2e.open_clients(stack, max(cfg.concurrency, cfg.warmup))
            await e2e.warm_up(cfg, pipeline, clients)
            await asyncio.sleep(cfg.idle_seconds)
            idle = pipeline.rss()
            load = await e2e.run_load(cfg, pipeline, clients, continuous_usage=True)
            await asyncio.sleep(cfg.idle_seconds)  # what the stages give back once it ends
            after = pipeline.rss()
    streams = e2e.summarize(load.traces)
    return {
        "machine": machine,
        "streams": {
            k: streams[k] for k in ("streams", "errors", "first_error", "output_tokens", "wall_s")
        }
        | {"engine_s": cfg.ttft + cfg.max_tokens * cfg.itl, "peak_open_streams": load.streams.peak},
        "fit_window": fit_window(load.samples, cfg),
        "memory": memory_by_output(load.samples, idle, after, cfg),
    }


# -- the owner's bookkeeping, in this process ----------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What the owners of N streams are handed: each request as it arrives on `tw.sched`,
    the output (stream 0's, in engine chunks) and the derender state after all of it."""

    payloads: list[bytes]
    prompt_tokens: int
    chunks: list[list[int]]
    state: bytes


def workload(cfg: BenchConfig) -> Workload:
    with tempfile.TemporaryDirectory(prefix="tw-owner-memory-") as tmp:
        model = load_model_info(default_model_dir(Path(tmp)))
        renderer = Renderer(model, DEFAULT_MODEL_NAME)
        tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    payloads = [
        msgspec.msgpack.encode(renderer.render(RenderRequest(
            api="chat", request_id=f"r{i}", created=0,
            body=json.dumps(e2e.chat_body(cfg, i)).encode(),
        )))
        for i in range(cfg.concurrency)
    ]  # fmt: skip
    first = msgspec.msgpack.decode(payloads[0], type=GenerateRequest)
    model_out = CorpusModel(corpus_sentences(tokenizer)).tokens(first.token_ids, 0, cfg.max_tokens)
    output = [tid for tid, _ in islice(model_out, cfg.max_tokens)]  # stream 0's: seed 0
    chunks = [output[i : i + cfg.chunk_size] for i in range(0, len(output), cfg.chunk_size)]
    detok, state = Detokenizer(tokenizer), None
    for chunk in chunks:
        entry = DerenderEntry(context=first.context, state=state, token_ids=chunk)
        state = derender(detok, entry).state
    assert state is not None
    return Workload(payloads, len(first.token_ids), chunks, state)


def owner_footprint(cfg: BenchConfig) -> dict[str, Any]:
    """Heap bytes (tracemalloc) of N owned requests, per stream and per committed token.

    What a stream's owner holds: the un-acked message (its payload), the decoded request,
    the `Owned` request with its choice, the last derender state, the committed output IDs,
    committed chunk by chunk as the owner commits them.
    """
    work, n = workload(cfg), cfg.concurrency
    decoder = msgspec.msgpack.Decoder(GenerateRequest)
    tracemalloc.start()
    try:
        held = [tracemalloc.get_traced_memory()[0]]
        msgs = [
            Msg(None, subject=bus.sched_subject("m"), data=bytes(bytearray(p)))  # type: ignore[arg-type]
            for p in work.payloads
        ]
        held.append(tracemalloc.get_traced_memory()[0])
        requests = [decoder.decode(m.data) for m in msgs]
        held.append(tracemalloc.get_traced_memory()[0])
        owned = [
            Owned(rid=f"r{i}", reply="i1", request=r, deadline=0.0, msg=m)
            for i, (r, m) in enumerate(zip(requests, msgs, strict=True))
        ]
        for r in owned:
            r.choices[0].state = bytes(bytearray(work.state))  # each stream's own copy
        held.append(tracemalloc.get_traced_memory()[0])
        per_token: dict[str, float] = {}
        done = 0
        for share in CHECKPOINTS:
            upto = round(share * len(work.chunks))
            for chunk in work.chunks[done:upto]:
                for r in owned:
                    r.choices[0].committed.extend(chunk)
            done = upto
            tokens = sum(map(len, work.chunks[:upto]))
            grown = tracemalloc.get_traced_memory()[0] - held[-1]
            per_token[f"at_{round(share * 100)}pct"] = grown / (tokens * n)
        assert all(len(r.choices[0].committed) == cfg.max_tokens for r in owned)
    finally:
        tracemalloc.stop()
    message, request, bookkeeping = (b - a for a, b in pairwise(held))
    return {
        "streams": n,
        "tokens_per_stream": cfg.max_tokens,
        "prompt_tokens": work.prompt_tokens,
        "state_bytes": len(work.state),
        "bytes_per_stream": {
            "message": message / n,
            "request": request / n,
            "owned": bookkeeping / n,
            "total": (held[-1] - held[0]) / n,
        },
        "bytes_per_token": per_token,
    }


# -- output ------------------------------------------------------------------------------------


def _mb(kb: int | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.1f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_table(report: dict[str, Any]) -> str:
    c, own = report["config"], report["in_process"]
    lines = [
        f"tokenway owner memory: {c['concurrency']} streams × {c['max_tokens']} tokens, "
        f"chunk {c['chunk_size']}, itl {c['itl'] * 1e3:g} ms",
    ]
    if "pipeline" in report:
        p = report["pipeline"]
        s, w, m = p["streams"], p["fit_window"], p["machine"]
        lines += [
            f"{m['cpus']} CPUs, load {m['loadavg_1m_before']:.2f} before the run; "
            f"{s['streams']} streams, {s['errors']} errors, {s['output_tokens']:,} tokens in "
            f"{s['wall_s']:.1f} s (engine alone {s['engine_s']:.1f} s), "
            f"peak open streams {s['peak_open_streams']}",
        ]
        if s["first_error"]:
            lines.append(f"first error: {s['first_error']}")
        lines += [
            f"fit over {w['samples']} samples with every stream open, from "
            f"{_num(w['from_share'], '.0%')} to {_num(w['to_share'], '.0%')} of the output",
            "",
            f"{'RSS (MB)':13}{'idle':>8}{'25%':>8}{'50%':>8}{'75%':>8}{'100%':>8}{'peak':>8}"
            f"{'after':>8}{'kB/stream':>11}{'B/token':>9}",
        ]
        for name, row in p["memory"].items():
            per_stream = row["bytes_per_stream"]
            lines.append(
                f"{name:13}{_mb(row['idle_kb']):>8}"
                + "".join(f"{_mb(row[f'at_{round(x * 100)}pct_kb']):>8}" for x in CHECKPOINTS)
                + f"{_mb(row['peak_kb']):>8}{_mb(row['after_kb']):>8}"
                f"{_num(None if per_stream is None else per_stream / 1024, '.1f'):>11}"
                f"{_num(row['bytes_per_token'], '.1f'):>9}"
            )
        lines.append("")
    b = own["bytes_per_stream"]
    lines += [
        f"in-process (tracemalloc), {own['streams']} owned requests, prompt "
        f"{own['prompt_tokens']} tokens, derender state {own['state_bytes']} B:",
        f"  per stream: message {b['message']:.0f} B, decoded request {b['request']:.0f} B, "
        f"Owned + choice + state {b['owned']:.0f} B, total {b['total']:.0f} B",
        "  per committed token: "
        + ", ".join(f"{v:.2f} B at {k[3:-3]}%" for k, v in own["bytes_per_token"].items())
        + f"  (array('i'): 4 B; MindIE: ~{MINDIE_BYTES_PER_TOKEN:g} B)",
    ]
    return "\n".join(lines)


async def run(cfg: BenchConfig, pipeline: bool = True) -> dict[str, Any]:
    report: dict[str, Any] = {"config": asdict(cfg), "in_process": owner_footprint(cfg)}
    if pipeline:
        report["pipeline"] = await run_pipeline(cfg)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = e2e.arg_parser(__doc__.split("\n\n")[0], DEFAULTS)
    parser.add_argument("--in-process-only", action="store_true",
                        help="only the tracemalloc cross-check, no pipeline")  # fmt: skip
    args = parser.parse_args(argv)
    e2e.stop_on_sigterm()
    started = time.perf_counter()
    report = e2e.run_async(run(e2e.bench_config(args), pipeline=not args.in_process_only))
    print(render_table(report))
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
