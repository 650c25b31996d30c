"""A soak of `tokenway up`: mixed traffic for a long while, every process's memory sampled.

One `tokenway up` (every stage and its embedded nats-server, as a single-host deployment
runs it) serves `--clients` loops of requests like an ordinary day's: chat and completions,
streamed or not, prompts of 10 to 2,000 characters, `max_tokens` 8 to 300, a fifth with
`n=2`, a fifth with `logprobs`, and 15 % of the streams cancelled by their client after a
few events. Each `--sample` seconds it reads the resident memory of `up` and of its
nats-server. After `--warmup-minutes` (caches, pools and the prefix index fill up, and
should then stay), what each process grows by to the end is the figure: a structure that
grows with traffic shows as a line that keeps rising.

    python -m bench.soak [--minutes 60] [--warmup-minutes 10] [--json out.json]

Target (issue 30): growth after the warm-up ≤ 20 MB per process, to the end of an hour.
`--code DIR` runs `tokenway up` from another checkout (for a before/after table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.e2e import rss_kb
from bench.hostile import up_process

WORDS = "the pipeline carries token ids between stages and engines over the bus".split()


def children(pid: int) -> list[int]:
    """The process's direct children (its embedded nats-server)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def request(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """A request of the day's mix: its path, its body, and whether its client leaves early."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 400)))[: rng.randint(10, 2000)]
    body: dict[str, Any] = {"model": "deepseek-v4", "max_tokens": rng.randint(8, 300),
                            "stream": rng.random() < 0.6}  # fmt: skip
    chat = rng.random() < 0.5
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    kind = rng.random()
    if kind < 0.2:
        body["n"] = 2
    elif kind < 0.4:
        body.update({"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3})
    cancel = body["stream"] and rng.random() < 0.15
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, cancel


async def client(url: str, until: float, seed: int, seen: Counter[str]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            path, body, cancel = request(rng)
            try:
                if not body["stream"]:
                    status = (await http.post(path, json=body)).status_code
                else:
                    async with http.stream("POST", path, json=body) as resp:
                        status = resp.status_code
                        events = 0
                        async for line in resp.aiter_lines():
                            events += line.startswith("data: ")
                            if cancel and events >= 3:
                                break  # the client leaves; closing the response tells tokenway
                seen["cancelled" if cancel else str(status)] += 1
            except httpx.HTTPError as exc:
                seen[type(exc).__name__] += 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        itl = {"TOKENWAY_SIM_ITL": str(args.itl)}
        async with up_process(args.code, Path(tmp), itl) as (url, pid):
            procs = {"up": pid}
            if server := children(pid):  # the embedded nats-server, up's one child
                procs["nats-server"] = server[0]
            seen: Counter[str] = Counter()
            start = time.monotonic()
            until = start + args.minutes * 60
            samples: list[dict[str, Any]] = []

            async def sample() -> None:
                while True:
                    samples.append({"minute": round((time.monotonic() - start) / 60, 2),
                                    "requests": sum(seen.values()),
                                    **{name: rss_kb(p) for name, p in procs.items()}})  # fmt: skip
                    if time.monotonic() >= until:
                        return
                    await asyncio.sleep(min(args.sample, max(until - time.monotonic(), 0)))

            await asyncio.gather(
                sample(), *(client(url, until, i, seen) for i in range(args.clients))
            )
    warm = [s for s in samples if s["minute"] >= args.warmup_minutes] or samples[-1:]
    growth = {name: round((warm[-1][name] - warm[0][name]) / 1024, 1) for name in procs}
    served = samples[-1]["requests"]
    errors = {k: v for k, v in seen.items() if k not in ("200", "cancelled")}
    return {"config": vars(args), "requests": served, "outcomes": dict(seen), "errors": errors,
            "growth_after_warmup_mb": growth, "samples": samples}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    names = list(report["growth_after_warmup_mb"])
    out = ["| minute | requests | " + " | ".join(f"{n} MB" for n in names) + " |",
           "|---|---|" + "---|" * len(names)]  # fmt: skip
    for s in report["samples"]:
        out.append(f"| {s['minute']} | {s['requests']} | "
                   + " | ".join(f"{s[n] / 1024:.1f}" for n in names) + " |")  # fmt: skip
    out.append(f"\ngrowth after the warm-up: {report['growth_after_warmup_mb']} MB; "
               f"{report['requests']} requests, errors {report['errors'] or 'none'}")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", default=os.getcwd(), help="checkout whose `tokenway up` runs (.)")
    p.add_argument("--minutes", type=float, default=60.0, help="how long (60)")
    p.add_argument("--warmup-minutes", type=float, default=10.0, help="before growth counts (10)")
    p.add_argument("--clients", type=int, default=16, help="request loops at once (16)")
    p.add_argument("--sample", type=float, default=60.0, help="seconds between samples (60)")
    p.add_argument("--itl", type=float, default=0.005, help="engine seconds per token (0.005)")
    p.add_argument("--json", help="also write the report as JSON")
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
