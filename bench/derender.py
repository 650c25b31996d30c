"""Derender micro-benchmark: the pure core, in-process, one core.

Measures output tokens per second through `workers.derender.core.derender`, streamed one
token per chunk and eight per chunk, threading `stream_state` between chunks as an owner
does, for:

- plain text;
- each reasoning parser in `REASONING_PARSERS`: half reasoning, its end marker, then content
  (gpt-oss's: an analysis message, then a final one);
- each tool parser in `TOOL_PARSERS`: a sentence of content (none for the Llama and pythonic
  parsers, whose output is calls only when it opens with one), then one `write_file` call in
  the parser's own syntax whose `content` string argument is nearly all of the output,
  followed by an integer `mode` (Qwen3-Coder writing a file). Before timing, the whole output
  is derendered once as a non-streaming answer and must give exactly that call.

Each row's baseline, measured in the same run, is one `Tokenizer.decode` of the whole output
(the best of three): the least any detokenizer must do; each rate is also given as a share of
it. Also reported: the serialized `stream_state` size after 100, 1,000 and 10,000 output
tokens and at the end (it must not grow), and late/early, the time per token at 80–90 % of
the output over that at 10–20 % (one token per chunk; the fastest of five windows in each, so
a pause from the rest of the machine does not count): about 1 when a chunk costs O(its own
size), growing with the output when a step rereads what came before.

Every row uses the bundled DeepSeek-V4 tokenizer. The markers of other families (`<tool_call>`,
`<|tool_call_begin|>`, `<minimax:tool_call>`, `[THINK]`, ...) are several tokens in it, not
one as in their own models' vocabularies, so at one token per chunk a marker arrives in
pieces: more held-back text than those models give, never less.

    python bench/derender.py [--tokens 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

from tokenway.model import default_model_dir
from tokenway.parsers import HARMONY_REASONING, REASONING_PARSERS, TOOL_PARSERS, reasoning_format
from tokenway.wire import DerenderEntry, OutputContext, ParseContext, ToolParams
from workers.derender.core import derender
from workers.derender.detok import Detokenizer

CORPUS = Path(__file__).resolve().parent.parent / "engines" / "corpus.txt"
CHECKPOINTS = (100, 1_000, 10_000)
PLAIN = OutputContext(api="chat", response_id="chatcmpl-b", model="m", stream=True)

# The call every tool row makes: a file's path, its text, and its mode (an integer).
PATH, MODE = "docs/pipeline.md", 420
WRITE_FILE = ToolParams(
    name="write_file", types={"path": ["string"], "content": ["string"], "mode": ["integer"]}
)
PREAMBLE = "I will write the file.\n\n"  # content before the call
# an output is these parsers' calls only if it opens with one: no content before it
OPENS_WITH_CALL = frozenset({"llama3_json", "llama4_json", "llama4_pythonic", "openai", "pythonic"})
# gpt-oss's harmony: where its output's reasoning opens, and what ends it and opens the answer
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"


def _json_args(content: str) -> str:
    return json.dumps({"path": PATH, "content": content, "mode": MODE}, ensure_ascii=False)


def _params(content: str) -> tuple[tuple[str, object], ...]:
    return (("path", PATH), ("content", content), ("mode", MODE))


def _deepseek_v31(content: str) -> str:
    return (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>write_file<｜tool▁sep｜>"
        f"{_json_args(content)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )


def _hermes(content: str) -> str:
    return (
        f'<tool_call>\n{{"name": "write_file", "arguments": {_json_args(content)}}}\n</tool_call>'
    )


def _kimi(content: str) -> str:
    return (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0"
        f"<|tool_call_argument_begin|>{_json_args(content)}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )


def _llama(content: str) -> str:
    return f'<|python_tag|>{{"name": "write_file", "parameters": {_json_args(content)}}}'


def _pythonic(start: str) -> Callable[[str], str]:
    def call(content: str) -> str:
        # a JSON string is a Python literal too
        literal = json.dumps(content, ensure_ascii=False)
        return f'{start}[write_file(path="{PATH}", content={literal}, mode={MODE})]'

    return call


def _qwen(block: str) -> Callable[[str], str]:
    def call(content: str) -> str:
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in _params(content))
        return f"<{block}>\n<function=write_file>\n{params}</function>\n</{block}>"

    return call


def _harmony(content: str) -> str:
    return (
        "<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>"
        f"{_json_args(content)}<|call|>"
    )


def _mistral(content: str) -> str:
    return f"[TOOL_CALLS]write_file[ARGS]{_json_args(content)}"


def _minimax(content: str) -> str:
    params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in _params(content))
    return (
        f'<minimax:tool_call>\n<invoke name="write_file">\n{params}</invoke>\n</minimax:tool_call>'
    )


def _glm(content: str) -> str:
    params = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in _params(content)
    )
    return f"<tool_call>write_file\n{params}</tool_call>"


def _dsml(block: str) -> Callable[[str], str]:
    def call(content: str) -> str:
        d = "｜DSML｜"
        params = "".join(
            f'<{d}parameter name="{k}" string="{is_str}">{v}</{d}parameter>\n'
            for k, v, is_str in (
                ("path", PATH, "true"),
                ("content", content, "true"),
                ("mode", MODE, "false"),
            )
        )
        return f'<{d}{block}>\n<{d}invoke name="write_file">\n{params}</{d}invoke>\n</{d}{block}>'

    return call


# Each tool parser's call, in its own syntax (tests/workers/derender/test_tool_markup.py).
CALLS: dict[str, Callable[[str], str]] = {
    "deepseek_v31": _deepseek_v31,
    "deepseek_v32": _dsml("function_calls"),
    "deepseek_v4": _dsml("tool_calls"),
    "glm45": _glm,
    "glm47": _glm,
    "hermes": _hermes,
    "kimi_k2": _kimi,
    "llama3_json": _llama,
    "llama4_json": _llama,
    "llama4_pythonic": _pythonic("<|python_start|>"),
    "minimax_m2": _minimax,
    "mistral": _mistral,
    "openai": _harmony,
    "pythonic": _pythonic(""),
    "qwen3_coder": _qwen("tool_call"),
    "qwen3_xml": _qwen("tool_call"),
    "seed_oss": _qwen("seed:tool_call"),
}


class Output(msgspec.Struct):
    kind: str  # plain, reasoning or tool
    parser: str
    context: OutputContext
    ids: list[int]
    content: str = ""  # a tool row's `content` argument, as its call must give it


def _long(
    tokenizer: Tokenizer, n: int, body: list[int], before: str, write: Callable[[str], str]
) -> tuple[str, list[int]]:
    """A file's text (`body`, cut at a token) whose call, written by `write` after the text
    `before` it, is an output of at least n tokens."""
    take = n - len(tokenizer.encode(before + write(""), add_special_tokens=False).ids)
    while True:
        content = tokenizer.decode(body[: max(take, 0)])
        ids = tokenizer.encode(before + write(content), add_special_tokens=False).ids
        if len(ids) >= n:
            return content, ids
        take += n - len(ids)


def outputs(tokenizer: Tokenizer, n: int) -> list[Output]:
    text = CORPUS.read_text(encoding="utf-8")
    lines = tokenizer.encode(text, add_special_tokens=False).ids
    words = tokenizer.encode(text.replace("\n", " "), add_special_tokens=False).ids
    plain = (words * (n // len(words) + 1))[:n]
    file_text = lines * (2 * n // len(lines) + 2)
    rows = [Output("plain", "", PLAIN, plain)]
    for parser in REASONING_PARSERS:
        harmony = parser == HARMONY_REASONING
        opens = tokenizer.encode(ANALYSIS, add_special_tokens=False).ids if harmony else []
        end_text = FINAL if harmony else reasoning_format(parser).end
        end = tokenizer.encode(end_text, add_special_tokens=False).ids
        parse = ParseContext(reasoning_parser=parser, reasoning_start="open")
        ids = opens + plain[: n // 2] + end + plain[: n - n // 2 - len(end) - len(opens)]
        rows.append(Output("reasoning", parser, _with(parse), ids))
    for parser in TOOL_PARSERS:
        if parser not in CALLS:  # unwritten(): reported, not measured
            continue
        before = "" if parser in OPENS_WITH_CALL else PREAMBLE
        content, ids = _long(tokenizer, n, file_text, before, CALLS[parser])
        parse = ParseContext(tool_choice="auto", tool_parser=parser, tools=[WRITE_FILE])
        rows.append(Output("tool", parser, _with(parse), ids, content))
    return rows


def unwritten() -> list[str]:
    """Tool parsers the bench has no call written for (a new parser's needs one in CALLS)."""
    return [p for p in TOOL_PARSERS if p not in CALLS]


def _with(parse: ParseContext) -> OutputContext:
    return msgspec.structs.replace(PLAIN, parse=parse)


def check_call(detok: Detokenizer, row: Output) -> None:
    """The whole output, derendered as one non-streaming answer, is the one write_file call."""
    whole = msgspec.structs.replace(row.context, stream=False)
    entry = DerenderEntry(context=whole, token_ids=row.ids, finish_reason="length")
    message = json.loads(derender(detok, entry).chunks[0])["choices"][0]["message"]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    want = {"path": PATH, "content": row.content, "mode": MODE}
    if [name for name, _ in calls] != ["write_file"] or _loads(calls[0][1]) != want:
        raise RuntimeError(f"{row.parser}: the output is not the write_file call: {calls!r:.300}")


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class Streamed(msgspec.Struct):
    seconds: float
    late_early: float
    state_bytes: dict[int | str, int]  # after each checkpoint's token, and at the end


def stream(detok: Detokenizer, ctx: OutputContext, ids: list[int], size: int) -> Streamed:
    """Derender `ids` in chunks of `size`, threading the state like an owner."""
    n = len(ids)
    early, late = _windows(n, size, 0.1), _windows(n, size, 0.8)
    marks = {*early, *late}
    at: dict[int, float] = {}
    sizes: dict[int | str, int] = {}
    state = None
    start = time.perf_counter()
    for i in range(0, n, size):
        if i in marks:
            at[i] = time.perf_counter()
        done = min(i + size, n)
        entry = DerenderEntry(
            context=ctx,
            state=state,
            token_ids=ids[i:done],
            finish_reason="length" if done == n else None,
        )
        state = derender(detok, entry).state
        if done in CHECKPOINTS:
            sizes[done] = len(state or b"")
    seconds = time.perf_counter() - start
    sizes["end"] = len(state or b"")
    return Streamed(seconds, _fastest(at, late) / _fastest(at, early), sizes)


def _windows(n: int, size: int, start: float) -> list[int]:
    """The chunk starts that bound five short windows from `start` of the output to 10 %
    past it."""
    return sorted({size * round(n * (start + k / 50) / size) for k in range(6)})


def _fastest(at: dict[int, float], edges: list[int]) -> float:
    """Seconds per token in the fastest of the windows: a pause the rest of the machine
    causes does not count."""
    return min((at[b] - at[a]) / (b - a) for a, b in itertools.pairwise(edges))


def decode_rate(tokenizer: Tokenizer, ids: list[int]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        tokenizer.decode(ids)
        best = min(best, time.perf_counter() - start)
    return len(ids) / best


def run(tokens: int) -> dict[str, dict[str, object]]:
    model = default_model_dir(Path(tempfile.gettempdir()) / "tokenway-bench")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    detok = Detokenizer(tokenizer)
    report: dict[str, dict[str, object]] = {}
    for row in outputs(tokenizer, tokens):
        if row.kind == "tool":
            check_call(detok, row)
        decode = decode_rate(tokenizer, row.ids)
        one, eight = (stream(detok, row.context, row.ids, size) for size in (1, 8))
        one_rate, eight_rate = len(row.ids) / one.seconds, len(row.ids) / eight.seconds
        report[f"{row.kind} {row.parser}".strip()] = {
            "kind": row.kind,
            "parser": row.parser or None,
            "tokens": len(row.ids),
            "baseline_decode_tok_s": round(decode),
            "chunk1_tok_s": round(one_rate),
            "chunk1_of_decode": round(one_rate / decode, 4),
            "chunk8_tok_s": round(eight_rate),
            "chunk8_of_decode": round(eight_rate / decode, 4),
            "late_early": round(one.late_early, 2),
            "state_bytes": one.state_bytes,
        }
    return report


def table(report: dict[str, dict[str, object]]) -> str:
    """The report as a markdown table."""
    head = (
        "| output | tokens | 1 tok/chunk | of decode | 8 tok/chunk | of decode | one decode "
        "| late/early | state bytes @100 / 1k / 10k / end |"
    )
    lines = [head, "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, row in report.items():
        sizes = row["state_bytes"]
        assert isinstance(sizes, dict)
        state = " / ".join(str(sizes.get(k, "–")) for k in (*CHECKPOINTS, "end"))
        lines.append(
            f"| {name} | {row['tokens']:,} "
            f"| {row['chunk1_tok_s']:,} | {row['chunk1_of_decode']:.1%} "
            f"| {row['chunk8_tok_s']:,} | {row['chunk8_of_decode']:.1%} "
            f"| {row['baseline_decode_tok_s']:,} | {row['late_early']:.2f} | {state} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000, help="output tokens per row")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    report = run(max(args.tokens, 10_000))
    print(table(report))
    if missing := unwritten():
        print(f"\nnot measured, no call written for them in CALLS: {', '.join(missing)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
