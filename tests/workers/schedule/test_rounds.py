"""The owner's derender + commit rounds: what a round leaves due, and what it does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.conftest import make_settings
from tokenway.model import load_model_info
from tokenway.wire import GenerateRequest, OutputContext, TokenDelta
from workers.derender.backend import LocalBackend
from workers.schedule.owned import Owned
from workers.schedule.service import ScheduleService

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_output_held_back_waits_for_the_engine_instead_of_being_derendered_again(
    model_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The first byte of a four-byte character shows nothing: the token waits for the next
    one. Asking derender again before the engine sends more would spin on it."""
    owner = ScheduleService(make_settings(tmp_path), "m", load_model_info(model_dir))
    owner.derenderer = LocalBackend(model_dir)
    ctx = OutputContext(api="completion", response_id="cmpl-1", model="m", stream=True)
    r = Owned(rid="r1", reply="i1", request=GenerateRequest(request_id="r1", token_ids=[1],
              context=ctx), deadline=1e12, msg=None)  # fmt: skip
    partial = tokenizer.encode("👩", add_special_tokens=False).ids[:1]
    assert r.accept(TokenDelta(rid="r1", attempt=0, seq=0, token_ids=partial))
    [(choice, entry)] = r.take_ready()
    await owner._derender_and_commit([(r, choice, entry)])
    assert choice.pending == partial and choice.state is None  # nothing was committed
    assert owner._ready == {}  # and nothing is due until the engine's next step
    assert r.accept(TokenDelta(rid="r1", attempt=0, seq=1, token_ids=[6366]))
    [(_, entry)] = r.take_ready()
    assert entry.token_ids == [*partial, 6366]  # held back, then sent with what followed
