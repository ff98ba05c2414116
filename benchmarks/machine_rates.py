"""Measure this machine's float32 and int8 matmul rates and memory bandwidth.

Every benchmark scenario (``benchmarks/suite.py``) records these beside its
figures: a batched decode is bound by matmul rate, a one-sequence decode by
how fast the weights stream from memory, and an int8 kernel by the int8
rate (AVX-512 VNNI does four multiply-adds per 32-bit lane and instruction).

    .venv/bin/python benchmarks/machine_rates.py [--json]

Matmul: square float32 products (numpy and a jitted JAX ``jnp.dot``), median
of several runs per size, GFLOP/s = 2 n^3 / seconds. The best size's median
is reported as the machine's rate.

int8: ``int8_gemm_probe.cc`` (built here with ``g++ -O3 -march=native
-fopenmp``; a plain VNNI GEMM, see its header) and XLA's ``s8 x s8 -> s32``
dot, GOP/s = 2 n^3 / seconds; the better is the reference.

Bandwidth: a numpy copy of a 512 MiB float32 array (read + write, counted as
2 x bytes) and a numpy sum (read only), median GB/s; a JAX copy too. Arrays
far exceed the last-level cache, so this is DRAM bandwidth.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE_SRC = Path(__file__).resolve().parent / "int8_gemm_probe.cc"
#: the CPU features a figure's reader needs to judge it (SIMD width, int8
#: dot products, bf16, AMX)
FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, compilation)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def numpy_matmul(sizes, repeats):
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        seconds = _median_seconds(lambda a=a, b=b: a @ b, repeats)
        out[n] = 2 * n**3 / seconds / 1e9
    return out


def jax_matmul(sizes, repeats):
    import jax
    import jax.numpy as jnp

    dot = jax.jit(jnp.dot)
    out = {}
    for n in sizes:
        key_a, key_b = jax.random.split(jax.random.key(0))
        a = jax.random.normal(key_a, (n, n), jnp.float32)
        b = jax.random.normal(key_b, (n, n), jnp.float32)
        seconds = _median_seconds(lambda a=a, b=b: dot(a, b).block_until_ready(), repeats)
        out[n] = 2 * n**3 / seconds / 1e9
    return out


def jax_int8_matmul(sizes, repeats):
    import jax
    import jax.numpy as jnp

    dot = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))
    out = {}
    for n in sizes:
        a = jnp.ones((n, n), jnp.int8)
        b = jnp.ones((n, n), jnp.int8)
        seconds = _median_seconds(lambda a=a, b=b: dot(a, b).block_until_ready(), repeats)
        out[n] = 2 * n**3 / seconds / 1e9
    return out


def _probe_binary() -> Path | None:
    """``int8_gemm_probe.cc`` compiled for this CPU (cached by source hash)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    digest = hashlib.sha256(PROBE_SRC.read_bytes()).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / f"jaxserve-int8-gemm-probe-{digest}"
    if not exe.exists():
        build = subprocess.run(
            [cxx, "-O3", "-march=native", "-fopenmp", str(PROBE_SRC), "-o", str(exe)], capture_output=True, text=True
        )
        if build.returncode != 0:
            return None
    return exe


def cpp_int8_matmul(sizes, repeats):
    exe = _probe_binary()
    out = {}
    if exe is None:
        return out
    for n in sizes:
        line = subprocess.run([str(exe), str(n), str(repeats)], capture_output=True, text=True).stdout.split()
        if len(line) >= 5:
            out[n] = float(line[4])
    return out


def numpy_bandwidth(mib, repeats):
    import numpy as np

    n = mib * 2**20 // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    copy_s = _median_seconds(lambda: np.copyto(dst, src), repeats)
    sum_s = _median_seconds(lambda: src.sum(), repeats)
    return {
        "copy_gb_s": 2 * src.nbytes / copy_s / 1e9,
        "read_gb_s": src.nbytes / sum_s / 1e9,
    }


def jax_bandwidth(mib, repeats):
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    src = jnp.ones((n,), jnp.float32)
    total = jax.jit(jnp.sum)
    sum_s = _median_seconds(lambda: total(src).block_until_ready(), repeats)
    # A scale that reads and writes every element once, in place (donated),
    # so the timing is not dominated by faulting in a fresh output buffer.
    scale = jax.jit(lambda x: x * 1.000001, donate_argnums=0)
    state = {"x": jnp.ones((n,), jnp.float32)}

    def step():
        state["x"] = scale(state["x"])
        state["x"].block_until_ready()

    copy_s = _median_seconds(step, repeats)
    return {
        "copy_gb_s": 2 * src.nbytes / copy_s / 1e9,
        "read_gb_s": src.nbytes / sum_s / 1e9,
    }


def measure(sizes=(1024, 1536, 2048), repeats=7, bandwidth_mib=512) -> dict:
    np_mm = numpy_matmul(sizes, repeats)
    jax_mm = jax_matmul(sizes, repeats)
    i8_cpp = cpp_int8_matmul(sizes, repeats)
    i8_jax = jax_int8_matmul(sizes, repeats)
    np_bw = numpy_bandwidth(bandwidth_mib, repeats)
    jax_bw = jax_bandwidth(bandwidth_mib, repeats)
    return {
        "machine": machine_facts(),
        "int8_gop_s": {
            "cpp_vnni": {str(n): round(v, 1) for n, v in i8_cpp.items()},
            "jax": {str(n): round(v, 1) for n, v in i8_jax.items()},
            "best": round(max([*i8_cpp.values(), *i8_jax.values()]), 1),
        },
        "matmul_gflop_s": {
            "numpy": {str(n): round(v, 1) for n, v in np_mm.items()},
            "jax": {str(n): round(v, 1) for n, v in jax_mm.items()},
            "best": round(max(max(np_mm.values()), max(jax_mm.values())), 1),
        },
        "bandwidth_gb_s": {
            "numpy": {k: round(v, 2) for k, v in np_bw.items()},
            "jax": {k: round(v, 2) for k, v in jax_bw.items()},
            # Reading weights is what a one-sequence decode does.
            "best_read": round(max(np_bw["read_gb_s"], jax_bw["read_gb_s"]), 2),
            "best_copy": round(max(np_bw["copy_gb_s"], jax_bw["copy_gb_s"]), 2),
        },
    }


def machine_facts() -> dict:
    """CPU model, the flags of interest, logical and physical cores, memory."""
    flags: set[str] = set()
    physical: set[tuple[str, str]] = set()
    phys_id = "0"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("physical id"):
                phys_id = line.split(":", 1)[1].strip()
            elif line.startswith("core id"):
                physical.add((phys_id, line.split(":", 1)[1].strip()))
    except OSError:
        pass
    return {
        "cpu": _cpu_model(),
        "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
        "int8_kernel_units": _int8_kernel_units(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "physical_cores": len(physical) or None,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
    }


def _int8_kernel_units() -> str | None:
    """Where jaxserve's quantized kernel takes its prefill products on this
    machine (``jaxserve.kernels.cpu.int8_units``: amx, avx512_vnni or
    portable; ``None`` without the C++ kernels)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxserve.kernels import cpu

    return cpu.int8_units()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 1536, 2048])
    parser.add_argument("--bandwidth-mib", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.bandwidth_mib = [512], 3, 128
    result = measure(tuple(args.sizes), args.repeats, args.bandwidth_mib)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
