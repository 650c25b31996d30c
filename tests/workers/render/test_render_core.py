"""Render's pure core: an OpenAI body → the token IDs and output context the engine gets."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tokenway.api.bodies import decode_body
from tokenway.api.openai import (
    MAX_DEPTH,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
)
from tokenway.errors import InvalidRequest, ModelNotFound
from tokenway.model import DEFAULT_CONTEXT_LENGTH, load_model_info
from tokenway.wire import SEED_TOKENS, Api, GenerateRequest, RenderRequest
from workers.render.backend import LocalBackend
from workers.render.core import Renderer

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
VOCAB = 129280
SMALL_CONTEXT = 32


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    """An independent transformers tokenizer: the reference render is compared against."""
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def small(model_dir: Path) -> Renderer:
    return Renderer(load_model_info(model_dir, max_model_len=SMALL_CONTEXT), "deepseek-v4")


def request(api: Api = "chat", **body: Any) -> RenderRequest:
    if api == "chat":
        body.setdefault("messages", [{"role": "user", "content": "Hello!"}])
    return RenderRequest(api=api, request_id="r1", body=json.dumps(body).encode(), created=1)


def render(renderer: Renderer, api: Api = "chat", **body: Any) -> GenerateRequest:
    return renderer.render(request(api, **body))


def rejected(renderer: Renderer, api: Api = "chat", **body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        render(renderer, api, **body)
    assert info.value.status == 400
    return info.value


def templated(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    kwargs.setdefault("add_generation_prompt", True)
    text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    return hf.encode(text, add_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "另一个？ 🎨"},
]


# -- chat ----------------------------------------------------------------------------------


def test_a_chat_request_renders_to_the_templated_prompt_tokens(renderer: Renderer, hf: Any) -> None:
    generate = render(renderer, messages=CONVERSATION)
    assert generate.token_ids == templated(hf, CONVERSATION)
    assert generate.token_ids[0] == BOS and generate.token_ids.count(BOS) == 1
    assert generate.token_ids.count(USER) == 2


def test_a_rendered_chat_request_carries_its_identity_and_output_context(
    renderer: Renderer,
) -> None:
    generate = render(
        renderer,
        model="deepseek-v4",
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        return_token_ids=True,
        skip_special_tokens=False,
    )
    ctx = generate.context
    assert (generate.request_id, generate.model, generate.stream) == ("r1", "deepseek-v4", True)
    assert (ctx.api, ctx.response_id, ctx.model, ctx.created) == (
        "chat",
        "chatcmpl-r1",
        "deepseek-v4",
        1,
    )
    assert ctx.prompt_tokens == len(generate.token_ids)
    assert ctx.stream and ctx.include_usage and ctx.continuous_usage_stats
    assert ctx.return_token_ids
    assert not ctx.skip_special_tokens and not generate.sampling_params.skip_special_tokens
    assert generate.stream_options is not None and generate.stream_options.include_usage


def test_the_client_request_id_names_the_response(renderer: Renderer) -> None:
    assert render(renderer, request_id="mine").context.response_id == "chatcmpl-mine"


def test_content_parts_are_joined_with_newlines(renderer: Renderer, hf: Any) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second 二"}]
    generate = render(renderer, messages=[{"role": "user", "content": parts}])
    joined = [{"role": "user", "content": "first\nsecond 二"}]
    assert generate.token_ids == templated(hf, joined)


def test_an_image_part_is_invalid_request_naming_the_message(renderer: Renderer) -> None:
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    error = rejected(renderer, messages=messages)
    assert error.param == "messages[1].content"
    assert "image_url" in error.message


def test_the_generation_prompt_ends_with_end_think_by_default(renderer: Renderer) -> None:
    assert render(renderer).token_ids[-2:] == [ASSISTANT, END_THINK]


@pytest.mark.parametrize("flag", ["thinking", "enable_thinking"])
def test_thinking_in_chat_template_kwargs_ends_the_prompt_with_think(
    renderer: Renderer, flag: str
) -> None:
    ids = render(renderer, chat_template_kwargs={flag: True}).token_ids
    assert ids[-2:] == [ASSISTANT, THINK]
    off = render(renderer, chat_template_kwargs={flag: False}).token_ids
    assert off[-2:] == [ASSISTANT, END_THINK]


def test_continue_final_message_continues_the_assistant_text(renderer: Renderer, hf: Any) -> None:
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One,"}]
    generate = render(
        renderer, messages=messages, add_generation_prompt=False, continue_final_message=True
    )
    expected = templated(hf, messages, add_generation_prompt=False, continue_final_message=True)
    assert generate.token_ids == expected
    assert EOS not in generate.token_ids
    assert hf.decode(generate.token_ids).endswith("One,")


def test_continue_final_message_with_add_generation_prompt_is_400(renderer: Renderer) -> None:
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One,"}]
    error = rejected(renderer, messages=messages, continue_final_message=True)
    assert error.param == "continue_final_message"


@pytest.mark.parametrize("name", ["tools", "tokenize", "messages", "add_generation_prompt"])
def test_reserved_chat_template_kwargs_are_400(renderer: Renderer, name: str) -> None:
    error = rejected(renderer, chat_template_kwargs={name: None, "thinking": True})
    assert error.param == "chat_template_kwargs"
    assert name in error.message


def test_a_wrong_model_name_is_model_not_found(renderer: Renderer) -> None:
    with pytest.raises(ModelNotFound) as info:
        render(renderer, model="gpt-4o")
    assert info.value.status == 404
    assert info.value.param == "model" and info.value.code == "model_not_found"
    assert "gpt-4o" in info.value.message


# -- completions ---------------------------------------------------------------------------


def test_a_completion_string_prompt_renders_to_its_tokens(renderer: Renderer, hf: Any) -> None:
    prompt = "Once upon a time, 从前"
    generate = render(renderer, "completion", prompt=prompt, add_special_tokens=False)
    assert generate.token_ids == hf.encode(prompt, add_special_tokens=False)
    assert generate.context.response_id == "cmpl-r1"
    assert not generate.context.echo


def test_a_completion_string_prompt_is_tokenized_as_the_tokenizer_does(
    renderer: Renderer, hf: Any
) -> None:
    """No BOS of our own: every HF tool (and vLLM) loading the model dir gets these ids."""
    generate = render(renderer, "completion", prompt="Once upon a time")
    assert generate.token_ids == hf.encode("Once upon a time")
    assert generate.token_ids[0] != BOS


def test_a_completion_token_prompt_is_passed_through(renderer: Renderer, hf: Any) -> None:
    ids = hf.encode("Hello there", add_special_tokens=False)
    generate = render(renderer, "completion", prompt=ids, echo=True)
    assert generate.token_ids == ids
    assert generate.context.echo


@pytest.mark.parametrize("single", [["Hello there"], "token-list"])
def test_a_single_element_prompt_list_is_the_prompt_itself(
    renderer: Renderer, hf: Any, single: Any
) -> None:
    ids = hf.encode("Hello there", add_special_tokens=False)
    prompt = [ids] if single == "token-list" else single
    generate = render(renderer, "completion", prompt=prompt, add_special_tokens=False)
    assert generate.token_ids == ids


@pytest.mark.parametrize("prompt", [["a", 5], [], [[]], ["a", [2], ""], [[6366], []]])
def test_empty_or_mixed_prompts_are_400(renderer: Renderer, prompt: Any) -> None:
    error = rejected(renderer, "completion", prompt=prompt, add_special_tokens=False)
    assert error.param == "prompt"


def test_several_prompts_become_one_request_with_every_prompt(renderer: Renderer, hf: Any) -> None:
    first = hf.encode("Hello there", add_special_tokens=False)
    generate = render(renderer, "completion", prompt=["Hello there", [6366, 33]],
                      add_special_tokens=False, max_tokens=7)  # fmt: skip
    assert generate.token_ids == first
    assert generate.prompts is not None
    assert [p.token_ids for p in generate.prompts] == [first, [6366, 33]]
    assert [p.max_tokens for p in generate.prompts] == [7, 7]


def test_each_prompt_gets_its_own_budget_of_the_context(small: Renderer) -> None:
    generate = render(small, "completion", prompt=[[6366] * 4, [6366] * 10], max_tokens=None)
    assert generate.prompts is not None
    assert [p.max_tokens for p in generate.prompts] == [SMALL_CONTEXT - 4, SMALL_CONTEXT - 10]
    too_long = rejected(small, "completion", prompt=[[6366] * 4, [6366] * SMALL_CONTEXT])
    assert too_long.code == "context_length_exceeded"


@pytest.mark.parametrize("bad", [VOCAB, 10**6])
def test_a_prompt_token_id_outside_the_vocabulary_is_400(renderer: Renderer, bad: int) -> None:
    error = rejected(renderer, "completion", prompt=[6366, bad])
    assert error.param == "prompt" and str(bad) in error.message


def test_a_negative_prompt_token_id_is_400(renderer: Renderer) -> None:
    rejected(renderer, "completion", prompt=[6366, -1])


def test_an_empty_completion_prompt_is_400_naming_the_prompt(renderer: Renderer) -> None:
    error = rejected(renderer, "completion", prompt="", add_special_tokens=False)
    assert error.param == "prompt"


def test_the_output_context_prompt_tail_is_the_last_prompt_tokens(renderer: Renderer) -> None:
    generate = render(renderer, "completion", prompt="The quick brown fox jumps over the dog.")
    assert len(generate.token_ids) > SEED_TOKENS
    assert generate.context.prompt_tail == generate.token_ids[-SEED_TOKENS:]
    chat = render(renderer, messages=CONVERSATION)
    assert chat.context.prompt_tail == chat.token_ids[-SEED_TOKENS:]
    assert chat.context.prompt_tail[-2:] == [ASSISTANT, END_THINK]


# -- budget and unsupported features -------------------------------------------------------


def test_without_max_tokens_the_budget_is_the_rest_of_the_context(renderer: Renderer) -> None:
    generate = render(renderer)
    rest = DEFAULT_CONTEXT_LENGTH - len(generate.token_ids)
    assert generate.sampling_params.max_tokens == rest
    assert render(renderer, max_tokens=10).sampling_params.max_tokens == 10
    assert render(renderer, max_completion_tokens=12).sampling_params.max_tokens == 12
    assert render(renderer, "completion", prompt="Hi").sampling_params.max_tokens == 16


def test_a_prompt_as_long_as_the_context_is_400_naming_both_numbers(small: Renderer) -> None:
    ids = [6366] * SMALL_CONTEXT
    error = rejected(small, "completion", prompt=ids, max_tokens=None)
    assert str(SMALL_CONTEXT) in error.message
    assert str(len(ids)) in error.message
    assert error.code == "context_length_exceeded"
    long_text = "word " * 100
    error = rejected(small, messages=[{"role": "user", "content": long_text}])
    assert str(SMALL_CONTEXT) in error.message
    assert "prompt" in error.message


def test_prompt_plus_max_tokens_over_the_context_is_400_on_max_tokens(small: Renderer) -> None:
    ids = [6366] * 10
    error = rejected(small, "completion", prompt=ids, max_tokens=SMALL_CONTEXT - 9)
    assert error.param == "max_tokens"
    assert str(SMALL_CONTEXT + 1) in error.message
    fits = render(small, "completion", prompt=ids, max_tokens=SMALL_CONTEXT - 10)
    assert fits.sampling_params.max_tokens == SMALL_CONTEXT - 10


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        ("completion", {"prompt": [6366] * SMALL_CONTEXT}, "prompt"),
        ("completion", {"prompt": "word " * 100}, "prompt"),
        ("completion", {"prompt": [[6366], [6366] * SMALL_CONTEXT]}, "prompt"),
        ("chat", {"messages": [{"role": "user", "content": "word " * 100}]}, "messages"),
        ("responses", {"input": "word " * 100}, "input"),
        ("messages", {"messages": [{"role": "user", "content": "word " * 100}],
                      "max_tokens": 1}, "messages"),
        ("completion", {"prompt": [6366] * 10, "max_tokens": SMALL_CONTEXT}, "max_tokens"),
        ("chat", {"max_completion_tokens": SMALL_CONTEXT}, "max_completion_tokens"),
        ("chat", {"max_tokens": SMALL_CONTEXT}, "max_tokens"),
        ("responses", {"input": "Hi", "max_output_tokens": SMALL_CONTEXT}, "max_output_tokens"),
    ],
    ids=["completion-ids", "completion-text", "completion-several", "chat", "responses",
         "messages", "completion-budget", "chat-max-completion-tokens", "chat-max-tokens",
         "responses-budget"],
)  # fmt: skip
def test_past_the_context_is_400_naming_the_param_as_the_api_spells_it(
    small: Renderer, api: Api, body: dict[str, Any], param: str
) -> None:
    error = rejected(small, api, **body)
    assert error.code == "context_length_exceeded"
    assert error.param == param, error


@pytest.mark.parametrize(
    ("api", "field", "value"),
    [
        ("chat", "n", 200),
        ("completion", "n", 0),
        ("chat", "stop", [""]),
        ("chat", "top_logprobs", 2),
        ("chat", "echo", True),
        ("completion", "suffix", "tail"),
        ("completion", "best_of", 2),
    ],
)
def test_unsupported_or_malformed_features_are_400_naming_the_param(
    renderer: Renderer, api: Api, field: str, value: Any
) -> None:
    body: dict[str, Any] = {field: value}
    if api == "completion":
        body["prompt"] = "Hi"
    error = rejected(renderer, api, **body)
    assert error.param == field


def test_unset_or_empty_optional_features_are_accepted(renderer: Renderer) -> None:
    generate = render(renderer, n=1, stop=[], logprobs=False)
    assert generate.sampling_params.stop == [] and generate.sampling_params.n == 1


def test_request_fields_become_sampling_params(renderer: Renderer) -> None:
    params = render(
        renderer,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        seed=7,
        min_tokens=3,
        stop_token_ids=[6366],
        ignore_eos=True,
        include_stop_str_in_output=True,
    ).sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.5, 40, 7)
    assert (params.min_tokens, params.stop_token_ids, params.ignore_eos) == (3, [6366], True)
    assert params.include_stop_str_in_output
    defaults = render(renderer).sampling_params
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (1.0, 1.0, 1.0)


# -- decode_body ---------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"{not json", b"", b'{"messages": [}'])
def test_decode_body_on_malformed_json_is_invalid_request(body: bytes) -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        decode_body("chat", body)


def test_decode_body_on_a_schema_violation_names_the_field() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"})
    with pytest.raises(InvalidRequest) as info:
        decode_body("chat", body.encode())
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequest) as info:
        decode_body("chat", b'{"messages": [{"role": "robot", "content": "hi"}]}')
    assert info.value.param == "messages[0].role"


def test_decode_body_picks_the_api_schema() -> None:
    chat = decode_body("chat", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert isinstance(chat, ChatCompletionRequest)
    completion = decode_body("completion", b'{"prompt": "hi"}')
    assert isinstance(completion, CompletionRequest)
    with pytest.raises(InvalidRequest):
        decode_body("completion", b'{"messages": [{"role": "user", "content": "hi"}]}')


def test_stops_and_logprobs_reach_the_engine_and_the_output_context(renderer: Renderer) -> None:
    chat = render(renderer, stop=["END", "\n\n"], logprobs=True, top_logprobs=3, min_tokens=2)
    assert chat.sampling_params.stop == ["END", "\n\n"] == chat.context.stop
    assert chat.sampling_params.logprobs == 3 == chat.context.logprobs
    assert chat.context.min_tokens == 2
    plain = render(renderer, logprobs=True)
    assert plain.context.logprobs == 0  # the sampled token only
    completion = render(renderer, "completion", prompt="Hi", logprobs=2, stop=".")
    assert completion.context.logprobs == 2 and completion.context.stop == ["."]


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "field",
    ["chat_template_kwargs", "kv_transfer_params", "response_format", "structured_outputs",
     "tools"],
)  # fmt: skip
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_json_nested_too_deep_is_invalid_request_naming_the_field(field: str, depth: int) -> None:
    """Deep nesting was a RecursionError (a 500) in decoding, the template or re-encoding."""
    with pytest.raises(InvalidRequest, match="nests deeper than"):
        decode_body("chat", deep_json(field, depth))


def deep_json(field: str, depth: int) -> bytes:
    """A chat body with `field` nesting `depth` deep (deeper than Python's json writes)."""
    inner = '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)
    if field == "tools":
        inner = f'[{{"type":"function","function":{{"name":"f","parameters":{inner}}}}}]'
    if field == "response_format":  # a JSON schema's
        inner = f'{{"type":"json_schema","json_schema":{{"name":"s","schema":{inner}}}}}'
    if field == "structured_outputs":
        inner = f'{{"json":{inner}}}'
    return f'{{"messages":[{{"role":"user","content":"hi"}}],"{field}":{inner}}}'.encode()


def test_json_nested_as_deep_as_allowed_decodes() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": _nested(MAX_DEPTH)}  # fmt: skip
    assert decode_body("chat", json.dumps(body).encode()).chat_template_kwargs


def test_integer_fields_take_what_vllm_takes() -> None:
    """vLLM's pydantic models are lax: an integral float or a numeric string is an int."""
    req = decode_body("completion", b'{"prompt": "hi", "min_tokens": 0.0, "max_tokens": "5"}')
    assert (req.min_tokens, req.max_tokens) == (0, 5)
    with pytest.raises(InvalidRequest, match="min_tokens"):
        decode_body("completion", b'{"prompt": "hi", "min_tokens": 0.5}')


@pytest.mark.parametrize(("words", "off_loop"), [(10, False), (1_000, True), (20_000, True)])
async def test_a_big_body_is_tokenized_off_the_event_loop(
    renderer: Renderer, words: int, off_loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A million-token prompt tokenized on the loop held `tokenway up`'s every stage for
    seconds (engine heartbeats lapsed); the tokenizer lets go of the GIL in a thread. So
    does a 5 KiB one (an agent's system prompt): with render beside the ingress, each one
    inline held every stream of that ingress (8 ms at 16 KiB, 63 at 64 KiB)."""
    threads: list[int] = []
    tokenize = renderer.prompt_ids

    def recording(req: OpenAIRequest, api: Api | None = None) -> list[list[int]]:
        threads.append(threading.get_ident())
        return tokenize(req, api)

    body = request("completion", prompt="word " * words)
    expected = renderer.render(body).token_ids
    monkeypatch.setattr(renderer, "prompt_ids", recording)
    assert (await LocalBackend(renderer).render(body)).token_ids == expected
    assert (threads != [threading.get_ident()]) == off_loop


# A template that writes each tool as JSON, as Qwen's do: the prompt then depends on how the
# tool is handed to it.
JSON_TOOLS = (
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def test_a_template_gets_each_tool_as_vllm_hands_it_whatever_the_clients_order(
    model_dir: Path, tmp_path: Path
) -> None:
    """Issue 36: tokenway wrote `function` before `type` and left absent keys out, so a
    template writing tools as JSON rendered another prompt than vLLM's. vLLM 0.32's render
    server, with this template, renders exactly the text asserted here."""
    shutil.copytree(model_dir, tmp_path / "m")
    config_path = tmp_path / "m" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": JSON_TOOLS}))
    renderer = Renderer(load_model_info(tmp_path / "m"), "deepseek-v4")
    tools = [
        {"function": {"parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
                      "name": "get_weather"}, "type": "function"},
        {"type": "function", "function": {"name": "w", "strict": True}},
    ]  # fmt: skip
    ids = render(renderer, messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                 tool_choice="none")  # fmt: skip
    text = renderer.tokenizer.decode(ids.token_ids)
    assert text == (
        '{"type": "function", "function": {"name": "get_weather", "description": null, '
        '"parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}}\n'
        '{"type": "function", "function": {"name": "w", "description": null, '
        '"parameters": null, "strict": true}}\n'
        "user: Weather?\n"
    )
