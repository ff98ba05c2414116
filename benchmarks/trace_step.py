"""Where one compiled engine step spends its time, op by op (``jax.profiler``).

    .venv/bin/python benchmarks/trace_step.py --step prefill      # 16 x 128-token prompts, one 2048-token step
    .venv/bin/python benchmarks/trace_step.py --step decode       # 64 sequences at context 192 (--seqs N: N)
    .venv/bin/python benchmarks/trace_step.py --step mixed        # a classification step: 16 x 250-token prompts + 96 decodes

Builds a ``ModelRunner`` on the preset's weights with the engine's default
kernel choice, runs the step a few times untraced, then ``--repeats`` times
under ``jax.profiler.trace(create_perfetto_trace=True)``, and sums the
trace's complete events of the XLA CPU thunks per step: the YNNPACK fusions
(the matmuls, with whatever XLA fused into them), the attention custom calls
(``ffi_call``: the C++ kernels, attention and, in programs of up to 64 tokens,
the dense layers' matmuls; ``--top`` lists the costliest ops, the kernels by
their target name) and
the other fusions by kind (element-wise work). Writes ``benchmarks/results/trace-<step>-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import queue_common as qc


def category(name: str) -> str | None:
    """The bucket of one trace event's name (None: not an XLA op, or a
    container such as ``cond`` whose inner ops are counted themselves)."""
    if name.startswith("ynn_fusion"):
        return "matmuls (ynn fusions)"
    if name.startswith("ffi_call"):
        return "C++ kernels (ffi custom calls)"
    if re.match(r"^[a-z_]+_fusion(\.\d+)?$", name) or re.match(r"^(scatter|gather|copy|transpose|reduce)", name):
        return "other: " + re.sub(r"(\.\d+)?$", "", name)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--step", choices=["prefill", "decode", "mixed"], default="prefill")
    ap.add_argument("--seqs", type=int, default=64, help="decode: the number of sequences (1-64)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--quantization", choices=["int8", "int4"], default=None, help="weights as --quantization loads them"
    )
    ap.add_argument(
        "--top", type=int, default=0, help="also list the N costliest single ops (name, ms and calls per step)"
    )
    args = ap.parse_args()

    import jax

    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.sampling_params import SamplingParams

    loaded, impl, reason = eb.load_on_default_kernel(args.model, args.quantization)
    cfg = loaded.config
    if args.step == "mixed":  # the shape of classify_docs.py's steps (256 sequences, 4096-token budget)
        sizes = dict(
            num_blocks=900,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            max_model_len=1024,
            buckets=Buckets(tokens=(256, 4096), seqs=(128, 256)),
        )
    elif args.step == "decode":
        # the buckets an engine of max_num_seqs = --seqs builds (one sequence: the 1-token program on the C++ kernels)
        sizes = dict(num_blocks=300, max_num_seqs=args.seqs, max_num_batched_tokens=2048, max_model_len=2048)
    else:
        sizes = dict(
            num_blocks=300,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            buckets=Buckets(tokens=(64, 2048), seqs=(64,)),
        )
    runner = ModelRunner(
        loaded.model,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        block_size=64,
        **sizes,
    )
    runner.warmup()
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    rng = np.random.default_rng(0)
    if args.step == "mixed":
        work = [
            SeqWork(
                token_ids=rng.integers(5, cfg.vocab_size - 5, 250).tolist(),
                start_pos=0,
                block_ids=list(range(1 + 5 * i, 6 + 5 * i)),
                sampling=greedy,
            )
            for i in range(16)
        ]
        work += [
            SeqWork(token_ids=[7], start_pos=250, block_ids=list(range(100 + 5 * i, 105 + 5 * i)), sampling=greedy)
            for i in range(96)
        ]
    elif args.step == "decode":
        work = [
            SeqWork(token_ids=[5], start_pos=192, block_ids=list(range(1 + 4 * i, 5 + 4 * i)), sampling=greedy)
            for i in range(args.seqs)
        ]
    else:
        work = [
            SeqWork(
                token_ids=rng.integers(5, cfg.vocab_size - 5, 128).tolist(),
                start_pos=0,
                block_ids=list(range(1 + 2 * i, 3 + 2 * i)),
                sampling=greedy,
            )
            for i in range(16)
        ]
    for _ in range(3):
        runner.execute(work).fetch()
    folder = Path(tempfile.mkdtemp(prefix="jaxserve-trace-"))
    walls = []
    try:
        with jax.profiler.trace(str(folder), create_perfetto_trace=True):
            for _ in range(args.repeats):
                t = time.perf_counter()
                runner.execute(work).fetch()
                walls.append(time.perf_counter() - t)
        (trace,) = glob.glob(str(folder / "**" / "*.trace.json.gz"), recursive=True)
        events = json.load(gzip.open(trace))["traceEvents"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # a C++ kernel's events are named ffi_call.N: counted by the custom call's target instead
    hlo = runner.forward_program(sum(len(w.token_ids) for w in work)).as_text()
    targets = dict(re.findall(r"%?(ffi_call[.\d]*) = .*?custom_call_target=\"([^\"]+)\"", hlo))
    per_step, per_op, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (cat := category(e.get("name", ""))) is not None:
            name = targets.get(e["name"], e["name"])
            per_step[cat] += e["dur"] / 1000 / args.repeats  # microseconds -> ms per step
            per_op[name] += e["dur"] / 1000 / args.repeats
            calls[name] += 1 / args.repeats
    ops = sum(per_step.values())
    result = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "model": args.model,
        "quantization": args.quantization,
        "step": args.step,
        "kernel": impl.kernel,
        "reason": reason,
        "step_ms_median": round(1000 * float(np.median(walls)), 1),
        "ops_ms_per_step": {k: round(v, 2) for k, v in per_step.most_common()},
    }
    print(f"{args.step} step, {impl.kernel} attention: median {result['step_ms_median']} ms wall\n")
    print("| ops | ms per step | share of op time |\n|---|---|---|")
    for k, v in per_step.most_common(12):
        print(f"| {k} | {v:.1f} | {100 * v / ops:.0f}% |")
    if args.top:
        result["top_ops"] = [
            {"name": k, "ms": round(v, 3), "calls": round(calls[k], 1)} for k, v in per_op.most_common(args.top)
        ]
        print("\n| op | ms per step | calls per step |\n|---|---|---|")
        for row in result["top_ops"]:
            print(f"| {row['name']} | {row['ms']:.2f} | {row['calls']:g} |")
    path = qc.write_stamped(f"trace-{args.step}", result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
