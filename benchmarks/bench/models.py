"""Which copy of SmolLM2-135M-Instruct each system loads.

jaxserve loads the ``smollm2-135m`` preset (the shipped Q4_1 GGUF, read by
jaxserve itself; ``--quantization int4`` then takes its Q4_1 blocks as they
are) when this checkout has it, else the float32 transformers folder that
``benchmarks/peers/prepare_smollm2.py`` writes, which holds the same weights
dequantized and is what vLLM and llmq load.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER_DIR = ROOT / ".peers" / "smollm2"
HF_FOLDER = PEER_DIR / "hf"
PRESET = "smollm2-135m"


def jaxserve_default() -> str:
    if (ROOT / "models" / f"{PRESET}.json").is_file():
        return PRESET
    return str(HF_FOLDER)


def require_hf_folder(path: str | Path = HF_FOLDER) -> Path:
    p = Path(path).resolve()
    if not (p / "config.json").is_file():
        raise SystemExit(f"{p}: no config.json; run .venv/bin/python benchmarks/peers/prepare_smollm2.py")
    return p


def label(model: str) -> str:
    """How a table row names the model a system served."""
    if model in (PRESET, str(HF_FOLDER)) or Path(model).resolve() == HF_FOLDER.resolve():
        return "SmolLM2-135M"
    return Path(model).name or model
