"""One mixture-of-experts layer of Qwen3-30B-A3B's shape, every way jaxserve can compute it.

The question behind ``jaxserve/models/moe.py``'s paths: how much do the
grouped computations cost against the alternatives, at decode and prefill
token counts, on this CPU? Sides (each ``moe_mlp``'s experts on the same
random weights; routing included, so every side is the whole layer):

- ``kernel``: ``moe_cpu.cc`` (the CPU path), Q8_0 stacks (``--kind``);
- ``loop``: the pure-JAX loop over expert tiles (``grouped_experts``,
  ``impl="loop"``), the same Q8_0 stacks through ``quant.matmul``;
- ``kernel_f32`` / ``loop_f32`` / ``ragged_f32``: the same with float32
  stacks, ``ragged`` being ``jax.lax.ragged_dot_general``, which JAX lowers
  on the CPU to a dense dot over every expert (``--ragged-max-tokens``
  bounds it: at prefill sizes it computes X / k times the work);
- ``per_pair_f32``: what ``moe_mlp`` did before grouping (each pair's
  expert matrices gathered; ``--per-pair-max-tokens``: it copies k expert
  matrices per token).

One process, the sides alternated round by round at each token count;
median and min-max of each side's per-round time (``--reps`` calls a
round), and for the kernel the weight bytes it reads per call over its time.
Each call takes the next of ``--layers`` copies of the weights (different
random values), as a model's consecutive layers do: with one copy, repeated
calls would find a one-token call's 8 experts (40 MB) partly in the last
level cache.
The Qwen3-30B-A3B layer is 128 experts of 2 x 768 + 768 rows over 2048
features: 1.6 GB as float32 stacks (``--no-f32`` skips them).

    .venv/bin/python benchmarks/moe_kernel_ab.py --tokens 1,8,64,512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.kernels import cpu  # noqa: E402
from jaxserve.models import moe, quant  # noqa: E402
from jaxserve.models.config import ModelConfig, MoEConfig, RopeConfig  # noqa: E402

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768


def config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        family="qwen3_moe",
        vocab_size=49152,
        hidden_size=HIDDEN,
        intermediate_size=6144,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1e6),
        max_position_embeddings=4096,
        qk_norm="head",
        moe=MoEConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=WIDTH),
    )


def weights(kind: str | None, seed: int = 0) -> dict:
    """Random stacks, one expert at a time (float32 or quantized to ``kind``)."""
    rng = np.random.default_rng(seed)
    out: dict = {"router": jnp.asarray(rng.standard_normal((EXPERTS, HIDDEN), np.float32) * 0.02), "b_router": None}
    for name, shape in (("experts_gate_up", (2 * WIDTH, HIDDEN)), ("experts_down", (HIDDEN, WIDTH))):
        mats = [rng.standard_normal(shape, np.float32) * np.float32(0.02) for _ in range(EXPERTS)]
        if kind is None:
            out[name] = jnp.asarray(np.stack(mats))
        else:
            out[name] = quant.to_device(quant.quantize(np.stack(mats), kind))
        del mats
    out["experts_b_gate_up"] = out["experts_b_down"] = None
    return out


def per_pair(x, w, m):
    """moe_mlp before grouping: each pair's expert matrices gathered."""
    xt = x.T
    ids, wts = moe.route(moe.router_logits(xt, w), m)
    T, k = ids.shape
    flat = ids.reshape(-1)
    xs = jnp.repeat(xt, k, axis=0)
    gu = jnp.einsum("pe,pfe->pf", xs, w["experts_gate_up"][flat])
    act = moe.expert_activation(gu[:, :WIDTH], gu[:, WIDTH:], m)
    out = jnp.einsum("pi,pei->pe", act, w["experts_down"][flat])
    return jnp.sum(out.reshape(T, k, -1) * wts[..., None], axis=1).T


def sides(c: ModelConfig, wq: list[dict], wf: list[dict] | None) -> dict:
    m = c.moe
    assert m is not None

    def grouped(impl):
        def f(x, w):
            ids, wts = moe.route(moe.router_logits(x.T, w), m)
            return moe.grouped_experts(x.T, ids, wts, w, m, impl=impl).T

        return f

    kernel = lambda x, w: moe.moe_mlp(x, w, c, cpu_kernel=True)  # noqa: E731
    out = {"kernel": (jax.jit(kernel), wq), "loop": (jax.jit(grouped("loop")), wq)}
    if wf is not None:
        out["kernel_f32"] = (jax.jit(kernel), wf)
        out["loop_f32"] = (jax.jit(grouped("loop")), wf)
        out["ragged_f32"] = (jax.jit(grouped("ragged")), wf)
        out["per_pair_f32"] = (jax.jit(lambda x, w: per_pair(x, w, m)), wf)
    return out


def kernel_bytes(w: dict, ids: np.ndarray) -> int:
    """Weight bytes the kernel reads for one call: the router and each chosen expert once."""
    used = len(set(ids.ravel().tolist()))
    stacks = sum(
        sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(w[n])) for n in quant.EXPERT_STACKS
    )
    return int(w["router"].size * 4 + stacks * used / EXPERTS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="q8_0", choices=quant.KINDS)
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=4, help="calls per side per round")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 sides (2.4 GB of stacks a layer)")
    ap.add_argument("--layers", type=int, default=4, help="weight copies, cycled call by call")
    ap.add_argument("--ragged-max-tokens", type=int, default=8)
    ap.add_argument("--per-pair-max-tokens", type=int, default=8)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("the C++ CPU kernels are not available")
    c = config()
    assert c.moe is not None
    wq = [weights(args.kind, seed=i) for i in range(args.layers)]
    wf = None if args.no_f32 else [weights(None, seed=i) for i in range(args.layers)]
    all_sides = sides(c, wq, wf)
    rng = np.random.default_rng(1)
    report: dict = {"kind": args.kind, "rounds": args.rounds, "reps": args.reps, "tokens": {}}
    for T in [int(t) for t in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((HIDDEN, T), np.float32))
        names = [
            n
            for n in all_sides
            if not (n == "ragged_f32" and T > args.ragged_max_tokens)
            and not (n == "per_pair_f32" and T > args.per_pair_max_tokens)
        ]
        for n in names:  # compile and warm
            fn, ws = all_sides[n]
            jax.block_until_ready(fn(x, ws[0]))
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                fn, ws = all_sides[n]
                t0 = time.perf_counter()
                for i in range(args.reps):
                    jax.block_until_ready(fn(x, ws[i % len(ws)]))
                times[n].append((time.perf_counter() - t0) / args.reps * 1e3)
        ids, _ = moe.route(moe.router_logits(x.T, wq[0]), c.moe)
        read = kernel_bytes(wq[0], np.asarray(ids))
        row = {
            n: {"median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3), "max_ms": round(max(v), 3)}
            for n, v in times.items()
        }
        k_ms = row["kernel"]["median_ms"]
        row["kernel"]["weight_gb_s"] = round(read / (k_ms / 1e3) / 1e9, 2)
        row["kernel"]["weight_bytes"] = read
        report["tokens"][T] = row
        print(f"T={T}: " + ", ".join(f"{n} {v['median_ms']:.2f} ms" for n, v in row.items()), flush=True)
        print(f"   kernel reads {read / 1e6:.1f} MB: {row['kernel']['weight_gb_s']} GB/s", flush=True)
    text = json.dumps(report, indent=1)
    if args.output:
        Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
