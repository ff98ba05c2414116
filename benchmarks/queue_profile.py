"""Measurement-only instrumentation of a ``jaxserve worker`` for the queue
benchmarks: where does a job's time go between the broker and the engine?

Run the worker through it, with one of its engine factories:
``python benchmarks/queue_profile.py worker ... --engine
queue_profile:build_engine`` with ``PYTHONPATH=benchmarks``
(``queue_common.profiled_worker`` gives the launcher, flags and environment;
``queue_batch_vs_offline.py --profile`` and the other queue benchmarks use
it). The launcher instruments the worker's side (the event loop) and runs
``jaxserve``'s command line; the factory builds the real engine with
``jaxserve.worker.factory.build_engine`` and instruments it wherever it runs
(the worker's engine process, by default), writing its steps next to the
record, where the worker's side picks them up. Without changing behaviour:

- wraps ``Engine.step`` to record, per step: start time, duration, sequences
  scheduled, tokens scheduled, and requests waiting in the engine after it;
- wraps ``EngineThread.add_request`` (``EngineProcess``'s) / the worker's ``_handle``, ``_finish``,
  ``_reply_final`` and ``_settle`` coroutines to time each job's phases
  (delivery received -> admitted -> finished -> final reply confirmed ->
  acked) on the event loop;
- samples the event loop's lag (a 1 ms timer's lateness) from the first
  delivery on;
- with ``$QUEUE_PROFILE_CPROFILE`` set, cProfiles the event loop's thread
  (from the first delivery on) into that file (this slows the loop: use it
  for the breakdown, not for timings).

Everything is written as JSON to ``$QUEUE_PROFILE_OUT`` when the worker
process exits (SIGTERM drains and exits normally; the engine process has
exited by then).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import threading
import time
from typing import Any

_steps: list[tuple[float, float, int, int, int]] = []
_jobs: dict[str, dict[str, float]] = {}
_lag: list[tuple[float, float]] = []
_lock = threading.Lock()


_cprof: list[Any] = []


def _start_cprofile() -> None:
    """cProfile the calling thread (the event loop) when
    ``$QUEUE_PROFILE_CPROFILE`` names an output file."""
    if os.environ.get("QUEUE_PROFILE_CPROFILE") and not _cprof:
        import cProfile

        # CPU time of this thread, so waiting in epoll does not count.
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        _cprof.append(prof)


def _steps_path() -> str | None:
    path = os.environ.get("QUEUE_PROFILE_OUT")
    return f"{path}.steps" if path else None


def _dump_steps() -> None:
    """The engine's side, at its process's exit: the steps it recorded."""
    path = _steps_path()
    if path:
        with _lock, open(path, "w") as f:
            json.dump(_steps, f)


def _dump() -> None:
    """The worker's side, at its exit: its job and loop records with the
    engine's steps."""
    if _cprof:
        _cprof[0].disable()
        _cprof[0].dump_stats(os.environ["QUEUE_PROFILE_CPROFILE"])
    path = os.environ.get("QUEUE_PROFILE_OUT")
    if not path:
        return
    try:
        with open(f"{path}.steps") as f:
            steps = json.load(f)
    except (OSError, ValueError):
        steps = []
    with _lock:
        data = {"steps": steps, "jobs": _jobs, "loop_lag": _lag}
    with open(path, "w") as f:
        json.dump(data, f)


def _instrument_engine(engine: Any) -> None:
    orig_step = engine.step
    sched = engine.scheduler

    def step() -> Any:
        t0 = time.monotonic()
        outs = orig_step()
        t1 = time.monotonic()
        # The plan of this step is gone; the scheduler's running list after
        # the step is what ran (minus finished, plus nothing new).
        n_running = len(sched.running)
        finished = sum(1 for o in outs if o.finished)
        _steps.append((t0, t1 - t0, n_running + finished, len(outs), sched.num_waiting))
        return outs

    engine.step = step


def _instrument_worker() -> None:
    from jaxserve.worker.engine_process import EngineProcess
    from jaxserve.worker.engine_thread import EngineThread
    from jaxserve.worker.intake import Intake
    from jaxserve.worker.job_run import JobRun
    from jaxserve.worker.lifecycle import Delivery, job_key_of
    from jaxserve.worker.replies import Replies

    def rec(key: Any, name: str) -> None:
        if isinstance(key, str):
            _jobs.setdefault(key, {})[name] = time.monotonic()

    orig_take = Intake.take
    sampler: list[asyncio.Task] = []

    async def take(self, message, queue_class):  # type: ignore[no-untyped-def]
        rec(message.message_id, "received")
        if not sampler:
            sampler.append(asyncio.get_running_loop().create_task(_lag_sampler()))
            _start_cprofile()  # on the event loop's thread only
        return await orig_take(self, message, queue_class)

    def timed_add(orig):  # type: ignore[no-untyped-def]
        def add_request(self, request_id, *a, **kw):  # type: ignore[no-untyped-def]
            key = job_key_of(request_id)
            rec(key, "add_sent")
            fut = orig(self, request_id, *a, **kw)
            fut.add_done_callback(lambda _f: rec(key, "admitted"))
            return fut

        return add_request

    orig_finish = JobRun.finish

    async def _finish(kj, result, record=None):  # type: ignore[no-untyped-def]
        rec(kj.key, "finish_start")
        # The engine's own clock (same monotonic clock) and the loop's first token.
        stamps = _jobs.setdefault(kj.key, {})
        for name, t in (getattr(kj, "engine_metrics", None) or {}).items():
            stamps[f"engine_{name}"] = t
        if getattr(kj, "first_token_mono", None) is not None:
            stamps["loop_first_token"] = kj.first_token_mono
        r = await orig_finish(kj, result, record)
        rec(kj.key, "finish_end")
        return r

    orig_reply = Replies.final

    async def _publish_final(self, d, result):  # type: ignore[no-untyped-def]
        rec(result.id, "reply_start")
        r = await orig_reply(self, d, result)
        rec(result.id, "reply_confirmed")
        return r

    orig_settle = Delivery.settle

    async def settle(self, how):  # type: ignore[no-untyped-def]
        r = await orig_settle(self, how)
        rec(self.message.message_id, "acked")
        return r

    Intake.take = take
    for cls in (EngineThread, EngineProcess):
        cls.add_request = timed_add(cls.add_request)
    JobRun.finish = _finish
    Replies.final = _publish_final
    Delivery.settle = settle


async def _lag_sampler() -> None:
    """Lateness of a 1 ms sleep: how long callbacks wait for the loop."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(0.001)
        _lag.append((t0, time.monotonic() - t0 - 0.001))


def build_engine(**kwargs: Any) -> Any:
    from jaxserve.worker.factory import build_engine as real

    engine = real(**kwargs)
    _instrument_engine(engine)
    atexit.register(_dump_steps)
    return engine


# ------------------------------------------------------------- analysis
def summarize(path: str, t_from: float, t_to: float) -> dict[str, Any]:
    """Engine occupancy and per-job phase medians inside [t_from, t_to]."""
    import statistics

    data = json.load(open(path))
    steps = [s for s in data["steps"] if t_from <= s[0] <= t_to]
    span = t_to - t_from
    out: dict[str, Any] = {}
    if steps:
        busy = sum(s[1] for s in steps)
        out["engine"] = {
            "steps": len(steps),
            "busy_frac": round(busy / span, 3),
            "step_ms_median": round(1000 * statistics.median(s[1] for s in steps), 3),
            "seqs_per_step_mean": round(sum(s[2] for s in steps) / len(steps), 2),
            "waiting_in_engine_mean": round(sum(s[4] for s in steps) / len(steps), 2),
            "steps_with_empty_waiting_frac": round(sum(1 for s in steps if s[4] == 0) / len(steps), 3),
        }
    phases = {
        "received_to_add_sent": ("received", "add_sent"),
        "add_sent_to_admitted": ("add_sent", "admitted"),
        "admitted_to_finish_start": ("admitted", "finish_start"),
        "reply_publish_confirm": ("reply_start", "reply_confirmed"),
        "finish_start_to_acked": ("finish_start", "acked"),
        "received_to_acked": ("received", "acked"),
    }
    jobs = [j for j in data["jobs"].values() if t_from <= j.get("received", -1) <= t_to]
    out["jobs"] = len(jobs)
    ph: dict[str, Any] = {}
    for name, (a, b) in phases.items():
        xs = sorted(j[b] - j[a] for j in jobs if a in j and b in j)
        if xs:
            ph[name] = {
                "median_ms": round(1000 * statistics.median(xs), 3),
                "p90_ms": round(1000 * xs[int(0.9 * (len(xs) - 1))], 3),
                "mean_ms": round(1000 * sum(xs) / len(xs), 3),
            }
    out["job_phases"] = ph
    lag = [x[1] for x in data["loop_lag"] if t_from <= x[0] <= t_to]
    if lag:
        lag.sort()
        out["loop_lag_ms"] = {
            "median": round(1000 * statistics.median(lag), 3),
            "p90": round(1000 * lag[int(0.9 * (len(lag) - 1))], 3),
        }
    return out


def loop_breakdown(pstats_path: str, jobs: int) -> dict[str, Any]:
    """Self CPU time (``time.thread_time`` profiles) of the profiled thread
    grouped by library, in milliseconds per job."""
    import pstats

    st = pstats.Stats(pstats_path)
    groups = {
        "amqp (aio_pika/aiormq/pamqp)": ("aio_pika", "aiormq", "pamqp"),
        "socket send/recv syscalls": ("_socket.socket",),
        "asyncio + selectors": ("asyncio", "selectors", "select.epoll", "_contextvars"),
        "logging (structlog + print)": ("structlog", "logging", "builtins.print"),
        "uuid4 (os.urandom)": ("uuid", "posix.urandom"),
        "json (orjson/json)": ("orjson", "json"),
        "tokenizer": ("jaxserve/tokenizer", "tokenizers"),
        "idempotency store": ("jaxserve/worker/store", "sqlite3"),
        "worker": ("jaxserve/worker",),
        "wire (validation, messages)": ("jaxserve/wire", "pydantic"),
        "metrics (prometheus)": ("prometheus", "jaxserve/metrics"),
        "profiler shims (benchmarks/queue_profile)": ("queue_profile",),
    }
    totals: dict[str, float] = dict.fromkeys(groups, 0.0)
    totals["other"] = 0.0
    top: list[tuple[float, str]] = []
    all_tt = 0.0
    for (file, line, fn), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        all_tt += tt
        where = f"{file}:{line}({fn})"
        top.append((tt, where))
        for name, keys in groups.items():
            if any((k in fn) if file == "~" else (k in file) for k in keys):
                totals[name] += tt
                break
        else:
            totals["other"] += tt
    top.sort(reverse=True)
    return {
        "total_ms_per_job": round(1000 * all_tt / max(jobs, 1), 3),
        "by_group_ms_per_job": {
            k: round(1000 * v / max(jobs, 1), 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
        },
        "top_self_time": [
            {"fn": w.replace(os.getcwd() + "/", ""), "ms_per_job": round(1000 * t / max(jobs, 1), 4)}
            for t, w in top[:15]
        ],
    }


def build_engine_late_admission(**kwargs: Any) -> Any:
    """``build_engine`` with the behaviour before commit 3652a22, for A/B
    runs: the engine ignores the worker's ``before_plan`` hook, so a job that
    arrives during a step waits for the plan after the next one (pair with
    ``--engine-arg async_scheduling=true``, the old worker default)."""
    engine = build_engine(**kwargs)

    class _LateAdmission(type(engine)):  # type: ignore[misc, valid-type]
        before_plan = property(lambda self: None, lambda self, _hook: None)

    engine.__class__ = _LateAdmission
    return engine


if __name__ == "__main__":
    # The launcher: ``jaxserve`` with the worker's side instrumented before
    # anything runs (atexit: after the engine's side, whose process the
    # worker stops first, or whose handler was registered later).
    from jaxserve.cli.main import cli

    _instrument_worker()
    atexit.register(_dump)
    sys.argv[0] = "jaxserve"
    cli()
