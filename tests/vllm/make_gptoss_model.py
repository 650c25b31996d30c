"""Build a gpt-oss model directory for the vLLM tier: gpt-oss's tokenizer, rebuilt from the
o200k vocabulary that OpenAI's harmony package embeds, and a tiny config. No weights, and no
chat template: vLLM renders gpt-oss through harmony, never through Jinja.

Run with the vLLM venv's python, where vLLM installs `oss-harmony` (the `openai_harmony`
module) and brings tiktoken, tokenizers and transformers:

    python tests/vllm/make_gptoss_model.py --models-dir ~/.cache/tokenway/models
    python tests/vllm/make_gptoss_model.py --check DIR

The first prints the directory, `gpt-oss-<oss-harmony version>-<hash of this file>` under
`--models-dir`, built once (the same inputs give the same directory): written beside it,
checked, and renamed into place. The second holds a directory's tokenizer to the harmony
encoding and exits 1 if they disagree. Without `oss-harmony` both exit 3 with one line
saying so. Nothing is downloaded: harmony's vocabulary is compiled into the package.

`tokenizer.json` is transformers' tiktoken converter run on o200k_base's ranks (each ordinary
token's bytes as harmony decodes them; the builder holds them to tiktoken's published hash of
o200k_base) and o200k's pre-tokenization pattern (taken from tiktoken's own o200k_base
definition), with harmony's special tokens as added special tokens at their ids: the
`<|start|>`, `<|channel|>`, `<|message|>`, … markup and `<|reserved_NNNNNN|>` for every other
id up to the embedding's 201088 rows, each spelled as harmony decodes it. Two places where
this follows harmony rather than gpt-oss's published tokenizer files, which stop at id 200018
and spell that one `<|endofprompt|>`: here 200018 is `<|reserved_200018|>`, and the ids past it
are tokens too. (Harmony knows one more, `<|reserved_201088|>`, outside the embedding; it is
left out.)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from model_cli import main, staged, write_json

PACKAGE = "oss-harmony"
NO_PACKAGE = 3  # exit status: the package is not installed in this python
MAX_POSITIONS = 32768  # the tier's --max-model-len
VOCAB_ROWS = 201088  # gpt-oss's embedding rows: the ids a model can produce
# The markup tokens by id; every other special id is `<|reserved_NNNNNN|>`.
NAMED = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
    200008: "<|message|>", 200012: "<|call|>",
}  # fmt: skip
START_OF_TEXT, END_OF_TEXT, RETURN, CALL = 199998, 199999, 200002, 200012

# Texts the check encodes both ways: scripts, marks, digits, whitespace runs, code, markup.
CHECK_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "São Paulo, Zürich, Kraków, Ålesund, İstanbul; 東京タワー; 서울; القاهرة; मुंबई; ไทย",
    "e\u0301 n\u0303 a\u0308 (combining marks stay as they are: no normalization)",
    "emoji 🌊🇳🇴👩‍💻 and  double  spaces\t\ttabs\n\n\nnewlines \r\n done   ",
    "12345678901234567890 3.14159 -0.5e-10 0x1F 1,000,000",
    "I'M HERE, you'll see, they'd've, it's: DON'T 'quote' \"double\" CamelCaseWords",
    '{"city": "São Paulo", "days": 3, "opts": {"unit": "c", "hours": [6, 12]}}',
    "    def indented(self) -> None:\n        return None  # comment\n\n\n\tif x:\r\n\t\tpass\n",
    "<|start|>system<|message|>You are ChatGPT.\nReasoning: high<|end|><|start|>user"
    "<|message|>Weather in Paris?<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "Need tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
    '<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    '{"temp": 22}<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 22°C.<|return|>',
    "<|startoftext|>text<|endoftext|><|reserved_200000|><|reserved_200018|><|reserved_201087|>"
    "<|endofprompt|> <|not_a_token|>",
]


def _package() -> tuple[str, Any]:
    """The installed package's version and its gpt-oss encoding, or exit NO_PACKAGE."""
    try:
        version = importlib.metadata.version(PACKAGE)
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except (importlib.metadata.PackageNotFoundError, ImportError) as exc:
        print(f"{PACKAGE} is not installed in {sys.executable}: {exc}", file=sys.stderr)
        raise SystemExit(NO_PACKAGE) from exc
    return version, load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _token_bytes(harmony: Any, token_id: int) -> bytes:
    # the wrapper only decodes to text (lossy for a token holding part of a character)
    return bytes(harmony._inner.decode_bytes([token_id]))


def _ranks(harmony: Any) -> dict[bytes, int]:
    """o200k_base's mergeable ranks: the ordinary tokens, every id below the first special."""
    ordinary = min(NAMED)
    if harmony.is_special_token(ordinary - 1) or not harmony.is_special_token(ordinary):
        raise RuntimeError(f"harmony's ordinary tokens do not end at id {ordinary}")
    return {_token_bytes(harmony, i): i for i in range(ordinary)}


def _ranks_file(ranks: dict[bytes, int]) -> bytes:
    """The ranks as a .tiktoken file (base64 token, rank; in rank order), the form tiktoken
    publishes, hashes and loads."""
    lines = sorted(ranks.items(), key=lambda item: item[1])
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in lines)


def _specials(harmony: Any) -> list[tuple[int, str]]:
    """The special tokens (id, text) in id order, from the first special to the last row."""
    specials = []
    for token_id in range(min(NAMED), VOCAB_ROWS):
        text = _token_bytes(harmony, token_id).decode()
        want = NAMED.get(token_id, f"<|reserved_{token_id}|>")
        if text != want or not harmony.is_special_token(token_id):
            raise RuntimeError(f"harmony decodes special id {token_id} as {text!r}, not {want!r}")
        specials.append((token_id, text))
    return specials


def _o200k_pattern(ranks: dict[bytes, int]) -> str:
    """o200k's pre-tokenization pattern, from tiktoken's own o200k_base definition, fed
    `ranks` instead of the download it names, which they must match byte for byte."""
    from tiktoken_ext import openai_public

    def load(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if not url.endswith("/o200k_base.tiktoken"):
            raise RuntimeError(f"tiktoken's o200k_base asks for {url}")
        got = hashlib.sha256(_ranks_file(ranks)).hexdigest()
        if expected_hash is not None and got != expected_hash:
            raise RuntimeError(f"harmony's ranks hash to {got}, tiktoken's o200k_base to "
                               f"{expected_hash}")  # fmt: skip
        return ranks

    with mock.patch.object(openai_public, "load_tiktoken_bpe", load):
        return openai_public.o200k_base()["pat_str"]


def _tokenizer_json(ranks: dict[bytes, int], pattern: str, specials: list[tuple[int, str]]) -> str:
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as tmp:  # the converter reads ranks from a file
        ranks_path = Path(tmp) / "o200k_base.tiktoken"
        ranks_path.write_bytes(_ranks_file(ranks))
        tokenizer = TikTokenConverter(vocab_file=str(ranks_path), pattern=pattern).converted()
    if tokenizer.get_vocab_size() != len(ranks):
        raise RuntimeError(f"the converted vocabulary has {tokenizer.get_vocab_size()} tokens")
    # in id order: each gets the next id
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    for token_id, text in specials:
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"{text} got id {tokenizer.token_to_id(text)}, not {token_id}")
    return tokenizer.to_str(pretty=True)


def _tokenizer_config(specials: list[tuple[int, str]]) -> dict[str, Any]:
    added = {
        str(token_id): {"content": text, "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}
        for token_id, text in specials
    }  # fmt: skip
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": NAMED[START_OF_TEXT],
        "eos_token": NAMED[RETURN],
        "pad_token": NAMED[END_OF_TEXT],
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def tiny_config() -> dict[str, Any]:
    """A one-layer gpt-oss (attention sinks, a sliding window, 4 experts): what vLLM's render
    server reads (the model type that turns harmony on, the architecture, the context length,
    the vocabulary's size), small enough that nothing else matters."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": VOCAB_ROWS,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention"],
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        # gpt-oss's YaRN, with a factor that stretches its 4096 positions to MAX_POSITIONS
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": MAX_POSITIONS / 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "bos_token_id": START_OF_TEXT,
        "eos_token_id": RETURN,
        "pad_token_id": END_OF_TEXT,
        "torch_dtype": "bfloat16",
        # written by transformers before 5 for a non-Mistral model: transformers 5 then does
        # not warn that the tokenizer may have Mistral's broken pre-tokenization pattern
        "transformers_version": "4.57.1",
    }


def check(model_dir: Path, harmony: Any) -> list[str]:
    """Where `model_dir`'s tokenizer (through transformers, as vLLM and tokenway load it) and
    the harmony encoding disagree, in encoding `CHECK_TEXTS` or in any id's token; empty when
    they agree."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = []
    if len(tokenizer) != VOCAB_ROWS:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens, not {VOCAB_ROWS}")
    for text in CHECK_TEXTS:
        want = harmony.encode(text, allowed_special="all")
        got = tokenizer.encode(text, add_special_tokens=False)
        if got != want:
            problems.append(f"transformers encodes {text!r} as {got}, harmony as {want}")
        decoded = tokenizer.decode(want, skip_special_tokens=False)
        if decoded != text:
            problems.append(f"transformers decodes {want} as {decoded!r}, not {text!r}")
    # Each id on its own: an ordinary token's bytes (through the byte-level alphabet, since
    # one may hold part of a character), a special token's text.
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    ids = list(range(VOCAB_ROWS))
    for token_id, token in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        raw = _token_bytes(harmony, token_id)
        if harmony.is_special_token(token_id):
            added = tokenizer.added_tokens_decoder.get(token_id)
            ok = added is not None and added.special and token == raw.decode()
        else:
            ok = token is not None and [to_byte.get(c) for c in token] == list(raw)
        if not ok:
            problems.append(f"id {token_id} is {token!r} in transformers, {raw!r} in harmony")
    return problems


def build(out: Path, harmony: Any) -> Path:
    import tiktoken

    ranks = _ranks(harmony)
    pattern = _o200k_pattern(ranks)
    specials = _specials(harmony)
    # tiktoken on the same ranks and pattern: a disagreement it shares is in the inputs, one
    # it does not is in the conversion
    encoding = tiktoken.Encoding(
        name="gpt-oss", pat_str=pattern, mergeable_ranks=ranks,
        special_tokens={text: token_id for token_id, text in specials},
    )  # fmt: skip
    generation = {
        "bos_token_id": START_OF_TEXT,
        "eos_token_id": [RETURN, END_OF_TEXT, CALL],
        "pad_token_id": END_OF_TEXT,
    }
    with staged(out) as tmp:
        (tmp / "tokenizer.json").write_text(_tokenizer_json(ranks, pattern, specials))
        docs = {"tokenizer_config.json": _tokenizer_config(specials), "config.json": tiny_config()}
        write_json(tmp, docs | {"generation_config.json": generation})
        problems = [
            f"tiktoken encodes {text!r} otherwise"
            for text in CHECK_TEXTS
            if encoding.encode(text, allowed_special="all")
            != harmony.encode(text, allowed_special="all")
        ] + check(tmp, harmony)
        if problems:
            raise RuntimeError("the converted tokenizer disagrees:\n" + "\n".join(problems[:20]))
    return out


if __name__ == "__main__":
    main(__doc__, "gpt-oss", __file__, _package, build, check)
