"""Decode attention of two versions of the C++ CPU kernel, side by side in one process.

    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline 2278206        # that commit's kernel vs the working tree's
    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline REV --context 512 --seqs 32
    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline REV --kv-heads 3 --group 3   # SmolLM2-135M
    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline REV --head-dim 256 --kv-heads 1 --group 8
    .venv/bin/python benchmarks/attention_kernel_ab.py --baseline REV --softcap 50 --sinks   # the features' cost

Builds ``jaxserve/kernels/cpu/paged_attention_cpu.cc`` as it is at
``--baseline`` (``git show REV:...``) and as it is in the working tree, each
into its own library registered under its own FFI target, then times one
decode step's attention for ``--layers`` layers: ``--seqs`` sequences of
one query token at ``--context`` cached tokens, GQA ``--kv-heads`` x ``--group``
query heads of ``--head-dim`` (default 4 x 2 of 64), blocks
of 64 at shuffled places in a cache of ``--num-blocks`` blocks per layer
(each layer its own cache, so every step reads its keys and values from
memory, as a real decode step does). The two versions alternate per
repeat; prints medians, the KV bytes read per second, and whether the two
outputs are bitwise equal. ``--softcap CAP`` and ``--sinks`` turn the
logit soft-cap and attention sinks on in the working tree's kernel only
(the baseline's output then differs, by design): what the features cost
against the plain kernel. A kernel from before the features existed (no
sinks buffer, no ``logit_softcap`` attribute) is called without them. Writes
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
    ap.add_argument("--head-dim", type=int, default=64, help="64 (SmolLM2, gpt-oss), 128 (Qwen3), 256 (Gemma)")
    ap.add_argument("--softcap", type=float, default=0.0, help="the working tree's logit soft-cap (0: off)")
    ap.add_argument("--sinks", action="store_true", help="attention sinks in the working tree's kernel")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    T, KVH, G, D, BS, L = args.seqs, args.kv_heads, args.group, args.head_dim, 64, args.layers
    M = (args.context + BS) // BS  # blocks per sequence, the query's own slot included
    if T * M >= args.num_blocks:
        raise SystemExit(f"--num-blocks {args.num_blocks} cannot hold {T} sequences of {M} blocks")
    source = "paged_attention_cpu.cc"
    targets = kb.register_versions(args.baseline, source, "JaxservePagedAttentionCpuFm", "attention_ab")
    # which versions take the sinks buffer and the logit_softcap attribute
    with_features = {
        "baseline": "logit_softcap" in (kb._git_show(args.baseline, f"{kb.KERNELS}/{source}") or ""),
        "working tree": True,
    }

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
    sinks = jnp.asarray(rng.standard_normal(KVH * G), jnp.float32) if args.sinks else jnp.zeros((0,), jnp.float32)

    def step_for(name: str, target: str):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((T, KVH, G, D), jnp.float32))
        features: tuple = ()
        attrs = {"scale": np.float32(D**-0.5)}
        if with_features[name]:
            on = name == "working tree"
            features = (sinks if on else jnp.zeros((0,), jnp.float32),)
            attrs["logit_softcap"] = np.float32(args.softcap if on else 0.0)

        def step(q, ks, vs):  # each layer's output feeds the next layer's queries, as in a model
            for k, v in zip(ks, vs):
                out = call(q, cos, sin, k, v, tables, seq, limit, lower, *features, **attrs)
                q = q + 1e-3 * out.reshape(T, -1).T
            return q

        return jax.jit(step)

    steps = {name: step_for(name, t) for name, t in targets.items()}
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
            "head_dim": D,
            "softcap": args.softcap,
            "sinks": args.sinks,
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
