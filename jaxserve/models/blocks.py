"""The pieces every family's layers are built from: norms, activations, soft-capping, q/k norms.

Each is a small pure function over float32 activations, so the decoder
(:mod:`jaxserve.models.decoder`) reads as the order the pieces run in, and
a family that differs in one piece (Gemma's ``1 + w`` norm, GeGLU, q/k
norms) differs in one argument. Activations are feature-major (``[features,
tokens]``) inside the layers; ``axis`` says which axis a norm reduces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1, offset: float = 0.0) -> jax.Array:
    """RMSNorm over ``axis`` in float32: ``x / rms(x) * (offset + weight)``;
    returns float32. ``offset`` 1 is Gemma's norm, whose checkpoints store
    the weight minus one."""
    x = x.astype(jnp.float32)
    var = jnp.mean(x * x, axis=axis, keepdims=True)
    w = weight.astype(jnp.float32)
    if offset:
        w = w + jnp.float32(offset)
    trailing = x.ndim - (axis % x.ndim) - 1  # axes after the reduced one: the weight broadcasts over them
    if trailing:
        w = w.reshape(w.shape + (1,) * trailing)
    return x * jax.lax.rsqrt(var + eps) * w


def head_rms_norm(x: jax.Array, weight: jax.Array, num_heads: int, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over each head of feature-major ``x`` ``[num_heads * D, T]``
    (head-major rows) with one ``[D]`` weight for every head (Qwen3's and
    Gemma 3's q/k norms); float32, same shape."""
    hd, T = x.shape
    y = rms_norm(x.reshape(num_heads, hd // num_heads, T), weight, eps, axis=1, offset=offset)
    return y.reshape(hd, T)


def gated_activation(gate: jax.Array, up: jax.Array, act: str) -> jax.Array:
    """``act(gate) * up``: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU with the
    tanh approximation of GELU, transformers' ``gelu_pytorch_tanh``)."""
    if act == "silu":
        return jax.nn.silu(gate) * up
    if act == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    raise ValueError(f"unknown activation {act!r}")


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` when ``cap`` is None."""
    if cap is None:
        return x
    c = jnp.float32(cap)
    return jnp.tanh(x / c) * c


__all__ = ["gated_activation", "head_rms_norm", "rms_norm", "softcap"]
