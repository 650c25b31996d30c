"""Raw JSON rewritten as it streams into the text `json.dumps(json.loads(raw),
ensure_ascii=False)` gives, whatever the raw spacing, escapes and chunking."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.derender import json_canon
from workers.derender.json_canon import CanonState


def canon(pieces: list[str], ascii: bool = False) -> str:
    s = CanonState(ascii=ascii)
    out = [json_canon.step(s, p) for p in pieces]
    return "".join(out) + json_canon.finish(s)


def cut(text: str, points: list[int]) -> list[str]:
    edges = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def expected(raw: str, ascii: bool = False) -> str:
    return json.dumps(json.loads(raw), ensure_ascii=ascii)


def test_spacing_escapes_and_numbers_come_out_as_python_writes_them() -> None:
    raw = (
        '{ "a":1.50,"b" :[ 1E2 , -0, true,null],\n '
        '"c":"\\u00e9\\/\\ud83d\\ude00\\n\\u0007", "d":{} }'
    )
    assert (
        canon([raw])
        == expected(raw)
        == ('{"a": 1.5, "b": [100.0, 0, true, null], "c": "é/😀\\n\\u0007", "d": {}}')
    )
    assert canon(list(raw)) == expected(raw)


def test_what_is_not_json_passes_through() -> None:
    assert canon(['{"a": tru']) == '{"a": tru'


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8")),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    value=values,
    indent=st.sampled_from([None, 0, 2]),
    ascii_only=st.booleans(),
    points=st.lists(st.integers(min_value=0), max_size=30),
    ascii_out=st.booleans(),
)
def test_any_json_at_any_chunking_equals_the_whole_rewritten(
    value: object, indent: int | None, ascii_only: bool, points: list[int], ascii_out: bool
) -> None:
    """Either way json.dumps writes it: as is (hermes' arguments), or with ASCII escapes
    (json.dumps's default: harmony's arguments)."""
    raw = json.dumps(value, indent=indent, ensure_ascii=ascii_only, separators=(",", ":"))
    assert canon(cut(raw, points), ascii_out) == expected(raw, ascii_out)
