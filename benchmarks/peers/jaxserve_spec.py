"""jaxserve's engine with or without speculative decoding, kept loaded, jobs a few at a time.

    .venv/bin/python benchmarks/peers/jaxserve_spec.py --model smollm2-135m \
        --num-speculative-tokens 4 [--quantization int8] [--smoke] --serve

One engine as a worker builds it (the ``serve`` profile; no seats reserved
for interactive jobs, since every job here is a batch job), whose
``num_speculative_tokens`` is the one setting the two systems of the
``speculative`` scenario differ in. Three workloads, built here from the
repository's files with the engine's own tokenizer, so both systems get
the same token ids:

- ``invoices``: the README's extraction jobs (``docs/examples/invoices.csv``,
  its chat template and question, ``docs/examples/invoice.schema.json`` as the
  job's JSON Schema), greedy, up to 96 tokens;
- ``summaries``: ``benchmarks/data/summaries.jsonl``, each text with a request
  to summarize it in its own words (a chat turn), greedy, up to 128 tokens;
- ``random``: 64 random token ids (no special tokens), greedy, exactly 128
  tokens (EOS ignored): nothing to copy.

``run WORKLOAD CONCURRENCY JOBS`` runs ``JOBS`` jobs of the workload (its
prompts in order, cycled), at most ``CONCURRENCY`` in the engine at once (a
new one is added as one finishes), and prints one ``result`` line: output
tokens per second over the run, the steps, the guesses made and kept, and a
digest of every job's tokens (equal digests: equal outputs).
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from pathlib import Path

from common import emit, serve_commands

ROOT = Path(__file__).resolve().parents[2]
INVOICE_QUESTION = "Which company sent this, on what date, for what amount and in which currency? Answer in JSON."
SUMMARY_REQUEST = "Summarize the text above in two or three sentences."


def workloads(engine, smoke: bool) -> dict[str, tuple[list[list[int]], object]]:
    """Each workload's prompts (token ids) and sampling parameters."""
    import numpy as np

    from jaxserve.engine.structured import json_schema_constraint
    from jaxserve.sampling_params import SamplingParams

    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return list(
            tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        )

    with open(ROOT / "docs" / "examples" / "invoices.csv", newline="") as f:
        invoices = [chat(f"{row['text']}\n\n{INVOICE_QUESTION}") for row in csv.DictReader(f)]
    schema = json.loads((ROOT / "docs" / "examples" / "invoice.schema.json").read_text())
    with open(ROOT / "benchmarks" / "data" / "summaries.jsonl") as f:
        summaries = [chat(f"{json.loads(line)['text']}\n\n{SUMMARY_REQUEST}") for line in f if line.strip()]
    rng = np.random.default_rng(0)
    special = set(engine.special_token_ids)
    pool = np.array([i for i in range(min(tok.vocab_size, engine.model_config.vocab_size)) if i not in special])
    random_prompts = [rng.choice(pool, size=64).tolist() for _ in range(16)]
    short = 16 if smoke else None
    return {
        "invoices": (
            invoices,
            SamplingParams(max_tokens=short or 96, temperature=0.0, structured=json_schema_constraint(schema)),
        ),
        "summaries": (summaries, SamplingParams(max_tokens=short or 128, temperature=0.0)),
        "random": (random_prompts, SamplingParams(max_tokens=short or 128, temperature=0.0, ignore_eos=True)),
    }


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-speculative-tokens", type=int, required=True)
    parser.add_argument("--quantization", default=None, help="int8 or int4 weights (as the CLI's --quantization)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="16-token outputs: a check that it runs")
    parser.add_argument("--serve", action="store_true", help="wait for 'run WORKLOAD CONCURRENCY JOBS' on stdin")
    args = parser.parse_args()

    started = time.perf_counter()
    import jaxserve
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine
    from jaxserve.worker.logs import configure_logging

    configure_logging(level="warning")
    engine = Engine(
        EngineArgs.for_profile(
            "serve",
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            interactive_reserved_seqs=0,
            max_model_len=1024,
            num_speculative_tokens=args.num_speculative_tokens,
            **({"quantization": args.quantization} if args.quantization else {}),
        )
    )
    engine.warmup()
    jobs = workloads(engine, args.smoke)
    runs = 0

    def run(workload: str, concurrency: int, count: int) -> dict:
        nonlocal runs
        runs += 1
        prompts, params = jobs[workload]
        queue = [(f"{workload}-{runs}-{i}", prompts[i % len(prompts)]) for i in range(count)]
        stats0 = engine.scheduler.stats()
        steps0 = engine.num_steps
        tokens: dict[str, list[int]] = {}
        in_flight = 0
        t0 = time.perf_counter()
        while queue or engine.has_unfinished():
            while queue and in_flight < concurrency:
                rid, prompt = queue.pop(0)
                engine.add_request(rid, prompt, params, request_class="batch")
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    if out.error is not None:
                        raise RuntimeError(f"{out.request_id}: {out.error}")
                    tokens[out.request_id] = out.token_ids
                    in_flight -= 1
        elapsed = time.perf_counter() - t0
        stats = engine.scheduler.stats()
        generated = sum(len(t) for t in tokens.values())
        in_order = [tokens[k] for k in sorted(tokens, key=lambda k: int(k.rsplit("-", 1)[1]))]
        digest = hashlib.sha256(json.dumps(in_order).encode()).hexdigest()[:16]
        return {
            "workload": workload,
            "concurrency": concurrency,
            "jobs": count,
            "output_tokens": generated,
            "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(generated / elapsed, 2),
            "steps": engine.num_steps - steps0,
            "draft_tokens": stats.num_draft_tokens - stats0.num_draft_tokens,
            "accepted_tokens": stats.num_accepted_tokens - stats0.num_accepted_tokens,
            "digest": digest,
        }

    base = {
        "system": "jaxserve",
        "version": getattr(jaxserve, "__version__", "dev"),
        "startup_s": round(time.perf_counter() - started, 2),
        "compile_s": round(engine.compile_seconds, 2),
        "settings": {
            "num_speculative_tokens": args.num_speculative_tokens,
            "quantization": args.quantization,
            "max_num_seqs": args.max_num_seqs,
            "attention": engine.attention.kernel,
            "token_buckets": list(engine.runner.buckets.tokens),
        },
    }
    if not args.serve:
        for name in jobs:
            emit({"event": "result", **base, **run(name, 1, 2)})
        return
    serve_commands(base, lambda args: run(args[0], int(args[1]), int(args[2])))


if __name__ == "__main__":
    main()
