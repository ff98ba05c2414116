"""What a request asks of generation: :class:`SamplingParams`, the one typed
object that goes from the wire (``jaxserve.wire.job.parse_job``) or the
offline ``LLM`` through the engine to the sampler
(``jaxserve.engine.sampler``), and :class:`StructuredOutput`, its
constraint on the output.

Plain Python values only, no device array and no import of the engine or
the wire, so both can use it; ``validate`` range-checks every field that
reaches a device array (``tests/test_engine_params.py``). Adding a
sampling knob: docs/architecture.md, "Where to look".
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from jaxserve.request_error import RequestError

#: Largest value an int32 device array holds (``max_tokens``, ``top_k``).
INT32_MAX = 2**31 - 1
#: ``seed`` may be any signed or unsigned 64-bit integer; the engine folds it
#: into the sampler's uint32 (``jaxserve.engine.sampler.sampler_seed``).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
#: float32's largest finite value and smallest positive normal value.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
#: most guessed tokens a request may ask for per step (speculative decoding;
#: the engine's ``num_speculative_tokens`` caps it further)
MAX_SPECULATIVE_TOKENS = 64
_COLLECTIONS = (list, tuple, set, frozenset)


#: kinds of structured output (``StructuredOutput.kind``)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token
    (``jaxserve.engine.structured``).

    ``kind`` is one of :data:`STRUCTURED_KINDS`; ``value`` is the JSON
    Schema as canonical JSON text (``json_schema``), ``""`` (``json_object``:
    any JSON object), a regular expression (``regex``), the candidate strings
    (``choice``) or a Lark grammar (``grammar``). Plain, hashable values: the
    engine caches one compiled grammar per distinct constraint.
    """

    kind: str
    value: str | tuple[str, ...] = ""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(
                "invalid_request", f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if self.kind == "choice":
            if (
                not isinstance(self.value, tuple)
                or not self.value
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                raise RequestError(
                    "invalid_request",
                    f"guided_choice must be a non-empty list of non-empty strings, got {self.value!r}",
                )
        elif not isinstance(self.value, str):
            raise RequestError("invalid_request", f"structured output {self.kind} needs a string, got {self.value!r}")


@dataclasses.dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI names and meanings).

    ``temperature == 0`` means greedy. ``top_k == 0`` disables top-k.
    ``seed`` makes sampling reproducible whatever else shares the batch; any
    integer in ``[-2**63, 2**64 - 1]`` is accepted (see
    ``jaxserve.engine.sampler.sampler_seed`` for how it reaches the device).
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
    #: how many most likely alternatives to report per token (0-20, OpenAI's);
    #: with ``logprobs``
    top_logprobs: int = 0
    #: constrain the output (JSON Schema, regex, choice, grammar); None: free text
    structured: StructuredOutput | None = None
    #: speculative decoding for this request: at most this many guessed tokens
    #: per step (0: none); None: the engine's ``num_speculative_tokens``. It
    #: changes how fast the output comes, never the output
    #: (``jaxserve.engine.speculative``)
    num_speculative_tokens: int | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition/frequency/presence penalty is active."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        """Raise ``RequestError('invalid_request', ...)`` naming the bad field
        and value.

        Every field that reaches a device array is range- and
        finiteness-checked here, so that filling a step's arrays can never
        fail because of one request (an out-of-range value would raise while
        the whole batch's arrays are built, failing every request of the
        step). The limits that depend on the model (``top_k`` and
        ``stop_token_ids`` against the vocabulary) are checked by
        ``Engine.add_request``.
        """

        def bad(msg: str) -> RequestError:
            return RequestError("invalid_request", msg)

        def integer(name: str, lo: int, hi: int) -> None:
            value = getattr(self, name)
            if not _is_int(value):
                raise bad(f"{name} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                raise bad(f"{name} must be in [{lo}, {hi}], got {value!r}")

        def real(name: str) -> float:
            # Finite, and within float32's range (a larger magnitude would
            # become inf in the device arrays).
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise bad(f"{name} must be a number, got {value!r}")
            try:
                as_float = float(value)
            except (OverflowError, ValueError):
                as_float = math.inf
            if not math.isfinite(as_float) or abs(as_float) > FLOAT32_MAX:
                raise bad(f"{name} must be a finite number (within float32's range), got {value!r}")
            return as_float

        integer("max_tokens", 1, INT32_MAX)
        if not 0.0 <= real("temperature") <= 100.0:
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < real("top_p") <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        integer("top_k", 0, INT32_MAX)
        if not 0.0 <= real("min_p") <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            integer("seed", SEED_MIN, SEED_MAX)
        # Logits are divided by it: it must stay > 0 once rounded to float32.
        if not real("repetition_penalty") >= FLOAT32_TINY:
            raise bad(
                f"repetition_penalty must be > 0 (at least {FLOAT32_TINY:.3g}, float32's smallest normal number), "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = real(name)
            if not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, _COLLECTIONS) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, _COLLECTIONS) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise bad(f"stop_token_ids must be a list of non-negative integer token ids, got {ids!r}")
        for name in ("logprobs", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {getattr(self, name)!r}")
        integer("top_logprobs", 0, 20)
        if self.num_speculative_tokens is not None:
            integer("num_speculative_tokens", 0, MAX_SPECULATIVE_TOKENS)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad(f"structured must be a StructuredOutput, got {self.structured!r}")
            self.structured.validate()
            if self.ignore_eos:
                raise bad("ignore_eos cannot be combined with structured output (the grammar ends with EOS)")


def _is_int(value: object) -> bool:
    """A Python or numpy integer, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
