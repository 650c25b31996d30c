"""Schemathesis against `tokenway up` over real HTTP, from the ingress's own OpenAPI
document: bodies and parameters that fit the schema and ones that break it, on every route.
Target: no answer is a 5xx and none hangs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
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
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenApiSchema]:
    """`tokenway up` in a process of its own: schemathesis calls it synchronously."""
    # A 4k context: a generated request without max_tokens (and with ignore_eos) runs to the
    # context's end, which at 131k tokens outlasts the call's timeout.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENWAY_SIM_TTFT": "0",
           "TOKENWAY_SIM_ITL": "0.0005", "TOKENWAY_SIM_OUTPUT_LEN": "24",
           "TOKENWAY_MAX_MODEL_LEN": "4096"}  # fmt: skip
    data = tmp_path_factory.mktemp("fuzz")
    command = [sys.executable, "-m", "tokenway.cli", "up", "--data-dir", str(data), "--port", "0"]
    log = (data / "up.log").open("wb")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        urls = (re.search(r"at (http://\S+)/v1", line) for line in proc.stdout)
        url = next(m.group(1) for m in urls if m)
        yield schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            proc.kill()
            log.close()


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
