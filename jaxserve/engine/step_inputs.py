"""A plan's rows as the runner takes them: one ``SeqWork`` per scheduled
request, with its sampling row.

The scheduler's plan says which tokens to compute; the runner also needs
each sampling request's parameters (temperature, seed folded for the
sampler, penalties' history, a structured-output mask). Built on the host
right before the launch (``Engine._launch``); the masks of a step's
constrained rows are computed together (``StructuredBackend.fill_masks``).
Tests: ``tests/test_engine_params.py``, ``tests/test_structured.py``.
"""

from __future__ import annotations

from typing import Any, cast

import jax

from jaxserve.engine.plan import ScheduledRequest
from jaxserve.engine.request import PENDING_TOKEN, Request
from jaxserve.engine.sampler import sampler_seed
from jaxserve.engine.step_arrays import SeqWork
from jaxserve.engine.structured import Constraint, StructuredBackend


def sampling_row(req: Request, constraint: Constraint | None) -> dict:
    """The sampler's parameters for ``req``'s next token."""
    p = req.sampling_params
    row: dict[str, Any] = {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "seed": sampler_seed(cast(int, p.seed)),  # add_request gave it one
        "output_index": req.num_output_tokens,
        "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "logprobs": p.logprobs,
        "top_logprobs": p.top_logprobs if p.logprobs else 0,
    }
    if constraint is not None:
        row["constraint"] = (constraint, req.output_token_ids)  # its mask: fill_masks, the step's rows at once
    if p.has_penalties:
        row["history"] = req.all_token_ids
        row["num_prompt"] = req.num_prompt_tokens
    return row


def seq_work(s: ScheduledRequest, sampling: dict | None, prev: tuple[jax.Array, dict[str, int]] | None) -> SeqWork:
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


def fill_masks(backend: StructuredBackend, work: list[SeqWork]) -> None:
    """Structured output: the token masks of a step's constrained rows,
    computed together (``StructuredBackend.fill_masks``)."""
    rows = [w.sampling for w in work if w.sampling is not None and "constraint" in w.sampling]
    if not rows:
        return
    masks = backend.fill_masks([row.pop("constraint") for row in rows])
    for row, mask in zip(rows, masks):
        row["mask"] = mask
