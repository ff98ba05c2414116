"""Mistral (7B v0.1 - v0.3, Ministral text): Llama without biases, with a sliding window on every layer.

The window (v0.1's 4096) is dropped when it is at least the context length
(:attr:`ModelConfig.layer_windows`). llama.cpp converts Mistral checkpoints
as ``llama`` files (read by the Llama family, without the window, as
llama.cpp runs them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, optional_int, read_base
from jaxserve.models.family import Family

ARCHITECTURE = "MistralForCausalLM"


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base(d, ARCHITECTURE, source, family="mistral")
    return dataclasses.replace(c, sliding_window=optional_int(d.get("sliding_window")))


FAMILY = Family("mistral", (ARCHITECTURE,), read_config)
