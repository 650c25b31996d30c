"""Scheduling micro-benchmark: KV-affinity routing against the least-loaded pick, one core.

Two parts, each next to its baseline measured in the same run:

1. Decision time (µs) for 1k-, 8k- and 32k-token prompts over 16 engines: block hashes +
   `affinity.choose` + `PrefixIndex.record`, against `routing.pick`.
2. Shared-prefix workloads (2k-token system prompts + random user suffixes, Poisson
   arrivals, 16 engines with a bounded prefix cache each), every arrival sequence run
   through both policies: 8 prompts at a load one engine per prompt holds, 8 prompts at a
   load that needs several engines per prompt, and 128 prompts (more than one engine's
   cache). Reported: the share of requests whose engine still held their whole system
   prompt, how many had to prefill it, the share of prompt blocks reused, engines used per
   prompt, and how evenly the load spread.

    python bench/schedule.py [--requests 6000] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenway.block_hashes import BLOCK_SIZE, block_hashes
from tokenway.wire import EngineInfo
from workers.schedule import routing
from workers.schedule.affinity import PrefixIndex, choose

ENGINES = 16
VOCAB = 150_000
TTL = 300.0


def engines(max_seqs: int) -> list[EngineInfo]:
    return [EngineInfo(id=f"e{i:02d}", model="m", max_seqs=max_seqs) for i in range(ENGINES)]


def least_loaded(pool: Sequence[EngineInfo], seqs: dict[str, int]) -> EngineInfo | None:
    """Today's pick: the least loaded union engine by fraction of its capacity."""
    return routing.pick(pool, seqs, {}, 0, 1, "union")


# -- part 1: decision time ----------------------------------------------------------------------


def decision_time(prompt_tokens: int, rng: random.Random) -> dict[str, float]:
    """Mean µs per decision, with an index holding 8 earlier prompts per engine."""
    pool = [
        EngineInfo(id=f"e{i:02d}", model="m", max_seqs=256, running=rng.randrange(0, 128))
        for i in range(ENGINES)
    ]
    seqs = {e.id: e.running for e in pool}
    index = PrefixIndex(ttl=TTL, max_blocks=1 << 17)
    prefixes = [[rng.randrange(VOCAB) for _ in range(prompt_tokens)] for _ in range(4)]
    for i, e in enumerate(pool):
        for j in range(8):  # 8 earlier prompts per engine, two sharing this run's prefixes
            base = prefixes[(i + j) % 4] if j < 2 else None
            tokens = base or [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
            index.record(e.id, block_hashes(tokens), now=0.0)
    # Requests: a known prefix (90 %) plus their own tail.
    cut = prompt_tokens * 9 // 10
    reps = max(20, 40_000 // (prompt_tokens // 256))
    requests = [
        prefixes[k % 4][:cut] + [rng.randrange(VOCAB) for _ in range(prompt_tokens - cut)]
        for k in range(min(reps, 64))
    ]
    hash_s = choose_s = record_s = pick_s = 0.0
    now = 1.0
    for k in range(reps):
        tokens = requests[k % len(requests)]
        t0 = time.perf_counter()
        hashes = block_hashes(tokens)
        t1 = time.perf_counter()
        choice = choose(pool, seqs, hashes, index, now)
        t2 = time.perf_counter()
        assert choice is not None
        index.record(choice.engine.id, hashes, now)
        t3 = time.perf_counter()
        least_loaded(pool, seqs)
        t4 = time.perf_counter()
        hash_s += t1 - t0
        choose_s += t2 - t1
        record_s += t3 - t2
        pick_s += t4 - t3
        now += 0.001
    us = 1e6 / reps
    total = (hash_s + choose_s + record_s) * us
    return {
        "prompt_tokens": prompt_tokens,
        "blocks": prompt_tokens // BLOCK_SIZE,
        "hash_us": round(hash_s * us, 1),
        "choose_us": round(choose_s * us, 1),
        "record_us": round(record_s * us, 1),
        "affinity_us": round(total, 1),
        "least_loaded_us": round(pick_s * us, 1),
        "ratio": round(total / (pick_s * us), 1),
    }


# -- part 2: shared-prefix workload ---------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: float  # mean sequences in flight: arrival rate × mean duration
    system_prompts: int = 8
    max_seqs: int = 64  # per engine
    kv_blocks: int = 8192  # an engine's prefix cache, in blocks (128k tokens)
    system_tokens: int = 2048
    suffix_tokens: tuple[int, int] = (50, 500)
    duration: float = 10.0  # mean seconds a request holds its slot (exponential)


WORKLOADS = (
    Workload("fits", concurrency=128),  # 16 per prompt: a quarter of an engine
    Workload("exceeds", concurrency=640),  # 80 per prompt: more than one engine
    # More prefix than one engine's cache holds (128 × 128 blocks > 8192): spreading every
    # prompt everywhere evicts them.
    Workload("many", concurrency=256, system_prompts=128),
)


@dataclass
class Request:
    system: int
    hashes: list[int]
    arrival: float
    duration: float


def requests(w: Workload, n: int, rng: random.Random) -> list[Request]:
    systems = [
        [rng.randrange(VOCAB) for _ in range(w.system_tokens)] for _ in range(w.system_prompts)
    ]
    rate = w.concurrency / w.duration
    now, out = 0.0, []
    for _ in range(n):
        now += rng.expovariate(rate)
        system = rng.randrange(w.system_prompts)
        suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(*w.suffix_tokens))]
        hashes = block_hashes(systems[system] + suffix)
        out.append(Request(system, hashes, now, rng.expovariate(1 / w.duration)))
    return out


Policy = Callable[[list[EngineInfo], dict[str, int], list[int], PrefixIndex, float], str | None]


def affinity_policy(pool, seqs, hashes, index, now) -> str | None:
    choice = choose(pool, seqs, hashes, index, now)
    if choice is None:
        return None
    index.record(choice.engine.id, hashes, now)
    return choice.engine.id


def least_loaded_policy(pool, seqs, hashes, index, now) -> str | None:
    e = least_loaded(pool, seqs)
    return None if e is None else e.id


def simulate(w: Workload, reqs: list[Request], policy: Policy, warmup: int) -> dict[str, object]:
    """Run the arrivals through a policy against simulated engine prefix caches.

    Each engine's cache is an LRU of `kv_blocks` blocks that every prompt sent there
    touches; a hit is a request whose whole system prompt is still in its engine's cache.
    The router's own index (what `choose` consults) is separate and may be stale.
    """
    pool = engines(w.max_seqs)
    seqs = {e.id: 0 for e in pool}
    cache = PrefixIndex(ttl=float("inf"), max_blocks=w.kv_blocks)  # the engines' truth
    index = PrefixIndex(ttl=TTL, max_blocks=w.kv_blocks)  # what the router believes
    ends: list[tuple[float, str]] = []
    prefix_blocks = w.system_tokens // BLOCK_SIZE
    hits = rejected = reused = blocks = 0
    excess: list[float] = []
    peak = 0.0
    served: dict[int, set[str]] = {}
    decide = 0.0
    for k, r in enumerate(reqs):
        while ends and ends[0][0] <= r.arrival:
            seqs[heapq.heappop(ends)[1]] -= 1
        t0 = time.perf_counter()
        engine = policy(pool, seqs, r.hashes, index, r.arrival)
        decide += time.perf_counter() - t0
        if engine is None:
            rejected += 1
            continue
        overlap = cache.overlap(engine, r.hashes, r.arrival)
        cache.record(engine, r.hashes, r.arrival)
        seqs[engine] += 1
        heapq.heappush(ends, (r.arrival + r.duration, engine))
        hits += overlap >= prefix_blocks
        reused += overlap
        blocks += len(r.hashes)
        served.setdefault(r.system, set()).add(engine)
        if k >= warmup:  # load figures once the arrivals reached their steady rate
            loads = list(seqs.values())
            excess.append((max(loads) - statistics.fmean(loads)) / w.max_seqs)
            peak = max(peak, max(loads) / w.max_seqs)
    placed = len(reqs) - rejected
    return {
        "requests": len(reqs),
        "hit_share": round(hits / max(placed, 1), 4),
        "prefix_prefills": placed - hits,
        "reused_block_share": round(reused / max(blocks, 1), 4),
        "engines_per_prompt": round(statistics.fmean(len(s) for s in served.values()), 1),
        "peak_load": round(peak, 2),
        "mean_excess_load": round(statistics.fmean(excess), 4),
        "rejected": rejected,
        "decision_us": round(decide / len(reqs) * 1e6, 1),
    }


def run(n_requests: int, seed: int = 0) -> dict[str, object]:
    rng = random.Random(seed)
    timing = [decision_time(tokens, rng) for tokens in (1024, 8192, 32768)]
    workloads = {}
    for w in WORKLOADS:
        reqs = requests(w, n_requests, random.Random(seed + 1))
        warmup = n_requests // 5
        workloads[w.name] = {
            "config": {
                "engines": ENGINES,
                "max_seqs": w.max_seqs,
                "kv_blocks": w.kv_blocks,
                "concurrency": w.concurrency,
                "system_prompts": w.system_prompts,
                "system_tokens": w.system_tokens,
                "suffix_tokens": list(w.suffix_tokens),
            },
            "affinity": simulate(w, reqs, affinity_policy, warmup),
            "least_loaded": simulate(w, reqs, least_loaded_policy, warmup),
        }
    return {"decision_time": timing, "workloads": workloads}


def render(report: dict[str, object]) -> str:
    lines = ["decision time, 16 engines (µs per request, mean)"]
    lines.append(
        f"{'prompt':>8}{'blocks':>8}{'hash':>9}{'choose':>9}{'record':>9}"
        f"{'affinity':>10}{'least-ld':>10}{'ratio':>8}"
    )
    for row in report["decision_time"]:  # type: ignore[union-attr]
        lines.append(
            f"{row['prompt_tokens']:>8}{row['blocks']:>8}{row['hash_us']:>9}{row['choose_us']:>9}"
            f"{row['record_us']:>9}{row['affinity_us']:>10}{row['least_loaded_us']:>10}"
            f"{row['ratio']:>7}×"
        )
    lines.append("")
    lines.append(
        "shared-prefix workload: 2k-token system prompts + 50-500 token suffixes, "
        "16 engines × 64 seqs, 8192-block prefix cache each"
    )
    lines.append(
        f"{'workload':<28}{'policy':<14}{'hit':>8}{'prefills':>10}{'reused':>8}"
        f"{'eng/prompt':>11}{'peak':>6}{'excess':>8}{'rejected':>9}{'µs':>7}"
    )
    for name, wl in report["workloads"].items():  # type: ignore[union-attr]
        cfg = wl["config"]
        label = f"{name}: {cfg['system_prompts']} × {cfg['concurrency']:g} in flight"
        for policy in ("affinity", "least_loaded"):
            r = wl[policy]
            lines.append(
                f"{label:<28}{policy:<14}{r['hit_share']:>8.1%}{r['prefix_prefills']:>10}"
                f"{r['reused_block_share']:>8.1%}{r['engines_per_prompt']:>11}"
                f"{r['peak_load']:>6.0%}{r['mean_excess_load']:>8.1%}{r['rejected']:>9}"
                f"{r['decision_us']:>7}"
            )
            label = ""
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6000, help="arrivals per workload run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    report = run(max(args.requests, 100), args.seed)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
