"""Tiny random Hugging Face checkpoints for model tests, written with transformers' own
classes and ``save_pretrained`` (float32, seeded).

Every builder takes the folder, a seed and config overrides (``vocab_size=``
for the GGUF tests, whose converter needs SmolLM2's tokenizer and its
vocabulary size). :data:`FAMILIES` maps a name to each family's builder; the
parity tests (``test_model_parity.py``, ``test_family_engine_parity.py``,
``test_family_gguf.py``) cover every entry.

Every parameter is re-drawn (norm weights around 1, biases non-zero) so that
biases and norms really take part in the parity checks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

VOCAB = 512  # the tiny preset's tokenizer, so engine tests can load a fixture folder (with_tokenizer)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per kv head
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


#: the matrices' standard deviation (``std=`` raises it where a test needs peaked logits)
STD = 0.15


def _randomize(model: torch.nn.Module, seed: int, std: float = STD) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(std * noise)


def _save(model, folder: str, **kw) -> str:
    model.eval()
    model.save_pretrained(folder, **kw)
    return folder


def llama2(
    folder: str, *, std: float = STD, tied: bool = False, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **{**TINY, **overrides}, tie_word_embeddings=tied, rope_theta=10000.0, attn_implementation="eager"
    )
    m = LlamaForCausalLM(cfg)
    _randomize(m, seed, std)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    return _save(m, folder, **kw)


def llama3(folder: str, *, std: float = STD, seed: int = 1, tied: bool = True, bias: bool = True, **overrides) -> str:
    """Llama 3 style: llama3 rope scaling, large theta, tied embeddings, attention and MLP biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **{**TINY, **overrides},
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        attn_implementation="eager",
    )
    m = LlamaForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def mistral(folder: str, *, std: float = STD, seed: int = 2, sliding_window: int | None = 24, **overrides) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(
        **{**TINY, **overrides}, sliding_window=sliding_window, tie_word_embeddings=False, attn_implementation="eager"
    )
    m = MistralForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def qwen2(folder: str, *, std: float = STD, seed: int = 3, tied: bool = True, **overrides) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        **{**TINY, **overrides}, tie_word_embeddings=tied, rope_theta=1000000.0, attn_implementation="eager"
    )
    m = Qwen2ForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def qwen3(folder: str, *, std: float = STD, seed: int = 4, tied: bool = False, **overrides) -> str:
    """Qwen3 with q/k norms, head_dim apart from hidden / heads, and a
    sliding window on its first and last layers (the middle one attends to all)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    window = dict(
        use_sliding_window=True,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    cfg = Qwen3Config(
        **{**TINY, "num_hidden_layers": 3, **window, **overrides},
        head_dim=24,
        tie_word_embeddings=tied,
        rope_theta=1000000.0,
        attn_implementation="eager",
    )
    m = Qwen3ForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def mixtral(folder: str, *, std: float = STD, seed: int = 6, sliding_window: int | None = 24, **overrides) -> str:
    """Mixtral: 4 experts of width 64, top-2, a sliding window on every layer.

    The MoE fixtures' expert widths are multiples of 32, so that llama.cpp's
    Q8_0 (32-wide blocks along a matrix's input) takes every expert matrix,
    the down projections included."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    moe = dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    cfg = MixtralConfig(
        **{**TINY, **moe, "sliding_window": sliding_window, **overrides},
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        attn_implementation="eager",
    )
    m = MixtralForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def qwen3_moe(folder: str, *, std: float = STD, seed: int = 7, **overrides) -> str:
    """Qwen3-MoE: 8 experts of width 32, top-2, weights not renormalized
    (transformers' default), and a dense MLP (width 96) on the middle layer
    of three (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    moe = dict(
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    )
    cfg = Qwen3MoeConfig(
        **{**TINY, **moe, **overrides},
        head_dim=24,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        attn_implementation="eager",
    )
    m = Qwen3MoeForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def gpt_oss(folder: str, *, std: float = 0.1, seed: int = 10, **overrides) -> str:
    """gpt-oss: a sliding layer (24 tokens), then a full one; attention sinks
    around 1 (so they take a real share of each softmax); YaRN as released
    (factor 32 over 4096, betas 32 / 1, no rounding), which with head_dim 16
    puts the ramp across dimensions 2-4; 4 biased experts of width 64, top-2,
    and an activation limit low enough (1.5) that the clamps bind.

    Routing is discontinuous: where a token's k-th and (k+1)-th router
    logits nearly tie, bfloat16 rounding swaps the expert, and one swapped
    token in the last layer puts the logits 5-10 % off float32 (in
    transformers' own bfloat16 run as in jaxserve's), past the bfloat16
    parity bound, which is about rounding, not routing. These draws (two
    layers, spread 0.1, seed 10) route the parity tests' prompts without a
    swap; with a third layer, the usual spread or other seeds some do."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    shape = dict(
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=24,
        swiglu_limit=1.5,
        max_position_embeddings=131072,  # 4096 * 32: what yarn's factor says
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )
    cfg = GptOssConfig(**{**TINY, **shape, **overrides}, tie_word_embeddings=False, attn_implementation="eager")
    m = GptOssForCausalLM(cfg)
    _randomize(m, seed, std)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
    return _save(m, folder)


def _gemma_norms(model: torch.nn.Module) -> None:
    """Gemma stores a norm's weight minus one (it scales by ``1 + w``): shift
    the re-drawn weights (around 1) to around 0, so each norm scales by about
    1 as trained Gemma norms do, not by 2 (which makes the tiny model's
    attention so peaked that bfloat16 rounding swamps its logits)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)


def gemma2(folder: str, *, std: float = STD, seed: int = 20, **overrides) -> str:
    """Gemma 2: three layers (sliding over 24 tokens, full, sliding: the
    default pattern), head_dim 24 apart from hidden / heads, an attention
    scale from query_pre_attn_scalar 40 (not head_dim), both soft-caps
    binding (attention 5, final 6), tied embeddings."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(
        **{
            **TINY,
            "num_hidden_layers": 3,
            "head_dim": 24,
            "query_pre_attn_scalar": 40,
            "sliding_window": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 6.0,
            "pad_token_id": 0,
            **overrides,
        },
        attn_implementation="eager",
    )
    m = Gemma2ForCausalLM(cfg)
    _randomize(m, seed, std)
    _gemma_norms(m)
    return _save(m, folder)


#: Gemma 3's rope: the global layers' base and linear scaling, the local layers' own base
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


def gemma3(folder: str, *, std: float = STD, seed: int = 21, **overrides) -> str:
    """Gemma 3 (text): three layers, sliding (24 tokens), sliding, global (so
    both rope tables are used: the global one scaled), q/k norms, head_dim 32,
    query_pre_attn_scalar 20, the final soft-cap on (6), untied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        **{
            **TINY,
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 20,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {k: dict(v) for k, v in GEMMA3_ROPE.items()},
            "final_logit_softcapping": 6.0,
            "tie_word_embeddings": False,
            "pad_token_id": 0,
            **overrides,
        },
        attn_implementation="eager",
    )
    m = Gemma3ForCausalLM(cfg)
    _randomize(m, seed, std)
    _gemma_norms(m)
    return _save(m, folder)


def longrope_factors(rotary: int) -> dict[str, list[float]]:
    """LongRoPE factor lists for ``rotary`` rotated features, shaped like
    Phi-3's: short ones near 1, long ones growing to about 15 over the
    frequencies (so the two sets rotate visibly differently)."""
    n = rotary // 2
    return {
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 14.0 * i / max(n - 1, 1) for i in range(n)],
    }


def phi3(
    folder: str,
    *,
    std: float = STD,
    seed: int = 5,
    original: int = 128,
    sliding_window: int | None = 24,
    tied: bool = False,
    partial_rotary: float = 1.0,
    **overrides,
) -> str:
    """Phi-3 style: fused qkv / gate_up, LongRoPE (original context 128 of
    256: the shared parity tests' sequences all stay below it; the LongRoPE
    tests pass a small ``original``) and a sliding window on every layer."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    rotary = int(kw["hidden_size"] // kw["num_attention_heads"] * partial_rotary)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary}
    cfg = Phi3Config(
        **kw,
        rope_parameters={**rope, **longrope_factors(rotary)},
        original_max_position_embeddings=original,
        sliding_window=sliding_window,
        tie_word_embeddings=tied,
        pad_token_id=0,
        attn_implementation="eager",
    )
    m = Phi3ForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def phi4mini(folder: str, *, seed: int = 6, **overrides) -> str:
    """Phi-4-mini style: LongRoPE on the first 3/4 of each head, tied embeddings, no window."""
    kw = {"partial_rotary": 0.75, "tied": True, "sliding_window": None, **overrides}
    return phi3(folder, seed=seed, **kw)


def smollm3(
    folder: str,
    *,
    std: float = STD,
    seed: int = 7,
    tied: bool = True,
    no_rope_layers: list[int] | None = [1, 0, 1],  # noqa: B006 - never mutated
    **overrides,
) -> str:
    """SmolLM3 with a NoPE middle layer between two rope layers; that layer
    also slides (24 tokens), as transformers defaults ``layer_types`` when
    ``use_sliding_window`` is set."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(seed)
    window = dict(use_sliding_window=True, sliding_window=24)
    cfg = SmolLM3Config(
        **{**TINY, "num_hidden_layers": 3, **window, **overrides},
        no_rope_layers=no_rope_layers,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 2000000.0},
        pad_token_id=0,
        attn_implementation="eager",
    )
    m = SmolLM3ForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def olmo2(folder: str, *, std: float = STD, seed: int = 8, tied: bool = False, **overrides) -> str:
    """OLMo 2: post-norms, q/k norms over all heads."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(seed)
    cfg = Olmo2Config(
        **{**TINY, **overrides},
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        pad_token_id=0,
        attn_implementation="eager",
    )
    m = Olmo2ForCausalLM(cfg)
    _randomize(m, seed, std)
    return _save(m, folder)


def with_tokenizer(folder: str) -> str:
    """Copy the tiny preset's tokenizer files (512 tokens, = VOCAB) into a
    fixture folder, so the engine (which needs a tokenizer) can serve it."""
    import shutil

    from jaxserve.presets import resolve_model

    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, os.path.join(folder, name))
    return folder


def rewrite_config_4x(folder: str) -> str:
    """Rewrite config.json in the transformers 4.x key style: ``rope_theta`` and
    ``rope_scaling`` at the top level instead of ``rope_parameters``; ``torch_dtype``."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    params = dict(d.pop("rope_parameters", None) or {})
    d["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", "default")
    d["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **params}
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    d["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
    return folder


def edit_config(folder: str, fn: Callable[[dict], None]) -> str:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
    return folder


def hf_model(folder: str):
    """The transformers model of a fixture folder, float32, eager attention, eos disabled."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


FAMILIES: dict[str, Callable[[str], str]] = {
    "llama2": llama2,
    "llama3": llama3,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "phi3": phi3,
    "phi4mini": phi4mini,
    "smollm3": smollm3,
    "olmo2": olmo2,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
}
