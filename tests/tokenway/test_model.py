"""The bundled model directory and its chat template, loaded by real transformers and tokenizers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import tokenizers
from transformers import AutoConfig, AutoTokenizer

import tokenway.model
from tokenway.model import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_MODEL_NAME,
    ModelInfo,
    _content_hash,
    _default_model_files,
    _publish,
    default_model_dir,
    load_model_info,
)

BOS, EOS = 0, 1
USER, ASSISTANT = 128803, 128804
THINK, END_THINK = 128821, 128822
CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END = 128806, 128807, 128808, 128809
OUTPUT_BEGIN, OUTPUT_END, SEP = 128812, 128813, 128814

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "城市 or city"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def pieces(tok, *parts: str | int) -> list[int]:
    """Token IDs of a prompt given as plain-text pieces and special token IDs."""
    ids: list[int] = []
    for part in parts:
        ids += [part] if isinstance(part, int) else tok.encode(part, add_special_tokens=False)
    return ids


def render_ids(tok, messages: list[dict], **kwargs) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def test_default_model_dir_is_a_standard_hf_model_directory(model_dir: Path, tok) -> None:
    assert model_dir.name.startswith(f"{DEFAULT_MODEL_NAME}-")
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (tok.bos_token, tok.bos_token_id) == ("<｜begin▁of▁sentence｜>", BOS)
    assert (tok.eos_token, tok.eos_token_id) == ("<｜end▁of▁sentence｜>", EOS)
    assert tok.model_max_length == DEFAULT_CONTEXT_LENGTH
    assert tok.chat_template == (
        Path(tokenway.model.__file__).with_name("chat_template.jinja").read_text(encoding="utf-8")
    )
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.vocab_size == 129280 == len(tok)
    assert config.max_position_embeddings == DEFAULT_CONTEXT_LENGTH
    assert (config.bos_token_id, config.eos_token_id) == (BOS, EOS)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": BOS, "eos_token_id": EOS}


def test_single_user_turn_renders_to_exact_token_ids(tok) -> None:
    messages = [{"role": "user", "content": "Hello, world!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hello, world!<｜Assistant｜></think>"
    expected = pieces(tok, BOS, USER, "Hello, world!", ASSISTANT, END_THINK)
    assert expected[:2] == [BOS, USER] and expected[-2:] == [ASSISTANT, END_THINK]
    assert render_ids(tok, messages, add_generation_prompt=True) == expected
    assert tok.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize(
    ("kwargs", "last"),
    [
        ({}, END_THINK),
        ({"thinking": False}, END_THINK),
        ({"enable_thinking": False}, END_THINK),
        ({"thinking": True}, THINK),
        ({"enable_thinking": True}, THINK),
    ],
)
def test_generation_prompt_opens_or_closes_thinking(tok, kwargs: dict, last: int) -> None:
    ids = render_ids(
        tok, [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, **kwargs
    )
    assert ids == pieces(tok, BOS, USER, "2+2?", ASSISTANT, last)


def test_no_generation_prompt_ends_after_the_last_turn(tok) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert render_ids(tok, messages) == pieces(
        tok, BOS, USER, "Hi", ASSISTANT, END_THINK, "Hello!", EOS
    )


def test_system_tools_and_tool_calls_render_in_the_v31_layout(tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 °C"},
        {"role": "tool", "tool_call_id": "c2", "content": "24 °C"},
        {"role": "assistant", "content": "<think>Rome is warmer.</think>Paris 18 °C, Rome 24 °C."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "12:00"},
    ]
    text = tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, thinking=True
    )
    system, sep, conversation = text.partition("<｜User｜>")
    assert sep
    # every system message, then the tools, in the system part
    assert system.startswith(
        "<｜begin▁of▁sentence｜>Be brief.\n\nAnswer in English.\n\n## Tools\n\n"
    )
    assert (
        "### get_weather\nDescription: Current weather for a city.\n"
        f"Parameters: {json.dumps(WEATHER_PARAMS, ensure_ascii=False)}\n\n"
    ) in system
    assert '### now\nParameters: {"type": "object"}\n\n' in system
    assert (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ) in system
    # past reasoning is dropped, mapping arguments become JSON, each assistant turn is closed
    assert sep + conversation == (
        "<｜User｜>Weather in Paris and Rome?"
        "<｜Assistant｜></think><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁output▁begin｜>18 °C<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>24 °C<｜tool▁output▁end｜>"
        "<｜Assistant｜></think>Paris 18 °C, Rome 24 °C.<｜end▁of▁sentence｜>"
        "<｜User｜>Time?"
        "<｜Assistant｜></think>Checking.<｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜>"
        "<｜Assistant｜><think>"
    )
    ids = render_ids(tok, messages, tools=TOOLS, add_generation_prompt=True, thinking=True)
    conversation_ids = pieces(
        tok,
        USER, "Weather in Paris and Rome?",
        ASSISTANT, END_THINK, CALLS_BEGIN,
        CALL_BEGIN, "get_weather", SEP, '{"city": "Paris"}', CALL_END,
        CALL_BEGIN, "get_weather", SEP, '{"city": "Rome"}', CALL_END,
        CALLS_END, EOS,
        OUTPUT_BEGIN, "18 °C", OUTPUT_END,
        OUTPUT_BEGIN, "24 °C", OUTPUT_END,
        ASSISTANT, END_THINK, "Paris 18 °C, Rome 24 °C.", EOS,
        USER, "Time?",
        ASSISTANT, END_THINK, "Checking.", CALLS_BEGIN,
        CALL_BEGIN, "now", SEP, "{}", CALL_END,
        CALLS_END, EOS,
        OUTPUT_BEGIN, "12:00", OUTPUT_END,
        ASSISTANT, THINK,
    )  # fmt: skip
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert ids[-len(conversation_ids) :] == conversation_ids


def test_continue_final_message_leaves_the_last_answer_open(tok) -> None:
    messages = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two,"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert (
        text == "<｜begin▁of▁sentence｜><｜User｜>Count to three.<｜Assistant｜></think>One, two,"
    )
    assert render_ids(tok, messages, continue_final_message=True) == pieces(
        tok, BOS, USER, "Count to three.", ASSISTANT, END_THINK, "One, two,"
    )


def test_continue_final_message_keeps_inline_reasoning_of_the_last_answer(tok) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet</think>Hel"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("<｜Assistant｜></think><think>greet</think>Hel")


def test_unknown_role_is_rejected(tok) -> None:
    with pytest.raises(jinja2.TemplateError, match="unsupported message role: function"):
        tok.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_materialization_is_idempotent(tmp_path: Path) -> None:
    first = default_model_dir(tmp_path)
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.iterdir()}
    second = default_model_dir(tmp_path)
    assert second == first
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in second.iterdir()} == stamps
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]


def test_concurrent_processes_share_one_complete_directory(tmp_path: Path) -> None:
    root = Path(tokenway.model.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    code = (
        "import sys; from pathlib import Path; from tokenway.model import default_model_dir; "
        "print(default_model_dir(Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outputs = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert outputs == {str(default_model_dir(tmp_path))}
    assert len(list((tmp_path / "models").iterdir())) == 1  # no temporary directory left behind


def test_losing_the_rename_race_keeps_the_published_directory(tmp_path: Path) -> None:
    target, tmp = tmp_path / "model", tmp_path / ".model.tmp"
    target.mkdir()
    (target / "tokenizer.json").write_text("published")
    tmp.mkdir()
    (tmp / "tokenizer.json").write_text("late")
    _publish(tmp, target)
    assert (target / "tokenizer.json").read_text() == "published"


def test_directory_name_follows_the_content(tmp_path: Path) -> None:
    files = _default_model_files()
    changed = {
        **files,
        "tokenizer_config.json": files["tokenizer_config.json"].replace(b"User", b"Usr"),
    }
    assert _content_hash(changed) != _content_hash(files)
    assert default_model_dir(tmp_path).name == f"{DEFAULT_MODEL_NAME}-{_content_hash(files)}"


def test_load_model_info_reads_the_default_directory(model_dir: Path) -> None:
    assert load_model_info(model_dir) == ModelInfo(
        path=model_dir,
        context_length=DEFAULT_CONTEXT_LENGTH,
        eos_token_ids=[EOS],
        bos_token_id=BOS,
        vocab_size=129280,
    )
    assert load_model_info(model_dir, max_model_len=4096).context_length == 4096
    with pytest.raises(
        ValueError, match="max_model_len 200000 is larger than the context length 131072"
    ):
        load_model_info(model_dir, max_model_len=200000)


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_load_model_info_names_the_missing_file(
    model_dir: Path, tmp_path: Path, missing: str
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / missing).unlink()
    with pytest.raises(ValueError, match=f"has no {missing}"):
        load_model_info(broken)


def test_load_model_info_reads_other_hf_layouts(model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(model_dir / "tokenizer.json", other)
    tokenizer_config = {
        "bos_token": {"content": "<｜begin▁of▁sentence｜>"},
        "eos_token": "<｜end▁of▁sentence｜>",
    }
    (other / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "model_max_length": 8192})
    )
    # no config.json, no generation_config.json: tokens and length from tokenizer_config
    assert load_model_info(other) == ModelInfo(
        path=other, context_length=8192, eos_token_ids=[EOS], bos_token_id=BOS, vocab_size=129280
    )
    # config.json's `seq_length`, generation_config.json's list of EOS ids
    (other / "config.json").write_text(json.dumps({"seq_length": 32768, "vocab_size": 129536}))
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 128805]}))
    info = load_model_info(other)
    assert (info.context_length, info.eos_token_ids, info.vocab_size) == (
        32768,
        [1, 128805],
        129536,
    )
    # a "no limit" model_max_length and no config: only max_model_len can say
    (other / "config.json").unlink()
    (other / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "model_max_length": int(1e30)})
    )
    with pytest.raises(ValueError, match="declares no context length"):
        load_model_info(other)
    assert load_model_info(other, max_model_len=2048).context_length == 2048


def test_tokenizers_and_transformers_agree_on_multilingual_text(model_dir: Path, tok) -> None:
    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (
        "Hello, 世界! こんにちは 안녕하세요 Привет مرحبا नमस्ते 👋🏽👨‍👩‍👧 "
        "cafe\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0357 ½ 12345 \t\n  tabs"
    )
    for add_special_tokens in (True, False):
        expected = raw.encode(text, add_special_tokens=add_special_tokens).ids
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected
    ids = raw.encode(text).ids
    assert raw.decode(ids) == text == tok.decode(ids)
