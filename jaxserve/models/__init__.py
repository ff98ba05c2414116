"""jaxserve.models: every registered model family over the paged KV cache.

Public API::

    from jaxserve.models import load_model, ModelConfig, CausalLM, ModelLoadError
    loaded = load_model("path/to/hf-folder", dtype="bfloat16")   # LoadedModel(config, model, folder)
    fn, state = make_forward(loaded.model)                         # pure fn for jax.jit

Which architectures load: :func:`jaxserve.models.registry.supported_architectures`.
"""

from jaxserve.models.config import ModelConfig, MoEConfig, RopeConfig
from jaxserve.models.decoder import CausalLM
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.functional import make_forward, make_logits, make_step, split_model
from jaxserve.models.greedy import greedy_generate
from jaxserve.models.loader import LoadedModel, load_model

__all__ = [
    "CausalLM",
    "ModelConfig",
    "MoEConfig",
    "RopeConfig",
    "ModelLoadError",
    "LoadedModel",
    "load_model",
    "greedy_generate",
    "make_forward",
    "make_logits",
    "make_step",
    "split_model",
]
