"""The C++ CPU paged-attention kernel (jaxserve/kernels/cpu) against dense
attention and the pure-JAX kernel: shuffled blocks, garbage in unused
blocks, padding tokens, prefix chunks, sliding windows, GQA groups, logit
soft-capping and attention sinks, the generic and the unrolled (blocks of
64, head dims 64, 128, 256) code paths, and row independence."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import cpu
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.backends import select_attention
from jaxserve.kernels.paged_attention import paged_attention, write_kv
from test_paged_attention import CAP, NUM_PAD, SCALE, SEQS, _build, _reference, _sinks, dense_from_cache


def test_the_kernel_builds_where_a_compiler_exists():
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the engine falls back to the pure-JAX kernel")
    assert cpu.available()


needs_kernel = pytest.mark.skipif(not cpu.available(), reason="the C++ kernel did not build here")


@jax.jit
def _cpu_step(q, kc, vc, k_new, v_new, meta, positions):
    kc, vc = write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    return cpu.paged_attention_cpu(q, kc, vc, meta, positions, scale=SCALE)


@needs_kernel
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_dense_and_padding_gets_zeros(seed):
    case = _build(seed=seed)
    out = np.asarray(
        _cpu_step(case["q"], case["kc"], case["vc"], case["k_new"], case["v_new"], case["meta"], case["positions"])
    )
    ref, n_real = _reference(case)
    np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)
    assert n_real == sum(n for _, n in SEQS) and out.shape[0] == n_real + NUM_PAD
    np.testing.assert_array_equal(out[n_real:], 0.0)


@needs_kernel
def test_sliding_window_matches_dense():
    case = _build(seed=3)
    window = 9
    step = jax.jit(
        lambda q, kc, vc, kn, vn, meta, pos: cpu.paged_attention_cpu(
            q, *write_kv(kc, vc, kn, vn, meta.slot_mapping), meta, pos, scale=SCALE, sliding_window=window
        )
    )
    out = np.asarray(
        step(case["q"], case["kc"], case["vc"], case["k_new"], case["v_new"], case["meta"], case["positions"])
    )
    ref, n_real = _reference(case, sliding_window=window)
    np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)


def _paged_case(seed: int, *, block_size: int, head_dim: int, kv_heads: int, group: int, seqs):
    """A per-layer cache of shuffled blocks full of garbage, and one step's
    tokens over it: ``seqs`` lists (context before the step, tokens in it)."""
    rng = np.random.default_rng(seed)
    width = max(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = len(seqs) * width + 2
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs) + 1, width), np.int32)
    tok_seq, pos = [], []
    for s, (cached, new) in enumerate(seqs):
        nb = -(-(cached + new) // block_size)
        tables[s, :nb] = perm[s * width : s * width + nb]
        tok_seq += [s] * new
        pos += list(range(cached, cached + new))
    tok_seq += [len(seqs)] * 2  # two padding tokens
    pos += [0, 0]
    T = len(tok_seq)
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros(T, jnp.int32),
        token_seq=jnp.asarray(np.array(tok_seq, np.int32)),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(np.array([c + n for c, n in seqs] + [0], np.int32)),
        logits_indices=jnp.zeros(len(seqs) + 1, jnp.int32),
    )
    k = jnp.asarray(rng.standard_normal((num_blocks, kv_heads, head_dim, block_size)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((T, kv_heads * group, head_dim)), jnp.float32)
    return q, k, v, meta, jnp.asarray(np.array(pos, np.int32))


@needs_kernel
@pytest.mark.parametrize("block_size,head_dim", [(64, 64), (16, 32), (64, 128)])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6])
def test_matches_the_pure_jax_kernel(block_size, head_dim, group):
    # decodes at block boundaries and mid-block, a long prefill chunk over a
    # cached prefix, a fresh prompt; 64 x 64 takes the unrolled code path
    seqs = [(200, 1), (block_size - 1, 1), (block_size, 1), (70, 40), (0, 23)]
    q, k, v, meta, positions = _paged_case(
        7, block_size=block_size, head_dim=head_dim, kv_heads=2, group=group, seqs=seqs
    )
    scale = head_dim**-0.5
    for window in (None, 50):
        ref = jax.jit(
            lambda q, k, v, window=window: paged_attention(
                q, k, v, meta, positions, block_size=block_size, scale=scale, sliding_window=window
            )
        )(q, k, v)
        out = jax.jit(
            lambda q, k, v, window=window: cpu.paged_attention_cpu(
                q, k, v, meta, positions, scale=scale, sliding_window=window
            )
        )(q, k, v)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=3e-5, atol=3e-5)


@needs_kernel
@pytest.mark.parametrize("features", [False, True])
def test_a_tokens_result_does_not_depend_on_the_rest_of_the_batch(features):
    seqs = [(130, 1), (64, 1), (5, 30), (300, 1)]
    q, k, v, meta, positions = _paged_case(11, block_size=64, head_dim=64, kv_heads=4, group=2, seqs=seqs)
    extra = {"logit_softcap": CAP, "sinks": _sinks(8)} if features else {}
    run = jax.jit(lambda q, meta, positions: cpu.paged_attention_cpu(q, k, v, meta, positions, scale=0.125, **extra))
    full = np.asarray(run(q, meta, positions))
    # token 0 alone (the others turned into padding) and token 32 (the last
    # sequence's decode) moved to the front
    alone_seq = meta.token_seq.at[1:].set(len(seqs))
    alone = np.asarray(run(q, dataclasses.replace(meta, token_seq=alone_seq), positions))
    np.testing.assert_array_equal(alone[0], full[0])
    order = np.r_[32, np.arange(32), np.arange(33, q.shape[0])]
    moved = np.asarray(run(q[order], dataclasses.replace(meta, token_seq=meta.token_seq[order]), positions[order]))
    np.testing.assert_array_equal(moved, full[order])


@needs_kernel
@pytest.mark.parametrize(
    "block_size,head_dim,group",
    [(64, 64, 1), (64, 64, 3), (64, 64, 8), (64, 128, 4), (64, 256, 2), (16, 32, 4)],
)
def test_features_match_the_pure_jax_kernel(block_size, head_dim, group):
    """Soft-capping (the kernel's vectorised tanh), sinks and both, with and
    without a window, on the unrolled paths (blocks of 64, head dims 64, 128,
    256; query heads in threes, pairs and alone) and the generic one (16 x
    32): decodes in a block's first half (the half-block scores) and at
    boundaries, a prefill chunk over a prefix, a fresh prompt; padding tokens
    see no key and get zeros, sinks or not. Queries are 3x unit normal, so the
    cap of 2 bends most scores and the features change the result."""
    seqs = [(200, 1), (block_size - 1, 1), (block_size, 1), (70, 40), (0, 23)]
    q, k, v, meta, positions = _paged_case(
        7, block_size=block_size, head_dim=head_dim, kv_heads=2, group=group, seqs=seqs
    )
    q = q * 3
    scale = head_dim**-0.5
    sinks = _sinks(2 * group)
    plain = None
    for cap, with_sinks, window in ((None, False, None), (CAP, False, None), (None, True, 50), (CAP, True, 50)):
        s = sinks if with_sinks else None
        ref = jax.jit(
            lambda q, k, v, s, cap=cap, window=window: paged_attention(
                q,
                k,
                v,
                meta,
                positions,
                block_size=block_size,
                scale=scale,
                sliding_window=window,
                logit_softcap=cap,
                sinks=s,
            )
        )(q, k, v, s)
        out = jax.jit(
            lambda q, k, v, s, cap=cap, window=window: cpu.paged_attention_cpu(
                q, k, v, meta, positions, scale=scale, sliding_window=window, logit_softcap=cap, sinks=s
            )
        )(q, k, v, s)
        out = np.asarray(out)
        np.testing.assert_allclose(out, np.asarray(ref), rtol=3e-5, atol=3e-5)
        np.testing.assert_array_equal(out[-2:], 0.0)  # the padding tokens
        if plain is None:
            plain = out
        else:
            assert np.max(np.abs(out - plain)) > 0.1


@needs_kernel
def test_features_match_dense_attention():
    """The kernel with both features and a window against the dense oracle
    directly (not only the pure-JAX kernel), gpt-oss's shape: 8 query heads
    per kv head, head dim 64."""
    seqs = [(150, 1), (31, 1), (20, 45)]
    q, k, v, meta, positions = _paged_case(5, block_size=64, head_dim=64, kv_heads=1, group=8, seqs=seqs)
    q = q * 3
    sinks = _sinks(8, seed=2)
    out = cpu.paged_attention_cpu(
        q, k, v, meta, positions, scale=0.125, sliding_window=40, logit_softcap=CAP, sinks=sinks
    )
    want = dense_from_cache(q, k, v, meta, positions, scale=0.125, sliding_window=40, logit_softcap=CAP, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), want, rtol=3e-5, atol=3e-5)


@needs_kernel
def test_feature_arguments_are_checked():
    q, k, v, meta, positions = _paged_case(1, block_size=16, head_dim=32, kv_heads=2, group=2, seqs=[(3, 2)])
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, \[4\]"):
        cpu.paged_attention_cpu(q, k, v, meta, positions, scale=0.1, sinks=jnp.zeros(2))
    with pytest.raises(ValueError, match="logit_softcap must be a positive"):
        cpu.paged_attention_cpu(q, k, v, meta, positions, scale=0.1, logit_softcap=-3.0)


def test_auto_picks_the_kernel_for_float32_caches_only():
    shapes = dict(head_dim=64, num_kv_heads=4, block_size=64, sliding_window=None, platform="cpu")
    impl, reason = select_attention("auto", cache_dtype=jnp.float32, **shapes)
    assert (impl.kernel, impl.layout) == (("cpu", "blocks") if cpu.available() else ("reference", "blocks")), reason
    impl, reason = select_attention("auto", cache_dtype=jnp.bfloat16, **shapes)
    assert impl.kernel == "reference" and "float32" in reason
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here: the CPU kernel reads float32"):
        select_attention("cpu", cache_dtype=jnp.bfloat16, **shapes)
    with pytest.raises(ValueError, match="platform 'gpu' is not the CPU"):
        select_attention("cpu", cache_dtype=jnp.float32, **{**shapes, "platform": "gpu"})
    assert select_attention("reference", cache_dtype=jnp.float32, **shapes)[0].kernel == "reference"


@needs_kernel
def test_the_engine_default_on_cpu_is_the_kernel_and_plans_no_block_major_step():
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine

    engine = Engine(EngineArgs(model="tiny", max_num_seqs=2, max_model_len=128))
    runner = engine.runner
    assert engine.attention.kernel == "cpu" and runner.kv_cache.layout == "blocks"
    # a decode step of sequences holding the whole cache would be block-major
    # on the pure-JAX kernel; the C++ kernel never reads that plan
    tables = np.zeros((3, runner.max_blocks_per_seq), np.int32)
    usable = np.arange(1, runner.num_blocks)
    tables[0, : len(usable[::2])], tables[1, : len(usable[1::2])] = usable[::2], usable[1::2]
    from types import SimpleNamespace

    from jaxserve.engine.step_arrays import block_major_plan

    # the three fields of StepArrays the plan reads
    step = SimpleNamespace(block_tables=tables, rows=2, counts=np.ones(2, np.int32))
    sizes = dict(num_blocks=runner.num_blocks, max_num_seqs=runner.max_num_seqs, min_use=runner.block_major_min_use)
    assert bool(block_major_plan(step, **sizes, enabled=True)[2])  # the pure-JAX kernel would go block-major
    owner, index, major = block_major_plan(step, **sizes, enabled=runner.plans_block_major)
    assert not runner.plans_block_major and not bool(major) and np.all(owner == runner.max_num_seqs)


@needs_kernel
@pytest.mark.parametrize("window,features", [(None, False), (9, False), (9, True)])
def test_feature_major_unrotated_queries_match_rotated_ones(window, features):
    """``paged_attention_cpu_fm`` (q as the fused projection leaves it:
    ``[H * D, T]``, rotated and scaled by the kernel) equals the token-major
    kernel on the same queries rotated by ``apply_rope`` first."""
    from jaxserve.models.rope import apply_rope, rope_cos_sin

    case = _build(seed=5)
    q = case["q"]
    T, H, D = q.shape
    cos, sin = rope_cos_sin(case["positions"], 1.0 / (10000.0 ** (np.arange(0, D, 2) / D)))
    q_fm = jnp.transpose(q, (1, 2, 0)).reshape(H * D, T)  # row h * D + d, column t
    extra = {"logit_softcap": CAP, "sinks": _sinks(H)} if features else {}

    @jax.jit
    def both(q, q_fm, cos, sin, kc, vc, kn, vn, meta, pos):
        kc, vc = write_kv(kc, vc, kn, vn, meta.slot_mapping)
        want = cpu.paged_attention_cpu(
            apply_rope(q, cos, sin), kc, vc, meta, pos, scale=SCALE, sliding_window=window, **extra
        )
        got = cpu.paged_attention_cpu_fm(q_fm, cos, sin, kc, vc, meta, pos, scale=SCALE, sliding_window=window, **extra)
        plain = cpu.paged_attention_cpu_fm(q_fm, cos, sin, kc, vc, meta, pos, scale=SCALE, sliding_window=window)
        return want, got, plain

    want, got, plain = both(
        q, q_fm, cos, sin, case["kc"], case["vc"], case["k_new"], case["v_new"], case["meta"], case["positions"]
    )
    assert got.shape == (T, H, D)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    if features:  # the features reach the feature-major entry point, as the dense oracle has them
        assert np.max(np.abs(np.asarray(got) - np.asarray(plain))) > 0.1
        ref, n_real = _reference(dict(case, q_np=np.asarray(apply_rope(q, cos, sin))), sliding_window=window, **extra)
        np.testing.assert_allclose(np.asarray(got)[:n_real], ref, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("rotary", [64, 32])
def test_rope_kernel_rotates_keys_as_apply_rope_the_same_bits_at_any_token_count(rotary):
    """``rope_cpu`` (keys on the CPU kernels' path) is ``apply_rope``'s
    rotation, partial rotary included, and a token's keys are the same bits
    rotated alone, in a call of 5 tokens and in one of 70, inside a jitted
    program (XLA fused its own rotation into the cache write in one-token
    programs only: rope_cpu.cc)."""
    from jaxserve.models.rope import apply_rope, rope_cos_sin

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((70, 3, 64)), jnp.float32)
    cos, sin = rope_cos_sin(jnp.arange(300, 370), 1.0 / (10000.0 ** (np.arange(0, rotary, 2) / rotary)))
    rotate = jax.jit(lambda x, c, s: cpu.rope_cpu(x, c, s))
    got = np.asarray(rotate(x, cos, sin))
    np.testing.assert_allclose(got, np.asarray(apply_rope(x, cos, sin)), rtol=1e-6, atol=1e-6)
    if rotary < 64:
        np.testing.assert_array_equal(got[..., rotary:], np.asarray(x)[..., rotary:])
    for T in (1, 5):
        np.testing.assert_array_equal(np.asarray(rotate(x[:T], cos[:T], sin[:T])), got[:T], err_msg=f"T={T}")
    with pytest.raises(ValueError, match="rope_cpu takes"):
        cpu.rope_cpu(x, cos[:, :3], sin[:, :3])


@needs_kernel
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_kernel_is_rms_norm_and_a_token_is_the_same_bits_at_any_token_count(offset):
    """``rms_norm_cpu`` (the residual stream's norms on the CPU kernels'
    path) is ``blocks.rms_norm`` over the features of ``[E, T]``, Gemma's
    offset included, and a token's output is the same bits alone, at any
    place in a call of 2 to 70 tokens (16-token lane blocks, the last one
    partial), inside a jitted program."""
    from jaxserve.models.blocks import rms_norm

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((576, 70)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal(576), jnp.float32)
    norm = jax.jit(lambda x, w: cpu.rms_norm_cpu(x, w, 1e-5, offset))
    got = np.asarray(norm(x, w))
    ref = np.asarray(rms_norm(x, w, 1e-5, axis=0, offset=offset))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
    for T in (2, 5, 16, 17, 33):
        np.testing.assert_array_equal(np.asarray(norm(x[:, :T], w)), got[:, :T], err_msg=f"T={T}")
    for t in (0, 15, 16, 40, 69):
        np.testing.assert_array_equal(np.asarray(norm(x[:, t : t + 1], w))[:, 0], got[:, t], err_msg=f"t={t}")
    with pytest.raises(ValueError, match="rms_norm_cpu takes"):
        cpu.rms_norm_cpu(x, w[:3], 1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cache_write_kernel_fills_the_cache_as_write_kv_does_in_place(dtype):
    """``kv_write_cpu`` (a float32 or int8 cache's writes on the CPU
    kernels' path) leaves the same bytes as ``write_kv``'s XLA scatters (and
    for int8 its quantization: a zero vector, scale 0; a rounding tie),
    out-of-range slots dropped, every other slot untouched; and with the
    cache donated the program writes it in place (no copy of the cache in
    the compiled HLO)."""
    from jaxserve.kernels.kv_cache import QuantizedPages

    NB, H, D, BS = 24, 3, 64, 16
    rng = np.random.default_rng(6)

    def pages():
        def scales():
            return jnp.asarray(rng.random((NB, H, BS)), jnp.float32)

        def values(*shape):
            if dtype == "float32":
                return jnp.asarray(rng.standard_normal(shape), jnp.float32)
            return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)

        k, v = values(NB, H, D, BS), values(NB, H, BS, D)
        return (k, v) if dtype == "float32" else (QuantizedPages(k, scales()), QuantizedPages(v, scales()))

    if not cpu.kv_write_serves(pages()[0], D):
        pytest.skip(f"this build has no {dtype} cache write")
    xla_write = jax.jit(write_kv)
    kernel_write = jax.jit(cpu.kv_write_cpu)
    for T in (1, 5, 70):
        k = rng.standard_normal((T, H, D)).astype(np.float32) * rng.random((T, H, 1)).astype(np.float32) * 4
        v = rng.standard_normal((T, H, D)).astype(np.float32)
        k[0, 0] = 0.0  # int8: scale 0
        v[-1, 1, :2] = (127.0, 62.5)  # int8: scale 1.0 exactly; 62.5 is a tie: rint goes to the even 62
        slots = rng.permutation(NB * BS)[:T].astype(np.int32)
        if T > 1:
            slots[1] = NB * BS + 3  # out of range: dropped
        kp, vp = pages()
        want = xla_write(kp, vp, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
        got = kernel_write(kp, vp, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
        assert [type(p) for p in got] == [type(p) for p in want]
        for i, (a, b) in enumerate(zip(jax.tree.leaves(want), jax.tree.leaves(got))):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"T={T} leaf {i}")
        if dtype == "int8":
            assert np.asarray(got[1].q)[slots[-1] // BS, 1, slots[-1] % BS, :2].tolist() == [127, 62]
    in_place = jax.jit(cpu.kv_write_cpu, donate_argnums=(0, 1))
    hlo = in_place.lower(*pages(), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)).compile().as_text()
    assert " copy(" not in hlo and "custom-call" in hlo
    with pytest.raises(ValueError, match="kv_write_cpu takes"):
        cpu.kv_write_cpu(kp, vp, jnp.asarray(k)[:, :, :32], jnp.asarray(v)[:, :, :32], jnp.asarray(slots))
