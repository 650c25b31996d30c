"""Token obfuscation: a keyed permutation of the vocabulary, semantic IDs ↔ physical IDs (pure).

Everything above the engine bridge works in *semantic* IDs, the tokenizer's. An obfuscated
engine serves a model whose embedding rows were permuted, so it speaks *physical* IDs:
`physical = forward[semantic]`. The bridge maps each `EngineWork` to physical IDs on the
way in and each engine step back on the way out; the scheduler maps prompts only to hash
them for KV affinity, since the engines' caches hold physical blocks.

The permutation is a Fisher–Yates shuffle of `[0, vocab_size)` driven by a keyed PRF:
HMAC-SHA256(key) derives a seed, SHAKE-256 of the seed gives one 64-bit draw per swap.
Draws are reduced modulo the remaining length; with 64-bit draws and a vocabulary under
2^31 the bias is below 2^-33 per draw. Bytes are read little-endian on every machine, so a
scheduler and a bridge on different hosts derive the same tables. The key itself never
leaves the process: engines advertise `fingerprint`, an HMAC of the key and vocabulary
size, so a scheduler can refuse engines keyed differently (fail closed).
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tokenway.wire import EngineWork, LogprobEntry, SamplingParams, TokenLogprob

MIN_KEY_BYTES = 16
_DOMAIN = b"tokenway token obfuscation v1\x00"


class ObfuscationError(ValueError):
    """A key that cannot be used, or a token ID outside the vocabulary."""


def load_key(key: str | None, key_file: str | None) -> bytes | None:
    """The key from `--obfuscation-key` or `--obfuscation-key-file`; None when neither is set.

    A flag that was given but yields no usable key is an error, never "obfuscation off".
    """
    if key is not None and key_file is not None:
        raise ObfuscationError("give --obfuscation-key or --obfuscation-key-file, not both")
    if key_file is not None:
        if not key_file.strip():
            raise ObfuscationError("--obfuscation-key-file names no file")
        path = Path(key_file).expanduser()
        try:
            raw = path.read_bytes().strip()
        except OSError as exc:
            raise ObfuscationError(
                f"cannot read --obfuscation-key-file {path}: {exc.strerror or exc}"
            ) from exc
        where = f"--obfuscation-key-file {path}"
    elif key is not None:
        raw = key.strip().encode()
        where = "--obfuscation-key (or TOKENWAY_OBFUSCATION_KEY)"
    else:
        return None
    if len(raw) < MIN_KEY_BYTES:
        raise ObfuscationError(
            f"{where} holds {len(raw)} bytes; an obfuscation key needs at least "
            f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return raw


def _prf(key: bytes, label: bytes, vocab_size: int) -> bytes:
    return hmac.new(key, _DOMAIN + label + vocab_size.to_bytes(8, "little"), "sha256").digest()


def fingerprint(key: bytes, vocab_size: int) -> str:
    """What engines advertise: equal for equal (key, vocabulary size), and reveals neither."""
    return _prf(key, b"fingerprint", vocab_size)[:8].hex()


def _shuffled(key: bytes, vocab_size: int) -> list[int]:
    draws = array(
        "Q",
        hashlib.shake_256(_prf(key, b"permutation", vocab_size)).digest(8 * max(vocab_size - 1, 0)),
    )
    if sys.byteorder != "little":
        draws.byteswap()
    table = list(range(vocab_size))
    for k, i in enumerate(range(vocab_size - 1, 0, -1)):
        j = draws[k] % (i + 1)
        table[i], table[j] = table[j], table[i]
    return table


class Permutation:
    """The keyed bijection over `[0, vocab_size)`, with both lookup tables built once."""

    def __init__(self, key: bytes, vocab_size: int) -> None:
        if vocab_size <= 1:
            raise ObfuscationError(f"cannot obfuscate a vocabulary of {vocab_size} tokens")
        if len(key) < MIN_KEY_BYTES:
            raise ObfuscationError(f"an obfuscation key needs at least {MIN_KEY_BYTES} bytes")
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint(key, vocab_size)
        self._forward = _shuffled(key, vocab_size)
        inverse = [0] * vocab_size
        for semantic, physical in enumerate(self._forward):
            inverse[physical] = semantic
        self._inverse = inverse

    def __repr__(self) -> str:  # never the key, nor the tables
        return f"Permutation(vocab_size={self.vocab_size}, fingerprint={self.fingerprint})"

    def to_physical(self, ids: Sequence[int], what: str = "token_ids") -> list[int]:
        return self._map(self._forward, ids, what)

    def to_semantic(self, ids: Sequence[int], what: str = "engine output") -> list[int]:
        return self._map(self._inverse, ids, what)

    def _map(self, table: list[int], ids: Sequence[int], what: str) -> list[int]:
        try:
            out = list(map(table.__getitem__, ids))
        except IndexError:
            out = []
        if len(out) != len(ids) or (ids and min(ids) < 0):  # negative indexes wrap: refuse
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ObfuscationError(
                f"{what} holds token ID {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        return out

    # -- what crosses the bridge ------------------------------------------------------------

    def work_to_physical(self, work: EngineWork) -> EngineWork:
        """The prompt and every sampling field that names tokens, as the engine knows them.

        An obfuscated attempt may never use an engine's native (text) API: `native_ok` off.
        """
        return msgspec.structs.replace(
            work,
            token_ids=self.to_physical(work.token_ids, "the prompt"),
            sampling_params=self.params_to_physical(work.sampling_params),
            native_ok=False,
        )

    def params_to_physical(self, params: SamplingParams) -> SamplingParams:
        changes: dict[str, object] = {}
        if params.stop_token_ids:
            changes["stop_token_ids"] = self.to_physical(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            try:
                ids = [int(k) for k in params.logit_bias]
            except ValueError as exc:
                raise ObfuscationError(f"logit_bias keys must be token IDs: {exc}") from None
            physical = self.to_physical(ids, "logit_bias")
            changes["logit_bias"] = {
                str(p): bias for p, bias in zip(physical, params.logit_bias.values(), strict=True)
            }
        return msgspec.structs.replace(params, **changes) if changes else params

    def stop_reason_to_semantic(self, reason: int | str | None) -> int | str | None:
        """An integer stop reason is the stop token's ID; a string is a stop string."""
        if isinstance(reason, int) and not isinstance(reason, bool):
            return self.to_semantic([reason], "stop_reason")[0]
        return reason

    def logprobs_to_semantic(self, entries: list[LogprobEntry]) -> list[LogprobEntry]:
        back = self.to_semantic
        out = []
        for e in entries:
            top_ids = back([t.token_id for t in e.top], "logprob candidates")
            top = [
                TokenLogprob(token_id=i, logprob=t.logprob, rank=t.rank)
                for i, t in zip(top_ids, e.top, strict=True)
            ]
            (tid,) = back([e.token_id], "logprobs")
            out.append(LogprobEntry(token_id=tid, logprob=e.logprob, rank=e.rank, top=top))
        return out
