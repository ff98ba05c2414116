"""Decode steps with and without the C++ dense matmul, side by side in one process.

    .venv/bin/python benchmarks/cpu_matmul_ab.py [--repeats 15] [--argmax | --matvec]

Two ``ModelRunner`` instances on the ``llama-56m`` weights with the engine's
CPU attention kernel: one compiled with ``jaxserve.kernels.cpu.matmul_cpu``
serving the dense layers and the vocabulary projection of programs of up
to ``MATMUL_MAX_TOKENS`` tokens (the default), one with XLA's matmul for
everything (``MATMUL_MAX_TOKENS = 0`` while it compiles; both runners
compile every bucket ahead, so the setting is fixed in each program). The
same decode steps (``--seqs`` sequences of one token at context 192, greedy)
run through ``execute`` + ``fetch``, the runners alternating per repeat.
Prints each step's medians, the ratio and whether the greedy tokens agree.
Writes ``benchmarks/results/cpu-matmul-ab-<UTC>.json``. With ``--argmax``
the two runners both use the C++ matmul and differ in the greedy pick
instead: ``vocab_argmax_cpu`` (``ModelRunner.cpu_argmax``, the default) or
``sampler.argmax`` in XLA (``cpu-argmax-ab-<UTC>.json``). With
``--matvec`` they differ in the few-token matmul: ``matvec_cpu`` for
programs of up to 16 tokens (the default) or XLA's matmul there
(``MATVEC_TOKENS = ()``; ``cpu-matvec-ab-<UTC>.json``); token buckets start
at 8 as the engine's do, so one sequence decodes in an 8-token program.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import engine_bench as eb  # benchmarks/ is on sys.path when run as a script
import queue_common as qc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--seqs", default="64,32,16", help="decode batch sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--argmax",
        action="store_true",
        help="compare the C++ greedy argmax on and off instead (both runners on the C++ matmul)",
    )
    ap.add_argument(
        "--matvec",
        action="store_true",
        help="compare the C++ few-token matmul on and off instead (both on the other C++ kernels)",
    )
    args = ap.parse_args()
    compared = "argmax" if args.argmax else "matvec" if args.matvec else "matmul"
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.kernels import cpu as cpu_kernels
    from jaxserve.sampling_params import SamplingParams

    loaded, impl, reason = eb.load_on_default_kernel(args.model)
    cfg = loaded.config
    sizes = sorted(int(s) for s in args.seqs.split(","))
    top = sizes[-1]
    default_max, default_matvec = cpu_kernels.MATMUL_MAX_TOKENS, cpu_kernels.MATVEC_TOKENS
    runners = {}
    # per runner: (matmul token limit, matvec token counts) while compiling, C++ argmax
    off = {
        "matmul": ((0, default_matvec), True),
        "argmax": ((default_max, default_matvec), False),
        "matvec": ((default_max, ()), True),
    }[compared]
    variants = (("cpu", (default_max, default_matvec), True), ("xla", *off))
    for name, (max_tokens, matvec_tokens), cpu_argmax in variants:
        cpu_kernels.MATMUL_MAX_TOKENS, cpu_kernels.MATVEC_TOKENS = max_tokens, matvec_tokens
        try:
            runners[name] = ModelRunner(
                loaded.model,
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                num_blocks=4 * top + 20,
                block_size=64,
                max_num_seqs=top,
                max_num_batched_tokens=max(top, 256),
                max_model_len=1024,
                buckets=Buckets(tokens=tuple(sorted({*(max(8, n) for n in sizes), max(top, 256)})), seqs=tuple(sizes)),
            )
            runners[name].cpu_argmax = runners[name].cpu_argmax and cpu_argmax
            runners[name].warmup()
        finally:
            cpu_kernels.MATMUL_MAX_TOKENS, cpu_kernels.MATVEC_TOKENS = default_max, default_matvec
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    rows = {}
    for n in sizes:
        work = [
            SeqWork(token_ids=[5 + i], start_pos=192, block_ids=list(range(1 + 4 * i, 5 + 4 * i)), sampling=greedy)
            for i in range(n)
        ]
        tokens = {k: r.execute(work).fetch()[0].tolist() for k, r in runners.items()}
        times = eb.alternate(
            {k: (lambda r=r, work=work: r.execute(work).fetch()) for k, r in runners.items()}, args.repeats
        )
        cpu, xla = (1000 * statistics.median(times[k]) for k in ("cpu", "xla"))
        rows[str(n)] = {
            "cpu_matmul_ms": round(cpu, 2),
            "xla_ms": round(xla, 2),
            "speedup": round(xla / cpu, 3),
            "same_tokens": tokens["cpu"] == tokens["xla"],
            "cpu_runs_ms": [round(1000 * x, 2) for x in times["cpu"]],
            "xla_runs_ms": [round(1000 * x, 2) for x in times["xla"]],
        }
        print(
            f"{n} x decode: XLA {compared} {xla:.2f} ms, C++ {compared} {cpu:.2f} ms = {xla / cpu:.3f}x; "
            f"same tokens: {rows[str(n)]['same_tokens']}"
        )
    path = qc.write_stamped(
        f"cpu-{compared}-ab",
        {
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "model": args.model,
            "kernel": impl.kernel,
            "reason": reason,
            "max_tokens": default_max,
            "matvec_tokens": list(default_matvec),
            "compared": compared,
            "steps": rows,
            "machine": qc.machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
