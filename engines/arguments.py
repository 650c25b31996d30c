"""What the simulated engine's toy model writes as a tool call's arguments.

A real model writes a call's arguments as an object of the tool's parameters, which it reads
in its prompt, where the chat template lists the tools; the constraint holds them only to
JSON where the tool is not strict (vLLM's structural tag gives such a call `json_schema:
true`). The toy model reads its prompt the same way: the called tool's name is in the call's
opening (a structural tag's `begin`, where the constraint has written it), and its parameters
are the first JSON schema after that name in the prompt. It then writes a small document of
that schema (or of the strict one the constraint names), its choices picked by a key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

WORDS = ("Lisbon", "Kyoto", "Quito", "Oslo", "Accra", "Hanoi")  # a string's value
_NAME = re.compile(r'[\w.-]+(?![\w.-]|"\s*:)')  # a word of an opening, not a JSON key in it
_SCHEMAS_TRIED = 16  # JSON objects after the name read before giving up


def openings(tag: object) -> Iterator[tuple[str, object]]:
    """(begin, schema) of each part of a structural tag whose content is a JSON schema:
    where a call's arguments start, and what the constraint holds them to."""
    if isinstance(tag, list):
        for node in tag:
            yield from openings(node)
    if not isinstance(tag, dict) or tag.get("type") == "json_schema":
        return  # a schema holds no formats
    content = tag.get("content")
    if isinstance(content, dict) and content.get("type") == "json_schema":
        yield tag["begin"], content.get("json_schema", True)
    if "begin" in tag and "schema" in tag:  # the older form's structures
        yield tag["begin"], tag["schema"]
    for value in tag.values():
        yield from openings(value)


def triggers(tag: object) -> Iterator[str]:
    """The texts that open a structural tag's calls from free text (a `triggered_tags`
    format's triggers, or the older form's), in order."""
    if isinstance(tag, list):
        for node in tag:
            yield from triggers(node)
    if not isinstance(tag, dict) or tag.get("type") == "json_schema":
        return  # a schema holds no formats
    if isinstance(tag.get("triggers"), list):
        yield from (t for t in tag["triggers"] if isinstance(t, str))
    for key, value in tag.items():
        if key != "triggers":
            yield from triggers(value)


def chosen(begins: list[str], asked: str, specials: list[str]) -> int:
    """Which call the model makes for a user's turn `asked`: the first whose tool's name (a
    word of its opening) the turn names as a word, else the first."""
    for index, begin in enumerate(begins):
        for special in specials:
            begin = begin.replace(special, " ")
        for name in _NAME.findall(begin):
            if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", asked):
                return index
    return 0


def planned(begin: str, schema: object, prompt: str, specials: list[str], key: int) -> str:
    """The arguments the model writes after `begin`: JSON text of `schema`, or, where the
    constraint allows any JSON, of the tool's parameters as `prompt` lists them
    (`specials`: the vocabulary's added tokens, which name no tool)."""
    if not isinstance(schema, dict):
        schema = listed(prompt, begin, specials) or {"type": "object"}
    return json.dumps(example(schema, key), ensure_ascii=False)


def listed(prompt: str, begin: str, specials: list[str]) -> dict[str, object] | None:
    """The parameters the prompt lists for the tool `begin` names: its longest word found in
    the prompt with a JSON schema after it."""
    for special in specials:
        begin = begin.replace(special, " ")
    decoder = json.JSONDecoder()
    for name in sorted(set(_NAME.findall(begin)), key=len, reverse=True):
        at = prompt.find(name)
        braces = re.finditer(r"\{", prompt[at:]) if at >= 0 else iter(())
        for _, brace in zip(range(_SCHEMAS_TRIED), braces, strict=False):
            try:
                schema, _ = decoder.raw_decode(prompt, at + brace.start())
            except ValueError:
                continue
            if isinstance(schema, dict) and ("properties" in schema or "type" in schema):
                return schema
    return None


def example(schema: object, key: int) -> object:
    """A small value of `schema`: its required properties (all where none is), one item of
    an array, a word for a string; `key` picks an enum's value, a number, a word."""
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][key % len(schema["enum"])]
    for alternatives in ("anyOf", "oneOf", "allOf"):
        if schema.get(alternatives):
            return example(schema[alternatives][0], key)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties") or {}
        required = schema.get("required") or list(properties)
        names = [n for n in properties if n in required]
        names += [n for n in required if n not in properties]
        return {n: example(properties.get(n, {}), hash((key, i))) for i, n in enumerate(names)}
    if kind == "array":
        count = max(1, schema.get("minItems", 0))
        count = min(count, schema.get("maxItems", count))
        return [example(schema.get("items", {}), hash((key, i))) for i in range(count)]
    if kind in ("integer", "number"):
        value = int(schema.get("minimum", 0)) + key % 10
        return min(value, int(schema["maximum"])) if "maximum" in schema else value
    if kind == "boolean":
        return key % 2 == 0
    if kind == "string":
        return WORDS[key % len(WORDS)]
    return None
