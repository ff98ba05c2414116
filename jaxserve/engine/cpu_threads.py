"""XLA's CPU thread pool, sized to the CPUs this process may use.

On the CPU backend an engine step runs on XLA's executing thread (one of the
client's dispatch threads) and XLA's intra-op pool, which XLA's own parallel
operations and the C++ kernels (``jaxserve/kernels/cpu/run_on_pool.h``)
share: one pool, not two. An operation on a pool of N threads runs on N, the
executing thread being one of them (a dot or a fusion on a 1-thread pool
runs on the executing thread alone: per-thread CPU time, this module's
commit). So the pool should be exactly the CPUs the process may use.

XLA sizes it itself from the affinity mask, but not from a cgroup CPU quota:
a pod limited to 2 CPUs on a 32-core node would start 32 threads per pool
and be throttled, each operation's statically split parts waiting for the
slowest. :func:`configure` sets ``PJRT_NPROC``, which XLA's CPU client reads
once, when it starts, to the affinity mask's CPUs capped by the quota. An
operator's own ``PJRT_NPROC`` is kept. It has to run before anything in the
process initializes JAX's CPU backend; after that it only reports.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

#: read by XLA's CPU client when it starts (``DefaultThreadPoolSize``): the
#: intra-op pool's threads, and the client's dispatch threads
ENV = "PJRT_NPROC"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# the value configure() wrote, per environment mapping: a later call reports
# "set", not the operator's "environment"
_set_here: dict[int, str] = {}


@dataclass(frozen=True)
class CpuThreads:
    """What :func:`configure` found and decided."""

    #: CPUs this process may run on: affinity mask, capped by a CPU quota
    cpus: int
    #: XLA's intra-op pool size in effect (``PJRT_NPROC``), or ``None``
    #: where the backend was already up and XLA chose it
    intra_op_threads: int | None
    #: ``"set"`` (configure set it), ``"environment"`` (the operator's value
    #: kept) or ``"already-initialized"`` (too late to change)
    source: str


def affinity_cpus() -> int:
    """The CPUs in this process's affinity mask (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return max(1, os.cpu_count() or 1)


def quota_cpus(root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup CPU quota in whole CPUs, rounded up (``None``: no quota).
    Reads cgroup v2's ``cpu.max`` (``"max 100000"`` or ``"200000 100000"``),
    else v1's ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The affinity mask's CPUs, capped by the cgroup quota."""
    quota = quota_cpus(root)
    cpus = affinity_cpus()
    return min(cpus, quota) if quota is not None else cpus


def intra_op_threads_for(cpus: int) -> int:
    """The intra-op pool for ``cpus`` usable CPUs: as many threads (XLA
    counts its executing thread as one of the pool's share)."""
    if cpus < 1:
        raise ValueError(f"cpus must be at least 1, got {cpus}")
    return cpus


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def configure(environ: dict[str, str] | None = None, *, root: Path = CGROUP_ROOT) -> CpuThreads:
    """Set ``PJRT_NPROC`` (in ``environ``, default ``os.environ``) for the
    CPUs this process may use, unless it is set already or JAX's backend is
    up. Idempotent; called by :class:`jaxserve.engine.engine.Engine` before it
    touches JAX."""
    env = os.environ if environ is None else environ
    cpus = usable_cpus(root)
    if env.get(ENV) is not None and env.get(ENV) == _set_here.get(id(env)):
        return CpuThreads(cpus, int(env[ENV]), "set")
    if ENV in env:
        value = env[ENV]
        try:
            threads = int(value)
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of threads, got {value!r}") from None
        if threads < 0:
            raise ValueError(f"{ENV} must be a whole number of threads, got {value!r}")
        return CpuThreads(cpus, threads, "environment")
    if _backend_started():
        return CpuThreads(cpus, None, "already-initialized")
    threads = intra_op_threads_for(cpus)
    env[ENV] = _set_here[id(env)] = str(threads)
    log.debug("cpu_threads.configured", cpus=cpus, intra_op_threads=threads)
    return CpuThreads(cpus, threads, "set")
