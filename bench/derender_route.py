"""vLLM's streaming derender route as a coordinator drives it through a long answer: one
generate event of one token per call, each call carrying the last call's `stream_state`.
What a call costs and what the carried state weighs, early in the answer and late, on
tokenway's route and (with `--vllm-url`) on vLLM's render server in the same run.

    python -m bench.derender_route --url http://127.0.0.1:8000 [--vllm-url URL]
        [--tokens 2000] [--json out.json]

Both servers must serve the same tokenizer (tokenway's bundled DeepSeek-V4 one and the vLLM
tier's tiny model do) with a reasoning and a tool parser, the path where vLLM keeps every
output token in the state and replays them on every call. The answer is a synthetic text
tokenized by `--url`'s `/tokenize`; the prompt is a chat rendered by `--url`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

TEXT = "The river bends past the mill, and the miller counts the sacks of grain. "
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 8}
WINDOW = 100  # calls averaged at each end


async def _ids(http: httpx.AsyncClient, tokens: int) -> tuple[list[int], list[int]]:
    """The answer's IDs (`tokens` of them) and the chat prompt's."""
    text = TEXT * (tokens // 10 + 1)
    answer = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    rendered = await http.post("/v1/chat/completions/render", json=CHAT)
    return answer.json()["tokens"][:tokens], rendered.json()["token_ids"]


async def carry(url: str, answer: list[int], prompt: list[int]) -> dict[str, Any]:
    """Every token its own call, in order: each call's wall time and state size."""
    times, sizes, text = [], [], []
    state = None
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        for i, token in enumerate(answer):
            last = i == len(answer) - 1
            choice = {"index": 0, "token_ids": [token], "finish_reason": "length" if last else None}
            call = {"stream": True, "stream_state": state, "chat_request": CHAT,
                    "prompt_token_ids": prompt,
                    "generate_chunk": {"request_id": "bench", "choices": [choice]}}  # fmt: skip
            began = time.perf_counter()
            resp = await http.post("/v1/chat/completions/derender", json=call)
            times.append((time.perf_counter() - began) * 1000)
            resp.raise_for_status()
            answered = resp.json()
            state = answered["stream_state"]
            sizes.append(len(json.dumps(state)))
            delta = answered["chunk"]["choices"][0]["delta"]
            text.append((delta.get("content") or "") + (delta.get("reasoning") or ""))
    early, late = statistics.mean(times[:WINDOW]), statistics.mean(times[-WINDOW:])
    return {
        "calls": len(times),
        "early_ms": round(early, 2),
        "late_ms": round(late, 2),
        "late_over_early": round(late / early, 2),
        "state_bytes_early": sizes[min(9, len(sizes) - 1)],
        "state_bytes_late": sizes[-1],
        "text_chars": len("".join(text)),
    }


async def run(url: str, vllm_url: str | None, tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        answer, prompt = await _ids(http, tokens)
    out = {"tokens": len(answer), "tokenway": await carry(url, answer, prompt)}
    if vllm_url:
        out["vllm"] = await carry(vllm_url, answer, prompt)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="tokenway's base URL")
    parser.add_argument("--vllm-url", help="a vLLM render server's base URL, run beside")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args()
    result = asyncio.run(run(args.url, args.vllm_url, args.tokens))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
