"""The README's main job: ``./dev.sh demo``.

Runs the default model offline: a few prompts through the continuous-batching
engine, printed with their timings. (The queue demo replaces this once the
worker lands.)
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str] | None = None) -> int:
    from jaxserve.engine.llm import LLM
    from jaxserve.engine.types import SamplingParams
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    print("jaxserve demo: the `tiny` preset has random weights, so its text is noise.\n")
    started = time.perf_counter()
    llm = LLM("tiny", max_num_seqs=8)
    print(f"engine ready (compiled in {time.perf_counter() - started:.1f} s)")
    prompts = ["Once upon a time", "The invoice total is", "Classify: the movie was great"]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    elapsed = time.perf_counter() - started
    for prompt, out in zip(prompts, outputs):
        print(f"- {prompt!r} -> {out.text!r} ({out.finish_reason}, {out.completion_tokens} tokens)")
    total = sum(o.completion_tokens for o in outputs)
    print(f"\n{total} tokens in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
