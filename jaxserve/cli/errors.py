"""Turn the errors a user can cause (bad model path, bad config) into one
clean line on stderr instead of a traceback."""

from __future__ import annotations

import contextlib
from typing import Iterator

import click


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    from jaxserve.models.errors import ModelLoadError
    from jaxserve.presets import PresetError
    from jaxserve.tokenizer.tokenizer import TokenizerLoadError

    try:
        yield
    except (ModelLoadError, PresetError, TokenizerLoadError, FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
