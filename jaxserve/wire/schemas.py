"""The JSON Schemas of the message contract, generated from the models.

``queues/schemas/*.schema.json`` are this module's output; a test fails
when they drift. Regenerate after changing a model::

    python -m jaxserve.wire.schemas queues/schemas
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jaxserve.wire.job import JobBody
from jaxserve.wire.messages import Cancel, Chunk, Result

MODELS: dict[str, type[BaseModel]] = {"job": JobBody, "result": Result, "chunk": Chunk, "cancel": Cancel}


def schema(name: str) -> dict[str, Any]:
    body = MODELS[name].model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://jaxserve.dev/queues/schemas/{name}.schema.json",
        **body,
    }


def render(name: str) -> str:
    return json.dumps(schema(name), indent=2, ensure_ascii=False) + "\n"


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in MODELS:
        path = folder / f"{name}.schema.json"
        path.write_text(render(name))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else "queues/schemas")):
        print(p)
