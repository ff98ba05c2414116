"""A step between its launch and its outputs: launched (:class:`InFlight`),
its tokens held by the scheduler as placeholders (:class:`Pending`,
overlapped steps only), and collected (:class:`Collected`).

``Engine.launch`` makes an ``InFlight``, ``Engine.collect`` turns it into a
``Collected`` and ``Engine.process`` a ``Collected`` into outputs; the step
modes (:mod:`jaxserve.engine.step_modes`) hand these from one part to the
next, and ``Engine.step`` keeps the one step still in flight between calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import jax
import numpy as np

from jaxserve.engine.request import Request
from jaxserve.engine.runner import StepResult
from jaxserve.engine.scheduler_output import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens were not collected yet."""

    plan: SchedulerOutput
    result: StepResult

    @property
    def sampling_ids(self) -> list[str]:
        """The requests that sample a token in this step, in the order of the
        step's sampled rows."""
        return [s.request_id for s in self.plan.scheduled if s.sample]

    @property
    def drafted(self) -> bool:
        """Some row of it carried guessed tokens (speculative decoding): its
        sampled rows are more than its sampling requests."""
        return any(s.draft_token_ids for s in self.plan.scheduled)

    @property
    def feedable(self) -> bool:
        """Its tokens stay on the device, where the next step can read them
        (``StepResult.feedable``: an all-greedy step)."""
        return self.result.feedable

    def feed(self) -> tuple[jax.Array, dict[str, int]]:
        """Its device tokens and each sampling request's row in them, for a
        step planned with those tokens still pending."""
        tokens = cast(jax.Array, self.result.tokens)  # feedable: still on the device
        return tokens, {rid: i for i, rid in enumerate(self.sampling_ids)}


@dataclasses.dataclass(frozen=True)
class Pending:
    """An overlapped step's tokens as the scheduler holds them before they
    are fetched: a placeholder in each sampling request (``requests``, kept
    here since a request finished by length leaves the scheduler), and the
    requests that finished by length."""

    requests: dict[str, Request | None]
    finished_by_length: set[str]

    def resolve(self, sampled: dict[str, int]) -> None:
        """Fill the placeholders in with the fetched tokens."""
        for request_id, token in sampled.items():
            req = self.requests[request_id]
            if req is not None and req.pending_index is not None:
                req.resolve_pending(token)


@dataclasses.dataclass(frozen=True)
class Collected:
    """A collected step: each sampling request's token and its
    log-probability, and the requests the scheduler finished by length.

    A request that carried guessed tokens (speculative decoding) got a run
    of tokens: ``runs`` holds it whole with ``run_logprobs``, and
    ``sampled`` its last token (a stop token, when it ends on one)."""

    sampled: dict[str, int]
    logprobs: dict[str, float]
    finished_by_length: set[str]
    runs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    run_logprobs: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def tokens(self, request_id: str) -> list[int]:
        """The request's new tokens, in order."""
        return self.runs.get(request_id) or [self.sampled[request_id]]

    def token_logprobs(self, request_id: str) -> list[float]:
        """Their log-probabilities."""
        return self.run_logprobs.get(request_id) or [self.logprobs[request_id]]

    def split(self, first: Callable[[str], bool]) -> tuple[Collected, Collected]:
        """The tokens of the requests ``first`` picks, and the rest."""
        picked = {rid: token for rid, token in self.sampled.items() if first(rid)}
        rest = {rid: token for rid, token in self.sampled.items() if rid not in picked}
        return (
            dataclasses.replace(self, sampled=picked),
            dataclasses.replace(self, sampled=rest),
        )


def by_request(
    request_ids: list[str], tokens: np.ndarray, logprobs: np.ndarray
) -> tuple[dict[str, int], dict[str, float]]:
    """A step's sampled tokens and log-probabilities keyed by request, in
    the order the plan's sampling requests were given (``tolist`` makes the
    Python numbers in one call: ``int()`` per numpy scalar took ~5% of the
    engine thread's samples in a 64-sequence offline run, py-spy)."""
    sampled = dict(zip(request_ids, np.asarray(tokens).tolist()))
    return sampled, dict(zip(request_ids, np.asarray(logprobs).tolist()))
