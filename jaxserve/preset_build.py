"""The random-checkpoint builder behind model presets: a preset's JSON in, a
Hugging Face model folder out (a trained byte-level BPE tokenizer, config
files, seeded random weights in safetensors).

:mod:`jaxserve.presets` finds, validates and caches presets and calls
:func:`write_model_folder` once per preset version; this module is the part
that needs numpy, ``tokenizers`` and ``safetensors``, so looking presets up
imports none of them. ``tests/test_presets.py`` checks the folders it
writes load in transformers and give the same tokens on every build.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.presets import FORMAT_VERSION, PresetError, referenced_files

# Written to config.json so older transformers/vLLM read the legacy rope fields.
_TRANSFORMERS_VERSION = "4.46.0"

# Llama 3's pre-tokenizer split pattern.
_LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tokenizer(preset_path: Path, data: Mapping[str, Any]):
    """Train the preset's byte-level BPE; returns a ``tokenizers.Tokenizer``
    whose vocabulary has exactly config.vocab_size entries."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    recipe = data["tokenizer"]
    vocab_size = data["config"]["vocab_size"]
    specials: list[str] = list(recipe["special_tokens"])
    refs = referenced_files(preset_path, data)
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
    """config.json as transformers 4.x writes it, for the preset's
    architecture (default ``LlamaForCausalLM``; any registered family)."""
    c = data["config"]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    architectures = c.get("architectures", ["LlamaForCausalLM"])
    config = {
        "architectures": architectures,
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
        "model_type": c.get("model_type", "llama"),
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
    config.update(c)
    if config["attention_bias"] or config["mlp_bias"]:
        raise PresetError("presets do not support attention_bias/mlp_bias")
    return dict(sorted(config.items()))


def _tensor_specs(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) for every weight of the config's family, as the
    family names them (:mod:`jaxserve.models.weights`), HF Linear layout
    [out, in]: norm weights at their neutral value, everything else random."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.registry import family

    model_config = ModelConfig.from_dict(config, source="preset config")
    plan = family(model_config.family).weights(model_config)
    neutral = "zeros" if model_config.norm_weight_offset else "ones"
    specs: list[tuple[str, tuple[int, ...], str]] = []
    for params in [plan.top, *plan.layers]:
        for parts in params.values():
            for part in parts:
                specs.append((part.name, part.shape, neutral if part.name.endswith("norm.weight") else "normal"))
    return specs


def build_weights(config: Mapping[str, Any], seed: int, std: float, dtype: str) -> dict[str, np.ndarray]:
    """Seeded random weights. Each tensor draws from its own generator keyed by
    (seed, crc32(name)), so its values do not depend on the other tensors."""
    np_dtype = np.dtype(dtype)  # one of jaxserve.presets.WEIGHT_DTYPES (load_preset checks)
    tensors: dict[str, np.ndarray] = {}
    for name, shape, init in _tensor_specs(config):
        if init in ("ones", "zeros"):
            tensors[name] = (np.ones if init == "ones" else np.zeros)(shape, dtype=np_dtype)
            continue
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= np.float32(std)
        tensors[name] = values if np_dtype == np.float32 else values.astype(np_dtype)
    return tensors


def write_model_folder(folder: Path, preset_path: Path, data: Mapping[str, Any]) -> None:
    """Write the preset's whole model folder into ``folder`` (a fresh
    temporary one: ``jaxserve.cache_folders.build_folder_once`` renames it into
    place)."""
    from safetensors.numpy import save_file

    recipe = data["tokenizer"]
    refs = referenced_files(preset_path, data)
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
