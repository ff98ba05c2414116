"""Typed replies and control messages of the queue contract.

The worker builds every reply through these models and the client decodes
every reply into them, so both sides share one definition; the JSON Schemas
under ``queues/schemas/`` are generated from them (``jaxserve.wire.schemas``).

Replies are forward compatible for readers: fields a newer worker adds are
kept (``extra="allow"``) rather than refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from jaxserve.wire.errors import ERROR_CODES, is_retryable

# pydantic reads the runtime tuple; a type checker cannot build a Literal from it
ErrorCode = Literal[ERROR_CODES]  # type: ignore[valid-type]
FinishReason = Literal["stop", "length"]
#: what a degraded answer gave up: "model" the job was re-routed
#: to one of its fallback_models; "max_tokens" it ran with degrade.max_tokens
Degradation = Literal["model", "max_tokens"]


class WireDecodeError(ValueError):
    """A message body that is not a valid message of the contract."""


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_dict())


class UsageCost(TypedDict):
    """What a job's tokens cost: a plain mapping on the wire and
    in Python, so readers index it (``usage.cost["amount"]``)."""

    amount: Annotated[float, Field(ge=0.0)]
    currency: str


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: Annotated[int, Field(ge=0)]
    completion_tokens: Annotated[int, Field(ge=0)]
    cost: UsageCost | None = Field(
        default=None,
        description="The job's own prompt and completion tokens at the worker's price for the model that served it "
        "(jaxserve worker --prices); absent when that worker has no price for it.",
    )


class LabelScore(BaseModel):
    model_config = ConfigDict(extra="allow")

    label: str
    logprob: float = Field(
        description="Sum of the label's token log-probabilities (after 'mean' normalization: their mean)."
    )
    prob: Annotated[float, Field(ge=0.0, le=1.0)] = Field(description="Softmax of the labels' logprobs.")


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: ErrorCode = Field(description="One of the contract's error codes (docs/protocol.md).")
    message: str = Field(description="What was wrong, naming the offending field and value where there is one.")
    retryable: bool = Field(description="Whether resubmitting the same job later may succeed.")
    retry_after_s: Annotated[float, Field(ge=0.0)] | None = Field(
        default=None, description="overloaded / rate_limited: seconds after which a resubmission may be admitted."
    )


class Chunk(_Reply):
    """A text delta of a streaming job. ``seq`` counts 0, 1, 2, ... within one
    ``run`` (one execution of the job); the texts of a run concatenate to
    the final result's text."""

    model_config = ConfigDict(
        extra="allow",
        title="jaxserve stream chunk",
        json_schema_extra={
            "description": "Sent to reply_to (correlation_id echoed) while a job with stream=true runs. seq counts "
            "0, 1, 2, ... per run; chunks of one run arrive in order; concatenated texts equal the final result's "
            "text. A chunk may carry several tokens. A job restarted after a crash starts a new run (new run id) "
            "at seq 0; when it continues from the tokens the crashed run saved, its first chunk carries their "
            "text too (resumed: how many of its tokens those are)."
        },
    )

    type: Literal["chunk"] = "chunk"
    id: str = Field(description="The job's key (its message_id).")
    seq: Annotated[int, Field(ge=0)]
    text: str = Field(
        description="Text delta (never splits a UTF-8 character). May be empty: the first token is sent at once "
        "even when its text is still held back (part of a character), so the first chunk marks time to first token."
    )
    run: str | None = Field(default=None, description="Id of this execution of the job.")
    tokens: Annotated[int, Field(ge=0)] | None = Field(default=None, description="Tokens the delta carries.")
    resumed: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="Only on the first chunk of a run that continues from the tokens an earlier run of the job "
        "saved before its worker died: how many of this chunk's tokens that run generated (their text is in this "
        "chunk, so the run's texts still concatenate to the final text).",
    )


class Result(_Reply):
    """The one final reply of a job: ``status`` ok (text, finish_reason,
    usage, timings) or error (``error``)."""

    model_config = ConfigDict(
        extra="allow",
        title="jaxserve final result",
        json_schema_extra={
            "description": "Exactly one per job (at-least-once delivery: deduplicate by id), sent to reply_to "
            "with AMQP message_id = the job's key and its correlation_id. replayed=true when answered from the "
            "idempotency store without running the model.",
            "oneOf": [
                {"properties": {"status": {"const": "ok"}}, "required": ["text", "finish_reason", "usage", "timings"]},
                {"properties": {"status": {"const": "error"}}, "required": ["error"]},
            ],
        },
    )

    type: Literal["result"] = "result"
    id: str | None = Field(description="The job's key; null only when the job had no usable message_id.")
    status: Literal["ok", "error"]
    text: str | None = Field(default=None, description="The whole completion (stop strings removed).")
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: dict[str, float] | None = Field(
        default=None,
        description="Seconds, measured by the worker from receipt: total_s, admit_s, ttft_s; queue_s from the "
        "producer's x-published-at-ms header (or timestamp).",
    )
    error: ErrorInfo | None = None
    replayed: bool | None = Field(default=None, description="Answered from the idempotency store, not run again.")
    cached: bool | None = Field(
        default=None, description="Answered from the response cache (the same deterministic job ran before), not run."
    )
    labels: list[LabelScore] | None = Field(
        default=None,
        description="Label scoring: every label of the job, in the job's order, with its logprob and prob.",
    )
    model: str | None = Field(default=None, description="The served model name.")
    served_model: str | None = Field(
        default=None,
        description="The model that answered: the job's own, or the fallback it was re-routed to (then degraded "
        "holds 'model').",
    )
    degraded: list[Degradation] | None = Field(
        default=None,
        description="Present when the job was answered in a degraded form it asked to accept instead of "
        "overloaded: 'model' (re-routed to one of its fallback_models), 'max_tokens' (run with degrade.max_tokens).",
    )
    logprobs: dict[str, Any] | None = Field(
        default=None,
        description="Jobs with logprobs: OpenAI's chat shape, {content: [{token, logprob, bytes, top_logprobs: "
        "[{token, logprob, bytes}]}], refusal: null}, one entry per completion token, raw model log-probabilities.",
    )
    parsed: Any = Field(
        default=None,
        description="JSON-constrained jobs (response_format json_schema / json_object) that ended with "
        "finish_reason stop: the text, parsed.",
    )
    trace_id: str | None = Field(
        default=None,
        description="The job's W3C trace id (32 hex digits): the producer's, from the job's traceparent header, "
        "or a new root trace's when the worker traces and the job brought none.",
    )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.setdefault("id", None)  # null, not absent, for a job without a key
        return out

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def raw(self) -> dict[str, Any]:
        """The message as a plain dict (what went over the wire)."""
        return self.to_dict()

    @classmethod
    def success(
        cls,
        key: str,
        text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        timings: dict[str, float],
        *,
        labels: list[dict[str, Any]] | None = None,
        model: str | None = None,
        logprobs: dict[str, Any] | None = None,
        parsed: Any = None,
        served_model: str | None = None,
        degraded: list[str] | None = None,
    ) -> Result:
        return cls(
            id=key,
            status="ok",
            text=text,
            finish_reason=cast(FinishReason, finish_reason),  # pydantic validates it
            usage=Usage(prompt_tokens=int(prompt_tokens), completion_tokens=int(completion_tokens)),
            timings=timings,
            labels=None if labels is None else [LabelScore(**x) for x in labels],
            model=model,
            logprobs=logprobs,
            parsed=parsed,
            served_model=served_model,
            degraded=None if not degraded else [cast(Degradation, d) for d in degraded],  # pydantic validates them
        )

    @classmethod
    def failure(
        cls,
        key: str | None,
        code: str,
        message: str,
        retryable: bool | None = None,
        *,
        retry_after_s: float | None = None,
    ) -> Result:
        if retryable is None:
            retryable = is_retryable(code)
        info = ErrorInfo(code=code, message=message, retryable=bool(retryable), retry_after_s=retry_after_s)
        return cls(id=key, status="error", error=info)

    @property
    def retryable_error(self) -> bool:
        return self.error is not None and self.error.retryable


class Cancel(_Reply):
    """Published to the fanout exchange ``<prefix>.control``: the worker
    running the job aborts it and answers it ``cancelled``."""

    model_config = ConfigDict(
        extra="allow",
        title="jaxserve cancel",
        json_schema_extra={
            "description": "Published to the fanout exchange <prefix>.control (any routing key). Every worker "
            "receives it; the one running the job aborts it, frees its KV blocks and answers it with error code "
            "cancelled. A job that has not been delivered yet is answered cancelled when it arrives (workers "
            "remember cancels for 24 hours by default; with the Redis store, across workers)."
        },
    )

    type: Literal["cancel"] = "cancel"
    id: Annotated[str, Field(min_length=1, description="The job's key.")]


_REPLY = TypeAdapter(Annotated[Chunk | Result, Field(discriminator="type")])
_CANCEL = TypeAdapter(Cancel)


def decode_reply(body: bytes) -> Chunk | Result:
    """A reply body as a :class:`Chunk` or :class:`Result`; raises
    :class:`WireDecodeError` naming what is wrong."""
    try:
        return _REPLY.validate_json(body)
    except ValidationError as exc:
        raise WireDecodeError(f"not a jaxserve reply: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}") from None


def decode_cancel(body: bytes) -> Cancel:
    try:
        return _CANCEL.validate_json(body)
    except ValidationError as exc:
        raise WireDecodeError(f"not a cancel message: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}") from None
