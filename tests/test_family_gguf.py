"""Every family with a GGUF architecture: the same random checkpoint converted by llama.cpp's own converter.

Per family (tiny transformers-written checkpoints with SmolLM2's tokenizer,
which the converter recognises; ``gguf_convert.py``), the folder is
converted to F32 and Q8_0 GGUF files with ``convert_hf_to_gguf.py``, and
jaxserve loads each through the same path a ``--model FILE.gguf`` takes
(:func:`jaxserve.models.gguf_folder.gguf_model_folder`):

- F32: greedy tokens equal those of the Hugging Face folder, for eight
  prompts;
- Q8_0, read as float and with ``--quantization int8`` (its blocks taken as
  they are): each position's greedy choice, teacher-forced on the F32
  continuation, agrees with F32's on at least 90 % of the tokens.

For the mixtures of experts, every expert tensor the folder holds is also
asked of both files by its Hugging Face name (one expert's slice of
llama.cpp's stacked tensors, or gpt-oss's gate/up joined back), and
gpt-oss's released MXFP4 format goes through the converter too.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import numpy as np
import pytest

import gemma_tokenizer as gt
import gguf_convert as gc
import model_fixtures as mf
from jaxserve.models import greedy_generate, load_model
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.gguf_file import GGUFCheckpoint
from jaxserve.models.gguf_folder import GGUF_LINK, gguf_model_folder
from test_model_parity import _jax_logits

pytestmark = pytest.mark.timeout(900)

#: family fixture -> its config overrides for the conversion. llama.cpp
#: writes no sliding window for Mistral (run as Llama) or Qwen3 files, so
#: those fixtures have none here
GGUF_FIXTURES: dict[str, dict] = {
    "llama2": {},
    "llama3": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"use_sliding_window": False, "layer_types": None},
    # llama.cpp stores no query_pre_attn_scalar (it takes head_dim) and no
    # layer pattern (Gemma 2: every other layer slides, Gemma 3: one global
    # layer in six, so six layers here to have one)
    "gemma2": {"query_pre_attn_scalar": 24},
    "gemma3": {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32},
    # LongRoPE with an original context of 32, so the prompts and their
    # continuations run on both factor sets
    "phi3": {"original": 32},
    "phi4mini": {"original": 32},
    # llama.cpp fixes SmolLM3's NoPE layers at every fourth (layer 3 of 4
    # here) and writes no window
    "smollm3": {"no_rope_layers": None, "num_hidden_layers": 4, "use_sliding_window": False},
    "olmo2": {},
    # llama.cpp writes no window for Mixtral (a llama file)
    "mixtral": {"sliding_window": None},
    # llama.cpp's qwen3moe has no dense-layer tensors and always renormalizes
    # the top-k weights (as the released models do)
    "qwen3_moe": {"mlp_only_layers": [], "norm_topk_prob": True},
    # nor does a gpt-oss file store the activation's limit: llama.cpp fixes 7.0
    "gpt_oss": {"swiglu_limit": 7.0},
}
PROMPTS = [[1, 504, 3339, 25, 14, 920], list(range(100, 140)), [7] * 3 + list(range(2000, 2013))] + [
    np.random.default_rng(n).integers(3, gc.SMOLLM2_VOCAB, n).tolist() for n in (5, 12, 20, 30, 9)
]
NEW_TOKENS = 24
Q8_AGREEMENT = 0.9
#: a third of the fixtures' usual spread. Random layers at 0.15 (or more)
#: amplify a perturbation from layer to layer, so any rounding flips many
#: greedy choices (agreement 0.85-0.95 for F32 against Q8_0); at 0.05, near
#: the scale models are initialised at, they do not (0.97-1.0), and the
#: agreement measures the quantization
WEIGHT_STD = 0.05
#: transformers 5 loads the tokenizer of a folder whose model_type is qwen2 as
#: its Qwen2Tokenizer, with Qwen's own pre-tokenizer whatever the files say,
#: and the converter (which asks AutoTokenizer) then fails to recognise
#: SmolLM2's tokenizer; the converter and jaxserve both go by
#: ``architectures``, so the fixture's model_type only picks the tokenizer class
TOKENIZER_MODEL_TYPE = {"qwen2": "llama"}
#: families converted with a Gemma-style SentencePiece tokenizer.model (Gemma
#: 2's converter reads nothing else), and the chat template each ships
SENTENCEPIECE_TEMPLATES = {"gemma2": gt.GEMMA2_TEMPLATE, "gemma3": gt.GEMMA3_TEMPLATE}
#: Phi-3's converter reads a byte-level BPE tokenizer only when
#: tokenizer_config.json names GPT2Tokenizer (Phi-4-mini's); otherwise it
#: wants a SentencePiece tokenizer.model
TOKENIZER_CLASS = {"phi3": "GPT2Tokenizer", "phi4mini": "GPT2Tokenizer"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_families")
    cache = root / "cache"

    @functools.cache
    def get(name: str) -> dict[str, str]:
        folder = str(root / name)
        mf.FAMILIES[name](folder, std=WEIGHT_STD, vocab_size=gc.SMOLLM2_VOCAB, **GGUF_FIXTURES[name])
        if name in SENTENCEPIECE_TEMPLATES:
            gt.with_gemma_tokenizer(folder, SENTENCEPIECE_TEMPLATES[name])
        else:
            gc.with_smollm2_tokenizer(folder)
        if name in TOKENIZER_MODEL_TYPE:
            mf.edit_config(folder, lambda d: d.update(model_type=TOKENIZER_MODEL_TYPE[name]))
        if name in TOKENIZER_CLASS:
            _edit_json(os.path.join(folder, "tokenizer_config.json"), tokenizer_class=TOKENIZER_CLASS[name])
        out = {"hf": folder}
        for outtype in ("f32", "q8_0"):
            path = gc.convert(folder, root / f"{name}-{outtype}.gguf", outtype)
            out[outtype] = str(gguf_model_folder(path, cache))
        return out

    return get


def _edit_json(path: str, **changes) -> None:
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


def _continuations(loaded) -> list[list[int]]:
    return [greedy_generate(loaded, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("name", list(GGUF_FIXTURES))
def test_f32_file_gives_the_folders_tokens(name, files):
    f = files(name)
    ours = _continuations(load_model(f["f32"]))
    assert ours == _continuations(load_model(f["hf"]))


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("name", list(GGUF_FIXTURES))
def test_q8_0_file_agrees_with_f32(name, quantization, files):
    f = files(name)
    f32 = load_model(f["f32"])
    q8 = load_model(f["q8_0"], quantization=quantization)
    agree = total = 0
    for prompt, cont in zip(PROMPTS, _continuations(f32)):
        ids = np.asarray(prompt + cont[:-1], np.int32)
        ref = _jax_logits(f32.model, ids)[len(prompt) - 1 :].argmax(-1)
        got = _jax_logits(q8.model, ids)[len(prompt) - 1 :].argmax(-1)
        agree += int((ref == got).sum())
        total += len(ref)
    assert agree / total >= Q8_AGREEMENT, (name, quantization, agree, total)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_expert_tensors_come_from_the_stacked_gguf_tensors(name, files):
    """Every expert tensor of the folder, asked of the GGUF files by its
    Hugging Face name: one expert's slice of llama.cpp's stacked
    ``ffn_*_exps`` (Mixtral, Qwen3-MoE), or gpt-oss's ``[X, E, 2I]``
    gate/up tensor joined back from the split, transposed ones. The F32
    file gives the folder's values exactly; the Q8_0 file's are within a
    Q8_0 step of them, and one expert's stored blocks dequantize to what
    ``get`` gives."""
    from safetensors import safe_open

    f = files(name)
    f32 = GGUFCheckpoint(os.path.join(f["f32"], GGUF_LINK))
    q8 = GGUFCheckpoint(os.path.join(f["q8_0"], GGUF_LINK))
    seen_blocks = 0
    with safe_open(os.path.join(f["hf"], "model.safetensors"), "np") as hf:
        names = [n for n in hf.keys() if ".experts." in n]
        assert names
        for n in names:
            ref = hf.get_tensor(n)
            assert n in f32 and n in q8
            assert f32.shape(n) == ref.shape
            np.testing.assert_array_equal(f32.get(n, ref.shape), ref, err_msg=n)
            got = q8.get(n, ref.shape)
            np.testing.assert_allclose(got, ref, rtol=0, atol=float(np.abs(ref).max()) / 127, err_msg=n)
            if q8.dtype_name(n) == "Q8_0" and name != "gpt_oss":
                np.testing.assert_array_equal(q8.raw_blocks(n).dequantize(), got, err_msg=n)
                seen_blocks += 1
    if name == "gpt_oss":
        with pytest.raises(ModelLoadError, match="several GGUF tensors"):
            q8.raw_blocks("model.layers.0.mlp.experts.gate_up_proj")
    else:
        assert seen_blocks > 0
        beyond = names[0].replace(".experts.0.", ".experts.99.")
        assert beyond != names[0] and beyond not in f32


#: e2m1, the 4-bit float of MXFP4 (codes 8-15: the same magnitudes negative)
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w [..., out, in]`` as gpt-oss's released checkpoints store it: per
    32 inputs a power-of-two scale (a biased exponent byte) and 4-bit codes,
    two a byte, the even element in the low nibble. Returns (blocks
    ``[..., out, in / 32, 16]``, scales ``[..., out, in / 32]``, and the
    values they stand for, exactly)."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    peak = np.abs(groups).max(axis=-1, keepdims=True)
    exponent = np.ceil(np.log2(np.maximum(peak, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exponent)
    magnitude = np.abs(np.abs(scaled)[..., None] - FP4).argmin(axis=-1)
    codes = (magnitude + 8 * (scaled < 0)).astype(np.uint8)
    values = np.where(codes >= 8, -1.0, 1.0) * FP4[codes % 8] * np.exp2(exponent)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent[..., 0] + 127).astype(np.uint8)
    # safetensors writes an array's buffer as it lies: contiguous copies
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales), values.reshape(w.shape).astype(np.float32)


def _gpt_oss_mxfp4_pair(root) -> tuple[str, str]:
    """(a gpt-oss folder whose experts are MXFP4 ``*_blocks`` / ``*_scales``
    as released, the same model with those experts' exact values as float32)."""
    from safetensors.numpy import load_file, save_file

    reference, packed = str(root / "gpt_oss_mxfp4_values"), str(root / "gpt_oss_mxfp4")
    mf.gpt_oss(reference, std=WEIGHT_STD, vocab_size=gc.SMOLLM2_VOCAB, **GGUF_FIXTURES["gpt_oss"])
    gc.with_smollm2_tokenizer(reference)
    tensors = load_file(os.path.join(reference, "model.safetensors"))
    quantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, values = _mxfp4(np.swapaxes(tensors[name], 1, 2))  # stored [in, out]: blocks run along in
        tensors[name] = np.ascontiguousarray(np.swapaxes(values, 1, 2))
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(reference, packed)
    save_file(quantized, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
    mxfp4 = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    mf.edit_config(packed, lambda d: d.update(quantization_config=mxfp4))
    return packed, reference


def test_mxfp4_gpt_oss(tmp_path):
    """gpt-oss's released format: a Hugging Face folder with MXFP4 experts is
    a one-line error naming it; llama.cpp's converter turns it into a GGUF
    file with MXFP4 expert tensors, which gives the same greedy tokens as
    the folder holding those experts' exact values in float32."""
    import torch
    from safetensors.numpy import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed, reference = _gpt_oss_mxfp4_pair(tmp_path)
    stored, values = (load_file(os.path.join(f, "model.safetensors")) for f in (packed, reference))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        # the packing is the released one: transformers' own unpacking gives the float values
        blocks, scales = (torch.from_numpy(stored[name + suffix]) for suffix in ("_blocks", "_scales"))
        np.testing.assert_array_equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), values[name])
    with pytest.raises(ModelLoadError, match="MXFP4") as err:
        load_model(packed)
    assert "\n" not in str(err.value)
    path = gc.convert(packed, tmp_path / "gpt_oss-mxfp4.gguf", "f32")
    folder = gguf_model_folder(path, tmp_path / "cache")
    ckpt = GGUFCheckpoint(path)
    assert ckpt.dtype_name("model.layers.0.mlp.experts.gate_up_proj") == "MXFP4"
    assert ckpt.dtype_name("model.layers.1.mlp.experts.down_proj") == "MXFP4"
    assert _continuations(load_model(folder)) == _continuations(load_model(reference))
