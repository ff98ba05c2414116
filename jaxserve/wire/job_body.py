"""The job's JSON body: its pydantic model and the ranges it declares.

:class:`JobBody` (OpenAI completions / chat completions names) is what a
producer publishes and the source of ``queues/schemas/job.schema.json``
(:mod:`jaxserve.wire.schemas`). Turning a validated body into an engine
request, with the checks that span fields or need the delivery's properties,
is :mod:`jaxserve.wire.job`'s: the two change for different reasons (a new
field vs a new rule), so they live apart.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import INT32_MAX, MAX_SPECULATIVE_TOKENS, SEED_MAX, SEED_MIN

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
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
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = Field(
        default=None,
        description="Speculative decoding for this job: at most this many guessed tokens per engine step, 0 "
        "for none (absent: the worker's --num-speculative-tokens). Changes how fast the output comes, never "
        "the output.",
    )
