"""Mixtral, Qwen3-MoE and gpt-oss beyond the shared parity tests: routing, activation, yarn, configs, stop tokens, the CLI.

The shared tests (``test_model_parity.py``, ``test_family_engine_parity.py``,
``test_family_gguf.py``) compare each fixture's logits, tokens and scores
with transformers. Here, against transformers' own modules on random
inputs: each family's router (which experts, with which weights), gpt-oss's
clamped activation where its clamps bind, and YaRN's frequencies and
attention factor over the settings configs use; then how configs are read
(which Qwen3-MoE layers are MoE, gpt-oss's defaults and its released config
with MXFP4 experts), which tokens stop generation, and ``jaxserve generate
--chat`` on a Mixtral folder.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

import model_fixtures as mf
from jaxserve.engine.engine import stop_token_ids
from jaxserve.models.config import ModelConfig, MoEConfig, read_rope
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.moe import expert_activation, route
from jaxserve.models.rope import inv_frequencies
from jaxserve.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, EXPERTS, TOKENS = 32, 8, 200


def _router_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(TOKENS, HIDDEN, generator=g),
        torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5,
        torch.randn(EXPERTS, generator=g) * 0.5,
    )


def _ours(logits: torch.Tensor, m: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    ids, weights = route(jnp.asarray(logits.numpy()), m)
    return np.asarray(ids), np.asarray(weights)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_normalized", "gpt_oss"])
def test_routing_equals_transformers_router(family):
    """Each token's experts (in order) and weights, from the same router weights."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x, w, b = _router_case(seed=len(family))
    sizes = dict(hidden_size=HIDDEN, num_experts_per_tok=3)
    if family == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(num_local_experts=EXPERTS, **sizes))
        m = ModelConfig.from_dict(_mixtral_config()).moe
    elif family.startswith("qwen3_moe"):
        normalized = family.endswith("normalized")
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=EXPERTS, norm_topk_prob=normalized, **sizes))
        m = ModelConfig.from_dict(_qwen3_moe_config(norm_topk_prob=normalized)).moe
    else:
        router = GptOssTopKRouter(GptOssConfig(num_local_experts=EXPERTS, **sizes))
        m = ModelConfig.from_dict(_gpt_oss_config()).moe
    assert m is not None
    m = MoEConfig(**{**m.__dict__, "num_experts": EXPERTS, "top_k": 3, "layers": ()})
    with torch.no_grad():
        router.weight.copy_(w)
        logits = x @ w.T
        if family == "gpt_oss":
            router.bias.copy_(b)
            logits = logits + b
        _, scores, indices = router(x)
    ids, weights = _ours(logits, m)
    np.testing.assert_array_equal(ids, indices.numpy())
    np.testing.assert_allclose(weights, scores.float().numpy(), rtol=1e-6, atol=1e-7)
    if family in ("mixtral", "qwen3_moe_normalized", "gpt_oss"):
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    else:  # Qwen3-MoE without norm_topk_prob: the k softmax probabilities as they are
        assert (weights.sum(-1) < 1.0).all() and weights.sum(-1).min() < 0.9


def test_gpt_oss_activation_equals_transformers_where_the_clamps_bind():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=64, num_local_experts=2, swiglu_limit=2.5))
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(50, 128, generator=g) * 4  # columns gate, up, gate, up, ...
    ref = experts._apply_gate(gate_up).numpy()
    gate, up = gate_up[:, 0::2].numpy(), gate_up[:, 1::2].numpy()
    assert (gate > 2.5).any() and (np.abs(up) > 2.5).any()  # both clamps bind somewhere
    m = MoEConfig(num_experts=2, top_k=1, intermediate_size=64, activation="swiglu_oss", swiglu_limit=2.5)
    ours = np.asarray(expert_activation(jnp.asarray(gate), jnp.asarray(up), m))
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        {},  # gpt-oss as released
        {"truncate": True},
        {"factor": 4.0, "original_max_position_embeddings": 64},
        {"beta_fast": 8.0, "beta_slow": 2.0},
        {"attention_factor": 1.1},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
    ],
)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_equals_transformers(params, head_dim):
    """Frequencies (float32) and the attention factor that scales cos and sin."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        **params,
    }
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope)
    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = read_rope(json.loads(config.to_json_string()), "config.json")
    np.testing.assert_allclose(inv_frequencies(ours, head_dim), inv.numpy(), rtol=2e-7)
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)


# ------------------------------------------------------------------ configs

SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _mixtral_config(**kw) -> dict:
    return {"architectures": ["MixtralForCausalLM"], **SIZES, "num_local_experts": 8, "num_experts_per_tok": 2, **kw}


def _qwen3_moe_config(**kw) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        **SIZES,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        **kw,
    }


def _gpt_oss_config(**kw) -> dict:
    """gpt-oss-20b's config.json keys (transformers 4.x spelling), tiny sizes."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **SIZES,
        "head_dim": 16,
        "num_local_experts": 4,
        "experts_per_token": 2,
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        **kw,
    }


def test_mixtral_config():
    c = ModelConfig.from_dict(_mixtral_config(sliding_window=32))
    assert c.family == "mixtral" and c.layer_windows == (32,) * 4
    assert c.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=96, router="softmax_topk", normalize_topk=True)
    assert ModelConfig.from_dict(_mixtral_config()).layer_windows == (None,) * 4


@pytest.mark.parametrize(
    "keys, moe_layers",
    [
        ({}, (True,) * 4),
        ({"decoder_sparse_step": 2}, (False, True, False, True)),
        ({"mlp_only_layers": [0, 3]}, (False, True, True, False)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (False, False, False, True)),
    ],
)
def test_qwen3_moe_layers_as_transformers_builds_them(keys, moe_layers):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = _qwen3_moe_config(**keys)
    c = ModelConfig.from_dict(d)
    assert tuple(c.is_moe_layer(i) for i in range(4)) == moe_layers
    assert c.moe is not None and not c.moe.normalize_topk and c.qk_norm == "head"
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "architectures"}))
    assert tuple(hasattr(layer.mlp, "experts") for layer in hf.model.layers) == moe_layers


def test_qwen3_moe_reads_either_experts_key_and_its_window():
    """transformers saves ``num_experts`` as ``num_local_experts``; Qwen's own configs say ``num_experts``."""
    d = _qwen3_moe_config(use_sliding_window=True, sliding_window=64)
    d["num_local_experts"] = d.pop("num_experts")
    c = ModelConfig.from_dict(d)
    assert c.moe is not None and c.moe.num_experts == 8 and c.layer_windows == (64,) * 4
    assert ModelConfig.from_dict(_qwen3_moe_config(sliding_window=64)).layer_windows == (None,) * 4


def test_gpt_oss_config_as_released():
    c = ModelConfig.from_dict(_gpt_oss_config())
    assert c.qkv_bias and c.o_bias and c.attention_sinks
    assert c.layer_windows == (128, None, 128, None)  # transformers' defaults: even layers slide, 128 tokens
    assert c.rope.rope_type == "yarn" and not c.rope.truncate
    assert c.rope.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    assert c.moe == MoEConfig(
        num_experts=4,
        top_k=2,
        intermediate_size=96,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oss",
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    )


def test_gpt_oss_with_mxfp4_experts_is_one_line_naming_it():
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with pytest.raises(ModelLoadError, match=r"MXFP4 \(quantization_config\)") as err:
        ModelConfig.from_dict(_gpt_oss_config(quantization_config=quant), source="gpt-oss-20b/config.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("gpt-oss-20b/config.json: ")


# --------------------------------------------------------------- stop tokens


@pytest.mark.parametrize(
    "name, stops, not_stops",
    [
        ("mixtral", (), ("<|im_end|>",)),
        ("qwen3_moe", ("<|im_end|>",), ()),
        # harmony: <|return|> ends the final answer, <|call|> a tool call;
        # <|end|> ends every message, the reasoning before the answer too
        ("gpt_oss", ("<|return|>", "<|call|>"), ("<|end|>",)),
    ],
)
def test_end_of_turn_tokens_stop_generation(name, stops, not_stops, tmp_path):
    folder = mf.with_tokenizer(mf.FAMILIES[name](str(tmp_path / name)))
    path = os.path.join(folder, "tokenizer.json")
    hf = HFTokenizer.from_file(path)
    hf.add_special_tokens([AddedToken(t, special=True) for t in stops + not_stops])
    hf.save(path)
    tok = Tokenizer.from_folder(folder)
    ids = stop_token_ids(tok, ModelConfig.from_folder(folder))
    assert set(tok.eos_token_ids) <= set(ids)
    for t in stops:
        assert tok.token_to_id(t) in ids, t
    for t in not_stops:
        assert tok.token_to_id(t) not in ids, t


# ----------------------------------------------------------------------- CLI


def _jaxserve(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["JAXSERVE_STATE_DIR"] = str(cwd / "state")
    return subprocess.run(
        [sys.executable, "-m", "jaxserve", *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd
    )


def test_generate_chat_on_a_mixtral_folder_prints_text(tmp_path):
    folder = mf.with_tokenizer(mf.mixtral(str(tmp_path / "mixtral")))
    proc = _jaxserve(
        ["generate", "--model", folder, "--chat", "--max-tokens", "5", "--json", "Name a river."], tmp_path
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert isinstance(out["text"], str) and 1 <= out["usage"]["completion_tokens"] <= 5

    # a config that leaves out the experts is one line naming the file and the key
    mf.edit_config(folder, lambda d: d.pop("num_local_experts"))
    proc = _jaxserve(["generate", "--model", folder, "--chat", "Name a river."], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_local_experts" in lines[0] and "config.json" in lines[0], lines
