"""Capacity planning (``jaxserve plan``).

- :mod:`~jaxserve.planning.profile`: a model's measured prefill and decode
  rates and KV bytes per token on one machine (``jaxserve plan --measure``);
- :mod:`~jaxserve.planning.workload`: the workload (rate, burst, token
  distributions, TTFT/ITL targets, headroom), from flags or a JSON/YAML file;
- :mod:`~jaxserve.planning.scaleout`: broker and event-loop limits from a
  ``benchmarks/scaleout.py`` result;
- :mod:`~jaxserve.planning.planner`: the arithmetic, line by line.
"""

from jaxserve.planning.planner import BUDGETS, Plan, PlanInfeasible, PlanOptions, make_plan
from jaxserve.planning.profile import Profile, ProfileError
from jaxserve.planning.scaleout import ScaleoutError, ScaleoutLimits, limits_from_results, load_limits
from jaxserve.planning.workload import PlanWorkload, TokenDist, WorkloadError, build_workload, read_workload_file

__all__ = [
    "BUDGETS",
    "Plan",
    "PlanInfeasible",
    "PlanOptions",
    "PlanWorkload",
    "Profile",
    "ProfileError",
    "ScaleoutError",
    "ScaleoutLimits",
    "TokenDist",
    "WorkloadError",
    "build_workload",
    "limits_from_results",
    "load_limits",
    "make_plan",
    "read_workload_file",
]
