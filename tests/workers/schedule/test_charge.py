"""What an attempt holds of its engine's budget: its prompt and a reserve per sequence
ahead of its output, charged again as it outgrows it, never past its max_tokens."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import make_settings
from tokenway.wire import GenerateRequest, SamplingParams, TokenDelta
from workers.schedule.dispatch import Dispatcher, holding
from workers.schedule.owned import Owned


def test_the_hold_grows_by_reserves_as_each_choice_outgrows_one(tmp_path: Path) -> None:
    dispatcher = Dispatcher(None, "o1", None, make_settings(tmp_path, decode_reserve=4))  # type: ignore[arg-type]
    request = GenerateRequest(
        request_id="r1", token_ids=[5, 6, 7], sampling_params=SamplingParams(n=2, max_tokens=10)
    )
    r = Owned(rid="r1", reply="i1", request=request, deadline=1e9, msg=None)
    r.engine, r.attempt, r.held = "e1", 1, holding(r, 4)
    dispatcher.tokens["e1"] = r.held
    assert r.held == 3 + 4 + 4
    steps = [(0, 3), (1, 1), (0, 2), (0, 6), (1, 9)]  # (choice, tokens) per engine delta
    for seq, (index, tokens) in enumerate(steps):
        delta = TokenDelta(rid="r1", attempt=1, seq=seq, index=index, token_ids=[9] * tokens)
        assert r.accept(delta)
        dispatcher.grow(r, r.choices[index], tokens)
        assert r.held == holding(r, 4) == dispatcher.tokens["e1"]
    assert r.held == 3 + 10 + 10  # each at its max_tokens, no further
