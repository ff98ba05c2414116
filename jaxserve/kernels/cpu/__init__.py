"""The CPU paged-attention kernel (``paged_attention_cpu.cc``), built on first use.

XLA's CPU backend runs paged attention as many tiny batched matmuls and
reaches a fraction of the machine's bandwidth; the C++ kernel walks each
token's blocks in place (its header comment says how). It is compiled with
the host's C++ compiler the first time a process needs it, against the XLA
FFI headers that ship with jaxlib, into ``<cache>/kernels/`` (the presets'
cache folder: ``$JAXSERVE_CACHE_DIR`` or ``~/.cache/jaxserve``), keyed by a
hash of the source, the jaxlib version and the flags, so later processes
load it in milliseconds. ``-march=native`` is safe because the library is
built on the machine that runs it.

Where no compiler is found, the build fails, or ``JAXSERVE_CPU_KERNEL=0``
is set, :func:`available` says False (logging why, once) and the pure-JAX
kernels serve: the C++ kernel is a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import structlog

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.paged_attention import visible_keys
from jaxserve.presets import cache_dir

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.cc")
TARGET = "jaxserve_paged_attention_cpu"
SYMBOL = "JaxservePagedAttentionCpu"
#: the entry point for feature-major, not yet rotated queries (``paged_attention_cpu_fm``)
TARGET_FM = "jaxserve_paged_attention_cpu_fm"
SYMBOL_FM = "JaxservePagedAttentionCpuFm"
DISABLE_ENV = "JAXSERVE_CPU_KERNEL"
# -ffast-math lets the compiler vectorise exp (glibc's libmvec) and reorder
# the sums inside one (token, head) pair; the order is still fixed per pair.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-shared", "-fPIC")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _library_path(compiler: str) -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join((compiler, jaxlib.__version__, *FLAGS)).encode())
    return cache_dir() / "kernels" / f"paged_attention_cpu-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(out, path)  # atomic: a concurrent process loads a whole file or builds its own


def available() -> bool:
    """Whether the C++ kernel is registered with XLA (building it if needed)."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = False, ""
        if os.environ.get(DISABLE_ENV, "1") == "0":
            why = f"{DISABLE_ENV}=0"
        elif (compiler := _compiler()) is None:
            why = "no C++ compiler (g++, c++ or clang++) on PATH"
        else:
            try:
                path = _library_path(compiler)
                if not path.is_file():
                    _build(compiler, path)
                    log.info("cpu_kernel.built", path=str(path))
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
                jax.ffi.register_ffi_target(TARGET_FM, jax.ffi.pycapsule(getattr(lib, SYMBOL_FM)), platform="cpu")
                ok = True
            except Exception as exc:  # noqa: BLE001 - any failure means "use the pure-JAX kernel"
                why = f"{type(exc).__name__}: {exc}"
        if not ok:
            log.warning("cpu_kernel.unavailable", reason=why, fallback="pure-JAX paged attention")
        _state["ok"] = ok
        return ok


def unsupported(cache_dtype) -> str | None:
    """Why the C++ kernel cannot serve a cache of ``cache_dtype`` (``None``:
    it can). It reads float32 caches (in the ``blocks`` layout, which
    choosing it implies); availability is :func:`available`."""
    if jnp.dtype(cache_dtype) != jnp.float32:
        return f"the CPU kernel reads float32 caches, not {jnp.dtype(cache_dtype).name}"
    return None


def paged_attention_cpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """``paged_attention``'s result (``[T, H, D]`` in ``q.dtype``) from the C++
    kernel, for one layer's float32 cache in the ``blocks`` layout (see
    :func:`unsupported`; call :func:`available` first)."""
    T, H, D = q.shape
    kvh = k_cache.shape[1]
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    qs = (q.astype(jnp.float32) * scale).reshape(T, kvh, H // kvh, D)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(qs.shape, jnp.float32))(
        qs, k_cache, v_cache, *_paging(meta, positions, sliding_window)
    )
    return out.reshape(T, H, D).astype(q.dtype)


def _paging(meta: AttentionMetadata, positions: jax.Array, sliding_window: int | None) -> tuple[jax.Array, ...]:
    """The kernel's int32 block tables, token rows and visible key range ``[lower, limit)`` per token."""
    limit, lower = visible_keys(meta, positions, sliding_window)
    if lower is None:
        lower = jnp.zeros_like(limit)
    i32 = jnp.int32
    return meta.block_tables.astype(i32), meta.token_seq.astype(i32), limit.astype(i32), lower.astype(i32)


def paged_attention_cpu_fm(
    q_fm: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """:func:`paged_attention_cpu` of the queries ``q_fm`` as the fused
    projection leaves them: feature-major ``[H * D, T]`` (head-major rows)
    and not yet rotated; the kernel applies RoPE with ``cos``/``sin``
    ``[T, D]`` (``jaxserve.models.rope``'s rotate-half convention) and the
    scale as it reads them. Returns ``[T, H, D]`` float32."""
    HD, T = q_fm.shape
    D = cos.shape[-1]
    kvh = k_cache.shape[1]
    if HD % (kvh * D) or cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(
            f"q rows {HD} must be a multiple of {kvh} kv heads x head dim {D}, and cos/sin "
            f"{cos.shape}/{sin.shape} must be [{T}, {D}]"
        )
    H = HD // D
    f32 = jnp.float32
    out = jax.ffi.ffi_call(TARGET_FM, jax.ShapeDtypeStruct((T, kvh, H // kvh, D), f32))(
        q_fm.astype(f32), cos.astype(f32), sin.astype(f32), k_cache, v_cache,
        *_paging(meta, positions, sliding_window), scale=np.float32(scale),
    )  # fmt: skip
    return out.reshape(T, H, D)


__all__ = ["available", "paged_attention_cpu", "paged_attention_cpu_fm", "unsupported"]
