"""What one broker and one worker's event loop can carry, from a scale-out run.

``benchmarks/scaleout.py`` runs N = 1, 2, 4, 8 workers with a fixed-latency
engine stand-in against one broker and writes, per N, the jobs/s, the
broker's CPU per job and the workers' event-loop CPU per job. From it:

- **workers per broker**: the largest N whose efficiency (jobs/s over
  N x the single worker's jobs/s) is at least ``efficiency`` (default 0.75);
- **broker jobs/s per core**: 1000 / the broker's CPU milliseconds per job
  (median over the runs): one job queue is served by one Erlang process, so
  one core per job queue is the ceiling whatever else the node has;
- **event-loop CPU per job**: the workers' main-thread CPU per job at N = 1
  (the asyncio loop: AMQP, parsing, replies, acks). One loop is one core,
  so a worker handles at most 1 / that jobs/s, whatever its engine does.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from jaxserve.json_files import read_json


class ScaleoutError(ValueError):
    """A scale-out results file that cannot be used."""


@dataclasses.dataclass(frozen=True)
class ScaleoutLimits:
    workers_per_broker: int
    efficiency: float
    table: list[tuple[int, float, float]]  # (workers, jobs/s, efficiency)
    broker_jobs_per_s_per_core: float | None = None
    loop_cpu_s_per_job: float | None = None
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers_per_broker": self.workers_per_broker,
            "efficiency_threshold": self.efficiency,
            "table": [{"workers": n, "jobs_per_s": j, "efficiency": e} for n, j, e in self.table],
            "broker_jobs_per_s_per_core": self.broker_jobs_per_s_per_core,
            "loop_cpu_s_per_job": self.loop_cpu_s_per_job,
            "source": self.source,
        }


def limits_from_results(data: dict[str, Any], *, efficiency: float = 0.75, source: str | None = None) -> ScaleoutLimits:
    """:class:`ScaleoutLimits` from the JSON ``benchmarks/scaleout.py`` writes."""
    if not 0 < efficiency <= 1:
        raise ScaleoutError(f"efficiency threshold must be in (0, 1], got {efficiency}")
    try:
        runs = sorted(((int(r["workers"]), float(r["jobs_per_s"]), r) for r in data["runs"]), key=lambda x: x[0])
    except (KeyError, TypeError, ValueError) as exc:
        raise ScaleoutError(f"not a scale-out result (runs with workers and jobs_per_s): {exc!r}") from None
    if not runs or runs[0][0] != 1 or runs[0][1] <= 0:
        raise ScaleoutError("a scale-out result needs a run with 1 worker and jobs_per_s > 0")
    single = runs[0][1]
    table = [(n, j, j / (n * single)) for n, j, _ in runs]
    cap = 1
    for n, _j, e in table:
        if e < efficiency:
            break
        cap = n
    broker = [float(r["broker_cpu_ms_per_job"]) for _, _, r in runs if r.get("broker_cpu_ms_per_job")]
    broker_per_core = 1000.0 / statistics.median(broker) if broker else None
    loop = runs[0][2].get("worker_loop_cpu_ms_per_job")
    return ScaleoutLimits(
        workers_per_broker=cap,
        efficiency=efficiency,
        table=[(n, round(j, 3), round(e, 4)) for n, j, e in table],
        broker_jobs_per_s_per_core=None if broker_per_core is None else round(broker_per_core, 3),
        loop_cpu_s_per_job=None if not loop else float(loop) / 1000.0,
        source=source,
    )


def load_limits(path: str | Path, *, efficiency: float = 0.75) -> ScaleoutLimits:
    data = read_json(path, ScaleoutError)
    return limits_from_results(data, efficiency=efficiency, source=str(path))
