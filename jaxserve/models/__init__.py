"""jaxserve.models: Llama-family models over the paged KV cache.

Public API::

    from jaxserve.models import load_model, ModelConfig, LlamaForCausalLM, ModelLoadError
    loaded = load_model("path/to/hf-folder", dtype="bfloat16")   # LoadedModel(config, model, folder)
    fn, state = make_forward(loaded.model)                         # pure fn for jax.jit
"""

from jaxserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.functional import make_forward, make_logits, make_step, split_model
from jaxserve.models.greedy import greedy_generate
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.loader import LoadedModel, load_model

__all__ = [
    "ModelConfig",
    "RopeConfig",
    "SUPPORTED_ARCHITECTURES",
    "ModelLoadError",
    "LlamaForCausalLM",
    "LoadedModel",
    "load_model",
    "greedy_generate",
    "make_forward",
    "make_logits",
    "make_step",
    "split_model",
]
