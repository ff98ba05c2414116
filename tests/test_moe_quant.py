"""Quantized expert stacks as the loader builds them (``quant.load_param``
with a stack's shape): a GGUF file's Q8_0 / Q4_0 / Q4_1 expert blocks are
taken as they are, whether the family names one tensor per expert (its
slice of llama.cpp's stacked tensor) or the whole stack, never through
float32; float experts are quantized part by part to the same values as
the whole stack at once; the other block width is quantized again as
asked. Sources are in-memory stand-ins for ``GGUFCheckpoint`` and the
safetensors reader (the same calls)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models import quant
from jaxserve.models.weights import Part

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType

X, I, E = 4, 64, 96  # experts, their width, hidden: 3 blocks of 32 per row


class Blocks:
    """``GGUFCheckpoint.raw_blocks``' answer."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks


class Source:
    """Tensors by name, each float32 or a GGUF type's blocks."""

    def __init__(self, tensors: dict[str, np.ndarray], qtype: str) -> None:
        self.floats, self.qtype = tensors, qtype
        self.reads_as_float: list[str] = []

    def dtype_name(self, name: str) -> str:
        return self.qtype

    def raw_blocks(self, name: str) -> Blocks:
        w = self.floats[name]
        blocks = gguf.quants.quantize(w.reshape(-1, w.shape[-1]), QT[self.qtype])
        return Blocks(blocks.view(np.uint8).reshape(int(np.prod(w.shape[:-1])), -1))

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self.reads_as_float.append(name)
        w = self.floats[name]
        assert w.shape == tuple(shape)
        if self.qtype == "F32":
            return w
        return gguf.quants.dequantize(self.raw_blocks(name).blocks, QT[self.qtype]).reshape(w.shape)


def _experts(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for j in range(X):
        out[f"experts.{j}.gate_proj.weight"] = rng.standard_normal((I, E)).astype(np.float32) * 0.1
        out[f"experts.{j}.up_proj.weight"] = rng.standard_normal((I, E)).astype(np.float32) * 0.1
    return out


def _per_expert_parts() -> list[Part]:
    """Each expert's gate rows then its up rows (weights.per_expert_moe's layout)."""
    parts = []
    for j in range(X):
        parts.append(Part(f"experts.{j}.gate_proj.weight", (I, E), (j, slice(0, I))))
        parts.append(Part(f"experts.{j}.up_proj.weight", (I, E), (j, slice(I, 2 * I))))
    return parts


def _stacked(tensors: dict[str, np.ndarray]) -> np.ndarray:
    return np.stack(
        [
            np.concatenate([tensors[f"experts.{j}.gate_proj.weight"], tensors[f"experts.{j}.up_proj.weight"]])
            for j in range(X)
        ]
    )


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_expert_blocks_are_taken_as_they_are(qtype):
    tensors = _experts(seed=1)
    src = Source(tensors, qtype)
    kind = "q8_0" if qtype == "Q8_0" else "q4_1"  # what int8 / int4 ask for
    w = quant.load_param(src, _per_expert_parts(), kind, (X, 2 * I, E))
    assert src.reads_as_float == []  # never through float32
    assert w.kind == quant.GGUF_KINDS[qtype] and w.shape == (X, 2 * I, E)
    assert w.q.shape[:2] == (X, 2 * I) and w.scale.shape == (X, 2 * I, E // 32)
    # each expert's rows are the file's own blocks, dequantized as the file's reader does
    for j in (0, X - 1):
        for name, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
            raw = src.raw_blocks(f"experts.{j}.{name}_proj.weight").blocks
            expected = quant.from_gguf_blocks(qtype, raw, (I, E))
            np.testing.assert_array_equal(np.asarray(w.rows(j).q)[rows], expected.q)
            np.testing.assert_array_equal(np.asarray(w.rows(j).scale)[rows], expected.scale)
    floats = gguf.quants.dequantize(src.raw_blocks("experts.2.up_proj.weight").blocks, QT[qtype]).reshape(I, E)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w))[2, I:], floats)


def test_a_whole_stacked_tensor_is_taken_as_it_is():
    """A family that names llama.cpp's stacked tensor itself (one part, ``[X, O, I]``)."""
    rng = np.random.default_rng(2)
    down = rng.standard_normal((X, E, I)).astype(np.float32) * 0.1
    src = Source({"ffn_down_exps": down}, "Q8_0")
    w = quant.load_param(src, [Part("ffn_down_exps", (X, E, I))], "q8_0", (X, E, I))
    assert src.reads_as_float == [] and w.shape == (X, E, I)
    expected = gguf.quants.dequantize(src.raw_blocks("ffn_down_exps").blocks, QT.Q8_0).reshape(X, E, I)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), expected)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_float_experts_are_quantized_part_by_part_as_the_whole_stack(kind):
    tensors = _experts(seed=3)
    w = quant.load_param(Source(tensors, "F32"), _per_expert_parts(), kind, (X, 2 * I, E))
    whole = quant.quantize(_stacked(tensors), kind)
    assert w.kind == kind
    for field in ("q", "scale", "min"):
        a, b = getattr(w, field), getattr(whole, field)
        if b is None:
            assert a is None
        else:
            np.testing.assert_array_equal(np.asarray(a), b)


def test_the_other_block_width_is_quantized_again_as_asked():
    """int4 asked of a Q8_0 file: its values read as float and quantized to Q4_1."""
    tensors = _experts(seed=4)
    src = Source(tensors, "Q8_0")
    w = quant.load_param(src, _per_expert_parts(), "q4_1", (X, 2 * I, E))
    assert w.kind == "q4_1" and len(src.reads_as_float) == 2 * X
    floats = np.stack(
        [np.concatenate([src.get(f"experts.{j}.{n}_proj.weight", (I, E)) for n in ("gate", "up")]) for j in range(X)]
    )
    np.testing.assert_array_equal(np.asarray(w.q), quant.quantize(floats, "q4_1").q)


def test_a_quantized_stack_dequantizes_expert_by_expert():
    stack = _stacked(_experts(seed=5))
    w = quant.quantize(stack, "q4_0")
    full = quant.dequantize(w)
    assert full.shape == stack.shape
    for j in range(X):
        np.testing.assert_array_equal(quant.dequantize(w.rows(j)), full[j])
    assert np.abs(full - stack).max() <= 0.1 * np.abs(stack).max()
