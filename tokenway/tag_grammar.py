"""An xgrammar structural tag as a Lark grammar for llguidance: render checks a tag with it,
and the simulated engine decodes under it.

Every format becomes one rule. Where llguidance has no counterpart the grammar is looser
than the tag, never stricter: free text (`any_text`, the text around `triggered_tags`)
is any text, its `excludes` and `triggers` unenforced. A format kind it does not know
(an EBNF `grammar`, xgrammar's XML parameter styles…) is `Unsupported`: such a tag goes to
the engine unchecked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 64  # nesting of formats; a deeper tag is refused, not recursed into


class Unsupported(ValueError):
    """A format llguidance has no counterpart for."""


def lark(tag: dict[str, Any], tokens: Mapping[str, int] | None = None) -> str:
    """The grammar of a structural tag (`{"type": "structural_tag", "format": …}`);
    ValueError for one that is not well formed. `tokens`: the vocabulary's added tokens by
    their text — where a tag's text spells one, the grammar asks for that token (llguidance
    never matches an added token's text against its bytes)."""
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise ValueError('a structural tag needs a "format" object')
    rules: list[str] = []
    start = _Rules(rules, tokens or {}).rule(tag["format"], 0)
    return "\n".join([f"start: {start}", *rules]) + "\n"


class _Rules:
    def __init__(self, rules: list[str], tokens: Mapping[str, int]) -> None:
        self.rules = rules
        self.tokens = tokens

    def literal(self, text: str) -> str:
        """`text` as Lark: string pieces, and token references for the added tokens in it."""
        found = sorted((t for t in self.tokens if t and t in text), key=len, reverse=True)
        if not found:
            return json.dumps(text, ensure_ascii=False)
        parts = re.split("(" + "|".join(map(re.escape, found)) + ")", text)
        return " ".join(
            f"<[{self.tokens[p]}]>" if p in self.tokens else json.dumps(p, ensure_ascii=False)
            for p in parts
            if p
        )

    def rule(self, fmt: object, depth: int) -> str:
        """A new rule matching `fmt`; its name."""
        if depth > MAX_DEPTH:
            raise ValueError(f"structural tag formats nest deeper than {MAX_DEPTH}")
        if not isinstance(fmt, dict):
            raise ValueError(f"a structural tag format must be an object, got {fmt!r:.40}")
        kind = fmt.get("type")
        build = getattr(self, f"_{kind}", None) if isinstance(kind, str) else None
        if build is None:
            raise Unsupported(f"structural tag format {kind!r} is not decoded here")
        body = build(fmt, depth + 1)
        name = f"f{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def _const_string(self, fmt: dict[str, Any], depth: int) -> str:
        return self.literal(_field(fmt, "value", str))

    def _json_schema(self, fmt: dict[str, Any], depth: int) -> str:
        schema = fmt.get("json_schema")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("a json_schema format needs a JSON schema object or true")
        return f"%json {json.dumps(schema)}"

    def _regex(self, fmt: dict[str, Any], depth: int) -> str:
        return "/" + _field(fmt, "pattern", str).replace("/", "\\/") + "/"

    def _any_text(self, fmt: dict[str, Any], depth: int) -> str:
        return _TEXT

    def _sequence(self, fmt: dict[str, Any], depth: int) -> str:
        return " ".join(self.rule(e, depth) for e in _field(fmt, "elements", list)) or '""'

    def _or(self, fmt: dict[str, Any], depth: int) -> str:
        options = [self.rule(e, depth) for e in _field(fmt, "elements", list)]
        if not options:
            raise ValueError("an or format needs elements")
        return " | ".join(options)

    def _tag(self, fmt: dict[str, Any], depth: int) -> str:
        begin, end = _field(fmt, "begin", str), _field(fmt, "end", str)
        parts = [self.literal(begin) if begin else "", self.rule(fmt.get("content"), depth),
                 self.literal(end) if end else ""]  # fmt: skip
        return " ".join(p for p in parts if p)

    def _optional(self, fmt: dict[str, Any], depth: int) -> str:
        return f"{self.rule(fmt.get('content'), depth)}?"

    def _plus(self, fmt: dict[str, Any], depth: int) -> str:
        return f"{self.rule(fmt.get('content'), depth)}+"

    def _star(self, fmt: dict[str, Any], depth: int) -> str:
        return f"{self.rule(fmt.get('content'), depth)}*"

    def _tags(self, fmt: dict[str, Any], depth: int) -> str:
        tags = _field(fmt, "tags", list)
        if not tags:
            raise ValueError(f"a {fmt['type']} format needs tags")
        return "(" + " | ".join(self.rule(t, depth) for t in tags) + ")"

    def _tags_with_separator(self, fmt: dict[str, Any], depth: int) -> str:
        one, sep = self._tags(fmt, depth), _field(fmt, "separator", str)
        if fmt.get("stop_after_first"):
            body = one
        else:
            body = f"{one} ({self.literal(sep)} {one})*" if sep else f"{one}+"
        return body if fmt.get("at_least_one") else f"({body})?"

    def _triggered_tags(self, fmt: dict[str, Any], depth: int) -> str:
        _field(fmt, "triggers", list)
        one = self._tags(fmt, depth)
        if fmt.get("stop_after_first"):
            calls = one if fmt.get("at_least_one") else f"{one}?"
            return f"{_TEXT} {calls}"
        more = f"({one} {_TEXT})"
        return f"{_TEXT} {more}+" if fmt.get("at_least_one") else f"{_TEXT} {more}*"


_TEXT = "/(?s:.*)/"


def _field(fmt: dict[str, Any], name: str, kind: type) -> Any:
    value = fmt.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"a {fmt.get('type')} format needs {name!r} ({kind.__name__})")
    return value
