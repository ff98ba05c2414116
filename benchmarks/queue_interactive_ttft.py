"""Interactive time to first token, idle vs behind a deep batch queue.

    .venv/bin/python benchmarks/queue_interactive_ttft.py [--samples 10] [--rounds 2]

Starts ``jaxserve worker --model tiny --prefix bench-ttft-<uuid>`` (the
worker's default scheduling: priority policy, a quarter of the sequences
reserved for interactive jobs), then per round:

1. idle: ``--samples`` streamed interactive jobs, one at a time, spaced by
   ``--spacing`` seconds; TTFT = from just before the publish to the first
   text delta out of the reference client's stream;
2. loaded: publish batch jobs until the batch queue holds ``--batch-depth``
   (>= 300) ready jobs; then the same interactive jobs, spaced the same way,
   topping the batch queue up before each one so that it holds at least 200
   ready jobs when the interactive job is published (the depth is recorded);
3. purge the batch queue and let the worker drain.

Batch replies go to the prefix's results queue, not to the measuring
client's reply queue, so the measuring client only handles its own replies; the
results published during the loaded phases are the batch throughput
while interactive jobs run (``batch_jobs_per_s_loaded``).
Reported: median (and p90) TTFT idle and loaded, the ratio loaded/idle, and
the worker's own view from each final result (``queue_s``: publish ->
delivery, ``ttft_s``: delivery -> first token). Results go to
``benchmarks/results/queue-ttft-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import queue_common as qc
from queue_batch_vs_offline import make_prompts


async def depth(client: Any, queue: str) -> int:
    """Ready messages in ``queue`` (passive declare on a fresh channel)."""
    ch = await client._sub_conn.channel()
    try:
        q = await ch.declare_queue(queue, passive=True)
        return int(q.declaration_result.message_count)
    finally:
        if not ch.is_closed:
            await ch.close()


async def one_interactive(
    client: Any, prompt: str, max_tokens: int, key: str, temperature: float = 0.0
) -> dict[str, Any]:
    t0 = time.monotonic()
    seed = 0 if temperature > 0 else None  # reproducible texts when sampling
    stream = await client.stream(
        prompt,
        queue="interactive",
        key=key,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        cache=False,
        timeout=60,
    )
    t_pub = time.monotonic()
    first_text = None
    async for _delta in stream:
        if first_text is None:
            first_text = time.monotonic()
    t_end = time.monotonic()
    # TTFT: the first chunk's arrival (its token's text may still be empty:
    # random weights often start with byte pieces; `first_text_s` is the
    # first visible text).
    first = stream.first_chunk_at
    timings = (stream.result.raw.get("timings") if stream.result else None) or {}
    return {
        "key": key,
        "t0": t0,
        "ttft_s": round(first - t0, 5) if first is not None else None,
        "first_text_s": round(first_text - t0, 5) if first_text is not None else None,
        "publish_s": round(t_pub - t0, 5),
        "total_s": round(t_end - t0, 5),
        "chunks": stream.chunks,
        "worker_queue_s": timings.get("queue_s"),
        "worker_ttft_s": timings.get("ttft_s"),
        "worker_admit_s": timings.get("admit_s"),
        "ok": bool(stream.result and stream.result.ok),
        "error": (stream.result.error.code if stream.result and stream.result.error else None),
        "completion_tokens": (
            (stream.result.raw.get("usage") or {}).get("completion_tokens") if stream.result else None
        ),
    }


async def run(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    from jaxserve.client import AsyncClient

    batch_q = f"{prefix}.batch"
    results_q = f"{prefix}.results"
    client = await AsyncClient(qc.AMQP_URL, prefix=prefix, name="bench-ttft").connect()
    loader = await AsyncClient(qc.AMQP_URL, prefix=prefix, name="bench-ttft-loader").connect()
    prompts = make_prompts(args.samples * args.rounds * 2 + 8, args.seed)
    batch_prompts = make_prompts(997, args.seed + 1)
    n_batch = 0
    run_tag = prefix.rsplit("-", 1)[1]

    async def top_up(target: int) -> int:
        nonlocal n_batch
        d = await depth(client, batch_q)
        while d < target:
            for _ in range(target - d):
                body = {
                    "prompt": batch_prompts[n_batch % len(batch_prompts)],
                    "max_tokens": args.batch_max_tokens,
                    "temperature": 0,
                    "cache": False,
                }  # the same prompts recur: the response cache would answer them
                await loader.publish(
                    body, key=f"{run_tag}-b{n_batch}", queue="batch", reply_to=results_q, expect_reply=False
                )
                n_batch += 1
            d = await depth(client, batch_q)
        return d

    try:
        # Warm-up (untimed): compile paths, connections, reply queue.
        for i in range(3):
            await one_interactive(client, prompts[-1 - i], args.max_tokens, f"{run_tag}-warm{i}", args.temperature)
        idle: list[dict[str, Any]] = []
        loaded: list[dict[str, Any]] = []
        spans: dict[str, list[tuple[float, float]]] = {"idle": [], "loaded": []}
        batch_done: list[tuple[int, float]] = []  # per round: batch jobs done in the loaded phase, its seconds
        k = 0
        for rnd in range(args.rounds):
            t_idle = time.monotonic()
            for _ in range(args.samples):
                await asyncio.sleep(args.spacing)
                r = await one_interactive(client, prompts[k], args.max_tokens, f"{run_tag}-i{k}", args.temperature)
                r.update(round=rnd, batch_depth=await depth(client, batch_q))
                idle.append(r)
                k += 1
            spans["idle"].append((t_idle, time.monotonic()))
            t_fill = time.monotonic()
            d0 = await top_up(args.batch_depth)
            fill_s = time.monotonic() - t_fill
            await asyncio.sleep(args.spacing)  # let the worker fill its batch
            t_loaded = time.monotonic()
            done0 = await depth(client, results_q)  # nobody consumes it: it counts the batch jobs done
            for _ in range(args.samples):
                d = await top_up(args.min_depth)
                r = await one_interactive(client, prompts[k], args.max_tokens, f"{run_tag}-l{k}", args.temperature)
                r.update(round=rnd, batch_depth=d)
                loaded.append(r)
                k += 1
                await asyncio.sleep(args.spacing)
            spans["loaded"].append((t_loaded, time.monotonic()))
            batch_done.append((await depth(client, results_q) - done0, spans["loaded"][-1][1] - t_loaded))
            # Purge and drain before the next idle phase.
            ch = await client._sub_conn.channel()
            purged = await (await ch.declare_queue(batch_q, passive=True)).purge()
            await ch.close()
            await asyncio.sleep(3.0)
            print(
                f"round {rnd}: idle median {qc.median([x['ttft_s'] for x in idle if x['round'] == rnd]):.4f}s "
                f"loaded median {qc.median([x['ttft_s'] for x in loaded if x['round'] == rnd]):.4f}s "
                f"(filled {d0} in {fill_s:.1f}s; purged {getattr(purged, 'message_count', purged)})",
                file=sys.stderr,
            )
        return {
            "idle": idle,
            "loaded": loaded,
            "batch_jobs_published": n_batch,
            "spans": spans,
            "batch_done": batch_done,
        }
    finally:
        await client.delete_reply_queue()
        await client.close()
        await loader.delete_reply_queue()
        await loader.close()


def attach_profile(path: str, res: dict[str, Any]) -> dict[str, Any]:
    """Per sample: client publish -> the worker's ``_handle`` (one monotonic
    clock); per phase: the worker loop's lag and the engine's batch size."""
    data = json.load(open(path))
    jobs = data["jobs"]
    steps_by_start = sorted(data["steps"])
    for phase in ("idle", "loaded"):
        for r in res[phase]:
            j = jobs.get(r["key"], {})
            if "received" in j:
                r["publish_to_received_s"] = round(j["received"] - r["t0"], 5)
                if r.get("worker_ttft_s") is not None:
                    r["timeline"] = timeline(steps_by_start, j, j["received"] + r["worker_ttft_s"])
    out: dict[str, Any] = {}
    for phase, spans in res["spans"].items():
        lag = sorted(x[1] for x in data["loop_lag"] if any(a <= x[0] <= b for a, b in spans))
        steps = [s for s in data["steps"] if any(a <= s[0] <= b for a, b in spans)]
        out[phase] = {
            "loop_lag_ms": {
                "median": round(1000 * qc.median(lag), 3),
                "p90": round(1000 * pct(lag, 0.9), 3),
                "max": round(1000 * lag[-1], 3),
            }
            if lag
            else None,
            "engine_steps": len(steps),
            "engine_seqs_per_step_mean": round(sum(s[2] for s in steps) / len(steps), 2) if steps else None,
            # the outputs Engine.step returned: the batch sequences it
            # planned (interactive outputs leave early, on_urgent_outputs),
            # where engine_seqs_per_step_mean counts every running sequence
            "engine_outputs_per_step_mean": round(sum(s[3] for s in steps) / len(steps), 2) if steps else None,
            "engine_step_ms_median": round(1000 * qc.median([s[1] for s in steps]), 3) if steps else None,
            "engine_step_ms_p90": round(1000 * pct(sorted(s[1] for s in steps), 0.9), 3) if steps else None,
            # the expected rest of the step in flight at a random moment:
            # long steps are likelier to be the one an arrival lands in
            "engine_step_residual_ms": round(1000 * sum(s[1] ** 2 for s in steps) / (2 * sum(s[1] for s in steps)), 3)
            if steps
            else None,
        }
    return out


def timeline(steps: list[list[float]], job: dict[str, float], first_token: float) -> dict[str, Any]:
    """Where one job's delivery -> first token went, on the worker's clock:
    the rest of the engine step running when it was received, the steps
    that ran after that before the one that made its first token, and that
    step's own duration (steps are ``(start, duration, ...)``). Since the
    engine hands interactive tokens over inside a step (``on_urgent_outputs``)
    the step-based fields miss the step that made the token; the ``engine_*``
    fields (the engine's own clock) and ``loop_first_token_ms`` do not."""
    t = job["received"]
    inflight = [s for s in steps if s[0] <= t < s[0] + s[1]]
    after = [s for s in steps if s[0] >= t and s[0] + s[1] <= first_token + 1e-4]
    own = after[-1] if after else None
    return {
        "inflight_rest_ms": round(1000 * (inflight[0][0] + inflight[0][1] - t), 2) if inflight else 0.0,
        "add_sent_ms": round(1000 * (job["add_sent"] - t), 2) if "add_sent" in job else None,
        "admitted_ms": round(1000 * (job["admitted"] - t), 2) if "admitted" in job else None,
        "first_step_start_ms": round(1000 * (after[0][0] - t), 2) if after else None,
        # The engine's clock: request arrival in the engine, first scheduled,
        # first token collected; then the loop's first token (the handover).
        "engine_arrival_ms": _since(job, "engine_arrival", t),
        "engine_first_scheduled_ms": _since(job, "engine_first_scheduled", t),
        "engine_first_token_ms": _since(job, "engine_first_token", t),
        "loop_first_token_ms": _since(job, "loop_first_token", t),
        # the engine's view of the two parts: waiting (for the step in
        # flight, on a loaded worker) and its own step
        "engine_own_step_ms": round(1000 * (job["engine_first_token"] - job["engine_first_scheduled"]), 2)
        if "engine_first_token" in job and "engine_first_scheduled" in job
        else None,
        "steps_between": len(after) - 1 if after else 0,
        "steps_between_ms": round(1000 * sum(s[1] for s in after[:-1]), 2) if after else 0.0,
        "own_step_ms": round(1000 * own[1], 2) if own else None,
        "after_own_step_ms": round(1000 * (first_token - own[0] - own[1]), 2) if own else None,
    }


def _since(job: dict[str, float], name: str, t: float) -> float | None:
    return round(1000 * (job[name] - t), 2) if name in job else None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10, help="Interactive jobs per phase and round.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spacing", type=float, default=0.5, help="Seconds between interactive jobs.")
    ap.add_argument("--max-tokens", type=int, default=16, help="Interactive jobs.")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Interactive jobs (seed 0 when > 0). A chunk carries text, and a random model's greedy "
        "tokens can all be empty text (llama-56m): sample there.",
    )
    ap.add_argument("--batch-max-tokens", type=int, default=64, help="Background batch jobs.")
    ap.add_argument("--batch-depth", type=int, default=400, help="Ready batch jobs before the loaded phase.")
    ap.add_argument("--min-depth", type=int, default=300, help="Top-up level before each loaded sample.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model", default="tiny", help="Preset or checkpoint folder (llama-56m: a batch step of tens of ms)."
    )
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--worker-arg", action="append", default=[], help="Extra flag for `jaxserve worker` (repeatable).")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="Worker with benchmarks/queue_profile.py's instrumentation: per interactive job, publish -> "
        "delivery on the worker's loop (same monotonic clock), and the loop's lag per phase.",
    )
    ap.add_argument(
        "--late-admission",
        action="store_true",
        help="With --profile: the engine ignores the worker's before_plan hook (the behaviour before "
        "3652a22; add --worker-arg=--engine-arg --worker-arg=async_scheduling=true for its defaults)",
    )
    ap.add_argument("--label", default="ttft")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    engine = {
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    }
    t_script = time.monotonic()
    machine = qc.machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-ttft-bench-"))
    prefix = qc.new_prefix("ttft")
    worker_extra, worker_env, launcher = list(args.worker_arg), {}, None
    profile_path = tmp / "worker-profile.json"
    if args.profile:
        factory = "build_engine_late_admission" if args.late_admission else "build_engine"
        flags, worker_env, launcher = qc.profiled_worker(profile_path, factory)
        worker_extra += flags
    worker = qc.WorkerProc(prefix, engine, worker_extra, tmp / "worker.log", env=worker_env, launcher=launcher)
    print(f"worker pid {worker.pid} prefix {prefix}: {' '.join(worker.cmd)}", file=sys.stderr)
    try:
        ready_s = worker.wait_consuming()
        print(f"worker consuming after {ready_s:.1f}s", file=sys.stderr)
        m0 = qc.scrape_metrics(worker.metrics_port)
        res = asyncio.run(run(args, prefix))
        m1 = qc.scrape_metrics(worker.metrics_port)
    finally:
        rc = worker.stop()
        stats = worker.stopped_stats()
        deleted = qc.delete_topology(prefix)
        left = qc.leftover_queues(prefix)
        print(f"worker stopped rc={rc}; deleted {len(deleted)}; leftover {left}", file=sys.stderr)

    def summ(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(rows)}
        for name in (
            "ttft_s",
            "first_text_s",
            "publish_s",
            "worker_queue_s",
            "publish_to_received_s",
            "worker_admit_s",
            "worker_ttft_s",
            "first_chunk_return_s",
            "total_s",
            "batch_depth",
            "chunks",
        ):
            xs = [r[name] for r in rows if r.get(name) is not None]
            if xs:
                out[name] = {
                    "median": round(qc.median(xs), 5),
                    "p90": round(pct(xs, 0.9), 5),
                    "min": min(xs),
                    "max": max(xs),
                }
        return out

    profile = None
    if args.profile and profile_path.exists():
        profile = attach_profile(str(profile_path), res)
    for rows in (res["idle"], res["loaded"]):
        for r in rows:
            # What is left of the client's TTFT once the job reached the
            # worker and produced its first token: the first chunk's way back
            # (publish with confirm, broker, the client's consumer).
            if None not in (r["ttft_s"], r["worker_queue_s"], r["worker_ttft_s"]):
                r["first_chunk_return_s"] = round(r["ttft_s"] - r["worker_queue_s"] - r["worker_ttft_s"], 5)
            r.pop("t0", None)
    idle, loaded = summ(res["idle"]), summ(res["loaded"])
    summary = {
        "ttft_idle_median_s": idle["ttft_s"]["median"],
        "ttft_loaded_median_s": loaded["ttft_s"]["median"],
        "ratio_loaded_over_idle": round(loaded["ttft_s"]["median"] / idle["ttft_s"]["median"], 2),
        "ttft_idle_p90_s": idle["ttft_s"]["p90"],
        "ttft_loaded_p90_s": loaded["ttft_s"]["p90"],
        "min_batch_depth_at_loaded_publish": loaded["batch_depth"]["min"],
        # batch throughput while interactive jobs run (the price of any
        # interactive-first rule): results published during the loaded phases
        "batch_jobs_done_loaded": sum(n for n, _ in res["batch_done"]),
        "batch_jobs_per_s_loaded": round(
            sum(n for n, _ in res["batch_done"]) / max(1e-9, sum(t for _, t in res["batch_done"])), 3
        ),
        # Medians of the parts (each its own median: they need not add up).
        "breakdown_median_s": {
            phase: {
                name: summ_[name]["median"]
                for name in ("worker_queue_s", "publish_to_received_s", "worker_ttft_s", "first_chunk_return_s")
                if name in summ_
            }
            for phase, summ_ in (("idle", idle), ("loaded", loaded))
        },
    }
    if profile is not None:
        # Medians of each part of the worker's delivery -> first token.
        summary["timeline_median_ms"] = {
            phase: {
                name: qc.median(
                    [r["timeline"][name] for r in res[phase] if r.get("timeline", {}).get(name) is not None]
                )
                for name in (
                    "inflight_rest_ms",
                    "add_sent_ms",
                    "admitted_ms",
                    "first_step_start_ms",
                    "engine_arrival_ms",
                    "engine_first_scheduled_ms",
                    "engine_first_token_ms",
                    "engine_own_step_ms",
                    "loop_first_token_ms",
                    "steps_between",
                    "steps_between_ms",
                    "own_step_ms",
                    "after_own_step_ms",
                )
            }
            for phase in ("idle", "loaded")
        }
    data = {
        "benchmark": "queue_interactive_ttft",
        "command": " ".join([".venv/bin/python", "benchmarks/queue_interactive_ttft.py", *sys.argv[1:]]),
        "worker_command": " ".join(worker.cmd).replace(str(qc.REPO) + "/", ""),
        "machine": {**machine, "loadavg_end": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json_out", "no_save", "label")},
        "worker_ready_s": round(ready_s, 1),
        "summary": summary,
        "idle": idle,
        "loaded": loaded,
        "batch_jobs_published": res["batch_jobs_published"],
        "engine_steps": int(m1.get("jaxserve_engine_steps_total", 0) - m0.get("jaxserve_engine_steps_total", 0))
        if m0 and m1
        else None,
        "worker_profile": profile,
        "samples": {"idle": res["idle"], "loaded": res["loaded"]},
        "worker_stats": stats,
        "script_s": round(time.monotonic() - t_script, 1),
    }
    print(json.dumps(summary, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2) + "\n")
    elif not args.no_save:
        print(f"wrote {qc.write_results(args.label, data)}", file=sys.stderr)


if __name__ == "__main__":
    main()
