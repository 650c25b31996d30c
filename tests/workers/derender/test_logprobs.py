"""Engine logprobs → OpenAI chat and completions logprobs, shaped and decoded as vLLM does."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.workers.derender.texts import EOS, PROPERTY, chunkings, encode, segments, split
from tokenway.wire import LogprobEntry, TokenLogprob
from workers.derender import logprobs as lp
from workers.derender.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    LogprobState,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)

EMOJI = [28927, 225]  # "😀": two tokens, neither a whole character alone
HELLO, E_ACUTE, ZHONGWEN = 44388, 619, 21134  # " hello", "é", "中文"
OUTSIDE_VOCAB = 200_000


@pytest.fixture(scope="module")
def texts(tokenizer: Tokenizer) -> TokenTexts:
    return TokenTexts(tokenizer)


def entry(token_id: int, logprob: float = -0.5, *others: int) -> LogprobEntry:
    """The sampled token first, then `others` by rank, as the engine sends them."""
    top = [TokenLogprob(token_id, logprob)]
    top += [TokenLogprob(t, -1.0 - k, k + 1) for k, t in enumerate(others)]
    return LogprobEntry(token_id, logprob, 1, top)


def as_json(obj: object) -> object:
    return json.loads(msgspec.json.encode(obj))


def test_chat_shape_is_token_logprob_bytes_top_logprobs(texts: TokenTexts) -> None:
    content, _ = chat_logprobs(texts, [entry(HELLO, -0.25, E_ACUTE)], 2, LogprobState())
    assert msgspec.json.encode(ChatLogprobs(content)) == (
        b'{"content":[{"token":" hello","logprob":-0.25,"bytes":[32,104,101,108,108,111],'
        b'"top_logprobs":[{"token":" hello","logprob":-0.25,"bytes":[32,104,101,108,108,111]},'
        b'{"token":"\xc3\xa9","logprob":-1.0,"bytes":[195,169]}]}]}'
    )


def test_completion_shape_is_four_parallel_lists(texts: TokenTexts) -> None:
    out, _ = completion_logprobs(
        texts, [entry(HELLO, -0.25, E_ACUTE), entry(ZHONGWEN, -0.75)], 1, LogprobState()
    )
    assert as_json(out) == {
        "text_offset": [0, 6],
        "token_logprobs": [-0.25, -0.75],
        "tokens": [" hello", "中文"],
        "top_logprobs": [{" hello": -0.25, "é": -1.0}, {"中文": -0.75}],
    }
    assert list(as_json(out)) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]


def test_chat_keeps_the_first_top_logprobs_the_sampled_token_among_them(
    texts: TokenTexts,
) -> None:
    e = entry(E_ACUTE, -3.0, HELLO, ZHONGWEN, EOS)  # sampled token ranked low
    top = {
        n: [t.token for t in chat_logprobs(texts, [e], n, LogprobState())[0][0].top_logprobs]
        for n in (0, 1, 2, -1)
    }
    assert top == {
        0: [],
        1: ["é"],
        2: ["é", " hello"],
        -1: ["é", " hello", "中文", "<｜end▁of▁sentence｜>"],
    }


def test_completions_keep_logprobs_plus_one_candidates(texts: TokenTexts) -> None:
    e = entry(E_ACUTE, -3.0, HELLO, ZHONGWEN, EOS)
    top = {
        n: completion_logprobs(texts, [e], n, LogprobState())[0].top_logprobs[0] for n in (0, 1, -1)
    }
    assert top == {
        0: {"é": -3.0},
        1: {"é": -3.0, " hello": -1.0},
        -1: {"é": -3.0, " hello": -1.0, "中文": -2.0, "<｜end▁of▁sentence｜>": -3.0},
    }
    # No candidates from the engine at all: null, as vLLM reports it.
    bare = LogprobEntry(E_ACUTE, -3.0)
    assert completion_logprobs(texts, [bare], 1, LogprobState())[0].top_logprobs == [None]


def test_minus_infinity_and_nan_become_minus_9999(texts: TokenTexts) -> None:
    e = LogprobEntry(
        HELLO,
        -math.inf,
        top=[
            TokenLogprob(HELLO, -math.inf),
            TokenLogprob(E_ACUTE, math.nan),
            TokenLogprob(1, -2.0),
        ],
    )
    content, _ = chat_logprobs(texts, [e], -1, LogprobState())
    assert content[0].logprob == -9999.0
    assert [t.logprob for t in content[0].top_logprobs] == [-9999.0, -9999.0, -2.0]
    out, _ = completion_logprobs(texts, [e], -1, LogprobState())
    assert out.token_logprobs == [-9999.0]
    assert list(out.top_logprobs[0].values()) == [-9999.0, -9999.0, -2.0]
    assert b"NaN" not in msgspec.json.encode(out) and b"null" not in msgspec.json.encode(out)


def test_a_character_split_across_tokens_shows_whole_on_the_token_completing_it(
    texts: TokenTexts,
) -> None:
    content, _ = chat_logprobs(texts, [entry(t) for t in EMOJI], 0, LogprobState())
    assert [(c.token, c.bytes_) for c in content] == [("", []), ("😀", [240, 159, 152, 128])]


def test_the_repair_reads_context_carried_from_the_previous_chunk(texts: TokenTexts) -> None:
    first, state = chat_logprobs(texts, [entry(HELLO), entry(EMOJI[0])], 0, LogprobState())
    second, _ = chat_logprobs(texts, [entry(EMOJI[1])], 0, state)
    assert [c.token for c in first + second] == [" hello", "", "😀"]
    # Without the carried context the completing token cannot be repaired.
    assert chat_logprobs(texts, [entry(EMOJI[1])], 0, LogprobState())[0][0].token == ""


def test_candidates_are_repaired_from_the_sampled_tokens(texts: TokenTexts) -> None:
    e = entry(EMOJI[1], -0.1, EMOJI[0], E_ACUTE)
    content, _ = chat_logprobs(texts, [e], -1, LogprobState(context_ids=[EMOJI[0]]))
    assert [(t.token, t.bytes_) for t in content[0].top_logprobs] == [
        ("😀", [240, 159, 152, 128]),
        ("", []),  # a second partial after the first is still no character
        ("é", [195, 169]),
    ]


def test_zwj_sequence_tokens_join_to_the_text(tokenizer: Tokenizer, texts: TokenTexts) -> None:
    family = "👩\u200d👩\u200d👧\u200d👦"
    ids = encode(tokenizer, [family])
    out, _ = completion_logprobs(texts, [entry(t) for t in ids], 0, LogprobState())
    assert "".join(out.tokens) == family
    assert out.text_offset[-1] + len(out.tokens[-1]) == len(family)


def test_special_tokens_show_and_unknown_ids_are_empty_without_bytes(texts: TokenTexts) -> None:
    content, _ = chat_logprobs(texts, [entry(EOS, -0.1, OUTSIDE_VOCAB)], -1, LogprobState())
    assert content[0].token == "<｜end▁of▁sentence｜>"
    assert as_json(content[0].top_logprobs[1]) == {"token": "", "logprob": -1.0, "bytes": None}


def test_text_offset_is_absolute_across_chunks(texts: TokenTexts) -> None:
    state = LogprobState(text_offset=10)  # e.g. after 10 characters of echoed prompt
    a, state = completion_logprobs(texts, [entry(HELLO), entry(E_ACUTE)], 0, state)
    b, state = completion_logprobs(texts, [], 0, state)
    c, state = completion_logprobs(texts, [entry(ZHONGWEN)], 0, state)
    assert a.text_offset + b.text_offset + c.text_offset == [10, 16, 17]
    assert state.text_offset == 19


def test_returned_bytes_are_not_shared_with_the_cache(texts: TokenTexts) -> None:
    content, _ = chat_logprobs(texts, [entry(HELLO)], 1, LogprobState())
    content[0].bytes_.append(0)  # type: ignore[union-attr]
    again, _ = chat_logprobs(texts, [entry(HELLO)], 1, LogprobState())
    assert again[0].bytes_ == list(b" hello")
    assert again[0].top_logprobs[0].bytes_ == list(b" hello")


def test_metaspace_tokens_keep_their_leading_space() -> None:
    vocab = {"▁hello": 0, "▁world": 1, "▁": 2, "x": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    content, _ = chat_logprobs(TokenTexts(tok), [entry(i) for i in range(4)], 0, LogprobState())
    assert [c.token for c in content] == [" hello", " world", " ", "x"]


def _entries(ids: list[int]) -> list[LogprobEntry]:
    """Deterministic engine logprobs whose candidates are other tokens of the same output."""
    n = len(ids)
    return [
        entry(t, -0.1 * i if i % 5 else -math.inf, *(ids[(i + k) % n] for k in (1, 3, 4)))
        for i, t in enumerate(ids)
    ]


@PROPERTY
@given(parts=segments, sizes=chunkings, top_n=st.integers(-1, 4), offset=st.integers(0, 99))
def test_any_chunking_gives_the_one_chunk_result(
    tokenizer: Tokenizer,
    texts: TokenTexts,
    parts: list[str | int],
    sizes: list[int],
    top_n: int,
    offset: int,
) -> None:
    entries = _entries(encode(tokenizer, parts))
    start = LogprobState(text_offset=offset)
    whole_chat, chat_end = chat_logprobs(texts, entries, top_n, start)
    whole_cmpl, cmpl_end = completion_logprobs(texts, entries, top_n, start)

    chat_parts, cmpl_parts = [], CompletionLogprobs([], [], [], [])
    chat_state = cmpl_state = start
    for chunk in split(entries, sizes):
        content, chat_state = chat_logprobs(texts, chunk, top_n, chat_state)
        chat_parts += content
        out, cmpl_state = completion_logprobs(texts, chunk, top_n, cmpl_state)
        for field in CompletionLogprobs.__struct_fields__:
            getattr(cmpl_parts, field).extend(getattr(out, field))
        assert len(chat_state.context_ids) <= lp.CONTEXT_TOKENS
        assert lp.problem(cmpl_state) is None

    assert chat_parts == whole_chat and chat_state == chat_end
    assert cmpl_parts == whole_cmpl and cmpl_state == cmpl_end
    assert cmpl_end.text_offset == offset + sum(map(len, whole_cmpl.tokens))


def test_a_state_with_too_much_context_is_a_problem() -> None:
    assert lp.problem(LogprobState(context_ids=[1, 2, 3, 4, 5])) is not None
    assert lp.problem(LogprobState(text_offset=-1)) is not None
    assert lp.problem(LogprobState(context_ids=[1, 2, 3, 4], text_offset=7)) is None
