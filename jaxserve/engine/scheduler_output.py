"""What the scheduler hands out: a step's plan (:class:`SchedulerOutput`,
one :class:`ScheduledRequest` per request) and a snapshot for metrics
(:class:`SchedulerStats`), plain data.

The scheduler decides (host bookkeeping); the engine turns a
:class:`SchedulerOutput` into device work and runs it; neither reaches into
the other's state through these objects (vLLM v1's split, see
``jaxserve/engine/scheduler.py``). Named after vLLM's, and apart from
:mod:`jaxserve.planning`, which plans capacity, not steps.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ScheduledRequest:
    """One request's share of a step.

    Compute ``token_ids`` (``num_scheduled_tokens`` of them) at absolute
    positions ``start_position ..``; ``block_ids`` is the request's whole
    block table and covers every position up to the end of the chunk. When
    ``sample`` is set, the chunk reaches the end of the request's known
    tokens and the step must sample one token for it from the last row.
    ``is_new`` marks the first step after admission (fresh, or resumed after
    a preemption); then ``start_position > 0`` means a prefix-cache hit.

    Speculative decoding: ``draft_token_ids`` are guesses appended to a
    sampling chunk (they end ``token_ids``, past the request's known
    tokens); the step samples at the chunk's known last token and at each
    guess, and the request keeps the guesses that equal what was sampled
    (``Scheduler.update_from_output``).
    """

    request_id: str
    num_scheduled_tokens: int
    start_position: int
    token_ids: list[int]
    block_ids: list[int]
    sample: bool
    is_new: bool = False
    #: label scoring: the target tokens of the chunk's score rows, which are
    #: its last ``len(score_targets)`` tokens (see ``Request.score_from``)
    score_targets: list[int] = dataclasses.field(default_factory=list)
    #: speculative decoding: the guessed tokens at the end of ``token_ids``
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_logits_rows(self) -> int:
        """Rows of the step's logits this request needs: one to sample (and
        one more per guessed token), or one per score row."""
        return len(self.score_targets) + int(self.sample) + len(self.draft_token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """The plan for one step.

    ``scheduled``: the requests to compute, in scheduling order.
    ``total_num_scheduled_tokens``: sum of their ``num_scheduled_tokens``.
    ``preempted_req_ids``: requests that lost their blocks this step (the
    runner should drop any per-request state; they come back later with
    ``is_new`` set).
    ``finished_req_ids``: requests that finished, including aborted ones,
    since the previous plan; ``aborted_req_ids`` is the aborted subset.
    """

    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    aborted_req_ids: list[str]
    step: int
    #: (source, destination) block copies to make before this step's
    #: forward: each fork's copy of its parent's partial last block
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def get(self, request_id: str) -> ScheduledRequest | None:
        for s in self.scheduled:
            if s.request_id == request_id:
                return s
        return None


@dataclasses.dataclass
class SchedulerStats:
    """A snapshot for metrics. Counters are cumulative since start; prefix
    cache queries/hits count tokens (as vLLM's metrics do)."""

    num_running: int
    num_waiting: int
    num_waiting_interactive: int
    num_waiting_batch: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    #: speculative decoding (as vLLM's spec_decode counters): steps' rows that
    #: carried guesses, the guessed tokens, and those the model kept
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
