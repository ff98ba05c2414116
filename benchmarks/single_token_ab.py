"""One sequence's decode step in a 1-token program vs the 8-token bucket, side by side in one process.

    .venv/bin/python benchmarks/single_token_ab.py --model smollm2-135m [--repeats 30]

Two ``ModelRunner`` instances on the same weights and the engine's default
kernels: one with a 1-token bucket (``Buckets.build(..., single_token=True)``,
what the runner builds on the C++ kernels' path), one whose smallest token
bucket is 8 (so a lone decode token is padded to 8 and the matrix-vector
kernel multiplies every weight by seven zero columns too). The same greedy
decode step of one sequence at context ``--context`` runs through
``execute`` + ``fetch``, the runners alternating per round
(``engine_bench.alternate``). Prints each runner's median and min-max, the
ratio of medians and whether the tokens agree; writes
``benchmarks/results/single-token-ab-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import queue_common as qc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--context", type=int, default=192)
    args = ap.parse_args()
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.sampling_params import SamplingParams

    loaded, impl, reason = eb.load_on_default_kernel(args.model)
    cfg = loaded.config
    runners = {}
    for name, tokens in (("one", (1, 8, 256)), ("eight", (8, 256))):
        runners[name] = ModelRunner(
            loaded.model,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            num_blocks=16,
            block_size=64,
            max_num_seqs=1,
            max_num_batched_tokens=256,
            max_model_len=1024,
            buckets=Buckets(tokens=tokens, seqs=(1,)),
        )
        runners[name].warmup()
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    blocks = list(range(1, 2 + args.context // 64))
    work = [SeqWork(token_ids=[5], start_pos=args.context, block_ids=blocks, sampling=greedy)]
    tokens = {k: r.execute(work).fetch()[0].tolist() for k, r in runners.items()}
    times = eb.alternate({k: (lambda r=r: r.execute(work).fetch()) for k, r in runners.items()}, args.repeats)
    ms = {k: sorted(1000 * x for x in v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in ms.items()}
    for k, v in ms.items():
        print(f"{k}-token program: median {med[k]:.2f} ms (min {v[0]:.2f}, max {v[-1]:.2f})")
    print(f"8-token / 1-token: {med['eight'] / med['one']:.3f}x; same tokens: {tokens['one'] == tokens['eight']}")
    path = qc.write_stamped(
        "single-token-ab",
        {
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "model": args.model,
            "kernel": impl.kernel,
            "reason": reason,
            "median_ms": {k: round(v, 2) for k, v in med.items()},
            "runs_ms": {k: [round(x, 2) for x in v] for k, v in ms.items()},
            "ratio": round(med["eight"] / med["one"], 3),
            "same_tokens": tokens["one"] == tokens["eight"],
            "machine": qc.machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
