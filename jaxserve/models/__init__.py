"""jaxserve.models: every registered model family over the paged KV cache.

Public API::

    from jaxserve.models import load_model, ModelConfig, CausalLM, ModelLoadError
    loaded = load_model("path/to/hf-folder", dtype="bfloat16")   # LoadedModel(config, model, folder)
    fn, state = make_forward(loaded.model)                         # pure fn for jax.jit

Which architectures load: :func:`jaxserve.models.registry.supported_architectures`.

The names load on first use (PEP 562): the worker's process imports
``jaxserve.models.errors`` and ``jaxserve.models.config`` without JAX, whose
runtime is the engine process's (``tests/test_import_rules.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them (re-exports)
    from jaxserve.models.config import ModelConfig, MoEConfig, RopeConfig  # noqa: F401
    from jaxserve.models.decoder import CausalLM  # noqa: F401
    from jaxserve.models.errors import ModelLoadError  # noqa: F401
    from jaxserve.models.functional import make_forward, make_logits, make_step, split_model  # noqa: F401
    from jaxserve.models.greedy import greedy_generate  # noqa: F401
    from jaxserve.models.loader import LoadedModel, load_model  # noqa: F401

#: each public name and the submodule that defines it
_HOMES = {
    "CausalLM": "decoder",
    "ModelConfig": "config",
    "MoEConfig": "config",
    "RopeConfig": "config",
    "ModelLoadError": "errors",
    "LoadedModel": "loader",
    "load_model": "loader",
    "greedy_generate": "greedy",
    "make_forward": "functional",
    "make_logits": "functional",
    "make_step": "functional",
    "split_model": "functional",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxserve.models.{home}"), name)
