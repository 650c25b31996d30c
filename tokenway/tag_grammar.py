"""An xgrammar structural tag, checked as vLLM 0.33's xgrammar checks it, and as a Lark grammar
for llguidance: render refuses a tag with it before anything is queued, and the simulated
engine decodes under it.

Every format is checked, whatever its kind: its fields, as xgrammar 0.2.8 reads them (a kind
it does not know, a missing content, an empty list of elements, tags or triggers, a tag no
trigger opens, a tag whose content never ends without an end string…), so what vLLM refuses
is refused here, naming where. The older form (`structures` with begin/schema/end, and
`triggers`), which vLLM reads as a `triggered_tags` format, is served as that format.

Every format becomes one rule. Where llguidance has no counterpart the grammar is looser
than the tag, never stricter: free text (`any_text`, the text around `triggered_tags`)
is any text, its `excludes`, `max_tokens` and `triggers` unenforced. A well-formed tag with
a kind that has no Lark rule here (token sets, `repeat`, `dispatch`, the XML parameter
styles) is `Unsupported`: it goes to vLLM, whose xgrammar decodes it, and the simulated
engine refuses it as the request's own fault.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from types import UnionType
from typing import Any, TypeGuard

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

MAX_DEPTH = 64  # nesting of formats; a deeper tag is refused, not recursed into
MAX_ID = 2**31 - 1  # a token ID, and xgrammar's bound on a count
# xgrammar's JSON schema styles: "json" is llguidance's JSON; the others are XML call syntaxes
STYLES = (
    "json",
    "qwen_xml",
    "minimax_xml",
    "minimax_m3_xml",
    "deepseek_xml",
    "glm_xml",
    "cohere_xml",
    "kimi_k3_xml",
    "deepseek_v4_1_xml",
)


class Unsupported(ValueError):
    """A well-formed tag with a format llguidance has no counterpart for here."""


def lark(tag: object, tokens: Mapping[str, int] | None = None) -> str:
    """The grammar of a structural tag (`{"type": "structural_tag", "format": …}`, or the
    older `structures`/`triggers` form); ValueError naming what vLLM would refuse in it,
    `Unsupported` for a well-formed one with a format not decoded here. `tokens`: the
    vocabulary's added tokens by their text — where a tag's text spells one, the grammar
    asks for that token (llguidance never matches an added token's text against its bytes)."""
    rules = _Rules(tokens or {})
    grammar = rules.top(tag)
    if rules.unsupported:
        raise Unsupported(f"structural tag format {rules.unsupported[0]} is not decoded here")
    return grammar


def checked(tag: object) -> str:
    """A grammar holding every part of a well-formed tag that llguidance compiles (its
    schemas, patterns, grammars), looser than the tag where a format is not decoded here:
    what render compiles to check such a tag. ValueError as `lark`."""
    return _Rules({}).top(tag)


def lark_of_gbnf(text: str) -> str:
    """A GBNF grammar as Lark; ValueError where the converter cannot read it. Besides its
    own error it raises a bare Exception for a missing rule (or no `root`), and an
    IndexError reading past an escape the grammar's end cuts off (`root ::= "\\`): the
    client's grammar each time. Any other exception is a bug and stays one."""
    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as exc:
        raise ValueError(str(exc)) from exc
    except IndexError as exc:
        raise ValueError("incomplete escape sequence at the end of the grammar") from exc
    except Exception as exc:
        if type(exc) is not Exception:
            raise
        raise ValueError(str(exc)) from exc


def legacy(tag: dict[str, Any]) -> dict[str, Any]:
    """The older form as the `triggered_tags` format vLLM reads it as. vLLM's guidance
    backend, its fallback, takes it where a tag's begin starts with any trigger (xgrammar
    wants exactly one), so triggers are not matched one to one here."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list of {begin, schema, end} objects")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a list of non-empty strings")
    tags = []
    for i, s in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} must be a {{begin, schema, end}} object")
        begin, schema, end = s.get("begin"), s.get("schema"), s.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f"{where} needs a begin and an end string")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError(f"{where}.schema is a string that is not JSON") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"{where} needs a schema: a JSON schema object or true")
        if not any(begin.startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin {begin!r} starts with none of the triggers")
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


_TEXT = "/(?s:.*)/"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class _Rules:
    """One walk over a tag: checks each format and writes its rule. Kinds without a rule
    here are noted in `unsupported` and written as free text (their parts still become
    rules, so that compiling the grammar checks them)."""

    def __init__(self, tokens: Mapping[str, int]) -> None:
        self.rules: list[str] = []
        self.tokens = tokens
        self.unsupported: list[str] = []

    def top(self, tag: object) -> str:
        if not isinstance(tag, dict):
            raise ValueError("a structural tag must be a JSON object")
        if tag.get("type", "structural_tag") != "structural_tag":
            raise ValueError('a structural tag\'s type must be "structural_tag"')
        if "structures" in tag:  # the older form: vLLM reads it whatever else is there
            start = self._triggered_tags(legacy(tag), "structures", 1, one_trigger=False)
        elif "format" not in tag:
            raise ValueError('a structural tag needs a "format" object')
        else:
            start = self.rule(tag["format"], "format", 0)
        return "\n".join([f"start: {start}", *self.rules]) + "\n"

    def rule(self, fmt: object, where: str, depth: int) -> str:
        """A new rule matching `fmt` (at `where` in the tag); its name."""
        if depth > MAX_DEPTH:
            raise ValueError(f"structural tag formats nest deeper than {MAX_DEPTH}")
        if not isinstance(fmt, dict):
            raise ValueError(f"{where} must be a format object, got {json.dumps(fmt)[:40]}")
        kind = fmt.get("type")
        if kind is None:  # xgrammar guesses the kind from the fields: vLLM judges it
            self.unsupported.append(f"without a type at {where}")
            body = _TEXT
        elif not isinstance(kind, str) or kind not in _KINDS:
            raise ValueError(
                f"{where} has the type {json.dumps(kind)[:40]}, which is no structural tag "
                f"format (one of {', '.join(sorted(_KINDS))})"
            )
        else:
            body = _KINDS[kind](self, fmt, where, depth + 1)
        name = f"f{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def _not_here(self, kind: str, where: str, parts: list[str]) -> str:
        """A kind with no rule here: noted, and free text beside its parts' rules."""
        self.unsupported.append(f"{kind!r} at {where}")
        return " | ".join([_TEXT, *parts])

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

    # -- the kinds, as xgrammar 0.2.8 checks each ----------------------------------------------

    def _const_string(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return self.literal(_field(fmt, where, "value", str))

    def _json_schema(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        schema = _schema(fmt, where)
        style = fmt.get("style", "json")
        if style not in STYLES:
            raise ValueError(f"{where}.style must be one of {', '.join(STYLES)}")
        _flags(fmt, where, "any_order")
        _strings(fmt, where, "excludes", non_empty=True)
        spaces = fmt.get("max_whitespace_cnt")
        if spaces is not None and not (_is_int(spaces) and spaces > 0):
            raise ValueError(f"{where}.max_whitespace_cnt must be a positive integer or null")
        body = f"%json {json.dumps(schema)}"
        return (
            body if style == "json" else self._not_here(f"json_schema style {style}", where, [body])
        )

    def _qwen_xml_parameter(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return self._not_here(
            "qwen_xml_parameter", where, [f"%json {json.dumps(_schema(fmt, where))}"]
        )

    def _any_text(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        _strings(fmt, where, "excludes")
        _counts(fmt, where, "max_tokens", "max_chars")
        return _TEXT

    def _grammar(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        text = fmt.get("grammar")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"the grammar format at {where} has no grammar text (EBNF)")
        try:
            grammar = lark_of_gbnf(text)
        except ValueError as exc:
            raise ValueError(f"the grammar format at {where} is not valid: {exc}") from None
        if why := LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)):
            raise ValueError(f"the grammar format at {where} is not valid: {why}")
        return "%lark {\n" + grammar + "\n}"

    def _regex(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        pattern = fmt.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where} needs its pattern: a non-empty string")
        return "/" + pattern.replace("/", "\\/") + "/"

    def _token(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return f"<[{_token_id(fmt.get('token'), f'{where}.token')}]>"

    def _exclude_token(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        _token_ids(fmt, where, "exclude_tokens")
        return self._not_here("exclude_token", where, [])

    def _any_tokens(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        _token_ids(fmt, where, "exclude_tokens")
        _counts(fmt, where, "max_tokens")
        return self._not_here("any_tokens", where, [])

    def _sequence(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return " ".join(self._elements(fmt, where, depth))

    def _or(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return " | ".join(self._elements(fmt, where, depth))

    def _elements(self, fmt: dict[str, Any], where: str, depth: int) -> list[str]:
        elements = _field(fmt, where, "elements", list)
        if not elements:
            raise ValueError(f"{where} needs at least one element")
        return [self.rule(e, f"{where}.elements[{i}]", depth) for i, e in enumerate(elements)]

    def _tag(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        begin = fmt.get("begin")
        if isinstance(begin, dict) and begin.get("type") == "token":
            opening = self._token(begin, f"{where}.begin", depth)
        elif isinstance(begin, str):
            opening = self.literal(begin) if begin else ""
        else:
            raise ValueError(f"{where}.begin must be a string or a token format")
        if "content" not in fmt:
            raise ValueError(f"{where} needs a content format")
        content = self.rule(fmt["content"], f"{where}.content", depth)
        end = fmt.get("end")
        if isinstance(end, dict) and end.get("type") == "token":
            closing, ends = self._token(end, f"{where}.end", depth), True
        elif isinstance(end, str):
            closing, ends = (self.literal(end) if end else ""), bool(end)
        elif isinstance(end, list) and end and all(isinstance(e, str) for e in end):
            closing = "(" + " | ".join(self.literal(e) if e else '""' for e in end) + ")"
            ends = any(end)
        else:
            raise ValueError(
                f"{where}.end must be a string, a non-empty list of strings or a token format"
            )
        if not ends and _unbounded(fmt["content"]):
            raise ValueError(
                f"the content of {where} runs on without an end of its own, so "
                "its end must be a non-empty string"
            )
        return " ".join(p for p in (opening, content, closing) if p)

    def _tags(
        self, fmt: dict[str, Any], where: str, depth: int, begin: type | UnionType
    ) -> list[str]:
        """The rules of a list of tags (`tags`), each opened by a `begin` of that kind."""
        tags = _field(fmt, where, "tags", list)
        if not tags:
            raise ValueError(f"{where} needs at least one tag")
        for i, tag in enumerate(tags):
            if not isinstance(tag, dict) or tag.get("type") != "tag":
                raise ValueError(f'{where}.tags[{i}] must be a format of type "tag"')
            if not isinstance(tag.get("begin"), begin):
                raise ValueError(
                    f"{where}.tags[{i}].begin must be a "
                    f"{'string' if begin is str else 'token format'}"
                )
        return [self.rule(t, f"{where}.tags[{i}]", depth) for i, t in enumerate(tags)]

    def _triggered_tags(
        self, fmt: dict[str, Any], where: str, depth: int, one_trigger: bool = True
    ) -> str:
        triggers = _field(fmt, where, "triggers", list)
        if not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
        _flags(fmt, where, "at_least_one", "stop_after_first")
        _strings(fmt, where, "excludes")
        tags = self._tags(fmt, where, depth, str)
        for i, tag in enumerate(fmt["tags"]):
            opened = sum(tag["begin"].startswith(t) for t in triggers)
            if opened == 0 or (one_trigger and opened > 1):
                raise ValueError(
                    f"{where}.tags[{i}].begin {tag['begin']!r} starts with "
                    f"{'none' if opened == 0 else 'more than one'} of the "
                    "triggers"
                )
        one = "(" + " | ".join(tags) + ")"
        if fmt.get("stop_after_first"):
            calls = one if fmt.get("at_least_one") else f"{one}?"
            return f"{_TEXT} {calls}"
        more = f"({one} {_TEXT})"
        return f"{_TEXT} {more}+" if fmt.get("at_least_one") else f"{_TEXT} {more}*"

    def _token_triggered_tags(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        triggers = _token_ids(fmt, where, "trigger_tokens", required=True)
        _token_ids(fmt, where, "exclude_tokens")
        _flags(fmt, where, "at_least_one", "stop_after_first")
        tags = self._tags(fmt, where, depth, dict)
        for i, tag in enumerate(fmt["tags"]):
            if tag["begin"].get("token") not in triggers:
                raise ValueError(f"{where}.tags[{i}].begin is none of the trigger tokens")
        return self._not_here("token_triggered_tags", where, tags)

    def _tags_with_separator(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        sep = _field(fmt, where, "separator", str)
        _flags(fmt, where, "at_least_one", "stop_after_first")
        one = "(" + " | ".join(self._tags(fmt, where, depth, str | dict)) + ")"
        if fmt.get("stop_after_first"):
            body = one
        else:
            body = f"{one} ({self.literal(sep)} {one})*" if sep else f"{one}+"
        return body if fmt.get("at_least_one") else f"({body})?"

    def _optional(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return f"{self._content(fmt, where, depth)}?"

    def _plus(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return f"{self._content(fmt, where, depth)}+"

    def _star(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        return f"{self._content(fmt, where, depth)}*"

    def _repeat(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        low, high = fmt.get("min"), fmt.get("max")
        if not _is_int(low) or not 0 <= low <= MAX_ID:
            raise ValueError(f"{where}.min must be a count (0 or more)")
        if not _is_int(high) or not (high == -1 or 0 <= high <= MAX_ID):
            raise ValueError(f"{where}.max must be a count, or -1 for no limit")
        if high != -1 and low > high:
            raise ValueError(f"{where}.min {low} is more than its max {high}")
        return self._not_here("repeat", where, [self._content(fmt, where, depth)])

    def _content(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        if "content" not in fmt:
            raise ValueError(f"{where} needs a content format")
        return self.rule(fmt["content"], f"{where}.content", depth)

    def _dispatch(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        _flags(fmt, where, "loop")
        _strings(fmt, where, "excludes")
        return self._not_here("dispatch", where, self._rules(fmt, where, depth, str))

    def _token_dispatch(self, fmt: dict[str, Any], where: str, depth: int) -> str:
        _flags(fmt, where, "loop")
        _token_ids(fmt, where, "exclude_tokens")
        return self._not_here("token_dispatch", where, self._rules(fmt, where, depth, int))

    def _rules(self, fmt: dict[str, Any], where: str, depth: int, pattern: type) -> list[str]:
        """A dispatch's `rules`: [pattern, format] pairs."""
        pairs = _field(fmt, where, "rules", list)
        if not pairs:
            raise ValueError(f"{where} needs at least one rule")
        names = []
        for i, pair in enumerate(pairs):
            at = f"{where}.rules[{i}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"{at} must be a [pattern, format] pair")
            if pattern is int:
                _token_id(pair[0], f"{at}[0]")
            elif not isinstance(pair[0], str):
                raise ValueError(f"{at}[0] must be a string")
            names.append(self.rule(pair[1], f"{at}[1]", depth))
        return names


_Build = Callable[[_Rules, dict[str, Any], str, int], str]
# Every kind xgrammar 0.2.8 knows, and what checks it and writes its rule.
_KINDS: dict[str, _Build] = {
    kind: getattr(_Rules, f"_{kind}")
    for kind in (
        "const_string",
        "json_schema",
        "any_text",
        "grammar",
        "regex",
        "token",
        "exclude_token",
        "any_tokens",
        "sequence",
        "or",
        "tag",
        "triggered_tags",
        "token_triggered_tags",
        "tags_with_separator",
        "optional",
        "plus",
        "star",
        "repeat",
        "dispatch",
        "token_dispatch",
        "qwen_xml_parameter",
    )
}
# Kinds whose text may run on for ever: a tag around one needs an end string (xgrammar's rule).
_RUNS_ON = frozenset(
    {
        "any_text",
        "any_tokens",
        "triggered_tags",
        "token_triggered_tags",
        "tags_with_separator",
        "plus",
        "star",
        "dispatch",
        "token_dispatch",
    }
)


def _unbounded(fmt: dict[str, Any]) -> bool:
    """Whether a (checked) format's text may run on without an end of its own."""
    kind = fmt.get("type")
    if kind in _RUNS_ON:
        return True
    if kind in ("sequence", "or"):
        return any(_unbounded(e) for e in fmt["elements"])
    if kind == "optional":
        return _unbounded(fmt["content"])
    if kind == "repeat":
        return fmt["max"] == -1 or _unbounded(fmt["content"])
    return False


def _field(fmt: dict[str, Any], where: str, name: str, kind: type) -> Any:
    value = fmt.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"{where} needs {name!r} ({kind.__name__})")
    return value


def _schema(fmt: dict[str, Any], where: str) -> dict[str, Any]:
    schema = fmt.get("json_schema")
    if schema is True:
        return {}
    if schema is False or not isinstance(schema, dict):
        raise ValueError(f"{where} needs a json_schema: a JSON schema object or true")
    return schema


def _flags(fmt: dict[str, Any], where: str, *names: str) -> None:
    for name in names:
        if not isinstance(fmt.get(name, False), bool):
            raise ValueError(f"{where}.{name} must be true or false")


def _strings(fmt: dict[str, Any], where: str, name: str, non_empty: bool = False) -> None:
    value = fmt.get(name, [])
    if not isinstance(value, list) or not all(
        isinstance(s, str) and (s or not non_empty) for s in value
    ):
        raise ValueError(f"{where}.{name} must be a list of {'non-empty ' * non_empty}strings")


def _counts(fmt: dict[str, Any], where: str, *names: str) -> None:
    for name in names:
        value = fmt.get(name)
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_ID):
            raise ValueError(f"{where}.{name} must be a count (0 or more) or null")


def _token_id(value: object, where: str) -> int:
    """A token named by its ID: vLLM checks a tag without its tokenizer, so a token named
    by its text is refused there."""
    if isinstance(value, str):
        raise ValueError(f"{where} names a token by its text; name it by its ID")
    if not _is_int(value) or not 0 <= value <= MAX_ID:
        raise ValueError(f"{where} must be a token ID")
    return value


def _token_ids(fmt: dict[str, Any], where: str, name: str, required: bool = False) -> list[int]:
    value = fmt.get(name, None if required else [])
    if not isinstance(value, list) or (required and not value):
        raise ValueError(f"{where}.{name} must be a {'non-empty ' * required}list of token IDs")
    return [_token_id(v, f"{where}.{name}[{i}]") for i, v in enumerate(value)]
