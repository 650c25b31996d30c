"""A stored response's input items, a page at a time, as OpenAI lists them (`input_page`):
the pure core of `GET /v1/responses/{id}/input_items`."""

from __future__ import annotations

import pytest

from ingress.responses import input_page
from tokenway.errors import InvalidRequest

ITEMS = [{"type": "message", "id": f"msg_{i}"} for i in range(30)]


def ids(query: list[tuple[str, str]]) -> list[int]:
    return [int(item["id"][4:]) for item in input_page(ITEMS, query)["data"]]


def test_newest_first_twenty_at_a_time_where_unsaid() -> None:
    page = input_page(ITEMS, [])
    assert ids([]) == list(range(29, 9, -1))
    assert page["has_more"] and (page["first_id"], page["last_id"]) == ("msg_29", "msg_10")


def test_order_and_limit_as_asked() -> None:
    assert ids([("order", "asc"), ("limit", "3")]) == [0, 1, 2]
    assert ids([("order", "desc"), ("limit", "100")]) == list(range(29, -1, -1))
    assert ids([("order", "desc"), ("order", "asc"), ("limit", "1")]) == [0]  # the last said


def test_after_starts_past_the_item_in_the_order_asked() -> None:
    assert ids([("order", "asc"), ("after", "msg_26")]) == [27, 28, 29]
    assert ids([("after", "msg_3")]) == [2, 1, 0]
    last = input_page(ITEMS, [("after", "msg_3"), ("limit", "3")])
    assert not last["has_more"]
    assert input_page(ITEMS, [("after", "msg_0")]) == {
        "object": "list",
        "data": [],
        "has_more": False,
        "first_id": None,
        "last_id": None,
    }


def test_before_is_the_page_that_ends_just_before_the_item() -> None:
    assert ids([("order", "asc"), ("before", "msg_10"), ("limit", "3")]) == [7, 8, 9]
    assert ids([("order", "asc"), ("after", "msg_1"), ("before", "msg_5")]) == [2, 3, 4]
    assert input_page(ITEMS, [("order", "asc"), ("before", "msg_10"), ("limit", "3")])["has_more"]


def test_include_takes_openais_values_and_changes_nothing() -> None:
    hinted = [("include[]", "reasoning.encrypted_content"), ("include", "file_search_call.results")]
    assert ids(hinted) == ids([])


@pytest.mark.parametrize(
    ("query", "param"),
    [([("order", "up")], "order"), ([("limit", "0")], "limit"), ([("limit", "101")], "limit"),
     ([("limit", "-1")], "limit"), ([("limit", "2.5")], "limit"), ([("limit", "²")], "limit"),
     ([("after", "msg_99")], "after"), ([("before", "nope")], "before"),
     ([("include[]", "everything")], "include")],
)  # fmt: skip
def test_what_openai_refuses_is_a_400_naming_it(query: list[tuple[str, str]], param: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        input_page(ITEMS, query)
    assert bad.value.param == param and query[0][1] in bad.value.message
