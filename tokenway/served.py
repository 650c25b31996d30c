"""The models a process serves: each `--model NAME=DIR` (repeatable), or the one model of
`--model-dir` and `--served-model-name` (by default the bundled DeepSeek-V4 tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenway import bus
from tokenway.config import Settings
from tokenway.model import DEFAULT_MODEL_NAME, ModelInfo, default_model_dir, load_model_info
from tokenway.model_parsers import picked
from tokenway.obfuscation import ObfuscationError, Permutation, load_key
from tokenway.parsers import HARMONY, HARMONY_REASONING, HARMONY_TOOLS, ParserFlags

# The bundled DeepSeek-V4 tokenizer's template speaks DeepSeek-V3.1's formats.
DEFAULT_PARSERS = ParserFlags(
    reasoning_parser="deepseek_v3", tool_call_parser="deepseek_v31", enable_auto_tool_choice=True
)


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients call it
    info: ModelInfo
    bundled: bool  # the bundled tokenizer directory: its parsers are the defaults


def model_entries(value: str) -> list[tuple[str, str | None]]:
    """`--model` values, comma-separated: `NAME=DIR`, or `NAME` for the bundled tokenizer."""
    entries = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        name, _, directory = item.partition("=")
        if not name.strip():
            raise ValueError(f"--model takes NAME=DIR (or NAME), got {item!r}")
        entries.append((name.strip(), directory.strip() or None))
    return entries


def served_models(s: Settings) -> list[ServedModel]:
    """Every model this process serves, in the order given (the first: the default of a
    request that names none). Exits with the reason when one cannot be served."""
    try:
        entries = model_entries(s.models)
        if entries and (s.model_dir or s.served_model_name):
            raise ValueError(
                "name models either with --model NAME=DIR (repeatable) or with --model-dir "
                "and --served-model-name, not both"
            )
        if not entries:
            given = Path(s.model_dir).expanduser() if s.model_dir else None
            entries = [
                (s.served_model_name or (given.name if given else DEFAULT_MODEL_NAME), s.model_dir)
            ]
        models = [_load(s, name, directory) for name, directory in entries]
        _check(s, models)
    except ValueError as exc:
        raise SystemExit(f"tokenway: {exc}") from exc
    return models


def _load(s: Settings, name: str, directory: str | None) -> ServedModel:
    # resolved: the directory reached through any link is one model, read once per process
    path = (Path(directory).expanduser() if directory else default_model_dir(s.data_path)).resolve()
    return ServedModel(name, load_model_info(path, s.max_model_len), bundled=directory is None)


def _check(s: Settings, models: list[ServedModel]) -> None:
    seen: dict[str, str] = {}  # subject token → the name that has it
    for model in models:
        # names meet as subject tokens: two that spell the same one would share queues
        key = bus.token(model.name)
        if key in seen:
            raise ValueError(
                f"model {model.name!r} is named twice"
                if seen[key] == model.name
                else f"models {seen[key]!r} and {model.name!r} would share the bus's subjects"
            )
        seen[key] = model.name
    if len(models) > 1:
        for backend in ("render", "derender"):
            if getattr(s, f"{backend}_backend") == "vllm":
                raise ValueError(
                    f"--{backend}-backend vllm serves one model (its server's); run one "
                    f"{backend} process per model"
                )


def _base(model: ServedModel) -> ParserFlags:
    """What a model brings when no flag names its parsers: the bundled tokenizer's
    defaults, or what a directory's chat template speaks (auto tool choice with a tool
    parser)."""
    if model.bundled:
        return DEFAULT_PARSERS
    if model.info.harmony:
        return ParserFlags(HARMONY_REASONING, HARMONY_TOOLS, enable_auto_tool_choice=True)
    reasoning, tools = picked(model.info.path)
    return ParserFlags(reasoning, tools, enable_auto_tool_choice=tools is not None)


def parser_flags(s: Settings, model: ServedModel) -> ParserFlags:
    """The flags as given (for every model of the process); what the model brings
    (`_base`) fills what was not given."""
    base = _base(model)
    auto = s.enable_auto_tool_choice
    flags = ParserFlags(
        reasoning_parser=s.reasoning_parser or base.reasoning_parser,
        tool_call_parser=s.tool_call_parser or base.tool_call_parser,
        enable_auto_tool_choice=base.enable_auto_tool_choice if auto is None else auto,
        strict_tool_calling=s.strict_tool_calling,
        tool_strict_level=s.tool_strict_level,
    )
    try:
        flags.check()
    except ValueError as exc:
        raise SystemExit(f"tokenway: {exc}") from exc
    other = next((p for p in (flags.reasoning_parser, flags.tool_call_parser)
                  if p is not None and p not in HARMONY), None)  # fmt: skip
    if model.info.harmony and other is not None:
        raise SystemExit(
            f"tokenway: model {model.name!r} is gpt-oss (its config's model_type): its output "
            f"is harmony's, read by --reasoning-parser {HARMONY_REASONING} and "
            f"--tool-call-parser {HARMONY_TOOLS}, not {other}"
        )
    return flags


def parsers_said(s: Settings, model: ServedModel) -> str:
    """The start-up line that says how a model's output is parsed, and where that came from."""
    flags, base = parser_flags(s, model), _base(model)
    source = "the bundled tokenizer's" if model.bundled else "its chat template's"
    if model.info.harmony:
        source = "gpt-oss's, its config says"

    def one(kind: str, name: str | None, given: str | None) -> str:
        if name is None:
            return f"no {kind} parser"
        return f"{kind} parser {name} ({'as given' if given else source})"

    auto = "on" if flags.enable_auto_tool_choice else "off"
    return (
        f"model {model.name!r}: {one('reasoning', flags.reasoning_parser, s.reasoning_parser)}, "
        f"{one('tool-call', flags.tool_call_parser, s.tool_call_parser)}, auto tool choice {auto}"
        + (
            ""
            if base == ParserFlags() or model.bundled
            else " (--reasoning-parser and --tool-call-parser override what the template speaks)"
        )
    )


def obfuscation(s: Settings, model: ModelInfo) -> Permutation | None:
    """The token permutation of a model's vocabulary when a key is configured; a key flag
    without a usable key refuses to start rather than run unobfuscated."""
    try:
        key = load_key(s.obfuscation_key, s.obfuscation_key_file)
        return None if key is None else Permutation(key, model.vocab_size)
    except ObfuscationError as exc:
        raise SystemExit(f"tokenway: {exc}") from exc
