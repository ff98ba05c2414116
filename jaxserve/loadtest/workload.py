"""What a load test sends: job kinds, their mix and their length distributions.

A workload is a weighted mix of job *kinds*. The default has two:

``chat``
    Short interactive chat: one user message of a few words, on the
    interactive queue, streamed, 16-32 new tokens.
``summarize``
    Long summarization: a raw prompt of a few hundred words, on the batch
    queue, not streamed, 64-128 new tokens.

Lengths are drawn uniformly (integers, both ends included) from each kind's
ranges with one seeded ``numpy.random.Generator``, so a run is reproducible.
Prompt lengths are in *words* (the load generator has no tokenizer); the
tokens they become are what the worker reports in each result's
``usage.prompt_tokens``, and the report gives those. Words are taken from the
preset corpus (``models/corpus.txt``, English prose, what the ``tiny``
preset's tokenizer was trained on) at a random offset.

Every job body carries ``"cache": false`` so the worker's response cache
never answers a load-test job instead of the model.

Cancellation: a share of all jobs (``cancel_share``, default 5 %) is marked
to be cancelled after its first streamed chunk. Only streaming jobs can be
cancelled that way, so the marks go to streaming jobs at the rate
``cancel_share / streaming share`` (at most every one of them); they are
spread evenly (error diffusion: the n-th streaming job is marked when
``floor(n * rate)`` steps up), not at random, so a short run still gets its
share.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

#: Used when the preset corpus cannot be found (an unusual install).
_FALLBACK_WORDS = (
    "the river ran fast under the old stone bridge while people walked their dogs along the bank and a baker "
    "pulled the first loaves of bread out of the oven the smell drifted down the street and children stopped "
    "to look through the window on their way to school"
).split()


def corpus_words() -> list[str]:
    """Words of the preset corpus (``models/corpus.txt``)."""
    try:
        from jaxserve.presets import presets_dir

        words = (Path(presets_dir()) / "corpus.txt").read_text(encoding="utf-8").split()
    except (OSError, ImportError):
        words = []
    return words or list(_FALLBACK_WORDS)


@dataclasses.dataclass(frozen=True)
class IntRange:
    """Integers ``lo..hi``, both included (``"16-32"`` or ``"24"``)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.lo < 1 or self.hi < self.lo:
            raise ValueError(f"a range needs 1 <= low <= high, got {self.lo}-{self.hi}")

    @classmethod
    def parse(cls, text: str | int | IntRange) -> IntRange:
        if isinstance(text, IntRange):
            return text
        if isinstance(text, int):
            return cls(text, text)
        raw = str(text).strip()
        lo, sep, hi = raw.partition("-")
        try:
            return cls(int(lo), int(hi) if sep else int(lo))
        except ValueError:
            raise ValueError(f"expected N or LOW-HIGH (positive integers), got {text!r}") from None

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.lo, self.hi, endpoint=True))

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}" if self.hi != self.lo else str(self.lo)


@dataclasses.dataclass(frozen=True)
class JobKind:
    """One kind of job in the mix."""

    name: str
    queue: str  # "interactive" or "batch"
    stream: bool
    chat: bool  # a user message (chat template) instead of a raw prompt
    prompt_words: IntRange
    max_tokens: IntRange
    instruction: str = ""  # text put before the words


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job to send."""

    index: int
    kind: str
    queue: str
    stream: bool
    body: dict[str, Any]
    prompt_words: int
    max_tokens: int
    cancel: bool


def parse_mix(text: str) -> dict[str, float]:
    """``"chat=0.8,summarize=0.2"`` -> weights normalised to sum 1."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"--mix expects NAME=WEIGHT pairs, got {part!r}") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mix weight of {name!r} must be a finite number >= 0, got {value!r}")
        out[name.strip()] = out.get(name.strip(), 0.0) + weight
    total = sum(out.values())
    if not out or total <= 0:
        raise ValueError(f"--mix needs at least one kind with a positive weight, got {text!r}")
    return {k: v / total for k, v in out.items() if v > 0}


def default_kinds(
    *,
    chat_prompt_words: IntRange | str = "3-12",
    chat_max_tokens: IntRange | str = "16-32",
    summary_prompt_words: IntRange | str = "150-300",
    summary_max_tokens: IntRange | str = "64-128",
    summary_stream: bool = False,
) -> dict[str, JobKind]:
    return {
        "chat": JobKind(
            "chat", "interactive", True, True, IntRange.parse(chat_prompt_words), IntRange.parse(chat_max_tokens)
        ),
        "summarize": JobKind(
            "summarize",
            "batch",
            summary_stream,
            False,
            IntRange.parse(summary_prompt_words),
            IntRange.parse(summary_max_tokens),
            instruction="Summarize the following text in a few sentences.\n\n",
        ),
    }


class Workload:
    """A thread-safe, seeded source of :class:`JobSpec`."""

    def __init__(
        self,
        kinds: dict[str, JobKind],
        mix: dict[str, float],
        *,
        seed: int = 0,
        cancel_share: float = 0.05,
        extra_params: dict[str, Any] | None = None,
        words: list[str] | None = None,
    ) -> None:
        unknown = sorted(set(mix) - set(kinds))
        if unknown:
            raise ValueError(f"--mix names unknown job kinds {unknown}; known: {sorted(kinds)}")
        if not 0.0 <= cancel_share <= 1.0:
            raise ValueError(f"cancel share must be in [0, 1], got {cancel_share}")
        self.kinds = kinds
        self.names = list(mix)
        self.weights = np.array([mix[n] for n in self.names], dtype=float)
        self.weights /= self.weights.sum()
        self.cancel_share = cancel_share
        streaming = float(sum(w for n, w in zip(self.names, self.weights) if kinds[n].stream))
        #: probability that a streaming job is marked for cancellation
        self.stream_cancel_rate = min(1.0, cancel_share / streaming) if streaming > 0 else 0.0
        self.extra_params = {k: v for k, v in (extra_params or {}).items() if v is not None}
        self.words = words or corpus_words()
        self.rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._count = 0
        self._streamed = 0

    def describe(self) -> dict[str, Any]:
        return {
            "mix": {n: round(float(w), 6) for n, w in zip(self.names, self.weights)},
            "kinds": {
                n: {
                    "queue": k.queue,
                    "stream": k.stream,
                    "chat": k.chat,
                    "prompt_words": str(k.prompt_words),
                    "max_tokens": str(k.max_tokens),
                }
                for n, k in self.kinds.items()
                if n in self.names
            },
            "cancel_share": self.cancel_share,
            "stream_cancel_rate": round(self.stream_cancel_rate, 6),
            "params": self.extra_params,
        }

    def _text(self, n_words: int) -> str:
        start = int(self.rng.integers(0, len(self.words)))
        picked = [self.words[(start + i) % len(self.words)] for i in range(n_words)]
        return " ".join(picked)

    def next(self) -> JobSpec:
        with self._lock:
            index = self._count
            self._count += 1
            name = self.names[int(self.rng.choice(len(self.names), p=self.weights))]
            kind = self.kinds[name]
            n_words = kind.prompt_words.draw(self.rng)
            max_tokens = kind.max_tokens.draw(self.rng)
            text = kind.instruction + self._text(n_words)
            cancel = False
            if kind.stream:
                self._streamed += 1
                n = self._streamed
                cancel = math.floor(n * self.stream_cancel_rate + 1e-9) > math.floor(
                    (n - 1) * self.stream_cancel_rate + 1e-9
                )
        body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if kind.chat else {"prompt": text}
        body.update(self.extra_params)
        body["max_tokens"] = max_tokens
        body["cache"] = False
        # "stream": true is added by the client's stream() for streaming kinds
        return JobSpec(index, name, kind.queue, kind.stream, body, n_words, max_tokens, cancel)

    def probe(self, index: int) -> JobSpec:
        """A short job of the first streaming kind in the mix (else the first
        kind): its shortest prompt and fewest tokens, never cancelled. The
        capacity check after each level sends a few at once."""
        name = next((n for n in self.names if self.kinds[n].stream), self.names[0])
        kind = self.kinds[name]
        n_words = kind.prompt_words.lo
        text = kind.instruction + " ".join(self.words[(index + i) % len(self.words)] for i in range(n_words))
        body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if kind.chat else {"prompt": text}
        body.update(self.extra_params)
        body["max_tokens"] = kind.max_tokens.lo
        body["cache"] = False
        return JobSpec(index, name, kind.queue, kind.stream, body, n_words, kind.max_tokens.lo, False)
