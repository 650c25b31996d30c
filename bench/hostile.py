"""Hostile input against `tokenway up`: a calm tenant's latency while others misbehave.

One `tokenway up` (every stage and its embedded NATS in one process, as an attacker with
network access meets it). A calm tenant keeps `--calm` streams going, each a default chat
request (no `max_tokens`). Each scenario adds one kind of hostility beside it, for
`--seconds`:

- `flood`: another tenant runs `--flood` request loops at once, retrying each 429 at once
  (its key may run `--flood-limit` requests at once; 0: no limit);
- `slow-readers`: `--slow` streams with logprobs whose clients read nothing (a 4 KiB
  receive buffer);
- `huge-prompts`: two loops of `--huge-mb` MB prompts (far past the context: a 400 once
  tokenized);
- `default-n8`: one stream with `n=8`, `ignore_eos` and no `max_tokens`;
- `slow-headers`: `--dripping` connections that each send a request head a byte every
  `--drip` seconds and never finish it, opening another whenever the server closes one
  (what they got: how many the server closed, how many were open at the end, and how long
  the server held each one it closed, p50);
- `huge-schema`: two loops of `--schema-properties` (80,000) string properties in one
  tool's parameters, a 7 MB chat body (issue 30's);
- `invalid-grammars`: `--grammar-clients` (8) clients sending issue 30's request, each as
  soon as its last is answered: a structural tag of a format vLLM does not know
  (`{"type": "nope"}`: a 400 at render);
- `engine-refusals`: the same with a structural tag vLLM takes that the simulated engine
  cannot decode (a 400 from the engine). Before issue 30 both went to the engine and, as
  engine failures, opened its breaker for every tenant.

Reported per scenario: the calm tenant's time to first token and end-to-end latency
(p50/p99) and their ratio to the calm-only baseline of the same run, the calm requests
that failed, what the hostile requests got, and how much the `up` process grew.

    python -m bench.hostile [--code DIR] [--flood-limit 0] [--json out.json]

`--code DIR` runs `tokenway up` from another checkout (for a before/after table); the
`up` process takes the `TOKENWAY_*` variables of the bench's environment.

`--memory` measures instead what one request costs the process and what it keeps: for each
of the 7 MB bodies (the huge schema as a chat, a Responses and a Messages tool, and a 7 MB
completions prompt of words; `--bodies` picks some), the `up` process's RSS at rest, its
peak while one request runs (sampled every 10 ms) and its RSS a second after the answer,
then the same for four at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench.e2e import percentile, rss_kb

CALM_KEY, FLOOD_KEY = "sk-calm-0123456789abcdef", "sk-flood-0123456789abcdef"
CHAT = [{"role": "user", "content": "Tell me about the pipeline."}]
SCENARIOS = ["flood", "slow-readers", "huge-prompts", "default-n8", "slow-headers", "huge-schema",
             "invalid-grammars", "engine-refusals"]  # fmt: skip
MB = 1 << 20


async def calm_stream(http: httpx.AsyncClient) -> tuple[float, float] | None:
    """One default request, streamed: (time to first token, end to end); None on failure."""
    body = {"model": "deepseek-v4", "messages": CHAT, "stream": True}
    start = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return (first or 0.0), time.perf_counter() - start


async def loop(until: float, once: Callable[[], Awaitable[None]]) -> None:
    while time.perf_counter() < until:
        await once()


async def flood(
    http: httpx.AsyncClient, until: float, width: int, seen: Counter[int | str]
) -> None:
    body = {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 64}

    async def once() -> None:
        seen[(await http.post("/v1/chat/completions", json=body)).status_code] += 1

    await asyncio.gather(*(loop(until, once) for _ in range(width)))


async def slow_readers(url: str, until: float, count: int, seen: Counter[int | str]) -> None:
    # Logprobs make each token ~1 KB of output: more than the kernel's socket buffers
    # (a few MB per connection) hold within the scenario.
    body = {"model": "deepseek-v4", "messages": CHAT, "stream": True, "max_tokens": 100_000,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 5}  # fmt: skip
    tiny = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
    transport = httpx.AsyncHTTPTransport(socket_options=tiny)
    auth = {"Authorization": f"Bearer {FLOOD_KEY}"}
    async with httpx.AsyncClient(
        base_url=url, transport=transport, timeout=None, headers=auth
    ) as http:

        async def one() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                seen[resp.status_code] += 1
                await asyncio.sleep(max(until - time.perf_counter(), 0))  # reads nothing

        await asyncio.gather(*(one() for _ in range(count)))


async def huge_prompts(
    http: httpx.AsyncClient, until: float, mb: int, seen: Counter[int | str]
) -> None:
    body = json.dumps({"model": "deepseek-v4", "prompt": "word " * (mb * 200_000)}).encode()

    async def once() -> None:
        resp = await http.post("/v1/completions", content=body,
                               headers={"content-type": "application/json"})  # fmt: skip
        seen[resp.status_code] += 1

    await asyncio.gather(*(loop(until, once) for _ in range(2)))


async def default_n8(http: httpx.AsyncClient, until: float, seen: Counter[int | str]) -> None:
    body = {"model": "deepseek-v4", "messages": CHAT, "stream": True, "n": 8, "ignore_eos": True}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(until - time.perf_counter(), 0)):
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                seen[resp.status_code] += 1
                async for _ in resp.aiter_bytes():
                    pass


async def slow_headers(
    url: str, until: float, count: int, drip: float, seen: Counter[int | str], held: list[float]
) -> None:
    """`count` connections dripping a request head that never ends; `held`: how long the
    server kept each one it closed."""
    where = httpx.URL(url)
    head = b"GET /health HTTP/1.1\r\nHost: tokenway\r\nX-Drip: "

    async def one() -> None:
        while time.perf_counter() < until:
            reader, writer = await asyncio.open_connection(where.host, where.port)
            opened = time.perf_counter()
            closed = asyncio.ensure_future(reader.read(1))  # b"" once the server closes it
            closed.add_done_callback(lambda f: f.cancelled() or f.exception())  # a reset too
            try:
                writer.write(head)
                while time.perf_counter() < until:
                    await asyncio.wait({closed}, timeout=min(drip, until - time.perf_counter()))
                    if closed.done():
                        break
                    writer.write(b"a")  # another byte of a header value without an end
                if not closed.done():
                    seen["open at end"] += 1
                    break
                seen["closed"] += 1
                held.append(time.perf_counter() - opened)
            finally:
                closed.cancel()
                writer.close()

    await asyncio.gather(*(one() for _ in range(count)))


def wide_schema(properties: int) -> dict[str, Any]:
    """A tool's parameters with that many string properties (80,000: about 7 MB)."""
    props = {f"property_{i:06d}": {"type": "string",
                                   "description": f"The string property number {i}."}
             for i in range(properties)}  # fmt: skip
    return {"type": "object", "properties": props}


def huge_bodies(properties: int) -> dict[str, tuple[str, bytes]]:
    """The memory mode's bodies by name: (route, JSON body)."""
    params, model = wide_schema(properties), "deepseek-v4"
    bodies = {
        "tool, chat": ("/v1/chat/completions", {"model": model, "messages": CHAT, "tools": [
            {"type": "function", "function": {"name": "fill", "parameters": params}}]}),
        "tool, Responses": ("/v1/responses", {"model": model, "input": CHAT[0]["content"],
            "tools": [{"type": "function", "name": "fill", "parameters": params}]}),
        "tool, Messages": ("/v1/messages", {"model": model, "max_tokens": 64,
            "messages": CHAT, "tools": [{"name": "fill", "input_schema": params}]}),
    }  # fmt: skip
    out = {name: (route, json.dumps(body).encode()) for name, (route, body) in bodies.items()}
    size = len(out["tool, chat"][1])  # a prompt as big, of plain words
    prompt = {"model": model, "prompt": "word " * (size // 5)}
    out["prompt, completions"] = ("/v1/completions", json.dumps(prompt).encode())
    return out


async def huge_schema(
    http: httpx.AsyncClient, until: float, properties: int, seen: Counter[int | str]
) -> None:
    route, body = huge_bodies(properties)["tool, chat"]

    async def once() -> None:
        resp = await http.post(route, content=body, headers={"content-type": "application/json"})
        seen[resp.status_code] += 1

    await asyncio.gather(*(loop(until, once) for _ in range(2)))


async def memory(url: str, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per huge body: RSS at rest, peak and a second after one request, then four at once."""
    rows = []
    auth = {"Authorization": f"Bearer {FLOOD_KEY}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=auth) as http:
        for name, (route, body) in huge_bodies(args.schema_properties).items():
            if args.bodies and not any(b in name for b in args.bodies):
                continue
            row: dict[str, Any] = {"body": name, "mb": round(len(body) / MB, 1)}
            for at_once in (1, 4):
                await asyncio.sleep(1)
                rest = peak = rss_kb(pid)
                sent = asyncio.gather(*(http.post(route, content=body) for _ in range(at_once)))
                began = time.perf_counter()
                while not sent.done():
                    peak = max(peak, rss_kb(pid))
                    await asyncio.sleep(0.01)
                took = time.perf_counter() - began
                statuses = Counter(r.status_code for r in sent.result())
                await asyncio.sleep(1)
                row[at_once] = {"rest_mb": round(rest / 1024),
                                "peak_mb": round((peak - rest) / 1024),
                                "held_mb": round((rss_kb(pid) - rest) / 1024),
                                "seconds": round(took, 1), "statuses": dict(statuses)}  # fmt: skip
            rows.append(row)
    return rows


def memory_table(rows: list[dict[str, Any]]) -> str:
    out = ["| body | MB | at rest MB | one: peak +MB / held +MB / s "
           "| four: peak +MB / held +MB / s | got |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        one, four = r[1], r[4]
        got = Counter(one["statuses"]) + Counter(four["statuses"])
        out.append(
            f"| {r['body']} | {r['mb']} | {one['rest_mb']} | {one['peak_mb']} / {one['held_mb']}"
            f" / {one['seconds']} | {four['peak_mb']} / {four['held_mb']} / {four['seconds']} "
            f"| {dict(got)} |"
        )
    return "\n".join(out)


# Issue 30's request: a structural tag of a format vLLM does not know (render refuses it);
# and one vLLM takes that the simulated engine cannot decode (the engine refuses it).
NOPE = {"type": "nope"}
UNDECODED = {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}}


async def refused_grammars(
    http: httpx.AsyncClient, until: float, clients: int, tag: object, seen: Counter[int | str]
) -> None:
    tagged = {"type": "structural_tag", "format": tag}
    body = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "response_format": tagged}  # fmt: skip

    async def once() -> None:
        try:
            seen[(await http.post("/v1/chat/completions", json=body)).status_code] += 1
        except httpx.TimeoutException:
            seen["timed out"] += 1

    await asyncio.gather(*(loop(until, once) for _ in range(clients)))


@contextlib.asynccontextmanager
async def up_process(
    code: str, data: Path, env: dict[str, str], *flags: str
) -> AsyncIterator[tuple[str, int]]:
    """`tokenway up` from the checkout `code` on `data` (its log in `data/up.log`), with the
    bench's environment and `env` over it: its API's URL and its pid."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENWAY_SIM_TTFT": "0.02", **env,
           "PYTHONPATH": code}  # fmt: skip
    with open(data / "up.log", "wb") as log:  # noqa: ASYNC230 - once, at start
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "program.cli", "up", "--data-dir", str(data), "--port", "0",
            *flags, cwd=code, env=env, stdout=asyncio.subprocess.PIPE, stderr=log,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        while line := (await asyncio.wait_for(proc.stdout.readline(), 120)).decode():
            if match := re.search(r"at (http://\S+)/v1", line):
                break
        else:
            raise SystemExit((data / "up.log").read_text()[-2000:])
        yield match.group(1), proc.pid
    finally:
        proc.terminate()
        await proc.wait()


@contextlib.asynccontextmanager
async def up(args: argparse.Namespace, data: Path) -> AsyncIterator[tuple[str, int]]:
    limit = f" concurrent={args.flood_limit}" if args.flood_limit else ""
    keys = data / "keys"
    keys.write_text(f"calm {CALM_KEY}\nflood {FLOOD_KEY}{limit}\n")
    env = {"TOKENWAY_SIM_ITL": str(args.itl), "TOKENWAY_SIM_OUTPUT_LEN": "32"}
    flags = ["--api-key-file", str(keys), "--sim-max-seqs", str(args.max_seqs)]
    async with up_process(args.code, data, env, *flags) as running:
        yield running


async def scenario(url: str, pid: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    until = time.perf_counter() + args.seconds
    seen: Counter[int | str] = Counter()
    held: list[float] = []  # slow-headers: seconds the server held each dripping connection
    auth = {"Authorization": f"Bearer {FLOOD_KEY}"}
    calm_results: list[tuple[float, float] | None] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=120,
                          transport=httpx.AsyncHTTPTransport(local_address=args.calm_address),
                          headers={"Authorization": f"Bearer {CALM_KEY}"}) as calm,
        httpx.AsyncClient(base_url=url, timeout=120, headers=auth,
                          limits=httpx.Limits(max_connections=None)) as hostile,
    ):  # fmt: skip
        rss_before = rss_kb(pid)
        hostility = {
            "baseline": lambda: asyncio.sleep(0),
            "flood": lambda: flood(hostile, until, args.flood, seen),
            "slow-readers": lambda: slow_readers(url, until, args.slow, seen),
            "huge-prompts": lambda: huge_prompts(hostile, until, args.huge_mb, seen),
            "default-n8": lambda: default_n8(hostile, until, seen),
            "slow-headers": lambda: slow_headers(url, until, args.dripping, args.drip, seen, held),
            "huge-schema": lambda: huge_schema(hostile, until, args.schema_properties, seen),
            "invalid-grammars": lambda: refused_grammars(
                hostile, until, args.grammar_clients, NOPE, seen
            ),
            "engine-refusals": lambda: refused_grammars(
                hostile, until, args.grammar_clients, UNDECODED, seen
            ),
        }[name]

        async def calm_once() -> None:
            try:
                calm_results.append(await calm_stream(calm))
            except httpx.TimeoutException:  # no answer within the client's timeout: failed
                calm_results.append(None)

        peak = rss_before

        async def watch() -> None:
            nonlocal peak
            while time.perf_counter() < until:
                peak = max(peak, rss_kb(pid))
                await asyncio.sleep(0.1)

        await asyncio.gather(
            hostility(), watch(), *(loop(until, calm_once) for _ in range(args.calm))
        )
    if held:
        seen["held p50 s"] = round(percentile(held, 50), 1)  # type: ignore[assignment]
    ok = [r for r in calm_results if r is not None]
    ttft, e2e = [r[0] for r in ok], [r[1] for r in ok]
    return {
        "scenario": name,
        "calm_requests": len(calm_results),
        "calm_failed": len(calm_results) - len(ok),
        "ttft_p50": percentile(ttft, 50) if ttft else None,
        "ttft_p99": percentile(ttft, 99) if ttft else None,
        "e2e_p50": percentile(e2e, 50) if e2e else None,
        "hostile_statuses": dict(sorted(seen.items(), key=lambda kv: str(kv[0]))),
        "rss_growth_mb": round((peak - rss_before) / 1024, 1),
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        async with up(args, Path(tmp)) as (url, pid):
            async with httpx.AsyncClient(
                base_url=url, timeout=60, headers={"Authorization": f"Bearer {CALM_KEY}"}
            ) as w:
                for _ in range(4):  # warm up
                    await calm_stream(w)
                if "engine-refusals" in args.scenarios:
                    # the simulated engine's vocabulary for grammars, built on the first
                    # constraint a process meets (a second, with every stream held)
                    constrained = {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 1,
                                   "response_format": {"type": "json_object"}}  # fmt: skip
                    await w.post("/v1/chat/completions", json=constrained)
            if args.memory:
                return await memory(url, pid, args)
            rows = [await scenario(url, pid, args, name) for name in ["baseline", *args.scenarios]]
    base = rows[0]
    for row in rows:
        for key in ("ttft_p50", "e2e_p50"):
            if row[key] is not None and base[key]:
                row[f"{key}_ratio"] = round(row[key] / base[key], 2)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "–" if v is None else f"{v * 1000:.0f}"

    out = ["| scenario | calm TTFT p50 / p99 ms | ×base | calm e2e p50 ms | ×base | calm failed | "
           "hostile got | up RSS +MB |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['scenario']} | {ms(r['ttft_p50'])} / {ms(r['ttft_p99'])} | "
            f"{r.get('ttft_p50_ratio', '–')} | {ms(r['e2e_p50'])} | "
            f"{r.get('e2e_p50_ratio', '–')} | "
            f"{r['calm_failed']}/{r['calm_requests']} | {r['hostile_statuses'] or '–'} | "
            f"{r['rss_growth_mb']} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", default=os.getcwd(), help="checkout whose `tokenway up` runs (.)")
    p.add_argument("--seconds", type=float, default=10.0, help="per scenario (10)")
    p.add_argument("--calm", type=int, default=4, help="calm streams at once (4)")
    p.add_argument("--calm-address",
                   help="the calm tenant's source address, another host's than the hostile "
                   "clients' (e.g. 127.0.0.2; default: the system's choice, theirs)")  # fmt: skip
    p.add_argument("--flood", type=int, default=64, help="flooding request loops (64)")
    p.add_argument("--flood-limit", type=int, default=8,
                   help="requests the flooding key may run at once (8; 0: no limit)")  # fmt: skip
    p.add_argument("--slow", type=int, default=16, help="streams that read nothing (16)")
    p.add_argument("--huge-mb", type=int, default=5, help="size of a huge prompt (5)")
    p.add_argument("--dripping", type=int, default=200,
                   help="connections dripping a request head (200)")  # fmt: skip
    p.add_argument("--drip", type=float, default=1.0,
                   help="seconds between two bytes of a dripping head (1)")  # fmt: skip
    p.add_argument("--schema-properties", type=int, default=80_000,
                   help="string properties of the huge schema (80,000: 7 MB)")  # fmt: skip
    p.add_argument("--memory", action="store_true",
                   help="measure what huge bodies cost the process and what it keeps, "
                   "instead of the scenarios")  # fmt: skip
    p.add_argument("--grammar-clients", type=int, default=8,
                   help="clients sending refused grammars (8)")  # fmt: skip
    p.add_argument("--bodies", nargs="+",
                   help="--memory: only the bodies whose names hold one of these (tool, "
                   "prompt, chat, Responses, Messages, completions)")  # fmt: skip
    p.add_argument("--itl", type=float, default=0.01, help="engine seconds per token (0.01)")
    p.add_argument("--max-seqs", type=int, default=64, help="engine sequences at once (64)")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=SCENARIOS,
        help="which, in order, after the baseline (all)",
    )
    p.add_argument("--json", help="also write the rows as JSON")
    args = p.parse_args()
    rows = asyncio.run(run(args))
    print(memory_table(rows) if args.memory else table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
