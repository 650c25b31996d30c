"""One owned request's bookkeeping: which attempt is live, what is pending, when to derender."""

from __future__ import annotations

from tokenway.errors import EngineFailed
from tokenway.wire import (
    DerenderEntry,
    FinishReason,
    GenerateRequest,
    OutputContext,
    TokenDelta,
)
from workers.schedule.owned import Owned


def owned(stream: bool = True, attempt: int = 0) -> Owned:
    request = GenerateRequest(
        request_id="r1", token_ids=[0, 6366], context=OutputContext(api="chat", stream=stream)
    )
    return Owned(
        rid="r1",
        reply="ingress-1",
        request=request,
        deadline=1e9,
        msg=None,
        engine="e1",
        attempt=attempt,
    )


def delta(
    seq: int,
    tokens: list[int] | None = None,
    attempt: int = 0,
    finish: FinishReason | None = None,
    stop_reason: int | str | None = None,
    error: str | None = None,
) -> TokenDelta:
    return TokenDelta(
        rid="r1",
        attempt=attempt,
        seq=seq,
        token_ids=tokens or [],
        finish_reason=finish,
        stop_reason=stop_reason,
        error=error,
    )


def test_accepted_deltas_queue_their_tokens_in_order() -> None:
    r = owned()
    assert r.accept(delta(0, [1, 2]))
    assert r.accept(delta(1, [3]))
    assert r.pending == [1, 2, 3]
    assert r.next_delta == 2
    assert not r.engine_done and r.finish is None and not r.ended.is_set()


def test_accept_ignores_deltas_of_a_stale_attempt() -> None:
    r = owned(attempt=2)
    assert not r.accept(delta(0, [1], attempt=1))
    assert not r.accept(delta(5, [1], attempt=0, finish="stop"))
    assert r.pending == [] and r.next_delta == 0
    assert r.error is None and not r.ended.is_set() and not r.engine_done
    assert r.accept(delta(0, [7], attempt=2))
    assert r.pending == [7]


def test_accept_ignores_deltas_after_the_engine_finished() -> None:
    r = owned()
    assert r.accept(delta(0, [1], finish="length"))
    assert not r.accept(delta(1, [2]))
    assert r.pending == [1] and r.finish == "length"


def test_accept_ignores_deltas_after_the_request_ended() -> None:
    r = owned()
    r.cancel()
    assert r.cancelled and r.ended.is_set()
    assert not r.accept(delta(0, [1]))
    assert r.pending == []


def test_a_seq_gap_fails_the_request_as_an_engine_failure() -> None:
    r = owned()
    assert r.accept(delta(0, [1]))
    assert not r.accept(delta(2, [3]))
    assert r.ended.is_set()
    assert r.error is not None
    expected = EngineFailed("x").info()
    assert (r.error.status, r.error.type) == (expected.status, expected.type)
    assert (r.error.status, r.error.type) == (502, "EngineError")
    assert "expected chunk 1, got 2" in r.error.message and "e1" in r.error.message
    assert r.pending == [1]  # nothing from the lost stretch is queued
    assert not r.engine_done  # the engine is still running: it must be aborted


def test_a_seq_gap_on_the_last_delta_marks_the_engine_done() -> None:
    r = owned()
    assert not r.accept(delta(1, [3], finish="stop"))
    assert r.engine_done and r.error is not None and r.error.status == 502


def test_an_engine_error_delta_fails_the_request() -> None:
    r = owned()
    assert r.accept(delta(0, [1]))
    assert not r.accept(delta(1, error="engine e1: RuntimeError: boom", finish="error"))
    assert r.engine_done and r.ended.is_set()
    assert r.error is not None
    assert (r.error.status, r.error.type) == (502, "EngineError")
    assert r.error.message == "engine e1: RuntimeError: boom"
    assert not r.ready()


def test_the_first_failure_is_the_one_reported() -> None:
    r = owned()
    r.fail(EngineFailed("first").info())
    r.fail(EngineFailed("second").info())
    assert r.error is not None and r.error.message == "first"


def test_finish_sets_engine_done_with_the_finish_and_stop_reason() -> None:
    r = owned()
    assert r.accept(delta(0, [5, 42], finish="stop", stop_reason=42))
    assert r.engine_done
    assert (r.finish, r.stop_reason) == ("stop", 42)
    assert r.pending == [5, 42]
    assert not r.ended.is_set()  # ended only once the last chunk is committed


def test_a_stream_is_ready_chunk_by_chunk() -> None:
    r = owned(stream=True)
    assert not r.ready()
    r.accept(delta(0, [1]))
    assert r.ready()
    r.take()
    r.accept(delta(1, [2]))
    assert not r.ready()  # a derender is in flight
    r.busy = False
    assert r.ready()
    r.take()
    r.busy = False
    assert not r.ready()  # nothing pending
    r.accept(delta(2, finish="stop"))
    assert r.ready()  # the finish alone is worth a chunk


def test_a_non_stream_request_is_ready_only_at_the_finish() -> None:
    r = owned(stream=False)
    for seq in range(3):
        r.accept(delta(seq, [seq + 10]))
        assert not r.ready()
    r.accept(delta(3, [1], finish="stop"))
    assert r.ready()
    entry = r.take()
    assert entry.token_ids == [10, 11, 12, 1] and entry.finish_reason == "stop"


def test_take_clears_pending_and_sets_busy() -> None:
    r = owned()
    r.state = b"opaque derender state"
    r.accept(delta(0, [1, 2], finish="stop", stop_reason=2))
    entry = r.take()
    assert entry == DerenderEntry(
        context=r.request.context,
        state=r.state,
        token_ids=[1, 2],
        finish_reason="stop",
        stop_reason=2,
    )
    assert r.pending == [] and r.busy


def test_hold_back_restores_tokens_in_front_of_newer_ones() -> None:
    r = owned()
    r.accept(delta(0, [1, 2]))
    entry = r.take()
    r.accept(delta(1, [3]))
    r.accept(delta(2, [4]))
    r.hold_back(entry)
    assert r.pending == [1, 2, 3, 4]
    r.busy = False
    assert r.take().token_ids == [1, 2, 3, 4]
