"""Derender micro-benchmark: the pure core, in-process, one core.

Measures output tokens per second through `workers.derender.core.derender` for plain text,
reasoning, and tool-call outputs, streamed one token per chunk and eight per chunk, next to
a baseline measured in the same run: one `Tokenizer.decode` of the whole output, the least
any detokenizer must do. Also reports the serialized `stream_state` size after 100, 1,000
and 10,000 output tokens (it must not grow).

    python bench/derender.py [--tokens 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from tokenway.model import default_model_dir
from tokenway.wire import DerenderEntry, OutputContext, ParseContext
from workers.derender.core import derender
from workers.derender.detok import Detokenizer

CORPUS = Path(__file__).resolve().parent.parent / "engines" / "corpus.txt"
CALL = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
    '{"query": "%s", "filters": {"lang": ["en", "ja"], "limit": 10}}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
PLAIN = OutputContext(api="chat", response_id="chatcmpl-b", model="m", stream=True)
REASONING = OutputContext(
    api="chat",
    response_id="chatcmpl-b",
    model="m",
    stream=True,
    parse=ParseContext(reasoning_parser="deepseek_v3", reasoning_start="open"),
)
TOOLS = OutputContext(
    api="chat",
    response_id="chatcmpl-b",
    model="m",
    stream=True,
    parse=ParseContext(tool_choice="auto", tool_parser="deepseek_v31"),
)


def outputs(tokenizer: Tokenizer, n: int) -> dict[str, tuple[OutputContext, list[int]]]:
    text = CORPUS.read_text(encoding="utf-8").replace("\n", " ")
    body = tokenizer.encode(text, add_special_tokens=False).ids
    plain = (body * (n // len(body) + 1))[:n]
    reasoning = plain[: n // 2] + tokenizer.encode("</think>").ids + plain[: n - n // 2 - 1]
    words = tokenizer.decode(plain[: n - 60])
    call = tokenizer.encode(CALL % words.replace('"', "'"), add_special_tokens=False).ids
    return {
        "plain": (PLAIN, plain),
        "reasoning": (REASONING, reasoning[:n]),
        "tool_call": (TOOLS, call),
    }


def stream(detok: Detokenizer, ctx: OutputContext, ids: list[int], size: int) -> float:
    """Seconds to derender `ids` in chunks of `size`, threading the state like an owner."""
    state = None
    start = time.perf_counter()
    for i in range(0, len(ids), size):
        chunk = ids[i : i + size]
        last = i + size >= len(ids)
        entry = DerenderEntry(
            context=ctx, state=state, token_ids=chunk, finish_reason="length" if last else None
        )
        state = derender(detok, entry).state
    return time.perf_counter() - start


def state_sizes(detok: Detokenizer, ctx: OutputContext, ids: list[int]) -> dict[int, int]:
    sizes, state = {}, None
    for i, tid in enumerate(ids, 1):
        state = derender(detok, DerenderEntry(context=ctx, state=state, token_ids=[tid])).state
        if i in (100, 1000, 10_000):
            sizes[i] = len(state)
    return sizes


def run(tokens: int) -> dict[str, object]:
    model = default_model_dir(Path(tempfile.gettempdir()) / "tokenway-bench")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    detok = Detokenizer(tokenizer)
    report: dict[str, object] = {}
    for name, (ctx, ids) in outputs(tokenizer, tokens).items():
        start = time.perf_counter()
        tokenizer.decode(ids)
        baseline = len(ids) / (time.perf_counter() - start)
        row: dict[str, object] = {"tokens": len(ids), "baseline_decode_tok_s": round(baseline)}
        for size in (1, 8):
            rate = len(ids) / stream(detok, ctx, ids, size)
            row[f"chunk{size}_tok_s"] = round(rate)
        row["state_bytes"] = state_sizes(detok, ctx, ids)
        report[name] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000, help="output tokens per case")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    report = run(max(args.tokens, 10_000))
    print(f"{'output':<12}{'1 tok/chunk':>14}{'8 tok/chunk':>14}{'one decode':>14}  state bytes")
    for name, row in report.items():
        assert isinstance(row, dict)
        print(
            f"{name:<12}{row['chunk1_tok_s']:>14,}{row['chunk8_tok_s']:>14,}"
            f"{row['baseline_decode_tok_s']:>14,}  {row['state_bytes']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
