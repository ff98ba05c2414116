"""A step's work packed into the host arrays the runner's programs take.

:class:`SeqWork` is what the engine hands the runner for each sequence of a
step (``jaxserve.engine.step_inputs`` builds them from a plan);
:func:`pack_step` flattens a step of them into the token batch, its
attention metadata and the rows the sampling and scoring programs read;
:func:`block_major_plan` decides whether the pure-JAX attention reads the
cache block-major. All of it is numpy on the host, no device work, so it is
apart from :mod:`jaxserve.engine.runner`, which compiles and launches the
programs; both change for different reasons (a new input vs a new program).
``tests/test_engine.py`` (block-major steps included) and
``tests/test_matvec_cpu.py`` (``SeqWork`` straight to the runner) run both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.engine.buckets import Buckets
from jaxserve.engine.sampler import SamplingRow


@dataclasses.dataclass
class SeqWork:
    """One sequence's share of a step.

    ``token_ids`` are the tokens computed this step, starting at absolute
    position ``start_pos``; ``block_ids`` is the sequence's whole block table
    (it must already cover ``start_pos + len(token_ids)`` slots). When
    ``sampling`` is set the step samples the token after the last one, with
    that row's parameters (``sampler.SamplingRow``). With ``draft_rows``
    (speculative decoding: the chunk ends with that many guessed tokens),
    the step samples after each of the chunk's last ``1 + len(draft_rows)``
    tokens: ``sampling`` at the first of them, ``draft_rows[i]`` after
    guess ``i``.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]
    sampling: SamplingRow | None = None
    #: the first token is still on the device: row ``pending_row`` of the
    #: ``prev_tokens`` given to ``execute`` (the previous step's tokens)
    pending_row: int | None = None
    #: label scoring: the log-probability of ``score_targets[j]`` is wanted
    #: at each of the chunk's last ``len(score_targets)`` tokens (teacher forcing)
    score_targets: Sequence[int] = ()
    #: longrope models: this sequence's first position that rotates with the
    #: long factors (``AttentionMetadata.long_rope_from``; the engine sends 0
    #: or past every position); None: 0 when the sequence holds more than
    #: the original context after the step, else the original context
    #: (transformers' choice for one forward call)
    long_rope_from: int | None = None
    #: speculative decoding: the sampling rows after each guessed token
    draft_rows: Sequence[SamplingRow] = ()


@dataclasses.dataclass
class StepArrays:
    """One step on the host, padded to its token bucket ``t_bucket``.

    Padding tokens (past ``num_tokens``) write into block 0 and belong to the
    extra last row (``max_num_seqs``), whose context is empty: they attend to
    nothing. ``feed[i]`` is the row of the previous step's tokens that token
    ``i`` reads on the device, -1 for none. ``logits_indices`` picks the
    sampling rows' last tokens, then the score rows."""

    num_tokens: int
    t_bucket: int
    rows: int
    counts: np.ndarray  # tokens per sequence
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    token_seq: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    feed: np.ndarray
    has_pending: bool  # some token reads the previous step's (``SeqWork.pending_row``)
    sampling_rows: list[SamplingRow]
    score_targets: list[int]
    num_score_rows: int
    logits_indices: np.ndarray
    #: per row, the first long-factor position (longrope models only)
    long_rope_from: np.ndarray | None = None


def pack_step(
    work: Sequence[SeqWork],
    buckets: Buckets,
    *,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    block_size: int,
    long_rope_original: int | None = None,
    max_logits_rows: int | None = None,
) -> StepArrays:
    """Flatten ``work`` into :class:`StepArrays`; ValueError for a step the
    programs cannot take (no token, too many sequences or rows, a block
    table too short for its tokens). ``long_rope_original``: a longrope
    model's original context (``long_rope_from`` is filled then).
    ``max_logits_rows``: the sampling and score rows the programs take
    (``max_num_seqs`` unless speculative decoding's guesses add some)."""
    num_tokens = sum(len(w.token_ids) for w in work)
    if num_tokens == 0:
        raise ValueError("a step needs at least one token")
    if len(work) > max_num_seqs:
        raise ValueError(f"a step of {len(work)} sequences exceeds max_num_seqs={max_num_seqs}")
    t_bucket = buckets.token_bucket(num_tokens)
    bs = block_size
    rows = len(work)
    counts = np.fromiter((len(w.token_ids) for w in work), np.int32, rows)
    starts = np.fromiter((w.start_pos for w in work), np.int32, rows)
    ends = np.cumsum(counts)
    ctx = starts + counts
    block_tables = np.zeros((max_num_seqs + 1, max_blocks_per_seq), np.int32)
    for row, w in enumerate(work):
        block_tables[row, : len(w.block_ids)] = w.block_ids
    num_blocks = np.fromiter((len(w.block_ids) for w in work), np.int32, rows)
    short = np.flatnonzero(num_blocks * bs < ctx)
    if short.size:
        row = int(short[0])
        raise ValueError(f"sequence {row} has {num_blocks[row]} blocks for {ctx[row]} tokens (block size {bs})")
    input_ids = np.zeros(t_bucket, np.int32)
    input_ids[:num_tokens] = [t for w in work for t in w.token_ids]
    token_row = np.repeat(np.arange(rows, dtype=np.int32), counts)
    positions = np.zeros(t_bucket, np.int32)
    positions[:num_tokens] = np.arange(num_tokens, dtype=np.int32) - np.repeat(ends - counts - starts, counts)
    slot_mapping = np.zeros(t_bucket, np.int32)
    pos = positions[:num_tokens]
    slot_mapping[:num_tokens] = block_tables[token_row, pos // bs] * bs + pos % bs
    token_seq = np.full(t_bucket, max_num_seqs, np.int32)
    token_seq[:num_tokens] = token_row
    context_lens = np.zeros(max_num_seqs + 1, np.int32)
    context_lens[:rows] = ctx
    feed = np.full(t_bucket, -1, np.int32)
    pending = [(int(e - c), w.pending_row) for w, e, c in zip(work, ends, counts) if w.pending_row is not None]
    if pending:
        at, src = zip(*pending)
        feed[list(at)] = src
    sampling_rows = [row for w in work if w.sampling is not None for row in (w.sampling, *w.draft_rows)]
    # a chunk with guesses samples after its last known token and after each guess
    logits_rows = [
        int(e) - 1 - len(w.draft_rows) + j
        for w, e in zip(work, ends)
        if w.sampling is not None
        for j in range(1 + len(w.draft_rows))
    ]
    # Score rows follow the sampling rows: each scoring chunk's last tokens.
    score_rows = [int(e) - len(w.score_targets) + j for w, e in zip(work, ends) for j in range(len(w.score_targets))]
    rows_cap = max_num_seqs if max_logits_rows is None else max_logits_rows
    if len(logits_rows) + len(score_rows) > rows_cap:
        raise ValueError(
            f"a step of {len(logits_rows)} sampling and {len(score_rows)} score rows exceeds the {rows_cap} "
            f"logits rows the programs take"
        )
    logits_indices = np.zeros(rows_cap, np.int32)
    logits_indices[: len(logits_rows)] = logits_rows
    logits_indices[len(logits_rows) : len(logits_rows) + len(score_rows)] = score_rows
    long_rope_from = None
    if long_rope_original is not None:
        long_rope_from = np.full(max_num_seqs + 1, long_rope_original, np.int32)
        for row, (w, n) in enumerate(zip(work, ctx)):
            default = 0 if n > long_rope_original else long_rope_original
            long_rope_from[row] = default if w.long_rope_from is None else w.long_rope_from
    return StepArrays(
        num_tokens=num_tokens,
        t_bucket=t_bucket,
        rows=rows,
        counts=counts,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        token_seq=token_seq,
        block_tables=block_tables,
        context_lens=context_lens,
        feed=feed,
        has_pending=bool(pending),
        sampling_rows=sampling_rows,
        score_targets=[t for w in work for t in w.score_targets],
        num_score_rows=len(score_rows),
        logits_indices=logits_indices,
        long_rope_from=long_rope_from,
    )


def block_major_plan(
    step: StepArrays, *, num_blocks: int, max_num_seqs: int, min_use: float, enabled: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Who owns which block this step, and whether attention runs block-major.

    Block-major attention (``paged_attention``) reads every block of the
    cache once instead of gathering each sequence's blocks: it wins when the
    step's sequences hold at least ``min_use`` of the usable cache, and it
    needs one token per sequence and no block shared by two sequences
    (prefix caching shares blocks). Kernels other than the pure-JAX one never
    run it: for them (``enabled`` false) every step gets the same empty plan.
    """
    owner = np.full(num_blocks, max_num_seqs, np.int32)  # the padding row
    index = np.zeros(num_blocks, np.int32)
    if not enabled:
        return owner, index, np.asarray(False)
    table = step.block_tables[: step.rows]
    row, col = np.nonzero(table > 0)
    blocks = table[row, col]
    owner[blocks] = row
    index[blocks] = col
    major = (
        bool(np.all(step.counts == 1))
        and blocks.size >= min_use * (num_blocks - 1)
        and np.unique(blocks).size == blocks.size
    )
    return owner, index, np.asarray(major)
