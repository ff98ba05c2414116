"""What one model step needs to know to read and write the paged KV cache.

The runner builds one of these per step on the host (numpy), then it travels
into the jitted step as a pytree of device arrays. Every field has a fixed
shape for a given shape bucket, so nothing here forces a recompilation.

Layout of a step (vLLM v1 style, no prefill/decode modes): a flat batch of
``T`` tokens from ``S`` sequences. Token ``t`` belongs to sequence
``token_seq[t]``, sits at absolute position ``positions[t]`` of that
sequence, and its new key/value is written to cache slot ``slot_mapping[t]``
(``block_id * block_size + offset``). Padding tokens write to slots inside
block 0, the null block, which nobody ever reads as valid context.

Sequence ``s`` owns the blocks ``block_tables[s, :]`` (padded with 0) and,
after this step's writes, has ``context_lens[s]`` valid tokens. A token
attends to the keys of its own sequence at positions ``<= positions[t]``.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device-side description of one flat step over the paged cache.

    Shapes (``T`` token bucket, ``S`` sequence bucket, ``M`` max blocks per
    sequence):

    - ``slot_mapping``  int32 [T]   cache slot each token's K/V goes to
    - ``token_seq``     int32 [T]   row of ``block_tables`` each token belongs to
    - ``block_tables``  int32 [S, M] physical block ids, 0-padded
    - ``context_lens``  int32 [S]   valid tokens per sequence after this step
    - ``logits_indices`` int32 [S]  which token row of the step to sample for
      each sequence (its last scheduled token); padding rows point at 0

    Optional, for the block-major decode attention (see ``paged_attention``;
    absent, only the gathering kernel is compiled):

    - ``block_owner`` int32 [num_blocks]  the row of ``block_tables`` holding
      each physical block this step, or the padding row (``S``) for none
    - ``block_index`` int32 [num_blocks]  that block's index in its row's table
    - ``block_major`` bool []  run this step block-major: the host sets it
      only when every row has exactly one token, no block is in two rows,
      and enough of the cache is in use for a pass over all of it to beat
      gathering the rows' blocks

    Optional, for models with LongRoPE (Phi-3) only:

    - ``long_rope_from`` int32 [S]  a token at a position at or past its
      row's value rotates with the long factors; absent, the model decides
      from ``context_lens`` (``jaxserve.models.rope.long_rope_tokens``)

    ``positions`` travel separately (the model needs them for RoPE too).
    """

    slot_mapping: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    logits_indices: jax.Array
    block_owner: jax.Array | None = None
    block_index: jax.Array | None = None
    block_major: jax.Array | None = None
    long_rope_from: jax.Array | None = None
