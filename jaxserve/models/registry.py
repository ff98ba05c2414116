"""The model registry: architecture name -> family module (:mod:`jaxserve.models.families`).

The loader, the GGUF reader, the presets and the engine ask here; nothing
else names a family. A config names its family by ``architectures`` (or,
without it, ``model_type``); a GGUF file by ``general.architecture``.
Anything else is a one-line :class:`ModelLoadError` that lists what is
supported.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Any

from jaxserve.models.errors import ModelLoadError
from jaxserve.models.family import Family


@functools.cache
def families() -> tuple[Family, ...]:
    """Every registered family, in the order of ``families.FAMILIES``."""
    from jaxserve.models.families import FAMILIES

    return tuple(FAMILIES)


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in families() for a in f.architectures)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(dict.fromkeys(a for f in families() if f.gguf for a in f.gguf.architectures))


def family(name: str) -> Family:
    """The family registered as ``name`` (``ModelConfig.family``)."""
    for f in families():
        if f.name == name:
            return f
    raise KeyError(name)


def family_of_architecture(architecture: str) -> Family | None:
    for f in families():
        if architecture in f.architectures:
            return f
    return None


def family_of_config(d: Mapping[str, Any], source: str) -> Family:
    """The family that reads ``config.json`` ``d``: by its ``architectures``, else its ``model_type``."""
    supported = ", ".join(supported_architectures())
    archs = d.get("architectures")
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        for a in archs:
            f = family_of_architecture(str(a))
            if f is not None:
                return f
        raise ModelLoadError(f"{source}: unsupported architecture {', '.join(map(str, archs))}; supported: {supported}")
    model_type = d.get("model_type")
    for f in families():
        if model_type in f.model_types:
            return f
    raise ModelLoadError(
        f"{source}: unsupported architecture (no 'architectures', model_type {model_type!r}); supported: {supported}"
    )


def family_of_gguf(arch: Any, tensor_names: Collection[str], path: str) -> Family:
    """The family that reads a GGUF file of ``general.architecture`` ``arch``."""
    for f in families():
        if f.gguf is not None and arch in f.gguf.architectures:
            if f.gguf.claims is None or f.gguf.claims(tensor_names):
                return f
    raise ModelLoadError(
        f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(supported_gguf_architectures())}"
    )


__all__ = [
    "families",
    "family",
    "family_of_architecture",
    "family_of_config",
    "family_of_gguf",
    "supported_architectures",
    "supported_gguf_architectures",
]
