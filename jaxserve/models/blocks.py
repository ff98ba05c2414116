"""The pieces every family's layers are built from: norms, activations, soft-capping, q/k norms.

Each is a small pure function over float32 activations, so the decoder
(:mod:`jaxserve.models.decoder`) reads as the order the pieces run in, and
a family that differs in one piece (Gemma's ``1 + w`` norm, GeGLU, q/k
norms) differs in one argument. Activations are feature-major (``[features,
tokens]``) inside the layers; ``axis`` says which axis a norm reduces.

Sums over features go through :func:`ordered_sum`, so a token's values do
not depend on how many tokens share its step (see there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ordered_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """``x`` summed over ``axis`` in an order fixed by that axis's length
    alone: its first half plus its second (a zero appended to an odd
    length), repeated, as elementwise adds. ``jnp.sum``'s order is XLA's
    and follows the whole shape: an RMSNorm's mean over 576 features of one
    token came out a bit apart alone and among 8 tokens. With int8 weights
    the next product quantizes its input, so such a bit can become another
    integer and another greedy token when a speculative step's guesses
    join the tokens (tests/test_speculative.py, the int8 engine). Each
    level reads the array once more in halves: about twice a plain sum's
    reads."""
    axis = axis % x.ndim
    while x.shape[axis] > 1:
        n = x.shape[axis]
        if n % 2:
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, 1)
            x = jnp.pad(x, pad)
            n += 1
        x = jax.lax.slice_in_dim(x, 0, n // 2, axis=axis) + jax.lax.slice_in_dim(x, n // 2, n, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1, offset: float = 0.0) -> jax.Array:
    """RMSNorm over ``axis`` in float32: ``x / rms(x) * (offset + weight)``;
    returns float32. ``offset`` 1 is Gemma's norm, whose checkpoints store
    the weight minus one."""
    x = x.astype(jnp.float32)
    var = ordered_sum(x * x, axis=axis, keepdims=True) / jnp.float32(x.shape[axis])
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


__all__ = ["gated_activation", "head_rms_norm", "ordered_sum", "rms_norm", "softcap"]
