"""The hash of every full KV block of a prompt, each covering the blocks before it: what the
owners' KV-affinity index keeps and what the simulated engine's prefix cache is keyed by, so
that the two agree on which prompts share a prefix."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from struct import Struct

from xxhash import xxh3_64_intdigest

# The block hash scheme of Dynamo's KV router, which MindIE's KV Conductor shares, so that
# engine KV events hashed by either can later be matched against ours. Followed from
# ai-dynamo/dynamo: docs/guides "KV Events & Hashing Consistency" (algorithm, seed, token
# encoding, test vector) and lib/llm/src/kv_router/protocols.rs, `compute_block_hash_for_seq`
# and `compute_seq_hash_for_block`; MindIE-Motor's docs/zh/design/kv_conductor.md describes
# the same two levels (XXH3 `LocalBlockHash`, edges `(parent_seq_hash, local_hash)`).
#   local[i] = XXH3-64(block i's token IDs as u32 little-endian, seed 1337)
#   seq[0]   = local[0]                              (the first block has no parent)
#   seq[i]   = XXH3-64(seq[i-1] as u64 LE ‖ local[i] as u64 LE, seed 1337)
# Dynamo's own tests pin local([5..8]) = 16777012769546811212, seq = 4945711292740353085
# for tokens 1..8 in blocks of 4; ours reproduce them (tests/.../test_affinity.py). A salt
# (LoRA name there, `cache_salt` here) seeds the local hashes with 1337 + XXH3-64(salt).
# Only full blocks are hashed: a partial last block is never shared by an engine's cache.
SEED = 1337
BLOCK_SIZE = 16

_pair = Struct("<QQ").pack
_MASK64 = (1 << 64) - 1


def salt_seed(salt: str | None) -> int:
    """The hash seed for a request's cache salt (Dynamo's LoRA rule: 1337 + XXH3-64(name))."""
    if not salt:
        return SEED
    return (SEED + xxh3_64_intdigest(salt.encode())) & _MASK64


def _token_bytes(token_ids: Sequence[int], count: int) -> bytes:
    tokens = array("I", token_ids if count == len(token_ids) else token_ids[:count])
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tobytes()


def local_hashes(
    token_ids: Sequence[int], block_size: int = BLOCK_SIZE, seed: int = SEED
) -> list[int]:
    """One hash per full block of its own tokens only (Dynamo's `LocalBlockHash`)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    step = 4 * block_size
    data = _token_bytes(token_ids, len(token_ids) // block_size * block_size)
    return [xxh3_64_intdigest(data[i : i + step], seed) for i in range(0, len(data), step)]


def chain(local: Sequence[int]) -> list[int]:
    """Sequence hashes from local block hashes: each covers its block and all before it."""
    if not local:
        return []
    out = [local[0]]
    parent = local[0]
    for h in local[1:]:
        parent = xxh3_64_intdigest(_pair(parent, h), SEED)
        out.append(parent)
    return out


def block_hashes(
    token_ids: Sequence[int], block_size: int = BLOCK_SIZE, salt: str | None = None
) -> list[int]:
    """The sequence hash of every full block of a prompt: what `PrefixIndex` stores.

    A cache salt (vLLM's `cache_salt`: prompts that must not share KV) seeds the local
    hashes, so salted prompts never match unsalted ones; the chain keeps seed 1337.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    seed = salt_seed(salt)
    step = 4 * block_size
    data = _token_bytes(token_ids, len(token_ids) // block_size * block_size)
    if not data:
        return []
    # `chain(local_hashes(...))` in one pass: one loop, no intermediate list.
    parent = xxh3_64_intdigest(data[:step], seed)
    out = [parent]
    append = out.append
    for i in range(step, len(data), step):
        local = xxh3_64_intdigest(data[i : i + step], seed)
        parent = xxh3_64_intdigest(_pair(parent, local), SEED)
        append(parent)
    return out
