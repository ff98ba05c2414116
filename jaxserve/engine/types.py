"""The engine's public vocabulary: what goes in with a request and what comes out.

These types are shared by the engine (``jaxserve.engine``), the offline
``LLM`` API and the queue worker (``jaxserve.worker``), so they hold plain
Python values only and never a device array.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal, Sequence


class RequestClass(enum.IntEnum):
    """Service class. Lower value is served first; interactive beats batch."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: "str | int | RequestClass") -> "RequestClass":
        if isinstance(value, RequestClass):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown request class {value!r}; expected 'interactive' or 'batch'") from None
        return cls(int(value))


FinishReason = Literal["stop", "length", "abort", "error"]


class RequestError(Exception):
    """A request the engine refuses. ``code`` is one of the public error codes
    of the queue contract (``invalid_request``, ``context_length_exceeded``,
    ``overloaded``, ...), so the worker can forward it unchanged."""

    def __init__(self, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclasses.dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI names and meanings).

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k.
    ``seed`` makes sampling reproducible whatever else shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition/frequency/presence penalty is active."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        """Raise ``RequestError('invalid_request', ...)`` naming the bad value."""

        def bad(msg: str) -> RequestError:
            return RequestError("invalid_request", msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise bad(f"top_k must be an integer, got {self.top_k!r}")
        if not (0.0 <= float(self.min_p) <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if float(self.repetition_penalty) <= 0.0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = float(getattr(self, name))
            if not (-2.0 <= value <= 2.0):
                raise bad(f"{name} must be in [-2, 2], got {value!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")


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
    error: RequestError | None = None
    # Wall-clock timestamps (time.monotonic) for metrics: arrival, first
    # scheduled, first token, finished.
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
