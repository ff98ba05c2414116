"""jaxserve's Llama-family models against transformers (the oracle) on tiny random checkpoints.

Bounds: float32 logits, relative Frobenius error < 1e-4; greedy continuation
of 32 tokens identical token for token; bfloat16 weights and cache (same
checkpoint loaded with dtype=bfloat16) vs float32 transformers logits,
relative Frobenius error < BF16_REL_BOUND = 3e-2.
"""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import model_fixtures as mf
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models import greedy_generate, load_model
from jaxserve.models.functional import forward_fn, logits_fn, split_model

F32_REL_BOUND = 1e-4
BF16_REL_BOUND = 3e-2
BLOCK = 16
NUM_BLOCKS = 12  # block 0 + 11 usable
TABLE_WIDTH = 8  # 128 tokens per sequence at most
T_BUCKET = 64  # every test step is padded to 64 tokens -> one compilation per model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            if name in mf.FAMILIES:
                cache[name] = mf.FAMILIES[name](str(root / name))
            elif name == "llama2_sharded":
                cache[name] = mf.llama2(str(root / name), seed=5, max_shard_size="100KB")
            elif name == "llama3_4x_keys":
                d = str(root / name)
                shutil.copytree(get("llama3"), d)
                cache[name] = mf.rewrite_config_4x(d)
            else:
                raise KeyError(name)
        return cache[name]

    return get


@functools.cache
def _hf(folder: str):
    return mf.hf_model(folder)


def _hf_logits(folder: str, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return _hf(folder)(torch.tensor(ids[None], dtype=torch.long)).logits[0].float().numpy()


@functools.partial(jax.jit, static_argnums=0)
def _step_all_logits(graphdef, state, ids, pos, cache, meta):
    hidden, cache = forward_fn(graphdef, state, ids, pos, cache, meta)
    return logits_fn(graphdef, state, hidden), cache


def _jax_logits(model, ids: np.ndarray, chunks: list[int] | None = None, seed: int = 0) -> np.ndarray:
    """Logits of every prompt position through the paged path, with a shuffled block table,
    the prompt fed in ``chunks`` (prefill continuing a cached prefix) padded to T_BUCKET."""
    n = len(ids)
    chunks = chunks or [n]
    assert sum(chunks) == n
    graphdef, state = split_model(model)
    c = model.config
    cache = KVCache.create(c.num_hidden_layers, NUM_BLOCKS, BLOCK, c.num_key_value_heads, c.head_dim, model.dtype)
    rng = np.random.default_rng(seed)
    table = np.zeros(TABLE_WIDTH, np.int32)
    need = -(-n // BLOCK)
    table[:need] = rng.permutation(np.arange(1, NUM_BLOCKS))[:need]
    out = []
    start = 0
    for size in chunks:
        tok = np.zeros(T_BUCKET, np.int32)
        pos = np.zeros(T_BUCKET, np.int32)
        slot = np.arange(T_BUCKET, dtype=np.int32) % BLOCK  # padding -> null block
        p = np.arange(start, start + size)
        tok[:size] = ids[start : start + size]
        pos[:size] = p
        slot[:size] = table[p // BLOCK] * BLOCK + p % BLOCK
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slot),
            token_seq=jnp.zeros(T_BUCKET, jnp.int32),
            block_tables=jnp.asarray(table[None]),
            context_lens=jnp.asarray([start + size], jnp.int32),
            logits_indices=jnp.asarray([start + size - 1], jnp.int32),
        )
        logits, cache = _step_all_logits(graphdef, state, jnp.asarray(tok), jnp.asarray(pos), cache, meta)
        out.append(np.asarray(logits)[:size])
        start += size
    return np.concatenate(out)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, mf.VOCAB, n).astype(np.int32)


@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_float32_logits_match_transformers(family, folders):
    folder = folders(family)
    loaded = load_model(folder)
    assert loaded.model.dtype == jnp.float32
    for n in (1, 7, 64):
        ids = _prompt(n, seed=n)
        ref = _hf_logits(folder, ids)
        ours = _jax_logits(loaded.model, ids, seed=n)
        assert ours.shape == ref.shape
        assert _rel(ours, ref) < F32_REL_BOUND, (family, n, _rel(ours, ref))
    # the same 64 tokens as a prefill chunk continuing a cached 40-token prefix
    ids = _prompt(64, seed=64)
    ours = _jax_logits(loaded.model, ids, chunks=[40, 24], seed=3)
    assert _rel(ours, _hf_logits(folder, ids)) < F32_REL_BOUND


@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_greedy_continuation_matches_transformers(family, folders):
    folder = folders(family)
    loaded = load_model(folder)
    prompt = _prompt(7, seed=11).tolist()
    ours = greedy_generate(loaded, prompt, 32)
    with torch.no_grad():
        theirs = _hf(folder).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)
    theirs = theirs[0, len(prompt) :].tolist()
    assert len(ours) == 32
    assert ours == theirs


@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_bfloat16_close_to_float32_transformers(family, folders):
    folder = folders(family)
    loaded = load_model(folder, dtype="bfloat16")
    assert loaded.model.dtype == jnp.bfloat16
    assert loaded.model.layers[0].wqkv[...].dtype == jnp.bfloat16
    ids = _prompt(64, seed=21)
    ours = _jax_logits(loaded.model, ids)
    assert ours.dtype == np.float32
    rel = _rel(ours, _hf_logits(folder, ids))
    assert rel < BF16_REL_BOUND, (family, rel)


def test_sharded_checkpoint(folders):
    folder = folders("llama2_sharded")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert not os.path.isfile(os.path.join(folder, "model.safetensors"))
    loaded = load_model(folder)
    ids = _prompt(7, seed=5)
    assert _rel(_jax_logits(loaded.model, ids), _hf_logits(folder, ids)) < F32_REL_BOUND


def test_transformers_4x_config_keys(folders):
    folder = folders("llama3_4x_keys")
    import json

    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    assert "rope_parameters" not in d and d["rope_scaling"]["rope_type"] == "llama3"
    loaded = load_model(folder)
    cfg = loaded.config
    assert cfg.rope.rope_type == "llama3" and cfg.rope_theta == 500000.0
    assert cfg.rope.original_max_position_embeddings == 32
    ids = _prompt(64, seed=9)
    # oracle: the original (5.x-keyed) checkpoint in transformers
    assert _rel(_jax_logits(loaded.model, ids), _hf_logits(folders("llama3"), ids)) < F32_REL_BOUND


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path, folders):
    """A checkpoint saved in bfloat16 loads as bfloat16 when dtype is None."""
    d = str(tmp_path / "bf16")
    m = _hf(folders("llama2"))
    m.to(torch.bfloat16).save_pretrained(d)
    m.to(torch.float32)
    loaded = load_model(d)
    assert loaded.model.dtype == jnp.bfloat16
    ids = _prompt(7, seed=4)
    assert _rel(_jax_logits(loaded.model, ids), _hf_logits(folders("llama2"), ids)) < BF16_REL_BOUND
