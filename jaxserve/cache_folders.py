"""The folders jaxserve builds once and keeps: where they live and how one
is written without a reader ever seeing half of it.

Presets (:mod:`jaxserve.presets`), GGUF model folders
(:mod:`jaxserve.models.gguf_folder`) and the CPU kernels' shared library
(:mod:`jaxserve.kernels.cpu`) all cache under :func:`cache_dir`; the first
two write their folders with :func:`build_folder_once`. Kept apart from the
presets so that the models and the kernels, which the presets use, need not
import them back (``tests/test_import_rules.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

CACHE_DIR_ENV = "JAXSERVE_CACHE_DIR"


def cache_dir() -> Path:
    """``$JAXSERVE_CACHE_DIR``, else ``~/.cache/jaxserve``."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "jaxserve"


def build_folder_once(target: Path, files: Sequence[str], write: Callable[[Path], None]) -> Path:
    """``target`` holding ``files``, written by ``write`` into a temporary
    sibling folder and renamed into place, so concurrent processes never see
    a half-written folder: the first complete one wins and a broken one in
    the way is replaced. Returns ``target`` at once when it is complete."""
    if all((target / f).is_file() for f in files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Someone else finished first (rename onto a non-empty dir fails),
            # or a broken folder is in the way: keep a complete one.
            if all((target / f).is_file() for f in files):
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
