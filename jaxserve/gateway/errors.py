"""Errors in OpenAI's shape, and the HTTP status of each jaxserve error code.

Every refusal the gateway answers is ``{"error": {"message", "type",
"param", "code"}}`` with OpenAI's status codes, so the ``openai`` SDK raises
the exception its users already catch (``NotFoundError``,
``RateLimitError`` ...). ``Retry-After`` goes only on the refusals a retry
can cure: a full queue, an overloaded worker, a tenant over its limits
(``tests/test_gateway_unit.py`` holds the table; ``tests/test_gateway_sdk.py``
the SDK's view of it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jaxserve.wire import Result

#: jaxserve error code -> (HTTP status, OpenAI error type, OpenAI code)
_BY_CODE: dict[str, tuple[int, str, str]] = {
    "invalid_request": (400, "invalid_request_error", "invalid_request"),
    "context_length_exceeded": (400, "invalid_request_error", "context_length_exceeded"),
    "unknown_model": (404, "invalid_request_error", "model_not_found"),
    "overloaded": (429, "server_error", "overloaded"),
    "rate_limited": (429, "requests", "rate_limit_exceeded"),
    "expired": (504, "timeout", "expired"),
    "cancelled": (409, "invalid_request_error", "cancelled"),
    "internal": (500, "server_error", "internal"),
    "idempotency_key_reused": (409, "invalid_request_error", "idempotency_key_reused"),
}

#: statuses a retry can cure, and so the ones that carry Retry-After
RETRYABLE_STATUSES = frozenset({429})


@dataclasses.dataclass
class ApiError(Exception):
    """One refusal: raised anywhere under a route, answered by the app."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.status in RETRYABLE_STATUSES and self.retry_after_s is not None:
            # whole seconds (RFC 9110), never 0: a client that retries at once meets the same refusal
            return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        return {}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def queue_full(queue: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429,
        f"the queue {queue} is full; retry after {retry_after_s:g}s",
        "server_error",
        None,
        "queue_full",
        retry_after_s,
    )


def no_worker(model: str, queue: str) -> ApiError:
    """The model is routed but nothing consumes its queue: a 503, without
    Retry-After (nobody can say when a worker comes)."""
    return ApiError(
        503,
        f"no worker is serving model {model!r} now (its queue {queue} has no consumer)",
        "server_error",
        "model",
        "no_worker",
    )


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?(?:\.[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?)*)\b")


def param_of(message: str) -> str | None:
    """The body field an ``invalid_request`` message names first (the wire
    writes ``top_logprobs: ...`` or ``messages[0].content ...``)."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def from_error(code: str, message: str, retry_after_s: float | None = None, *, param: str | None = None) -> ApiError:
    status, kind, openai_code = _BY_CODE.get(code, (500, "server_error", code))
    if param is None and code == "invalid_request":
        param = param_of(message)
    if code == "unknown_model":
        param = "model"
    return ApiError(status, message, kind, param, openai_code, retry_after_s if status == 429 else None)


def from_result(result: Result) -> ApiError:
    """The refusal for a final result with ``status: error``."""
    err = result.error
    if err is None:
        return ApiError(500, "the worker answered an error without details", "server_error", None, "internal")
    return from_error(err.code, err.message, err.retry_after_s)
