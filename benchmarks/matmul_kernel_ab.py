"""A chain of decode layers' matmuls on two versions of a C++ matmul kernel, and on XLA, in one process.

    .venv/bin/python benchmarks/matmul_kernel_ab.py --baseline 8325c81                # matmul_cpu.cc, 64 tokens
    .venv/bin/python benchmarks/matmul_kernel_ab.py --baseline REV --kernel matvec --tokens 8

Builds ``matmul_cpu.cc`` (``--kernel matmul``) or ``matvec_cpu.cc``
(``--kernel matvec``) as it is at ``--baseline`` and in the working tree
(``kernel_build.py``), then times the dense matmuls of ``--layers`` decode
layers of the ``llama-56m`` shapes (fused q/k/v ``[1024, 512]``, output
``[512, 512]``, fused gate/up ``[2816, 512]``, down ``[512, 1408]``) at
``--tokens`` tokens, as a chain: each product feeds the next, as in a model,
so no two run at once. ``--copies`` copies of the weights (random, 94 MB
each) are used in turn, so that with more than fit in the last-level cache
every run reads its weights from memory as a decode step does. The two
versions and XLA's matmul alternate per repeat; prints medians and whether
the two versions' outputs are bitwise equal. Writes
``benchmarks/results/matmul-kernel-ab-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import numpy as np

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import kernel_build as kb
import queue_common as qc

SHAPES = ((1024, 512), (512, 512), (2816, 512), (512, 1408))  # llama-56m's dense layers, [out, in]
SOURCES = {"matmul": ("matmul_cpu.cc", "JaxserveMatmulCpu"), "matvec": ("matvec_cpu.cc", "JaxserveMatvecCpu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose kernel is the baseline")
    ap.add_argument("--kernel", choices=sorted(SOURCES), default="matmul")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--copies", type=int, default=6, help="weight copies used in turn (6 x 94 MB)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    source, symbol = SOURCES[args.kernel]
    targets = kb.register_versions(args.baseline, source, symbol, f"{args.kernel}_ab")
    T = args.tokens
    rng = np.random.default_rng(0)
    models = [
        [[jnp.asarray(0.05 * rng.standard_normal(s, np.float32)) for s in SHAPES] for _ in range(args.layers)]
        for _ in range(args.copies)
    ]
    x = jnp.asarray(rng.standard_normal((SHAPES[0][1], T), np.float32))

    def chain_for(mm):
        def chain(layers, x):
            for qkv, o, gate_up, down in layers:  # the shapes of one layer's products, each feeding the next
                y = mm(qkv, x)[: o.shape[1]]
                y = mm(o, y)
                y = mm(gate_up, y)[: down.shape[1]]
                x = mm(down, y)
            return x

        return jax.jit(chain)

    def ffi(target):
        return lambda w, x: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32))(w, x)

    chains = {name: chain_for(ffi(t)) for name, t in targets.items()}
    chains["XLA"] = chain_for(lambda w, x: jnp.dot(w, x, preferred_element_type=jnp.float32))
    outs = {name: np.asarray(f(models[0], x)) for name, f in chains.items()}
    same = bool(np.array_equal(outs["baseline"], outs["working tree"]))
    weights = itertools.cycle(models)  # each run the next copy
    times = eb.alternate(
        {name: (lambda f=f: f(next(weights), x).block_until_ready()) for name, f in chains.items()}, args.repeats
    )
    flop = 2 * T * args.layers * sum(o * i for o, i in SHAPES)
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {
            "median_ms": round(1000 * med, 3),
            "gflop_s": round(flop / med / 1e9, 1),
            "runs_ms": [round(1000 * t, 3) for t in ts],
        }
        print(f"{name}: {1000 * med:.2f} ms for {args.layers} layers at {T} tokens ({flop / med / 1e9:.0f} GFLOP/s)")
    speedup = rows["baseline"]["median_ms"] / rows["working tree"]["median_ms"]
    print(f"working tree / baseline: {speedup:.3f}x; bitwise the same outputs: {same}")
    path = qc.write_stamped(
        "matmul-kernel-ab",
        {
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "baseline": kb.commit_of(args.baseline),
            "kernel": args.kernel,
            "tokens": T,
            "layers": args.layers,
            "copies": args.copies,
            "same_outputs": same,
            "speedup": round(speedup, 3),
            "versions": rows,
            "machine": qc.machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
