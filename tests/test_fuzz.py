"""Schemathesis against `tokenway up` over real HTTP, from the ingress's own OpenAPI
document: bodies and parameters that fit the schema and ones that break it, on every route;
then the request fields where one client's input meets another's code (tools, tool choice,
structured outputs), drawn so that their combinations come up in every run, on each API
that takes them. Target: no answer is a 5xx and none hangs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.schemas import OpenApiSchema

# Per route and mode: 25 fits the suite's budget (each run draws anew: database=None);
# TOKENWAY_FUZZ_EXAMPLES=1000 digs deeper.
EXAMPLES = int(os.environ.get("TOKENWAY_FUZZ_EXAMPLES", 25))
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# Every operation the document describes (a test below checks it is all of them), and how it
# is fuzzed: one that takes no input has nothing to break.
ROUTES = {
    ("POST", "/v1/chat/completions"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/completions"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/responses"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/messages"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/messages/count_tokens"): [POSITIVE, NEGATIVE],
    ("POST", "/tokenize"): [POSITIVE, NEGATIVE],
    ("POST", "/detokenize"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/chat/completions/render"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/completions/render"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/messages/render"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/responses/render"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/chat/completions/derender"): [POSITIVE, NEGATIVE],
    ("POST", "/v1/completions/derender"): [POSITIVE, NEGATIVE],
    ("POST", "/inference/v1/generate"): [POSITIVE, NEGATIVE],
    ("POST", "/inference/v1/abort_requests"): [POSITIVE, NEGATIVE],
    ("GET", "/v1/streams/{rid}"): [POSITIVE, NEGATIVE],
    ("GET", "/v1/models"): [POSITIVE],
    ("GET", "/v1/models/{model_id}"): [POSITIVE],  # any string is an id: nothing to break
    ("GET", "/version"): [POSITIVE],
    ("GET", "/health"): [POSITIVE],
    ("GET", "/ready"): [POSITIVE],
    ("GET", "/metrics"): [POSITIVE],
    ("POST", "/v1/files"): [POSITIVE, NEGATIVE],
    ("GET", "/v1/files"): [POSITIVE],
    ("GET", "/v1/files/{file_id}"): [POSITIVE],  # ids, like model ids, are any string
    ("GET", "/v1/files/{file_id}/content"): [POSITIVE],
    ("DELETE", "/v1/files/{file_id}"): [POSITIVE],
    ("POST", "/v1/batches"): [POSITIVE, NEGATIVE],
    ("GET", "/v1/batches"): [POSITIVE],
    ("GET", "/v1/batches/{batch_id}"): [POSITIVE],
    ("POST", "/v1/batches/{batch_id}/cancel"): [POSITIVE],
    ("GET", "/v1/responses/{response_id}"): [POSITIVE],  # ids are any string: a 404
    ("GET", "/v1/responses/{response_id}/input_items"): [POSITIVE],
    ("DELETE", "/v1/responses/{response_id}"): [POSITIVE],
}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tokenway up` in a process of its own (its base URL): schemathesis calls it
    synchronously."""
    # A 4k context: a generated request without max_tokens (and with ignore_eos) runs to the
    # context's end, which at 131k tokens outlasts the call's timeout.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENWAY_SIM_TTFT": "0",
           "TOKENWAY_SIM_ITL": "0.0005", "TOKENWAY_SIM_OUTPUT_LEN": "24",
           "TOKENWAY_MAX_MODEL_LEN": "4096"}  # fmt: skip
    data = tmp_path_factory.mktemp("fuzz")
    command = [sys.executable, "-m", "program.cli", "up", "--data-dir", str(data), "--port", "0"]
    log = (data / "up.log").open("wb")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        urls = (re.search(r"at (http://\S+)/v1", line) for line in proc.stdout)
        yield next(m.group(1) for m in urls if m)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            proc.kill()
            log.close()


@pytest.fixture(scope="module")
def api(up: str) -> OpenApiSchema:
    return schemathesis.openapi.from_url(f"{up}/openapi.json", timeout=30)


def test_the_document_describes_every_route(api: OpenApiSchema) -> None:
    operations = {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()}
    assert operations == set(ROUTES)


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(method, path, mode) for (method, path), modes in ROUTES.items() for mode in modes],
)
def test_no_input_makes_a_server_error_or_a_hang(
    api: OpenApiSchema, method: str, path: str, mode: GenerationMode
) -> None:
    @given(case=api[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def call(case: schemathesis.Case) -> None:
        response = case.call(timeout=30)  # a hang is a failure, not a wait
        case.validate_response(response, checks=[not_a_server_error])

    call()


# -- tools, tool choice and structured outputs, in play together -----------------------------
# The schema's generator rarely names a tool the request also offers, or one it does not:
# these draw each field from values that mean something (and ones that are wrong in the ways
# a client gets them wrong), so each combination turns up in every run. A named tool that
# was not among the tools was a 500 the schema-driven fuzz found once in many runs.
TOOL_EXAMPLES = int(os.environ.get("TOKENWAY_FUZZ_TOOL_EXAMPLES", 120))
NAMES = st.sampled_from(["get_weather", "lookup", "nope", ""])
PARAMETERS = st.sampled_from([
    {},
    {"type": "object"},
    {"type": "object", "properties": {"city": {"type": "string"},
                                      "unit": {"type": "string", "enum": ["c", "f"]}},
     "required": ["city", "unit"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "nonsense"},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
])  # fmt: skip
SCHEMA_FORMATS = st.sampled_from([
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "string", "pattern": "(("},
    {"type": "nonsense"},
    {},
])  # fmt: skip
GRAMMARS = st.sampled_from(['root ::= "yes" | "no"', "root ::= ((", 'start: "a"', "root ::= x\\",
                            "?start: ((", ""])  # fmt: skip
REGEXES = st.sampled_from(["[a-z]{3}", "((", "", "\\d+"])
TAGS = st.sampled_from([
    {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}},
    {"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= (("}},
    {"type": "structural_tag", "format": {"type": "grammar", "grammar": 'root ::= "ok"'}},
    {"type": "structural_tag"},
    {"type": "structural_tag", "format": {"type": "nope"}},
    {"type": "structural_tag", "structures": [], "triggers": []},
    {"type": "structural_tag", "triggers": ["<a"],
     "structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}]},
    # valid for vLLM, not decoded by the simulated engine: its 400, not an engine failure
    {"type": "structural_tag",
     "format": {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}}},
])  # fmt: skip


def _json_schema_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


CHAT_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": NAMES, "parameters": PARAMETERS},
                                       optional={"strict": st.booleans()})},
)  # fmt: skip
CHAT_CHOICE = st.sampled_from(["auto", "none", "required"]) | NAMES.map(
    lambda n: {"type": "function", "function": {"name": n}}
)
RESPONSE_FORMAT = (
    st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | SCHEMA_FORMATS.map(_json_schema_format)
    | TAGS
)
STRUCTURED = st.one_of(
    SCHEMA_FORMATS.map(lambda s: {"json": s}),
    REGEXES.map(lambda r: {"regex": r}),
    GRAMMARS.map(lambda g: {"grammar": g}),
    st.lists(st.sampled_from(["a", "b", ""]), max_size=2).map(lambda c: {"choice": c}),
    st.just({"json_object": True}),
    TAGS.map(lambda t: {"structural_tag": t}),
    st.just({"json": {}, "regex": "a"}),  # two kinds at once
)
COMMON = {"max_tokens": st.integers(1, 6), "stream": st.booleans()}
CHAT = st.fixed_dictionaries(
    {"model": st.just("deepseek-v4"),
     "messages": st.just([{"role": "user", "content": "Weather in Paris?"}]), **COMMON},
    optional={"tools": st.lists(CHAT_TOOL, max_size=3), "tool_choice": CHAT_CHOICE,
              "parallel_tool_calls": st.booleans(), "response_format": RESPONSE_FORMAT,
              "structured_outputs": STRUCTURED, "guided_grammar": GRAMMARS,
              "guided_regex": REGEXES, "guided_json": SCHEMA_FORMATS,
              "chat_template_kwargs": st.just({"thinking": True})},
)  # fmt: skip
RESPONSES = st.fixed_dictionaries(
    {"model": st.just("deepseek-v4"), "input": st.just("Weather in Paris?"),
     "max_output_tokens": st.integers(1, 6), "stream": st.booleans()},
    optional={
        "tools": st.lists(st.fixed_dictionaries(
            {"type": st.just("function"), "name": NAMES, "parameters": PARAMETERS},
            optional={"strict": st.booleans()}), max_size=3),
        "tool_choice": st.sampled_from(["auto", "none", "required"])
        | NAMES.map(lambda n: {"type": "function", "name": n}),
        "parallel_tool_calls": st.booleans(),
        "text": (st.sampled_from([{"type": "text"}, {"type": "json_object"}])
                 | SCHEMA_FORMATS.map(lambda s: {"type": "json_schema", "name": "o", "schema": s})
                 ).map(lambda f: {"format": f}),
        "structured_outputs": STRUCTURED,
        "reasoning": st.sampled_from([{"effort": "none"}, {"effort": "high"}]),
    },
)  # fmt: skip
MESSAGES = st.fixed_dictionaries(
    {"model": st.just("deepseek-v4"), "max_tokens": st.integers(1, 6), "stream": st.booleans(),
     "messages": st.just([{"role": "user", "content": "Weather in Paris?"}])},
    optional={
        "tools": st.lists(st.fixed_dictionaries({"name": NAMES, "input_schema": PARAMETERS},
                                                optional={"strict": st.booleans()}), max_size=3),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
        | NAMES.map(lambda n: {"type": "tool", "name": n}),
        "output_config": SCHEMA_FORMATS.map(
            lambda s: {"format": {"type": "json_schema", "schema": s}}),
        "thinking": st.just({"type": "enabled", "budget_tokens": 1024}),
    },
)  # fmt: skip


@pytest.mark.parametrize(
    ("path", "bodies"),
    [("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)],
    ids=["chat", "responses", "messages"],
)
def test_tools_and_structured_outputs_make_no_server_error_or_hang(
    up: str, path: str, bodies: st.SearchStrategy[dict]
) -> None:
    with httpx.Client(base_url=up, timeout=30) as http:  # a hang is a failure, not a wait

        @given(body=bodies)
        @settings(max_examples=TOOL_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def call(body: dict) -> None:
            with http.stream("POST", path, json=body) as resp:
                text = resp.read().decode()
            assert resp.status_code < 500, (body, text)
            assert "internal error" not in text, (body, text)  # nor an error event in a stream

        call()
