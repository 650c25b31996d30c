"""Every failure as an OpenAI error: one place maps a failure class to its type and status."""

from __future__ import annotations

import msgspec

from tokenway.wire import ErrorInfo


class TokenwayError(Exception):
    """A failure with an OpenAI error type and HTTP status."""

    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            message=self.message,
            type=self.type,
            status=self.status,
            param=self.param,
            code=self.code,
        )


class InvalidRequest(TokenwayError):
    status = 400
    type = "BadRequestError"


class Unprocessable(TokenwayError):
    status = 422
    type = "UnprocessableEntityError"


class BodyTimeout(TokenwayError):
    status = 408
    type = "RequestTimeoutError"


class TooLarge(TokenwayError):
    status = 413
    type = "RequestTooLargeError"


class HeadTooLarge(TokenwayError):
    status = 431
    type = "RequestHeaderFieldsTooLargeError"


class ModelNotFound(TokenwayError):
    status = 404
    type = "NotFoundError"


def check_model(asked: str | None, *served: str) -> None:
    """A request naming a model other than those served: the client's 404, as vLLM words it."""
    if asked is not None and asked not in served:
        raise ModelNotFound(
            f"The model `{asked}` does not exist.", param="model", code="model_not_found"
        )


class Conflict(TokenwayError):
    status = 409
    type = "ConflictError"


class MethodNotAllowed(TokenwayError):
    status = 405
    type = "MethodNotAllowed"


class DeadlineExceeded(TokenwayError):
    status = 504
    type = "TimeoutError"


class Overloaded(TokenwayError):
    status = 429
    type = "RateLimitError"


class RateLimited(Overloaded):
    """The tenant's limits: it may try again in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after = retry_after

    def info(self) -> ErrorInfo:
        return msgspec.structs.replace(super().info(), retry_after=self.retry_after)


class StageUnavailable(TokenwayError):
    status = 502
    type = "ServiceUnavailableError"


class Unavailable(TokenwayError):
    """The bus cannot take the request now (JetStream electing leaders): retry shortly."""

    status = 503
    type = "ServiceUnavailableError"


class NoEngine(Unavailable):
    """No engine of the model has been registered for the scheduler's engine wait."""


class StageTimeout(TokenwayError):
    status = 504
    type = "TimeoutError"


class EngineFailed(TokenwayError):
    status = 502
    type = "EngineError"


class NoCompatibleEngine(EngineFailed):
    """Engines are registered, but none speaks this scheduler's token IDs (obfuscation)."""

    status = 503
    type = "ServiceUnavailableError"


class CannotStart(Exception):
    """A process that cannot start or go on (NATS out of reach, its port taken, its data
    directory in use): the message says why in one line; the command exits with status 1."""


class ErrorDetail(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorBody(msgspec.Struct):
    """Every error answer's body, as OpenAI sends it."""

    error: ErrorDetail


_json = msgspec.json.Encoder()


def error_body(info: ErrorInfo) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
    return _json.encode(
        ErrorBody(
            ErrorDetail(
                message=info.message,
                type=info.type,
                param=info.param,
                code=info.code if info.code is not None else info.status,
            )
        )
    )


def too_big_for_the_bus(size: int, limit: int, *, at_least: bool = False) -> InvalidRequest:
    """A response that cannot travel as one message: the client asked for more than fits."""
    return InvalidRequest(
        f"the response is {'at least ' if at_least else ''}{size} bytes, over the bus's message "
        f"limit of {limit} bytes; ask for it with stream: true, or for fewer tokens, choices "
        "or logprobs",
        param="stream",
    )


def refused(message: str, status: int) -> ErrorInfo:
    """An engine's refusal of a request itself (its 4xx), as the client hears it: the
    request's own error, of the type its status has."""
    kind = {c.status: c for c in (TooLarge, Unprocessable)}.get(status, InvalidRequest)
    return ErrorInfo(message=message, type=kind.type, status=status)


def internal(rid: str) -> ErrorInfo:
    """A bug, as its client hears of it: that it happened and under which request id. What
    broke goes to the log under that id (the caller logs the traceback), never to the
    client: an exception's text can hold paths, keys or another request's data."""
    return ErrorInfo(
        message=f"internal error in request {rid}; the server's log has the details",
        type="InternalServerError",
        status=500,
    )
