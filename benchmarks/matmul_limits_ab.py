"""Engine steps with the C++ matmul's current limits vs earlier ones, side by side in one process.

    .venv/bin/python benchmarks/matmul_limits_ab.py --model smollm2-135m [--repeats 9] [--old-tokens 64 --old-rows 8192]

Two ``ModelRunner`` instances on the same weights and the engine's default
kernels, compiled with ``jaxserve.kernels.cpu.MATMUL_MAX_TOKENS`` and
``MATMUL_MAX_ROWS`` at their current values ("new") or at ``--old-tokens``
/ ``--old-rows`` ("old"; the defaults are the limits before the C++ matmul
took prefill-sized programs and the vocabulary projection). Both run the
same steps through ``execute`` + ``fetch``, alternating per round
(``engine_bench.alternate``): a prefill step of 4 fresh 128-token prompts
(the 512-token bucket) and a greedy decode step of 64 sequences at context
192. Prints wall medians with min-max, the process's CPU seconds per step
(less sensitive to other processes on a shared machine), ratios, and
whether the sampled tokens agree. Writes
``benchmarks/results/matmul-limits-ab-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import queue_common as qc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--old-tokens", type=int, default=64)
    ap.add_argument("--old-rows", type=int, default=8192)
    args = ap.parse_args()
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.kernels import cpu as cpu_kernels
    from jaxserve.sampling_params import SamplingParams

    loaded, impl, reason = eb.load_on_default_kernel(args.model)
    cfg = loaded.config
    new = (cpu_kernels.MATMUL_MAX_TOKENS, cpu_kernels.MATMUL_MAX_ROWS)
    runners = {}
    for name, (tokens, rows) in (("new", new), ("old", (args.old_tokens, args.old_rows))):
        cpu_kernels.MATMUL_MAX_TOKENS, cpu_kernels.MATMUL_MAX_ROWS = tokens, rows
        try:
            runners[name] = ModelRunner(
                loaded.model,
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                num_blocks=300,
                block_size=64,
                max_num_seqs=64,
                max_num_batched_tokens=512,
                max_model_len=1024,
                buckets=Buckets(tokens=(64, 512), seqs=(64,)),
            )
            runners[name].warmup()
        finally:
            cpu_kernels.MATMUL_MAX_TOKENS, cpu_kernels.MATMUL_MAX_ROWS = new
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    rng = np.random.default_rng(0)
    steps = {
        "prefill 4 x 128": [
            SeqWork(
                token_ids=rng.integers(5, cfg.vocab_size - 5, 128).tolist(),
                start_pos=0,
                block_ids=[1 + 2 * i, 2 + 2 * i],
                sampling=greedy,
            )
            for i in range(4)
        ],
        "decode 64 at 192": [
            SeqWork(token_ids=[5 + i], start_pos=192, block_ids=list(range(1 + 4 * i, 5 + 4 * i)), sampling=greedy)
            for i in range(64)
        ],
    }
    out = {}
    for label, work in steps.items():
        tokens = {k: r.execute(work).fetch()[0].tolist() for k, r in runners.items()}
        cpu_s = {k: [] for k in runners}

        def timed(k, work=work, cpu_s=cpu_s):
            c = time.process_time()
            runners[k].execute(work).fetch()
            cpu_s[k].append(time.process_time() - c)

        wall = eb.alternate({k: (lambda k=k: timed(k)) for k in runners}, args.repeats)
        med = {k: 1000 * statistics.median(v) for k, v in wall.items()}
        cmed = {k: 1000 * statistics.median(v) for k, v in cpu_s.items()}
        out[label] = {
            "wall_median_ms": {k: round(v, 1) for k, v in med.items()},
            "wall_ms": {k: [round(1000 * x, 1) for x in v] for k, v in wall.items()},
            "cpu_median_ms": {k: round(v, 1) for k, v in cmed.items()},
            "wall_ratio": round(med["old"] / med["new"], 3),
            "cpu_ratio": round(cmed["old"] / cmed["new"], 3),
            "same_tokens": tokens["new"] == tokens["old"],
        }
        spread = {k: f"{1000 * min(v):.1f}-{1000 * max(v):.1f}" for k, v in wall.items()}
        print(
            f"{label}: new {med['new']:.1f} ms ({spread['new']}), old {med['old']:.1f} ms ({spread['old']}): "
            f"old/new {out[label]['wall_ratio']}x wall, {out[label]['cpu_ratio']}x CPU "
            f"({cmed['new']:.1f} vs {cmed['old']:.1f} ms); same tokens: {out[label]['same_tokens']}"
        )
    path = qc.write_stamped(
        "matmul-limits-ab",
        {
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "model": args.model,
            "kernel": impl.kernel,
            "reason": reason,
            "new": list(new),
            "old": [args.old_tokens, args.old_rows],
            "steps": out,
            "machine": qc.machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
