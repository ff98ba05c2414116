"""Give a GGUF file the shape of a Hugging Face model folder.

Everything in jaxserve that consumes a model (the engine, ``generate``,
``bench``, the worker, ``plan --measure``) reads a folder: ``config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json`` and
weights. :func:`gguf_model_folder` derives the four JSON files from the GGUF
metadata once and writes them, beside a symbolic link ``model.gguf`` to the
file, into ``$JAXSERVE_CACHE_DIR/gguf/STEM-HASH`` (HASH covers the file's
resolved path, size, modification time and :data:`FORMAT_VERSION`, so a
replaced file gets a new folder without hashing gigabytes). The weight
loader reads ``model.gguf`` when a folder has no safetensors
(:mod:`jaxserve.models.loader`), so nothing else needs to know the model came
from a GGUF file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jaxserve.cache_folders import build_folder_once
from jaxserve.models.errors import ModelLoadError

#: Bump when the derived files change for the same GGUF file.
FORMAT_VERSION = 2
GGUF_LINK = "model.gguf"
_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", GGUF_LINK)


def single_gguf_in(folder: Path) -> Path | None:
    """The one ``*.gguf`` in ``folder`` (None when there is none); several is an error."""
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"{folder} holds several GGUF files ({names}); pass one of them as --model")
    return found[0] if found else None


def _identity(path: Path) -> str:
    st = path.stat()
    digest = hashlib.sha256()
    digest.update(f"jaxserve-gguf-v{FORMAT_VERSION}\n{path}\n{st.st_size}\n{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def gguf_model_folder(gguf_path: str | os.PathLike[str], cache_root: str | os.PathLike[str]) -> Path:
    """The model folder for ``gguf_path`` under ``cache_root/gguf`` (built on first use)."""
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    root = Path(cache_root).expanduser() / "gguf"
    stem = source.stem if source.stem else "model"
    target = root / f"{stem}-{_identity(source)}"
    return build_folder_once(target, _FILES, lambda tmp: _write_folder(tmp, source))


def _write_folder(folder: Path, source: Path) -> None:
    from jaxserve.models.gguf_file import GGUFCheckpoint
    from jaxserve.tokenizer.from_gguf import tokenizer_from_gguf

    checkpoint = GGUFCheckpoint(source)
    try:
        config = checkpoint.hf_config()
        tok = tokenizer_from_gguf(checkpoint.metadata, str(source))
    finally:
        checkpoint.close()
    tok.tokenizer.save(str(folder / "tokenizer.json"), pretty=False)
    tokenizer_config = dict(tok.tokenizer_config)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    _write_json(folder / "config.json", config)
    generation: dict[str, Any] = {}
    if tok.bos_token_id is not None:
        generation["bos_token_id"] = tok.bos_token_id
    if tok.generation_eos_ids:
        ids = list(tok.generation_eos_ids)
        generation["eos_token_id"] = ids if len(ids) > 1 else ids[0]
    _write_json(folder / "generation_config.json", generation)
    _write_json(folder / "jaxserve_gguf.json", {"source": str(source), "format_version": FORMAT_VERSION})
    os.symlink(source, folder / GGUF_LINK)
    for file in folder.iterdir():
        if not file.is_symlink():
            file.chmod(0o644)
    folder.chmod(0o755)


__all__ = ["FORMAT_VERSION", "GGUF_LINK", "gguf_model_folder", "single_gguf_in"]
