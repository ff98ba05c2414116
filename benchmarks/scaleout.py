"""Scale-out of the queue path: N workers against one broker.

    PYTHONPATH=. .venv/bin/python benchmarks/scaleout.py [--workers 1,2,4,8] [--jobs 1500]

Each worker runs an engine stand-in of fixed per-job latency
(:func:`make_fixed_latency_engine`, ``--engine benchmarks.scaleout:make_fixed_latency_engine``:
every job finishes ``latency_s`` after admission with ``tokens`` tokens, up
to ``max_num_seqs`` at once, no model), so a worker alone is bound by that
latency (``max_num_seqs / latency_s`` jobs/s) and the machine's cores
measure only the queue path: the broker, the workers' event loops and the
load generator.

Per N: start N ``jaxserve worker`` processes on a fresh prefix (memory
store), wait until the batch queue has N consumers, stop them (SIGSTOP),
publish ``--jobs`` batch jobs up front (publisher confirms, pipelined),
resume them (SIGCONT) and time until the last result is back. Reported:

- jobs/s, and efficiency = jobs/s / (N x the single worker's jobs/s);
- worker event-loop CPU per job: the workers' main threads (the asyncio
  loop), utime + stime from ``/proc/<pid>/task/<pid>/stat`` over the run,
  summed over the workers, divided by the jobs; the whole worker processes
  too;
- broker CPU per job and the cores it used (the ``beam.smp`` process);
- messages/s: jobs plus their results, both published to and delivered by
  the broker (2 per job);
- how busy the machine was (``/proc/stat``).

The summary says where efficiency first drops below ``--efficiency``
(0.75) and what the CPU was doing there. ``jaxserve plan --scaleout FILE``
reads the result. Writes ``benchmarks/results/scaleout-<UTC time>.json``
and prints a markdown table. The workers are stopped by PID and every queue
of each prefix is deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# -------------------------------------------------------- the engine stand-in
class _Tokenizer:
    """One token per UTF-8 byte (the stand-in never looks at them)."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages)


class FixedLatencyEngine:
    """Every request finishes ``latency_s`` after it is admitted, with
    ``tokens`` tokens (at most its ``max_tokens``); ``max_num_seqs`` run at
    once, the rest wait in arrival order. ``step`` sleeps until the next
    finish, at most ``tick_s``, so new requests are admitted promptly."""

    def __init__(
        self,
        *,
        latency_s: float = 0.04,
        tokens: int = 4,
        max_num_seqs: int = 4,
        interactive_reserved_seqs: int = 0,
        max_model_len: int = 4096,
        tick_s: float = 0.002,
        model_name: str = "fixed-latency",
    ) -> None:
        from jaxserve.engine.types import RequestOutput

        self._Output = RequestOutput
        self.tokenizer = _Tokenizer()
        self.latency_s = float(latency_s)
        self.tokens = int(tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.interactive_reserved_seqs = int(interactive_reserved_seqs)
        self.max_model_len = int(max_model_len)
        self.tick_s = float(tick_s)
        self.model_name = model_name
        self.waiting: list[tuple[str, int, int]] = []  # (id, prompt tokens, tokens)
        self.running: dict[str, tuple[float, int, int]] = {}  # id -> (due, prompt tokens, tokens)

    def warmup(self) -> None:
        pass

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        request_class: Any = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        from jaxserve.request_error import RequestError

        n = len(prompt) if not isinstance(prompt, str) else len(prompt.encode())
        if n + params.max_tokens > self.max_model_len:
            raise RequestError("context_length_exceeded", f"{n} + {params.max_tokens} > {self.max_model_len}")
        self.waiting.append((request_id, n, max(1, min(self.tokens, int(params.max_tokens)))))

    def abort(self, request_id: str) -> bool:
        if self.running.pop(request_id, None) is not None:
            return True
        before = len(self.waiting)
        self.waiting = [w for w in self.waiting if w[0] != request_id]
        return len(self.waiting) != before

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Any]:
        now = time.monotonic()
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid, n, k = self.waiting.pop(0)
            self.running[rid] = (now + self.latency_s, n, k)
        if self.running:
            wait = min(due for due, _, _ in self.running.values()) - now
            if wait > 0:
                time.sleep(min(wait, self.tick_s))
        now = time.monotonic()
        outs = []
        for rid, (due, n, k) in list(self.running.items()):
            if due <= now:
                del self.running[rid]
                text = "ok " * k
                outs.append(
                    self._Output(
                        rid,
                        [1] * k,
                        text,
                        finished=True,
                        finish_reason="length",
                        text=text,
                        prompt_tokens=n,
                        completion_tokens=k,
                    )
                )
        return outs


def make_fixed_latency_engine(model: str | None = None, **kwargs: Any) -> FixedLatencyEngine:
    """Factory for ``jaxserve worker --engine benchmarks.scaleout:make_fixed_latency_engine
    --engine-arg latency_s=0.04 --engine-arg tokens=4 --engine-arg max_num_seqs=4``
    (``model`` and the worker's engine flags it does not use are ignored)."""
    known = (
        "latency_s",
        "tokens",
        "max_num_seqs",
        "interactive_reserved_seqs",
        "max_model_len",
        "tick_s",
        "model_name",
    )
    return FixedLatencyEngine(**{k: v for k, v in kwargs.items() if k in known})


# --------------------------------------------------------------- the benchmark
def _launch(prefix: str, n: int, args: argparse.Namespace, logdir: Path, qc: Any) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    procs = []
    for i in range(n):
        cmd = [
            qc.jaxserve_exe(),
            "worker",
            "--engine",
            "benchmarks.scaleout:make_fixed_latency_engine",
            "--engine-arg",
            f"latency_s={args.latency_s}",
            "--engine-arg",
            f"tokens={args.tokens}",
            "--engine-arg",
            f"max_num_seqs={args.max_num_seqs}",
            "--engine-arg",
            "interactive_reserved_seqs=0",
            "--prefix",
            prefix,
            "--amqp-url",
            qc.AMQP_URL,
            "--store",
            "memory",
            "--log-format",
            "json",
            "--log-level",
            args.log_level,
        ]
        log = open(logdir / f"{prefix}-w{i}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


async def _consumers(url: str, queue: str) -> int:
    import aio_pika
    import aiormq.exceptions

    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel()
        try:
            q = await ch.declare_queue(queue, passive=True)
            return int(q.declaration_result.consumer_count)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return 0
    finally:
        await conn.close()


def _wait_consumers(procs: list[subprocess.Popen], url: str, queue: str, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        dead = [p.pid for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"workers {dead} exited before consuming")
        if asyncio.run(_consumers(url, queue)) >= n:
            return time.monotonic() - t0
        time.sleep(0.3)
    raise RuntimeError(f"{queue}: fewer than {n} consumers after {timeout}s")


def _snap(procs: list[subprocess.Popen], broker_pid: int | None, qc: Any) -> dict[str, Any]:
    import resource

    loops, totals = [], []
    for p in procs:
        threads = qc.thread_cpu_s(p.pid)
        loops.append(threads.get(p.pid, ("", 0.0))[1])
        totals.append(qc.proc_cpu_s(p.pid) or 0.0)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "t": time.monotonic(),
        "loop": sum(loops),
        "workers": sum(totals),
        "broker": qc.proc_cpu_s(broker_pid) if broker_pid else None,
        "self": ru.ru_utime + ru.ru_stime,
        "system": qc._system_cpu_s(),
    }


async def _run_jobs(
    prefix: str, procs: list[subprocess.Popen], args: argparse.Namespace, broker_pid: int | None, qc: Any
) -> dict[str, Any]:
    from jaxserve.client import AsyncClient

    client = await AsyncClient(qc.AMQP_URL, prefix=prefix, name="bench-scaleout").connect()
    try:
        body = {"prompt": " ".join(["word"] * args.prompt_words), "max_tokens": args.tokens, "cache": False}
        keys = [f"{prefix}-{i}" for i in range(args.jobs)]
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            t_pub = time.monotonic()
            for start in range(0, len(keys), 200):  # up to 200 confirms outstanding
                await asyncio.gather(*(client.publish(body, key=k, queue="batch") for k in keys[start : start + 200]))
            publish_s = time.monotonic() - t_pub
            a = _snap(procs, broker_pid, qc)
        finally:
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
        results = await asyncio.gather(*(client.wait(k, args.timeout) for k in keys))
        b = _snap(procs, broker_pid, qc)
    finally:
        await client.delete_reply_queue()
        await client.close()
    wall = b["t"] - a["t"]
    failed = sum(not r.ok for r in results)
    jobs = args.jobs
    out: dict[str, Any] = {
        "jobs": jobs,
        "failed": failed,
        "publish_s": round(publish_s, 3),
        "wall_s": round(wall, 3),
        "jobs_per_s": round(jobs / wall, 2),
        "messages_per_s": round(2 * jobs / wall, 2),
        "worker_loop_cpu_ms_per_job": round(1000 * (b["loop"] - a["loop"]) / jobs, 4),
        "worker_cpu_ms_per_job": round(1000 * (b["workers"] - a["workers"]) / jobs, 4),
        "worker_cores": round((b["workers"] - a["workers"]) / wall, 3),
        "bench_process_cpu_ms_per_job": round(1000 * (b["self"] - a["self"]) / jobs, 4),
        "bench_process_cores": round((b["self"] - a["self"]) / wall, 3),
    }
    if a["broker"] is not None and b["broker"] is not None:
        out["broker_cpu_ms_per_job"] = round(1000 * (b["broker"] - a["broker"]) / jobs, 4)
        out["broker_cores"] = round((b["broker"] - a["broker"]) / wall, 3)
    if a["system"] and b["system"]:
        busy, total = b["system"][0] - a["system"][0], b["system"][1] - a["system"][1]
        out["machine_busy_frac"] = round(busy / total, 3) if total > 0 else None
    return out


def _stop(procs: list[subprocess.Popen]) -> list[int | None]:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(30))
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            codes.append(p.wait(10))
    return codes


def summarize(runs: list[dict[str, Any]], threshold: float, nproc: int | None) -> dict[str, Any]:
    single = runs[0]["jobs_per_s"]
    for r in runs:
        r["efficiency"] = round(r["jobs_per_s"] / (r["workers"] * single), 4)
    scales_to, stops_at = 1, None
    for r in runs:
        if r["efficiency"] < threshold:
            stops_at = r
            break
        scales_to = r["workers"]
    best = max(runs, key=lambda r: r["jobs_per_s"])
    broker = [r["broker_cpu_ms_per_job"] for r in runs if r.get("broker_cpu_ms_per_job")]
    broker_ms = statistics.median(broker) if broker else None
    summary: dict[str, Any] = {
        "single_worker_jobs_per_s": single,
        "max_jobs_per_s": best["jobs_per_s"],
        "max_at_workers": best["workers"],
        "efficiency_threshold": threshold,
        "scales_to_workers": scales_to,
        "stops_scaling_at": None if stops_at is None else stops_at["workers"],
        "broker_cpu_ms_per_job": None if broker_ms is None else round(broker_ms, 4),
        "broker_jobs_per_s_per_core": None if not broker_ms else round(1000 / broker_ms, 1),
        "worker_loop_cpu_ms_per_job": runs[0]["worker_loop_cpu_ms_per_job"],
        "worker_loop_jobs_per_s_per_core": round(1000 / runs[0]["worker_loop_cpu_ms_per_job"], 1)
        if runs[0]["worker_loop_cpu_ms_per_job"]
        else None,
    }
    where = stops_at or runs[-1]
    busy = where.get("machine_busy_frac")
    cpu_ms = (
        where["worker_cpu_ms_per_job"] + where.get("broker_cpu_ms_per_job", 0.0) + where["bench_process_cpu_ms_per_job"]
    )
    ceiling = (nproc or 1) * 1000 / cpu_ms if cpu_ms else None
    summary["cpu_ms_per_job_total"] = round(cpu_ms, 4)
    summary["cpu_bound_ceiling_jobs_per_s"] = None if ceiling is None else round(ceiling, 1)
    summary["why"] = (
        f"{'stops scaling' if stops_at else 'last run'} at N={where['workers']}: {where['jobs_per_s']} jobs/s, "
        f"efficiency {where['efficiency']}; the machine was {busy if busy is None else f'{busy:.0%}'} busy on {nproc} cores: "
        f"workers {where['worker_cores']} cores, broker {where.get('broker_cores')} cores, load generator "
        f"{where['bench_process_cores']} cores. The queue path costs {cpu_ms:.2f} CPU ms per job in all "
        f"(worker processes {where['worker_cpu_ms_per_job']}, of which event loops {where['worker_loop_cpu_ms_per_job']}; "
        f"broker {where.get('broker_cpu_ms_per_job')}; publisher+collector {where['bench_process_cpu_ms_per_job']}), "
        f"so {nproc} cores carry at most about {ceiling and round(ceiling)} jobs/s however many workers there are"
    )
    return summary


def markdown(runs: list[dict[str, Any]]) -> str:
    rows = [
        (
            "| workers | jobs/s | ideal jobs/s | efficiency | loop CPU ms/job | worker CPU ms/job | broker CPU ms/job "
            "| broker cores | messages/s | machine busy |"
        ),
        "|" + "---|" * 10,
    ]
    for r in runs:
        busy = r.get("machine_busy_frac")
        rows.append(
            f"| {r['workers']} | {r['jobs_per_s']:.1f} | {r['ideal_jobs_per_s']:.0f} | {r['efficiency']:.2f} | "
            f"{r['worker_loop_cpu_ms_per_job']:.3f} | {r['worker_cpu_ms_per_job']:.3f} | {r.get('broker_cpu_ms_per_job', float('nan')):.3f} | "
            f"{r.get('broker_cores', float('nan')):.2f} | {r['messages_per_s']:.0f} | {'-' if busy is None else f'{busy:.0%}'} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4,8", help="Worker counts, in order (the first must be 1).")
    ap.add_argument("--jobs", type=int, default=1500, help="Batch jobs per worker count.")
    ap.add_argument("--latency-s", type=float, default=0.04, help="The stand-in's per-job latency.")
    ap.add_argument("--tokens", type=int, default=4, help="Tokens per job (max_tokens).")
    ap.add_argument(
        "--max-num-seqs", type=int, default=4, help="Jobs one stand-in runs at once (= the batch prefetch)."
    )
    ap.add_argument("--prompt-words", type=int, default=8)
    ap.add_argument("--efficiency", type=float, default=0.75, help="Scaling stops where efficiency falls below this.")
    ap.add_argument(
        "--log-level", default="info", help="Workers' log level (info: the default deployment's per-job lines)."
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--settle", type=float, default=2.0, help="Seconds between worker counts.")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import queue_common as qc

    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    if not counts or counts[0] != 1:
        raise SystemExit("--workers must start with 1 (efficiency is against one worker)")
    machine = qc.machine_info()
    broker_pid = qc.find_broker_pid()
    logdir = Path(tempfile.mkdtemp(prefix="jaxserve-scaleout-"))
    runs: list[dict[str, Any]] = []
    t_script = time.monotonic()
    for n in counts:
        prefix = f"bench-scaleout-{uuid.uuid4().hex[:8]}-n{n}"
        procs = _launch(prefix, n, args, logdir, qc)
        try:
            ready = _wait_consumers(procs, qc.AMQP_URL, f"{prefix}.batch", n, timeout=180)
            time.sleep(1.0)  # let start-up CPU settle
            res = asyncio.run(_run_jobs(prefix, procs, args, broker_pid, qc))
        finally:
            codes = _stop(procs)
            qc.delete_topology(prefix)
        left = qc.leftover_queues(prefix)
        res.update(
            workers=n,
            ready_s=round(ready, 1),
            exit_codes=codes,
            leftover_queues=left,
            ideal_jobs_per_s=n * args.max_num_seqs / args.latency_s,
        )
        runs.append(res)
        print(
            f"N={n}: {res['jobs_per_s']} jobs/s ({res['wall_s']} s, failed {res['failed']}); loop "
            f"{res['worker_loop_cpu_ms_per_job']} ms/job, broker {res.get('broker_cpu_ms_per_job')} ms/job, "
            f"machine busy {res.get('machine_busy_frac')}",
            file=sys.stderr,
        )
        time.sleep(args.settle)
    summary = summarize(runs, args.efficiency, machine.get("nproc"))
    data = {
        "benchmark": "scaleout",
        "command": " ".join(["PYTHONPATH=.", ".venv/bin/python", "benchmarks/scaleout.py", *sys.argv[1:]]),
        "machine": {**machine, "loadavg_end": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json_out", "no_save")},
        "summary": summary,
        "runs": runs,
        "script_s": round(time.monotonic() - t_script, 1),
    }
    print(markdown(runs))
    print()
    print(summary["why"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2) + "\n")
    elif not args.no_save:
        qc.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = qc.RESULTS_DIR / f"scaleout-{time.strftime('%Y-%m-%dT%H%M%SZ', time.gmtime())}.json"
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
