"""SSE as a client gets it: vLLM's `data:` events, numbered by count for resume and `id:` lines."""

from __future__ import annotations

from ingress.sse_writer import SseWriter
from tokenway import headers as h
from tokenway.output_router import Event
from tokenway.sse import frame
from tokenway.wire import OUTPUTS, Failed


def chunk(seq: int, *docs: str, kind: str = h.KIND_CHUNK) -> Event:
    """A ledger message holding several documents, as an owner commits a merged step."""
    return OUTPUTS[kind](rid="r", seq=seq, payload=frame([d.encode() for d in docs]))


EVENTS = [chunk(1, "{1}", "{2}"), chunk(2, "{3}"), chunk(3, "{4}", "{5}", kind=h.KIND_END)]


def test_the_bytes_are_the_committed_chunks_then_done() -> None:
    out, done = SseWriter().write(EVENTS)
    assert out == b"".join(e.payload for e in EVENTS) + b"data: [DONE]\n\n" and done


def test_id_lines_number_every_data_event_across_writes() -> None:
    writer = SseWriter(ids=True)
    first, _ = writer.write(EVENTS[:1])
    rest, done = writer.write(EVENTS[1:])
    numbered = (first + rest).split(b"\n\n")
    assert [e.split(b"\n")[0] for e in numbered[:5]] == [b"id: %d" % n for n in range(1, 6)]
    assert numbered[5:] == [b"data: [DONE]", b""] and done


def test_a_resume_leaves_out_the_events_the_client_counted_even_inside_a_message() -> None:
    out, _ = SseWriter(after=2 + 1).write(EVENTS)  # it had {1}, {2} and {3}
    assert out == b"data: {4}\n\ndata: {5}\n\ndata: [DONE]\n\n"
    out, _ = SseWriter(ids=True, after=4).write(EVENTS)
    assert out == b"id: 5\ndata: {5}\n\ndata: [DONE]\n\n"
    out, _ = SseWriter(after=1).write(EVENTS[:1])
    assert out == b"data: {2}\n\n"


def test_an_error_is_one_data_event_and_ends_the_stream() -> None:
    error = Failed(rid="r", seq=2, payload=b'{"error": {}}', status=502)
    out, done = SseWriter(ids=True).write([chunk(1, "{1}"), error])
    assert out == b'id: 1\ndata: {1}\n\nid: 2\ndata: {"error": {}}\n\ndata: [DONE]\n\n' and done
