"""Queue batch path vs offline engine on the same prompts and engine settings.

    .venv/bin/python benchmarks/queue_batch_vs_offline.py [--num-prompts 2000] [--repeats 3]

N short classification prompts ("Classify sentiment: <synthetic review>
\\nSentiment:", 20-40 tokens with the ``tiny`` tokenizer, generated from
``--seed``), ``max_tokens`` 6, temperature 0, run

(a) through ``jaxserve batch IN.jsonl -o OUT.jsonl`` against a
    ``jaxserve worker --model tiny --prefix bench-batch-<uuid>`` started here
    (engine settings passed with ``--engine-arg``), timed from the first
    publish to the last result (a timing shim wraps the client's ``publish``
    and reply handler inside the ``batch`` command's process; the whole
    command's wall time, startup included, is reported too); and
(b) through ``LLM("tiny", <same engine settings>).generate(prompts, params)``
    in this process, timed around ``generate``.

Both sides are warmed up first (one untimed small run each). The repeats
interleave (queue, offline, offline, queue, ...). Each repeat uses fresh job
keys, since a key that completed before is answered from the worker's
idempotency store without running the model. The report: median wall time
of each side and the ratio queue/offline, plus where the time went (CPU
seconds of the worker's event-loop thread, its other threads, the broker and
the ``batch`` command; engine steps and the mean number of sequences per step;
the worker's per-job timings). Results go to
``benchmarks/results/queue-<date>.json``.

Ablations and profiling (separate runs; ``--label NAME`` writes
``queue-NAME-<date>.json``):

- ``--worker-arg=--batch-prefetch=96`` (any worker flag) and
  ``--batch-arg=--max-in-flight=2000`` (any ``batch`` flag) are passed through;
- ``--publisher pipelined`` replaces ``jaxserve batch`` by the same client
  with many publisher confirms outstanding (``batch`` awaits each confirm);
- ``--profile`` runs the worker with ``queue_profile.py``'s instrumented
  engine factory: engine occupancy per step and each job's phases;
- ``--cprofile`` (with ``--profile``) adds a CPU-time profile of the worker's
  event loop and of the ``batch`` command, grouped by library.

The worker is stopped by PID and the bench queues deleted at the end.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import queue_common as qc

# ----------------------------------------------------------------- prompts
_SUBJECTS = [
    "The phone",
    "This movie",
    "The hotel",
    "Our meal",
    "The book",
    "This chair",
    "The game",
    "The lamp",
    "The bag",
    "The service",
    "The room",
    "This shoe",
    "The coffee",
    "The show",
]
_POS = [
    "was great",
    "is lovely",
    "works well",
    "was fun",
    "felt solid",
    "is excellent",
    "was worth it",
    "was nice",
    "is fast and cheap",
    "was a treat",
]
_NEG = [
    "was awful",
    "is broken",
    "works badly",
    "was boring",
    "was weak",
    "is too slow",
    "was a waste",
    "was bad",
    "is loud",
    "was late again",
]
_TAILS = ["", "", "", " Never again.", " Five stars.", " Not for me.", " Loved it.", " So so.", " Buy it.", " Skip it."]
PROMPT_HEAD = "Classify sentiment: "
PROMPT_TAIL = "\nSentiment:"


def make_prompts(n: int, seed: int) -> list[str]:
    """``n`` deterministic classification prompts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        verb = rng.choice(_POS if rng.random() < 0.5 else _NEG)
        out.append(f"{PROMPT_HEAD}{rng.choice(_SUBJECTS)} {verb}.{rng.choice(_TAILS)}{PROMPT_TAIL}")
    return out


# ------------------------------------------------------- batch child shim
def batch_child(stamps_path: str, cli_args: list[str]) -> None:
    """Run ``jaxserve <cli_args>`` (the ``batch`` command) in this process,
    stamping (CLOCK_MONOTONIC, shared by all processes) the first and last
    publish and the last reply handled. Written at exit."""
    t_start = time.monotonic()
    import jaxserve.client.client as cc
    from jaxserve.cli.main import cli

    stamps: dict[str, Any] = {
        "process_start": t_start,
        "first_publish": None,
        "last_publish": None,
        "last_result": None,
        "replies": 0,
        "publishes": 0,
    }
    orig_publish = cc.AsyncClient.publish
    orig_on_reply = cc.AsyncClient._on_reply

    async def publish(self, *a, **kw):  # type: ignore[no-untyped-def]
        if stamps["first_publish"] is None:
            stamps["first_publish"] = time.monotonic()
            stamps["cpu_at_first_publish"] = time.process_time()
        r = await orig_publish(self, *a, **kw)
        stamps["last_publish"] = time.monotonic()
        stamps["publishes"] += 1
        return r

    async def on_reply(self, message):  # type: ignore[no-untyped-def]
        await orig_on_reply(self, message)
        stamps["last_result"] = time.monotonic()
        stamps["replies"] += 1

    cc.AsyncClient.publish = publish  # type: ignore[method-assign]
    cc.AsyncClient._on_reply = on_reply  # type: ignore[method-assign]

    def dump() -> None:
        stamps["process_end"] = time.monotonic()
        stamps["cpu_at_end"] = time.process_time()
        Path(stamps_path).write_text(json.dumps(stamps))

    atexit.register(dump)
    if os.environ.get("QUEUE_BENCH_CPROFILE"):
        import cProfile

        prof = cProfile.Profile(time.thread_time)  # CPU time of the loop's thread
        atexit.register(lambda: prof.dump_stats(os.environ["QUEUE_BENCH_CPROFILE"]))
        prof.enable()
    cli.main(args=cli_args, prog_name="jaxserve")


def pipelined_child(stamps_path: str, prefix: str, inp: str, out: str, window: int, confirms: int) -> None:
    """Ablation publisher (not a jaxserve command): the same jobs as
    ``batch``, through the same ``AsyncClient``, but with up to ``confirms``
    publishes awaiting their broker confirm at once (``batch`` awaits each
    confirm before the next publish) and ``window`` jobs unanswered."""
    import asyncio

    t_start = time.monotonic()
    from jaxserve.client.client import AsyncClient

    jobs = [json.loads(line) for line in open(inp)]
    stamps: dict[str, Any] = {
        "process_start": t_start,
        "first_publish": None,
        "last_publish": None,
        "last_result": None,
        "replies": 0,
        "publishes": 0,
    }

    async def main() -> None:
        pending = {j["id"] for j in jobs}
        results: dict[str, Any] = {}
        done = asyncio.Event()
        slots = asyncio.Semaphore(window)
        unconfirmed = asyncio.Semaphore(confirms)

        async def on_final(msg: Any) -> None:
            key = msg.id
            if key in pending:
                pending.discard(key)
                results[key] = msg.to_dict()
                slots.release()
                stamps["last_result"] = time.monotonic()
                stamps["replies"] += 1
                if not pending:
                    done.set()

        client = AsyncClient(qc.AMQP_URL, prefix=prefix, on_unclaimed=on_final, name="bench-pipelined")
        await client.connect()

        async def pub(body: dict[str, Any], key: str) -> None:
            try:
                await client.publish(body, key=key, queue="batch", expect_reply=False)
            finally:
                unconfirmed.release()
            stamps["last_publish"] = time.monotonic()
            stamps["publishes"] += 1

        tasks = []
        for job in jobs:
            body = {k: v for k, v in job.items() if k != "id"}
            await slots.acquire()
            await unconfirmed.acquire()
            if stamps["first_publish"] is None:
                stamps["first_publish"] = time.monotonic()
            tasks.append(asyncio.ensure_future(pub(body, job["id"])))
        await asyncio.gather(*tasks)
        await asyncio.wait_for(done.wait(), 600)
        await client.delete_reply_queue()
        await client.close()
        with open(out, "wb") as f:
            for msg in results.values():
                f.write(json.dumps(msg).encode() + b"\n")

    asyncio.run(main())
    stamps["process_end"] = time.monotonic()
    Path(stamps_path).write_text(json.dumps(stamps))


# ------------------------------------------------------------------- runs
def write_jobs(path: Path, prompts: list[str], tag: str, max_tokens: int) -> list[str]:
    keys = []
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            key = f"{tag}-{i:05d}"
            keys.append(key)
            f.write(
                json.dumps({"id": key, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "cache": False}) + "\n"
            )
    return keys


def run_queue(
    args: argparse.Namespace, worker: qc.WorkerProc, meter: qc.CpuMeter, prompts: list[str], tag: str, tmp: Path
) -> dict[str, Any]:
    inp, out, stamps_path = tmp / f"{tag}.in.jsonl", tmp / f"{tag}.out.jsonl", tmp / f"{tag}.stamps.json"
    keys = write_jobs(inp, prompts, tag, args.max_tokens)
    if args.publisher == "batch":
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--batch-child",
            str(stamps_path),
            "batch",
            str(inp),
            "-o",
            str(out),
            "--prefix",
            worker.prefix,
            "--amqp-url",
            qc.AMQP_URL,
            "--no-progress",
            *args.batch_arg,
        ]
    else:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--pipelined-child",
            str(stamps_path),
            worker.prefix,
            str(inp),
            str(out),
            str(args.pipelined_window),
            str(args.pipelined_confirms),
        ]
    m0 = qc.scrape_metrics(worker.metrics_port)
    meter.start()
    t0 = time.monotonic()
    env = dict(os.environ)
    if args.cprofile:
        env["QUEUE_BENCH_CPROFILE"] = str(tmp / f"{tag}.batch.pstats")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=qc.REPO, env=env)
    t1 = time.monotonic()
    cpu = meter.stop()
    m1 = qc.scrape_metrics(worker.metrics_port)
    if proc.returncode != 0:
        raise RuntimeError(f"batch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    st = json.loads(stamps_path.read_text())
    results: dict[str, dict[str, Any]] = {}
    with open(out, "rb") as f:
        for line in f:
            rec = json.loads(line)
            results[rec["id"]] = rec
    texts = [results.get(k, {}).get("text") for k in keys]
    ok = sum(1 for k in keys if results.get(k, {}).get("status") == "ok")
    replayed = sum(1 for k in keys if results.get(k, {}).get("replayed"))
    window = st["last_result"] - st["first_publish"]
    span = (st["first_publish"], st["last_result"])
    res: dict[str, Any] = {
        "window_s": round(window, 4),
        "publish_span_s": round(st["last_publish"] - st["first_publish"], 4),
        "command_wall_s": round(t1 - t0, 4),
        "command_startup_s": round(st["first_publish"] - t0, 4),
        "ok": ok,
        "replayed": replayed,
        "replies_handled": st["replies"],
        "cpu": cpu,
        # The command's CPU from its first publish on (children_s includes
        # its start: imports, connecting).
        "command_cpu_after_first_publish_s": (
            round(st["cpu_at_end"] - st["cpu_at_first_publish"], 3)
            if "cpu_at_end" in st and "cpu_at_first_publish" in st
            else None
        ),
        "summary_line": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "",
        "_texts": texts,
        "_keys": keys,
        "_span": span,
    }
    if m0 and m1:
        steps = m1.get("jaxserve_engine_steps_total", 0) - m0.get("jaxserve_engine_steps_total", 0)
        toks = m1.get("jaxserve_generation_tokens_total", 0) - m0.get("jaxserve_generation_tokens_total", 0)
        res["engine_steps"] = int(steps)
        res["generated_tokens"] = int(toks)
        res["tokens_per_step"] = round(toks / steps, 2) if steps else None
    return res


def run_offline(llm: Any, params: Any, meter: qc.CpuMeter, prompts: list[str]) -> dict[str, Any]:
    eng = llm.engine
    s0 = eng.scheduler.stats().num_steps
    meter.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    steps = eng.scheduler.stats().num_steps - s0
    toks = sum(o.completion_tokens for o in outs)
    return {
        "wall_s": round(wall, 4),
        "ok": sum(1 for o in outs if o.error is None),
        "engine_steps": steps,
        "generated_tokens": toks,
        "tokens_per_step": round(toks / steps, 2) if steps else None,
        "cpu": cpu,
        "_texts": [o.text for o in outs],
    }


def worker_job_timings(worker: qc.WorkerProc, tag: str) -> dict[str, Any]:
    """Medians (and p90) of the worker's per-job timings for one repeat."""
    recs = [r for r in worker.job_done_records() if str(r.get("key", "")).startswith(tag + "-")]
    out: dict[str, Any] = {"jobs": len(recs)}
    for name in ("queue_s", "admit_s", "ttft_s", "total_s"):
        xs = sorted(float(r[name]) for r in recs if r.get(name) is not None)
        if xs:
            out[name] = {"median": round(qc.median(xs), 5), "p90": round(xs[int(0.9 * (len(xs) - 1))], 5)}
    return out


# ------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument(
        "--interactive-reserved-seqs",
        type=int,
        default=None,
        help="Both sides (default: the worker's default, max_num_seqs // 4).",
    )
    ap.add_argument("--policy", default="priority", help="Both sides (the worker's default: priority).")
    ap.add_argument("--worker-arg", action="append", default=[], help="Extra flag for `jaxserve worker` (repeatable).")
    ap.add_argument("--batch-arg", action="append", default=[], help="Extra flag for `jaxserve batch` (repeatable).")
    ap.add_argument(
        "--publisher",
        choices=["batch", "pipelined"],
        default="batch",
        help="batch: `jaxserve batch` (the benchmark). pipelined: ablation, the same client with "
        "concurrent publisher confirms.",
    )
    ap.add_argument("--pipelined-window", type=int, default=512)
    ap.add_argument("--pipelined-confirms", type=int, default=256)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="Run the worker with benchmarks/queue_profile.py's instrumented engine factory and report "
        "engine occupancy and per-job phases (adds a little overhead; not for the headline numbers).",
    )
    ap.add_argument(
        "--cprofile",
        action="store_true",
        help="With --profile: also cProfile the worker's event-loop thread and the batch command "
        "(both slow down; for the CPU breakdown only).",
    )
    ap.add_argument("--warmup-prompts", type=int, default=200)
    ap.add_argument("--label", default="", help="Results file queue-[LABEL-]<date>.json (default: none).")
    ap.add_argument("--json-out", default=None, help="Write the results here instead of benchmarks/results/.")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    reserved = args.interactive_reserved_seqs
    if reserved is None:
        reserved = max(1, args.max_num_seqs // 4) if args.max_num_seqs > 1 else 0
    engine = {
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "interactive_reserved_seqs": reserved,
        "policy": args.policy,
    }
    t_script = time.monotonic()
    machine = qc.machine_info()
    prompts = make_prompts(args.num_prompts, args.seed)
    warm_prompts = make_prompts(args.warmup_prompts, args.seed + 1)
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-queue-bench-"))
    prefix = qc.new_prefix("batch")
    run_id = prefix.rsplit("-", 1)[1]
    worker_extra, worker_env, launcher = list(args.worker_arg), {}, None
    profile_path = tmp / "worker-profile.json"
    if args.profile:
        flags, worker_env, launcher = qc.profiled_worker(profile_path)
        worker_extra += flags
        if args.cprofile:
            worker_env["QUEUE_PROFILE_CPROFILE"] = str(tmp / "worker-loop.pstats")
    worker = qc.WorkerProc(prefix, engine, worker_extra, tmp / "worker.log", env=worker_env, launcher=launcher)
    print(f"worker pid {worker.pid} prefix {prefix}: {' '.join(worker.cmd)}", file=sys.stderr)
    try:
        # Build the offline engine while the worker compiles.
        from jaxserve.engine.llm import LLM
        from jaxserve.sampling_params import SamplingParams
        from jaxserve.worker.logs import configure_logging

        configure_logging(level="warning")
        llm = LLM(**{"model": engine["model"], **{k: v for k, v in engine.items() if k != "model"}})
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        lens = sorted(len(llm.engine.tokenizer.encode(p)) for p in prompts)
        ready_s = worker.wait_consuming()
        print(
            f"worker consuming after {ready_s:.1f}s; prompt tokens min/median/max "
            f"{lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}",
            file=sys.stderr,
        )
        meter = qc.CpuMeter(worker.pid, qc.find_broker_pid())

        # Warm-up, untimed.
        run_offline(llm, params, meter, warm_prompts)
        run_queue(args, worker, meter, warm_prompts, f"{run_id}-warm", tmp)

        reps: list[dict[str, Any]] = []
        for rep in range(args.repeats):
            order = ["queue", "offline"] if rep % 2 == 0 else ["offline", "queue"]
            row: dict[str, Any] = {"rep": rep, "order": order, "loadavg": os.getloadavg()}
            for side in order:
                if side == "queue":
                    tag = f"{run_id}-r{rep}"
                    row["queue"] = run_queue(args, worker, meter, prompts, tag, tmp)
                    row["queue"]["worker_job_timings"] = worker_job_timings(worker, tag)
                else:
                    row["offline"] = run_offline(llm, params, meter, prompts)
            q_texts, o_texts = row["queue"].pop("_texts"), row["offline"].pop("_texts")
            row["queue"].pop("_keys")
            row["same_text"] = sum(1 for a, b in zip(q_texts, o_texts) if a == b)
            row["ratio"] = round(row["queue"]["window_s"] / row["offline"]["wall_s"], 3)
            print(
                f"rep {rep}: queue {row['queue']['window_s']:.3f}s (publish span {row['queue']['publish_span_s']:.3f}s, "
                f"command {row['queue']['command_wall_s']:.3f}s) offline {row['offline']['wall_s']:.3f}s "
                f"ratio {row['ratio']:.2f} same_text {row['same_text']}/{len(prompts)}; tokens/step queue "
                f"{row['queue'].get('tokens_per_step')} offline {row['offline']['tokens_per_step']}; queue CPU "
                f"{json.dumps(row['queue']['cpu'])}",
                file=sys.stderr,
            )
            reps.append(row)
    finally:
        rc = worker.stop()
        stats = worker.stopped_stats()
        deleted = qc.delete_topology(prefix)
        left = qc.leftover_queues(prefix)
        print(f"worker stopped rc={rc}; deleted {len(deleted)} queues/exchanges; leftover {left}", file=sys.stderr)

    for row in reps:
        span = row["queue"].pop("_span")
        if args.profile and profile_path.exists():
            import queue_profile

            row["queue"]["profile"] = queue_profile.summarize(str(profile_path), *span)
            print(f"rep {row['rep']} profile: {json.dumps(row['queue']['profile'])}", file=sys.stderr)
    cprofile = None
    if args.cprofile and (tmp / "worker-loop.pstats").exists():
        import queue_profile

        # Every job the worker saw (warm-up included) is in the profile.
        jobs_seen = (stats or {}).get("received", 0)
        cprofile = {"worker_loop": queue_profile.loop_breakdown(str(tmp / "worker-loop.pstats"), jobs_seen)}
        last = tmp / f"{run_id}-r{args.repeats - 1}.batch.pstats"
        if last.exists():
            cprofile["batch_command_last_rep"] = queue_profile.loop_breakdown(str(last), len(prompts))
        print(json.dumps(cprofile, indent=1), file=sys.stderr)
    q_med = qc.median([r["queue"]["window_s"] for r in reps])
    o_med = qc.median([r["offline"]["wall_s"] for r in reps])
    summary = {
        "queue_window_median_s": round(q_med, 4),
        "queue_command_wall_median_s": round(qc.median([r["queue"]["command_wall_s"] for r in reps]), 4),
        "queue_publish_span_median_s": round(qc.median([r["queue"]["publish_span_s"] for r in reps]), 4),
        "offline_median_s": round(o_med, 4),
        "ratio_queue_over_offline": round(q_med / o_med, 3),
        "ratio_command_wall_over_offline": round(qc.median([r["queue"]["command_wall_s"] for r in reps]) / o_med, 3),
        # CPU milliseconds per job (median over repeats), by process/thread:
        # the queue's per-job cost next to the engine's.
        "queue_cpu_ms_per_job": {
            name: round(1000 * qc.median([r["queue"]["cpu"][key] for r in reps]) / len(prompts), 3)
            for name, key in (
                ("worker_event_loop_thread", "worker_loop_thread_s"),
                ("worker_engine_and_xla_threads", "worker_other_threads_s"),
                ("broker", "broker_s"),
                ("batch_command_incl_startup", "children_s"),
            )
            if all(key in r["queue"]["cpu"] for r in reps)
        },
        "batch_command_cpu_ms_per_job_after_first_publish": (
            round(1000 * qc.median([r["queue"]["command_cpu_after_first_publish_s"] for r in reps]) / len(prompts), 3)
            if all(r["queue"].get("command_cpu_after_first_publish_s") is not None for r in reps)
            else None
        ),
        "offline_cpu_ms_per_prompt": round(
            1000 * qc.median([r["offline"]["cpu"]["bench_process_s"] for r in reps]) / len(prompts), 3
        ),
        "queue_tokens_per_step_median": qc.median([r["queue"].get("tokens_per_step") or 0 for r in reps]),
        "offline_tokens_per_step_median": qc.median([r["offline"]["tokens_per_step"] for r in reps]),
        "queue_jobs_per_s": round(len(prompts) / q_med, 1),
        "offline_prompts_per_s": round(len(prompts) / o_med, 1),
    }
    data = {
        "benchmark": "queue_batch_vs_offline",
        "command": " ".join([".venv/bin/python", "benchmarks/queue_batch_vs_offline.py", *sys.argv[1:]]),
        "worker_command": " ".join(worker.cmd).replace(str(qc.REPO) + "/", ""),
        "machine": {**machine, "loadavg_end": os.getloadavg()},
        "settings": {
            "num_prompts": args.num_prompts,
            "repeats": args.repeats,
            "seed": args.seed,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "engine": engine,
            "worker_args": args.worker_arg,
            "batch_args": args.batch_arg,
            "publisher": args.publisher,
            "profile": args.profile,
            "cprofile": args.cprofile,
            "prompt_tokens": {"min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1]},
            "example_prompt": prompts[0],
        },
        "worker_ready_s": round(ready_s, 1),
        "summary": summary,
        "repeats": reps,
        "worker_stats": stats,
        "cprofile": cprofile,
        "script_s": round(time.monotonic() - t_script, 1),
    }
    print(json.dumps(summary, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2) + "\n")
    elif not args.no_save:
        path = qc.write_results(args.label, data)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--batch-child":
        batch_child(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 2 and sys.argv[1] == "--pipelined-child":
        a = sys.argv[2:]
        pipelined_child(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]))
    else:
        main()
