"""The layers point one way (``docs/architecture.md``): what a package may
import, checked on the code itself.

- The wire (the queue contract) and the client that producers install never
  load the engine: importing them in a fresh interpreter leaves
  ``jaxserve.engine`` and JAX out of ``sys.modules``.
- The models and the kernels sit below the presets, which build models: no
  module of theirs imports ``jaxserve.presets`` or ``jaxserve.preset_build``
  (the cache folder they share is ``jaxserve.cache_folders``).
- Cost reads plans; planning never imports cost.

The static checks read every import statement, those inside functions too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxserve"


def imported_modules(folder: str) -> dict[str, set[str]]:
    """Every module that a file under ``jaxserve/<folder>`` imports, by file."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(PACKAGE.parent))] = names
    return found


def offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path, names in imported_modules(folder).items():
        hits = sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        if hits:
            bad[path] = hits
    return bad


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("wire", ("jaxserve.engine", "jaxserve.worker")),
        ("client", ("jaxserve.engine", "jaxserve.worker")),
        ("models", ("jaxserve.presets", "jaxserve.preset_build")),
        ("kernels", ("jaxserve.presets", "jaxserve.preset_build")),
        ("planning", ("jaxserve.cost",)),
    ],
)
def test_no_import_against_the_layers(folder, forbidden):
    assert offenders(folder, forbidden) == {}


def test_the_wire_and_the_client_load_without_the_engine():
    code = (
        "import json, sys\n"
        "import jaxserve.wire, jaxserve.client\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jaxserve', 'jax'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert "jaxserve.wire" in loaded and "jaxserve.client" in loaded  # (the check can fail)
    assert [m for m in loaded if m == "jax" or m.startswith(("jax.", "jaxserve.engine"))] == []
