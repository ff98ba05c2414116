"""Quantized models end to end: the tiny preset in int8 and int4 gives the
same greedy tokens through the C++ kernels and through the pure-JAX path
(what GPU/TPU run), holds a fraction of the float weights' bytes, and a GGUF
file's Q8_0 / Q4_1 blocks taken as they are give the logits of the same file
dequantized to float32, within the error of quantizing the activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.engine.llm import LLM
from jaxserve.kernels import cpu
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models import load_model, quant
from jaxserve.models.functional import jit_step
from jaxserve.sampling_params import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a king who had three daughters and a very old dog",
    "a",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(backend: str, quantization: str | None) -> list[list[int]]:
    # few buckets to compile: decode steps of 1-4 tokens, prompt chunks up to 64 (the prefill loop)
    llm = LLM(
        "tiny",
        quantization=quantization,
        attention_backend=backend,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels unavailable")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_cpp_and_pure_jax_paths_give_the_same_tokens(quantization):
    cpp = _tokens("cpu", quantization)
    pure = _tokens("reference", quantization)
    assert cpp == pure
    assert all(len(t) == GREEDY.max_tokens for t in cpp)


def _weight_bytes(model) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


def test_quantized_weights_take_a_fraction_of_the_float_bytes(tmp_path):
    from jaxserve.presets import resolve_model

    folder = resolve_model("tiny")
    f32 = load_model(folder)
    int8 = load_model(folder, quantization="int8")
    int4 = load_model(folder, quantization="int4")
    assert quant.is_quantized(int8.model.embed.get_value())
    assert int8.model.layers[0].w_down.get_value().kind == "q8_0"
    assert int4.model.layers[1].wqkv.get_value().kind == "q4_1"
    assert int8.model.dtype == jnp.float32 and int8.model.norm[...].dtype == jnp.float32
    full = _weight_bytes(f32.model)
    assert _weight_bytes(int8.model) <= 0.28 * full
    assert _weight_bytes(int4.model) <= 0.17 * full


# ---------------------------------------------------------------- GGUF blocks


def _all_logits(model, ids: list[int]) -> np.ndarray:
    """float32 logits of every position of ``ids`` from one prefill step."""
    cfg = model.config
    block = 16
    n = len(ids)
    blocks = -(-n // block)
    cache = KVCache.create(cfg.num_hidden_layers, blocks + 1, block, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    table = np.arange(1, blocks + 1, dtype=np.int32)[None, :]
    pos = np.arange(n, dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(table[0, pos // block] * block + pos % block),
        token_seq=jnp.zeros(n, jnp.int32),
        block_tables=jnp.asarray(table),
        context_lens=jnp.asarray([n], jnp.int32),
        logits_indices=jnp.asarray(pos),
    )
    graphdef, state = nnx.split(model)
    logits, _ = jit_step(graphdef, state, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), cache, meta)
    return np.asarray(logits)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_blocks_taken_directly_match_the_dequantized_file(tmp_path, qtype):
    gguf = pytest.importorskip("gguf")
    from jaxserve.models.gguf_file import GGUFCheckpoint
    from jaxserve.presets import resolve_model
    from test_gguf import gpt2_vocab, hf_weights, write_llama_gguf

    QT = gguf.GGMLQuantizationType
    vocab = gpt2_vocab("default", size=300)
    weights = hf_weights(len(vocab["tokens"]), seed=11, tied=True)
    path = write_llama_gguf(tmp_path / "q.gguf", vocab, weights, QT[qtype], seed=11)
    folder = resolve_model(path)
    asked = "int8" if qtype == "Q8_0" else "int4"
    direct = load_model(folder, quantization=asked)  # the file's blocks: the width asked for
    floats = load_model(folder)  # dequantized to float32 as it is read

    # the stored integers are the file's own bytes (q/k rows un-permuted, q/k/v fused)
    ckpt = GGUFCheckpoint(path)
    wqkv = direct.model.layers[0].wqkv.get_value()
    assert wqkv.kind == quant.GGUF_KINDS[qtype]
    head = 4 if qtype == "Q4_1" else 2
    raw_q = ckpt.raw_blocks("model.layers.0.self_attn.q_proj.weight").blocks
    rows = raw_q.shape[0]
    block_bytes = head + (32 if qtype == "Q8_0" else 16)
    np.testing.assert_array_equal(
        np.asarray(wqkv.q[:rows]).view(np.uint8), raw_q.reshape(rows, -1, block_bytes)[..., head:].reshape(rows, -1)
    )
    np.testing.assert_array_equal(
        np.asarray(quant.dequantize(direct.model.layers[1].w_down.get_value())),
        np.asarray(floats.model.layers[1].w_down[...]),
    )

    ids = [5 + (7 * i) % 280 for i in range(40)]
    a, b = _all_logits(direct.model, ids), _all_logits(floats.model, ids)
    scale = np.abs(b).max()
    assert np.abs(a - b).max() < 0.05 * scale, (np.abs(a - b).max(), scale)
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.9


def test_the_other_block_width_is_requantized_as_asked(tmp_path):
    """--quantization int8 on a Q4_1 file means int8 weights (as llama.cpp's
    Q8_0 of the same weights), not the file's 4-bit blocks; int4 on a Q8_0
    file means 4-bit ones."""
    gguf = pytest.importorskip("gguf")
    from jaxserve.presets import resolve_model
    from test_gguf import gpt2_vocab, hf_weights, write_llama_gguf

    QT = gguf.GGMLQuantizationType
    vocab = gpt2_vocab("default", size=300)
    weights = hf_weights(len(vocab["tokens"]), seed=12, tied=True)
    for qtype, asked, kind in (("Q4_1", "int8", "q8_0"), ("Q8_0", "int4", "q4_1")):
        folder = resolve_model(write_llama_gguf(tmp_path / f"{qtype}.gguf", vocab, weights, QT[qtype], seed=12))
        loaded = load_model(folder, quantization=asked)
        floats = load_model(folder)
        w = loaded.model.layers[0].w_down.get_value()
        assert w.kind == kind
        ref = np.asarray(floats.model.layers[0].w_down[...])
        err = np.abs(np.asarray(quant.dequantize(w)) - ref).max()
        assert 0 < err <= 0.1 * np.abs(ref).max()  # quantized again from the file's values
