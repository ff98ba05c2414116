"""Gemma 2 and Gemma 3: what the family-wide parity files do not cover.

``test_model_parity.py``, ``test_family_engine_parity.py`` and
``test_family_gguf.py`` run the ``gemma2`` / ``gemma3`` fixtures of
``model_fixtures.FAMILIES`` (logits, greedy tokens, bfloat16, the engine on
its default backend, GGUF F32 and Q8_0). Here, against transformers on the
same checkpoints:

- config reading: keys a config leaves out take transformers' defaults (an
  explicit null stays null), Gemma 3's 4.x keys (``rope_local_base_freq``,
  ``rope_scaling``, ``sliding_window_pattern``) give the same model as 5.x's
  ``rope_parameters``, a window that cannot bind keeps the local rope,
  Gemma 3 ignores ``attn_logit_softcapping`` as transformers does, a
  bidirectional (embedding) config is one line;
- ``Gemma3ForConditionalGeneration`` checkpoints serve their language model,
  in both tensor layouts;
- the engine on the pure-JAX reference attention (the default on the CPU is
  the C++ kernel), tokens and logprobs;
- chat: a system message with Gemma 2's template (which refuses it) folds
  into the first user turn exactly as Gemma 3's template folds it; Gemma 3's
  renders as transformers renders it; other template errors stay errors
  (``invalid_request`` in the worker); ``<end_of_turn>`` stops generation;
- GGUF: llama.cpp's rules for what a file does not store (layer pattern,
  attention scalar), and the SentencePiece tokenizer and chat template of a
  converted file equal the folder's and transformers' own GGUF reading;
- ``jaxserve generate --chat`` on a Gemma 2 folder prints text, with one BOS.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gemma_tokenizer as gt
import model_fixtures as mf
from jaxserve.engine.llm import LLM
from jaxserve.models import load_model
from jaxserve.models.config import ModelConfig, RopeConfig
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.families.gemma2 import gguf_layer_types, llama_cpp_attention_scalar
from jaxserve.models.gguf_spec import GGUFMetadata
from jaxserve.models.registry import family
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import ChatTemplateError, Tokenizer
from test_model_parity import F32_REL_BOUND, _jax_logits, _prompt, _rel

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[1]
#: the chat fixtures' vocabulary: the Gemma-style tokenizer's 600 pieces, rounded up
CHAT_VOCAB = 640
TEMPLATES = {"gemma2": gt.GEMMA2_TEMPLATE, "gemma3": gt.GEMMA3_TEMPLATE}
SYSTEM = [
    {"role": "system", "content": "You are terse. "},
    {"role": "user", "content": " Name a river."},
    {"role": "assistant", "content": "The Nile."},
    {"role": "user", "content": "Another one?"},
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma")


@pytest.fixture(scope="module")
def chat_folder(root):
    """A family's fixture with the Gemma-style tokenizer and its own chat template."""

    @functools.cache
    def get(name: str) -> str:
        folder = str(root / f"chat-{name}")
        mf.FAMILIES[name](folder, vocab_size=CHAT_VOCAB, bos_token_id=2, eos_token_id=1)
        return gt.with_gemma_tokenizer(folder, TEMPLATES[name])

    return get


def _hf_logits(folder: str, ids: np.ndarray, model=None) -> np.ndarray:
    hf = model if model is not None else mf.hf_model(folder)
    with torch.no_grad():
        return hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].float().numpy()


def _assert_logits_match(folder: str, hf=None) -> None:
    loaded = load_model(folder)
    for n in (7, 64):
        ids = _prompt(n, seed=n)
        rel = _rel(_jax_logits(loaded.model, ids, seed=n), _hf_logits(folder, ids, hf))
        assert rel < F32_REL_BOUND, (folder, n, rel)


def _write_config(folder: Path, d: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    return folder


# ------------------------------------------------------------------ config


def test_absent_keys_take_transformers_defaults_and_null_stays_null(tmp_path):
    from transformers import AutoConfig

    sizes = dict(mf.TINY, head_dim=16)
    cases = {
        "absent": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **sizes},
        "null": {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            **sizes,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "sliding_window": None,
        },
    }
    for name, d in cases.items():
        folder = _write_config(tmp_path / name, d)
        ours, theirs = ModelConfig.from_folder(folder), AutoConfig.from_pretrained(folder)
        assert ours.attn_logit_softcap == theirs.attn_logit_softcapping, name
        assert ours.final_logit_softcap == theirs.final_logit_softcapping, name
        assert ours.sliding_window == theirs.sliding_window, name
        assert list(ours.layer_types) == theirs.layer_types, name
        assert ours.attn_scale == theirs.query_pre_attn_scalar**-0.5, name
        assert ours.tie_word_embeddings == theirs.tie_word_embeddings, name
        assert ours.max_position_embeddings == theirs.max_position_embeddings, name
    assert ModelConfig.from_folder(tmp_path / "absent").attn_logit_softcap == 50.0
    assert ModelConfig.from_folder(tmp_path / "null").attn_logit_softcap is None


def test_a_released_style_multimodal_config_reads_as_transformers_reads_it(tmp_path):
    """Gemma 3 4B's config.json names only what differs from the defaults."""
    from transformers import AutoConfig

    d = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    folder = _write_config(tmp_path / "mm", d)
    ours, theirs = ModelConfig.from_folder(folder), AutoConfig.from_pretrained(folder).text_config
    assert ours.family == "gemma3" and ours.architecture == "Gemma3ForConditionalGeneration"
    for field, key in [
        ("vocab_size", "vocab_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_key_value_heads"),
        ("head_dim", "head_dim"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("sliding_window", "sliding_window"),
        ("rms_norm_eps", "rms_norm_eps"),
    ]:
        assert getattr(ours, field) == getattr(theirs, key), field
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.layer_types.count("full_attention") == 5  # layers 5, 11, ..., 29
    assert ours.attn_scale == theirs.query_pre_attn_scalar**-0.5
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope.rope_type, ours.rope.theta, ours.rope.factor) == ("linear", full["rope_theta"], full["factor"])
    assert local["rope_type"] == "default" and ours.local_rope == RopeConfig(theta=local["rope_theta"])
    assert ours.eos_token_ids == (1, 106) and ours.torch_dtype == "bfloat16" and ours.tie_word_embeddings
    assert ours.attn_logit_softcap is None and ours.final_logit_softcap is None


def test_gemma3_4x_keys_give_the_same_model(root):
    """``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` and
    ``sliding_window_pattern`` instead of ``rope_parameters`` and
    ``layer_types``: the same layers and ropes, the same logits as
    transformers reading that file."""
    folder = str(root / "gemma3-4x")
    mf.gemma3(folder)
    expected = ModelConfig.from_folder(folder)

    def to_4x(d: dict) -> None:
        d.pop("rope_parameters")
        d.pop("layer_types")
        d.update(
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            sliding_window_pattern=3,
        )

    mf.edit_config(folder, to_4x)
    ours = ModelConfig.from_folder(folder)
    assert ours.layer_types == expected.layer_types
    assert [ours.layer_rope(i) for i in range(3)] == [expected.layer_rope(i) for i in range(3)]
    _assert_logits_match(folder)


def test_a_window_that_cannot_bind_keeps_the_local_rope(root):
    """A sliding window longer than the context drops out, but the layer stays
    a local one, rotated by the local base (as transformers rotates it)."""
    folder = str(root / "gemma3-wide-window")
    mf.gemma3(folder, sliding_window=300)  # > max_position_embeddings 256
    c = ModelConfig.from_folder(folder)
    assert c.layer_windows == (None, None, None)
    assert c.layer_rope(0) == c.local_rope != c.rope
    _assert_logits_match(folder)


def test_gemma3_ignores_attention_softcapping_as_transformers_does(root):
    folder = str(root / "gemma3-attn-cap")
    mf.gemma3(folder, attn_logit_softcapping=2.0)
    assert ModelConfig.from_folder(folder).attn_logit_softcap is None
    _assert_logits_match(folder)


def test_a_bidirectional_gemma_config_is_one_line(tmp_path):
    d = {"architectures": ["Gemma3ForCausalLM"], **mf.TINY, "use_bidirectional_attention": True}
    folder = _write_config(tmp_path / "bidi", d)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention") as e:
        ModelConfig.from_folder(folder)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ multimodal checkpoints


@pytest.fixture(scope="module")
def multimodal(root):
    """A tiny Gemma3ForConditionalGeneration (two text layers, a one-layer
    SigLIP tower) and the transformers model that wrote it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = dict(
        mf.TINY,
        num_hidden_layers=2,
        head_dim=16,
        query_pre_attn_scalar=20,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={k: dict(v) for k, v in mf.GEMMA3_ROPE.items()},
        pad_token_id=0,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=500,
        eoi_token_index=501,
        image_token_index=502,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    mf._randomize(model, 0)
    mf._gemma_norms(model)
    model.eval()
    folder = root / "gemma3-multimodal"
    model.save_pretrained(folder)
    return folder, model


def test_a_multimodal_checkpoint_serves_its_language_model(multimodal):
    from safetensors import safe_open

    folder, model = multimodal
    with safe_open(folder / "model.safetensors", "np") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names)  # present, never read
    assert ModelConfig.from_folder(folder).architecture == "Gemma3ForConditionalGeneration"
    _assert_logits_match(str(folder), model)


def test_a_multimodal_checkpoint_in_the_other_layout(multimodal, tmp_path):
    """transformers writes the language model as ``language_model.model.*``
    (the released files' layout) and reads ``model.language_model.*`` too;
    so does jaxserve."""
    from safetensors.numpy import load_file, save_file

    folder, model = multimodal
    tensors = load_file(folder / "model.safetensors")
    renamed = {k.replace("language_model.model.", "model.language_model."): v for k, v in tensors.items()}
    assert renamed != tensors
    other = tmp_path / "other-layout"
    other.mkdir()
    shutil.copy(folder / "config.json", other / "config.json")
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    _assert_logits_match(str(other), model)


# ------------------------------------------------------------------ engine


def _engine_run(folder: str, backend: str) -> None:
    hf = mf.hf_model(folder)
    llm = LLM(folder, max_num_seqs=2, max_model_len=128, attention_backend=backend)
    assert llm.engine.attention.kernel == backend
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True, ignore_eos=True)
    prompts = [_prompt(n, seed=n).tolist() for n in (10, 70)]
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.error is None, out.error
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40)[0, len(prompt) :]
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        assert out.token_ids == theirs.tolist(), (folder, backend, len(prompt))
        ref = torch.log_softmax(logits, -1).numpy()[len(prompt) - 1 : -1]
        np.testing.assert_allclose(out.logprobs, ref[np.arange(40), out.token_ids], atol=1e-4)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_engine_on_the_reference_attention_equals_transformers(name, root):
    """The family-wide engine test runs the C++ kernel; this is the pure-JAX
    path (what GPUs and TPUs fall back to for soft-capped, sliding layers)."""
    folder = mf.with_tokenizer(mf.FAMILIES[name](str(root / f"engine-{name}")))
    _engine_run(folder, "reference")


# ------------------------------------------------------------------ chat


def _hf_render(folder: str, messages: list[dict], template: str | None = None) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def _served_tokenizer(folder: str) -> Tokenizer:
    """The tokenizer as the engine builds it for the folder's family."""
    return Tokenizer.from_folder(folder, fold_system=family(ModelConfig.from_folder(folder).family).fold_system)


def test_gemma2_folds_a_system_message_as_gemma3s_template_does(chat_folder):
    folder = chat_folder("gemma2")
    with pytest.raises(Exception, match="System role not supported"):
        _hf_render(folder, SYSTEM)
    ours = _served_tokenizer(folder).apply_chat_template(SYSTEM)
    # what Gemma 3's authors do with the same messages, rendered by transformers
    assert ours == _hf_render(folder, SYSTEM, gt.GEMMA3_TEMPLATE)
    folded = [{"role": "user", "content": "You are terse. \n\nName a river."}, *SYSTEM[2:]]
    assert ours == _hf_render(folder, folded)
    assert ours.startswith("<bos><start_of_turn>user\nYou are terse. \n\nName a river.<end_of_turn>\n")
    # without a system message: exactly transformers' rendering
    assert _served_tokenizer(folder).apply_chat_template(SYSTEM[1:]) == _hf_render(folder, SYSTEM[1:])


def test_gemma3_renders_a_system_message_exactly_as_transformers(chat_folder):
    folder = chat_folder("gemma3")
    assert _served_tokenizer(folder).apply_chat_template(SYSTEM) == _hf_render(folder, SYSTEM)


def test_other_template_errors_stay_errors(chat_folder):
    """Only a refused system message is folded: roles that do not alternate
    are still the request's error, in the worker an invalid_request; a family
    with a system role keeps the template's refusal."""
    from jaxserve.worker.engine_host import EngineInfo
    from jaxserve.worker.prompts import prepare_prompt

    folder = chat_folder("gemma2")
    tok = _served_tokenizer(folder)
    twice = [SYSTEM[0], SYSTEM[1], SYSTEM[1]]
    with pytest.raises(ChatTemplateError, match="alternate"):
        tok.apply_chat_template(twice)
    info = EngineInfo(model_name=folder, max_model_len=128, tokenizer=tok)
    job = SimpleNamespace(model=None, messages=twice, prompt=None, params=SimpleNamespace(max_tokens=4))
    with pytest.raises(RequestError, match="alternate") as e:
        prepare_prompt(info, None, job)
    assert e.value.code == "invalid_request"
    ok = prepare_prompt(info, None, SimpleNamespace(**{**vars(job), "messages": SYSTEM}))
    assert ok == tok.encode_chat(SYSTEM) and ok.count(tok.bos_token_id) == 1
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        Tokenizer.from_folder(folder).apply_chat_template(SYSTEM)


def test_end_of_turn_stops_generation(chat_folder):
    from jaxserve.engine.engine import stop_token_ids

    for name in ("gemma2", "gemma3"):
        folder = chat_folder(name)
        tok = Tokenizer.from_folder(folder)
        assert tok.token_to_id("<end_of_turn>") in stop_token_ids(tok, ModelConfig.from_folder(folder))


def test_generate_chat_on_a_gemma2_folder_prints_text(chat_folder, tmp_path):
    folder = chat_folder("gemma2")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["JAXSERVE_STATE_DIR"] = str(tmp_path / "state")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "generate", "--model", folder, "--chat", "--max-tokens", "5", "--json"]
        + ["Name a river."],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert isinstance(out["text"], str) and 1 <= out["usage"]["completion_tokens"] <= 5
    expected = Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "Name a river."}])
    assert out["usage"]["prompt_tokens"] == len(expected)  # the template's BOS, and no second one


# ------------------------------------------------------------------ GGUF


def _meta(arch: str, **keys) -> GGUFMetadata:
    return GGUFMetadata({"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}, {}, "x.gguf")


def test_gguf_layer_pattern_as_llama_cpp_reads_it():
    s, f = "sliding_attention", "full_attention"
    assert gguf_layer_types(_meta("gemma2", block_count=5), 2) == [s, f, s, f, s]
    assert gguf_layer_types(_meta("gemma3", block_count=7), 6) == [s] * 5 + [f, s]
    assert gguf_layer_types(_meta("gemma3", block_count=4, **{"attention.sliding_window_pattern": 2}), 6) == [
        s,
        f,
        s,
        f,
    ]
    flags = [True, False, False, True]
    assert gguf_layer_types(_meta("gemma3", block_count=4, **{"attention.sliding_window_pattern": flags}), 6) == [
        s,
        f,
        f,
        s,
    ]
    with pytest.raises(ModelLoadError, match="3 entries for 4 layers"):
        gguf_layer_types(_meta("gemma3", block_count=4, **{"attention.sliding_window_pattern": flags[:3]}), 6)


def test_gguf_attention_scalar_as_llama_cpp_assumes_it():
    """Gemma 2 27B (46 layers, 4608 / 32 heads: scalar 144, head_dim 128) and
    Gemma 3 27B (62 layers, 5376 / 32: 168) scale by hidden / heads; the
    others by head_dim (their scalar is head_dim: 256)."""
    big2 = {"num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32, "head_dim": 128}
    big3 = {"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32, "head_dim": 128}
    small = {"num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8, "head_dim": 256}
    assert llama_cpp_attention_scalar(big2, 46) == 144
    assert llama_cpp_attention_scalar(big3, 62) == 168
    assert llama_cpp_attention_scalar(small, 46) == llama_cpp_attention_scalar(small, 62) == 256


TEXTS = [
    "Hello world, 123 the river ran.",
    "  two  spaces\n\nnewlines\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "ünïcödé ☃ ⅞",
    "The librarian, a tall woman named Clara, knew every book.",
    " leading space",
]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_tokenizer_and_template_equal_the_folders(name, chat_folder, root, monkeypatch):
    """The converted file's SentencePiece vocabulary (scores, no merges)
    tokenizes as the folder's tokenizer and as transformers' GGUF reader do,
    and its chat template renders (and folds) as the folder's."""
    from transformers import AutoTokenizer

    import gguf_convert as gc
    from jaxserve.models.gguf_folder import gguf_model_folder

    folder = chat_folder(name)
    path = gc.convert(folder, root / f"chat-{name}.gguf", "f32")
    ours = Tokenizer.from_folder(gguf_model_folder(path, root / "cache"))
    ours.fold_system = family(name).fold_system
    source = _served_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(str(root), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == source.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == "<bos>" + text
    assert ours.apply_chat_template(SYSTEM) == source.apply_chat_template(SYSTEM)
    assert ours.token_to_id("<end_of_turn>") == source.token_to_id("<end_of_turn>")
