"""A tool parameter's raw text as the JSON value its schema asks for.

Markup call syntaxes (Qwen3-Coder's `<parameter=…>`, MiniMax-M2's and GLM's tags) write
every argument as bare text. vLLM 0.33 turns each into JSON by the tool's schema: the types
a parameter's schema allows (`type`, an `enum`'s values, `anyOf`/`oneOf`/`allOf`), then the
first that the text reads as, in the order null, integer, number, boolean, object, array,
string. Render reads the types (`types_of`); derender converts (`coerce`, `typed`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

# The tool parsers that read calls as markup (workers/derender/tool_markup.py): render hands
# them the request's tools' parameter types.
MARKUP_PARSERS = frozenset(
    (
        "deepseek_v32",
        "deepseek_v4",
        "glm45",
        "glm47",
        "kimi_k2",
        "minimax_m2",
        "mistral",
        "qwen3_coder",
        "qwen3_xml",
        "seed_oss",
    )
)

# Type names models and schemas write for the JSON Schema ones.
_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
# an enum's values say their types
_ENUM_TYPES: dict[type, str] = {
    type(None): "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def types_of(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows; ["string"] when it says none."""
    if not isinstance(schema, dict):
        return ["string"]
    found: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        found.add(declared)
    elif isinstance(declared, list):
        found.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        found.update(_ENUM_TYPES[type(v)] for v in enum if type(v) in _ENUM_TYPES)
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                found.update(types_of(choice))
    return sorted(found) or ["string"]


def streams_as_text(types: Sequence[str] | None) -> bool:
    """Whether a value of these types is a JSON string whatever its text (so it can be
    streamed before it ends); None: a parameter the schema does not type."""
    return types is None or _normal(types) == {"string"}


def typed(text: str, types: Sequence[str] | None, as_json: bool = False) -> Any:
    """A parameter's value: its text (read as JSON first where `as_json`: DSML's values
    not marked `string="true"`), then converted to its schema's types if it has any.
    JSON objects and arrays stand as they read."""
    value: Any = text
    if as_json:
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if not _finite(value):
            value = text
    if not types:
        return value
    if isinstance(value, str):
        return coerce(value, types)
    if isinstance(value, (dict, list)):
        return value
    converted = coerce(json.dumps(value), types)
    same = type(converted) is type(value) and converted == value
    return value if same else converted


def coerce(text: str, types: Sequence[str]) -> Any:
    """The value `text` reads as: the first of the allowed types it parses as, else JSON
    if it is JSON (finite), else the text itself."""
    allowed = _normal(types)
    for kind in _ORDER:
        if kind not in allowed:
            continue
        if kind == "string":
            return text
        value = _as(kind, text)
        if value is not _NO:
            return value
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if _finite(value) else text


_NO = object()


def _normal(types: Sequence[str]) -> set[str]:
    return {_ALIASES.get(k, k) for k in (t.strip().lower() for t in types)}


def _as(kind: str, text: str) -> Any:
    if kind == "null":
        return None if text.lower() == "null" else _NO
    if kind == "boolean":
        word = text.strip().lower()
        return True if word in ("true", "1") else False if word in ("false", "0") else _NO
    if kind in ("integer", "number"):
        try:
            return int(text)
        except ValueError:
            if kind == "integer":
                return _NO
        try:
            number = float(text)
        except ValueError:
            return _NO
        if not math.isfinite(number):
            return _NO
        return int(number) if number == int(number) else number
    try:  # object, array
        value = json.loads(text)
    except ValueError:
        return _NO
    return value if _finite(value) else _NO


def _finite(value: Any) -> bool:
    """JSON can write it back (no inf or nan anywhere inside)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True
