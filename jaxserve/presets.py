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
    config       HF config.json fields (LlamaForCausalLM): hidden_size,
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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import jaxserve

# Bump when the materialized output changes for the same preset file.
FORMAT_VERSION = 1

PRESETS_DIR_ENV = "JAXSERVE_PRESETS_DIR"
CACHE_DIR_ENV = "JAXSERVE_CACHE_DIR"

# Written to config.json so older transformers/vLLM read the legacy rope fields.
_TRANSFORMERS_VERSION = "4.46.0"

# Llama 3's pre-tokenizer split pattern.
_LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_DTYPES = {"float32": np.float32, "float16": np.float16}


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


def cache_dir() -> Path:
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "jaxserve"


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
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from jaxserve.models.gguf_folder import gguf_model_folder

        return gguf_model_folder(path, cache_dir())
    if path.is_file() and path.suffix == ".json":
        return materialize_preset(path)
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
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PresetError(f"cannot read preset {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise PresetError(f"preset {path} must be a JSON object")
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
    if archs != ["LlamaForCausalLM"]:
        raise PresetError(f"preset {path}: only LlamaForCausalLM is supported, got {archs!r}")
    if data.get("dtype", "float32") not in _DTYPES:
        raise PresetError(f"preset {path}: dtype must be one of {sorted(_DTYPES)}")
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


def _referenced_files(preset_path: Path, preset: Mapping[str, Any]) -> dict[str, Path]:
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
    refs = {} if "gguf" in preset else _referenced_files(preset_path, preset)
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
    return build_folder_once(target, _MODEL_FILES, lambda tmp: _write_model_folder(tmp, preset_path, data))


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


def _remove_stale_temp_dirs(presets_root: Path, max_age_s: float = 3600.0) -> None:
    now = time.time()
    for entry in presets_root.glob(".*.tmp-*"):
        try:
            if now - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


# -------------------------------------------------------------- materializing


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tokenizer(preset_path: Path, data: Mapping[str, Any]):
    """Train the preset's byte-level BPE; returns a ``tokenizers.Tokenizer``
    whose vocabulary has exactly config.vocab_size entries."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    recipe = data["tokenizer"]
    vocab_size = data["config"]["vocab_size"]
    specials: list[str] = list(recipe["special_tokens"])
    refs = _referenced_files(preset_path, data)
    lines = [line for line in refs["corpus"].read_text(encoding="utf-8").splitlines() if line.strip()]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    min_vocab = len(specials) + 256
    if vocab_size < min_vocab:
        raise PresetError(
            f"preset {preset_path}: vocab_size {vocab_size} is below {min_vocab} "
            "(special tokens plus the 256 byte symbols)"
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=int(recipe.get("min_frequency", 2)),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)

    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        fmt = recipe.get("reserved_token_format", "<|reserved_special_token_{}|>")
        tokenizer.add_special_tokens(
            [AddedToken(fmt.format(i), special=True, normalized=False) for i in range(missing)]
        )
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise PresetError(
            f"preset {preset_path}: tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} "
            f"tokens, expected vocab_size {vocab_size}"
        )

    bos = recipe["bos_token"]
    bos_id = tokenizer.token_to_id(bos)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A:0",
        pair=f"{bos} $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)],
    )
    return tokenizer


def build_config(data: Mapping[str, Any], bos_id: int, eos_id: int) -> dict[str, Any]:
    """config.json as transformers 4.x writes it for LlamaForCausalLM."""
    c = data["config"]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": c["hidden_size"],
        "initializer_range": float(data.get("init_std", 0.02)),
        "intermediate_size": c["intermediate_size"],
        "max_position_embeddings": c["max_position_embeddings"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": c["num_attention_heads"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_key_value_heads": c["num_key_value_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": data.get("dtype", "float32"),
        "transformers_version": _TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": c["vocab_size"],
    }
    for key, value in c.items():
        if key not in ("architectures", "model_type"):
            config[key] = value
    if config["attention_bias"] or config["mlp_bias"]:
        raise PresetError("presets do not support attention_bias/mlp_bias")
    return dict(sorted(config.items()))


def _tensor_specs(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) for every LlamaForCausalLM weight, HF Linear layout [out, in]."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "normal")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.input_layernorm.weight", (hidden,), "ones"),
            (f"{p}.self_attn.q_proj.weight", (q_out, hidden), "normal"),
            (f"{p}.self_attn.k_proj.weight", (kv_out, hidden), "normal"),
            (f"{p}.self_attn.v_proj.weight", (kv_out, hidden), "normal"),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_out), "normal"),
            (f"{p}.post_attention_layernorm.weight", (hidden,), "ones"),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden), "normal"),
            (f"{p}.mlp.up_proj.weight", (inter, hidden), "normal"),
            (f"{p}.mlp.down_proj.weight", (hidden, inter), "normal"),
        ]
    specs.append(("model.norm.weight", (hidden,), "ones"))
    if not config["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, hidden), "normal"))
    return specs


def build_weights(config: Mapping[str, Any], seed: int, std: float, dtype: str) -> dict[str, np.ndarray]:
    """Seeded random weights. Each tensor draws from its own generator keyed by
    (seed, crc32(name)), so its values do not depend on the other tensors."""
    np_dtype = _DTYPES[dtype]
    tensors: dict[str, np.ndarray] = {}
    for name, shape, init in _tensor_specs(config):
        if init == "ones":
            tensors[name] = np.ones(shape, dtype=np_dtype)
            continue
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= np.float32(std)
        tensors[name] = values if np_dtype == np.float32 else values.astype(np_dtype)
    return tensors


def _write_model_folder(folder: Path, preset_path: Path, data: Mapping[str, Any]) -> None:
    from safetensors.numpy import save_file

    recipe = data["tokenizer"]
    refs = _referenced_files(preset_path, data)
    tokenizer = build_tokenizer(preset_path, data)
    tokenizer.save(str(folder / "tokenizer.json"), pretty=False)

    bos_id = tokenizer.token_to_id(recipe["bos_token"])
    eos_id = tokenizer.token_to_id(recipe["eos_token"])
    config = build_config(data, bos_id, eos_id)
    _write_json(folder / "config.json", config)

    gen_eos = [eos_id]
    for token in recipe.get("generation_eos_tokens", []):
        token_id = tokenizer.token_to_id(token)
        if token_id not in gen_eos:
            gen_eos.append(token_id)
    _write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": bos_id,
            "eos_token_id": gen_eos if len(gen_eos) > 1 else eos_id,
            "transformers_version": _TRANSFORMERS_VERSION,
        },
    )

    tokenizer_config: dict[str, Any] = {
        "bos_token": recipe["bos_token"],
        "clean_up_tokenization_spaces": False,
        "eos_token": recipe["eos_token"],
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "chat_template_file" in refs:
        tokenizer_config["chat_template"] = refs["chat_template_file"].read_text(encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config)

    weights = build_weights(
        config, int(data.get("seed", 0)), float(data.get("init_std", 0.02)), data.get("dtype", "float32")
    )
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})

    _write_json(
        folder / "jaxserve_preset.json",
        {"name": data.get("name", preset_path.stem), "format_version": FORMAT_VERSION, "preset": data},
    )
    # mkdtemp makes a private folder and safetensors a private file; the cache
    # may be shared with other users (a vLLM container, say).
    for file in folder.iterdir():
        file.chmod(0o644)
    folder.chmod(0o755)
