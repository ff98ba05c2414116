"""A job as it arrives: the single translation of a delivery into an engine
request.

Every range check of the contract lives here or in the body's model
(:mod:`jaxserve.wire.job_body`), so a value that could break the engine (a
seed outside 64 bits, a top_k beyond the vocabulary, a NaN) is refused at
the door with ``invalid_request`` naming the field and the value, and never
reaches a batch shared with other jobs. Ranges follow OpenAI where OpenAI
defines the field (temperature 0-2, top_p in (0, 1], penalties -2..2, seed a
64-bit integer); the rest are documented in ``docs/protocol.md``.

``JobBody`` is re-exported here, so ``jaxserve.wire.job.JobBody`` keeps
working.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import reprlib
import time
from typing import Any

import orjson
from pydantic import ValidationError

from jaxserve.json_files import loads_object
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams, StructuredOutput
from jaxserve.wire.job_body import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    DIRECT_REPLY_TO,
    PRIORITY_MAX,
    UNSUPPORTED_FIELDS,
    JobBody,
    JsonObjectFormat,
    JsonSchemaFormat,
)

# The public names; DEFAULT_MAX_BODY_BYTES, DIRECT_REPLY_TO and JobBody are
# the body module's, re-exported (jaxserve.wire, the worker and the schemas).
__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DIRECT_REPLY_TO",
    "Job",
    "JobBody",
    "JobLimits",
    "JobProperties",
    "check_reply_to",
    "derive_seed",
    "fingerprint",
    "parse_expiration",
    "parse_job",
]


@dataclasses.dataclass(frozen=True)
class JobProperties:
    """The AMQP properties of a delivery that the contract reads."""

    message_id: Any = None
    reply_to: Any = None
    correlation_id: Any = None
    content_type: Any = None
    expiration: Any = None
    published_at: float | None = None  # header x-published-at-ms, else timestamp (epoch seconds)
    priority: Any = None


@dataclasses.dataclass(frozen=True)
class JobLimits:
    """What the serving side adds to the ranges: the body size limit and
    the engine's vocabulary and context length (None: unknown)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    vocab_size: int | None = None
    max_model_len: int | None = None


@dataclasses.dataclass
class Job:
    """A validated job, ready for the engine."""

    key: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    model: str | None
    tenant: str | None
    deadline: float | None  # epoch seconds
    priority: int  # 0-255, higher first (the wire's sense)
    body_bytes: int
    fingerprint: str  # identifies the job's effect; a key reused with another one is refused
    seed_given: bool
    labels: tuple[str, ...] | None = None
    label_normalization: str = "sum"
    use_cache: bool = True
    label_prompt: str = "plain"
    calibrate: bool = False
    calibration_input: str = "N/A"
    few_shot: tuple[tuple[str, str], ...] = ()  # (text, label)
    fallback_models: tuple[str, ...] = ()  # in order; (): no fallback
    degrade_max_tokens: int | None = None  # the smaller limit the job accepts instead of overloaded

    @property
    def deterministic(self) -> bool:
        """Same inputs, same result: greedy, seeded, or label scoring. Only
        these may be answered from the response cache or deduplicated."""
        return self.labels is not None or self.params.temperature == 0.0 or self.seed_given

    @property
    def engine_priority(self) -> int:
        """The engine's scheduler serves the *lower* value first (as vLLM)."""
        return -self.priority


def _bad(message: str) -> RequestError:
    return RequestError("invalid_request", message)


_REPR = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 6, 6


def _show(value: Any, limit: int = 80) -> str:
    """A bounded repr of an offending value: shallow (reprlib), so a value
    nested thousands deep cannot blow the recursion limit, and short."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - an error message must never fail
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _path(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'content', 'str')`` -> ``messages[0].content``: the
    union member tags pydantic adds (``str``, ``list[...]``) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _FIELD.match(part) and part not in ("str", "int", "float", "bool", "list"):
            out += f".{part}" if out else part
    return out or "body"


def _explain(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    # The deepest location names the most specific problem (for unions).
    err = max(errors, key=lambda e: len(e["loc"]))
    return f"{_path(tuple(err['loc']))}: {err['msg']} (got {_show(err.get('input'))})"


def derive_seed(key: str) -> int:
    """The sampling seed of a job that gives none: a 64-bit hash of its key.
    A job run again (redelivered after a crash) reproduces its text, and
    different jobs, in any process, draw different seeds."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def fingerprint(body: JobBody, max_tokens: int) -> str:
    """What determines a job's result, hashed: a key seen again with another
    fingerprint is a reused key, not a redelivery."""
    fields = body.model_dump(
        include={
            "prompt",
            "messages",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "frequency_penalty",
            "presence_penalty",
            "stop",
            "model",
            "labels",
            "label_normalization",
            "response_format",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "logprobs",
            "top_logprobs",
            "label_prompt",
            "calibrate",
            "calibration_input",
            "few_shot",
        },
        exclude_none=True,
        by_alias=True,
    )
    fields["max_tokens"] = max_tokens
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def check_reply_to(reply_to: Any, reserved: frozenset[str]) -> None:
    """Refuse a ``reply_to`` that names one of the worker's own queues or
    exchanges (``Topology.reserved_names``)."""
    if reply_to is None or reply_to == "":
        return
    if not isinstance(reply_to, str):
        raise _bad(f"reply_to must be a UTF-8 queue name, got {_show(reply_to)}")
    if reply_to in reserved or _is_model_queue(reply_to, reserved):
        raise _bad(
            f"reply_to {reply_to!r} names one of the worker's own queues or exchanges; use a reply queue of your own"
        )


def _is_model_queue(name: str, reserved: frozenset[str]) -> bool:
    """``<prefix>.interactive.<model>`` and ``<prefix>.batch.<model>``: other
    models' job queues (``Topology.model_queue``), known from the default
    model's queue names among ``reserved``."""
    return any(r.endswith((".interactive", ".batch")) and name.startswith(r + ".") for r in reserved)


def parse_expiration(value: Any) -> float | None:
    """AMQP ``expiration`` -> seconds. On the wire it is a string of
    milliseconds; aio-pika hands it over already decoded to float seconds."""
    if value is None or value == "":
        return None
    try:
        if hasattr(value, "total_seconds"):
            seconds = float(value.total_seconds())
        elif isinstance(value, (str, bytes)):
            seconds = float(value) / 1000.0
        else:
            seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def parse_job(
    body: bytes,
    props: JobProperties,
    limits: JobLimits = JobLimits(),
    *,
    received_at: float | None = None,
) -> Job:
    """Validate one delivery and translate it into engine terms. Raises
    :class:`RequestError` (``invalid_request``) naming the field and value."""
    now = time.time() if received_at is None else received_at
    key = props.message_id
    if not isinstance(key, str) or not key:
        raise _bad("message_id (the AMQP property, the job's idempotency key) is required and must be UTF-8 text")
    if len(body) > limits.max_body_bytes:
        raise _bad(f"body is {len(body)} bytes; the limit is {limits.max_body_bytes}")
    ctype = props.content_type
    if ctype not in (None, "") and (
        not isinstance(ctype, str) or ctype.split(";")[0].strip().lower() != "application/json"
    ):
        raise _bad(f"content_type must be application/json, got {_show(ctype)}")
    data = loads_object(body, _bad, "body is not valid UTF-8 JSON: {}", "body must be a JSON object, got {}")
    _refuse_unsupported(data)
    try:
        job_body = JobBody.model_validate(data)
    except ValidationError as exc:
        raise _bad(_explain(exc)) from None
    except RecursionError:
        raise _bad("body is nested too deeply") from None
    return _translate(job_body, key, props, limits, now, len(body))


def _translate(body: JobBody, key: str, props: JobProperties, limits: JobLimits, now: float, size: int) -> Job:
    if (body.prompt is None) == (body.messages is None):
        raise _bad("exactly one of 'prompt' (string) and 'messages' (chat list) is required")
    if body.labels is not None and len(set(body.labels)) != len(body.labels):
        dup = next(x for x in body.labels if body.labels.count(x) > 1)
        raise _bad(f"labels must be distinct, got {dup!r} twice")
    _check_label_fields(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    mt_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    _check_degradation(body, max_tokens, mt_name)
    if limits.max_model_len is not None and max_tokens > limits.max_model_len:
        raise _bad(f"{mt_name} {max_tokens} exceeds max_model_len {limits.max_model_len}")
    top_k = body.top_k or 0
    if limits.vocab_size is not None and top_k > limits.vocab_size:
        raise _bad(f"top_k must be in [0, {limits.vocab_size}] (the vocabulary size), got {top_k}")
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed
    if seed is None and temperature > 0.0:
        seed = derive_seed(key)
    stop_given = body.stop or ()
    stop = (stop_given,) if isinstance(stop_given, str) else tuple(stop_given)
    structured = _structured(body)
    want_logprobs, top_logprobs = _logprobs(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=seed,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        stop=stop,
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
        structured=structured,
        num_speculative_tokens=body.num_speculative_tokens,
    )
    params.validate()
    messages = None
    if body.messages is not None:
        messages = []
        for m in body.messages:
            msg = m.model_dump()
            if not isinstance(m.content, str):
                msg["content"] = "".join(part.text for part in m.content)
            messages.append(msg)
    return Job(
        key=key,
        prompt=body.prompt,
        messages=messages,
        params=params,
        stream=bool(body.stream),
        model=body.model,
        tenant=body.tenant,
        deadline=_deadline(body, props, now),
        priority=_priority(body, props),
        body_bytes=size,
        fingerprint=fingerprint(body, max_tokens),
        seed_given=body.seed is not None,
        labels=None if body.labels is None else tuple(body.labels),
        label_normalization=body.label_normalization or "sum",
        use_cache=body.cache is not False,
        label_prompt=body.label_prompt or ("chat" if body.messages is not None else "plain"),  # as before the field
        calibrate=bool(body.calibrate),
        calibration_input="N/A" if body.calibration_input is None else body.calibration_input,
        few_shot=tuple((x.text, x.label) for x in body.few_shot or ()),
        fallback_models=tuple(body.fallback_models or ()),
        degrade_max_tokens=None if body.degrade is None else body.degrade.max_tokens,
    )


def _check_degradation(body: JobBody, max_tokens: int, mt_name: str) -> None:
    """``fallback_models``: distinct, none the job's own model (a re-route
    there would queue the job behind itself). ``degrade.max_tokens``: below
    the job's own limit, else it degrades nothing."""
    fallbacks = body.fallback_models or []
    for i, name in enumerate(fallbacks):
        if name in fallbacks[:i]:
            raise _bad(f"fallback_models must be distinct, got {name!r} twice")
        if body.model is not None and name == body.model:
            raise _bad(f"fallback_models[{i}] {name!r} is the job's own model; name other models")
    limit = None if body.degrade is None else body.degrade.max_tokens
    if limit is not None and limit >= max_tokens:
        raise _bad(f"degrade.max_tokens must be smaller than the job's {mt_name} {max_tokens}, got {limit}")


def _check_label_fields(body: JobBody) -> None:
    """The label-scoring options only mean something with ``labels``; a
    worked example must answer with one of them; the plain form continues a
    prompt, so messages need the chat form."""
    if body.labels is None:
        for name in (
            "label_prompt",
            "calibrate",
            "calibration_input",
            "few_shot",
        ):  # (label_normalization predates them: ignored)
            value = getattr(body, name)
            if value is not None:
                raise _bad(
                    f"{name} is for label scoring and needs labels, got {name}={_show(value if not isinstance(value, list) else '[...]')}"
                )
        return
    if body.label_prompt == "plain" and body.messages is not None:
        raise _bad("label_prompt 'plain' continues a prompt; a job with messages uses label_prompt 'chat'")
    if body.calibration_input is not None and not body.calibrate:
        raise _bad(f"calibration_input is used with calibrate: true, got calibrate={_show(body.calibrate)}")
    for i, shot in enumerate(body.few_shot or ()):
        if shot.label not in body.labels:
            raise _bad(f"few_shot[{i}].label {shot.label!r} is not one of the job's labels")


def _refuse_unsupported(data: dict[str, Any]) -> None:
    """A field of OpenAI's API that jaxserve cannot honour is refused, never
    dropped: the caller would otherwise get an answer to another question."""
    for name, harmless in UNSUPPORTED_FIELDS.items():
        if name in data and data[name] is not None and data[name] != harmless:
            raise _bad(f"{name} is not supported by jaxserve (got {_show(data[name])})")


def _structured(body: JobBody) -> StructuredOutput | None:
    """The job's output constraint: at most one of response_format (other
    than text), guided_regex, guided_choice and guided_grammar."""
    given = []
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        given.append(("response_format", StructuredOutput("json_object")))
    elif isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        if schema is None:
            spec = StructuredOutput("json_object")
        else:
            try:
                spec = StructuredOutput("json_schema", orjson.dumps(schema).decode())
            except (TypeError, orjson.JSONEncodeError) as exc:
                raise _bad(f"response_format.json_schema.schema cannot be encoded: {exc}") from None
        given.append(("response_format", spec))
    if body.guided_regex is not None:
        given.append(("guided_regex", StructuredOutput("regex", body.guided_regex)))
    if body.guided_choice is not None:
        given.append(("guided_choice", StructuredOutput("choice", tuple(body.guided_choice))))
    if body.guided_grammar is not None:
        given.append(("guided_grammar", StructuredOutput("grammar", body.guided_grammar)))
    if len(given) > 1:
        raise _bad(f"give at most one output constraint, got {', '.join(name for name, _ in given)}")
    if given and body.labels is not None:
        raise _bad(f"labels (label scoring) cannot be combined with {given[0][0]}")
    return given[0][1] if given else None


def _logprobs(body: JobBody) -> tuple[bool, int]:
    """(logprobs wanted, alternatives per token) from OpenAI's two forms:
    chat's ``logprobs: true, top_logprobs: n`` and completions' ``logprobs: n``."""
    lp, top = body.logprobs, body.top_logprobs
    if isinstance(lp, bool) or lp is None:
        if top is not None and top > 0 and not lp:
            raise _bad(f"top_logprobs {top} needs logprobs: true")
        wanted, n = bool(lp), (top or 0) if lp else 0
    else:
        if top is not None and top != lp:
            raise _bad(f"logprobs {lp} (an integer: that many alternatives) and top_logprobs {top} disagree")
        wanted, n = True, lp
    if wanted and body.labels is not None:
        raise _bad("logprobs cannot be combined with labels (the result's labels carry their logprobs)")
    return wanted, n


def _deadline(body: JobBody, props: JobProperties, now: float) -> float | None:
    deadline = None
    ttl = parse_expiration(props.expiration)
    if ttl is not None:
        start = now
        ts = props.published_at
        if ts is not None and math.isfinite(ts):
            start = min(ts, now)  # trust the producer's clock only when it is not in the future
        deadline = start + ttl
    if body.deadline is not None:
        deadline = body.deadline if deadline is None else min(deadline, body.deadline)
    return deadline


def _priority(body: JobBody, props: JobProperties) -> int:
    if body.priority is not None:
        return body.priority
    p = props.priority
    if isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= PRIORITY_MAX:
        return p
    return 0
