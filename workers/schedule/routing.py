"""Which engines can take a request, and how much work this owner may pull (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from tokenway.wire import EngineInfo, Role

# Roles that stream a request's output; a prefill engine only ever runs P/D's first leg.
OUTPUT_ROLES = ("union", "decode")


def load(engine: EngineInfo, ours: int) -> int:
    """Sequences on an engine: the heartbeat's count, or ours if the beat is older than them."""
    return max(engine.running, ours) + engine.waiting


def fits(
    engine: EngineInfo, seqs: Mapping[str, int], tokens: Mapping[str, int], cost: int, n: int
) -> bool:
    """Room for `n` more sequences holding `cost` tokens (our own tokens; others' we cannot see)."""
    return (
        load(engine, seqs.get(engine.id, 0)) + n <= engine.max_seqs
        and tokens.get(engine.id, 0) + cost <= engine.max_tokens
    )


def leaving(engines: Iterable[EngineInfo], headroom: float) -> list[EngineInfo]:
    """The engines as a batch job's requests see them: without the `headroom` share of
    their sequences and tokens, which interactive requests keep (an engine of one sequence
    keeps none)."""
    return [
        msgspec.structs.replace(
            e,
            max_seqs=e.max_seqs - round(e.max_seqs * headroom),
            max_tokens=e.max_tokens - round(e.max_tokens * headroom),
        )
        for e in engines
    ]


def free_slots(
    engines: Iterable[EngineInfo], seqs: Mapping[str, int], tokens: Mapping[str, int]
) -> int:
    """Sequences the output engines could still start: what an owner may pull."""
    return sum(
        max(e.max_seqs - load(e, seqs.get(e.id, 0)), 0)
        for e in engines
        if e.role in OUTPUT_ROLES and tokens.get(e.id, 0) < e.max_tokens
    )


def pick(
    engines: Iterable[EngineInfo],
    seqs: Mapping[str, int],
    tokens: Mapping[str, int],
    cost: int,
    n: int,
    role: Role,
) -> EngineInfo | None:
    """The least loaded engine of `role` that fits, by fraction of its capacity."""
    best: EngineInfo | None = None
    best_score = 2.0
    for e in engines:
        if e.role != role or e.max_seqs <= 0 or not fits(e, seqs, tokens, cost, n):
            continue
        score = load(e, seqs.get(e.id, 0)) / e.max_seqs
        if score < best_score or (score == best_score and best is not None and e.id < best.id):
            best, best_score = e, score
    return best


def never_fits(engines: Iterable[EngineInfo], cost: int, n: int) -> str | None:
    """Why no output engine could ever hold `n` sequences of `cost` tokens, however idle;
    None when one could (or no engine is known yet to tell)."""
    out = [e for e in engines if e.role in OUTPUT_ROLES]
    if not out or any(cost <= e.max_tokens and n <= e.max_seqs for e in out):
        return None
    tokens, seqs = max(e.max_tokens for e in out), max(e.max_seqs for e in out)
    return (
        f"the request needs {cost} tokens of engine budget for {n} sequences; the "
        f"largest engine holds {tokens} tokens and {seqs} sequences"
    )
