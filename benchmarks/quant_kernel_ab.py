"""Integer dots on quantized activations vs float FMAs on widened weights,
for the quantized CPU kernel (``jaxserve/kernels/cpu/qmatmul_cpu.cc``).

The question the kernel's header answers: at each token count, is it faster
to quantize the activations per token and block to int8 and take integer
dots (VNNI ``vpdpbusd``), or to widen the weights to float and FMA them
against float activations? Both read the same quantized weights.

- decode sizes (1-16 tokens): ``qmatmul_cpu(mode=0)`` (integer) against
  ``mode=1`` (float FMAs on weights widened in registers, same loop shape),
  and ``mode=2`` (the integer prefill loop, tokens in lanes) to place the
  boundary between the two integer loops;
- prefill sizes (32+ tokens): ``mode=0`` against XLA's float32 matmul on a
  dequantized copy of the weights: the float alternative at its best (the
  widening done once, not per call), so an integer win here is a lower bound;
  and ``mode=3``, the VNNI prefill loop where ``mode=0`` runs on AMX tiles
  (on a CPU without AMX the two are the same loop). Each side's rate is
  also given in GOP/s (2 x weights x tokens / time).

One process, the two sides alternated round by round over the matrices of
one SmolLM2-135M layer plus its vocabulary projection (random weights of the
same shapes), median and min-max of each side's per-round time. Above 512
tokens (prefill chunks) without the vocabulary projection: a prefill step
projects only the tokens it samples, and at 2,048 tokens its 400 MB output
would be most of what is timed.

    python benchmarks/quant_kernel_ab.py --kind q8_0 --rounds 9
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
from jaxserve.models import quant  # noqa: E402

# SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64, ffn 1536, vocab 49152
SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536), "vocab": (49152, 576)}


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="q8_0", choices=quant.KINDS)
    ap.add_argument("--tokens", default="1,4,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5, help="calls per side per round")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("the C++ CPU kernels are unavailable")
    rng = np.random.default_rng(0)
    weights = {
        n: quant.to_device(quant.quantize(rng.standard_normal(s).astype(np.float32) * 0.05, args.kind))
        for n, s in SHAPES.items()
    }
    dense = {n: quant.dequantize(w) for n, w in weights.items()}

    def chain(mode: int):
        def run(ws, xs):
            return [cpu.qmatmul_cpu(ws[n], xs[n], mode=mode) for n in xs]

        return jax.jit(run)

    integer, floats, lanes, vnni = chain(0), chain(1), chain(2), chain(3)

    xla = jax.jit(lambda ws, xs: [jnp.dot(ws[n], xs[n], preferred_element_type=jnp.float32) for n in xs])
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        shapes = {n: s for n, s in SHAPES.items() if T <= 512 or n != "vocab"}
        xs = {n: jnp.asarray(rng.standard_normal((s[1], T)).astype(np.float32)) for n, s in shapes.items()}
        ops_per_token = 2 * sum(o * i for o, i in shapes.values())
        if T <= 16:
            sides = {
                "integer": lambda xs=xs: integer(weights, xs),
                "float": lambda xs=xs: floats(weights, xs),
                "integer_token_lanes": lambda xs=xs: lanes(weights, xs),
            }
        else:
            sides = {
                "integer": lambda xs=xs: integer(weights, xs),
                "float": lambda xs=xs: xla(dense, xs),
                "integer_vnni": lambda xs=xs: vnni(weights, xs),
            }
        for f in sides.values():  # compile and warm
            jax.block_until_ready(f())
        times = {k: [] for k in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))  # alternated
            for k in order:
                times[k].append(min(timed(sides[k]) for _ in range(args.reps)))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {
            "tokens": T,
            "matrices": list(shapes),
            "float_side": "mode 1 (widened in registers)" if T <= 16 else "XLA f32 matmul on dequantized weights",
            "integer_ms": round(1e3 * med["integer"], 3),
            "float_ms": round(1e3 * med["float"], 3),
            "integer_range_ms": [round(1e3 * min(times["integer"]), 3), round(1e3 * max(times["integer"]), 3)],
            "float_range_ms": [round(1e3 * min(times["float"]), 3), round(1e3 * max(times["float"]), 3)],
            "float_over_integer": round(med["float"] / med["integer"], 3),
        }
        if "integer_token_lanes" in med:  # the prefill loop (tokens in lanes) at a decode size
            row["token_lanes_over_integer"] = round(med["integer_token_lanes"] / med["integer"], 3)
        if "integer_vnni" in med:  # the VNNI prefill loop against mode 0 (AMX where the CPU has it)
            row["vnni_ms"] = round(1e3 * med["integer_vnni"], 3)
            row["vnni_range_ms"] = [
                round(1e3 * min(times["integer_vnni"]), 3),
                round(1e3 * max(times["integer_vnni"]), 3),
            ]
            row["vnni_over_integer"] = round(med["integer_vnni"] / med["integer"], 3)
            row["integer_gop_s"] = round(ops_per_token * T / med["integer"] / 1e9, 1)
            row["vnni_gop_s"] = round(ops_per_token * T / med["integer_vnni"] / 1e9, 1)
        rows.append(row)
        print(
            f"T={T:4d}  integer {row['integer_ms']:8.3f} ms  float {row['float_ms']:8.3f} ms  "
            f"float/integer {row['float_over_integer']:.2f}x  ({row['float_side']})"
            + (
                f"  token-lanes/integer {row['token_lanes_over_integer']:.2f}x"
                if "token_lanes_over_integer" in row
                else ""
            )
            + (
                f"  vnni/integer {row['vnni_over_integer']:.2f}x"
                f" ({row['integer_gop_s']:.0f} vs {row['vnni_gop_s']:.0f} GOP/s)"
                if "vnni_over_integer" in row
                else ""
            )
        )
    if args.output:
        Path(args.output).write_text(
            json.dumps({"kind": args.kind, "rounds": args.rounds, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
