"""A job as it arrives: the body's model, and the single translation of a
delivery into an engine request.

Every range check of the contract lives here, so a value that could break
the engine (a seed outside 64 bits, a top_k beyond the vocabulary, a NaN)
is refused at the door with ``invalid_request`` naming the field and the
value, and never reaches a batch shared with other jobs. Ranges follow
OpenAI where OpenAI defines the field (temperature 0-2, top_p in (0, 1],
penalties -2..2, seed a 64-bit integer); the rest are documented in
``docs/protocol.md``.

:class:`JobBody` is also the source of ``queues/schemas/job.schema.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import reprlib
import time
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxserve.engine.types import RequestError, SamplingParams, StructuredOutput

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
PRIORITY_MAX = 255  # AMQP's priority property is an octet
MIN_LABELS, MAX_LABELS = 2, 64
MAX_LABEL_CHARS = 256
MAX_FEW_SHOT = 32  # as jaxserve.tokenizer.labels.MAX_FEW_SHOT
MAX_FEW_SHOT_CHARS = 8192
MAX_FALLBACK_MODELS = 4  # a job is re-routed once, to the first that has room: a long list buys nothing
MAX_MODEL_NAME_CHARS = 243  # "interactive.<model>" must fit AMQP's 255-byte routing key
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FewShotExample(BaseModel):
    model_config = _STRICT
    text: Annotated[str, Field(min_length=1, max_length=MAX_FEW_SHOT_CHARS)] = Field(
        description="A worked example's input: a user turn (chat) or a prompt (plain), filled like the job's own."
    )
    label: Annotated[str, Field(min_length=1, max_length=MAX_LABEL_CHARS)] = Field(
        description="Its answer: one of the job's labels."
    )


class ChatMessage(BaseModel):
    # Extra keys (``name`` ...) are kept for the chat template.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: str
    content: str | list[TextPart] = Field(description="A string, or OpenAI content parts of type text.")


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="The JSON Schema the output follows (absent: any JSON object)."
    )
    strict: bool | None = Field(default=None, description="Accepted; the schema is always enforced token by token.")


class Degrade(BaseModel):
    """The degraded answer a job accepts instead of ``overloaded``."""

    model_config = _STRICT
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] = Field(
        description="Run with this smaller completion limit when the full one cannot start in budget."
    )


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


#: body fields of OpenAI's APIs that jaxserve cannot honour, with the value
#: that is harmless (absent, null or this value is accepted; anything else is
#: invalid_request rather than silently dropped)
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "parallel_tool_calls": None,
    "logit_bias": {},
    "echo": False,
    "suffix": None,
    "best_of": 1,
    "audio": None,
    "modalities": ["text"],
    "prediction": None,
    "web_search_options": None,
    "guided_json": None,
    "guided_decoding_backend": None,
}
#: at most this many most likely alternatives per token (OpenAI's limit)
MAX_TOP_LOGPROBS = 20


class JobBody(BaseModel):
    """The JSON body of a job (OpenAI completions / chat completions names)."""

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        allow_inf_nan=False,
        title="jaxserve job (message body)",
        json_schema_extra={
            "description": "Body of a job published to <prefix>.interactive or <prefix>.batch through the default "
            "exchange, or, when it names a model, to the direct exchange <prefix>.models with routing key "
            "<class>.<model> and mandatory (an unroutable job is unknown_model). AMQP properties: message_id (required, the idempotency key), correlation_id (echoed on "
            "every reply), reply_to (default <prefix>.results; never one of the worker's own queues or exchanges), "
            "expiration (ms string), priority (0-255, higher first), content_type application/json. Field names "
            "and meanings follow OpenAI's completions/chat completions API. Unknown fields are ignored; fields of "
            "OpenAI's API that jaxserve cannot honour (tools, tool_choice, functions, logit_bias, echo, suffix, "
            "best_of > 1, n > 1, audio, ...) are invalid_request.",
            "oneOf": [
                {"required": ["prompt"], "not": {"required": ["messages"]}},
                {"required": ["messages"], "not": {"required": ["prompt"]}},
            ],
        },
    )

    prompt: str | None = Field(default=None, description="Raw prompt text.")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        default=None, description="Chat messages, rendered with the model's chat template (add_generation_prompt)."
    )
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = Field(
        default=None, description="Completion length limit (default 16); prompt + max_tokens must fit max_model_len."
    )
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = Field(
        default=None, description="OpenAI's newer name; wins over max_tokens."
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = Field(
        default=None, description="0 is greedy (default 1)."
    )
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = Field(
        default=None, description="0 disables top-k; at most the model's vocabulary size."
    )
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = Field(
        default=None,
        description="A 64-bit integer; makes sampling reproducible. Without one the worker derives the seed "
        "from the job's key, so a recomputed job reproduces its text.",
    )
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)]
        | None
    ) = None
    stream: bool | None = Field(default=None, description="Send chunk messages before the final result.")
    n: Literal[1] | None = Field(default=None, description="Only 1: one completion per job.")
    model: str | None = Field(
        default=None,
        description="The model to run the job: routes it to that model's queues (docs/protocol.md, Routing by "
        "model); absent: the deployment's default model. A model nobody serves is unknown_model.",
    )
    fallback_models: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)]],
            Field(min_length=1, max_length=MAX_FALLBACK_MODELS),
        ]
        | None
    ) = Field(
        default=None,
        description="Up to 4 distinct other models, in order: when the job's model cannot start it within its "
        "budget (what would be answered overloaded), the job is re-routed once to the first that has room; the "
        "result's served_model names the model that answered. Not the job's own model.",
    )
    degrade: Degrade | None = Field(
        default=None,
        description="A degraded answer the job accepts instead of overloaded: {max_tokens: N}, N smaller than the "
        "job's max_tokens. The result's degraded lists what was degraded.",
    )
    tenant: Annotated[str, Field(max_length=256)] | None = Field(default=None, description="Opaque tenant id, logged.")
    deadline: float | None = Field(
        default=None,
        description="Unix time (seconds): not started after it (expired); with the AMQP expiration the earlier "
        "wins. Once a job has produced its first token its deadline no longer applies.",
    )
    priority: Annotated[int, Field(ge=0, le=PRIORITY_MAX)] | None = Field(
        default=None, description="0-255, higher runs earlier within its queue; wins over the AMQP priority."
    )
    labels: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_LABEL_CHARS)]],
            Field(min_length=MIN_LABELS, max_length=MAX_LABELS),
        ]
        | None
    ) = Field(
        default=None,
        description="Label scoring instead of generation: 2-64 distinct candidate continuations of the prompt; "
        "each is scored by the sum of its tokens' log-probabilities and the result names the most probable.",
    )
    label_normalization: Literal["sum", "mean", "first"] | None = Field(
        default=None,
        description="'sum' (default), 'mean' (divide each label's logprob by its token count before the softmax) or "
        "'first' (each label's first token alone; labels must start with different tokens).",
    )
    label_prompt: Literal["plain", "chat"] | None = Field(
        default=None,
        description="With labels: 'plain' scores each label as a continuation of the prompt text; 'chat' renders the "
        "prompt (as one user message) or the messages with the model's chat template and scores each label as the "
        "assistant's answer. Default: 'chat' for messages, 'plain' for a prompt. Labels are tokenized together with "
        "the text they follow.",
    )
    calibrate: bool | None = Field(
        default=None,
        description="With labels: subtract each label's score on a content-free input (calibration_input in place of "
        "the prompt or the last user message) before the softmax; computed once per label set and form, and cached.",
    )
    calibration_input: Annotated[str, Field(max_length=MAX_FEW_SHOT_CHARS)] | None = Field(
        default=None, description="With calibrate: the content-free input (default 'N/A')."
    )
    few_shot: Annotated[list[FewShotExample], Field(min_length=1, max_length=MAX_FEW_SHOT)] | None = Field(
        default=None,
        description="With labels: worked examples put before the job's own input (chat: a user and an assistant turn "
        "each; plain: text + label blocks); every label one of the job's labels.",
    )
    cache: bool | None = Field(
        default=None,
        description="false: never answer this job from the response cache (deterministic jobs are cached by default).",
    )
    response_format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")] | None = (
        Field(
            default=None,
            description="OpenAI's: {type: text}, {type: json_object} (any JSON object) or {type: json_schema, "
            "json_schema: {name, schema, strict}}; the output is constrained token by token to follow it.",
        )
    )
    guided_regex: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="The output matches this regular expression (vLLM's name)."
    )
    guided_choice: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_LABELS * 4)] | None
    ) = Field(default=None, description="The output is exactly one of these strings (vLLM's name).")
    guided_grammar: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="The output follows this Lark grammar (llguidance's Lark dialect)."
    )
    logprobs: bool | Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        default=None,
        description="true: the result carries each completion token's log-probability (OpenAI's chat shape). An "
        "integer n (OpenAI completions' form): the same with the n most likely alternatives per token.",
    )
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        default=None, description="0-20 most likely alternatives per token; needs logprobs true."
    )


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
    fallback_models: tuple[str, ...] = ()  # in order; () keeps today's behaviour (issue 28)
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
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"body is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _bad(f"body must be a JSON object, got {type(data).__name__}")
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
