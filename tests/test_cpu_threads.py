"""XLA's CPU pool follows the CPUs the process may use (jaxserve.engine.cpu_threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.engine import cpu_threads


def test_intra_op_threads_match_the_usable_cpus():
    assert [cpu_threads.intra_op_threads_for(n) for n in (1, 2, 3, 8)] == [1, 2, 3, 8]
    with pytest.raises(ValueError, match="cpus must be at least 1, got 0"):
        cpu_threads.intra_op_threads_for(0)


def test_cgroup_v2_quota_rounds_up(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.quota_cpus(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads.quota_cpus(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert cpu_threads.quota_cpus(tmp_path) == 1


def test_cgroup_v1_quota(tmp_path: Path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads.quota_cpus(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cpu_threads.quota_cpus(tmp_path) == 3
    assert cpu_threads.quota_cpus(tmp_path / "missing") is None


def test_pool_follows_the_affinity_mask_capped_by_the_quota(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_backend_started", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    env: dict[str, str] = {}
    got = cpu_threads.configure(env, root=tmp_path)  # no cgroup files: the mask decides
    assert (got.cpus, got.intra_op_threads, got.source, env) == (
        8,
        8,
        "set",
        {"PJRT_NPROC": "8"},
    )
    assert cpu_threads.configure(env, root=tmp_path).source == "set"  # idempotent

    (tmp_path / "cpu.max").write_text("200000 100000\n")  # a 2-CPU limit on an 8-CPU mask
    env = {}
    got = cpu_threads.configure(env, root=tmp_path)
    assert (got.cpus, got.intra_op_threads, env) == (2, 2, {"PJRT_NPROC": "2"})

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # a 1-CPU mask under the 2-CPU limit
    env = {}
    assert cpu_threads.configure(env, root=tmp_path).intra_op_threads == 1
    assert env == {"PJRT_NPROC": "1"}


def test_operator_value_is_kept_and_checked(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_backend_started", lambda: False)
    env = {"PJRT_NPROC": "4"}
    got = cpu_threads.configure(env, root=tmp_path)
    assert (got.intra_op_threads, got.source, env) == (
        4,
        "environment",
        {"PJRT_NPROC": "4"},
    )
    with pytest.raises(ValueError, match=r"PJRT_NPROC must be a whole number of threads, got 'two'"):
        cpu_threads.configure({"PJRT_NPROC": "two"}, root=tmp_path)
    with pytest.raises(ValueError, match=r"got '-1'"):
        cpu_threads.configure({"PJRT_NPROC": "-1"}, root=tmp_path)


def test_too_late_once_the_backend_is_up(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_backend_started", lambda: True)
    env: dict[str, str] = {}
    got = cpu_threads.configure(env, root=tmp_path)
    assert (got.intra_op_threads, got.source, env) == (None, "already-initialized", {})


_COUNT_POOL = """
import json, os, sys
from pathlib import Path
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
os.environ.pop("PJRT_NPROC", None)
from jaxserve.engine import cpu_threads
plan = cpu_threads.configure(root=Path(sys.argv[2]))
import jax, jax.numpy as jnp
jnp.ones(4).block_until_ready()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({"planned": plan.intra_op_threads, "eigen": names.count("tf_XLAEigen")}))
"""


def _pool_in_fresh_process(mask: list[int], cgroup: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_POOL, ",".join(map(str, mask)), str(cgroup)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_xla_starts_the_planned_pool_in_a_fresh_process(tmp_path: Path):
    """XLA's intra-op pool (its threads are named tf_XLAEigen) has as many
    threads as the affinity mask has CPUs, and one under a 1-CPU quota
    (XLA alone would start one per CPU of the mask)."""
    allowed = sorted(os.sched_getaffinity(0))
    mask = allowed[: min(len(allowed), 3)]
    no_quota = tmp_path / "none"
    no_quota.mkdir()
    assert _pool_in_fresh_process(mask, no_quota) == {
        "planned": len(mask),
        "eigen": len(mask),
    }
    one_cpu = tmp_path / "one"
    one_cpu.mkdir()
    (one_cpu / "cpu.max").write_text("100000 100000\n")
    assert _pool_in_fresh_process(mask, one_cpu) == {"planned": 1, "eigen": 1}
