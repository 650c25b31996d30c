"""The OpenAI Batch API's objects and rules (pure): files, batches, their input and output
lines. `tokenway.batch_store` keeps them on JetStream; the batch runner
(`workers.batch`) runs them; the ingress serves them.

A batch's lines run as ordinary requests whose ids are the batch's and the line's number
(`line_rid`), with the batch's id as their reply: each line's output is its own ledger,
which is how a runner that took a batch over finds what already ran, and why a line runs
once however often a runner starts again.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any, Literal

import msgspec

from tokenway.quota import Quota

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ENDED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
WINDOWS = {"24h": 24 * 3600}  # completion windows, as OpenAI offers them
MAX_LINES = 50_000  # OpenAI's limit per batch


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class LineError(msgspec.Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class Errors(msgspec.Struct, kw_only=True):
    data: list[LineError]
    object: str = "list"


class Batch(msgspec.Struct, kw_only=True):
    """OpenAI's batch object."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    created_at: int
    expires_at: int
    object: str = "batch"
    errors: Errors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class Record(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A batch as kept: OpenAI's object, whose it is, and its runner's lease."""

    batch: Batch
    tenant: str = ""
    runner: str = ""  # the runner that holds it
    lease_until: float = 0.0  # until when (epoch seconds): after that another may take it
    parts: int = 0  # output parts written (`workers.batch.service.PART_LINES` lines each)
    failures: int = 0  # runs of it that failed in a row (`workers.batch.service.RUNS`)
    # its tenant's share of the files store when it was made: its parts and output count
    # against it (None: counted, never refused)
    quota: Quota | None = None


class Line(msgspec.Struct, kw_only=True):
    """One input line: its request body, as the client gave it."""

    custom_id: str
    body: dict[str, Any]


class BatchRefused(ValueError):
    """A batch cannot be created: the message, and the parameter at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: object) -> Batch:
    """A batch as `POST /v1/batches` creates it; `BatchRefused` for what OpenAI refuses."""
    if endpoint not in ENDPOINTS:
        raise BatchRefused(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if window not in WINDOWS:
        raise BatchRefused(
            f"completion_window must be one of {', '.join(WINDOWS)}", "completion_window"
        )
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise BatchRefused("metadata holds at most 16 string keys and values", "metadata")
    now = int(time.time())
    return Batch(
        id=new_id("batch"),
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=window,
        status="validating",
        created_at=now,
        expires_at=now + WINDOWS[window],
        metadata=metadata,
    )


def parse_lines(data: bytes, endpoint: str) -> tuple[list[Line], list[LineError]]:
    """The input file's lines, or the errors that fail the batch (each with its line)."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            errors.append(
                LineError(code="invalid_json", message="the line is not JSON", line=number)
            )
            continue
        why = _line_problem(doc, endpoint, seen)
        if why is not None:
            errors.append(LineError(code=why[0], message=why[1], param=why[2], line=number))
            continue
        seen.add(doc["custom_id"])
        lines.append(Line(custom_id=doc["custom_id"], body=doc["body"]))
    if not lines and not errors:
        errors.append(LineError(code="empty_file", message="the input file has no requests"))
    if len(lines) > MAX_LINES:
        errors.append(
            LineError(
                code="too_many_requests", message=f"a batch holds at most {MAX_LINES} requests"
            )
        )
    return lines, errors


def _line_problem(doc: object, endpoint: str, seen: set[str]) -> tuple[str, str, str] | None:
    if not isinstance(doc, dict):
        return "invalid_request", "a line must be a JSON object", "line"
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "each line needs a custom_id string", "custom_id"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id!r} is used twice", "custom_id"
    if doc.get("method") != "POST":
        return "invalid_method", "method must be POST", "method"
    if doc.get("url") != endpoint:
        return "mismatched_url", f"url must be the batch's endpoint {endpoint}", "url"
    if not isinstance(doc.get("body"), dict):
        return "invalid_body", "body must be a JSON object", "body"
    if doc["body"].get("stream"):
        return "invalid_body", "a batch request cannot stream", "body.stream"
    return None


def line_rid(batch_id: str, index: int) -> str:
    """The request id of the batch's line `index` (0-based): the same on every runner."""
    return f"{batch_id.removeprefix('batch_')}-{index}"


def output_line(batch_id: str, index: int, line: Line, status: int, body: object) -> bytes:
    """One line of the output (or error) file, in OpenAI's shape."""
    rid = line_rid(batch_id, index)
    digest = hashlib.blake2b(rid.encode(), digest_size=12).hexdigest()
    doc = {
        "id": f"batch_req_{digest}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": rid, "body": body},
        "error": None,
    }
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def file_object(file_id: str, data: bytes, filename: str, purpose: str) -> FileObject:
    return FileObject(
        id=file_id, bytes=len(data), created_at=int(time.time()), filename=filename, purpose=purpose
    )


def cancelled(record: Record, now: float) -> Record | None:
    """The record once a cancel is asked for (None: it has ended, or is being cancelled)."""
    if record.batch.status in ENDED or record.batch.status == "cancelling":
        return None
    batch = msgspec.structs.replace(record.batch, status="cancelling", cancelling_at=int(now))
    return msgspec.structs.replace(record, batch=batch)
