"""What a batch step costs by token bucket, alternated in one engine.

    .venv/bin/python benchmarks/step_bucket_probe.py [--model smollm2-135m] [--rounds 14] [--quantization int8]

A loaded interactive first token waits for the rest of the batch step in
flight (``queue_interactive_ttft.py --profile``), so what bounds that step
(``EngineArgs.interactive_step_tokens``) should follow what a step costs.
The runner pads a step to its token bucket (1, 8, 16, 32, 64, ...), so this
times one engine's steps of four shapes, in alternating order each round,
with 24 batch sequences decoding (the worker's seats at ``max_num_seqs``
32 with its interactive reserve):

- ``b64``: 24 decodes and a 32-token batch prompt (the batch prompt cap's
  step: 56 tokens, bucket 64);
- ``b32``: the 24 decodes (bucket 32);
- ``b16`` / ``b8``: the decodes cut to 16 / 8 by ``interactive_step_tokens``
  with interactive work marked as just seen.

Each figure is the ``Engine.step`` call that collects a step of that shape
(the engine pipelines: a call collects the step launched by the previous
one). Printed: median, min and max per shape, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.sampling_params import SamplingParams

SHAPES = ("b64", "b32", "b16", "b8")
STEP_CAP = {"b64": 0, "b32": 0, "b16": 16, "b8": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--decodes", type=int, default=24)
    args = ap.parse_args()

    engine = Engine(
        EngineArgs(
            model=args.model,
            quantization=args.quantization,
            max_num_seqs=32,
            max_num_batched_tokens=512,
            max_model_len=256,
            async_scheduling=False,
            interactive_batch_prefill_tokens=32,
            interactive_step_tokens=0,
        )
    )
    engine.warmup()
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(args.decodes):
        engine.add_request(f"b{i}", rng.integers(100, 10000, size=24).tolist(), greedy)
    for _ in range(4):  # every prompt computed: decodes only
        engine.step()
    sched = engine.scheduler
    times: dict[str, list[float]] = {k: [] for k in SHAPES}
    for rnd in range(args.rounds):
        for shape in SHAPES if rnd % 2 == 0 else SHAPES[::-1]:
            sched._interactive_seen = sched._clock()  # as if an interactive job had just been seen
            sched.config.interactive_step_tokens = STEP_CAP[shape]
            if shape == "b64":
                engine.add_request(
                    f"p{rnd}", rng.integers(100, 10000, size=32).tolist(), SamplingParams(max_tokens=1, temperature=0.0)
                )
            engine.step()  # launches a step of this shape
            t0 = time.perf_counter()
            engine.step()  # collects it
            times[shape].append(time.perf_counter() - t0)
            sched.config.interactive_step_tokens = 0
            engine.step()
    for shape, xs in times.items():
        print(
            f"{shape}: median {1000 * statistics.median(xs):.1f} ms, min {1000 * min(xs):.1f}, "
            f"max {1000 * max(xs):.1f} (n={len(xs)})"
        )


if __name__ == "__main__":
    main()
