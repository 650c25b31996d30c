"""Where the engine is chosen, and how much work this owner may pull (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tokenway.wire import EngineInfo


def load(engine: EngineInfo, ours: int) -> int:
    """Sequences on an engine: the heartbeat's count, or ours if the beat is older than them."""
    return max(engine.running, ours) + engine.waiting


def free_slots(engines: Iterable[EngineInfo], ours: Mapping[str, int]) -> int:
    return sum(
        max(e.max_seqs - load(e, ours.get(e.id, 0)), 0) for e in engines if e.role == "union"
    )


def pick(engines: Iterable[EngineInfo], ours: Mapping[str, int]) -> EngineInfo | None:
    """Least loaded union engine with a free slot, by fraction of its capacity."""
    best: EngineInfo | None = None
    best_score = 2.0
    for e in engines:
        if e.role != "union" or e.max_seqs <= 0:
            continue
        used = load(e, ours.get(e.id, 0))
        if used >= e.max_seqs:
            continue
        score = used / e.max_seqs
        if score < best_score or (score == best_score and best is not None and e.id < best.id):
            best, best_score = e, score
    return best
