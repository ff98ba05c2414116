"""The engine's public vocabulary besides what a request asks
(``jaxserve.sampling_params``) and how it is refused
(``jaxserve.request_error``): its service class, what comes out of a step,
and the one failure that ends the engine.

These types are shared by the engine (``jaxserve.engine``), the offline
``LLM`` API and the queue worker (``jaxserve.worker``), so they hold plain
Python values only and never a device array.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

from jaxserve.request_error import RequestError


class RequestClass(enum.IntEnum):
    """Service class. Lower value is served first; interactive beats batch."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str | int | RequestClass) -> RequestClass:
        if isinstance(value, RequestClass):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown request class {value!r}; expected 'interactive' or 'batch'") from None
        return cls(int(value))


FinishReason = Literal["stop", "length", "abort", "error"]


class EngineBroken(RuntimeError):
    """Raised by ``Engine.step`` when a failed step took the engine's device
    state with it (the donated KV cache buffers were deleted, or hold a
    failed computation), or when recovering from a failed step failed: no
    request can run on this engine any more, and the process must be
    restarted. Every later ``step`` raises it again.

    Defined here, with no JAX import, so the worker's engine thread can
    recognise it without loading the engine."""


@dataclasses.dataclass(frozen=True)
class PriorOutput:
    """Output a request produced before, on a run that ended without
    finishing it (a worker that died: ``Engine.add_request(prior=...)``).
    The new run computes these tokens as it computes its prompt, then goes
    on sampling from there as the first run would have: they count toward
    ``max_tokens``, stop strings, the penalties' history, a structured
    output's grammar and the seeded stream's position. ``logprobs`` and
    ``top_logprobs`` are theirs, for a request that asks for them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


@dataclasses.dataclass
class RequestOutput:
    """One request's progress after a step.

    ``new_token_ids``/``new_text`` are what this step added (the text delta is
    produced by an incremental detokenizer and never splits a UTF-8
    character). When ``finished`` is true, ``text``/``token_ids`` hold the
    whole completion (stop strings removed, EOS excluded).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None
    #: per completion token, its ``top_logprobs`` most likely alternatives as
    #: ``(token id, logprob)``, most likely first (``SamplingParams.top_logprobs``)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: what this step added to ``logprobs`` and ``top_logprobs`` (one entry per
    #: new token id), for a request that asks for them
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    #: label scoring (``Engine.add_score_request``): each label's summed token
    #: log-probabilities, in the labels' order
    label_logprobs: list[float] | None = None
    error: RequestError | None = None
    # Wall-clock timestamps (time.monotonic) for metrics: arrival, first
    # scheduled, first token, finished.
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
