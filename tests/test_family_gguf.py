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
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

import gemma_tokenizer as gt
import gguf_convert as gc
import model_fixtures as mf
from jaxserve.models import greedy_generate, load_model
from jaxserve.models.gguf_folder import gguf_model_folder
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
