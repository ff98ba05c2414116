"""Offline throughput with and without async scheduling, side by side in one process.

    .venv/bin/python benchmarks/async_scheduling_ab.py [--num-prompts 64] [--rounds 4]

Two ``LLM`` engines on the ``llama-56m`` preset (``max_num_seqs =
min(prompts, 256)``, prefix caching off), one with ``async_scheduling`` and
one without, each warmed up; then ``--rounds`` rounds of ``generate`` on the
same random 128-token prompts -> 128 greedy tokens (``ignore_eos``), the two
engines' order alternating per round. Prints each run's output tokens/s and
the medians' ratio (async / sync). The question it answers: what does
launching step N+1 before waiting for step N buy on this host (the queue
worker turns it off, see ``jaxserve.worker.factory``)?
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--model", default="llama-56m")
    args = ap.parse_args()
    import numpy as np

    from jaxserve.engine.llm import LLM
    from jaxserve.engine.types import SamplingParams
    from jaxserve.presets import resolve_model
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    model, n = str(resolve_model(args.model)), args.num_prompts
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, size=128).tolist() for _ in range(n)]
    llms = {mode: LLM(model, max_num_seqs=min(n, 256), max_model_len=256, enable_prefix_caching=False,
                      async_scheduling=mode) for mode in (False, True)}  # fmt: skip
    for llm in llms.values():
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            t = time.perf_counter()
            outs = llms[mode].generate(prompts, params)
            rates[mode].append(round(sum(o.completion_tokens for o in outs) / (time.perf_counter() - t), 1))
            print(f"round {r} async={mode}: {rates[mode][-1]} tok/s", flush=True)
    sync, overlapped = statistics.median(rates[False]), statistics.median(rates[True])
    print(json.dumps({"num_prompts": n, "sync_tok_s": rates[False], "async_tok_s": rates[True],
                      "median_sync": sync, "median_async": overlapped, "async_over_sync": round(overlapped / sync, 3)}))


if __name__ == "__main__":
    main()
