"""Mixture-of-experts MLP: routing and the experts, for the layers a config makes MoE.

A MoE layer holds, instead of the dense MLP's weights:

``router``              ``[X, E]``      one logit per expert (``b_router`` ``[X]``: gpt-oss)
``experts_gate_up``     ``[X, 2I, E]``  each expert's gate rows, then its up rows
``experts_b_gate_up``   ``[X, 2I]``     (gpt-oss)
``experts_down``        ``[X, E, I]``
``experts_b_down``      ``[X, E]``      (gpt-oss)

(``X`` experts of width ``I = MoEConfig.intermediate_size``, hidden ``E``,
Hugging Face's ``[out, in]`` per expert.) :func:`route` picks each token's
``top_k`` experts and their weights as the family does;
:func:`moe_mlp` runs every token through its experts only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig, MoEConfig

PARAM_NAMES = ("router", "b_router", "experts_gate_up", "experts_b_gate_up", "experts_down", "experts_b_down")


def param_shapes(c: ModelConfig, index: int) -> dict[str, tuple[int, ...] | None]:
    """The MoE weights of layer ``index`` (None for those it does not have)."""
    shapes: dict[str, tuple[int, ...] | None] = dict.fromkeys(PARAM_NAMES)
    if c.moe is None or not c.moe.is_moe_layer(index):
        return shapes
    m, E = c.moe, c.hidden_size
    X, I = m.num_experts, m.intermediate_size
    shapes["router"] = (X, E)
    shapes["experts_gate_up"] = (X, 2 * I, E)
    shapes["experts_down"] = (X, E, I)
    if m.router_bias:
        shapes["b_router"] = (X,)
    if m.expert_bias:
        shapes["experts_b_gate_up"] = (X, 2 * I)
        shapes["experts_b_down"] = (X, E)
    return shapes


def route(logits: jax.Array, m: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and weights from router logits ``[T, X]``:
    ``(ids int32 [T, k], weights float32 [T, k])``."""
    logits = logits.astype(jnp.float32)
    if m.router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, m.top_k)
        return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, m.top_k)
    if m.normalize_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def expert_activation(gate: jax.Array, up: jax.Array, m: MoEConfig) -> jax.Array:
    if m.activation == "swiglu_oss":
        limit = jnp.float32(m.swiglu_limit)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(jnp.float32(m.swiglu_alpha) * gate)
    return jax.nn.silu(gate) * up


def moe_mlp(x: jax.Array, w: dict[str, Any], c: ModelConfig, *, cpu_kernel: bool = False, mesh=None) -> jax.Array:
    """The MoE MLP of feature-major ``x`` ``[E, T]``: float32 ``[E, T]``.

    Each token's ``top_k`` experts only: the (token, expert) pairs are
    gathered with their expert's weights and computed pair by pair."""
    del cpu_kernel, mesh
    m = c.moe
    assert m is not None
    xt = x.astype(jnp.float32).T  # [T, E]
    logits = xt @ w["router"].astype(jnp.float32).T
    if w["b_router"] is not None:
        logits = logits + w["b_router"].astype(jnp.float32)
    ids, weights = route(logits, m)
    T, k = ids.shape
    I = m.intermediate_size
    flat = ids.reshape(-1)
    xs = jnp.repeat(xt, k, axis=0)  # [T * k, E], token-major pairs
    gu = jnp.einsum("pe,pfe->pf", xs, w["experts_gate_up"][flat].astype(jnp.float32))
    if w["experts_b_gate_up"] is not None:
        gu = gu + w["experts_b_gate_up"][flat].astype(jnp.float32)
    act = expert_activation(gu[:, :I], gu[:, I:], m)
    out = jnp.einsum("pi,pei->pe", act, w["experts_down"][flat].astype(jnp.float32))
    if w["experts_b_down"] is not None:
        out = out + w["experts_b_down"][flat].astype(jnp.float32)
    out = jnp.sum(out.reshape(T, k, -1) * weights[..., None], axis=1)
    return out.T


__all__ = ["PARAM_NAMES", "expert_activation", "moe_mlp", "param_shapes", "route"]
