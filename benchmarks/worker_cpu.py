"""One worker behind a saturated batch queue: jobs/s and where its CPU goes.

    .venv/bin/python benchmarks/worker_cpu.py [--seconds 40] [--worker-arg=--engine-thread]

Starts ``jaxserve worker --model tiny`` (the TTFT benchmark's engine
settings: 32 sequences, 512-token steps, ``max_model_len`` 128), keeps its
batch queue at least ``--depth`` jobs deep (64-token greedy jobs, results to
a queue nobody reads) for ``--seconds``, and over the middle ``--window``
seconds records:

- jobs/s: the worker's ``job_done`` log lines inside the window;
- CPU cores used per thread of the worker's process and of its engine
  process (when the engine runs in one: ``--engine-process``, the default),
  and by the RabbitMQ node, from ``/proc`` (user + system time).

On ``tiny`` the engine's compute is small, so this measures the worker's
own overheads: the event loop's work per job and what it costs the engine
to share (or not) a process with it. Results go to
``benchmarks/results/queue-<label>-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import queue_common as qc  # noqa: E402
from queue_batch_vs_offline import make_prompts  # noqa: E402
from queue_interactive_ttft import depth  # noqa: E402


async def keep_full(prefix: str, depth_target: int, seconds: float) -> int:
    """Publish batch jobs so the queue holds ``depth_target`` ready jobs,
    checking every 0.2 s, for ``seconds``; returns how many were published."""
    from jaxserve.client import AsyncClient

    client = await AsyncClient(qc.AMQP_URL, prefix=prefix, name="bench-worker-cpu").connect()
    prompts = make_prompts(997, 1)
    n = 0
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            for _ in range(max(0, depth_target - await depth(client, f"{prefix}.batch"))):
                body = {"prompt": prompts[n % len(prompts)], "max_tokens": 64, "temperature": 0, "cache": False}
                await client.publish(body, key=f"b{n}", queue="batch", reply_to=f"{prefix}.results", expect_reply=False)
                n += 1
            await asyncio.sleep(0.2)
    finally:
        await client.close()
    return n


def cpu_by_thread(pids: dict[str, int]) -> dict[str, dict[int, tuple[str, float]]]:
    return {name: qc.thread_cpu_s(pid) for name, pid in pids.items()}


def child_pids(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def utc(ts: str) -> float:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="How long the queue is kept full.")
    ap.add_argument("--window", type=float, default=20.0, help="Seconds measured, in the middle of the run.")
    ap.add_argument("--depth", type=int, default=400, help="Ready batch jobs kept in the queue.")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--worker-arg", action="append", default=[], help="Extra flag for `jaxserve worker` (repeatable).")
    ap.add_argument("--label", default="worker-cpu")
    args = ap.parse_args()
    if args.window > args.seconds - 5:
        ap.error("--window must leave at least 5 s of --seconds around it")

    engine = {"model": args.model, "max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 128}
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-worker-cpu-"))
    prefix = qc.new_prefix("cpu")
    machine = qc.machine_info()
    worker = qc.WorkerProc(prefix, engine, list(args.worker_arg), tmp / "worker.log")
    sample: dict[str, Any] = {}
    try:
        ready_s = worker.wait_consuming()
        start = (args.seconds - args.window) / 2

        async def run() -> int:
            filler = asyncio.ensure_future(keep_full(prefix, args.depth, args.seconds))
            await asyncio.sleep(start)
            pids = {"worker": worker.pid, **{f"engine process {p}": p for p in child_pids(worker.pid)}}
            broker = qc.find_broker_pid()
            t0, wall0 = time.monotonic(), time.time()
            before, broker0 = cpu_by_thread(pids), qc.proc_cpu_s(broker) if broker else None
            await asyncio.sleep(args.window)
            after, broker1 = cpu_by_thread(pids), qc.proc_cpu_s(broker) if broker else None
            span = time.monotonic() - t0
            sample.update(span=span, wall=(wall0, wall0 + span), before=before, after=after,
                          broker=None if broker0 is None or broker1 is None else (broker1 - broker0) / span)
            return await filler

        published = asyncio.run(run())
    finally:
        worker.stop()
        qc.delete_topology(prefix)
    w0, w1 = sample["wall"]
    done = [r for r in worker.job_done_records() if w0 <= utc(r["timestamp"]) <= w1]
    threads: dict[str, list[dict[str, Any]]] = {}
    for name, tids in sample["after"].items():
        rows = []
        for tid, (comm, cpu) in tids.items():
            used = (cpu - sample["before"][name].get(tid, (comm, 0.0))[1]) / sample["span"]
            if used >= 0.005:
                rows.append({"tid": tid, "name": comm, "cores": round(used, 3)})
        threads[name] = sorted(rows, key=lambda r: -r["cores"])
    summary = {
        "jobs_per_s": round(len(done) / sample["span"], 2),
        "cores": {name: round(sum(r["cores"] for r in rows), 3) for name, rows in threads.items()},
        "broker_cores": None if sample["broker"] is None else round(sample["broker"], 3),
        "worker_ready_s": round(ready_s, 1),
    }
    data = {
        "benchmark": "worker_cpu",
        "command": " ".join([".venv/bin/python", "benchmarks/worker_cpu.py", *sys.argv[1:]]),
        "worker_command": " ".join(worker.cmd).replace(str(qc.REPO) + "/", ""),
        "machine": machine,
        "settings": vars(args),
        "summary": summary,
        "threads": threads,
        "batch_jobs_published": published,
    }
    print(json.dumps(summary, indent=2))
    print(f"wrote {qc.write_results(args.label, data)}", file=sys.stderr)


if __name__ == "__main__":
    main()
