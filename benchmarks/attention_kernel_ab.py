"""Decode attention of two versions of the C++ CPU kernel, side by side in one process.

    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline 2278206        # that commit's kernel vs the working tree's
    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline REV --context 512 --seqs 32
    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline REV --kv-heads 3 --group 3   # SmolLM2-135M

Builds ``jaxserve/kernels/cpu/paged_attention_cpu.cc`` as it is at
``--baseline`` (``git show REV:...``) and as it is in the working tree, each
into its own library registered under its own FFI target, then times one
decode step's attention for ``--layers`` layers: ``--seqs`` sequences of
one query token at ``--context`` cached tokens, GQA ``--kv-heads`` x ``--group``
query heads of 64 (default 4 x 2), blocks
of 64 at shuffled places in a cache of ``--num-blocks`` blocks per layer
(each layer its own cache, so every step reads its keys and values from
memory, as a real decode step does). The two versions alternate per
repeat; prints medians, the KV bytes read per second, and whether the two
outputs are bitwise equal. Writes
``benchmarks/results/attention-kernel-ab-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import kernel_build as kb
import queue_common as qc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose kernel is the baseline")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--group", type=int, default=2, help="query heads per kv head (SmolLM2-135M: 3 kv heads, group 3)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    T, KVH, G, D, BS, L = args.seqs, args.kv_heads, args.group, 64, 64, args.layers
    M = (args.context + BS) // BS  # blocks per sequence, the query's own slot included
    if T * M >= args.num_blocks:
        raise SystemExit(f"--num-blocks {args.num_blocks} cannot hold {T} sequences of {M} blocks")
    targets = kb.register_versions(
        args.baseline, "paged_attention_cpu.cc", "JaxservePagedAttentionCpuFm", "attention_ab"
    )

    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(1, args.num_blocks))
    tables = np.zeros((T + 1, M), np.int32)
    for t in range(T):
        tables[t] = order[M * t : M * (t + 1)]
    seq = np.arange(T, dtype=np.int32)
    limit = np.full(T, args.context + 1, np.int32)
    lower = np.zeros(T, np.int32)
    ks = [jnp.asarray(rng.standard_normal((args.num_blocks, KVH, D, BS), np.float32)) for _ in range(L)]
    vs = [jnp.asarray(rng.standard_normal((args.num_blocks, KVH, BS, D), np.float32)) for _ in range(L)]
    q = jnp.asarray(rng.standard_normal((KVH * G * D, T), np.float32))
    cos, sin = jnp.ones((T, D), jnp.float32), jnp.zeros((T, D), jnp.float32)

    def step_for(target: str):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((T, KVH, G, D), jnp.float32))

        def step(q, ks, vs):  # each layer's output feeds the next layer's queries, as in a model
            for k, v in zip(ks, vs):
                out = call(q, cos, sin, k, v, tables, seq, limit, lower, scale=np.float32(D**-0.5))
                q = q + 1e-3 * out.reshape(T, -1).T
            return q

        return jax.jit(step)

    steps = {name: step_for(t) for name, t in targets.items()}
    outs = {name: np.asarray(f(q, ks, vs)) for name, f in steps.items()}
    same = bool(np.array_equal(*outs.values()))
    times = eb.alternate(
        {name: (lambda f=f: f(q, ks, vs).block_until_ready()) for name, f in steps.items()}, args.repeats
    )
    kv_bytes = L * T * (args.context + 1) * KVH * D * 2 * 4
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {
            "median_ms": round(1000 * med, 3),
            "kv_gb_s": round(kv_bytes / med / 1e9, 2),
            "runs_ms": [round(1000 * x, 3) for x in ts],
        }
        print(f"{name}: {1000 * med:.2f} ms for {L} layers, {kv_bytes / med / 1e9:.1f} GB/s of keys and values read")
    speedup = rows["baseline"]["median_ms"] / rows["working tree"]["median_ms"]
    print(f"working tree / baseline: {speedup:.3f}x; bitwise the same outputs: {same}")
    path = qc.write_stamped(
        "attention-kernel-ab",
        {
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "baseline": kb.commit_of(args.baseline),
            "seqs": T,
            "context": args.context,
            "layers": L,
            "kv_heads": KVH,
            "group": G,
            "num_blocks": args.num_blocks,
            "same_outputs": same,
            "speedup": round(speedup, 3),
            "versions": rows,
            "machine": qc.machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
