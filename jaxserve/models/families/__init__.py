"""One module per model family; :data:`FAMILIES` is what the registry serves.

Adding a family: write its module (config reading, weight names, GGUF
names; see ``docs/architecture.md``), list its ``FAMILY`` here, and add its
checkpoint to ``tests/model_fixtures.py`` so the parity tests cover it.
"""

from __future__ import annotations

from jaxserve.models.families import (
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    smollm3,
)
from jaxserve.models.family import Family

FAMILIES: list[Family] = [
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    smollm3.FAMILY,
    olmo2.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    gpt_oss.FAMILY,
]

__all__ = ["FAMILIES"]
