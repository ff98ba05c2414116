"""What every result records about the machine and the code.

The machine: ``benchmarks/machine_rates.py`` in a subprocess (CPU model,
flags of interest, cores, memory, measured read/copy bandwidth, f32 GEMM and
int8 GEMM rates), before the rounds; a figure is put against these limits.
The code: the commit and whether ``jaxserve/`` had uncommitted changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def measure(quick: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "machine_rates.py"), "--json", *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    rates = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        **rates["machine"],
        "rates": rates,
        "read_gb_s": rates["bandwidth_gb_s"]["best_read"],
        "copy_gb_s": rates["bandwidth_gb_s"]["best_copy"],
        "f32_gflop_s": rates["matmul_gflop_s"]["best"],
        "int8_gop_s": rates["int8_gop_s"]["best"],
        "quick": quick,
    }


#: result variants of the scenarios whose figure depends on the int8 units
#: (int8-prefill, classify-queue): a run where they are not AMX tiles is kept
#: beside the AMX one, under the same command (the machine decides)
INT8_VARIANTS = {"vnni": "", "portable": ""}


def int8_variant() -> str | None:
    """``vnni`` or ``portable`` where this machine's int8 prefill loop does not
    run on AMX tiles (``jaxserve.kernels.cpu.int8_units``); None on AMX."""
    from jaxserve.kernels import cpu

    units = cpu.int8_units() if cpu.available() else "portable"
    return {"avx512_vnni": "vnni", "portable": "portable"}.get(units or "")


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "jaxserve_dirty": bool(git("status", "--porcelain", "--untracked-files=no", "jaxserve")),
    }


def short(machine: dict[str, Any]) -> str:
    """One table cell: the CPU and its limits."""
    if "error" in machine:
        return "not measured"
    cpu = machine.get("cpu", "?").replace("(R)", "").replace(" Processor", "").replace(" CPU", "")
    flags = machine.get("flags") or []
    simd = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    extra = [f for f in ("avx512_vnni", "amx_int8") if f in flags]
    units = machine.get("int8_kernel_units")
    return (
        f"{cpu}, {machine.get('usable_cpus')} cores, {simd}{'+' + '+'.join(extra) if extra else ''}"
        f"{f' (int8 prefill on {units})' if units else ''}; "
        f"{machine.get('read_gb_s')} GB/s read, {machine.get('f32_gflop_s')} GFLOP/s f32, "
        f"{machine.get('int8_gop_s')} GOP/s int8"
    )
