"""A checkpoint for engine tests: the tiny preset's tokenizer with
transformers-written random weights large enough that greedy decoding never
hinges on a near tie (the preset's own std of 0.02 gives nearly flat logits,
where float rounding order could flip an argmax)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def build_engine_checkpoint(
    folder: Path,
    *,
    seed: int = 7,
    max_position_embeddings: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxserve.presets import resolve_model

    tiny = resolve_model("tiny")
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, folder / name)
    import json

    tiny_cfg = json.loads((tiny / "config.json").read_text())
    cfg = LlamaConfig(
        vocab_size=tiny_cfg["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=tiny_cfg.get("bos_token_id"),
        eos_token_id=tiny_cfg.get("eos_token_id"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.eval()
    model.save_pretrained(folder)
    return folder
