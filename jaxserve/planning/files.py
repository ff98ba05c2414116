"""Reading the planner's input files (profile, workload, scale-out result)
with one-line errors that name the file, in the caller's error type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_text(path: str | Path, error: type[Exception], what: str = "") -> str:
    """The file's text; ``error("cannot read <what>'<path>': ...")`` if it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise error(f"cannot read {what}{str(path)!r}: {exc.strerror or exc}") from None


def parse_json(text: str, path: str | Path, error: type[Exception]) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error(f"{path}: not valid JSON: {exc}") from None


def read_json(path: str | Path, error: type[Exception], what: str = "") -> Any:
    return parse_json(read_text(path, error, what), path, error)
