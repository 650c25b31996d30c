"""`tokenway asyncapi`: a valid AsyncAPI 3.0 document that names every subject of the bus,
and whose references all resolve."""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

import pytest
from pydantic_asyncapi.v3 import AsyncAPI

from program import cli
from program.asyncapi import document
from tokenway import bus


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def bus_subjects() -> dict[str, str]:
    """Every subject function (called with sample tokens) and subject constant of
    `tokenway.bus`, the buckets' included."""
    found = {}
    for name, value in vars(bus).items():
        if name.endswith("_subject") and inspect.isfunction(value):
            params = inspect.signature(value).parameters.values()
            tokens = [f"sample{i}" for i, p in enumerate(params) if p.default is p.empty]
            found[name] = value(*tokens)
            if "batch" in inspect.signature(value).parameters:  # a queue's batch lane
                found[f"{name}(batch)"] = value(*tokens, batch=True)
        elif name.endswith(("_SUBJECT", "_SUBJECTS", "_KEYS")):  # the buckets' too
            found[name] = value.replace(">", "sample")
    return found


def test_the_document_is_asyncapi_3_and_every_reference_resolves() -> None:
    doc = document()
    AsyncAPI.model_validate(doc)
    assert doc["asyncapi"] == "3.0.0"
    for ref in refs(doc):
        assert resolve(doc, ref) is not None, ref
    for op in doc["operations"].values():  # each channel is sent and received by someone
        assert op["action"] in ("send", "receive") and op["summary"].split()[0]


def test_every_subject_of_the_bus_is_a_channel() -> None:
    addresses = [c["address"] for c in document()["channels"].values() if c["address"]]
    patterns = [re.compile(re.sub(r"\\\{\w+\\\}", "[^.]+", re.escape(a)) + "$") for a in addresses]
    subjects = bus_subjects()
    assert len(subjects) >= 15  # the functions and constants are found at all
    for name, subject in subjects.items():
        assert any(p.match(subject) for p in patterns), (name, subject)


def test_every_payload_is_a_schema_of_the_wire_structs() -> None:
    doc = document()
    schemas = doc["components"]["schemas"]
    for name in ("RenderRequest", "GenerateRequest", "TokenStep", "Delivery", "EngineWork"):
        assert schemas[name]["type"] == "object" and schemas[name]["properties"], name
    generate = schemas["GenerateRequest"]
    assert set(generate["required"]) == {"request_id", "token_ids"}
    assert doc["components"]["messages"]["schedule"]["payload"] == {
        "$ref": "#/components/schemas/GenerateRequest"
    }


def test_the_command_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["asyncapi"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(document()))
