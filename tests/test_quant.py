"""Weight-only quantization formats (``jaxserve.models.quant``): quantize /
dequantize round trips, GGUF blocks taken as they are, the pure-JAX product
against the numpy reference, and the ``--quantization`` value checks."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.args import EngineArgs
from jaxserve.models import quant

KINDS = quant.KINDS


def _weights(rows: int = 24, cols: int = 96, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[3, 5] = 0.9  # one outlier: only its own block's scale may grow
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_is_within_half_a_step_of_each_block(kind):
    """(q4_0's levels are -8..7 steps: the far side of its largest value
    clips by up to one whole step)"""
    w = _weights()
    q = quant.quantize(w, kind)
    back = quant.dequantize(q)
    assert back.shape == w.shape and back.dtype == np.float32
    step = q.scale.astype(np.float32)  # [O, G]
    err = np.abs(back - w).reshape(w.shape[0], -1, quant.GROUP).max(axis=-1)
    # half a quantization step, plus float16 rounding of the min (q4_1) and of the step itself
    slack = 1e-3 * np.abs(w).reshape(w.shape[0], -1, quant.GROUP).max(axis=-1) + 1e-6
    bound = (1.0 if kind == "q4_0" else 0.5) * np.abs(step) + slack
    assert np.all(err <= bound), (kind, float((err - bound).max()))
    # the outlier's block is the only one of row 3 with a large scale
    assert np.abs(step[3, 0]) > 5 * np.abs(step[3, 1:]).max()


@pytest.mark.parametrize("kind", KINDS)
def test_values_on_the_grid_come_back_exactly(kind):
    w = quant.dequantize(quant.quantize(_weights(seed=1), kind))
    again = quant.dequantize(quant.quantize(w, kind))
    np.testing.assert_allclose(again, w, rtol=0, atol=1e-6 * float(np.abs(w).max()))


def test_bytes_per_weight():
    w = _weights(32, 256)
    sizes = {k: quant.quantize(w, k).nbytes / w.size for k in KINDS}
    assert sizes == {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32}


def test_nibbles_are_in_gguf_order():
    n = np.arange(32, dtype=np.uint8).reshape(1, 1, 32) % 16
    packed = quant.pack_nibbles(n)
    assert packed.shape == (1, 16)
    assert packed[0, 0] == (0 | (0 << 4)) and packed[0, 1] == (1 | (1 << 4))
    np.testing.assert_array_equal(quant.unpack_nibbles(packed), n)


def test_a_weight_whose_input_is_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(np.zeros((4, 40), np.float32), "q8_0")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_are_taken_without_a_float_round_trip(qtype):
    gguf = pytest.importorskip("gguf")
    QT = gguf.GGMLQuantizationType
    w = _weights(16, 128, seed=2)
    blocks = gguf.quants.quantize(w, QT[qtype])
    expected = gguf.quants.dequantize(blocks, QT[qtype]).reshape(w.shape)
    q = quant.from_gguf_blocks(qtype, blocks.view(np.uint8).reshape(16, -1), w.shape)
    assert q.kind == quant.GGUF_KINDS[qtype]
    np.testing.assert_array_equal(quant.dequantize(q), expected)
    # the stored integers are the file's bytes
    raw = blocks.view(np.uint8).reshape(16, 128 // 32, -1)
    head = 4 if qtype == "Q4_1" else 2
    np.testing.assert_array_equal(q.q.view(np.uint8).reshape(16, 4, -1), raw[..., head:])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 16, 33])
def test_pure_jax_product_equals_the_reference(kind, tokens):
    rng = np.random.default_rng(tokens)
    q = quant.quantize(_weights(40, 160, seed=tokens), kind)
    x = rng.standard_normal((160, tokens)).astype(np.float32)
    x[:, -1] = 0.0 if tokens > 1 else x[:, -1]  # a token of zeros: scale 0, no division by it
    ref = quant.reference_matmul(q, x)
    got = np.asarray(quant.matmul(quant.to_device(q), jnp.asarray(x)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if tokens > 1:
        assert np.all(got[:, -1] == 0.0)
    # and the quantized math stays close to the float product
    exact = quant.dequantize(q) @ x
    assert np.abs(ref - exact).max() < 0.03 * np.abs(exact).max()


def test_activations_quantize_per_token_and_block():
    x = np.zeros((64, 2), np.float32)
    x[:32, 0] = np.linspace(-1, 1, 32)
    x[32:, 0] = 100.0
    xq, dx, sx = (np.asarray(a) for a in quant.quantize_activations(jnp.asarray(x)))
    assert xq.shape == (2, 2, 32) and dx.shape == (2, 2)
    assert xq[0, 0].min() == -127 and xq[0, 0].max() == 127
    assert np.all(xq[0, 1] == 127) and sx[0, 1] == 127 * 32
    assert np.all(xq[1] == 0) and np.all(dx[1] == 0)


def test_bad_quantization_value_names_the_field():
    with pytest.raises(ValueError, match=r"quantization must be one of int8, int4 .*'int3'"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineArgs(quantization="int8", tensor_parallel_size=2)
    assert EngineArgs(quantization="int4").quantization == "int4"


def test_bad_quantization_value_on_the_cli_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli.main", "generate", "--quantization", "int3", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--quantization" in proc.stderr and "'int3' is not one of" in proc.stderr
