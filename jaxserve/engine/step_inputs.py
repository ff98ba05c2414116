"""A plan's rows as the runner takes them: one ``SeqWork`` per scheduled
request, with its sampling row.

The scheduler's plan says which tokens to compute; the runner also needs
each sampling request's :class:`~jaxserve.engine.sampler.SamplingRow` (its
``SamplingParams`` as they are, how many tokens it has generated, the
penalties' history, a structured-output mask). Built on the host right
before the launch (``Engine.launch``); the masks of a step's constrained
rows are computed together (``StructuredBackend.fill_masks``).

Speculative decoding: a row that carries guessed tokens samples after each
of them too, as the row would after that many more output tokens
(:func:`draft_rows`: the draw's index, the penalties' history and the
grammar's mask move on by the guesses before it), so whatever the model
samples there is what decoding without guesses samples once those tokens
are its output. Tests: ``tests/test_engine_params.py``,
``tests/test_structured.py``, ``tests/test_speculative.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxserve.engine.request import PENDING_TOKEN, Request
from jaxserve.engine.sampler import SamplingRow
from jaxserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.engine.step_arrays import SeqWork
from jaxserve.engine.structured import Constraint, StructuredBackend


def sampling_row(req: Request, mask: np.ndarray | None = None) -> SamplingRow:
    """The sampler's row for ``req``'s next token (``mask``: its
    structured-output mask, from :func:`grammar_masks`). The penalties'
    history is handed over only when a penalty is active."""
    p = req.sampling_params
    if p.has_penalties:
        return SamplingRow(p, req.num_output_tokens, req.all_token_ids, req.num_prompt_tokens, mask)
    return SamplingRow(p, req.num_output_tokens, mask=mask)


def draft_rows(req: Request, drafts: Sequence[int], masks: np.ndarray | None = None) -> list[SamplingRow]:
    """The sampler's rows after each of ``req``'s guessed tokens ``drafts``
    (``masks[i]``: the grammar's mask after guess ``i``, from
    :func:`grammar_masks`): row ``i`` is :func:`sampling_row`'s as it will be
    once ``drafts[: i + 1]`` are output."""
    p = req.sampling_params
    rows = []
    for i in range(1, len(drafts) + 1):
        mask = None if masks is None else masks[i - 1]
        if p.has_penalties:
            history = [*req.all_token_ids, *drafts[:i]]
            rows.append(SamplingRow(p, req.num_output_tokens + i, history, req.num_prompt_tokens, mask))
        else:
            rows.append(SamplingRow(p, req.num_output_tokens + i, mask=mask))
    return rows


def grammar_masks(
    backend: StructuredBackend,
    plan: SchedulerOutput,
    requests: Mapping[str, Request],
    constraints: Mapping[str, Constraint],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The grammar's masks of the plan's constrained sampling rows, by
    request: each row's token mask (``StructuredBackend.fill_masks``,
    computed together), and for the rows carrying guessed tokens the masks
    after each guess, ``[len(draft_token_ids), words]``
    (``StructuredBackend.fill_draft_masks``). One function, as a row with
    guesses is one of the constrained sampling rows."""
    rows = [s for s in plan.scheduled if s.sample and s.request_id in constraints]
    if not rows:
        return {}, {}
    items = [(constraints[s.request_id], requests[s.request_id].output_token_ids) for s in rows]
    masks = dict(zip([s.request_id for s in rows], backend.fill_masks(items)))
    guessing = [s for s in rows if s.draft_token_ids]
    if not guessing:
        return masks, {}
    draft_items = [
        (constraints[s.request_id], requests[s.request_id].output_token_ids, s.draft_token_ids) for s in guessing
    ]
    return masks, dict(zip([s.request_id for s in guessing], backend.fill_draft_masks(draft_items)))


def seq_work(
    s: ScheduledRequest, sampling: SamplingRow | None, prev: tuple[jax.Array, dict[str, int]] | None
) -> SeqWork:
    """One scheduled request's work. ``prev``: the in-flight step's device
    tokens and each sampling request's row in them; a request planned with
    a pending token (overlapped steps) reads its token from that row."""
    pending_row = None
    if PENDING_TOKEN in s.token_ids:
        if prev is None or s.num_scheduled_tokens != 1:
            raise RuntimeError(f"request {s.request_id!r} was planned with a pending token out of place")
        pending_row = prev[1][s.request_id]
    return SeqWork(
        token_ids=s.token_ids,
        start_pos=s.start_position,
        block_ids=s.block_ids,
        sampling=sampling,
        pending_row=pending_row,
        score_targets=s.score_targets,
    )
