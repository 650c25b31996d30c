"""End-to-end benchmark: N concurrent streaming chat completions through the whole pipeline,
against the same simulated engine driven directly, in one run.

The pipeline runs as separate OS processes (nats-server, ingress, render, schedule (which
derenders its own requests), simulated engines) so that resident memory and CPU are per
stage. The direct baseline runs `SimEngine.generate` in this process with the same timing
and the same output, timestamping every emit: the simulated model's next token depends on
the seed and the context, so the direct path feeds the prompt IDs the pipeline's engine
receives (each chat body rendered by the local renderer, chat template applied) with the
same `seed=i` for stream i.

    python bench/e2e.py --concurrency 200 --max-tokens 200 --itl 0.01 --chunk-size 1 \
        [--json out.json]

See bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
from tokenizers import Tokenizer

from engines.sim import SimConfig, SimEngine
from tokenway.api.bodies import decode_body
from tokenway.model import DEFAULT_MODEL_NAME, ModelInfo, default_model_dir, load_model_info
from tokenway.natsd import server_binary
from tokenway.wire import EngineInfo, EngineWork, SamplingParams
from workers.derender.detok import Detokenizer, seed
from workers.render.core import Renderer

ROOT = Path(__file__).resolve().parent.parent  # the stages run from the project root

# Every process of the pipeline, as named in the report.
PROCESSES = ("nats-server", "ingress", "render", "schedule", "engine")


def processes(cfg: BenchConfig) -> tuple[str, ...]:
    """The pipeline's processes: render is the ingress's own with `--render-placement
    ingress`."""
    beside = cfg.render_placement == "ingress"
    return tuple(p for p in PROCESSES if not (beside and p == "render"))


PROMPT = "Request {i}: explain, step by step, how tokens stream from an engine to a client."
PROMPT_ALLOWANCE = 256  # tokens: more than PROMPT takes, chat template included
CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


@dataclass(frozen=True)
class BenchConfig:
    concurrency: int = 200
    max_tokens: int = 200
    itl: float = 0.01  # seconds per token (the simulated engine's step is itl * chunk_size)
    ttft: float = 0.02  # simulated prefill, seconds
    chunk_size: int = 1  # tokens per sequence per engine step
    stream_interval: int = 1  # the schedule stage's --stream-interval: tokens per chunk, at least
    render_placement: str = "ingress"  # the ingress's --render-placement (as under `up`)
    idle_seconds: float = 2.0  # idle window for idle RSS and background NATS traffic
    warmup: int = 8  # streams sent (and finished) before anything is measured
    ready_timeout: float = 60.0
    stop_timeout: float = 10.0  # SIGTERM → SIGKILL
    sample_interval: float = 0.05  # RSS sampling while loaded, seconds


# -- statistics (pure) ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass
class StreamTrace:
    """One stream as its consumer saw it: start, a timestamp per content delivery, tokens."""

    start: float
    deliveries: list[float] = field(default_factory=list)
    tokens: int = 0
    sse_chunks: int = 0  # `data:` events other than [DONE]
    end: float = 0.0
    error: str | None = None


def summarize(traces: list[StreamTrace]) -> dict[str, Any]:
    """TTFT, ITL (gap between consecutive content deliveries), TPOT and throughput, in ms."""
    ok = [t for t in traces if t.error is None and t.deliveries]
    ttft = [(t.deliveries[0] - t.start) * 1e3 for t in ok]
    itl = [(b - a) * 1e3 for t in ok for a, b in zip(t.deliveries, t.deliveries[1:], strict=False)]
    tpot = [(t.deliveries[-1] - t.deliveries[0]) * 1e3 / (t.tokens - 1) for t in ok if t.tokens > 1]
    tokens = sum(t.tokens for t in ok)
    wall = (max(t.end for t in ok) - min(t.start for t in ok)) if ok else 0.0
    return {
        "streams": len(traces),
        "errors": len(traces) - len(ok),
        "first_error": next((t.error for t in traces if t.error), None),
        "output_tokens": tokens,
        "content_deliveries": sum(len(t.deliveries) for t in ok),
        "sse_chunks": sum(t.sse_chunks for t in ok),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "tpot_ms": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
    }


def overhead(pipeline: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """Pipeline minus direct (ms) and pipeline / direct, per latency figure; tok/s ratio."""
    out: dict[str, Any] = {}
    for metric in ("ttft_ms", "itl_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            p, d = pipeline[metric][q], direct[metric][q]
            out[f"{metric[:-3]}_{q}"] = {"added_ms": p - d, "ratio": p / d if d > 0 else None}
    d_tps = direct["tokens_per_s"]
    out["tokens_per_s_ratio"] = pipeline["tokens_per_s"] / d_tps if d_tps > 0 else None
    return out


# -- the direct baseline ---------------------------------------------------------------------


def sampling(cfg: BenchConfig, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True, seed=i)


async def run_direct(
    cfg: BenchConfig, engine: SimEngine, prompts: list[list[int]]
) -> list[StreamTrace]:
    """N concurrent `generate` calls on one engine; every emit that releases text (as a
    client of any server gets it: a token inside a multi-byte character releases none, and
    its text comes with the next one) timestamped as it happens."""
    detok = Detokenizer(engine.tokenizer)

    async def one(i: int) -> StreamTrace:
        trace = StreamTrace(start=time.perf_counter())
        state = seed(prompts[i])

        def emit(
            token_ids: list[int],
            finish: object,
            reason: object,
            logprobs: object = None,
            index: int = 0,
            kv_transfer_params: object = None,
            cached_tokens: object = None,
        ) -> None:
            nonlocal state
            now = time.perf_counter()
            text, state = detok.step(state, token_ids)
            if text:
                trace.deliveries.append(now)
            trace.tokens += len(token_ids)

        work = EngineWork(
            rid=f"direct-{i}", attempt=1, owner="bench", token_ids=prompts[i],
            sampling_params=sampling(cfg, i),
        )  # fmt: skip
        try:
            await engine.generate(work, emit)
        except Exception as exc:
            trace.error = repr(exc)
        trace.end = time.perf_counter()
        return trace

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


# -- the pipeline client -----------------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def chat_body(cfg: BenchConfig, i: int, continuous_usage: bool = False) -> dict[str, Any]:
    """Stream i's request; `continuous_usage`: every chunk reports the tokens so far."""
    options = {"include_usage": True} | (
        {"continuous_usage_stats": True} if continuous_usage else {}
    )
    return {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": PROMPT.format(i=i)}],
        "max_tokens": cfg.max_tokens,
        "ignore_eos": True,
        "seed": i,
        "stream": True,
        "stream_options": options,
    }


def rendered_prompts(cfg: BenchConfig, model: ModelInfo) -> list[list[int]]:
    """The prompt IDs the pipeline's engine receives for each stream's chat body."""
    renderer = Renderer(model, DEFAULT_MODEL_NAME)
    return [
        renderer.prompt_ids(decode_body("chat", json.dumps(chat_body(cfg, i)).encode()))[0]
        for i in range(cfg.concurrency)
    ]


@dataclass
class OpenStreams:
    """How many streams are delivering content right now, and the most at once; with
    continuous usage stats, also how many output tokens all streams have received so far."""

    now: int = 0
    peak: int = 0
    tokens: int = 0

    def opened(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def closed(self) -> None:
        self.now -= 1


async def stream_chat(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], load: OpenStreams | None
) -> StreamTrace:
    """One streaming request; a timestamp for each SSE event whose delta has content."""
    trace = StreamTrace(start=time.perf_counter())
    counted = False
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            buf = b""
            async for part in resp.aiter_raw():
                now = time.perf_counter()
                buf += part
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        trace.sse_chunks += 1
                        chunk = _chunk_decoder.decode(line[6:])
                        if any(c.delta.content for c in chunk.choices):
                            trace.deliveries.append(now)
                            if load is not None and not counted:
                                counted = True
                                load.opened()
                        if chunk.usage is not None:
                            if load is not None:
                                load.tokens += chunk.usage.completion_tokens - trace.tokens
                            trace.tokens = chunk.usage.completion_tokens
        if trace.tokens != body["max_tokens"]:
            raise RuntimeError(f"got {trace.tokens} tokens, asked for {body['max_tokens']}")
    except Exception as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    finally:
        trace.end = time.perf_counter()
        if counted and load is not None:
            load.closed()
    return trace


# -- processes -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    """VmRSS from /proc/<pid>/status, in kB (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def sim_engines(cfg: BenchConfig) -> int:
    """Enough simulated engines that their KV budget holds every stream at once: an owner
    holds a request back until an engine has room for its prompt and whole `max_tokens`."""
    per_engine = EngineInfo(id="", model="").max_tokens  # what a simulated engine announces
    return max(1, math.ceil(cfg.concurrency * (cfg.max_tokens + PROMPT_ALLOWANCE) / per_engine))


def sim_engine_args(cfg: BenchConfig) -> list[str]:
    """`tokenway engine sim` with the benchmark's timing, and room for every stream."""
    return [
        "sim",
        "--sim-ttft", str(cfg.ttft), "--sim-itl", str(cfg.itl),
        "--sim-chunk-size", str(cfg.chunk_size), "--sim-output-len", str(cfg.max_tokens),
        "--sim-max-seqs", str(max(256, cfg.concurrency)),
        "--sim-engines", str(sim_engines(cfg)),
    ]  # fmt: skip


class Pipeline:
    """nats-server (with monitoring) and every stage as its own process; stopped on exit.

    `engine`: the `tokenway engine` arguments (default: the simulated engine for `cfg`);
    `model`: arguments every stage gets (a `--model-dir` and `--served-model-name`).
    """

    def __init__(
        self,
        cfg: BenchConfig,
        workdir: Path,
        engine: list[str] | None = None,
        model: Sequence[str] = (),
    ) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.engine = engine if engine is not None else sim_engine_args(cfg)
        self.model = list(model)
        self.procs: list[Proc] = []
        self.nats_url = ""
        self.monitor_url = ""
        self.metrics_url = ""  # the schedule stage's metrics page
        self.url = ""

    def _spawn(self, name: str, cmd: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWAY_")}
        env["HF_HUB_OFFLINE"] = "1"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=ROOT, env=env, start_new_session=True,
            )  # fmt: skip
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited with {p.popen.returncode}; last lines of {p.log}:\n"
                    + p.tail()
                )

    async def start(self, http: httpx.AsyncClient) -> None:
        port, monitor, http_port = free_port(), free_port(), free_port()
        store = self.workdir / "jetstream"
        self._spawn("nats-server", [
            server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor),
            "-js", "-sd", str(store),
        ])  # fmt: skip
        self.nats_url = f"nats://127.0.0.1:{port}"
        self.monitor_url = f"http://127.0.0.1:{monitor}"
        await self._wait_http(http, f"{self.monitor_url}/healthz")

        common = ["--nats", self.nats_url, "--data-dir", str(self.data_dir), "--log-level",
                  "warning", *self.model]  # fmt: skip
        tokenway = [sys.executable, "-m", "program.cli"]
        placement = self.cfg.render_placement
        self._spawn("ingress", [*tokenway, "ingress", "--port", str(http_port),
                                "--render-placement", placement, *common])  # fmt: skip
        if placement == "pool":
            self._spawn("render", [*tokenway, "render", *common])
        metrics = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        owner = ["--stream-interval", str(self.cfg.stream_interval),
                 "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics)]  # fmt: skip
        self._spawn("schedule", [*tokenway, "schedule", *common, *owner])
        self._spawn("engine", [*tokenway, "engine", *self.engine[:1], *common, *self.engine[1:]])
        self.url = f"http://127.0.0.1:{http_port}"
        await self._wait_http(http, f"{self.url}/ready")

    async def _wait_http(self, http: httpx.AsyncClient, url: str) -> None:
        """Poll a separate process's readiness route until it answers 200."""
        deadline = time.monotonic() + self.cfg.ready_timeout
        while True:
            self._check_alive()
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(url, timeout=2.0)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {self.cfg.ready_timeout}s")
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM the stages, then nats-server; SIGKILL whatever outlives the timeout."""
        stages = [p for p in self.procs if p.name != "nats-server"]
        server = [p for p in self.procs if p.name == "nats-server"]
        for group in (stages, server):
            for p in group:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.stop_timeout
            for p in group:
                try:
                    p.popen.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()

    def rss(self) -> dict[str, int]:
        return {p.name: rss_kb(p.popen.pid) for p in self.procs}

    def cpu(self) -> dict[str, float]:
        return {p.name: cpu_seconds(p.popen.pid) for p in self.procs}

    async def ledger_rounds(self, http: httpx.AsyncClient) -> tuple[float, float]:
        """The schedule stage's commit rounds so far and the ledger messages they stored."""
        page = (await http.get(self.metrics_url, timeout=5.0)).text
        found = dict.fromkeys(("_count", "_sum"), 0.0)
        for line in page.splitlines():
            name, _, value = line.partition(" ")
            for suffix in found:
                if name == f"tokenway_ledger_round_records{suffix}":
                    found[suffix] = float(value)
        return found["_count"], found["_sum"]

    async def varz(self, http: httpx.AsyncClient) -> dict[str, int]:
        v = (await http.get(f"{self.monitor_url}/varz", timeout=5.0)).json()
        return {k: v[k] for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}


@contextlib.asynccontextmanager
async def running_pipeline(
    cfg: BenchConfig, workdir: Path, engine: list[str] | None = None, model: Sequence[str] = ()
) -> AsyncIterator[Pipeline]:
    pipeline = Pipeline(cfg, workdir, engine, model)
    try:
        async with httpx.AsyncClient() as http:
            await pipeline.start(http)
        yield pipeline
    finally:
        pipeline.stop()


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """Every process's RSS (kB) at one moment of the load, with the load at that moment."""

    t: float  # perf_counter seconds
    open_streams: int
    tokens: int  # output tokens received by all clients (continuous usage stats only)
    rss: dict[str, int]


async def sample_rss(
    pipeline: Pipeline, load: OpenStreams, samples: list[Sample], interval: float
) -> None:
    while True:
        samples.append(Sample(time.perf_counter(), load.now, load.tokens, pipeline.rss()))
        await asyncio.sleep(interval)


def peak_rss(samples: list[Sample]) -> dict[str, int]:
    """The highest RSS sampled, per process."""
    return {name: max(s.rss[name] for s in samples) for name in samples[0].rss} if samples else {}


async def warm_up(cfg: BenchConfig, pipeline: Pipeline, clients: list[httpx.AsyncClient]) -> None:
    """Every stage's lazy paths run once before anything is measured, and every client opens
    its keep-alive connection, so TTFT holds no TCP connect."""
    warm = await asyncio.gather(
        *(stream_chat(clients[i], pipeline.url, chat_body(cfg, 10**6 + i), None)
          for i in range(cfg.warmup))
    )  # fmt: skip
    failed = [t.error for t in warm if t.error]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")
    await asyncio.gather(*(c.get(f"{pipeline.url}/health") for c in clients))


@dataclass
class Load:
    """What the N streams of the load phase left: traces, RSS samples, open-stream counts."""

    traces: list[StreamTrace]
    samples: list[Sample]
    streams: OpenStreams


async def run_load(
    cfg: BenchConfig,
    pipeline: Pipeline,
    clients: list[httpx.AsyncClient],
    continuous_usage: bool = False,
) -> Load:
    """N streams at once through the pipeline, every process's RSS sampled throughout."""
    streams, samples = OpenStreams(), []
    sampler = asyncio.create_task(sample_rss(pipeline, streams, samples, cfg.sample_interval))
    try:
        traces = await asyncio.gather(
            *(stream_chat(clients[i], pipeline.url, chat_body(cfg, i, continuous_usage), streams)
              for i in range(cfg.concurrency))
        )  # fmt: skip
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    samples.append(Sample(time.perf_counter(), streams.now, streams.tokens, pipeline.rss()))
    return Load(list(traces), samples, streams)


def memory_report(
    idle: dict[str, int], loaded: dict[str, int], streams: int
) -> dict[str, dict[str, float]]:
    out = {}
    for name in idle:
        out[name] = {
            "idle_kb": idle[name],
            "loaded_kb": loaded.get(name, 0),
            "per_stream_kb": (loaded.get(name, 0) - idle[name]) / streams,
        }
    total_idle, total_loaded = sum(idle.values()), sum(loaded.values())
    out["total"] = {
        "idle_kb": total_idle,
        "loaded_kb": total_loaded,
        "per_stream_kb": (total_loaded - total_idle) / streams,
    }
    return out


def direct_engine(cfg: BenchConfig, model: ModelInfo, tokenizer: Tokenizer) -> SimEngine:
    """The engine the pipeline's `tokenway engine sim` runs, with the same timing."""
    return SimEngine(
        SimConfig(
            id="bench-direct", model=DEFAULT_MODEL_NAME, eos_token_id=model.eos_token_ids[0],
            max_seqs=max(256, cfg.concurrency), chunk_size=cfg.chunk_size, ttft=cfg.ttft,
            itl=cfg.itl, output_len=cfg.max_tokens,
        ),
        tokenizer,
    )  # fmt: skip


async def open_clients(stack: contextlib.AsyncExitStack, count: int) -> list[httpx.AsyncClient]:
    """One client (one connection) per stream.

    httpcore's pool scans every connection on each request's start and end: with 200 streams
    on one client that costs the client more CPU than the streams do. A shared SSL context
    keeps creating many clients cheap.
    """
    tls = ssl.create_default_context()
    timeout = httpx.Timeout(120.0, connect=30.0)
    return [
        await stack.enter_async_context(
            httpx.AsyncClient(timeout=timeout, verify=tls, trust_env=False)
        )
        for _ in range(count)
    ]


def machine_load() -> dict[str, Any]:
    """Other work on the machine skews every figure: keep what the load was, for the reader."""
    return {"cpus": os.cpu_count(), "loadavg_1m_before": os.getloadavg()[0]}


async def run(cfg: BenchConfig) -> dict[str, Any]:
    """The whole benchmark; returns the report (also what `--json` writes)."""
    machine = machine_load()
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
        workdir = Path(tmp)
        model = load_model_info(default_model_dir(workdir / "data"))
        tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
        prompts = rendered_prompts(cfg, model)
        engine = direct_engine(cfg, model, tokenizer)

        async with contextlib.AsyncExitStack() as stack:
            pipeline = await stack.enter_async_context(running_pipeline(cfg, workdir))
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=30.0))
            clients = await open_clients(stack, max(cfg.concurrency, cfg.warmup))
            await warm_up(cfg, pipeline, clients)
            await run_direct(cfg, engine, prompts[: cfg.warmup])

            # Idle: memory, and the bus traffic nobody asked for (heartbeats, acks).
            await asyncio.sleep(0.5)
            idle_rss = pipeline.rss()
            v0, t0 = await pipeline.varz(http), time.monotonic()
            await asyncio.sleep(cfg.idle_seconds)
            v1, t1 = await pipeline.varz(http), time.monotonic()
            background = {k: (v1[k] - v0[k]) / (t1 - t0) for k in ("in_msgs", "out_msgs")}

            # The engine alone, in this process.
            direct = summarize(await run_direct(cfg, engine, prompts))

            # The pipeline, N streams at once; RSS sampled throughout, the peak kept.
            cpu0, client0 = pipeline.cpu(), time.process_time()
            varz0, rounds0 = await pipeline.varz(http), await pipeline.ledger_rounds(http)
            load = await run_load(cfg, pipeline, clients)
            varz1, rounds1 = await pipeline.varz(http), await pipeline.ledger_rounds(http)
            cpu1, client1 = pipeline.cpu(), time.process_time()

    pipe = summarize(load.traces) | {"peak_open_streams": load.streams.peak}
    cpu = {name: cpu1[name] - cpu0[name] for name in cpu0}
    cpu["bench client"] = client1 - client0
    return {
        "config": asdict(cfg),
        "machine": machine,
        "direct": direct,
        "pipeline": pipe,
        "overhead": overhead(pipe, direct),
        "memory": memory_report(idle_rss, peak_rss(load.samples), cfg.concurrency),
        "nats": bus_report(varz0, varz1, background, pipe),
        "ledger": ledger_report(rounds0, rounds1),
        "cpu": {
            name: {
                "seconds": seconds,
                "us_per_token": seconds * 1e6 / max(pipe["output_tokens"], 1),
            }
            for name, seconds in cpu.items()
        },
    }


def ledger_report(before: tuple[float, float], after: tuple[float, float]) -> dict[str, float]:
    """The owner's commit rounds during the load and the ledger messages each stored."""
    rounds, records = after[0] - before[0], after[1] - before[1]
    return {"rounds": rounds, "records": records, "records_per_round": records / max(rounds, 1)}


def bus_report(
    before: dict[str, int], after: dict[str, int], background: dict[str, float], pipe: dict
) -> dict[str, Any]:
    """NATS messages (server-wide `/varz` counters) per SSE chunk and per output token."""
    chunks, tokens = max(pipe["sse_chunks"], 1), max(pipe["output_tokens"], 1)
    delta = {k: after[k] - before[k] for k in after}
    return delta | {
        "sse_chunks": pipe["sse_chunks"],
        "output_tokens": pipe["output_tokens"],
        "in_msgs_per_chunk": delta["in_msgs"] / chunks,
        "out_msgs_per_chunk": delta["out_msgs"] / chunks,
        "in_msgs_per_token": delta["in_msgs"] / tokens,
        "out_msgs_per_token": delta["out_msgs"] / tokens,
        "background_msgs_per_s": background,
    }


# -- output ----------------------------------------------------------------------------------


def render_table(report: dict[str, Any]) -> str:
    c, d, p, o = report["config"], report["direct"], report["pipeline"], report["overhead"]
    m = report["machine"]
    lines = [
        f"tokenway e2e: {c['concurrency']} streams × {c['max_tokens']} tokens, "
        f"itl {c['itl'] * 1e3:g} ms, chunk {c['chunk_size']}, ttft {c['ttft'] * 1e3:g} ms; "
        f"{m['cpus']} CPUs, load {m['loadavg_1m_before']:.2f} before the run",
        "",
        f"{'':18}{'direct':>12}{'pipeline':>12}{'added':>12}{'ratio':>9}",
    ]
    for metric, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT")):
        for q in ("p50", "p99"):
            dv, pv = d[f"{metric}_ms"][q], p[f"{metric}_ms"][q]
            ov = o[f"{metric}_{q}"]
            ratio = f"{ov['ratio']:.2f}×" if ov["ratio"] is not None else "-"
            name = f"{label} {q} (ms)"
            lines.append(f"{name:18}{dv:12.2f}{pv:12.2f}{ov['added_ms']:+12.2f}{ratio:>9}")
    tps_ratio = o["tokens_per_s_ratio"]
    lines.append(
        f"{'output tok/s':18}{d['tokens_per_s']:12.0f}{p['tokens_per_s']:12.0f}{'':12}"
        f"{(f'{tps_ratio:.2f}×' if tps_ratio else '-'):>9}"
    )
    lines.append(
        f"{'deliveries':18}{d['content_deliveries']:12d}{p['content_deliveries']:12d}"
        f"   (errors: direct {d['errors']}, pipeline {p['errors']}; "
        f"peak open streams {p['peak_open_streams']})"
    )
    if p["first_error"]:
        lines.append(f"first pipeline error: {p['first_error']}")
    lines += ["", f"{'RSS (kB)':18}{'idle':>12}{'loaded':>12}{'per stream':>12}"]
    for name, mem in report["memory"].items():
        lines.append(
            f"{name:18}{mem['idle_kb']:12d}{mem['loaded_kb']:12d}{mem['per_stream_kb']:12.1f}"
        )
    n, led = report["nats"], report["ledger"]
    bg = n["background_msgs_per_s"]
    lines += [
        "",
        f"NATS: {n['in_msgs']} msgs in, {n['out_msgs']} out for {n['sse_chunks']} SSE chunks "
        f"and {n['output_tokens']} tokens",
        f"  per SSE chunk: {n['in_msgs_per_chunk']:.2f} in, {n['out_msgs_per_chunk']:.2f} out;"
        f"  per token: {n['in_msgs_per_token']:.2f} in, {n['out_msgs_per_token']:.2f} out",
        f"  background when idle: {bg['in_msgs']:.1f} in/s, {bg['out_msgs']:.1f} out/s",
        f"ledger: {led['records']:.0f} messages in {led['rounds']:.0f} commit rounds, "
        f"{led['records_per_round']:.1f} per round",
        "",
        f"{'CPU during load':18}{'seconds':>12}{'µs/token':>12}",
    ]
    for name, cpu in report["cpu"].items():
        lines.append(f"{name:18}{cpu['seconds']:12.2f}{cpu['us_per_token']:12.1f}")
    return "\n".join(lines)


def arg_parser(description: str, d: BenchConfig) -> argparse.ArgumentParser:
    """The flags of a pipeline benchmark, with `d`'s values as defaults."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens each")
    p.add_argument("--itl", type=float, default=d.itl, help="engine seconds per token")
    p.add_argument("--ttft", type=float, default=d.ttft, help="engine seconds to first token")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="tokens per engine step")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="the schedule stage's tokens per chunk, at least")  # fmt: skip
    p.add_argument("--render-placement", choices=["ingress", "pool"], default=d.render_placement,
                   help="where the ingress's requests are rendered")  # fmt: skip
    p.add_argument("--idle-seconds", type=float, default=d.idle_seconds)
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up streams")
    p.add_argument("--sample-interval", type=float, default=d.sample_interval,
                   help="seconds between RSS samples during the load")  # fmt: skip
    p.add_argument("--json", help="also write the report to this file")
    return p


def bench_config(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        concurrency=a.concurrency, max_tokens=a.max_tokens, itl=a.itl, ttft=a.ttft,
        chunk_size=a.chunk_size, idle_seconds=a.idle_seconds, warmup=a.warmup,
        sample_interval=a.sample_interval, stream_interval=a.stream_interval,
        render_placement=a.render_placement,
    )  # fmt: skip


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed (the stages do), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_on_sigterm() -> None:
    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the pipeline's finally: stops it

    signal.signal(signal.SIGTERM, terminate)


def main(argv: Sequence[str] | None = None) -> int:
    args = arg_parser(__doc__.split("\n\n")[0], BenchConfig()).parse_args(argv)
    stop_on_sigterm()
    report = run_async(run(bench_config(args)))
    print(render_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
