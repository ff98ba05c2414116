"""Errors raised while reading a model folder."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model folder that jaxserve cannot load.

    The message always names the offending thing (file, tensor, architecture,
    config key) so that it can be shown to an operator unchanged.
    """
