"""The C++ quantized matmul (``kernels/cpu/qmatmul_cpu.cc``) against a numpy
reference of the same quantized math (``jaxserve.models.quant.reference_matmul``:
activations quantized per token and block of 32, exact integer block dots,
float64 sums), at decode sizes (1-8 tokens, the rows-streamed loop) and
prefill sizes (9 and up, tokens in vector lanes), with odd token counts, an
odd number of blocks per row (a half 64-weight chunk) and row counts that
leave partial tiles. The portable build (what a CPU without AVX-512 VNNI
compiles, AVX2-only EPYCs among them) is checked the same way in a
subprocess that builds the library with ``-mno-avx512vnni``; on a CPU with
AMX the default build's prefill loop runs on AMX tiles, so the VNNI build
(``-mno-amx-tile -mno-amx-int8``) is checked in a subprocess too, and the
AMX loop gives the VNNI loop's bits (``mode=3``)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import cpu
from jaxserve.models import quant

pytestmark = pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels unavailable")

# (O, I): I = 96 has 3 blocks (a half chunk), 13 rows leave partial row tiles
SHAPES = [(13, 64), (40, 96), (100, 576)]
TOKENS = [1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 70]


def _case(O: int, I: int, T: int, kind: str, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((O, I)).astype(np.float32) * 0.1
    x = rng.standard_normal((I, T)).astype(np.float32)
    x[: I // 2, 0] *= 50.0  # blocks of very different magnitudes in one token
    if T > 2:
        x[:, 1] = 0.0  # a token of zeros
    return quant.quantize(w, kind), x


_kernel = jax.jit(cpu.qmatmul_cpu)


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("O,I", SHAPES)
def test_kernel_equals_reference(kind, O, I):
    for T in TOKENS:
        q, x = _case(O, I, T, kind, seed=O * 1000 + T)
        ref = quant.reference_matmul(q, x)
        got = np.asarray(_kernel(quant.to_device(q), jnp.asarray(x)))
        assert got.shape == (O, T) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max(), err_msg=f"T={T}")
        if T > 2:
            assert np.all(got[:, 1] == 0.0)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_kernel_equals_the_pure_jax_path(kind):
    q, x = _case(48, 128, 16, kind, seed=7)
    jq = quant.to_device(q)
    for T in (1, 16):
        xs = jnp.asarray(x[:, :T])
        np.testing.assert_allclose(np.asarray(_kernel(jq, xs)), np.asarray(quant.matmul(jq, xs)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("path", ["kernel", "pure_jax"])
def test_a_token_does_not_depend_on_the_rest_of_the_call(kind, path):
    """A token's outputs are bitwise the same alone and in calls of any
    token count, across the decode loop (1-8 tokens), the prefill loop (9
    and up) and the pure-JAX path's shapes: a speculative step's guesses
    are tokens of the same call, so greedy text with and without them
    rests on this (the next layer's activation quantization turns a last
    bit into another integer)."""
    fn = _kernel if path == "kernel" else jax.jit(quant.matmul)
    q, x = _case(100, 1120, 70, kind, seed=3)  # 35 blocks: 18 chunks, the last a half one
    jq = quant.to_device(q)
    alone = np.asarray(fn(jq, jnp.asarray(x[:, 4:5])))
    ref = quant.reference_matmul(q, x[:, 4:5])
    np.testing.assert_allclose(alone, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())
    for T in (5, 8, 9, 16, 33, 70):
        got = np.asarray(fn(jq, jnp.asarray(x[:, :T])))
        np.testing.assert_array_equal(got[:, 4:5], alone, err_msg=f"{path} T={T}")


@pytest.mark.skipif(
    cpu.available() and cpu.int8_units() != "amx", reason="the CPU has no AMX-INT8 (or Linux refused it)"
)
@pytest.mark.parametrize("kind", quant.KINDS)
def test_amx_prefill_gives_the_vnni_loops_bits(kind):
    """The AMX loop scales each block's tile of integer dots in the VNNI
    prefill loop's order of operations, so the two agree bitwise, over
    16-row panels, a remainder of rows below 16 and partial token tiles."""
    vnni = jax.jit(lambda w, x: cpu.qmatmul_cpu(w, x, mode=3))
    for O, I, T in [(100, 576, 70), (48, 96, 17), (40, 1536, 300)]:
        q, x = _case(O, I, T, kind, seed=O + T)
        jq, jx = quant.to_device(q), jnp.asarray(x)
        np.testing.assert_array_equal(np.asarray(_kernel(jq, jx)), np.asarray(vnni(jq, jx)))


def test_shapes_it_refuses():
    q = quant.to_device(quant.quantize(np.zeros((8, 64), np.float32), "q8_0"))
    with pytest.raises(ValueError, match="qmatmul_cpu takes"):
        cpu.qmatmul_cpu(q, jnp.zeros((32, 4)))
    with pytest.raises(ValueError, match="qmatmul_cpu takes"):
        cpu.qmatmul_cpu(jnp.zeros((8, 64)), jnp.zeros((64, 4)))


_PORTABLE = """
import numpy as np, jax, jax.numpy as jnp
from jaxserve.kernels import cpu
from jaxserve.models import quant
assert cpu.available()
rng = np.random.default_rng(0)
for kind in quant.KINDS:
    for O, I in [(13, 96), (50, 256)]:
        w = quant.quantize(rng.standard_normal((O, I)).astype(np.float32), kind)
        for T in (1, 3, 16, 17, 40):
            x = rng.standard_normal((I, T)).astype(np.float32)
            ref = quant.reference_matmul(w, x)
            got = np.asarray(cpu.qmatmul_cpu(quant.to_device(w), jnp.asarray(x)))
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())
print("build ok")
"""  # run with other compiler flags; says which loops the build has


@pytest.mark.parametrize(
    "flags,units",
    [("-mno-avx512vnni", "portable"), ("-mno-amx-tile -mno-amx-int8", "avx512_vnni")],
    ids=["portable", "vnni"],
)
def test_other_builds_equal_reference(flags, units):
    if units == "avx512_vnni" and cpu.int8_units() == "portable":
        pytest.skip("the CPU has no AVX-512 VNNI")
    env = dict(os.environ, JAXSERVE_CPU_KERNEL_CFLAGS=flags)
    code = _PORTABLE + f"assert cpu.int8_units() == {units!r}, cpu.int8_units()\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "build ok" in proc.stdout
