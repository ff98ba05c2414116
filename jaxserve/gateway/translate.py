"""OpenAI requests to jaxserve job bodies, and jaxserve replies to OpenAI
objects.

The job body is the request itself minus what only HTTP needs (``stream``
is kept, ``stream_options`` and ``user`` are not), plus the caller's
``tenant`` and ``priority``; every range check is the wire's own
(:func:`jaxserve.wire.parse_job`), run here before anything is published,
so a bad field is a 400 naming it without a round trip through the broker
and the same message a queue producer would get. Fields of OpenAI's API
that jaxserve cannot honour (``tools``, ``n`` > 1, ``logit_bias`` ...) are
refused there too, never silently dropped.

Responses reuse the Batch API's bodies (:func:`jaxserve.batch.openai_format.response_body`),
so a request answers the same object over HTTP and in a batch output line.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import orjson

from jaxserve.batch.openai_format import response_body
from jaxserve.gateway.errors import ApiError, from_error, invalid
from jaxserve.gateway.keys import Principal
from jaxserve.json_files import loads_object
from jaxserve.request_error import RequestError
from jaxserve.wire import JobProperties, Result, parse_job
from jaxserve.wire.outputs import completion_logprobs

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

#: fields that only shape the HTTP exchange, never the job
_HTTP_ONLY = ("stream_options", "user", "metadata", "store", "service_tier")


def parse_body(raw: bytes) -> dict[str, Any]:
    return loads_object(
        raw,
        invalid,
        "We could not parse the JSON body of your request ({}).",
        "The request body must be a JSON object, got {}.",
    )


def job_body(request: dict[str, Any], endpoint: Endpoint, principal: Principal, priority: int | None) -> dict[str, Any]:
    """The job body for an OpenAI request; raises :class:`ApiError` (400)
    naming the field for anything the wire refuses."""
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", "model", "missing_required_parameter")
    principal.check_model(model)
    body = {k: v for k, v in request.items() if k not in _HTTP_ONLY}
    stream_options = request.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid(f"stream_options must be an object, got {stream_options!r}", "stream_options")
        if not request.get("stream"):
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if endpoint == "chat":
        if "messages" not in body:
            raise invalid("messages is a required property", "messages", "missing_required_parameter")
        if "prompt" in body:
            raise invalid("prompt is not a parameter of /v1/chat/completions; send messages", "prompt")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            body["prompt"] = prompt[0]  # the SDK's list form of one prompt
        elif not isinstance(prompt, str):
            raise invalid(
                f"prompt must be a string (or a list of one string), got {_show(prompt)}",
                "prompt",
                "invalid_type" if prompt is not None else "missing_required_parameter",
            )
        if "messages" in body:
            raise invalid("messages is not a parameter of /v1/completions; send prompt", "messages")
    for name in ("tenant", "priority", "deadline", "labels"):
        body.pop(name, None)  # jaxserve's own fields come from the key and headers, not the body
    body["tenant"] = principal.tenant
    if priority is not None:
        body["priority"] = priority
    return body


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate(body: dict[str, Any], key: str) -> bytes:
    """The body's bytes once the wire's checks pass (the worker repeats them;
    the engine's limits, the context length above all, only it knows)."""
    raw = orjson.dumps(body)
    try:
        parse_job(raw, JobProperties(message_id=key, content_type="application/json"))
    except RequestError as exc:
        raise from_error(exc.code, str(exc)) from None
    return raw


def new_id(kind: Endpoint) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def completion(result: Result, endpoint: Endpoint, model: str) -> dict[str, Any]:
    """The non-streaming answer: a ``chat.completion`` or ``text_completion``."""
    return response_body(result.to_dict(), endpoint, model)


def _usage(result: Result) -> dict[str, int]:
    usage = result.usage
    prompt = usage.prompt_tokens if usage is not None else 0
    completion_tokens = usage.completion_tokens if usage is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


class ChunkWriter:
    """The server-sent events of one streamed answer, in OpenAI's chunk
    shapes: ``chat.completion.chunk`` (a first chunk with the role, content
    deltas, a last one with ``finish_reason``) or ``text_completion``, then
    the usage chunk when ``stream_options.include_usage``, then ``[DONE]``.
    Log-probabilities come with the last chunk (the worker sends them with
    its final result)."""

    def __init__(self, endpoint: Endpoint, model: str, include_usage: bool) -> None:
        self.endpoint = endpoint
        self.model = model
        self.include_usage = include_usage
        self.id = new_id(endpoint)
        self.created = int(time.time())

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, logprobs: Any = None, role: bool = False) -> dict[str, Any]:
        if self.endpoint == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def opening(self) -> bytes:
        """Sent the moment the first token exists (time to first token)."""
        return self._event([self._choice("", None, role=True)])

    def delta(self, text: str) -> bytes:
        return self._event([self._choice(text, None)])

    def closing(self, result: Result) -> bytes:
        logprobs = result.logprobs
        if logprobs is not None and self.endpoint == "completions":
            logprobs = completion_logprobs(logprobs)
        out = self._event([self._choice(None if self.endpoint == "chat" else "", result.finish_reason, logprobs)])
        if self.include_usage:
            out += self._event([], _usage(result))
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(exc: ApiError) -> bytes:
        """A refusal after the stream began (the status line is sent): an
        error event, as OpenAI streams one, then the end."""
        return b"data: " + orjson.dumps(exc.body()) + b"\n\n" + b"data: [DONE]\n\n"
