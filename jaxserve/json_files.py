"""Reading JSON files and message bodies with one-line errors in the caller's error type.

Model configs, safetensors indexes, tokenizer files, presets and the
planner's inputs are all "a JSON object or a one-line error naming the
file"; each
caller keeps its own exception class (ModelLoadError, TokenizerLoadError,
PresetError, ProfileError, ...) so its handlers and exit codes stay as they
are. This module sits below every layer: it imports nothing of jaxserve.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

#: makes the exception to raise from a one-line message
ErrorFactory = Callable[[str], Exception]


def read_text(path: str | Path, error: ErrorFactory, what: str = "") -> str:
    """The file's text; ``error("cannot read <what>'<path>': ...")`` if it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise error(f"cannot read {what}{str(path)!r}: {reason}") from None


def parse_json(text: str | bytes, source: str | Path, error: ErrorFactory) -> Any:
    """``text`` parsed; ``error("<source>: not valid JSON: ...")`` if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error(f"{source}: not valid JSON: {exc}") from None


def json_object(data: Any, source: str | Path, error: ErrorFactory) -> dict[str, Any]:
    """``data`` if it is a JSON object; ``error("<source> must hold a JSON object, got <type>")``."""
    if not isinstance(data, dict):
        raise error(f"{source} must hold a JSON object, got {type(data).__name__}")
    return data


def loads_object(raw: bytes, error: ErrorFactory, not_json: str, not_object: str) -> dict[str, Any]:
    """A request or job body (``orjson``: bytes, UTF-8 checked) as a JSON
    object; ``error(not_json.format(<parser's message>))`` if it is not JSON,
    ``error(not_object.format(<type name>))`` if it is another JSON value.
    Each caller words the two errors for its own audience."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise error(not_json.format(exc)) from None
    if not isinstance(data, dict):
        raise error(not_object.format(type(data).__name__))
    return data


def read_json(path: str | Path, error: ErrorFactory, what: str = "") -> Any:
    """The file's JSON value, with :func:`read_text`'s and :func:`parse_json`'s errors."""
    return parse_json(read_text(path, error, what), path, error)


def read_json_object(path: str | Path, error: ErrorFactory, what: str = "") -> dict[str, Any]:
    """The file's JSON object, with :func:`read_json`'s and :func:`json_object`'s errors."""
    return json_object(read_json(path, error, what), path, error)
