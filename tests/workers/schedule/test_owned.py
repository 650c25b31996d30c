"""One owned request's bookkeeping: which attempt is live, what is pending, when to derender."""

from __future__ import annotations

import msgspec
import pytest

from tokenway.errors import EngineFailed
from tokenway.wire import (
    DerenderEntry,
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    OutputContext,
    SamplingParams,
    StructuredOutputs,
    TokenDelta,
)
from workers.schedule.owned import CANCELLED, DONE, SUPERSEDED, Failed, Owned, RelayRefused


def owned(stream: bool = True, attempt: int = 0, n: int = 1, usage: bool = False) -> Owned:
    request = GenerateRequest(
        request_id="r1",
        token_ids=[0, 6366],
        sampling_params=SamplingParams(n=n),
        context=OutputContext(api="chat", stream=stream, n=n, include_usage=usage),
    )
    return Owned(
        rid="r1", reply="ingress-1", request=request, deadline=1e9, msg=None, engine="e1",
        attempt=attempt,
    )  # fmt: skip


def delta(
    seq: int,
    tokens: list[int] | None = None,
    attempt: int = 0,
    finish: FinishReason | None = None,
    stop_reason: int | str | None = None,
    error: str | None = None,
    index: int = 0,
) -> TokenDelta:
    return TokenDelta(
        rid="r1",
        attempt=attempt,
        seq=seq,
        token_ids=tokens or [],
        finish_reason=finish,
        stop_reason=stop_reason,
        error=error,
        index=index,
    )


def test_accepted_deltas_queue_their_tokens_in_order() -> None:
    r = owned()
    assert r.accept(delta(0, [1, 2]))
    assert r.accept(delta(1, [3]))
    assert r.choices[0].pending == [1, 2, 3]
    assert r.next_delta == 2
    assert not r.engine_done and r.choices[0].finish is None and not r.ended.is_set()


def test_accept_ignores_deltas_of_a_stale_attempt() -> None:
    r = owned(attempt=2)
    assert not r.accept(delta(0, [1], attempt=1))
    assert not r.accept(delta(5, [1], attempt=0, finish="stop"))
    assert r.choices[0].pending == [] and r.next_delta == 0
    assert r.error is None and not r.ended.is_set() and not r.engine_done
    assert r.accept(delta(0, [7], attempt=2))
    assert r.choices[0].pending == [7]


def test_accept_ignores_deltas_after_the_choice_finished() -> None:
    r = owned()
    assert r.accept(delta(0, [1], finish="length"))
    assert not r.accept(delta(1, [2]))
    assert r.choices[0].pending == [1] and r.choices[0].finish == "length"


def test_accept_ignores_deltas_after_the_request_ended() -> None:
    r = owned()
    r.cancel()
    assert r.end == CANCELLED and r.ended.is_set()
    assert not r.accept(delta(0, [1]))
    assert r.choices[0].pending == []


def test_a_request_ends_once_and_only_a_takeover_overrides_its_end() -> None:
    """How a request ended is one value: the first end stands (a client leaving after its
    request failed does not unsay the error, a stopping worker does not hand over what has
    ended), save another owner taking it over, which ends it here whatever it was."""
    r = owned()
    r.fail(EngineFailed("first").info())
    r.cancel()
    r.hand_over()
    r.end_as(DONE)
    assert isinstance(r.end, Failed) and r.error is not None and r.error.message == "first"
    assert not r.goes_on
    r.supersede()
    assert r.end == SUPERSEDED and r.error is None and r.goes_on
    done = owned()
    done.end_as(DONE)
    done.hand_over()
    assert done.end == DONE and done.ended.is_set() and not done.goes_on


def test_a_seq_gap_breaks_the_attempt_as_an_engine_failure() -> None:
    r = owned()
    assert r.accept(delta(0, [1]))
    assert not r.accept(delta(2, [3]))
    assert r.trouble.is_set() and r.broken is not None and not r.ended.is_set()
    expected = EngineFailed("x").info()
    assert (
        (r.broken.status, r.broken.type) == (expected.status, expected.type) == (502, "EngineError")
    )
    assert "expected chunk 1, got 2" in r.broken.message and "e1" in r.broken.message
    assert r.choices[0].pending == [1]  # nothing from the lost stretch is queued
    assert not r.engine_done  # the engine is still running: it must be aborted
    assert not r.accept(delta(1, [2]))  # the broken attempt sends nothing more
    assert r.take_ready() == []


def test_an_engine_error_delta_breaks_the_attempt() -> None:
    r = owned()
    assert r.accept(delta(0, [1]))
    assert not r.accept(delta(1, error="engine e1: RuntimeError: boom", finish="error"))
    assert r.broken is not None and r.trouble.is_set() and not r.ended.is_set()
    assert (r.broken.status, r.broken.type) == (502, "EngineError")
    assert r.broken.message == "engine e1: RuntimeError: boom"
    assert r.take_ready() == []


def committed(r: Owned, tokens: list[int], state: bytes = b"s") -> None:
    """What the shell does when a chunk's TW_OUT publish is acknowledged."""
    choice = r.choices[0]
    choice.committed.extend(tokens)
    choice.state = state


def test_a_relay_continues_from_the_committed_output() -> None:
    r = owned()
    r.request.sampling_params.max_tokens = 10
    r.request.sampling_params.min_tokens = 4
    r.request.kv_transfer_params = {"do_remote_prefill": True}
    assert r.client_kv is not None
    r.accept(delta(0, [7, 8]))
    r.take_ready()
    committed(r, [7, 8], b"after-8")
    r.choices[0].busy = False
    r.accept(delta(1, [9]))  # derendered, never committed: the relay makes it again
    r.attempt_failed(EngineFailed("engine e1: boom").info())
    assert r.relay()
    choice = r.choices[0]
    assert r.prompt == [0, 6366, 7, 8]  # the request's own IDs untouched
    assert r.request.token_ids == [0, 6366]
    assert (r.params.max_tokens, r.params.min_tokens) == (8, 2)
    assert choice.pending == [] and choice.state == b"after-8" and choice.finish is None
    assert r.broken is None and not r.trouble.is_set() and r.relays == 1
    assert r.client_kv is None  # the client's remote KV was for the first attempt only
    # Until the next attempt starts, and after, the failed one's deltas are stale.
    assert not r.accept(delta(2, [5], attempt=0))
    r.attempt += 1  # what dispatch does when it starts the next attempt
    r.next_delta = 0
    assert not r.accept(delta(3, [5], attempt=0))
    assert r.accept(delta(0, [9], attempt=r.attempt))
    [(_, entry)] = r.take_ready()
    assert entry.state == b"after-8" and entry.token_ids == [9]


def test_a_relay_with_no_budget_left_only_ends_the_output() -> None:
    r = owned()
    r.request.sampling_params.max_tokens = 2
    committed(r, [7, 8])
    r.attempt_failed(EngineFailed("gone").info())
    assert not r.relay()
    assert r.choices[0].finish == "length" and r.engine_done
    [(_, entry)] = r.take_ready()
    assert entry.finish_reason == "length" and entry.token_ids == []


def test_relay_is_refused_for_n_above_one_after_output() -> None:
    r = owned(n=2)
    r.attempt_failed(EngineFailed("gone").info())
    assert r.relay()  # nothing committed: a plain retry of both choices
    r.choices[1].committed.append(3)
    r.attempt_failed(EngineFailed("gone again").info())
    with pytest.raises(RelayRefused, match="n=2 cannot be relayed"):
        r.relay()


def test_relay_is_refused_for_a_constrained_request_after_output() -> None:
    """A new engine would start the grammar over mid-document: duplicated or nested JSON."""
    r = owned()
    r.request.sampling_params.structured_outputs = StructuredOutputs(json_object=True)
    r.attempt_failed(EngineFailed("gone").info())
    assert r.relay()  # nothing sent yet: a plain retry
    committed(r, [7, 8])
    r.attempt_failed(EngineFailed("gone again").info())
    with pytest.raises(RelayRefused, match="structured outputs cannot be relayed after output"):
        r.relay()


def test_a_choice_outside_n_fails_the_request() -> None:
    r = owned(n=2)
    assert not r.accept(delta(0, [1], index=2))
    assert r.error is not None and "choice 2" in r.error.message


def test_the_first_failure_is_the_one_reported() -> None:
    r = owned()
    r.fail(EngineFailed("first").info())
    r.fail(EngineFailed("second").info())
    assert r.error is not None and r.error.message == "first"


def test_finish_records_the_finish_and_stop_reason() -> None:
    r = owned()
    assert r.accept(delta(0, [5, 42], finish="stop", stop_reason=42))
    choice = r.choices[0]
    assert r.engine_done and (choice.finish, choice.stop_reason) == ("stop", 42)
    assert choice.pending == [5, 42]
    assert not r.ended.is_set()  # ended only once the last chunk is committed


def test_a_stream_is_ready_chunk_by_chunk() -> None:
    r = owned(stream=True)
    assert r.take_ready() == []
    r.accept(delta(0, [1]))
    [(choice, entry)] = r.take_ready()
    assert entry.token_ids == [1] and choice.busy
    r.accept(delta(1, [2]))
    assert r.take_ready() == []  # a derender is in flight
    choice.busy = False
    [(_, entry)] = r.take_ready()
    assert entry.token_ids == [2]
    choice.busy = False
    assert r.take_ready() == []  # nothing pending
    r.accept(delta(2, finish="stop"))
    [(_, entry)] = r.take_ready()  # the finish alone is worth a chunk
    assert entry.finish_reason == "stop"


def test_a_non_stream_request_is_ready_only_when_every_choice_finished() -> None:
    r = owned(stream=False, n=2)
    seq = 0
    for index in (0, 1, 0):
        r.accept(delta(seq, [seq + 10], index=index))
        seq += 1
        assert r.take_ready() == []
    r.accept(delta(seq, [1], finish="stop", index=0))
    assert r.take_ready() == []  # choice 1 still runs
    r.accept(delta(seq + 1, [2], finish="length", index=1))
    ready = r.take_ready()
    assert [(e.index, e.token_ids, e.finish_reason) for _, e in ready] == [
        (0, [10, 12, 1], "stop"),
        (1, [11, 2], "length"),
    ]


def test_one_derender_at_a_time_per_request_so_its_commits_stay_in_order() -> None:
    """Choices of one request commit fenced one on the next: while one of them is being
    derendered and committed, the others wait and join the next round."""
    r = owned(stream=True, n=2)
    r.accept(delta(0, [1], index=0))
    [(first, _)] = r.take_ready()
    r.accept(delta(1, [2], index=1))
    assert r.take_ready() == []  # choice 0 is in flight
    first.busy = False
    [(second, entry)] = r.take_ready()
    assert (second.index, entry.token_ids) == (1, [2])


def test_take_clears_pending_and_sets_busy() -> None:
    r = owned()
    r.choices[0].state = b"opaque derender state"
    r.accept(delta(0, [1, 2], finish="stop", stop_reason=2))
    [(choice, entry)] = r.take_ready()
    assert entry == DerenderEntry(
        context=r.request.context,
        state=b"opaque derender state",
        token_ids=[1, 2],
        finish_reason="stop",
        stop_reason=2,
    )
    assert choice.pending == [] and choice.busy


def test_the_prompt_rides_only_on_a_first_entry_that_needs_it() -> None:
    r = owned()
    r.request.context = msgspec.structs.replace(r.request.context, return_token_ids=True)
    r.accept(delta(0, [1]))
    [(choice, entry)] = r.take_ready()
    assert entry.prompt_token_ids == [0, 6366]
    choice.busy, choice.state = False, b"s"
    r.accept(delta(1, [2]))
    [(_, entry)] = r.take_ready()
    assert entry.prompt_token_ids is None


def test_hold_back_restores_tokens_in_front_of_newer_ones() -> None:
    r = owned()
    r.accept(delta(0, [1, 2]))
    [(choice, entry)] = r.take_ready()
    r.accept(delta(1, [3]))
    r.accept(delta(2, [4]))
    choice.hold_back(entry)
    assert choice.pending == [1, 2, 3, 4]
    choice.busy = False
    assert r.take_ready()[0][1].token_ids == [1, 2, 3, 4]


def test_with_n_choices_the_last_one_closes_unless_a_usage_chunk_follows() -> None:
    r = owned(n=2)
    first, second = r.choices
    assert not r.is_last(first)
    second.done = True
    assert r.is_last(first)
    with_usage = owned(n=2, usage=True)
    with_usage.choices[1].done = True
    assert not with_usage.is_last(with_usage.choices[0])
    with_usage.choices[0].done = True
    assert with_usage.needs_usage_chunk()
    for choice, count in zip(with_usage.choices, [5, 7], strict=True):
        choice.committed.extend(range(count))
    entry = with_usage.usage_entry()
    assert entry.usage_total == 12 and not with_usage.needs_usage_chunk()


def test_the_summary_says_where_how_much_how_fast_and_how_it_ended() -> None:
    r = owned(n=2)
    r.arrived, r.first_token = 100.0, 100.25
    r.choices[0].committed.extend([1, 2, 3])
    r.choices[1].committed.extend([4])
    r.choices[0].finish, r.choices[1].finish = "stop", "length"
    assert r.summary(102.5) == (
        "request r1 ended: model , engine e1, 2 prompt + 4 output tokens, ttft 0.250s, "
        "2.500s, stop,length"
    )
    r.relays = 1
    r.fail(EngineFailed("the engine went away").info())
    assert r.summary(103.0).endswith("3.000s, error 502: the engine went away, 1 relays")
    waiting = owned()
    waiting.engine = None
    waiting.cancel()
    assert "engine -, 2 prompt + 0 output tokens, ttft -" in waiting.summary(1.0)
    assert waiting.summary(1.0).endswith(", cancelled")


@pytest.mark.parametrize(("status", "kind"), [(400, "BadRequestError"),
                                              (422, "UnprocessableEntityError")])  # fmt: skip
def test_an_engines_refusal_of_the_request_ends_it_with_its_error_never_a_relay(
    status: int, kind: str
) -> None:
    r = owned(n=2)
    reason = "engine e1 refused the request: Invalid structural tag specification."
    refused = TokenDelta(rid="r1", attempt=0, seq=0, finish_reason="error", error=reason,
                         refused=status)  # fmt: skip
    assert not r.accept(refused)
    assert r.error == ErrorInfo(message=reason, type=kind, status=status)
    assert r.ended.is_set() and r.engine_done
    assert r.broken is None and not r.trouble.is_set()  # nothing to relay


@pytest.mark.parametrize("status", [None, 503, 200])
def test_an_error_without_a_4xx_refusal_is_the_engines_failure(status: int | None) -> None:
    r = owned()
    failed = TokenDelta(rid="r1", attempt=0, seq=0, finish_reason="error", error="boom",
                        refused=status)  # fmt: skip
    assert not r.accept(failed)
    assert r.broken is not None and r.broken.status == 502 and not r.ended.is_set()


def test_the_cached_prompt_tokens_said_are_the_answering_attempts_own() -> None:
    r = owned()
    r.request.context = msgspec.structs.replace(r.request.context, prompt_tokens=40)
    assert r.ctx.cached_tokens is None  # no engine said
    assert r.accept(msgspec.structs.replace(delta(0, [7]), cached_tokens=32))
    [(_, entry)] = r.take_ready()
    assert entry.context.cached_tokens == 32
    r.choices[0].busy = False
    r.attempt_failed(EngineFailed("engine e1: boom").info())
    assert r.relay()
    assert r.ctx.cached_tokens is None  # the failed attempt's count is not the relay's
    r.attempt += 1
    r.next_delta = 0
    assert r.accept(msgspec.structs.replace(delta(0, [9], attempt=r.attempt), cached_tokens=48))
    assert r.ctx.cached_tokens == 40  # at most the prompt: a relay's prompt holds output too
