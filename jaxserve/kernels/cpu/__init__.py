"""The CPU kernels, built on first use: paged attention
(``paged_attention_cpu.cc``), and for decode steps the dense matmuls
(``matvec_cpu.cc`` for 1-16 tokens, ``matmul_cpu.cc`` for 32-512) and the
greedy pick (``vocab_argmax_cpu.cc``); the quantized products
(``qmatmul_cpu.cc``) and mixtures of experts (``moe_cpu.cc``), which share
the rows-in-lanes tile of ``row_tile.h``; the keys' rotation
(``rope_cpu.cc``), the residual stream's RMSNorm (``rms_norm_cpu.cc``) and
the KV cache's write (``kv_write_cpu.cc``).

XLA's CPU backend runs paged attention as many tiny batched matmuls and
reaches a fraction of the machine's bandwidth; the C++ kernel walks each
token's blocks in place (its header comment says how). Its matmuls of a few
dozen tokens run at about half the machine's rate, which ``matmul_cpu.cc``
recovers without packing; at a handful of tokens it reads the weights at
half the machine's bandwidth, which ``matvec_cpu.cc`` streams once; its greedy argmax takes three passes over the
logits where one does. The sources are compiled together with
the host's C++ compiler the first time a process needs it, against the XLA
FFI headers that ship with jaxlib, into ``<cache>/kernels/`` (the presets'
cache folder: ``$JAXSERVE_CACHE_DIR`` or ``~/.cache/jaxserve``), keyed by a
hash of the sources, the jaxlib version and the flags, so later processes
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

from jaxserve.cache_folders import cache_dir
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import QuantizedPages
from jaxserve.kernels.paged_attention import check_features, visible_keys

log = structlog.get_logger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_attention_cpu.cc",
        "matmul_cpu.cc",
        "matvec_cpu.cc",
        "vocab_argmax_cpu.cc",
        "qmatmul_cpu.cc",
        "moe_cpu.cc",
        "rope_cpu.cc",
        "rms_norm_cpu.cc",
        "kv_write_cpu.cc",
    )
)
#: included by the sources; part of the library's cache key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("run_on_pool.h", "vec16.h", "quant_blocks.h", "row_tile.h"))
TARGET = "jaxserve_paged_attention_cpu"
SYMBOL = "JaxservePagedAttentionCpu"
#: the entry point for feature-major, not yet rotated queries (``paged_attention_cpu_fm``)
TARGET_FM = "jaxserve_paged_attention_cpu_fm"
SYMBOL_FM = "JaxservePagedAttentionCpuFm"
#: the same two over an int8 cache (``kv_cache.QuantizedPages``: int8 values and their scales)
TARGET_I8 = "jaxserve_paged_attention_cpu_i8"
SYMBOL_I8 = "JaxservePagedAttentionCpuI8"
TARGET_FM_I8 = "jaxserve_paged_attention_cpu_fm_i8"
SYMBOL_FM_I8 = "JaxservePagedAttentionCpuFmI8"
TARGET_MATMUL = "jaxserve_matmul_cpu"
SYMBOL_MATMUL = "JaxserveMatmulCpu"
TARGET_MATVEC = "jaxserve_matvec_cpu"
SYMBOL_MATVEC = "JaxserveMatvecCpu"
TARGET_ARGMAX = "jaxserve_vocab_argmax_cpu"
SYMBOL_ARGMAX = "JaxserveVocabArgmaxCpu"
#: quantized weights (``jaxserve.models.quant``; ``qmatmul_cpu.cc``)
TARGET_QMATMUL = "jaxserve_qmatmul_cpu"
SYMBOL_QMATMUL = "JaxserveQmatmulCpu"
#: a mixture of experts' layer, grouped by expert (``moe_cpu.cc``; ``jaxserve.models.moe``)
TARGET_MOE = "jaxserve_moe_cpu"
SYMBOL_MOE = "JaxserveMoeCpu"
#: keys' rotary embedding in one fixed expression per value (``rope_cpu.cc``)
TARGET_ROPE = "jaxserve_rope_cpu"
SYMBOL_ROPE = "JaxserveRopeCpu"
#: RMSNorm over a feature-major activation's features, its sum in a fixed order (``rms_norm_cpu.cc``)
TARGET_RMS_NORM = "jaxserve_rms_norm_cpu"
SYMBOL_RMS_NORM = "JaxserveRmsNormCpu"
#: one layer's KV cache write, in place, float32 and int8 (``kv_write_cpu.cc``)
TARGET_KV_WRITE_F32 = "jaxserve_kv_write_f32_cpu"
SYMBOL_KV_WRITE_F32 = "JaxserveKvWriteF32Cpu"
TARGET_KV_WRITE_I8 = "jaxserve_kv_write_i8_cpu"
SYMBOL_KV_WRITE_I8 = "JaxserveKvWriteI8Cpu"
#: extra compiler flags (space-separated), appended to FLAGS and part of the
#: cache key: tests build the portable loops with ``-mno-avx512vnni``
EXTRA_FLAGS_ENV = "JAXSERVE_CPU_KERNEL_CFLAGS"
#: :func:`matmul_cpu` takes token counts that are a multiple of this
MATMUL_TOKEN_MULTIPLE = 16
#: the programs whose matmuls it takes (:func:`matmul_pays`): below 32
#: tokens XLA's own matmul measured as fast or faster (commits a08414a and
#: 9489a6e: 32 tokens 1.18x on an AVX-512 Intel machine, 0.89x on an AVX-512
#: EPYC, which took 48 up; an AVX2-only EPYC, fe11cca: 1.27x at 32 tokens,
#: 1.08x at 64). Up to 512 tokens (prefill-sized steps of the default 512-token
#: budget) since wide inputs are copied into 64-column panels (matmul_cpu.cc):
#: SmolLM2-135M's layer matrices on a 2-vCPU AVX-512 Xeon, 1.19x XLA's CPU
#: time at 128 tokens, 1.16x at 512, 1.05x at 2048. Its vocabulary projection
#: (49152 x 576) at 64 rows: 1.28x, so the row limit covers vocabularies.
MATMUL_MIN_TOKENS = 32
MATMUL_MAX_TOKENS = 512
MATMUL_MAX_ROWS = 1 << 18
#: the fused q/k/v projection takes it only up to here: its keys and values
#: come out feature-major and need a transpose, which the model avoids in
#: wider programs by projecting them token-major with XLA's dot (llama.py)
MATMUL_QKV_MAX_TOKENS = 64
#: the token counts :func:`matvec_cpu` computes
MATVEC_KERNEL_TOKENS = (1, 2, 4, 8, 16, 32)
#: the token counts the model gives it (:func:`matvec_pays`):
#: the few-token programs, where it measured faster than XLA's matmul for
#: every matrix of the benchmark model, the vocabulary projection included;
#: it also computes 32, where :func:`matmul_cpu` was faster (commit
#: 9489a6e; with AVX2 only, fe11cca: 1.03-1.22x XLA's decode steps at
#: 1-16 tokens)
MATVEC_TOKENS = (1, 2, 4, 8, 16)
DISABLE_ENV = "JAXSERVE_CPU_KERNEL"
# -ffast-math lets the compiler vectorise exp (glibc's libmvec) and reorder
# the sums inside one (token, head) pair; the order is still fixed per pair.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-shared", "-fPIC")


def _flags() -> tuple[str, ...]:
    return (*FLAGS, *os.environ.get(EXTRA_FLAGS_ENV, "").split())


_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _library_path(compiler: str) -> Path:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join((compiler, jaxlib.__version__, *_flags())).encode())
    return cache_dir() / "kernels" / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [compiler, *_flags(), "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(out)]
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
                targets = (
                    (TARGET, SYMBOL),
                    (TARGET_FM, SYMBOL_FM),
                    (TARGET_I8, SYMBOL_I8),
                    (TARGET_FM_I8, SYMBOL_FM_I8),
                    (TARGET_MATMUL, SYMBOL_MATMUL),
                    (TARGET_MATVEC, SYMBOL_MATVEC),
                    (TARGET_ARGMAX, SYMBOL_ARGMAX),
                    (TARGET_QMATMUL, SYMBOL_QMATMUL),
                    (TARGET_MOE, SYMBOL_MOE),
                    (TARGET_ROPE, SYMBOL_ROPE),
                    (TARGET_RMS_NORM, SYMBOL_RMS_NORM),
                    (TARGET_KV_WRITE_F32, SYMBOL_KV_WRITE_F32),
                    (TARGET_KV_WRITE_I8, SYMBOL_KV_WRITE_I8),
                )
                for target, symbol in targets:
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["int8_units"] = _INT8_UNITS.get(int(lib.JaxserveInt8Units()), "portable")
                _state["kv_write_i8"] = bool(lib.JaxserveKvWriteI8Vectorized())
                ok = True
            except Exception as exc:  # noqa: BLE001 - any failure means "use the pure-JAX kernel"
                why = f"{type(exc).__name__}: {exc}"
        if not ok:
            log.warning("cpu_kernel.unavailable", reason=why, fallback="pure-JAX paged attention")
        _state["ok"] = ok
        return ok


#: ``JaxserveInt8Units()`` (qmatmul_cpu.cc) by name
_INT8_UNITS = {2: "amx", 1: "avx512_vnni", 0: "portable"}


def int8_units() -> str | None:
    """Where the quantized kernel's prefill loop (9+ tokens) takes its int8
    products: ``"amx"`` (AMX tiles: the CPU has AMX-INT8 and Linux granted
    the tile state), ``"avx512_vnni"``, or ``"portable"`` (plain C++); decided
    when the library is built (``-march=native``) and loaded. ``None`` where
    the kernels are unavailable."""
    return str(_state["int8_units"]) if available() else None


def unsupported(cache_dtype) -> str | None:
    """Why the C++ kernel cannot serve a cache of ``cache_dtype`` (``None``:
    it can). It reads float32 and int8 caches (in the ``blocks`` layout,
    which choosing it implies); availability is :func:`available`."""
    if jnp.dtype(cache_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.int8)):
        return f"the CPU kernel reads float32 and int8 caches, not {jnp.dtype(cache_dtype).name}"
    return None


def _cache_operands(k_cache, v_cache) -> tuple[str | None, tuple]:
    """The int8 entry point's suffix (``None``: float32) and the cache
    operands in the kernel's order: ``(k, v)``, or for an int8 cache
    ``(k, k_scale, v, v_scale)``."""
    if isinstance(k_cache, QuantizedPages) and isinstance(v_cache, QuantizedPages):
        return "i8", (k_cache.q, k_cache.scale, v_cache.q, v_cache.scale)
    return None, (k_cache, v_cache)


def paged_attention_cpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``paged_attention``'s result (``[T, H, D]`` in ``q.dtype``) from the C++
    kernel, for one layer's float32 or int8 (``QuantizedPages``) cache in
    the ``blocks`` layout (see :func:`unsupported`; call :func:`available`
    first). ``logit_softcap`` and ``sinks`` (float32 ``[H]``) as in
    ``paged_attention``."""
    T, H, D = q.shape
    kvh = k_cache.shape[1]
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    qs = (q.astype(jnp.float32) * scale).reshape(T, kvh, H // kvh, D)
    sink_logits, softcap = _features(logit_softcap, sinks, H)
    int8, caches = _cache_operands(k_cache, v_cache)
    out = jax.ffi.ffi_call(TARGET_I8 if int8 else TARGET, jax.ShapeDtypeStruct(qs.shape, jnp.float32))(
        qs, *caches, *_paging(meta, positions, sliding_window), sink_logits, logit_softcap=softcap
    )
    return out.reshape(T, H, D).astype(q.dtype)


def _paging(meta: AttentionMetadata, positions: jax.Array, sliding_window: int | None) -> tuple[jax.Array, ...]:
    """The kernel's int32 block tables, token rows and visible key range ``[lower, limit)`` per token."""
    limit, lower = visible_keys(meta, positions, sliding_window)
    if lower is None:
        lower = jnp.zeros_like(limit)
    i32 = jnp.int32
    return meta.block_tables.astype(i32), meta.token_seq.astype(i32), limit.astype(i32), lower.astype(i32)


def _features(logit_softcap: float | None, sinks: jax.Array | None, num_heads: int) -> tuple[jax.Array, np.float32]:
    """The kernel's sinks buffer (``[H]``, or ``[0]`` for none) and its
    ``logit_softcap`` attribute (0 for none)."""
    check_features(logit_softcap, sinks, num_heads)
    buffer = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return buffer, np.float32(logit_softcap or 0.0)


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
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
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
    sink_logits, softcap = _features(logit_softcap, sinks, H)
    int8, caches = _cache_operands(k_cache, v_cache)
    out = jax.ffi.ffi_call(TARGET_FM_I8 if int8 else TARGET_FM, jax.ShapeDtypeStruct((T, kvh, H // kvh, D), f32))(
        q_fm.astype(f32),
        cos.astype(f32),
        sin.astype(f32),
        *caches,
        *_paging(meta, positions, sliding_window),
        sink_logits,
        scale=np.float32(scale),
        logit_softcap=softcap,
    )
    return out.reshape(T, H, D)


def _matmul_shapes_ok(w: jax.Array, x: jax.Array) -> bool:
    return (
        w.ndim == 2
        and x.ndim == 2
        and w.dtype == jnp.float32
        and x.dtype == jnp.float32
        and w.shape[1] == x.shape[0]
        and x.shape[1] % MATMUL_TOKEN_MULTIPLE == 0
    )


def matmul_pays(w: jax.Array, x: jax.Array) -> bool:
    """Whether the model should take :func:`matmul_cpu` for ``w @ x``: shapes
    it computes, with a token count in ``[MATMUL_MIN_TOKENS,
    MATMUL_MAX_TOKENS]`` and at most ``MATMUL_MAX_ROWS`` output rows, where
    it measured faster than XLA's matmul (see the constants; fewer tokens
    are XLA's). Availability is :func:`available`."""
    T = x.shape[-1]
    return _matmul_shapes_ok(w, x) and MATMUL_MIN_TOKENS <= T <= MATMUL_MAX_TOKENS and w.shape[0] <= MATMUL_MAX_ROWS


def matmul_cpu(w: jax.Array, x: jax.Array) -> jax.Array:
    """``w @ x`` for float32 weights ``[O, I]`` and feature-major inputs
    ``[I, T]``, ``T`` a multiple of 16, from the C++ kernel: each output one
    float32 sum in k order, so a token's result does not depend on the rest
    of the batch. Call :func:`available` first."""
    if not _matmul_shapes_ok(w, x):
        raise ValueError(
            f"matmul_cpu takes float32 [O, I] @ [I, T] with T a multiple of {MATMUL_TOKEN_MULTIPLE}, "
            f"not {w.dtype.name}{list(w.shape)} @ {x.dtype.name}{list(x.shape)}"
        )
    return jax.ffi.ffi_call(TARGET_MATMUL, jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32))(w, x)


def _matvec_shapes_ok(w: jax.Array, x: jax.Array) -> bool:
    return (
        w.ndim == 2
        and x.ndim == 2
        and w.dtype == jnp.float32
        and x.dtype == jnp.float32
        and w.shape[1] == x.shape[0]
        and x.shape[1] in MATVEC_KERNEL_TOKENS
    )


def matvec_pays(w: jax.Array, x: jax.Array) -> bool:
    """Whether the model should take :func:`matvec_cpu` for ``w @ x``: shapes
    it computes with a token count in :data:`MATVEC_TOKENS`, where it
    measured faster than XLA's matmul for every matrix, the vocabulary
    projection included. Availability is :func:`available`."""
    return _matvec_shapes_ok(w, x) and x.shape[1] in MATVEC_TOKENS


def matvec_cpu(w: jax.Array, x: jax.Array) -> jax.Array:
    """``w @ x`` for float32 weights ``[O, I]`` and feature-major inputs
    ``[I, T]`` of 1, 2, 4, 8, 16 or 32 tokens, from the C++ kernel that streams
    each weight row once (``matvec_cpu.cc``): each output the same float32
    arithmetic whatever the batch, so a token's result does not depend on
    the rest of it. Call :func:`available` first."""
    if not _matvec_shapes_ok(w, x):
        raise ValueError(
            f"matvec_cpu takes float32 [O, I] @ [I, T] with T in {MATVEC_KERNEL_TOKENS}, "
            f"not {w.dtype.name}{list(w.shape)} @ {x.dtype.name}{list(x.shape)}"
        )
    return jax.ffi.ffi_call(TARGET_MATVEC, jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32))(w, x)


_QUANT_KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}


def qmatmul_serves(w, x: jax.Array) -> bool:
    """Whether :func:`qmatmul_cpu` computes ``w @ x`` for a
    ``jaxserve.models.quant.QuantizedWeight`` ``w``: any token count, one
    device's weight (availability is :func:`available`)."""
    return (
        getattr(w, "kind", None) in _QUANT_KINDS
        and x.ndim == 2
        and x.shape[0] == w.shape[1]
        and x.shape[1] >= 1
        and jnp.issubdtype(x.dtype, jnp.floating)
    )


def qmatmul_cpu(w, x: jax.Array, mode: int = 0) -> jax.Array:
    """``dequantize(w) @ x`` for a ``QuantizedWeight`` ``[O, I]`` and
    feature-major float inputs ``[I, T]``, float32 ``[O, T]``, from the C++
    kernel (``qmatmul_cpu.cc``): the activations quantized per token and
    block of 32 to int8, integer dots per block, as
    ``jaxserve.models.quant.matmul`` computes them. ``mode=1`` (only for
    ``benchmarks/quant_kernel_ab.py``): at 1-16 tokens on a VNNI build and
    an even number of blocks per row, float activations against weights
    widened to float instead (the alternative the kernel was measured
    against); ``mode=2``: the prefill loop (tokens in lanes) at any token
    count; ``mode=3``: the VNNI prefill loop where the CPU would run it on
    AMX tiles (:func:`int8_units` says whether it does; the same bits either way).
    Call :func:`available` first."""
    if not qmatmul_serves(w, x):
        raise ValueError(
            f"qmatmul_cpu takes a quantized [O, I] weight @ float [I, T], not "
            f"{getattr(w, 'kind', type(w).__name__)}{list(getattr(w, 'shape', ()))} @ {x.dtype.name}{list(x.shape)}"
        )
    mins = w.scale if w.min is None else w.min
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_QMATMUL, out)(
        w.q, w.scale, mins, x.astype(jnp.float32), kind=np.int32(_QUANT_KINDS[w.kind]), mode=np.int32(mode)
    )


#: :func:`moe_cpu`'s ``kind`` of a float32 stack (the quantized kinds are ``_QUANT_KINDS``')
_MOE_F32 = 3
_MOE_ACTIVATIONS = {"silu": 0, "swiglu_oss": 1}
_MOE_ROUTINGS = {"softmax_topk": 0, "topk_softmax": 1}


def _moe_kind(w) -> int | None:
    """A stack's kind for :func:`moe_cpu`, None for one it does not read."""
    if getattr(w, "kind", None) in _QUANT_KINDS:
        return _QUANT_KINDS[w.kind]
    if isinstance(w, jax.Array) and w.dtype == jnp.float32:
        return _MOE_F32
    return None


def moe_serves(gate_up, down, x: jax.Array) -> bool:
    """Whether :func:`moe_cpu` computes a MoE layer of these expert stacks
    (``gate_up`` ``[X, 2I, E]``, ``down`` ``[X, E, I]``: float32 arrays, or
    ``jaxserve.models.quant.QuantizedWeight`` stacks) for feature-major
    ``x`` ``[E, T]``: any token count, one device's weights (availability
    is :func:`available`)."""
    kinds = (_moe_kind(gate_up), _moe_kind(down))
    if None in kinds or (kinds[0] == _MOE_F32) != (kinds[1] == _MOE_F32):
        return False
    g, d = tuple(gate_up.shape), tuple(down.shape)
    return (
        len(g) == 3
        and len(d) == 3
        and g[1] % 2 == 0
        and d == (g[0], g[2], g[1] // 2)
        and x.ndim == 2
        and x.shape[0] == g[2]
        and jnp.issubdtype(x.dtype, jnp.floating)
    )


def moe_cpu(
    x: jax.Array,
    router: jax.Array,
    b_router: jax.Array | None,
    gate_up,
    down,
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    *,
    top_k: int,
    token_mask: jax.Array | None = None,
    routing: str = "softmax_topk",
    normalize_topk: bool = True,
    activation: str = "silu",
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> jax.Array:
    """A mixture of experts' MLP from the C++ kernel (``moe_cpu.cc``),
    routing included: float32 ``[E, T]`` for feature-major ``x`` ``[E, T]``.
    Each token's ``top_k`` experts by ``router`` ``[X, E]`` (+ ``b_router``)
    and ``routing`` / ``normalize_topk`` as ``jaxserve.models.moe.route``,
    each expert computing its tokens as one group, a token's k results
    weighted and added in routing order. ``gate_up`` ``[X, 2I, E]`` (gate
    rows then up rows) and ``down`` ``[X, E, I]``: float32 or
    ``QuantizedWeight`` stacks (the inputs then quantized per token and
    block as ``qmatmul_cpu`` does); optional biases ``[X, 2I]`` and ``[X,
    E]``; ``activation`` as ``jaxserve.models.moe.expert_activation``.
    ``token_mask`` (bool ``[T]``): tokens whose output nobody reads (a step's
    padding) are left out, experts and all, and get zeros. Call
    :func:`available` first."""
    if not moe_serves(gate_up, down, x) or router.shape != (gate_up.shape[0], x.shape[0]):
        raise ValueError(
            "moe_cpu takes float32 or quantized stacks gate_up [X, 2I, E] and down [X, E, I], router [X, E] and "
            f"x [E, T], not {list(getattr(gate_up, 'shape', ()))}, {list(getattr(down, 'shape', ()))}, "
            f"{list(router.shape)} and {list(x.shape)}"
        )
    if activation not in _MOE_ACTIVATIONS or routing not in _MOE_ROUTINGS:
        raise ValueError(
            f"moe_cpu: activation must be one of {', '.join(_MOE_ACTIVATIONS)} and routing one of "
            f"{', '.join(_MOE_ROUTINGS)}, not {activation!r} and {routing!r}"
        )

    def buffers(w) -> tuple[jax.Array, jax.Array, jax.Array]:
        if _moe_kind(w) != _MOE_F32:  # a QuantizedWeight stack
            return w.q, w.scale, w.scale if w.min is None else w.min
        none = jnp.zeros((0,), jnp.float16)
        return w, none, none

    def bias(b: jax.Array | None) -> jax.Array:
        return jnp.zeros((0,), jnp.float32) if b is None else b.astype(jnp.float32)

    kind_gate_up, kind_down = _moe_kind(gate_up), _moe_kind(down)
    assert kind_gate_up is not None and kind_down is not None  # moe_serves said so
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_MOE, out)(
        x.astype(jnp.float32),
        router.astype(jnp.float32),
        bias(b_router),
        *buffers(gate_up),
        *buffers(down),
        bias(b_gate_up),
        bias(b_down),
        jnp.zeros((0,), jnp.int32) if token_mask is None else token_mask.astype(jnp.int32),
        top_k=np.int32(top_k),
        router=np.int32(_MOE_ROUTINGS[routing]),
        normalize=np.int32(bool(normalize_topk)),
        kind_gate_up=np.int32(kind_gate_up),
        kind_down=np.int32(kind_down),
        activation=np.int32(_MOE_ACTIVATIONS[activation]),
        limit=np.float32(swiglu_limit),
        alpha=np.float32(swiglu_alpha),
    )


def vocab_argmax_serves(logits_t: jax.Array) -> bool:
    """Whether :func:`vocab_argmax_cpu` takes these logits: float32 ``[V, R]``,
    ``V, R >= 1`` (availability is :func:`available`)."""
    return logits_t.ndim == 2 and logits_t.dtype == jnp.float32 and logits_t.shape[1] > 0 and logits_t.shape[0] > 0


def vocab_argmax_cpu(logits_t: jax.Array) -> jax.Array:
    """``jaxserve.engine.sampler.argmax(logits_t, axis=0)`` in one pass: each
    column's first index of its maximum, 0 for a column holding a NaN;
    int32 ``[R]``."""
    if not vocab_argmax_serves(logits_t):
        raise ValueError(
            f"vocab_argmax_cpu takes float32 [V, R] logits with V, R >= 1, "
            f"not {logits_t.dtype.name}{list(logits_t.shape)}"
        )
    return jax.ffi.ffi_call(TARGET_ARGMAX, jax.ShapeDtypeStruct((logits_t.shape[1],), jnp.int32))(logits_t)


def rope_cpu(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``jaxserve.models.rope.apply_rope(x, cos, sin)`` for ``x`` ``[T, N,
    D]`` and ``cos``/``sin`` ``[T, R]`` (``R <= D``, even), float32: the same
    bits for a token in every program (``rope_cpu.cc`` says why)."""
    T, N, D = x.shape
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] != T or cos.shape[1] % 2 or cos.shape[1] > D:
        raise ValueError(f"rope_cpu takes x [T, N, D] and cos/sin [T, R], R even <= D, not {x.shape}, {cos.shape}")
    f32 = jnp.float32
    return jax.ffi.ffi_call(TARGET_ROPE, jax.ShapeDtypeStruct(x.shape, f32))(
        x.astype(f32), cos.astype(f32), sin.astype(f32)
    )


def rms_norm_cpu(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """``jaxserve.models.blocks.rms_norm(x, weight, eps, axis=0, offset)``
    for feature-major ``x`` ``[E, T]``, float32: a token's bits the same in
    every program, in one custom call instead of ``ordered_sum``'s tree
    (``rms_norm_cpu.cc`` says why)."""
    if x.ndim != 2 or weight.shape != (x.shape[0],):
        raise ValueError(f"rms_norm_cpu takes x [E, T] and weight [E], not {x.shape}, {weight.shape}")
    f32 = jnp.float32
    w = weight.astype(f32)
    if offset:
        w = w + f32(offset)
    return jax.ffi.ffi_call(TARGET_RMS_NORM, jax.ShapeDtypeStruct(x.shape, f32))(x.astype(f32), w, eps=np.float32(eps))


def kv_write_serves(k_cache, head_dim: int) -> bool:
    """Whether :func:`kv_write_cpu` takes the writes of one layer's ``k_cache``
    (blocks layout): a float32 array, or an int8 cache's ``QuantizedPages``
    where this build has the AVX-512 loop and ``head_dim`` is a multiple of
    16; else ``paged_attention.write_kv`` serves (bfloat16 caches among them),
    the same bytes."""
    if not available():
        return False
    if isinstance(k_cache, QuantizedPages):
        return bool(_state["kv_write_i8"]) and head_dim % 16 == 0
    return k_cache.dtype == jnp.float32


def kv_write_cpu(k_cache, v_cache, k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array):
    """``paged_attention.write_kv`` for one layer's float32 or int8 cache in
    the blocks layout: this step's keys and values ``[T, kv_heads,
    head_dim]`` copied, or quantized as ``kv_cache.quantize_kv`` does (the
    same bits), into their slots in place (the cache's arrays alias the
    results), in one custom call instead of XLA's slot arithmetic,
    scatters and quantization (``kv_write_cpu.cc`` says why). Returns the
    new ``(k_cache, v_cache)``, of the type given."""
    T, H, D = k_new.shape
    nb, bs = k_cache.shape[0], k_cache.shape[3]
    if (
        v_new.shape != k_new.shape
        or tuple(k_cache.shape) != (nb, H, D, bs)
        or tuple(v_cache.shape) != (nb, H, bs, D)
        or slot_mapping.shape != (T,)
    ):
        raise ValueError(
            f"kv_write_cpu takes k/v [T, H, D], slots [T] and blocks-layout pages, not {k_new.shape}, "
            f"{slot_mapping.shape}, {k_cache.shape}, {v_cache.shape}"
        )
    quantized = isinstance(k_cache, QuantizedPages)
    pages = (k_cache.q, k_cache.scale, v_cache.q, v_cache.scale) if quantized else (k_cache, v_cache)
    f32 = jnp.float32
    out = jax.ffi.ffi_call(
        TARGET_KV_WRITE_I8 if quantized else TARGET_KV_WRITE_F32,
        tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pages),
        input_output_aliases={3 + i: i for i in range(len(pages))},
    )(k_new.astype(f32), v_new.astype(f32), slot_mapping.astype(jnp.int32), *pages)
    if quantized:
        return QuantizedPages(out[0], out[1]), QuantizedPages(out[2], out[3])
    return out[0], out[1]


__all__ = [
    "available",
    "int8_units",
    "kv_write_cpu",
    "kv_write_serves",
    "matmul_cpu",
    "matmul_pays",
    "matvec_cpu",
    "matvec_pays",
    "moe_cpu",
    "moe_serves",
    "rms_norm_cpu",
    "rope_cpu",
    "paged_attention_cpu",
    "paged_attention_cpu_fm",
    "qmatmul_cpu",
    "qmatmul_serves",
    "unsupported",
    "vocab_argmax_cpu",
    "vocab_argmax_serves",
]
