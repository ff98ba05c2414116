"""A random-weight mixture of experts of Qwen3-30B-A3B's layer shape, as one Q8_0 GGUF both systems read.

    .venv/bin/python benchmarks/peers/prepare_moe.py [--layers 8] [--out .peers/moe]

Writes under ``--out`` (default ``.peers/moe``, ignored by git):

- ``hf/``: a Qwen3-MoE transformers folder with Qwen3-30B-A3B's per-layer
  shape (hidden 2048, 128 experts of width 768, 8 active, renormalized; 32
  query and 4 kv heads of 128, q/k norms; rope theta 1e6) and ``--layers``
  layers, SmolLM2's tokenizer and vocabulary (49152, what llama.cpp's
  converter knows), untied embeddings; random normal weights (std 0.02,
  norms 1, seed 0) in bfloat16, one safetensors shard per layer, generated
  one tensor at a time (peak memory about one layer);
- ``qwen3moe-30b-a3b-shape-L{layers}.Q8_0.gguf``: that folder through
  llama.cpp's own converter (``tests/gguf_convert.py``, ``--outtype bf16``)
  and ``llama-quantize ... Q8_0`` (``benchmarks/peers/setup_llamacpp.sh``
  builds it): every matrix in Q8_0 blocks but the routers, which the
  converter writes in float32 and llama-quantize leaves as they are. The bf16 GGUF and the
  safetensors are deleted afterwards (``--keep`` keeps them); ``hf/`` keeps
  its config and tokenizer, which the benchmark reads for its prompts.

A Q8_0 layer is about 0.66 GB (623 M parameters, 604 M of them in the
experts) and the vocabulary adds 0.21 GB, so 8 layers make a 5.5 GB file;
``jaxserve --quantization int8`` holds the same bytes in memory while
llama.cpp maps the file, about 11 GB for the two. Steps whose output exists
are skipped (``--force`` redoes them). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

#: Qwen3-30B-A3B's per-layer shape (its config.json), with SmolLM2's vocabulary
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,  # a dense layer's (mlp_only_layers); every layer here is MoE
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "attention_bias": False,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
}
STD = 0.02


def gguf_name(layers: int) -> str:
    return f"qwen3moe-30b-a3b-shape-L{layers}.Q8_0.gguf"


def layer_params(layers: int) -> dict[str, int]:
    """Parameters of the model: per layer (attention, router, experts), the
    embedding and lm_head, and what one token reads per layer (its ``k``
    experts)."""
    s = SHAPE
    E, D = s["hidden_size"], s["head_dim"]
    H, KVH, X, I, k = (
        s["num_attention_heads"],
        s["num_key_value_heads"],
        s["num_experts"],
        s["moe_intermediate_size"],
        s["num_experts_per_tok"],
    )
    attention = E * H * D + 2 * E * KVH * D + H * D * E
    expert = 3 * E * I
    return {
        "attention": attention,
        "router": X * E,
        "expert": expert,
        "experts": X * expert,
        "active_per_layer": attention + k * expert,
        "layer": attention + X * E + X * expert,
        "layers": layers,
    }


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return a.astype(ml_dtypes.bfloat16)


def write_hf(out: Path, layers: int, seed: int = 0) -> None:
    """The transformers folder (see the module docstring)."""
    from safetensors.numpy import save_file

    from gguf_convert import SMOLLM2_VOCAB, with_smollm2_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": SMOLLM2_VOCAB,
        "num_hidden_layers": layers,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPE,
    }
    rng = np.random.default_rng(seed)
    E, D, H, KVH = SHAPE["hidden_size"], SHAPE["head_dim"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    X, I, V = SHAPE["num_experts"], SHAPE["moe_intermediate_size"], SMOLLM2_VOCAB

    def normal(*shape: int) -> np.ndarray:
        return _bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(STD))

    def ones(n: int) -> np.ndarray:
        return _bf16(np.ones(n, np.float32))

    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, np.ndarray], name: str) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    shards = layers + 1
    save(
        {
            "model.embed_tokens.weight": normal(V, E),
            "lm_head.weight": normal(V, E),
            "model.norm.weight": ones(E),
        },
        f"model-00001-of-{shards:05d}.safetensors",
    )
    for i in range(layers):
        t0 = time.perf_counter()
        pre = f"model.layers.{i}."
        tensors = {
            pre + "input_layernorm.weight": ones(E),
            pre + "post_attention_layernorm.weight": ones(E),
            pre + "self_attn.q_proj.weight": normal(H * D, E),
            pre + "self_attn.k_proj.weight": normal(KVH * D, E),
            pre + "self_attn.v_proj.weight": normal(KVH * D, E),
            pre + "self_attn.o_proj.weight": normal(E, H * D),
            pre + "self_attn.q_norm.weight": ones(D),
            pre + "self_attn.k_norm.weight": ones(D),
            pre + "mlp.gate.weight": normal(X, E),
        }
        for j in range(X):
            ex = f"{pre}mlp.experts.{j}."
            tensors[ex + "gate_proj.weight"] = normal(I, E)
            tensors[ex + "up_proj.weight"] = normal(I, E)
            tensors[ex + "down_proj.weight"] = normal(E, I)
        save(tensors, f"model-{i + 2:05d}-of-{shards:05d}.safetensors")
        del tensors
        print(f"layer {i} written ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    with_smollm2_tokenizer(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / ".peers" / "moe"))
    parser.add_argument("--quantize", default=str(ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-quantize"))
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    parser.add_argument("--keep", action="store_true", help="keep the safetensors and the bf16 GGUF")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()

    out = Path(args.out)
    hf = out / "hf"
    final = out / gguf_name(args.layers)
    if final.is_file() and not args.force:
        print(f"{final} exists (--force redoes it)")
        return
    if not Path(args.quantize).is_file():
        raise SystemExit(f"{args.quantize} not built: run benchmarks/peers/setup_llamacpp.sh")
    from gguf_convert import convert

    config = hf / "config.json"
    if args.force or not config.is_file() or json.loads(config.read_text())["num_hidden_layers"] != args.layers:
        shutil.rmtree(hf, ignore_errors=True)
        write_hf(hf, args.layers)
    bf16 = out / f"qwen3moe-30b-a3b-shape-L{args.layers}.BF16.gguf"
    if args.force or not bf16.is_file():
        t0 = time.perf_counter()
        convert(hf, bf16, outtype="bf16")
        print(f"{bf16} converted ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    t0 = time.perf_counter()
    subprocess.run([args.quantize, str(bf16), str(final), "Q8_0", str(args.threads)], check=True)
    print(f"{final} quantized ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if not args.keep:
        bf16.unlink()
        for shard in hf.glob("*.safetensors"):
            shard.unlink()
        (hf / "model.safetensors.index.json").unlink(missing_ok=True)
    print(final)


if __name__ == "__main__":
    main()
