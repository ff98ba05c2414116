"""Two versions of one C++ CPU kernel in one process, for the kernel A/B scripts.

:func:`register_versions` builds ``jaxserve/kernels/cpu/<source>`` as it is at
a git revision and as it is in the working tree, each with the headers of
its own version beside it (``run_on_pool.h``, where the revision has it),
into its own library registered under its own FFI target, with the flags
the package builds its kernels with.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "jaxserve/kernels/cpu"


def _git_show(rev: str, path: str) -> str | None:
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def commit_of(rev: str) -> str:
    """``rev`` as a short commit hash (what a result records: ``HEAD`` moves)."""
    proc = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else rev


def register_versions(baseline: str, source: str, symbol: str, prefix: str) -> dict[str, str]:
    """FFI targets ``{"baseline": ..., "working tree": ...}`` of ``symbol`` in
    ``source`` (a file name under jaxserve/kernels/cpu) at ``baseline`` and
    in the working tree."""
    import jax

    from jaxserve.kernels import cpu as cpu_kernels

    tmp = Path(tempfile.mkdtemp(prefix=f"jaxserve-{prefix}-"))
    folders = {"baseline": tmp / "baseline", "working tree": ROOT / KERNELS}
    folders["baseline"].mkdir()
    text = _git_show(baseline, f"{KERNELS}/{source}")
    if text is None:
        raise SystemExit(f"{KERNELS}/{source} does not exist at {baseline}")
    (folders["baseline"] / source).write_text(text)
    for header in cpu_kernels.HEADERS:
        if (old := _git_show(baseline, f"{KERNELS}/{header.name}")) is not None:
            (folders["baseline"] / header.name).write_text(old)
    targets = {}
    for i, (name, folder) in enumerate(folders.items()):
        lib_path = tmp / f"kernel{i}.so"
        cmd = ["g++", *cpu_kernels.FLAGS, "-I", jax.ffi.include_dir(), str(folder / source), "-o", str(lib_path)]
        subprocess.run(cmd, check=True, capture_output=True)
        lib = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_LOCAL)
        targets[name] = f"jaxserve_{prefix}_{i}"
        jax.ffi.register_ffi_target(targets[name], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return targets
