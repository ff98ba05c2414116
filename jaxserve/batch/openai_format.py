"""OpenAI Batch output lines from jaxserve results.

A line is ``{"id": "batch_req_...", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``. The body is the object the endpoint
itself returns: a ``text_completion`` for ``/v1/completions`` or a
``chat.completion`` for ``/v1/chat/completions`` (``id``, ``object``,
``created``, ``model``, ``choices``, ``usage`` with ``total_tokens``, and
``cost`` when the worker priced the job, as in a jaxserve result). A
failed request has ``response: null`` and ``error: {"code", "message"}``
(jaxserve's error code and message).

Structured output and logprobs: ``choices[].logprobs`` in the endpoint's
shape (chat: ``{content: [...]}``; completions: ``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), and the parsed JSON
of a JSON-constrained request as ``message.parsed`` (chat, as the openai
SDK's parsed messages) or ``choices[].parsed`` (completions), next to the
text.

Label scoring: the chosen label is the choice's text (``message.content``
for chat), ``finish_reason`` is ``"stop"``, and the body carries one more
field, ``labels``: ``[{"label", "logprob", "prob"}]`` in the request's
order.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from jaxserve.wire.outputs import completion_logprobs


def _hex(n: int = 24) -> str:
    return uuid.uuid4().hex[:n]


def response_body(result: dict[str, Any], endpoint: str, model: str, created: int | None = None) -> dict[str, Any]:
    usage = result.get("usage") or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    created = int(time.time()) if created is None else created
    text = result.get("text") or ""
    finish = result.get("finish_reason") or "stop"
    logprobs = result.get("logprobs")
    choice: dict[str, Any]
    body: dict[str, Any]
    if endpoint == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        if "parsed" in result:
            choice["message"]["parsed"] = result["parsed"]
        body = {"id": f"chatcmpl-{_hex()}", "object": "chat.completion"}
    else:
        lp = None if logprobs is None else completion_logprobs(logprobs)
        choice = {"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}
        if "parsed" in result:
            choice["parsed"] = result["parsed"]
        body = {"id": f"cmpl-{_hex()}", "object": "text_completion"}
    out_usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if usage.get("cost") is not None:  # the worker priced it: the same field as a jaxserve result's
        out_usage["cost"] = usage["cost"]
    body.update(created=created, model=model, choices=[choice], usage=out_usage)
    if result.get("labels") is not None:
        body["labels"] = [{"label": x["label"], "logprob": x["logprob"], "prob": x["prob"]} for x in result["labels"]]
    return body


def output_line(
    custom_id: str, result: dict[str, Any], endpoint: str, model: str, line_id: str | None = None
) -> dict[str, Any]:
    """The OpenAI Batch line for a final jaxserve result (ok or error);
    ``line_id`` its ``id`` (``jaxserve.batch.keys.line_id``, which a resumed
    run checks), else a random one."""
    if result.get("status") != "ok":
        err = result.get("error") or {}
        return error_line(custom_id, str(err.get("code", "internal")), str(err.get("message", "")), line_id)
    return {
        "id": line_id or f"batch_req_{_hex()}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{_hex(32)}",
            "body": response_body(result, endpoint, model),
        },
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str, line_id: str | None = None) -> dict[str, Any]:
    return {
        "id": line_id or f"batch_req_{_hex()}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def line_outcome(line: dict[str, Any]) -> tuple[str | None, str | None]:
    """(custom_id, error code or None for ok) of an output line in either
    format, for resuming."""
    if "response" in line or "error" in line and "status" not in line:
        err = line.get("error")
        return line.get("custom_id"), (err or {}).get("code") if err else None
    if line.get("status") == "ok":
        return line.get("custom_id"), None
    return line.get("custom_id"), ((line.get("error") or {}).get("code") or "internal")
