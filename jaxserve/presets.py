"""Model presets: small Llama-architecture models materialized on first use.

A preset is a JSON file in the repository's ``models/`` folder, which the
package reaches as ``jaxserve/preset_data`` (a symlink in the checkout, real
files in a built wheel), or in ``$JAXSERVE_PRESETS_DIR`` (see
:func:`presets_dir`). It describes a model to build locally, with no
download: the HF ``config.json`` fields, a seed and dtype for random weights,
and a tokenizer recipe (a byte-level BPE trained on a small text corpus).

``resolve_model(name_or_path)`` returns an existing folder unchanged, and
otherwise materializes the named preset once into
``$JAXSERVE_CACHE_DIR/presets/NAME-HASH`` (default cache dir
``~/.cache/jaxserve``), where HASH covers the preset JSON, the files it
references and the materializer's format version, so editing a preset gives a
new folder. The folder is a standard Hugging Face model folder that
transformers and vLLM load as is.

Preset fields (``models/tiny.json`` is an example)::

    name         must match the file name
    description  free text
    seed         int, seeds the weights
    dtype        "float32" or "float16"
    init_std     weight std (default 0.02)
    config       HF config.json fields: architectures (default
                 LlamaForCausalLM; any registered family), hidden_size,
                 intermediate_size, num_hidden_layers, num_attention_heads,
                 num_key_value_heads, vocab_size, max_position_embeddings,
                 tie_word_embeddings, and optionally rope_theta, rms_norm_eps,
                 head_dim, ... (Llama defaults fill the rest)
    tokenizer    type "byte_level_bpe"; corpus (file next to the preset);
                 special_tokens (list, ids 0..n-1 in order); bos_token;
                 eos_token; generation_eos_tokens (ids listed in
                 generation_config.json); reserved_token_format (fills the
                 vocab up to vocab_size when the trainer stops short);
                 min_frequency; chat_template_file (next to the preset)

A preset may instead name a real model shipped as a GGUF file inside an
installed Python package (``models/smollm2-135m.json``)::

    name         must match the file name
    description  free text
    gguf         {"package": importable name, "file": the .gguf inside it,
                  "install": the command that installs the package}

Such a preset resolves to the GGUF file's model folder
(:mod:`jaxserve.models.gguf_folder`); the package is located without
importing it (its own code may need dependencies jaxserve does not), and
when it is missing the error gives the install command.

This module finds, validates, hashes and caches presets;
:mod:`jaxserve.preset_build` builds a random-weight preset's folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jaxserve
from jaxserve.cache_folders import build_folder_once, cache_dir
from jaxserve.json_files import read_json_object

# Bump when the materialized output changes for the same preset file.
FORMAT_VERSION = 1

PRESETS_DIR_ENV = "JAXSERVE_PRESETS_DIR"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
#: the weight dtypes a preset may ask for
WEIGHT_DTYPES = ("float32", "float16")


class PresetError(ValueError):
    """A preset file is malformed."""


class UnknownModelError(PresetError, LookupError):
    """Neither an existing folder nor a known preset."""


# --------------------------------------------------------------------- lookup


def packaged_presets_dir() -> Path:
    """``jaxserve/preset_data``: in a checkout a symlink to the repository's
    ``models/`` (resolved here, so it names ``models/``); in an installed
    wheel the copy of those files that the build put in the package."""
    return (Path(jaxserve.__file__).resolve().parent / "preset_data").resolve()


def checkout_presets_dir() -> Path:
    """``models/`` next to the ``jaxserve`` package of a source checkout (an
    editable install, or running from the repository)."""
    return Path(jaxserve.__file__).resolve().parents[1] / "models"


def presets_dir() -> Path:
    """``$JAXSERVE_PRESETS_DIR``, else the package's ``preset_data`` (the
    wheel's copy, or the checkout's symlink to ``models/``), else the
    checkout's ``models/`` (a checkout without the symlink).

    Never ``site-packages/models``: in an installed wheel ``parents[1]`` is
    ``site-packages``, where a ``models`` folder may belong to anything.
    """
    override = os.environ.get(PRESETS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    packaged = packaged_presets_dir()
    if packaged.is_dir():
        return packaged
    checkout = checkout_presets_dir()
    if (checkout.parent / "pyproject.toml").is_file():
        return checkout
    return packaged


def list_presets() -> list[str]:
    folder = presets_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.json") if p.is_file())


def _preset_file(name: str) -> Path | None:
    if not _NAME_RE.match(name):
        return None
    path = presets_dir() / f"{name}.json"
    return path if path.is_file() else None


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A model folder for ``name_or_path``.

    An existing model folder is returned as is. A ``.gguf`` file, or a folder
    with no ``config.json`` holding exactly one ``.gguf``, becomes a model
    folder derived from the file's metadata under
    ``$JAXSERVE_CACHE_DIR/gguf`` (:mod:`jaxserve.models.gguf_folder`).
    Otherwise the argument names a preset (``models/NAME.json``),
    materialized into the cache on first use and returned from there
    afterwards. A path to a preset ``.json`` file works too.
    """
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            from jaxserve.models.gguf_folder import gguf_model_folder, single_gguf_in

            gguf_file = single_gguf_in(path)
            if gguf_file is not None:
                return gguf_model_folder(gguf_file, cache_dir())
            raise UnknownModelError(
                f"{raw!r} is a folder but not a model: it has no config.json and no .gguf file "
                "(a Hugging Face model folder holds config.json, model.safetensors and tokenizer.json)"
            )
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from jaxserve.models.gguf_folder import gguf_model_folder

        return gguf_model_folder(path, cache_dir())
    if path.is_file() and path.suffix == ".json":
        return materialize_preset(path)
    if path.is_file():
        raise UnknownModelError(
            f"{raw!r} is a file but not a model: pass a .gguf file, a Hugging Face model folder "
            "(config.json, model.safetensors, tokenizer.json) or a preset name"
        )
    preset = _preset_file(raw)
    if preset is not None:
        return materialize_preset(preset)
    available = list_presets()
    listing = ", ".join(available) if available else "(none)"
    looks_like_path = os.sep in raw or raw.startswith((".", "~")) or raw.lower().endswith(".gguf")
    what = (
        f"{'file' if raw.lower().endswith('.gguf') else 'folder'} {raw!r} does not exist"
        if looks_like_path
        else f"unknown model {raw!r}"
    )
    raise UnknownModelError(
        f"{what}: it is neither an existing model folder nor a preset name. "
        f"Available presets (in {presets_dir()}): {listing}. "
        "A path to a Hugging Face model folder (config.json, model.safetensors, "
        "tokenizer.json) or to a .gguf file also works."
    )


# -------------------------------------------------------------------- presets


def load_preset(path: Path) -> dict[str, Any]:
    data = read_json_object(path, PresetError, "preset ")
    if "gguf" in data:
        return _check_gguf_preset(path, data)
    for key in ("config", "tokenizer"):
        if not isinstance(data.get(key), dict):
            raise PresetError(f"preset {path} needs a {key!r} object")
    config = data["config"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    ):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PresetError(f"preset {path}: config.{key} must be a positive integer, got {value!r}")
    if config["hidden_size"] % config["num_attention_heads"] and "head_dim" not in config:
        raise PresetError(f"preset {path}: hidden_size must divide by num_attention_heads")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise PresetError(f"preset {path}: num_attention_heads must divide by num_key_value_heads")
    archs = config.get("architectures", ["LlamaForCausalLM"])
    from jaxserve.models.registry import family_of_architecture, supported_architectures

    if not isinstance(archs, list) or len(archs) != 1 or family_of_architecture(str(archs[0])) is None:
        raise PresetError(
            f"preset {path}: architectures must name one of {', '.join(supported_architectures())}, got {archs!r}"
        )
    if data.get("dtype", "float32") not in WEIGHT_DTYPES:
        raise PresetError(f"preset {path}: dtype must be one of {sorted(WEIGHT_DTYPES)}")
    tok = data["tokenizer"]
    if tok.get("type", "byte_level_bpe") != "byte_level_bpe":
        raise PresetError(f"preset {path}: tokenizer.type must be 'byte_level_bpe'")
    specials = tok.get("special_tokens")
    if not isinstance(specials, list) or not all(isinstance(s, str) for s in specials):
        raise PresetError(f"preset {path}: tokenizer.special_tokens must be a list of strings")
    for key in ("bos_token", "eos_token"):
        if tok.get(key) not in specials:
            raise PresetError(f"preset {path}: tokenizer.{key} must be one of special_tokens")
    for token in tok.get("generation_eos_tokens", []):
        if token not in specials:
            raise PresetError(f"preset {path}: generation_eos_tokens entry {token!r} is not a special token")
    if not isinstance(tok.get("corpus"), str):
        raise PresetError(f"preset {path}: tokenizer.corpus must name a text file")
    return data


def _check_gguf_preset(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    spec = data["gguf"]
    if not isinstance(spec, dict):
        raise PresetError(f"preset {path}: gguf must be an object with package, file and install")
    for key in ("package", "file", "install"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise PresetError(f"preset {path}: gguf.{key} must be a non-empty string, got {spec.get(key)!r}")
    if not spec["file"].endswith(".gguf") or "/" in spec["file"] or "\\" in spec["file"]:
        raise PresetError(f"preset {path}: gguf.file must be a .gguf file name, got {spec['file']!r}")
    return data


def packaged_gguf(preset_path: Path, data: Mapping[str, Any]) -> Path:
    """The GGUF file a packaged preset names, found without importing its package."""
    import importlib.util

    spec = data["gguf"]
    name = data.get("name", preset_path.stem)
    try:
        found = importlib.util.find_spec(spec["package"])
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:
        raise PresetError(
            f"preset {name!r} needs the Python package {spec['package']!r}, which holds "
            f"{spec['file']}; install it with: {spec['install']}"
        )
    for folder in locations:
        candidate = Path(folder) / spec["file"]
        if candidate.is_file():
            return candidate
    raise PresetError(
        f"preset {name!r}: package {spec['package']!r} (in {locations[0]}) has no {spec['file']}; "
        f"reinstall it with: {spec['install']}"
    )


def referenced_files(preset_path: Path, preset: Mapping[str, Any]) -> dict[str, Path]:
    """The files a preset's tokenizer recipe names (its corpus, its chat
    template), resolved next to the preset; they are part of its hash."""
    tok = preset["tokenizer"]
    refs = {"corpus": tok["corpus"]}
    if tok.get("chat_template_file"):
        refs["chat_template_file"] = tok["chat_template_file"]
    out: dict[str, Path] = {}
    for key, rel in refs.items():
        file = (preset_path.parent / rel).resolve()
        if not file.is_file():
            raise PresetError(f"preset {preset_path}: tokenizer.{key} {rel!r} not found at {file}")
        out[key] = file
    return out


def preset_hash(preset_path: Path) -> str:
    """Hash of the preset JSON, the files it references, and FORMAT_VERSION."""
    preset = load_preset(preset_path)
    refs = {} if "gguf" in preset else referenced_files(preset_path, preset)
    digest = hashlib.sha256()
    digest.update(f"jaxserve-preset-v{FORMAT_VERSION}\n".encode())
    digest.update(preset_path.read_bytes())
    for key in sorted(refs):
        digest.update(f"\n{key}\n".encode())
        digest.update(hashlib.sha256(refs[key].read_bytes()).digest())
    return digest.hexdigest()[:16]


def materialize_preset(preset: str | os.PathLike[str], cache: str | os.PathLike[str] | None = None) -> Path:
    """Build (once) and return the model folder for a preset name or preset file."""
    preset_path = Path(preset)
    if not preset_path.is_file():
        found = _preset_file(os.fspath(preset))
        if found is None:
            raise UnknownModelError(
                f"no preset {os.fspath(preset)!r}; available: {', '.join(list_presets()) or '(none)'}"
            )
        preset_path = found
    data = load_preset(preset_path)
    name = str(data.get("name") or preset_path.stem)
    if not _NAME_RE.match(name):
        raise PresetError(f"preset {preset_path}: bad name {name!r}")
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    if "gguf" in data:
        from jaxserve.models.gguf_folder import gguf_model_folder

        return gguf_model_folder(packaged_gguf(preset_path, data), root)
    presets_root = root / "presets"
    target = presets_root / f"{name}-{preset_hash(preset_path)}"
    if all((target / f).is_file() for f in _MODEL_FILES):
        return target

    presets_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(presets_root)
    from jaxserve.preset_build import write_model_folder

    return build_folder_once(target, _MODEL_FILES, lambda tmp: write_model_folder(tmp, preset_path, data))


def _remove_stale_temp_dirs(presets_root: Path, max_age_s: float = 3600.0) -> None:
    now = time.time()
    for entry in presets_root.glob(".*.tmp-*"):
        try:
            if now - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


# The builder's functions, still reachable as ``jaxserve.presets.NAME``
# (tests/test_presets.py, benchmarks/device_check.py); imported on first use
# so a look-up needs none of numpy, tokenizers and safetensors.
_BUILDER_NAMES = frozenset({"build_config", "build_tokenizer", "build_weights", "write_model_folder"})


def __getattr__(name: str) -> Any:
    if name in _BUILDER_NAMES:
        from jaxserve import preset_build

        return getattr(preset_build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
