"""Pure-function views of an NNX model, for ``jax.jit`` with donation and AOT compilation.

Typical engine use::

    forward, state = make_forward(model)
    step = jax.jit(forward, donate_argnames=("kv_cache",))
    compiled = step.lower(state, ids, pos, kv_cache, meta).compile()  # ahead of time
    hidden, kv_cache = compiled(state, ids, pos, kv_cache, meta)

    logits_fn, _ = make_logits(model)           # fn(state, hidden[N, E]) -> f32[N, V]
    step_fn, _ = make_step(model)               # forward + logits at meta.logits_indices

Each ``fn`` takes the model *state* (the pytree of weights) as its first
argument, so weights are ordinary jit inputs (not baked-in constants) and
the same compiled executable serves any weights of the same shapes. Always
use the returned (new) ``kv_cache``: the donated input is invalid afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import KVCache


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split``: static graph definition (hashable) and the weight state."""
    return nnx.split(model)


def forward_fn(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    input_ids: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    output_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Hidden states of every token, or of the token rows ``output_rows`` only
    (see ``CausalLM.__call__``), and the updated cache."""
    model = nnx.merge(graphdef, state)
    return model(input_ids, positions, kv_cache, meta, output_rows)


def logits_fn(graphdef: nnx.GraphDef, state: nnx.State, hidden: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    return model.compute_logits(hidden)


def logits_t_fn(graphdef: nnx.GraphDef, state: nnx.State, hidden: jax.Array) -> jax.Array:
    """Transposed float32 logits ``[V, N]`` (see ``CausalLM.compute_logits_t``)."""
    model = nnx.merge(graphdef, state)
    return model.compute_logits_t(hidden)


def step_fn(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    input_ids: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    meta: AttentionMetadata,
) -> tuple[jax.Array, KVCache]:
    """Forward pass plus float32 logits ``[S, V]`` of the rows ``meta.logits_indices``."""
    hidden, kv_cache = forward_fn(graphdef, state, input_ids, positions, kv_cache, meta)
    return logits_fn(graphdef, state, hidden[meta.logits_indices]), kv_cache


def make_forward(model: nnx.Module) -> tuple[Callable, nnx.State]:
    """``(fn(state, input_ids, positions, kv_cache, meta) -> (hidden, kv_cache), state)``."""
    graphdef, state = nnx.split(model)
    return functools.partial(forward_fn, graphdef), state


def make_logits(model: nnx.Module) -> tuple[Callable, nnx.State]:
    """``(fn(state, hidden) -> float32 logits, state)``."""
    graphdef, state = nnx.split(model)
    return functools.partial(logits_fn, graphdef), state


def make_step(model: nnx.Module) -> tuple[Callable, nnx.State]:
    """``(fn(state, input_ids, positions, kv_cache, meta) -> (logits[S, V], kv_cache), state)``."""
    graphdef, state = nnx.split(model)
    return functools.partial(step_fn, graphdef), state


#: Shared jitted versions keyed by the (hashable) graphdef, so models with the
#: same structure and shapes reuse compilations. The cache argument is donated.
jit_forward = jax.jit(forward_fn, static_argnums=0, donate_argnames=("kv_cache",))
jit_logits = jax.jit(logits_fn, static_argnums=0)
jit_step = jax.jit(step_fn, static_argnums=0, donate_argnames=("kv_cache",))
