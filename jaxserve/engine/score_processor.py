"""Label scoring in the engine: a scoring job's requests, its score rows,
its one output.

A job (``Engine.add_score_request``) scores each label, token ids, as a
continuation of the prompt, by the sum of its tokens' log-probabilities.
The prompt but its last token is prefilled once by a prefill-only parent;
then one fork per label continues it, sharing its KV blocks through the
block table (a copy of the partial last block each), and computes the
prompt's last token and the label's tokens but the last, every one a score
row whose logits give the next label token's probability. So the job
computes ``len(prompt) - 1 + sum(len(label))`` tokens whatever the number of
labels, and its results do not depend on what else is in the batch
(``tests/test_engine_scoring.py``).

The scheduler side (parking the parent, starting forks) is
:mod:`jaxserve.engine.forks`; the arithmetic over the finished
log-probabilities (normalization, softmax, calibration) is
:mod:`jaxserve.engine.scoring`. This module keeps the job's books: which
request belongs to which job, the score rows collected so far, and the
job's output once every label is complete; a member's failure fails the
job.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.output_processor import OutputState
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.types import RequestClass, RequestOutput

#: at most this many labels per scoring request (the wire allows 64)
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

MAX_SCORE_LABELS = 256


@dataclasses.dataclass
class ScoreGroup:
    """A label-scoring request: its forks (one per label, in order), their
    score rows' log-probabilities by position, and the prompt + label tokens
    it reports."""

    request_id: str
    children: list[str]
    label_lengths: list[int]
    prompt_tokens: int
    scores: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(len(self.scores.get(c, ())) == n for c, n in zip(self.children, self.label_lengths))

    def output(self, metrics: dict[str, float]) -> RequestOutput:
        now = time.monotonic()
        metrics.setdefault("first_token", now)
        metrics["finished"] = now
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="stop",
            prompt_tokens=self.prompt_tokens,
            completion_tokens=0,
            label_logprobs=[sum(self.scores[c].values()) for c in self.children],
            metrics=metrics,
        )


class ScoreProcessor:
    """The engine's scoring jobs, by public id, and each member request's
    job (the parent has the public id itself).

    ``states`` and ``metrics`` are the engine's per-request dicts (shared,
    not copied); ``forget`` drops every engine record of a request."""

    def __init__(
        self,
        scheduler: Scheduler,
        states: dict[str, OutputState],
        metrics: dict[str, dict[str, float]],
        forget: Callable[[str], None],
    ) -> None:
        self.scheduler = scheduler
        self._states = states
        self._metrics = metrics
        self._forget = forget
        self.groups: dict[str, ScoreGroup] = {}
        self.group_of: dict[str, str] = {}
        self._outputs: list[RequestOutput] = []  # finished jobs, for the next processed step

    def is_member(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of a job's requests (its outputs
        are the job's, never the caller's)."""
        return request_id in self.group_of

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        label_ids: list[list[int]],
        *,
        vocab_size: int,
        max_model_len: int,
        request_class: RequestClass | str,
        priority: int,
        deadline: float | None,
        cache_salt: object,
    ) -> list[Request]:
        """Check a job, queue its requests with the scheduler and return them
        (the parent first, when the prompt has more than one token).
        Raises ``RequestError`` when it can never run."""
        if not prompt_ids:
            raise RequestError("invalid_request", f"request {request_id!r} has an empty prompt")
        if not 1 <= len(label_ids) <= MAX_SCORE_LABELS or any(not ids for ids in label_ids):
            raise RequestError("invalid_request", f"give 1 to {MAX_SCORE_LABELS} labels of at least one token each")
        bad = [t for t in prompt_ids + [t for ids in label_ids for t in ids] if not 0 <= t < vocab_size]
        if bad:
            raise RequestError("invalid_request", f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        longest = max(len(ids) for ids in label_ids)
        if len(prompt_ids) + longest > max_model_len:
            raise RequestError(
                "context_length_exceeded",
                f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and the longest label {longest}",
            )
        if deadline is not None and deadline <= time.monotonic():
            raise RequestError("expired", f"request {request_id!r} expired before admission")
        if request_id in self.groups or self.scheduler.get_request(request_id) is not None:
            raise RequestError("invalid_request", f"duplicate request id {request_id!r}: it is still in progress")
        greedy1 = SamplingParams(max_tokens=1, temperature=0.0)
        kw: dict[str, Any] = dict(request_class=request_class, priority=priority, cache_salt=cache_salt)
        n_prompt = len(prompt_ids)
        children = []
        for i, ids in enumerate(label_ids):
            child = Request(f"{request_id}\x1flabel{i}", prompt_ids + ids[:-1], greedy1, **kw)
            child.score_from = n_prompt - 1
            child.score_targets = list(ids)
            children.append(child)
        group = ScoreGroup(
            request_id,
            [c.request_id for c in children],
            [len(ids) for ids in label_ids],
            n_prompt + sum(len(ids) for ids in label_ids),
        )
        if n_prompt > 1:
            parent = Request(request_id, prompt_ids[:-1], greedy1, deadline=deadline, **kw)
            parent.prefill_only = True
            parent.fork_children = children
            self.scheduler.add_request(parent)
            members = [parent, *children]
        else:  # nothing to share: the forks start from scratch
            for child in children:
                self.scheduler.add_request(child)
            members = children
        for req in members:
            self.group_of[req.request_id] = request_id
        self.groups[request_id] = group
        return members

    def abort(self, request_id: str) -> bool:
        """Abort the job ``request_id``; False when it is no job's id."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        self._end(group)
        return True

    def record(self, plan: SchedulerOutput, scores: np.ndarray) -> None:
        """Apply a collected step's score rows, and finish the jobs whose
        every label is complete (their outputs wait for ``take_outputs``)."""
        at = 0
        for s in plan.scheduled:
            n = len(s.score_targets)
            if not n:
                if s.request_id in self.groups:
                    parent = self.scheduler.get_request(s.request_id)
                    if parent is not None and parent.status == RequestStatus.PARKED:
                        # its forks take over; a recovery must not recompute it
                        self._states.pop(s.request_id, None)
                continue
            values = scores[at : at + n]
            at += n
            gid = self.group_of.get(s.request_id)
            group = self.groups.get(gid) if gid is not None else None
            if group is None:
                continue
            first = s.start_position + s.num_scheduled_tokens - n
            got = group.scores.setdefault(s.request_id, {})
            for j, value in enumerate(values):
                got[first + j] = float(value)  # by position: a recomputation overwrites
            if self.scheduler.get_request(s.request_id) is None:  # all its rows computed
                self._forget(s.request_id)
        for group in [g for g in self.groups.values() if g.complete]:
            out = group.output(self._metrics.get(group.request_id, {}))
            self._end(group)
            self._outputs.append(out)

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs of the jobs finished since the last call."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def route(self, outputs: Sequence[RequestOutput]) -> list[RequestOutput]:
        """Outputs of a job's member requests become the job's: a member's
        failure fails the job (the rest is aborted); its other outputs are
        dropped."""
        routed = []
        for out in outputs:
            gid = self.group_of.get(out.request_id)
            if gid is None:
                routed.append(out)
                continue
            group = self.groups.get(gid)
            if group is None or not out.finished:
                continue
            self._end(group)
            routed.append(dataclasses.replace(out, request_id=gid, prompt_tokens=group.prompt_tokens))
        return routed

    def _end(self, group: ScoreGroup) -> None:
        """Abort whatever of a job is still running and forget it."""
        self.scheduler.abort(group.request_id)  # the parent, with its unstarted forks
        for rid in group.children:
            self.scheduler.abort(rid)
        for rid in (group.request_id, *group.children):
            self._forget(rid)
            self.group_of.pop(rid, None)
        self.groups.pop(group.request_id, None)
        self._metrics.pop(group.request_id, None)
