"""Where the dispatcher sends a request: the engine that holds its prefix while load
allows (KV-cache affinity), with the reason in the plan for the log."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import make_settings
from tokenway.block_hashes import block_hashes
from tokenway.wire import EngineInfo, GenerateRequest, Role, SamplingParams
from workers.schedule.dispatch import Dispatcher
from workers.schedule.owned import Owned

PROMPT = list(range(100, 164))  # four blocks of 16


def owned(prompt: list[int] = PROMPT) -> Owned:
    request = GenerateRequest(
        request_id="r1", token_ids=prompt, sampling_params=SamplingParams(max_tokens=8)
    )
    return Owned(rid="r1", reply="i1", request=request, deadline=1e9, msg=None)


def engine(id_: str, role: Role = "union", running: int = 0) -> EngineInfo:
    return EngineInfo(id=id_, model="m", role=role, max_seqs=10, running=running)


def dispatcher(tmp_path: Path) -> Dispatcher:
    return Dispatcher(None, "o1", None, make_settings(tmp_path))  # type: ignore[arg-type]


def test_a_request_goes_where_its_prefix_is_cached_not_to_the_first_idle_engine(
    tmp_path: Path,
) -> None:
    d = dispatcher(tmp_path)
    hashes = block_hashes(PROMPT, 16)
    d.index.record("e-b", hashes, now=1.0)
    plan = d._plan(owned(), [engine("e-a"), engine("e-b")], hashes, now=2.0)
    assert plan is not None and plan.engine.id == "e-b"
    assert "overlap 4/4 blocks" in plan.why and "e-b" in plan.why


def test_without_a_cached_prefix_the_least_loaded_engine_takes_it(tmp_path: Path) -> None:
    d = dispatcher(tmp_path)
    hashes = block_hashes(PROMPT, 16)
    plan = d._plan(owned(), [engine("e-a", running=3), engine("e-b")], hashes, now=2.0)
    assert plan is not None and plan.engine.id == "e-b" and "overlap 0/4" in plan.why


def test_p_d_prefills_where_the_prefix_is_cached_and_says_both(tmp_path: Path) -> None:
    d = dispatcher(tmp_path)
    hashes = block_hashes(PROMPT, 16)
    d.index.record("p-2", hashes, now=1.0)
    engines = [engine("p-1", "prefill"), engine("p-2", "prefill"), engine("d-1", "decode")]
    plan = d._plan(owned(), engines, hashes, now=2.0)
    assert plan is not None and plan.prefill is not None
    assert (plan.prefill.id, plan.engine.id) == ("p-2", "d-1")
    assert "d-1" in plan.why and "prefill on engine p-2 (overlap 4/4" in plan.why


def test_a_decode_engine_prefills_for_itself_without_a_pair_and_says_so(tmp_path: Path) -> None:
    d = dispatcher(tmp_path)
    hashes = block_hashes(PROMPT, 16)
    plan = d._plan(owned(), [engine("d-1", "decode")], hashes, now=2.0)
    assert plan is not None and plan.prefill is None and plan.engine.id == "d-1"
    assert "prefilling for itself" in plan.why
