"""Hand-built forward steps over a paged cache, for the model-level kernel tests.

:func:`paged_step` lays sequences (a start position and a token count each)
out on shuffled blocks, flat and padded as the runner would: padding tokens
belong to the empty last row and write into the null block.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.attention_metadata import AttentionMetadata


def paged_step(
    vocab: int,
    starts: list[int],
    counts: list[int],
    *,
    tokens: int,
    block: int,
    num_blocks: int,
    table_width: int,
    seed: int,
    logits_rows: int = 8,
):
    """``(input_ids, positions, meta)`` of a ``tokens``-token step: sequence
    ``s`` computes positions ``starts[s] .. starts[s] + counts[s] - 1`` (its
    cached prefix is whatever the cache holds below), on blocks drawn at
    random from ``1 .. num_blocks - 1``."""
    rng = np.random.default_rng(seed)
    n = len(starts)
    tables = np.zeros((n + 1, table_width), np.int32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    for s, (start, count) in enumerate(zip(starts, counts)):
        need = -(-(start + count) // block)
        tables[s, :need] = [free.pop(0) for _ in range(need)]
    ids, pos = np.zeros(tokens, np.int32), np.zeros(tokens, np.int32)
    seq = np.full(tokens, n, np.int32)  # padding: the empty last row
    slot = np.arange(tokens, dtype=np.int32) % block  # padding writes into the null block
    at = 0
    for s, (start, count) in enumerate(zip(starts, counts)):
        p = np.arange(start, start + count)
        ids[at : at + count] = rng.integers(3, vocab, count)
        pos[at : at + count], seq[at : at + count] = p, s
        slot[at : at + count] = tables[s, p // block] * block + p % block
        at += count
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slot),
        token_seq=jnp.asarray(seq),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray([a + b for a, b in zip(starts, counts)] + [0], jnp.int32),
        logits_indices=jnp.zeros(logits_rows, jnp.int32),
    )
    return jnp.asarray(ids), jnp.asarray(pos), meta
