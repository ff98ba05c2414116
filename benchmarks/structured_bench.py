"""What structured output costs the engine (jaxserve/engine/structured.py).

Two measurements, each alternated in rounds (the variants' order rotates
every round, medians reported), offline on one engine:

``step``: the decode step time of a full batch of ``--rows`` sequences
with 0, 1 and all rows constrained. Every row samples at ``--temperature``
(so all variants run the same sampling program, and the difference is the
host's mask filling, its transfer and the masked sampling); constrained
rows follow a fixed-length regex, so no row ends inside the timed window,
and free rows ignore EOS.

``jobs``: jobs/s of ``--jobs`` extraction jobs (a short document each, a
JSON Schema of a few fields) generated with the schema and without it
(same prompts, same ``max_tokens``; free jobs end at EOS or max_tokens, so
output tokens/s is reported too).

    .venv/bin/python benchmarks/structured_bench.py --model smollm2-135m --json out.json
    .venv/bin/python benchmarks/structured_bench.py --smoke      # tiny, small, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "maxLength": 24},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
    },
    "required": ["party", "date", "amount", "currency"],
    "additionalProperties": False,
}
PARTIES = ["ACME Ltd", "Globex", "Initech", "Umbrella plc", "Stark Industries", "Wayne Enterprises"]


def documents(n: int) -> list[str]:
    out = []
    for i in range(n):
        party = PARTIES[i % len(PARTIES)]
        out.append(
            f"Contract {i}: {party} agrees to pay {100 + 37 * i} {['EUR', 'USD', 'GBP'][i % 3]} on "
            f"2025-{1 + i % 12:02d}-{1 + i % 28:02d} for services rendered.\n"
            "Return the party, date, amount and currency as JSON."
        )
    return out


def step_times(engine, rows: int, constrained: int, steps: int, temperature: float, tag: str) -> list[float]:
    """Seconds of each of ``steps`` decode steps of a full batch."""
    from jaxserve.sampling_params import SamplingParams, StructuredOutput

    spec = StructuredOutput("regex", "[a-z]{4000}")  # never complete within the window
    for i in range(rows):
        if i < constrained:
            p = SamplingParams(max_tokens=steps + 64, temperature=temperature, seed=i, structured=spec)
        else:
            p = SamplingParams(max_tokens=steps + 64, temperature=temperature, seed=i, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", f"Row {i}: write letters", p)
    # prefill and settle into full decode steps
    for _ in range(8):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for i in range(rows):
        engine.abort(f"{tag}-{i}")
    while engine.has_unfinished():
        engine.step()
    return times


def run_jobs(llm, prompts: list[str], with_schema: bool, max_tokens: int, temperature: float) -> dict:
    from jaxserve.engine.structured import json_schema_constraint
    from jaxserve.sampling_params import SamplingParams

    spec = json_schema_constraint(SCHEMA) if with_schema else None
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured=spec)
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    valid = 0
    if with_schema:
        for o in outs:
            try:
                json.loads(o.text)
                valid += o.finish_reason == "stop"
            except ValueError:
                pass
    return {
        "wall_s": wall,
        "jobs_per_s": len(prompts) / wall,
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "errors": sum(o.error is not None for o in outs),
        **({"valid_json": valid} if with_schema else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=64, help="batch rows of the step measurement (max_num_seqs)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per variant and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=500, help="extraction jobs per variant and round")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--skip", choices=["step", "jobs"], default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 8 rows, 3 steps, 1 round, 16 jobs")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.rows, args.steps, args.rounds, args.jobs, args.max_tokens = "tiny", 8, 3, 1, 16, 48

    from jaxserve.engine.llm import LLM

    llm = LLM(args.model, max_num_seqs=args.rows)
    engine = llm.engine
    result: dict = {
        "model": args.model,
        "rows": args.rows,
        "steps": args.steps,
        "rounds": args.rounds,
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    if args.skip != "step":
        variants = [0, 1, args.rows]
        samples: dict[int, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % 3 :] + variants[: r % 3]
            for v in order:
                samples[v].extend(step_times(engine, args.rows, v, args.steps, args.temperature, f"r{r}v{v}"))
        med = {v: statistics.median(s) for v, s in samples.items()}
        result["step_ms"] = {f"{v}_constrained": round(1000 * m, 3) for v, m in med.items()}
        result["step_ratio_vs_0"] = {f"{v}_constrained": round(m / med[0], 4) for v, m in med.items()}
        print(json.dumps({"step_ms": result["step_ms"], "ratio": result["step_ratio_vs_0"]}), file=sys.stderr)
    if args.skip != "jobs":
        prompts = documents(args.jobs)
        runs: dict[str, list[dict]] = {"schema": [], "free": []}
        for r in range(args.rounds):
            for name in ["schema", "free"] if r % 2 == 0 else ["free", "schema"]:
                runs[name].append(run_jobs(llm, prompts, name == "schema", args.max_tokens, args.temperature))
        result["jobs_runs"] = runs
        result["jobs_per_s"] = {k: round(statistics.median(x["jobs_per_s"] for x in v), 3) for k, v in runs.items()}
        result["tokens_per_s"] = {k: round(statistics.median(x["tokens_per_s"] for x in v), 1) for k, v in runs.items()}
        result["jobs_ratio_free_over_schema"] = round(result["jobs_per_s"]["free"] / result["jobs_per_s"]["schema"], 4)
        print(json.dumps({"jobs_per_s": result["jobs_per_s"], "tokens_per_s": result["tokens_per_s"]}), file=sys.stderr)
    result["grammars_compiled"] = engine.structured.num_compiled
    text = json.dumps(result, indent=2)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
