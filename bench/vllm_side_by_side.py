"""vLLM alone against tokenway in front of the same vLLM engine, in one run, driven by vLLM's
own load generator (`vllm bench serve`).

One vLLM server (the vLLM tier's: `--enable-scale-out`, float32, CPU) serves both sides: its
own OpenAI routes ("vLLM alone"), and its token-only routes behind tokenway's stages, each its
own process against a nats-server of its own ("tokenway"). For each concurrency the two sides
run the same load back to back, in alternating order round after round, and the report gives
their ratios and the CPU seconds every process spent per 1,000 output tokens.

    python -m bench.vllm_side_by_side [--concurrency 8 32 128] [--num-prompts 200] \\
        [--input-len 256] [--output-len 128] [--rounds 1] [--json out.json]

It needs the vLLM venv and the tiny model that `.ci/vllm-tier` builds (or any model
directory and vLLM python: `--vllm-python`, `--model-dir`). See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import vllm_serve
from bench.e2e import (
    BenchConfig,
    Pipeline,
    cpu_seconds,
    ledger_report,
    machine_load,
    run_async,
    running_pipeline,
    stop_on_sigterm,
)

SERVED = "tiny"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenway"
MAX_MODEL_LEN = 4096
# vLLM's processes by their names (`/proc/<pid>/comm`); the API server is the one started.
VLLM_CHILDREN = {"VLLM::EngineCor": "vllm engine core", "VLLM::Worker": "vllm worker"}
API_SERVER = "vllm api server"
FIGURES = (  # (label, key in vllm bench serve's result)
    ("output tok/s", "output_throughput"),
    ("TTFT p50 (ms)", "median_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT p50 (ms)", "median_tpot_ms"),
    ("ITL p50 (ms)", "median_itl_ms"),
    ("ITL p99 (ms)", "p99_itl_ms"),
)
SIDES = ("vllm", "tokenway")


@dataclass(frozen=True)
class SideBySide:
    vllm_python: Path
    model_dir: Path
    concurrency: tuple[int, ...] = (8, 32, 128)
    num_prompts: int = 200
    input_len: int = 256
    output_len: int = 128
    rounds: int = 1
    render_placement: str = "ingress"  # tokenway's ingress: as `up` runs it


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def vllm_processes(server: vllm_serve.VllmServer) -> dict[str, int]:
    found = {API_SERVER: server.process.pid}
    for pid in descendants(server.process.pid):
        with contextlib.suppress(OSError):
            name = VLLM_CHILDREN.get(Path(f"/proc/{pid}/comm").read_text().strip())
            if name is not None:
                found[name] = pid
    return found


def children_cpu() -> float:
    """CPU seconds of this process's children that ended: here, the load generator's runs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def one_side(
    cfg: SideBySide,
    base_url: str,
    concurrency: int,
    pids: dict[str, int],
    pipeline: Pipeline | None = None,
) -> dict[str, Any]:
    """One `vllm bench serve` run, with every process's CPU over it, and for tokenway's side
    (`pipeline`) the ledger's commit rounds and the messages they stored."""
    load = vllm_serve.Load(
        backend="openai-chat", num_prompts=cfg.num_prompts, concurrency=concurrency,
        input_len=cfg.input_len, output_len=cfg.output_len,
    )  # fmt: skip
    async with httpx.AsyncClient() as http:
        rounds = await pipeline.ledger_rounds(http) if pipeline else (0.0, 0.0)
        before, client = {n: cpu_seconds(p) for n, p in pids.items()}, children_cpu()
        result = await vllm_serve.run(cfg.vllm_python, base_url, SERVED, cfg.model_dir, load)
        cpu = {n: cpu_seconds(p) - before[n] for n, p in pids.items()}
        ledger = ledger_report(rounds, await pipeline.ledger_rounds(http) if pipeline else rounds)
    cpu["load generator"] = children_cpu() - client
    if result["failed"]:
        errors = [e for e in result["errors"] if e][:3]
        raise RuntimeError(f"{result['failed']} requests failed against {base_url}: {errors}")
    tokens = max(result["total_output_tokens"], 1)
    return {
        "figures": {key: result[key] for _, key in FIGURES},
        "output_tokens": result["total_output_tokens"],
        "cpu_s_per_1k_tokens": {n: s * 1000 / tokens for n, s in cpu.items()},
        "ledger_per_token": {
            "records": ledger["records"] / tokens,
            "rounds": ledger["rounds"] / tokens,
            "records_per_round": ledger["records_per_round"],
        },
    }


def mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures and CPU averaged over the rounds."""
    return {
        part: {k: sum(r[part][k] for r in runs) / len(runs) for k in runs[0][part]}
        for part in ("figures", "cpu_s_per_1k_tokens", "ledger_per_token")
    }


async def run(cfg: SideBySide) -> dict[str, Any]:
    machine = machine_load()
    with tempfile.TemporaryDirectory(prefix="tw-vllm-bench-") as tmp:
        workdir = Path(tmp)
        port = vllm_serve.free_port()
        command = vllm_serve.server_command(
            cfg.vllm_python, cfg.model_dir, port, SERVED, MAX_MODEL_LEN, log_requests=False
        )
        with vllm_serve.launched(command, port, cfg.model_dir, workdir / "vllm.log") as server:
            engine = ["vllm", "--vllm-url", server.url, "--engine-max-seqs", "256"]
            model = ["--model-dir", str(cfg.model_dir), "--served-model-name", SERVED]
            pipe_cfg = BenchConfig(ready_timeout=120.0, render_placement=cfg.render_placement)
            async with running_pipeline(pipe_cfg, workdir, engine, model) as pipeline:
                pids = vllm_processes(server) | {p.name: p.popen.pid for p in pipeline.procs}
                urls = {"vllm": server.url, "tokenway": pipeline.url}
                warm = dataclasses.replace(cfg, num_prompts=8)
                for side in SIDES:  # every lazy path once, on both sides
                    await one_side(warm, urls[side], 4, pids)
                report: dict[str, Any] = {}
                for concurrency in cfg.concurrency:
                    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
                    for r in range(cfg.rounds):
                        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                            runs[side].append(await one_side(
                                cfg, urls[side], concurrency, pids,
                                pipeline if side == "tokenway" else None,
                            ))  # fmt: skip
                    report[str(concurrency)] = {s: mean(runs[s]) for s in SIDES}
    return {"config": {k: str(v) for k, v in asdict(cfg).items()}, "machine": machine,
            "runs": report}  # fmt: skip


def tokenway_share(side: dict[str, Any]) -> float:
    """CPU of tokenway's processes and nats-server, per 1,000 output tokens."""
    cpu = side["cpu_s_per_1k_tokens"]
    return sum(s for n, s in cpu.items() if not n.startswith("vllm") and n != "load generator")


def render_table(report: dict[str, Any]) -> str:
    c, m = report["config"], report["machine"]
    lines = [
        f"vLLM alone vs tokenway in front of the same vLLM engine: {c['num_prompts']} prompts, "
        f"{c['input_len']} in / {c['output_len']} out, {c['rounds']} round(s); "
        f"{m['cpus']} CPUs, load {m['loadavg_1m_before']:.2f} before the run",
    ]
    for concurrency, sides in report["runs"].items():
        alone, front = sides["vllm"], sides["tokenway"]
        lines += ["", f"c={concurrency}", f"{'':24}{'vLLM alone':>12}{'tokenway':>12}{'ratio':>9}"]
        for label, key in FIGURES:
            a, t = alone["figures"][key], front["figures"][key]
            ratio = f"{t / a:.2f}×" if a else "-"
            lines.append(f"{label:24}{a:12.1f}{t:12.1f}{ratio:>9}")
        lines.append(f"{'CPU s / 1k output tokens':24}{'':12}{'':12}")
        for name in front["cpu_s_per_1k_tokens"]:
            a = alone["cpu_s_per_1k_tokens"].get(name, 0.0)
            t = front["cpu_s_per_1k_tokens"][name]
            lines.append(f"  {name:22}{a:12.3f}{t:12.3f}")
        api = alone["cpu_s_per_1k_tokens"][API_SERVER]
        share = tokenway_share(front)
        ratio = f"{share / api:.2f}×" if api else "-"
        lines.append(f"  {'tokenway + nats':22}{'':12}{share:12.3f}{ratio:>9} of vLLM's API server")
        led = front["ledger_per_token"]
        nats = front["cpu_s_per_1k_tokens"].get("nats-server", 0.0)
        lines.append(
            f"ledger: {led['records']:.2f} messages and {led['rounds']:.3f} commit rounds per "
            f"output token ({led['records_per_round']:.1f} per round); nats-server "
            f"{nats * 1000 / max(led['records'], 1e-9):.0f} µs per ledger message"
        )
    return "\n".join(lines)


def default_model_dir() -> Path | None:
    """The newest tiny model `.ci/vllm-tier` built."""
    built = sorted((CACHE / "models").glob("tiny-llama-*"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", type=Path, default=CACHE / "vllm-venv" / "bin" / "python",
                   help="the python of a venv with vLLM (default: .ci/vllm-tier's)")  # fmt: skip
    p.add_argument("--model-dir", type=Path, default=default_model_dir(),
                   help="the model vLLM serves (default: .ci/vllm-tier's tiny model)")  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="runs per side and concurrency")
    p.add_argument("--render-placement", choices=["ingress", "pool"], default="ingress",
                   help="where tokenway's ingress has its requests rendered")  # fmt: skip
    p.add_argument("--json", help="also write the report to this file")
    a = p.parse_args(argv)
    if a.model_dir is None or not a.vllm_python.exists():
        p.error("no vLLM venv or model: run .ci/vllm-tier once, or pass both flags")
    cfg = SideBySide(
        vllm_python=a.vllm_python, model_dir=a.model_dir, concurrency=tuple(a.concurrency),
        num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
        rounds=a.rounds, render_placement=a.render_placement,
    )  # fmt: skip
    stop_on_sigterm()  # a killed run stops vLLM, the stages and nats-server on its way out
    report = run_async(run(cfg))
    print(render_table(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
