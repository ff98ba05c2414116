"""The wire contract: job parsing and reply building (pure Python).

A job is a JSON object published to ``<prefix>.interactive`` or
``<prefix>.batch`` with AMQP ``message_id`` (the idempotency key). See
``docs/protocol.md`` and ``queues/schemas/*.schema.json``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import orjson

from jaxserve.engine.types import RequestError, SamplingParams

ERROR_CODES = (
    "invalid_request",
    "context_length_exceeded",
    "unknown_model",
    "overloaded",
    "rate_limited",
    "expired",
    "cancelled",
    "internal",
)
# Retrying the same job later may succeed for these codes.
RETRYABLE_CODES = frozenset({"overloaded", "rate_limited", "internal"})

DEFAULT_MAX_BODY_BYTES = 1 << 20

# Body fields and their accepted JSON types (bool is excluded from numbers below).
_NUMBER = (int, float)


@dataclasses.dataclass
class Job:
    key: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    model: str | None
    tenant: str | None
    deadline: float | None  # time.time() epoch seconds
    priority: int
    body_bytes: int


def error_payload(code: str, message: str, retryable: bool | None = None) -> dict[str, Any]:
    if retryable is None:
        retryable = code in RETRYABLE_CODES
    return {"code": code, "message": message, "retryable": bool(retryable)}


def result_error(key: str | None, code: str, message: str, retryable: bool | None = None) -> dict[str, Any]:
    return {"type": "result", "id": key, "status": "error", "error": error_payload(code, message, retryable)}


def result_ok(
    key: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    timings: dict[str, float],
) -> dict[str, Any]:
    return {
        "type": "result",
        "id": key,
        "status": "ok",
        "text": text,
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens)},
        "timings": timings,
    }


def chunk(key: str, seq: int, text: str, run: str) -> dict[str, Any]:
    return {"type": "chunk", "id": key, "seq": seq, "text": text, "run": run}


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _bad(msg: str) -> RequestError:
    return RequestError("invalid_request", msg)


def _get_int(body: dict, name: str, default: int | None, *, lo: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise _bad(f"{name} must be >= {lo}, got {value!r}")
    return value


def _get_float(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, _NUMBER) or not math.isfinite(float(value)):
        raise _bad(f"{name} must be a finite number, got {value!r}")
    return float(value)


def parse_expiration(value: Any) -> float | None:
    """AMQP ``expiration`` -> seconds. On the wire it is a string of
    milliseconds; aio-pika hands it over already decoded to float seconds."""
    if value is None or value == "":
        return None
    try:
        if hasattr(value, "total_seconds"):
            return float(value.total_seconds())
        if isinstance(value, (str, bytes)):
            return float(value) / 1000.0
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_job(
    body: bytes,
    *,
    message_id: str | None,
    expiration: Any = None,
    timestamp: Any = None,
    priority: int | None = None,
    content_type: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    received_at: float | None = None,
) -> Job:
    """Validate one delivery. Raises :class:`RequestError` (``invalid_request``)."""
    now = time.time() if received_at is None else received_at
    if not message_id or not isinstance(message_id, str):
        raise _bad("message_id (the AMQP property, the job's idempotency key) is required")
    if len(body) > max_body_bytes:
        raise _bad(f"body is {len(body)} bytes; the limit is {max_body_bytes}")
    if content_type not in (None, "", "application/json"):
        raise _bad(f"content_type must be application/json, got {content_type!r}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"body is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _bad(f"body must be a JSON object, got {type(data).__name__}")

    prompt = data.get("prompt")
    messages = data.get("messages")
    if (prompt is None) == (messages is None):
        raise _bad("exactly one of 'prompt' (string) and 'messages' (chat list) is required")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad(f"prompt must be a string, got {type(prompt).__name__}")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a string 'role'")
            content = m.get("content")
            if not isinstance(content, str):
                # OpenAI content parts: accept text parts only.
                if isinstance(content, list) and all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    m["content"] = "".join(p["text"] for p in content)
                else:
                    raise _bad(f"messages[{i}].content must be a string or a list of text parts")

    n = data.get("n", 1)
    if n != 1:
        raise _bad(f"n must be 1 (one completion per job), got {n!r}")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"stream must be a boolean, got {stream!r}")
    stop = data.get("stop", ())
    if stop is None:
        stop = ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    if len(stop) > 16:
        raise _bad("at most 16 stop strings")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"model must be a string, got {model!r}")
    tenant = data.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise _bad(f"tenant must be a string, got {tenant!r}")

    # OpenAI: max_completion_tokens supersedes max_tokens.
    mt_name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get_int(data, mt_name, 16)
    if max_tokens is None or max_tokens < 1:
        raise _bad(f"{mt_name} must be a positive integer, got {data.get(mt_name)!r}")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_get_float(data, "temperature", 1.0),
        top_p=_get_float(data, "top_p", 1.0),
        top_k=_get_int(data, "top_k", 0) or 0,
        seed=_get_int(data, "seed", None),
        frequency_penalty=_get_float(data, "frequency_penalty", 0.0),
        presence_penalty=_get_float(data, "presence_penalty", 0.0),
        stop=tuple(stop),
    )
    params.validate()

    deadline = None
    ttl = parse_expiration(expiration)
    if ttl is not None:
        start = now
        if timestamp is not None:
            try:
                ts = float(timestamp)
                # Trust the producer's clock only when it is not in the future.
                start = min(ts, now)
            except (TypeError, ValueError, OverflowError):
                pass
        deadline = start + ttl
    if data.get("deadline") is not None:
        d = data["deadline"]
        if isinstance(d, bool) or not isinstance(d, _NUMBER) or not math.isfinite(float(d)):
            raise _bad(f"deadline must be a unix time in seconds, got {d!r}")
        deadline = float(d) if deadline is None else min(deadline, float(d))

    prio = 0
    if priority is not None:
        try:
            prio = int(priority)
        except (TypeError, ValueError):
            prio = 0

    return Job(
        key=message_id,
        prompt=prompt,
        messages=messages,
        params=params,
        stream=stream,
        model=model,
        tenant=tenant,
        deadline=deadline,
        priority=prio,
        body_bytes=len(body),
    )
