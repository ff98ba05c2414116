"""The int8 KV cache (``--kv-cache-dtype int8``): its quantizer, writes and
reads, every attention path over it, block copies, and the engine on it.

Layout and scales: ``jaxserve/kernels/kv_cache.py`` (one float32 scale per
token and kv head, ``s = max|x| / 127``, stored ``rint(x / s)``).

Two kinds of check:

- *exact*: the quantizer against a numpy one (same int8 values and scales,
  bit for bit), reads against numpy's ``q * s``, partial writes against one
  write (same bytes);
- *the kernels read what is stored*: every path's output over an int8 cache
  against dense float32 attention over the numpy-dequantized keys and
  values, within ``2e-5``-``3e-5`` as the float paths' own tests (the same
  arithmetic in another order: the kernels fold the scales into scores
  and softmax weights instead of dequantizing each element);
- *what int8 costs*: against the float32 cache, a bound derived from the
  quantization error, not a guess (:func:`int8_error_bound`), and at the
  model level greedy agreement with the float32 cache of at least 97 % of
  tokens on a parity fixture.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_fixtures as mf
from jaxserve.engine.llm import LLM
from jaxserve.engine.runner import ModelRunner
from jaxserve.kernels import backends
from jaxserve.kernels import cpu as cpu_kernel
from jaxserve.kernels import pallas_attention as pallas
from jaxserve.kernels.backends import AttentionImpl, select_attention
from jaxserve.kernels.kv_cache import (
    KVCache,
    QuantizedPages,
    blocks_to_heads,
    bytes_per_block,
    dequantize_kv,
    quantize_kv,
)
from jaxserve.kernels.paged_attention import paged_attention, write_kv
from jaxserve.models.config import ModelConfig
from jaxserve.sampling_params import SamplingParams
from test_paged_attention import CAP, _sinks, dense_from_cache, random_paged_case

needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="the C++ kernel did not build here")

# ------------------------------------------------------------------ numpy reference


def quantize_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantizer in numpy float32: ``s = max|x| * float32(1 / 127)``, ``rint(x / s)``."""
    x = np.asarray(x, np.float32)
    s = np.max(np.abs(x), axis=-1) * np.float32(1.0 / 127.0)
    safe = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return q, s.astype(np.float32)


def dequantize_np(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * s[..., None].astype(np.float32)


def int8_blocks(k: jax.Array, v: jax.Array) -> tuple[QuantizedPages, QuantizedPages]:
    """A float32 ``blocks``-layout cache (keys ``[NB, KVH, D, BS]``, values
    ``[NB, KVH, BS, D]``) as an int8 one, each token's vector quantized."""
    kq, ks = quantize_kv(jnp.swapaxes(k, -1, -2))
    vq, vs = quantize_kv(v)
    return QuantizedPages(jnp.swapaxes(kq, -1, -2), ks), QuantizedPages(vq, vs)


def dequantized_blocks(kp: QuantizedPages, vp: QuantizedPages) -> tuple[np.ndarray, np.ndarray]:
    """An int8 ``blocks`` cache read back in numpy (float32 ``blocks`` arrays)."""
    k = np.swapaxes(dequantize_np(np.swapaxes(np.asarray(kp.q), -1, -2), np.asarray(kp.scale)), -1, -2)
    return k, dequantize_np(np.asarray(vp.q), np.asarray(vp.scale))


def int8_error_bound(q, k, v, meta, positions, *, scale) -> np.ndarray:
    """Per token, a bound on |attention over the int8 cache - attention over
    the float32 one| (``k``/``v``: the float32 ``blocks`` cache).

    Quantization moves each key element by at most ``s_k / 2`` and each
    value element by at most ``s_v / 2`` (``s``: that vector's scale), so
    each score moves by at most ``E = scale * sum_d |q_d| * max s_k / 2``
    over the keys the token sees (a soft-cap, ``tanh``, is 1-Lipschitz).
    Scores moved by at most ``E`` change each softmax weight by a factor in
    ``[e^-2E, e^2E]``, so the weights move by at most ``e^2E - 1`` in sum
    (a sink column, unmoved, only shrinks that), and the output by at most
    ``(e^2E - 1) * max|v| + max s_v / 2``."""
    kc, vc = np.asarray(k), np.asarray(v)
    _, ks = quantize_np(np.swapaxes(kc, -1, -2))
    _, vs = quantize_np(vc)
    bs = vc.shape[2]
    seq, pos = np.asarray(meta.token_seq), np.asarray(positions)
    tables, ctx = np.asarray(meta.block_tables), np.asarray(meta.context_lens)
    qa = np.abs(np.asarray(q, np.float32))  # [T, H, D]
    kvh = kc.shape[1]
    bound = np.zeros(q.shape[0], np.float32)
    for t in range(q.shape[0]):
        n = min(pos[t] + 1, ctx[seq[t]])
        if n <= 0:
            continue
        p = np.arange(n)
        blocks = tables[seq[t], p // bs]
        sk = ks[blocks, :, p % bs]  # [n, kvh]
        sv = vs[blocks, :, p % bs]
        vmax = np.abs(vc[blocks, :, p % bs, :]).max()
        q_sum = qa[t].reshape(kvh, -1, qa.shape[-1]).sum(-1).max(-1)  # [kvh]: the largest head's sum |q_d|
        e = scale * float(np.max(q_sum[None, :] * sk)) / 2
        bound[t] = math.expm1(2 * e) * vmax + float(sv.max()) / 2
    return bound


# ------------------------------------------------------------------ the quantizer and the cache


def test_quantize_kv_is_the_numpy_quantizer_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 3, 64)).astype(np.float32) * rng.uniform(1e-3, 1e3, (300, 3, 1)).astype(np.float32)
    x[5, 1] = 0.0  # a zero vector: scale 0, zeros, read back as zeros
    x[6, 0] = 1e-30  # tiny, and a constant vector
    x[7, 2, 3] = -1e4  # one outlier
    q, s = quantize_kv(jnp.asarray(x))
    q_np, s_np = quantize_np(x)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32 and s.shape == (300, 3)
    np.testing.assert_array_equal(np.asarray(q), q_np)
    np.testing.assert_array_equal(np.asarray(s), s_np)
    back = np.asarray(dequantize_kv(q, s))
    np.testing.assert_array_equal(back, dequantize_np(q_np, s_np))
    assert np.all(back[5, 1] == 0.0) and np.abs(q_np).max() == 127
    # rounding to the nearest step: at most half a step off (and a float rounding)
    assert np.all(np.abs(back - x) <= s_np[..., None] * (0.5 + 1e-5))


@pytest.mark.parametrize("layout", ["blocks", "heads"])
def test_int8_cache_shapes_sizes_writes_and_reads(layout):
    L, NB, BS, KVH, D = 2, 6, 16, 3, 64
    cache = KVCache.create(L, NB, BS, KVH, D, jnp.int8, layout=layout)
    assert cache.quantized and cache.dtype == jnp.int8 and cache.num_blocks == NB and cache.num_kv_heads == KVH
    k0, v0 = cache.k[0], cache.v[0]
    scale = (KVH, NB, BS) if layout == "heads" else (NB, KVH, BS)
    assert k0.q.dtype == jnp.int8 and k0.scale.dtype == jnp.float32
    assert k0.scale.shape == scale and v0.scale.shape == scale
    # head_dim + 4 bytes per token and kv head, keys and values, every layer
    assert bytes_per_block(L, BS, KVH, D, jnp.int8) == 2 * L * BS * KVH * (D + 4)
    assert cache.nbytes == NB * bytes_per_block(L, BS, KVH, D, jnp.int8)
    assert cache.nbytes / KVCache.create(L, NB, BS, KVH, D, jnp.float32, layout=layout).nbytes == (D + 4) / (4 * D)

    rng = np.random.default_rng(1)
    slots = np.array([17, 18, 40, 95, 3 * BS + 5], np.int32)  # partial blocks, the last slot of a block
    k_new = rng.standard_normal((len(slots), KVH, D)).astype(np.float32) * 3
    v_new = rng.standard_normal((len(slots), KVH, D)).astype(np.float32)
    pad = np.array([NB * BS + 7], np.int32)  # out of range: dropped
    kk, vv = write_kv(
        k0,
        v0,
        jnp.asarray(np.concatenate([k_new, k_new[:1] * 100])),
        jnp.asarray(np.concatenate([v_new, v_new[:1] * 100])),
        jnp.asarray(np.concatenate([slots, pad])),
        layout=layout,
    )
    cache = cache.replace((kk, cache.k[1]), (vv, cache.v[1]))
    k_read, v_read = cache.read_slots(0, slots)
    np.testing.assert_array_equal(np.asarray(k_read), dequantize_np(*quantize_np(k_new)))
    np.testing.assert_array_equal(np.asarray(v_read), dequantize_np(*quantize_np(v_new)))
    others = np.setdiff1d(np.arange(NB * BS), slots)
    k_other, v_other = cache.read_slots(0, others)
    assert not np.any(np.asarray(k_other)) and not np.any(np.asarray(v_other))
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves((cache.k[1], cache.v[1])))


@pytest.mark.parametrize("layout", ["blocks", "heads"])
def test_a_block_written_a_few_tokens_at_a_time_holds_what_one_write_holds(layout):
    """Prefill chunks of any length and then decode steps store the same
    bytes as one write of the whole sequence: what prefix-cache sharing and a
    preempted request's recompute rely on."""
    NB, BS, KVH, D = 5, 16, 2, 32
    rng = np.random.default_rng(2)
    n = 45
    k = jnp.asarray(rng.standard_normal((n, KVH, D)) * rng.uniform(0.1, 10, (n, KVH, 1)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, KVH, D)), jnp.float32)
    table = np.array([3, 1, 4], np.int32)
    slots = jnp.asarray(table[np.arange(n) // BS] * BS + np.arange(n) % BS, jnp.int32)
    empty = KVCache.create(1, NB, BS, KVH, D, jnp.int8, layout=layout)
    write = jax.jit(functools.partial(write_kv, layout=layout))
    whole = write(empty.k[0], empty.v[0], k, v, slots)
    parts = (empty.k[0], empty.v[0])
    start = 0
    for size in (5, 1, 1, 20, 3, 1, 14):  # chunks, then single tokens
        parts = write(*parts, k[start : start + size], v[start : start + size], slots[start : start + size])
        start += size
    assert start == n
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(parts), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_copies_carry_the_scales():
    """``ModelRunner._copy_fn`` (a fork's copy of its parent's partial last
    block) copies an int8 block's scales with its values, in both layouts."""
    for layout in ("blocks", "heads"):
        cache = KVCache.create(2, 6, 4, 2, 8, jnp.int8, layout=layout)
        leaves, tree = jax.tree.flatten(cache)
        rng = np.random.default_rng(3)
        leaves = [jnp.asarray(rng.integers(-100, 100, x.shape), x.dtype) for x in leaves]
        cache = jax.tree.unflatten(tree, leaves)
        src = jnp.asarray([2, 5, 0, 0], jnp.int32)
        dst = jnp.asarray([4, 1, 0, 0], jnp.int32)
        copied = jax.jit(functools.partial(ModelRunner._copy_fn, None))(cache, src, dst, jnp.int32(2))
        axis = 0 if layout == "blocks" else 1
        for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(copied), strict=True):
            b, a = np.moveaxis(np.asarray(before), axis, 0), np.moveaxis(np.asarray(after), axis, 0)
            want = b.copy()
            want[4], want[1] = b[2], b[5]
            np.testing.assert_array_equal(a, want)
        assert copied.quantized and all(isinstance(p, QuantizedPages) for p in copied.k + copied.v)


# ------------------------------------------------------------------ the attention paths

#: (context before the step, tokens in it): decodes, prefill chunks, a fresh prompt
SEQS = [(40, 1), (15, 1), (9, 20), (0, 6), (63, 1)]
SEQS_DECODE = [(40, 1), (15, 1), (0, 1), (63, 1), (30, 1)]


def _case(seed: int, seqs, *, block_size: int = 16, head_dim: int = 32, kv_heads: int = 2, group: int = 2):
    q, k, v, meta, pos = random_paged_case(
        seed, block_size=block_size, head_dim=head_dim, kv_heads=kv_heads, group=group, seqs=seqs
    )
    kp, vp = int8_blocks(k, v)
    kd, vd = dequantized_blocks(kp, vp)
    return dict(q=q, k=k, v=v, kp=kp, vp=vp, kd=kd, vd=vd, meta=meta, pos=pos, scale=head_dim**-0.5, bs=block_size)


def _with_owners(meta, num_blocks: int, major: bool):
    """The block-major plan of a decode step: each table block's owner row and index."""
    bt = np.asarray(meta.block_tables)
    pad_row = bt.shape[0] - 1
    owner = np.full(num_blocks, pad_row, np.int32)
    index = np.zeros(num_blocks, np.int32)
    used = bt[:pad_row] > 0
    owner[bt[:pad_row][used]] = np.nonzero(used)[0]
    index[bt[:pad_row][used]] = np.nonzero(used)[1]
    return dataclasses.replace(
        meta, block_owner=jnp.asarray(owner), block_index=jnp.asarray(index), block_major=jnp.asarray(major)
    )


def _check(out, c, features=None, window=None, tol=3e-5):
    """``out`` against dense attention over the dequantized cache (tight) and
    over the float32 cache (within the int8 error bound)."""
    features = features or {}
    out = np.asarray(out, np.float32)
    want = dense_from_cache(
        c["q"], c["kd"], c["vd"], c["meta"], c["pos"], scale=c["scale"], sliding_window=window, **features
    )
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    f32 = dense_from_cache(
        c["q"], c["k"], c["v"], c["meta"], c["pos"], scale=c["scale"], sliding_window=window, **features
    )
    bound = int8_error_bound(c["q"], c["k"], c["v"], c["meta"], c["pos"], scale=c["scale"])
    err = np.abs(out - f32).reshape(out.shape[0], -1).max(-1)
    assert np.all(err <= bound + 1e-5), (err, bound)
    assert err.max() > 0  # the keys really were quantized
    np.testing.assert_array_equal(out[-2:], 0.0)  # padding tokens


@pytest.mark.parametrize(
    "chunk_tokens,query_tile",
    [(16, 16), (80, 16), (None, (64, 16)), (None, 1)],
    ids=["chunk", "chunks", "tiles", "per-token"],
)
def test_reference_gathering_paths_read_the_int8_cache(chunk_tokens, query_tile):
    c = _case(4, SEQS)
    out = jax.jit(
        lambda q, kp, vp: paged_attention(
            q,
            kp,
            vp,
            c["meta"],
            c["pos"],
            block_size=16,
            scale=c["scale"],
            chunk_tokens=chunk_tokens,
            query_tile=query_tile,
        )
    )(c["q"], c["kp"], c["vp"])
    _check(out, c)


@pytest.mark.parametrize("feature", ["none", "softcap", "sinks", "both"])
@pytest.mark.parametrize("major", [True, False])
def test_reference_block_major_decode_reads_the_int8_cache(feature, major):
    c = _case(5, SEQS_DECODE)
    features = (
        {}
        if feature == "none"
        else {
            "softcap": {"logit_softcap": CAP},
            "sinks": {"sinks": _sinks(4)},
            "both": {"logit_softcap": CAP, "sinks": _sinks(4)},
        }[feature]
    )
    window = 12 if feature == "both" else None
    meta = _with_owners(c["meta"], c["k"].shape[0], major)
    step = jax.jit(
        lambda q, kp, vp, sinks: paged_attention(
            q,
            kp,
            vp,
            meta,
            c["pos"],
            block_size=16,
            scale=c["scale"],
            sliding_window=window,
            logit_softcap=features.get("logit_softcap"),
            sinks=sinks,
        )
    )
    out = step(c["q"], c["kp"], c["vp"], features.get("sinks"))
    _check(out, c, features, window)
    if major:  # the block-major kernel is in the program: one matmul over every block of the int8 cache
        text = step.lower(c["q"], c["kp"], c["vp"], features.get("sinks")).as_text()
        assert f"tensor<{c['k'].shape[0]}x2x2x32xf32>" in text


def test_reference_heads_layout_and_stacked_cache_read_the_int8_cache():
    c = _case(6, SEQS)
    kh, vh = blocks_to_heads(c["kp"].q, c["vp"].q)
    # heads layout: scales [kvh, blocks, block_size]
    kph = QuantizedPages(kh, jnp.swapaxes(c["kp"].scale, 0, 1))
    vph = QuantizedPages(vh, jnp.swapaxes(c["vp"].scale, 0, 1))
    out = jax.jit(
        lambda q, kp, vp: paged_attention(
            q, kp, vp, c["meta"], c["pos"], block_size=16, scale=c["scale"], layout="heads"
        )
    )(c["q"], kph, vph)
    _check(out, c)

    # a stacked cache (a layer axis in front) with a traced layer index
    def stack(p: QuantizedPages) -> QuantizedPages:  # layer 0 empty, layer 1 the case's
        return QuantizedPages(jnp.stack([jnp.zeros_like(p.q), p.q]), jnp.stack([jnp.zeros_like(p.scale), p.scale]))

    out = jax.jit(
        lambda q, kp, vp, layer: paged_attention(
            q, kp, vp, c["meta"], c["pos"], block_size=16, scale=c["scale"], layer=layer
        )
    )(c["q"], stack(c["kp"]), stack(c["vp"]), jnp.int32(1))
    _check(out, c)


def test_reference_bfloat16_queries_over_the_int8_cache():
    """A bfloat16 model's queries: the matmuls run in bfloat16 (int8 widens
    to it exactly), the scales in float32; close to float32 attention over the
    dequantized cache to bfloat16's precision."""
    c = _case(7, SEQS)
    out = jax.jit(lambda q, kp, vp: paged_attention(q, kp, vp, c["meta"], c["pos"], block_size=16, scale=c["scale"]))(
        c["q"].astype(jnp.bfloat16), c["kp"], c["vp"]
    )
    assert out.dtype == jnp.bfloat16
    want = dense_from_cache(c["q"], c["kd"], c["vd"], c["meta"], c["pos"], scale=c["scale"])
    out = np.asarray(out, np.float32)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 2e-2


@needs_cpu_kernel
@pytest.mark.parametrize(
    "block_size,head_dim,group,features",
    [(64, 64, 3, False), (64, 128, 2, True), (64, 256, 1, False), (16, 32, 2, True)],
    ids=["unrolled-64x3", "unrolled-128-features", "unrolled-256", "generic-features"],
)
def test_the_cpu_kernel_reads_the_int8_cache(block_size, head_dim, group, features):
    """The C++ kernel's int8 entry points (the unrolled loops and the
    generic ones), token-major and feature-major queries."""
    from jaxserve.models.rope import apply_rope, rope_cos_sin

    seqs = [(140, 1), (15, 1), (9, 70), (0, 6), (64, 1)]
    c = _case(8, seqs, block_size=block_size, head_dim=head_dim, group=group)
    H = 2 * group
    feats = {"logit_softcap": CAP, "sinks": _sinks(H)} if features else {}
    window = 50 if features else None
    out = jax.jit(
        lambda q, kp, vp: cpu_kernel.paged_attention_cpu(
            q, kp, vp, c["meta"], c["pos"], scale=c["scale"], sliding_window=window, **feats
        )
    )(c["q"], c["kp"], c["vp"])
    _check(out, c, feats, window)

    T = c["q"].shape[0]
    cos, sin = rope_cos_sin(c["pos"], 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim)))
    q_fm = jnp.transpose(c["q"], (1, 2, 0)).reshape(H * head_dim, T)
    fm = jax.jit(
        lambda q_fm, kp, vp: cpu_kernel.paged_attention_cpu_fm(
            q_fm, cos, sin, kp, vp, c["meta"], c["pos"], scale=c["scale"], sliding_window=window, **feats
        )
    )(q_fm, c["kp"], c["vp"])
    rotated = dict(c, q=apply_rope(c["q"], cos, sin))
    _check(fm, rotated, feats, window)


def test_the_gpu_kernel_reads_the_int8_heads_cache_in_place():
    """The shipped GPU kernel (interpret mode) takes the heads layout's int8
    pages with their ``[kv_heads, pages, page_size]`` scales, as jaxserve
    stores them."""
    c = _case(9, [(40, 1), (15, 1), (0, 1), (63, 1), (3, 4)], head_dim=32, group=8)
    kph = QuantizedPages(*[blocks_to_heads(c["kp"].q, c["vp"].q)[0], jnp.swapaxes(c["kp"].scale, 0, 1)])
    vph = QuantizedPages(blocks_to_heads(c["kp"].q, c["vp"].q)[1], jnp.swapaxes(c["vp"].scale, 0, 1))
    out = pallas.gpu_paged_attention(c["q"], kph, vph, c["meta"], c["pos"], scale=c["scale"], interpret=True)
    _check(out, c, tol=2e-5)


def test_backend_choice_and_dispatch_with_an_int8_cache(monkeypatch):
    common = dict(head_dim=128, num_kv_heads=2, block_size=16, cache_dtype=jnp.int8)
    impl, why = select_attention("auto", platform="tpu", **common)
    assert impl == backends.REFERENCE and "int8" in why
    with pytest.raises(ValueError, match="int8"):
        select_attention("pallas", platform="tpu", **common)
    impl, _ = select_attention("auto", platform="gpu", **common)
    assert impl.kernel == "gpu"  # the GPU kernel reads int8 pages with their scales
    if cpu_kernel.available():
        assert select_attention("auto", platform="cpu", **common)[0].kernel == "cpu"
    assert cpu_kernel.unsupported(jnp.int8) is None and cpu_kernel.unsupported(jnp.bfloat16) is not None
    # a TPU engine built with a float cache: an int8 cache's call still goes to the reference
    calls = []
    monkeypatch.setattr(pallas, "tpu_paged_attention", lambda *a, **k: calls.append("tpu"))
    c = _case(10, SEQS_DECODE)
    kh, vh = blocks_to_heads(c["kp"].q, c["vp"].q)
    kph, vph = (
        QuantizedPages(kh, jnp.swapaxes(c["kp"].scale, 0, 1)),
        QuantizedPages(vh, jnp.swapaxes(c["vp"].scale, 0, 1)),
    )
    out = backends.attend(
        AttentionImpl(kernel="tpu"), c["q"], kph, vph, c["meta"], c["pos"], block_size=16, scale=c["scale"]
    )
    assert calls == []
    _check(out, c)


# ------------------------------------------------------------------ the engine

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine_fixtures import build_engine_checkpoint

    return build_engine_checkpoint(tmp_path_factory.mktemp("int8-ckpt"))


def _engine_run(engine, prompts, params):
    from test_engine import _run

    return _run(engine, prompts, lambda _i: params)


def test_prefix_sharing_chunking_and_preemption_with_an_int8_cache_equal_an_uninterrupted_run(checkpoint):
    """test_engine's batched, chunked, prefix-cached, preempted run on an int8
    cache gives every request the tokens an uninterrupted int8 run gives it
    alone: a block's bytes do not depend on how its tokens were chunked,
    shared or recomputed."""
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine
    from test_engine import _prompts

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    roomy = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=4,
            max_num_batched_tokens=128,
            max_model_len=256,
            enable_prefix_caching=False,
            kv_cache_dtype="int8",
        )
    )
    roomy.warmup()
    assert roomy.runner.kv_cache.quantized
    alone = {f"r{i}": _engine_run(roomy, [p], params)["r0"] for i, p in enumerate(_prompts())}
    per_block = bytes_per_block(2, 16, 2, 16, jnp.int8)
    tight = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=8,
            max_num_batched_tokens=16,
            max_model_len=128,
            block_size=16,
            kv_cache_memory=16 * per_block,
            enable_prefix_caching=True,
            kv_cache_dtype="int8",
        )
    )
    assert tight.num_blocks == 16
    tight.warmup()
    got = _engine_run(tight, _prompts(), params)
    stats = tight.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert got == alone


@pytest.fixture(scope="module")
def parity_folder(tmp_path_factory):
    return mf.with_tokenizer(mf.FAMILIES["llama2"](str(tmp_path_factory.mktemp("int8-parity") / "llama2")))


def _parity_llm(folder: str, kv_cache_dtype: str) -> LLM:
    return LLM(
        folder,
        max_num_seqs=8,
        max_model_len=128,
        max_num_batched_tokens=256,
        block_size=16,
        enable_prefix_caching=True,
        kv_cache_dtype=kv_cache_dtype,
    )


def test_greedy_agreement_and_label_scores_with_the_float32_cache(parity_folder):
    """On a parity fixture (``model_fixtures.llama2``): float32-cache greedy
    continuations of 8 prompts, then the int8-cache engine teacher-forced
    over each prefix (prompt + the first i continuation tokens, one token
    each, as ``benchmarks/quant_quality.py`` counts): at least 97 % of its
    greedy tokens equal float32's. Label scores (forks: a partial block
    copied with its scales) within 0.02 nats per label token of the float32
    cache's: int8 moves a label token's log-probability by 0.01 nats at
    most here, while forks that copied their parent's partial block without
    its scales (checked by hand, for this test) moved two of the three
    labels' scores by 3.3 and 3.7 nats."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, mf.VOCAB, n).tolist() for n in (7, 20, 33, 50, 16, 41, 9, 64)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    f32 = _parity_llm(parity_folder, "auto")
    assert not f32.engine.runner.kv_cache.quantized
    conts = [o.token_ids for o in f32.generate(prompts, greedy)]
    labels = ["alpha", "beta gamma", "the end of it all"]
    text = "Once upon a time there was a"  # 12 tokens here: the forks copy a partial block
    [f32_scores] = f32.score([text], labels)
    int8 = _parity_llm(parity_folder, "int8")
    assert int8.engine.runner.kv_cache.quantized and int8.engine.attention.kernel == f32.engine.attention.kernel
    prefixes = [p + c[:i] for p, c in zip(prompts, conts) for i in range(len(c))]
    wanted = [c[i] for c in conts for i in range(len(c))]
    outs = int8.generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    agreement = np.mean([o.token_ids[0] == w for o, w in zip(outs, wanted)])
    print(f"greedy agreement with the float32 cache: {agreement:.4f} of {len(wanted)} tokens")
    assert agreement >= 0.97, agreement
    [int8_scores] = int8.score([text], labels)
    assert not isinstance(f32_scores, Exception) and not isinstance(int8_scores, Exception)
    for a, b in zip(f32_scores, int8_scores, strict=True):
        assert a.label == b.label and abs(a.logprob - b.logprob) < 0.02 * a.num_tokens, (a, b)


def test_an_int8_cache_holds_about_four_times_the_tokens_in_the_same_memory(parity_folder):
    """``kv_cache_memory`` is the same budget whatever the dtype: an int8
    cache fits ``4D / (D + 4)`` times the blocks (its scales counted)."""
    c = ModelConfig.from_folder(parity_folder)
    D = c.head_dim
    budget = 41 * bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, D, jnp.float32)
    sizes = {}
    for dtype in ("float32", "int8"):
        from jaxserve.engine.args import EngineArgs

        args = EngineArgs(model=parity_folder, block_size=16, kv_cache_memory=budget, kv_cache_dtype=dtype)
        size = args.size_kv_cache(
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=D,
            cache_dtype=args.resolve_kv_cache_dtype(jnp.float32),
            max_model_len=128,
            weight_bytes=0,
        )
        assert size.bytes <= budget
        sizes[dtype] = size
    assert sizes["float32"].num_blocks == 41
    assert sizes["int8"].num_blocks == budget // bytes_per_block(
        c.num_hidden_layers, 16, c.num_key_value_heads, D, jnp.int8
    )
    assert sizes["int8"].bytes_per_token * 4 * D == sizes["float32"].bytes_per_token * (D + 4)


TP_CHILD = """
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "tests")
from test_paged_attention import random_paged_case
from jaxserve.kernels import cpu
from jaxserve.kernels.backends import REFERENCE, AttentionImpl, cache_spec, write_and_attend
from jaxserve.kernels.kv_cache import KVCache

KVH, G, D, BS = 4, 2, 16, 16
seqs = [(40, 1), (15, 1), (9, 20), (0, 6)]
q, k0, _, meta, positions = random_paged_case(3, block_size=BS, head_dim=D, kv_heads=KVH, group=G, seqs=seqs)
T, NB = q.shape[0], k0.shape[0]
rng = np.random.default_rng(4)
k_new = jnp.asarray(rng.standard_normal((T, KVH, D)), jnp.float32)
v_new = jnp.asarray(rng.standard_normal((T, KVH, D)), jnp.float32)
tables = np.asarray(meta.block_tables)
# every token's context written in this step: the step's tokens, and before them the cached ones
slots = [int(tables[s, p // BS]) * BS + p % BS if s < len(seqs) else 0
         for s, p in zip(np.asarray(meta.token_seq), np.asarray(positions))]
meta = dataclasses.replace(meta, slot_mapping=jnp.asarray(slots, jnp.int32))
impls = [REFERENCE, AttentionImpl(kernel="gpu", interpret=True, max_kernel_tokens=64)]
impls += [AttentionImpl(kernel="cpu")] if cpu.available() else []
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
report = {"devices": jax.device_count()}
for impl in impls:
    outs = {}
    for name, m in (("one", None), ("tp", mesh)):
        sharding = None if m is None else jax.sharding.NamedSharding(m, cache_spec(impl.layout))
        cache = KVCache.create(1, NB, BS, KVH, D, jnp.int8, sharding=sharding, layout=impl.layout)
        step = jax.jit(lambda q, k, v, kc, vc, meta, pos, m=m: write_and_attend(
            impl, q, k, v, kc, vc, meta, pos, block_size=BS, scale=D**-0.5, cache_dtype=jnp.int8, mesh=m))
        kc, vc, out = step(q, k_new, v_new, cache.k[0], cache.v[0], meta, positions)
        outs[name] = (np.asarray(out), [np.asarray(x) for x in jax.tree.leaves((kc, vc))])
        if m is not None:
            report[impl.kernel + "-scale-sharded"] = str(kc.scale.sharding.spec)
    report[impl.kernel] = float(np.max(np.abs(outs["one"][0] - outs["tp"][0])))
    report[impl.kernel + "-cache-equal"] = all(np.array_equal(a, b) for a, b in zip(outs["one"][1], outs["tp"][1]))
print("REPORT " + json.dumps(report))
"""


def test_tensor_parallel_int8_cache_equals_one_device():
    """``write_and_attend`` with a mesh of 2 virtual CPU devices (a child
    process) over an int8 cache created sharded on its kv heads, scales
    included: the same cache bytes and the same output as on one device,
    for the reference, GPU (interpreted) and C++ kernels."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", TP_CHILD], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    report = json.loads(lines[-1][len("REPORT ") :])
    assert report.pop("devices") == 2
    kernels = ["reference", "gpu"] + (["cpu"] if cpu_kernel.available() else [])
    for kernel in kernels:
        assert report[kernel] < 3e-5 and report[f"{kernel}-cache-equal"], (kernel, report)
    assert "'tp'" in report["reference-scale-sharded"] and "'tp'" in report["gpu-scale-sharded"]
