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

from jaxserve.models.config import ModelConfig, RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> np.ndarray:
    """Inverse frequencies, float32 ``[head_dim // 2]``, with linear, llama3 or yarn scaling;
    longrope's short factors, or with ``long`` its long ones."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope.theta), exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        inv = _llama3_scale(inv, rope)
    elif rope.rope_type == "yarn":
        inv = _yarn_scale(inv, rope, head_dim)
    elif rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if factors is None or len(factors) != len(inv):
            raise ValueError(f"longrope needs {len(inv)} factors, got {None if factors is None else len(factors)}")
        inv = (inv / np.asarray(factors, np.float32)).astype(np.float32)
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


def _yarn_scale(inv: np.ndarray, rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN: the fast-turning frequencies kept (extrapolated), the slow ones
    divided by ``factor`` (interpolated), a linear ramp between, over the
    dimensions where a frequency makes between ``beta_fast`` and ``beta_slow``
    turns in the original context."""
    base, old_ctx = rope.theta, rope.original_max_position_embeddings

    def dimension(turns: float) -> float:  # the dimension whose frequency turns so often in old_ctx
        return dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point
    ramp = np.clip((np.arange(len(inv), dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp  # 1: extrapolated as is, 0: interpolated
    wavelength_factors = np.power(np.float32(base), np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    interpolated = (np.float32(1) / (np.float32(rope.factor) * wavelength_factors)).astype(np.float32)
    return (interpolated * (np.float32(1) - keep) + inv * keep).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array, inv_freq: jax.Array | np.ndarray, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """``cos``, ``sin`` float32 ``[T, head_dim]`` for int positions ``[T]``,
    multiplied by ``scale`` (:attr:`RopeConfig.attention_factor`) unless it is 1."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    return cos, sin


def long_rope_tokens(
    positions: jax.Array,
    original: int,
    token_seq: jax.Array,
    context_lens: jax.Array,
    long_from: jax.Array | None = None,
) -> jax.Array:
    """Which tokens of a step take longrope's long factors (bool ``[T]``).

    ``long_from`` (int32, one per row of the step, the engine's
    ``AttentionMetadata.long_rope_from``): a token at a position at or past
    its row's value is long (the engine sends 0 or a position past every
    one: each request keeps one set, see ``families/phi3.py``). Without it,
    the step is read as transformers reads one forward call: a row that
    holds more than ``original`` tokens after the step is long throughout,
    so a whole sequence in one step rotates as transformers' forward does.
    """
    if long_from is None:
        return (context_lens > original)[token_seq]
    return positions >= long_from[token_seq]


def long_rope_original(config: ModelConfig) -> int | None:
    """The original context of a longrope model: the engine tells the model,
    row by row, where each sequence's long factors start (see
    ``jaxserve/models/families/phi3.py`` for the choice); None for every
    other rope."""
    rope = config.rope
    return rope.original_max_position_embeddings if rope.rope_type == "longrope" else None


def longrope_cos_sin(
    positions: jax.Array, rope: RopeConfig, rotary: int, long: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """longrope's ``cos``, ``sin`` ``[T, rotary]``: each token's from the
    short or, where ``long`` (bool ``[T]``), the long factors, both times
    the attention factor."""
    cos, sin = rope_cos_sin(positions, inv_frequencies(rope, rotary), rope.attention_factor)
    long_cos, long_sin = rope_cos_sin(positions, inv_frequencies(rope, rotary, long=True), rope.attention_factor)
    return jnp.where(long[:, None], long_cos, cos), jnp.where(long[:, None], long_sin, sin)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[T, heads, head_dim]`` with ``cos``/``sin`` ``[T, rotary]``.

    ``rotary`` below ``head_dim`` (partial rotary, Phi-4-mini): the first
    ``rotary`` features of each head are rotated among themselves and the
    rest pass through, as transformers does. Computed in float32; the result
    is float32 (callers cast). The CPU kernels' path rotates keys with
    ``jaxserve.kernels.cpu.rope_cpu`` instead (the same math, the same bits
    in every program).
    """
    x = x.astype(jnp.float32)
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = rotary // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
