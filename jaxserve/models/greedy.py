"""Single-sequence greedy decoding over the paged path (interim generator and parity oracle).

The sequence owns blocks ``1..M`` of a private cache (block 0 is the null
block); the prompt is prefilled in one step (padded to a power-of-two token
bucket, padding written into block 0), then one token per step. Shapes are
bucketed (prompt tokens and block-table width to powers of two), so repeated
calls reuse compilations through ``jaxserve.models.functional.jit_step``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models.functional import jit_step


def _pow2(n: int, lo: int = 1) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def greedy_generate(
    loaded,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
    *,
    block_size: int = 16,
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (new tokens only; a hit eos token is
    included and ends generation). ``loaded`` is a ``LoadedModel`` or a model."""
    model = getattr(loaded, "model", loaded)
    cfg = model.config
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens <= 0:
        return []
    eos = {int(e) for e in eos_token_ids}
    n = len(prompt)
    total = n + max_new_tokens
    M = _pow2(-(-total // block_size))
    graphdef, state = nnx.split(model)
    cache = KVCache.create(cfg.num_hidden_layers, M + 1, block_size, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    table = np.arange(1, M + 1, dtype=np.int32)[None, :]

    def slots(pos: np.ndarray) -> np.ndarray:
        return (table[0, pos // block_size] * block_size + pos % block_size).astype(np.int32)

    # prefill
    T = _pow2(n, 16)
    ids = np.zeros(T, np.int32)
    ids[:n] = prompt
    pos = np.zeros(T, np.int32)
    pos[:n] = np.arange(n)
    slot = np.arange(T, dtype=np.int32) % block_size  # padding -> null block 0
    slot[:n] = slots(np.arange(n))
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slot),
        token_seq=jnp.zeros(T, jnp.int32),
        block_tables=jnp.asarray(table),
        context_lens=jnp.asarray([n], jnp.int32),
        logits_indices=jnp.asarray([n - 1], jnp.int32),
    )
    logits, cache = jit_step(graphdef, state, jnp.asarray(ids), jnp.asarray(pos), cache, meta)
    out = [int(jnp.argmax(logits[0]))]
    table_d = jnp.asarray(table)
    zero = jnp.zeros(1, jnp.int32)
    while len(out) < max_new_tokens and out[-1] not in eos:
        p = n + len(out) - 1  # position of the token being fed
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slots(np.array([p]))),
            token_seq=zero,
            block_tables=table_d,
            context_lens=jnp.asarray([p + 1], jnp.int32),
            logits_indices=zero,
        )
        logits, cache = jit_step(
            graphdef, state, jnp.asarray([out[-1]], jnp.int32), jnp.asarray([p], jnp.int32), cache, meta
        )
        out.append(int(jnp.argmax(logits[0])))
    return out
