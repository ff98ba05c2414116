"""The mixture-of-experts MLP (``jaxserve.models.moe``) computed grouped by
expert, on every path: the C++ CPU kernel (``kernels/cpu/moe_cpu.cc``), the
pure-JAX loop over expert tiles and ``ragged_dot_general``. Each equals the
per-pair computation the grouped ones replaced (every (token, expert) pair
with its expert's matrices gathered) within float tolerance, for float32
stacks, for each family's routing and activation (Qwen3-MoE, Mixtral,
gpt-oss with its biases), at decode and prefill token counts; quantized
stacks (q8_0, q4_0, q4_1) equal a numpy reference of the same integer
math; an expert no token chose is never read; and a token's result does not
depend on the rest of the batch (bitwise through the C++ kernel)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.kernels import cpu
from jaxserve.kernels.backends import AttentionImpl, cache_spec
from jaxserve.models import moe, quant
from jaxserve.models.config import ModelConfig, MoEConfig, RopeConfig
from jaxserve.models.decoder import CausalLM
from jaxserve.models.functional import jit_step
from step_fixtures import paged_step

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels unavailable")

#: (routing, activation, biases) of the families that have experts
FAMILIES = {
    "qwen3_moe": MoEConfig(num_experts=8, top_k=2, intermediate_size=32, normalize_topk=False),
    "mixtral": MoEConfig(num_experts=6, top_k=2, intermediate_size=64),
    "gpt_oss": MoEConfig(
        num_experts=8,
        top_k=3,
        intermediate_size=32,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oss",
    ),
}
TOKENS = [1, 5, 40]


def model_config(m: MoEConfig, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> ModelConfig:
    """A Qwen3-MoE-shaped config around the experts ``m`` (every layer MoE)."""
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        family="qwen3_moe",
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads * 2,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=256,
        qk_norm="head",
        moe=m,
    )


def _weights(m: MoEConfig, hidden: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    X, I, E = m.num_experts, m.intermediate_size, hidden

    def f(*shape, scale=0.1):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    return {
        "router": f(X, E, scale=1.0),
        "b_router": f(X) if m.router_bias else None,
        "experts_gate_up": f(X, 2 * I, E),
        "experts_b_gate_up": f(X, 2 * I) if m.expert_bias else None,
        "experts_down": f(X, E, I),
        "experts_b_down": f(X, E) if m.expert_bias else None,
    }


def _inputs(T: int, hidden: int, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((hidden, T)), jnp.float32)


def per_pair(x: jax.Array, w: dict, m: MoEConfig) -> np.ndarray:
    """What ``moe_mlp`` computed before it grouped: every (token, expert)
    pair with its expert's matrices gathered, feature-major ``[E, T]``."""
    xt = x.T
    ids, weights = moe.route(moe.router_logits(xt, w), m)
    T, k = ids.shape
    I = m.intermediate_size
    flat = ids.reshape(-1)
    xs = jnp.repeat(xt, k, axis=0)
    gu = jnp.einsum("pe,pfe->pf", xs, w["experts_gate_up"][flat])
    if w["experts_b_gate_up"] is not None:
        gu = gu + w["experts_b_gate_up"][flat]
    act = moe.expert_activation(gu[:, :I], gu[:, I:], m)
    out = jnp.einsum("pi,pei->pe", act, w["experts_down"][flat])
    if w["experts_b_down"] is not None:
        out = out + w["experts_b_down"][flat]
    return np.asarray(jnp.sum(out.reshape(T, k, -1) * weights[..., None], axis=1).T)


def _run(path: str, x: jax.Array, w: dict, m: MoEConfig) -> np.ndarray:
    if path == "cpu":
        return np.asarray(jax.jit(lambda x, w: moe.moe_mlp(x, w, model_config(m, x.shape[0]), cpu_kernel=True))(x, w))

    def grouped(x, w):
        ids, weights = moe.route(moe.router_logits(x.T, w), m)
        return moe.grouped_experts(x.T, ids, weights, w, m, impl=path).T

    return np.asarray(jax.jit(grouped)(x, w))


PATHS = [pytest.param("cpu", marks=needs_kernel), "loop", "ragged"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grouped_paths_equal_the_per_pair_computation(path, family):
    m = FAMILIES[family]
    hidden = 96  # three blocks of 32: an odd number of 64-feature chunks
    w = _weights(m, hidden, seed=1)
    for T in TOKENS:
        x = _inputs(T, hidden, seed=T)
        ref = per_pair(x, w, m)
        got = _run(path, x, w, m)
        assert got.shape == (hidden, T) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=f"T={T}")


@needs_kernel
def test_the_kernel_takes_sizes_that_are_no_multiple_of_its_tiles():
    """float32 stacks of any width: 40 features (a partial 16-feature
    chunk), 24 intermediate rows and 40 output rows (partial 16-row tiles)."""
    m = MoEConfig(num_experts=5, top_k=2, intermediate_size=24)
    w = _weights(m, 40, seed=2)
    for T in (1, 7, 33):
        x = _inputs(T, 40, seed=T)
        ref = per_pair(x, w, m)
        np.testing.assert_allclose(_run("cpu", x, w, m), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _quantized(w: dict, kind: str) -> dict:
    q = {name: quant.to_device(quant.quantize(np.asarray(w[name]), kind)) for name in quant.EXPERT_STACKS}
    return {**w, **q}


def reference_quantized(x: jax.Array, w: dict, m: MoEConfig) -> np.ndarray:
    """numpy, pair by pair: each expert's product as ``quant.reference_matmul``
    computes it (activations quantized per token and block of 32, exact
    integer block dots, float64 sums), the activation in float32."""
    xt = x.T
    ids, weights = (np.asarray(a) for a in moe.route(moe.router_logits(xt, w), m))
    gate_up, down = (jax.tree.map(np.asarray, w[n]) for n in quant.EXPERT_STACKS)
    I = m.intermediate_size
    xn = np.asarray(x)
    out = np.zeros(xn.shape, np.float64)
    for t in range(xn.shape[1]):
        for j, e in enumerate(ids[t]):
            gu = quant.reference_matmul(gate_up.rows(int(e)), xn[:, t : t + 1])[:, 0]
            if w["experts_b_gate_up"] is not None:
                gu = gu + np.asarray(w["experts_b_gate_up"][e])
            act = np.asarray(
                moe.expert_activation(jnp.asarray(gu[:I], jnp.float32), jnp.asarray(gu[I:], jnp.float32), m)
            )
            y = quant.reference_matmul(down.rows(int(e)), act[:, None])[:, 0]
            if w["experts_b_down"] is not None:
                y = y + np.asarray(w["experts_b_down"][e])
            out[:, t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("path", [pytest.param("cpu", marks=needs_kernel), "loop"])
@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_quantized_stacks_equal_the_reference(path, kind, family):
    m = FAMILIES[family]
    hidden = 96
    w = _quantized(_weights(m, hidden, seed=3), kind)
    for T in (1, 5, 40):
        x = _inputs(T, hidden, seed=10 + T)
        ref = reference_quantized(x, w, m)
        got = _run(path, x, w, m)
        # the activation is quantized again for down: a rounding of the
        # float activation may move one of its integers, hence the looser bound
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max(), err_msg=f"T={T}")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # quantizing NaN
@pytest.mark.parametrize("path", [pytest.param("cpu", marks=needs_kernel), "loop"])
@pytest.mark.parametrize("kind", [None, "q8_0"])
def test_an_expert_no_token_chose_is_never_read(path, kind):
    """The experts no token routes to hold NaN: a dense pass over all
    experts would spread it (0 * NaN), the grouped ones never touch them."""
    m = FAMILIES["qwen3_moe"]  # 2 tokens choose at most 4 of its 8 experts
    hidden = 64
    w = _weights(m, hidden, seed=4)
    x = _inputs(2, hidden, seed=4)
    ids, _ = moe.route(moe.router_logits(x.T, w), m)
    unused = sorted(set(range(m.num_experts)) - set(np.asarray(ids).ravel().tolist()))
    assert unused, "the test needs an expert no token chose"
    for name in quant.EXPERT_STACKS:
        w[name] = w[name].at[np.asarray(unused)].set(jnp.nan)
    if kind is not None:
        w = _quantized(w, kind)  # NaN weights quantize to NaN scales
    got = _run(path, x, w, m)
    assert np.isfinite(got).all()


@needs_kernel
@pytest.mark.parametrize("kind", [None, "q8_0", "q4_1"])
def test_a_token_does_not_depend_on_the_rest_of_the_batch(kind):
    """Through the C++ kernel bitwise: each (weight row, token) is summed the
    same way whatever the expert's group holds, and a token's k results are
    added in its routing order. The pure-JAX loop within float tolerance
    (XLA's matmuls of a tile may sum a row differently by tile size)."""
    m = MoEConfig(num_experts=16, top_k=4, intermediate_size=64)
    hidden = 128
    w = _weights(m, hidden, seed=5)
    if kind is not None:
        w = _quantized(w, kind)
    x = _inputs(37, hidden, seed=5)
    for path in ("cpu", "loop"):
        full = _run(path, x, w, m)
        for rows in ([5], [5, 6], list(range(0, 37, 3))):
            part = _run(path, x[:, np.asarray(rows)], w, m)
            if path == "cpu":
                np.testing.assert_array_equal(part, full[:, rows])
            else:
                np.testing.assert_allclose(part, full[:, rows], rtol=1e-5, atol=1e-5 * np.abs(full).max())


@needs_kernel
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # quantizing NaN
def test_masked_tokens_are_left_out():
    """A step's padding (``token_mask`` false): zeros out, its experts never
    read (NaN here), and the other tokens bitwise as without it."""
    m = FAMILIES["qwen3_moe"]
    hidden = 64
    w = _weights(m, hidden, seed=7)
    x = _inputs(4, hidden, seed=7)
    mask = np.array([True, False, True, False])
    ids = np.asarray(moe.route(moe.router_logits(x.T, w), m)[0])
    only_masked = sorted(set(ids[~mask].ravel().tolist()) - set(ids[mask].ravel().tolist()))
    assert only_masked, "the test needs an expert only masked tokens chose"
    for name in quant.EXPERT_STACKS:
        w[name] = w[name].at[np.asarray(only_masked)].set(jnp.nan)
    run = jax.jit(lambda x, w, t: moe.moe_mlp(x, w, model_config(m, hidden), cpu_kernel=True, token_mask=t))
    got = np.asarray(run(x, w, jnp.asarray(mask)))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[:, ~mask], 0.0)
    np.testing.assert_array_equal(got[:, mask], np.asarray(run(x[:, mask], w, jnp.ones(2, bool))))


def test_tile_rows_follow_the_mean_group():
    assert moe.tile_rows(8, 128) == 1  # one decode token: one row a visit
    assert moe.tile_rows(512, 128) == 4
    assert moe.tile_rows(4096, 128) == 32
    assert moe.tile_rows(1 << 20, 8) == 64


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_compute():
    m = FAMILIES["mixtral"]
    w = _weights(m, 64, seed=6)
    x = _inputs(2, 64, seed=6)
    assert not cpu.moe_serves(w["experts_gate_up"].astype(jnp.bfloat16), w["experts_down"], x)
    assert not cpu.moe_serves(w["experts_gate_up"], w["experts_gate_up"], x)  # down of the wrong shape
    with pytest.raises(ValueError, match="moe_cpu takes"):
        cpu.moe_cpu(x, w["router"], None, w["experts_down"], w["experts_down"], top_k=2)
    with pytest.raises(ValueError, match="activation"):
        cpu.moe_cpu(x, w["router"], None, w["experts_gate_up"], w["experts_down"], top_k=2, activation="gelu")


def tiny_moe_model(dtype=jnp.float32, heads: int = 4, kv_heads: int = 2) -> CausalLM:
    """A random Qwen3-MoE-shaped decoder (q/k norms, 8 experts of width 64,
    top 2, every layer MoE) built from its config, no checkpoint."""
    config = model_config(MoEConfig(num_experts=8, top_k=2, intermediate_size=64), heads=heads, kv_heads=kv_heads)
    model = CausalLM(config, dtype=dtype, rngs=nnx.Rngs(3))
    for layer in model.layers:  # the default init (std 0.02) routes near-uniformly: spread the router's logits
        router = layer.router  # type: ignore[attr-defined]  # set from moe.PARAM_NAMES at init
        router.set_value(router[...] * 50.0)
    return model


def _logits(model: CausalLM, kernel: Literal["cpu", "reference"], counts: list[int], padding: int = 0) -> np.ndarray:
    """Logits of every real token of one prefill step (``padding`` tokens
    after them, as the runner pads a step to its bucket)."""
    c = model.config
    model.attention = AttentionImpl(kernel=kernel)  # "cpu": the C++ kernels, MoE included
    block = 16
    tokens = sum(counts) + padding
    ids, pos, meta = paged_step(
        c.vocab_size, [0] * len(counts), counts, tokens=tokens, block=block, num_blocks=32, table_width=8, seed=2
    )
    meta = dataclasses.replace(meta, logits_indices=jnp.arange(sum(counts), dtype=jnp.int32))
    cache = model.make_kv_cache(32, block)
    if model.mesh is not None:  # sharded on its kv heads, as the runner makes it
        spec = jax.sharding.NamedSharding(model.mesh, cache_spec(cache.layout))
        cache = cache.replace(
            k=[jax.device_put(a, spec) for a in cache.k], v=[jax.device_put(a, spec) for a in cache.v]
        )
    graphdef, state = nnx.split(model)
    logits, _ = jit_step(graphdef, state, ids, pos, cache, meta)
    return np.asarray(logits)


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_the_model_gives_the_same_logits_through_the_kernel_and_pure_jax(quantization):
    """The decoder's MoE layers through ``moe_cpu`` (the CPU kernels' path,
    the step padded: the kernel leaves the padding tokens out) and through
    the pure-JAX groups (what GPU/TPU run), float32 and with quantized
    expert stacks (``quant.quantize_model`` quantizes them with the dense
    matrices; the router stays float)."""
    model = tiny_moe_model()
    if quantization is not None:
        quant.quantize_model(model, quant.QUANTIZATIONS[quantization])
        stack = model.layers[0].experts_gate_up.get_value()
        assert stack.kind == quant.QUANTIZATIONS[quantization] and stack.shape == (8, 128, 64)
        assert model.layers[0].router[...].dtype == jnp.float32
    counts = [7, 1, 12]
    a, b = _logits(model, "cpu", counts, padding=4), _logits(model, "reference", counts)
    scale = np.abs(b).max()
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    if quantization is None:
        # the same products: only float sums differ in order
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)
        return
    # The same integer dots on both paths, but a float sum summed in another
    # order (AVX2's portable loops against XLA's) can put one activation on
    # the other side of a rounding step of the next layer's quantization: one
    # int8 step in one token's block, which then reaches the later tokens of
    # its sequence through attention (int4 on an AVX2 host: rows 3-6 of the
    # first sequence, 0.5 % of the largest logit). A wrong kernel differs by
    # far more, on every row.
    tight = np.isclose(a, b, rtol=1e-4, atol=1e-5 * scale).all(-1)
    assert tight.sum() >= 0.75 * len(tight), np.abs(a - b).max(-1) / scale
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * scale)


TENSOR_PARALLEL_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from test_moe import tiny_moe_model, _logits
from jaxserve.models.sharding import shard_model, tensor_parallel_mesh

counts = [7, 1, 12]
ref = _logits(tiny_moe_model(heads=8, kv_heads=4), "reference", counts)
out = {"devices": jax.device_count()}
for size in (2, 4):
    model = tiny_moe_model(heads=8, kv_heads=4)
    shard_model(model, tensor_parallel_mesh(model.config, size))
    got = _logits(model, "reference", counts)
    layer = model.layers[0]
    out[size] = {
        "max_diff": float(np.abs(got - ref).max()),
        "scale": float(np.abs(ref).max()),
        "same_argmax": bool((got.argmax(-1) == ref.argmax(-1)).all()),
        "shards": {
            name: [list(s.data.shape) for s in getattr(layer, name)[...].addressable_shards]
            for name in ("router", "experts_gate_up", "experts_down")
        },
    }
print(json.dumps(out))
"""


def test_tensor_parallel_splits_each_expert_and_gives_the_same_logits():
    """On 2 and 4 virtual CPU devices (a child process: XLA fixes the host
    device count at start-up): every device holds every expert with its
    share of the intermediate rows (gate/up rows, down columns), the router
    whole, and the sharded model's logits equal one device's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL_CHILD, tests], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    X, I, E = 8, 64, 64
    for size in ("2", "4"):
        r = out[size]
        n = int(size)
        assert r["shards"]["router"] == [[X, E]] * n
        assert r["shards"]["experts_gate_up"] == [[X, 2 * I // n, E]] * n
        assert r["shards"]["experts_down"] == [[X, E, I // n]] * n
        assert r["same_argmax"]
        assert r["max_diff"] <= 1e-5 * r["scale"], r


PORTABLE_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from jaxserve.kernels import cpu
from jaxserve.models import quant
assert cpu.available()
from test_moe import FAMILIES, _weights, _inputs, _quantized, _run, per_pair
for family in ("qwen3_moe", "gpt_oss"):
    m = FAMILIES[family]
    w = _weights(m, 96, seed=1)
    for T in (1, 17):
        x = _inputs(T, 96, seed=T)
        ref = per_pair(x, w, m)
        np.testing.assert_allclose(_run("cpu", x, w, m), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        for kind in quant.KINDS:
            wq = _quantized(w, kind)
            ref = _run("loop", x, wq, m)
            np.testing.assert_allclose(_run("cpu", x, wq, m), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
print("portable ok")
"""


@needs_kernel
def test_the_portable_build_equals_the_other_paths():
    """What a CPU without AVX-512 VNNI compiles (AVX2-only EPYCs among them):
    the same integer dots and per-(row, token) sums in plain loops, built in
    a child process with ``-mno-avx512vnni``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, JAXSERVE_CPU_KERNEL_CFLAGS="-mno-avx512vnni")
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-c", PORTABLE_CHILD, tests], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "portable ok" in proc.stdout
