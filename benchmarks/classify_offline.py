"""Where label scoring's time goes, offline: the same documents as
``classify_docs.py`` through ``LLM`` in one process, three ways:

1. ``score``: ``LLM.score(prompts, labels)`` (one prefill, four label forks);
2. ``generate``: ``LLM.generate`` of up to 8 tokens, temperature 0;
3. ``prefill``: ``LLM.generate`` of 1 token, temperature 0 (the prompt's
   prefill and one sample: the floor under both).

    .venv/bin/python benchmarks/classify_offline.py                 # 256 documents per run, 2 rounds: ~5 min
    .venv/bin/python benchmarks/classify_offline.py --num-docs 64 --rounds 1

The engine is built once (``llama-56m``, ``max_num_seqs`` 256,
``max_num_batched_tokens`` 2048 as ``classify_docs.py``'s workers) and
warmed up; every timed run gets documents no earlier run saw, so no whole
prompt comes from the prefix cache (the shared instruction does, in every
mode alike). The rounds interleave the modes in rotating order; the report is
each mode's median docs/s and prompt tok/s, and score's and generate's cost
next to prefill's. Writes ``benchmarks/results/classify-offline-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import queue_common as qc  # benchmarks/ is on sys.path when run as a script
from classify_docs import LABELS, make_docs

REPO = Path(__file__).resolve().parent.parent
MODES = ("score", "generate", "prefill")


def documents(n: int) -> list[str]:
    """The user messages of ``classify_docs.py``'s documents (the same generator and seed)."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = make_docs(n, Path(tmp))
        return [json.loads(line)["messages"][0]["content"] for line in jobs.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=256, help="documents per timed run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    from jaxserve.engine.llm import LLM
    from jaxserve.engine.types import SamplingParams
    from jaxserve.presets import resolve_model

    runs = args.rounds * len(MODES)
    docs = documents(args.num_docs * runs + 32)
    t0 = time.perf_counter()
    llm = LLM(str(resolve_model(args.model)), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    warm = docs[-32:]
    llm.score(warm[:16], LABELS)
    llm.generate(warm[16:], SamplingParams(max_tokens=8, temperature=0))
    startup = time.perf_counter() - t0
    tok = llm.engine.tokenizer
    samples: dict[str, list[dict]] = {m: [] for m in MODES}
    run = 0
    for r in range(args.rounds):
        for i in range(len(MODES)):
            mode = MODES[(r + i) % len(MODES)]
            batch = docs[run * args.num_docs : (run + 1) * args.num_docs]
            run += 1
            prompt_tokens = sum(len(tok.encode(d)) for d in batch)
            t = time.perf_counter()
            if mode == "score":
                out = llm.score(batch, LABELS)
                ok = sum(1 for x in out if isinstance(x, list))
            else:
                out = llm.generate(batch, SamplingParams(max_tokens=8 if mode == "generate" else 1, temperature=0))
                ok = sum(1 for x in out if x.error is None)
            wall = time.perf_counter() - t
            samples[mode].append({"round": r, "docs": len(batch), "ok": ok, "wall_s": round(wall, 3),
                                  "docs_per_s": round(len(batch) / wall, 2),
                                  "prompt_tokens_per_s": round(prompt_tokens / wall, 1),
                                  "load1": round(os.getloadavg()[0], 2)})  # fmt: skip
            print(json.dumps({"mode": mode, **samples[mode][-1]}), flush=True)
    summary = {m: {"docs_per_s": statistics.median(s["docs_per_s"] for s in samples[m]),
                   "prompt_tokens_per_s": round(statistics.median(s["prompt_tokens_per_s"] for s in samples[m]), 1)}
               for m in MODES}  # fmt: skip
    base = summary["prefill"]["docs_per_s"]
    for m in MODES:
        summary[m]["time_vs_prefill"] = round(base / summary[m]["docs_per_s"], 3)
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    result = {"benchmark": "classify_offline", "command": " ".join([".venv/bin/python", *sys.argv]), "stamp": stamp,
              "args": vars(args), "startup_s": round(startup, 1), "machine": qc.machine_info(), "summary": summary,
              "samples": samples}  # fmt: skip
    path = REPO / "benchmarks" / "results" / f"classify-offline-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print("\n| mode | docs/s (median) | prompt tok/s | time per doc vs prefill |\n|---|---|---|---|")
    for m in MODES:
        s = summary[m]
        print(f"| {m} | {s['docs_per_s']} | {s['prompt_tokens_per_s']} | {s['time_vs_prefill']:.2f}x |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
