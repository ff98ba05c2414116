"""One engine step on each CPU attention kernel, side by side in one process.

    .venv/bin/python benchmarks/kernel_steps.py                  # llama-56m, about 5 min
    .venv/bin/python benchmarks/kernel_steps.py --repeats 3 --backends cpu

For each ``attention_backend`` (``reference``: the pure-JAX kernels;
``cpu``: the C++ kernel of ``jaxserve/kernels/cpu``) a ``ModelRunner`` over
the preset's weights is compiled for the buckets these steps use, then the
same steps are timed through ``ModelRunner.execute`` + ``fetch`` (median of
``--repeats``, backends interleaved per repeat so a slow minute hits both):

- prefill steps of 2048 (and 1024) fresh prompt tokens, cut into prompts of
  128, 256, 512 and 2048 tokens (a larger step budget must not be slower per
  token);
- a decode step of 64 sequences at context 192 (greedy in the forward program).

Prefill tokens/s are also given as a share of the machine's float32 matmul
rate (best of a few jitted 1536^2 and 2048^2 matmuls, measured here): the
dense layers' FLOPs (2 x the non-embedding layer parameters per token)
divided by the step time. Writes ``benchmarks/results/kernel-steps-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import queue_common as qc  # benchmarks/ is on sys.path when run as a script

PREFILL = [(128, 16), (256, 8), (512, 4), (2048, 1), (128, 8)]  # (prompt length, prompts)
DECODE = (64, 192)  # sequences, context


def matmul_rate() -> float:
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in (1536, 2048):
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        for _ in range(5):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--backends", nargs="+", default=["reference", "cpu"], choices=["reference", "cpu"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax.numpy as jnp

    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.kernels.backends import select_attention
    from jaxserve.models.loader import load_model
    from jaxserve.presets import resolve_model
    from jaxserve.sampling_params import SamplingParams

    loaded = load_model(resolve_model(args.model))
    cfg = loaded.config
    bs = 64
    layer_params = sum(
        int(np.prod(np.shape(a)))
        for layer in loaded.model.layers
        for k, a in layer.arrays().items()
        if a is not None and k.startswith(("w",))
    )
    flops_per_token = 2 * layer_params
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    rng = np.random.default_rng(0)

    def prefill_work(length: int, n: int) -> list:
        nb = -(-length // bs)
        return [
            SeqWork(
                token_ids=rng.integers(5, cfg.vocab_size - 5, length).tolist(),
                start_pos=0,
                block_ids=list(range(1 + i * nb, 1 + (i + 1) * nb)),
                sampling=greedy,
            )
            for i in range(n)
        ]

    seqs, ctx = DECODE
    nb = -(-(ctx + 1) // bs)
    decode = [
        SeqWork(token_ids=[7], start_pos=ctx, block_ids=list(range(1 + i * nb, 1 + (i + 1) * nb)), sampling=greedy)
        for i in range(seqs)
    ]
    cases = {f"prefill {n}x{length}": prefill_work(length, n) for length, n in PREFILL}
    cases[f"decode {seqs}x ctx {ctx}"] = decode

    runners = {}
    for backend in args.backends:
        impl, reason = select_attention(
            backend,
            head_dim=cfg.head_dim,
            num_kv_heads=cfg.num_key_value_heads,
            block_size=bs,
            sliding_window=cfg.effective_sliding_window,
            cache_dtype=jnp.float32,
        )
        loaded.model.attention = impl
        runner = ModelRunner(
            loaded.model,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            num_blocks=max(seqs * nb, 32) + 1,
            block_size=bs,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            buckets=Buckets(tokens=(64, 1024, 2048), seqs=(64,)),
        )
        runner.warmup()
        runners[backend] = runner
        print(f"{backend}: {reason}, compiled in {runner.compile_seconds:.1f} s", flush=True)
    for runner in runners.values():  # warm every case once
        for work in cases.values():
            runner.execute(work).fetch()
    rate_before = matmul_rate()
    times = {b: {c: [] for c in cases} for b in runners}
    for rep in range(args.repeats):
        for name, work in cases.items():
            for backend in runners if rep % 2 == 0 else reversed(list(runners)):
                t = time.perf_counter()
                runners[backend].execute(work).fetch()
                times[backend][name].append(time.perf_counter() - t)
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    rate = max(rate_before, matmul_rate())
    result = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "model": args.model,
        "repeats": args.repeats,
        "matmul_gflop_s": round(rate, 1),
        "dense_mflop_per_token": round(flops_per_token / 1e6, 2),
        "cases": {},
    }
    print(f"\nmachine float32 matmul: {rate:.1f} GFLOP/s\n")
    print(
        "| step | "
        + " | ".join(f"{b} ms" for b in runners)
        + " | "
        + " | ".join(f"{b} tok/s" for b in runners)
        + " | "
        + " | ".join(f"{b} dense share" for b in runners)
        + " |"
    )
    print("|---" * (1 + 3 * len(runners)) + "|")
    for name, work in cases.items():
        tokens = sum(len(w.token_ids) for w in work)
        row = {}
        for b in runners:
            med = statistics.median(times[b][name])
            row[b] = {
                "ms": round(1000 * med, 1),
                "tokens_per_s": round(tokens / med, 1),
                "dense_share": round(tokens * flops_per_token / med / 1e9 / rate, 3),
                "samples_ms": [round(1000 * t, 1) for t in times[b][name]],
            }
        result["cases"][name] = {"tokens": tokens, **row}
        print(
            f"| {name} | "
            + " | ".join(f"{row[b]['ms']}" for b in runners)
            + " | "
            + " | ".join(f"{row[b]['tokens_per_s']:.0f}" for b in runners)
            + " | "
            + " | ".join(f"{100 * row[b]['dense_share']:.0f}%" for b in runners)
            + " |"
        )
    path = qc.write_stamped("kernel-steps", result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
