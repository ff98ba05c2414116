"""GGUF checkpoints against transformers reading the same file (``gguf_file=``).

The tests write their own small GGUF files with ``gguf.GGUFWriter``: a tiny
random Llama (hidden 256 and feed-forward 512, so K-quant super-blocks of 256
fit every input dimension) whose matrices cycle through every supported
tensor type, and two vocabularies, a GPT-2-style byte-level BPE (three
pre-tokenizers) and a SentencePiece-style one with scores and byte fallback.
Where ``gguf.quants.quantize`` has no quantizer (the K-quants) the blocks
are random bytes with small f16 scales, which are as valid to both readers.
Checked: every tensor equals transformers' dequantized copy, Q/K rows come
back in Hugging Face's order, raw blocks decode to the same floats, greedy
tokens equal transformers' ``generate``, token ids equal transformers' GGUF
tokenizer, and unsupported files stop with one line naming the cause.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from gguf import GGMLQuantizationType as QT  # noqa: E402

from jaxserve.models.errors import ModelLoadError  # noqa: E402
from jaxserve.models.gguf_file import SUPPORTED_TENSOR_TYPES, GGUFCheckpoint, unpermute_rows  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "models" / "corpus.txt"

E, I, H, KVH, D, LAYERS = 256, 512, 4, 2, 64, 2
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "Numbers 1234567 and 3.14159, dates 2024-05-17.",
    "multiple   spaces\n\nnew lines\ttabs\r\n end",
    "café naïve – “quotes” façade",
    "中文字符 and emoji 🙂👍",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "don't I'll we're THEY'VE",
    "",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


# ------------------------------------------------------------------ writing


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (Hugging Face rows -> GGUF rows)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant blocks (random quants and sub-scales, small f16 super-scales)."""
    n = cols // 256

    def f16(value: float, count: int) -> np.ndarray:
        return (value * (0.5 + rng.random((rows, n, 1)))).astype(np.float16).view(np.uint8)

    def rand(count: int) -> np.ndarray:
        return rng.integers(0, 256, (rows, n, count), dtype=np.uint8)

    if qtype == QT.Q4_K:
        d = 2e-4
        parts = [f16(d, 1), f16(d * 7.5, 1), rand(12), rand(128)]
    elif qtype == QT.Q5_K:
        d = 1e-4
        parts = [f16(d, 1), f16(d * 15.5, 1), rand(12), rand(32), rand(128)]
    elif qtype == QT.Q6_K:
        scales = rng.integers(-64, 65, (rows, n, 16)).astype(np.int8).view(np.uint8)
        parts = [rand(128), rand(64), scales, f16(3e-5, 1)]
    else:
        parts = [rand(gguf.GGML_QUANT_SIZES[qtype][1])]  # any bytes: for the unsupported-type test
    blocks = np.concatenate(parts, axis=-1)
    assert blocks.shape[-1] == gguf.GGML_QUANT_SIZES[qtype][1]
    return blocks.reshape(rows, -1)


def _encode_tensor(w: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    if qtype == QT.F32:
        return w.astype(np.float32)
    if qtype == QT.F16:
        return w.astype(np.float16)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K):
        return _random_kquant_blocks(qtype, w.shape[0], w.shape[1], rng)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def hf_weights(vocab: int, *, seed: int, tied: bool, qkv_bias: bool = False) -> dict[str, np.ndarray]:
    """Random Hugging Face-layout Llama weights (norms around 1; q/k/v biases
    as Qwen2 has them when ``qkv_bias``)."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, std: float = 0.08) -> np.ndarray:
        return (std * rng.standard_normal((rows, cols))).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab, E, 0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = mat(H * D, E)
        w[p + "self_attn.k_proj.weight"] = mat(KVH * D, E)
        w[p + "self_attn.v_proj.weight"] = mat(KVH * D, E)
        if qkv_bias:
            for proj, rows in (("q", H * D), ("k", KVH * D), ("v", KVH * D)):
                w[p + f"self_attn.{proj}_proj.bias"] = (0.05 * rng.standard_normal(rows)).astype(np.float32)
        w[p + "self_attn.o_proj.weight"] = mat(E, H * D)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = mat(I, E)
        w[p + "mlp.up_proj.weight"] = mat(I, E)
        w[p + "mlp.down_proj.weight"] = mat(E, I)
    w["model.norm.weight"] = norm()
    if not tied:
        w["lm_head.weight"] = mat(vocab, E)
    return w


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, index, rest = hf.split(".", 3)
    return f"blk.{index}.{_GGUF_NAMES[rest]}"


def write_llama_gguf(
    path: Path,
    vocab_meta: dict,
    weights: dict[str, np.ndarray],
    types: dict[str, QT] | QT = QT.F32,
    *,
    arch: str = "llama",
    seed: int = 0,
) -> Path:
    """A GGUF file for ``weights`` (Hugging Face names and layout); ``types``
    gives each matrix's tensor type (norms stay F32, as llama.cpp writes them)."""
    rng = np.random.default_rng(seed + 1)
    vocab = weights["model.embed_tokens.weight"].shape[0]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(E)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D)
    w.add_vocab_size(vocab)
    _add_vocab(w, vocab_meta)
    permuted = arch == "llama"  # llama.cpp's converter permutes Llama's Q/K rows, not Qwen2's
    for name, value in weights.items():
        if value.ndim == 2:
            if permuted and name.endswith("q_proj.weight"):
                value = _permute(value, H)
            elif permuted and name.endswith("k_proj.weight"):
                value = _permute(value, KVH)
            qtype = types.get(name, QT.F32) if isinstance(types, dict) else types
            data = _encode_tensor(value, qtype, rng)
            w.add_tensor(_gguf_name(name), data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
        else:
            w.add_tensor(_gguf_name(name), value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_vocab(w, meta: dict) -> None:
    w.add_tokenizer_model(meta["model"])
    if meta.get("pre"):
        w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    if "scores" in meta:
        w.add_token_scores(meta["scores"])
    if "merges" in meta:
        w.add_token_merges(meta["merges"])
    for key, fn in (
        ("bos", w.add_bos_token_id),
        ("eos", w.add_eos_token_id),
        ("unk", w.add_unk_token_id),
        ("pad", w.add_pad_token_id),
    ):
        if key in meta:
            fn(meta[key])
    if "add_bos" in meta:
        w.add_add_bos_token(meta["add_bos"])
    if "chat_template" in meta:
        w.add_chat_template(meta["chat_template"])


# --------------------------------------------------------------- vocabularies


def _corpus_lines() -> list[str]:
    return [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def gpt2_vocab(pre: str, size: int = 480) -> dict:
    """A byte-level BPE trained on the presets' corpus with the split the
    ``pre`` name stands for, as GGUF metadata (tokens, types, merges)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from jaxserve.tokenizer.from_gguf import PRE_TOKENIZERS

    kind, pattern = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=GPT2_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id] + ["<think>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in GPT2_SPECIALS else 1 for t in tokens[:-1]] + [4]
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": 1,
        "eos": 2,
        "pad": 0,
        "add_bos": False,
        "chat_template": CHATML,
    }


def spm_vocab(size: int = 420) -> dict:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens,
    then pieces (▁ for spaces) scored so that earlier-learned pieces rank
    higher; no merges, as files converted from SentencePiece models."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1, "eos": 2, "unk": 0}


# ------------------------------------------------------------------ fixtures

_CYCLE = [QT[name] for name in SUPPORTED_TENSOR_TYPES]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("jaxserve-cache")
    old = os.environ.get("JAXSERVE_CACHE_DIR")
    os.environ["JAXSERVE_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("JAXSERVE_CACHE_DIR", None)
    else:
        os.environ["JAXSERVE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(folder, file name, HF weights): smollm-style vocabulary, untied head,
    the 16 matrices cycling through every supported tensor type."""
    folder = tmp_path_factory.mktemp("mixed")
    vocab = gpt2_vocab("smollm")
    weights = hf_weights(len(vocab["tokens"]), seed=3, tied=False)
    matrices = [n for n, v in weights.items() if v.ndim == 2]
    types = {name: _CYCLE[i % len(_CYCLE)] for i, name in enumerate(matrices)}
    assert set(types.values()) == set(_CYCLE)
    write_llama_gguf(folder / "mixed.gguf", vocab, weights, types, seed=3)
    return folder, "mixed.gguf", weights


@pytest.fixture(scope="module")
def spm_tied(tmp_path_factory):
    """SentencePiece-style vocabulary, tied embeddings, F16 matrices with Q8_0 q/k."""
    folder = tmp_path_factory.mktemp("spm")
    vocab = spm_vocab()
    weights = hf_weights(len(vocab["tokens"]), seed=5, tied=True)
    types = {n: (QT.Q8_0 if "q_proj" in n or "k_proj" in n else QT.F16) for n, v in weights.items() if v.ndim == 2}
    write_llama_gguf(folder / "spm.gguf", vocab, weights, types, seed=5)
    return folder, "spm.gguf", weights


def _hf_model(folder: Path, name: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    return model.eval()


def _hf_tokenizer(folder: Path, name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


# --------------------------------------------------------------------- tensors


def test_every_tensor_equals_transformers(mixed):
    folder, name, _ = mixed
    reference = {k: v.numpy() for k, v in _hf_model(folder, name).state_dict().items()}
    ckpt = GGUFCheckpoint(folder / name)
    seen = set()
    for hf_name, ref in reference.items():
        if "rotary" in hf_name:
            continue
        ours = ckpt.get(hf_name, tuple(ref.shape)).astype(np.float32)
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7, err_msg=hf_name)
        seen.add(ckpt.dtype_name(hf_name))
    assert seen == set(SUPPORTED_TENSOR_TYPES)


def test_qk_rows_come_back_in_hugging_face_order(tmp_path):
    vocab = gpt2_vocab("default", size=300)
    weights = hf_weights(len(vocab["tokens"]), seed=7, tied=True)
    path = write_llama_gguf(tmp_path / "f32.gguf", vocab, weights, QT.F32)
    ckpt = GGUFCheckpoint(path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(ckpt.get(name, weights[name].shape), weights[name])
    # the permutation really moved rows: reading without undoing it differs
    raw = np.asarray(ckpt._tensors["blk.1.attn_q.weight"].data)
    assert not np.array_equal(raw, weights["model.layers.1.self_attn.q_proj.weight"])
    assert sorted(unpermute_rows(8, 2).tolist()) == list(range(8))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_raw_blocks_are_unpermuted_rows_of_the_hf_matrix(tmp_path, qtype):
    vocab = gpt2_vocab("default", size=300)
    weights = hf_weights(len(vocab["tokens"]), seed=9, tied=True)
    path = write_llama_gguf(tmp_path / "q.gguf", vocab, weights, QT[qtype])
    ckpt = GGUFCheckpoint(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    blocks = ckpt.raw_blocks(name)
    assert (blocks.qtype, blocks.shape, blocks.blocks.dtype) == (qtype, (H * D, E), np.uint8)
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    assert blocks.blocks.shape == (H * D, E // block_size * type_size)
    # the same blocks a quantizer makes from the Hugging Face rows (rows are quantized independently)
    np.testing.assert_array_equal(blocks.blocks, gguf.quants.quantize(weights[name], QT[qtype]))
    np.testing.assert_array_equal(blocks.dequantize(), ckpt.get(name, (H * D, E)))
    if qtype == "Q8_0":  # the documented layout: f16 scale, then 32 int8
        b = blocks.blocks.reshape(H * D, -1, 34)
        manual = b[..., :2].copy().view(np.float16).astype(np.float32) * b[..., 2:].view(np.int8)
        np.testing.assert_allclose(manual.reshape(H * D, E), ckpt.get(name, (H * D, E)), rtol=1e-6)


# -------------------------------------------------------------------- generation


def _greedy_pair(folder: Path, name: str, prompt: str, new: int = 12):
    from jaxserve.models import greedy_generate, load_model
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer import Tokenizer

    model_folder = resolve_model(folder / name)
    tok = Tokenizer.from_folder(model_folder)
    ids = tok.encode(prompt)
    ours = greedy_generate(load_model(model_folder), ids, new)
    hf = _hf_model(folder, name)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return ids, ours, out[0, len(ids) :].tolist()


def test_greedy_tokens_equal_transformers_every_tensor_type(mixed, cache):
    folder, name, _ = mixed
    ids, ours, theirs = _greedy_pair(folder, name, "The queue holds 42 documents")
    assert len(ids) > 3 and ours == theirs


def test_greedy_tokens_equal_transformers_sentencepiece_tied(spm_tied, cache):
    folder, name, _ = spm_tied
    ids, ours, theirs = _greedy_pair(folder, name, "Workers pull jobs from the broker")
    assert ids[0] == 1  # add-BOS is the default of a SentencePiece vocabulary
    assert ours == theirs


def test_qwen2_file_with_biases_equals_transformers(tmp_path, cache):
    """Qwen2: q/k/v biases, rows not permuted, Qwen2's pre-tokenizer."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer import Tokenizer

    vocab = gpt2_vocab("qwen2")
    weights = hf_weights(len(vocab["tokens"]), seed=11, tied=False, qkv_bias=True)
    write_llama_gguf(tmp_path / "qwen2.gguf", vocab, weights, QT.Q8_0, arch="qwen2")
    folder = resolve_model(tmp_path / "qwen2.gguf")
    assert ModelConfig.from_folder(folder).architecture == "Qwen2ForCausalLM"
    ours = Tokenizer.from_folder(folder)
    theirs = _hf_tokenizer(tmp_path, "qwen2.gguf")
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    ids, mine, hf = _greedy_pair(tmp_path, "qwen2.gguf", "Producers put 12 jobs on the queue")
    assert mine == hf


def test_model_folder_files(mixed, cache):
    from jaxserve.models.config import ModelConfig
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer import Tokenizer

    folder, name, _ = mixed
    model_folder = resolve_model(folder / name)
    assert resolve_model(folder) == model_folder  # a folder holding one .gguf
    assert resolve_model(str(folder / name)) == model_folder  # cached, same identity
    assert model_folder.is_relative_to(cache)
    config = ModelConfig.from_folder(model_folder)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (E, I, LAYERS)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (H, KVH, D)
    assert config.tie_word_embeddings is False and config.rope_theta == 10000.0 and config.rms_norm_eps == 1e-5
    tok = Tokenizer.from_folder(model_folder)
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("pre", ["smollm", "default", "llama-bpe"])
def test_byte_level_tokenizer_equals_transformers(tmp_path, pre, cache):
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer import Tokenizer

    vocab = gpt2_vocab(pre)
    weights = hf_weights(len(vocab["tokens"]), seed=1, tied=True)
    write_llama_gguf(tmp_path / "v.gguf", vocab, weights, QT.F16)
    ours = Tokenizer.from_folder(resolve_model(tmp_path / "v.gguf"))
    theirs = _hf_tokenizer(tmp_path, "v.gguf")
    texts = TEXTS + ["<think>reasoning</think>", "1 22 333 4444 55555"]
    for text in texts:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.all_special_ids >= {0, 1, 2}


def test_sentencepiece_tokenizer_equals_transformers(spm_tied, cache):
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer import Tokenizer

    folder, name, _ = spm_tied
    ours = Tokenizer.from_folder(resolve_model(folder / name))
    theirs = _hf_tokenizer(folder, name)
    for text in TEXTS + ["<s>literal</s>", "ünïcödé ⅞ byte-fallback ☃"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # characters outside the pieces fall back to byte tokens <0xNN> (ids 3..258)
    assert any(3 <= i < 259 for i in ours.encode("☃"))


def test_merges_from_scores_prefers_the_higher_scored_piece():
    from jaxserve.tokenizer.from_gguf import merges_from_scores

    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0, 0, 0, -5.0, -1.0, -3.0]
    merges = merges_from_scores(tokens, scores)
    assert merges[0] == ("b", "c") and merges.index(("a", "b")) > merges.index(("a", "bc"))


# ------------------------------------------------------------------------ errors


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_unsupported_tensor_type_is_one_line(tmp_path, cache):
    from jaxserve.presets import resolve_model

    vocab = gpt2_vocab("default", size=300)
    weights = hf_weights(len(vocab["tokens"]), seed=2, tied=True)
    types = {"model.layers.1.mlp.up_proj.weight": QT.Q2_K}
    path = write_llama_gguf(tmp_path / "q2k.gguf", vocab, weights, types)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(path)
    line = _one_line(info.value)
    assert "blk.1.ffn_up.weight" in line and "Q2_K" in line and "supported: F32" in line


def test_unsupported_architecture_is_one_line(tmp_path, cache):
    from jaxserve.presets import resolve_model

    vocab = gpt2_vocab("default", size=300)
    weights = hf_weights(len(vocab["tokens"]), seed=2, tied=True)
    path = write_llama_gguf(tmp_path / "falcon.gguf", vocab, weights, arch="falcon")
    with pytest.raises(ModelLoadError) as info:
        resolve_model(path)
    line = _one_line(info.value)
    assert "unsupported GGUF architecture 'falcon'" in line and "llama" in line


def test_unknown_pre_tokenizer_is_one_line(tmp_path, cache):
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer import TokenizerLoadError

    vocab = dict(gpt2_vocab("default", size=300), pre="made-up-pre")
    weights = hf_weights(len(vocab["tokens"]), seed=2, tied=True)
    path = write_llama_gguf(tmp_path / "pre.gguf", vocab, weights)
    with pytest.raises(TokenizerLoadError) as info:
        resolve_model(path)
    assert "'made-up-pre'" in _one_line(info.value)


def test_folder_with_two_gguf_files_names_both(tmp_path, cache):
    from jaxserve.presets import resolve_model

    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="a.gguf, b.gguf"):
        resolve_model(tmp_path)


def test_smollm_pre_tokenizer_splits_every_digit():
    """llama.cpp splits each digit alone for "smollm" (StarCoder's split), so a
    vocabulary's digit merges never apply; "default" (GPT-2's split) uses them."""
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxserve.tokenizer.from_gguf import tokenizer_from_gguf

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>"] + alphabet + ["12", "Ġ1"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["1 2", "Ġ 1"],
        "tokenizer.ggml.eos_token_id": 0,
    }
    split = tokenizer_from_gguf(dict(meta, **{"tokenizer.ggml.pre": "smollm"})).tokenizer
    whole = tokenizer_from_gguf(dict(meta, **{"tokenizer.ggml.pre": "default"})).tokenizer
    assert split.encode("a 12").tokens == ["a", "Ġ", "1", "2"]
    assert whole.encode("a 12").tokens == ["a", "Ġ", "12"]  # "1 2" is the first merge


@pytest.mark.parametrize("keep", [100, 0.5, -100])
def test_a_truncated_file_says_so_in_one_line(tmp_path, cache, keep):
    """Cut in the header, in the middle of the tensors, or 100 bytes short."""
    from jaxserve.presets import resolve_model

    vocab = gpt2_vocab("default", size=300)
    whole = write_llama_gguf(tmp_path / "whole.gguf", vocab, hf_weights(len(vocab["tokens"]), seed=2, tied=True))
    data = Path(whole).read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError) as info:
        resolve_model(short)
    line = _one_line(info.value)
    assert "short.gguf is truncated or corrupt" in line and f"({cut} bytes" in line


def test_a_file_that_is_not_gguf_says_so(tmp_path, cache):
    from jaxserve.presets import resolve_model

    path = tmp_path / "notes.gguf"
    path.write_text("these are notes, not weights\n")
    with pytest.raises(ModelLoadError) as info:
        resolve_model(path)
    assert "notes.gguf is not a GGUF file" in _one_line(info.value)


def test_paths_that_exist_but_are_not_models_say_so(tmp_path, cache):
    from jaxserve.presets import UnknownModelError, resolve_model

    (tmp_path / "readme.txt").write_text("hello\n")
    with pytest.raises(UnknownModelError) as info:
        resolve_model(tmp_path)
    line = _one_line(info.value)
    assert "is a folder but not a model" in line and "no config.json and no .gguf file" in line
    with pytest.raises(UnknownModelError) as info:
        resolve_model(tmp_path / "readme.txt")
    assert "readme.txt' is a file but not a model" in _one_line(info.value)
