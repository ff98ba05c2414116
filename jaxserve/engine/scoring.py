"""Label scoring arithmetic (host side, pure Python).

A label's score is the sum of its tokens' log-probabilities as a
continuation of the prompt; ``mean`` normalization divides it by the label's
token count first (so long labels are not penalised for their length);
``first`` keeps the first token's alone (the worker cuts each label to that
token, so its sum is already that; see :mod:`jaxserve.tokenizer.labels`).
``prob`` is a softmax over the labels' scores. With calibration the softmax
is over each label's score minus its score on a content-free input (the
``offsets``), which removes the model's prior preference for some labels;
``logprob`` stays the label's own (normalized) log-probability on the
document. The engine computes the per-token log-probabilities; this module
only combines them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

NORMALIZATIONS = ("sum", "mean", "first")


@dataclasses.dataclass(frozen=True)
class ScoredLabel:
    label: str
    logprob: float
    prob: float
    num_tokens: int
    #: what the softmax ranked: ``logprob`` minus the calibration offset
    score: float | None = None

    @property
    def rank_score(self) -> float:
        return self.logprob if self.score is None else self.score


def normalize(logprobs: Sequence[float], token_counts: Sequence[int], normalization: str = "sum") -> list[float]:
    """Each label's summed log-probability under ``normalization``."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"label_normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if len(logprobs) != len(token_counts):
        raise ValueError(f"{len(logprobs)} logprobs and {len(token_counts)} token counts")
    return [float(lp) / n if normalization == "mean" else float(lp) for lp, n in zip(logprobs, token_counts)]


def combine(
    labels: Sequence[str],
    logprobs: Sequence[float],
    token_counts: Sequence[int],
    normalization: str = "sum",
    offsets: Sequence[float] | None = None,
) -> list[ScoredLabel]:
    """Each label's (normalized) logprob and its softmax probability, in the
    labels' order. ``offsets`` (already normalized, one per label): the
    calibration subtracted before the softmax."""
    if not (len(labels) == len(logprobs) == len(token_counts)):
        raise ValueError(f"{len(labels)} labels, {len(logprobs)} logprobs and {len(token_counts)} token counts")
    values = normalize(logprobs, token_counts, normalization)
    if offsets is not None and len(offsets) != len(labels):
        raise ValueError(f"{len(labels)} labels but {len(offsets)} calibration offsets")
    scores = values if offsets is None else [v - float(o) for v, o in zip(values, offsets)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [
        ScoredLabel(label, value, w / total, int(n), None if offsets is None else score)
        for label, value, score, w, n in zip(labels, values, scores, weights, token_counts)
    ]


def best(scored: Sequence[ScoredLabel]) -> ScoredLabel:
    """The most probable label; the first one on a tie."""
    i = max(range(len(scored)), key=lambda j: (scored[j].rank_score, -j))
    return scored[i]
