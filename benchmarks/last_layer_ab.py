"""Prefill steps with and without the last-layer pruning, side by side in one process.

    .venv/bin/python benchmarks/last_layer_ab.py [--max-num-seqs 64] [--repeats 7]

Two ``ModelRunner`` instances on the ``llama-56m`` weights with the engine's
CPU attention kernel, one with ``prune_last_layer`` (the default: past its
key/value projection the last layer computes only the rows the step samples
or scores) and one without (every row, then the pick). Both are compiled
for the same buckets (``max_num_seqs`` tokens and 2048), then the same
2048-token prefill steps (16 x 128 and 8 x 256 fresh prompt tokens, one
greedy row per prompt) run through ``execute`` + ``fetch``, the two runners
alternating per repeat. Prints each step's medians, the ratio, and whether
the greedy tokens agree. Writes ``benchmarks/results/last-layer-ab-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import queue_common as qc

STEPS = {"16x128": (16, 128), "8x256": (8, 256)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork

    loaded, impl, reason = eb.load_on_default_kernel(args.model)
    cfg, s = loaded.config, args.max_num_seqs
    runners = {}
    for prune in (True, False):
        runners[prune] = ModelRunner(
            loaded.model, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, num_blocks=300, block_size=64, max_num_seqs=s, max_num_batched_tokens=2048,
            max_model_len=2048, buckets=Buckets(tokens=(s, 2048), seqs=(s,)), prune_last_layer=prune,
        )  # fmt: skip
        runners[prune].warmup()
    greedy = {"temperature": 0.0, "logprobs": False}
    rng = np.random.default_rng(0)
    rows = {}
    for name, (n, length) in STEPS.items():
        work = [SeqWork(token_ids=rng.integers(5, cfg.vocab_size - 5, length).tolist(), start_pos=0,
                        block_ids=list(range(1 + 4 * i, 5 + 4 * i)), sampling=greedy) for i in range(n)]  # fmt: skip
        tokens = {p: runners[p].execute(work).fetch()[0].tolist() for p in runners}
        times = eb.alternate({p: (lambda r=r: r.execute(work).fetch()) for p, r in runners.items()}, args.repeats)
        on, off = (1000 * statistics.median(times[p]) for p in (True, False))
        rows[name] = {"pruned_ms": round(on, 1), "full_ms": round(off, 1), "speedup": round(off / on, 3),
                      "same_tokens": tokens[True] == tokens[False],
                      "pruned_runs_ms": [round(1000 * x, 1) for x in times[True]],
                      "full_runs_ms": [round(1000 * x, 1) for x in times[False]]}  # fmt: skip
        print(f"{name}: full {off:.1f} ms, pruned {on:.1f} ms = {off / on:.3f}x; same tokens: {rows[name]['same_tokens']}")
    path = qc.write_stamped("last-layer-ab", {
        "command": " ".join([".venv/bin/python", *sys.argv]), "model": args.model, "kernel": impl.kernel,
        "reason": reason, "max_num_seqs": s, "steps": rows, "machine": qc.machine_info(),
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
