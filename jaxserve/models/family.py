"""What a model family is to jaxserve: how to read its config, where its weights are, how its GGUF files are named.

Every family shares one forward pass (:mod:`jaxserve.models.decoder`,
built from the blocks in :mod:`jaxserve.models.blocks`), switched by the
:class:`~jaxserve.models.config.ModelConfig` the family's ``read_config``
returns. So a family module under :mod:`jaxserve.models.families` is data
and small functions: the architecture names it answers to, the reading of
its ``config.json``, its weights' names (:mod:`jaxserve.models.weights`),
its GGUF names (:mod:`jaxserve.models.gguf_spec`) and the tokens that end
an assistant turn in its chat template. ``docs/architecture.md`` ("Adding
a model family") walks through writing one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxserve.models.config import ModelConfig
from jaxserve.models.gguf_spec import GGUFSpec
from jaxserve.models.weights import ModelWeights, llama_weights


@dataclasses.dataclass(frozen=True)
class Family:
    #: the registry's key (``qwen3``); ``ModelConfig.family``
    name: str
    #: Hugging Face ``architectures`` names it reads (``Qwen3ForCausalLM``)
    architectures: tuple[str, ...]
    #: ``(config.json as a dict, where it came from) -> ModelConfig``
    read_config: Callable[[Mapping[str, Any], str], ModelConfig]
    #: where each parameter comes from in a checkpoint; by default Llama's
    #: names, which a family that only switches ``ModelConfig`` fields keeps
    weights: Callable[[ModelConfig], ModelWeights] = llama_weights
    #: ``model_type`` values it reads when a config has no ``architectures``;
    #: left empty, its ``name`` alone: the registry names a family as its
    #: configs' ``model_type`` does (Gemma 3 reads two, ``gemma3_text`` and
    #: the multimodal ``gemma3``), so a family module writes it once
    model_types: tuple[str, ...] = ()
    #: how its GGUF files are read; None when llama.cpp has no such architecture
    gguf: GGUFSpec | None = None
    #: tokens that end an assistant turn in its chat template, besides the
    #: eos token (``<end_of_turn>``); each one in the vocabulary stops generation
    end_of_turn: tuple[str, ...] = ()
    #: its chat templates have no system role: a leading system message a
    #: template refuses is folded into the first user message as
    #: ``system + "\n\n" + user`` (what Gemma 3's own template does) and
    #: the messages rendered again (:meth:`jaxserve.tokenizer.Tokenizer.apply_chat_template`)
    fold_system: bool = False
    #: ``(prefix, older prefix)``: a checkpoint of an older layout names the
    #: tensors under the first prefix with the second instead (Gemma 3's
    #: multimodal files: ``language_model.model.`` for ``model.language_model.``);
    #: the loader reads whichever the checkpoint has
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.model_types:
            object.__setattr__(self, "model_types", (self.name,))


__all__ = ["Family"]
