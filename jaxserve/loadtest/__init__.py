"""Load testing a running jaxserve worker over the queue (``jaxserve loadtest``).

- :mod:`~jaxserve.loadtest.workload`: the job mix and its length distributions;
- :mod:`~jaxserve.loadtest.runner`: closed-loop (concurrency) and open-loop
  (Poisson rate) levels through the reference client, per-job timings,
  rejections, cancellations and the capacity check after each level;
- :mod:`~jaxserve.loadtest.records`: one job's record and how its final
  result is classified;
- :mod:`~jaxserve.loadtest.report`: per-level percentiles, the markdown
  table, ``loadtest.json`` and the plot (matplotlib, the ``loadtest`` extra).
"""

from jaxserve.loadtest.records import JobRecord, itl_samples
from jaxserve.loadtest.runner import LoadTest, LoadTestError, RunConfig
from jaxserve.loadtest.workload import IntRange, JobKind, JobSpec, Workload, default_kinds, parse_mix

__all__ = [
    "IntRange",
    "JobKind",
    "JobRecord",
    "JobSpec",
    "LoadTest",
    "LoadTestError",
    "RunConfig",
    "Workload",
    "default_kinds",
    "itl_samples",
    "parse_mix",
]
