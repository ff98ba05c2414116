"""Label scoring arithmetic (host side, pure Python).

A label's score is the sum of its tokens' log-probabilities as a
continuation of the prompt; ``mean`` normalization divides it by the label's
token count first (so long labels are not penalised for their length), and
``prob`` is a softmax over the labels' scores. The engine computes the
per-token log-probabilities; this module only combines them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

NORMALIZATIONS = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class ScoredLabel:
    label: str
    logprob: float
    prob: float
    num_tokens: int


def combine(
    labels: Sequence[str],
    logprobs: Sequence[float],
    token_counts: Sequence[int],
    normalization: str = "sum",
) -> list[ScoredLabel]:
    """Each label's (normalized) logprob and its softmax probability, in the
    labels' order."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"label_normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if not (len(labels) == len(logprobs) == len(token_counts)):
        raise ValueError(f"{len(labels)} labels, {len(logprobs)} logprobs and {len(token_counts)} token counts")
    scores = [lp / n if normalization == "mean" else lp for lp, n in zip(logprobs, token_counts)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [
        ScoredLabel(label, float(score), w / total, int(n))
        for label, score, w, n in zip(labels, scores, weights, token_counts)
    ]


def best(scored: Sequence[ScoredLabel]) -> ScoredLabel:
    """The most probable label; the first one on a tie."""
    i = max(range(len(scored)), key=lambda j: (scored[j].logprob, -j))
    return scored[i]
