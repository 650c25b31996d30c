"""KV-cache affinity: which engine already holds this prompt's prefix, and is it worth it (pure).

A prompt is cut into blocks of `block_size` tokens; each full block gets a hash that also
covers every block before it, so equal hashes mean equal prefixes (tokenway/block_hashes.py,
shared with the simulated engine's prefix cache). `PrefixIndex` remembers, per engine, the
hashes of prompts recently routed there; `choose` weighs the prefill an engine would save
against how loaded it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenway.wire import EngineInfo, Role
from workers.schedule.routing import load


class PrefixIndex:
    """Per engine, the block hashes of prefixes recently sent there: bounded LRU with a TTL.

    An engine's entries live in one `OrderedDict` (hash → time last routed), least recent
    first. A prompt's blocks are touched last block first, so its first block is the most
    recent and eviction takes the deep ends of old prefixes before their roots — as an
    engine's own prefix cache frees blocks. With `now` never going backwards, the oldest
    entries are also the front ones, so expiry and the size bound both pop from the front.
    The cost of a lookup is O(log blocks) per engine, of a record O(blocks), independent
    of how much the index holds.
    """

    def __init__(self, ttl: float, max_blocks: int = 1 << 16) -> None:
        if ttl <= 0 or max_blocks <= 0:
            raise ValueError(f"ttl and max_blocks must be positive, not {ttl}, {max_blocks}")
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._engines: dict[str, OrderedDict[int, float]] = {}

    def record(self, engine_id: str, hashes: Sequence[int], now: float) -> None:
        """The prompt with these block hashes was just sent to `engine_id`.

        `hashes` is a whole prompt's `block_hashes` (or their first blocks), never blocks
        picked from the middle: `overlap`'s binary search relies on it.
        """
        blocks = self._engines.get(engine_id)
        if blocks is None:
            blocks = self._engines[engine_id] = OrderedDict()
        touch = blocks.move_to_end
        for h in reversed(hashes[: self.max_blocks]):  # the first block ends up most recent
            blocks[h] = now
            touch(h)
        self._evict(blocks, now)
        if not blocks:
            del self._engines[engine_id]

    def overlap(self, engine_id: str, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks `engine_id` holds: the blocks before the first miss.

        A binary search, O(log blocks): the fresh blocks of one chain are always a prefix
        of it. `record` only stores whole prefixes and touches a block's parent after the
        block, so a parent is never older, never evicted or expired before its child, and
        a miss at block i means misses at every block after it (with `now` never going
        backwards, as with a monotonic clock).
        """
        blocks = self._engines.get(engine_id)
        if not blocks:
            return 0
        oldest = now - self.ttl
        get = blocks.get
        lo, hi = 0, len(hashes)  # blocks [0, lo) are held; block hi and later are not
        while lo < hi:
            mid = (lo + hi) // 2
            seen = get(hashes[mid])
            if seen is None or seen < oldest:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def forget(self, engine_id: str) -> None:
        """The engine left (or restarted with an empty cache)."""
        self._engines.pop(engine_id, None)

    def expire(self, now: float) -> None:
        """Drop every stale entry (lookups ignore them anyway; this returns the memory)."""
        for engine_id, blocks in list(self._engines.items()):
            self._evict(blocks, now)
            if not blocks:
                del self._engines[engine_id]

    def size(self, engine_id: str) -> int:
        blocks = self._engines.get(engine_id)
        return 0 if blocks is None else len(blocks)

    def engines(self) -> list[str]:
        return sorted(self._engines)

    def _evict(self, blocks: OrderedDict[int, float], now: float) -> None:
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        oldest = now - self.ttl
        while blocks:
            h, seen = next(iter(blocks.items()))
            if seen >= oldest:
                break
            del blocks[h]


@dataclass(frozen=True, slots=True)
class Choice:
    """The engine picked for a request and why, for the dispatch log."""

    engine: EngineInfo
    overlap_blocks: int  # leading blocks of the prompt the engine should still hold
    prompt_blocks: int  # full blocks in the prompt
    cost: float  # in block prefills: see `cost`
    used: int  # sequences on the engine (running, or ours if more, plus waiting)

    def describe(self) -> str:
        return (
            f"engine {self.engine.id} (overlap {self.overlap_blocks}/{self.prompt_blocks} blocks, "
            f"load {self.used}/{self.engine.max_seqs}, cost {self.cost:.1f})"
        )


def cost(prompt_blocks: int, overlap_blocks: int, used: int, max_seqs: int, scale: float) -> float:
    """Blocks to prefill, plus the engine's load in the same unit.

    `scale · (prompt − overlap) + max(prompt, 1) · used / (max_seqs − used)`.
    The load term is the queueing factor ρ/(1 − ρ) (ρ = used / max_seqs) in units of this
    request's own prefill, so the trade-off does not depend on prompt length: a request
    whose share s of blocks is cached on an engine sticks to it over an idle engine while
    ρ/(1 − ρ) < scale · s (ρ < 0.47 for s = 0.9, scale 1), and spreads beyond that. With one
    slot left the load term is `prompt · (max_seqs − 1)`, more than any saving (at most
    `scale · prompt`) once max_seqs > scale + 1. With no overlap anywhere it orders engines
    by ρ, as the least-loaded pick does; `max(prompt, 1)` keeps that true for prompts
    shorter than one block.
    """
    free = max(max_seqs - used, 1)
    return scale * max(prompt_blocks - overlap_blocks, 0) + max(prompt_blocks, 1) * used / free


def choose(
    engines: Sequence[EngineInfo],
    ours: Mapping[str, int],
    hashes: Sequence[int],
    index: PrefixIndex,
    now: float,
    prefill_scale: float = 1.0,
    *,
    tokens: Mapping[str, int] | None = None,
    need: int = 0,
    n: int = 1,
    role: Role = "union",
) -> Choice | None:
    """The engine of `role` with room and the lowest `cost`; None when none has room.

    Room is what the dispatcher checks: `n` more sequences within `max_seqs` (counting
    `ours`, the sequences this owner runs per engine, when the heartbeat is behind) and `need`
    more tokens within `max_tokens` (counting `tokens`, the tokens ours hold per engine).
    Ties go to the longer overlap, then the lower load fraction, then the lower engine id.
    """
    best: Choice | None = None
    best_key: tuple[float, int, float, str] | None = None
    held = tokens or {}
    blocks = len(hashes)
    for e in engines:
        if e.role != role or e.max_seqs <= 0:
            continue
        used = load(e, ours.get(e.id, 0))
        if used + n > e.max_seqs or held.get(e.id, 0) + need > e.max_tokens:
            continue
        hit = index.overlap(e.id, hashes, now)
        c = cost(blocks, hit, used, e.max_seqs, prefill_scale)
        key = (c, -hit, used / e.max_seqs, e.id)
        if best_key is None or key < best_key:
            best = Choice(engine=e, overlap_blocks=hit, prompt_blocks=blocks, cost=c, used=used)
            best_key = key
    return best
