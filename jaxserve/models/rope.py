"""Rotary position embedding (HF "rotate_half" convention), computed in float32.

The head dimension is split in two halves ``x = [x1, x2]`` and rotated as
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` and
``cos``/``sin`` of ``position * inv_freq`` repeated over both halves. This is
the layout Hugging Face Llama/Mistral/Qwen2 checkpoints are stored in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies, float32 ``[head_dim // 2]``, with linear or llama3 scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope.theta), exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        inv = _llama3_scale(inv, rope)
    elif rope.rope_type != "default":
        raise ValueError(f"unsupported rope type {rope.rope_type!r}")
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != len(inv):
            raise ValueError(f"{len(rope.freq_factors)} rope frequency factors for {len(inv)} frequencies")
        inv = (inv / np.asarray(rope.freq_factors, np.float32)).astype(np.float32)
    return inv


def _llama3_scale(inv: np.ndarray, rope: RopeConfig) -> np.ndarray:
    factor = rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = (2 * math.pi) / inv
    # long wavelengths (low frequencies) are slowed down by `factor`
    scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    # the band in between is interpolated smoothly
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array | np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``cos``, ``sin`` float32 ``[T, head_dim]`` for int positions ``[T]``."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[T, heads, head_dim]`` with ``cos``/``sin`` ``[T, rotary]``.

    ``rotary`` below ``head_dim`` (partial rotary, Phi-4-mini): the first
    ``rotary`` features of each head are rotated among themselves and the
    rest pass through, as transformers does. Computed in float32; the result
    is float32 (callers cast).
    """
    x = x.astype(jnp.float32)
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = rotary // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
