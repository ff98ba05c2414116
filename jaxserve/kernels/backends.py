"""Which attention kernel a layer runs, chosen once per engine and per compiled program.

``EngineArgs.attention_backend``:

- ``"reference"``: the pure-JAX kernels of ``paged_attention.py`` over the
  ``blocks`` cache layout, on every backend (the CPU's path, unchanged);
- ``"pallas"``: the Pallas kernels JAX ships, through the adapters of
  ``pallas_attention.py``, over the ``heads`` cache layout; an error when
  the platform has none (CPU) or the model's shapes do not fit them;
- ``"cpu"``: the C++ paged-attention kernel (``kernels/cpu``, built on
  first use with the host's compiler) over the ``blocks`` layout, for every
  program on the CPU; an error where it cannot build or the cache is neither
  float32 nor int8;
- ``"auto"`` (default): ``"pallas"`` on ``gpu`` and ``tpu`` when the shapes
  fit; on the CPU ``"cpu"`` when it builds and the cache is float32 or int8;
  else ``"reference"`` (bfloat16 caches on the CPU, head dims Triton cannot
  tile, ...).

An int8 cache (``kv_cache.QuantizedPages``) is read by the C++ kernel, the
reference kernels and the GPU Pallas kernel; on TPU ``auto`` picks the
reference for it (``pallas_attention.py`` says why).

The choice is per model and depends on shapes only. A layer's attention
features (sliding window, logit soft-cap, attention sinks) are arguments of
each call, so one model may mix them (Gemma 2: every other layer slides;
gpt-oss: sinks on every layer, a window on half): where the shipped kernel a
call would take lacks one of its features (``pallas_attention.KERNEL_FEATURES``),
that call runs the reference kernel over the same ``heads`` cache instead,
and the model's other layers keep the fast kernel. The C++ and reference
kernels compute every feature.

Per compiled program (the token bucket ``T`` is static) with the Pallas
backend:

- **GPU**: programs of at most ``max(max_num_seqs, 8)`` tokens, the ones
  every decode step runs in, call the shipped GPU paged kernel one token per
  kernel row (exact for any token; a decode step reads each context once);
  bigger (prefill) programs run the reference kernel over the ``heads``
  layout. The GPU kernel soft-caps; sliding-window and sink layers run the
  reference.
- **TPU**: the same split with the TPU paged kernel for the decode-sized
  programs; bigger programs run the ragged TPU kernel (mixed prefill and
  decode, sliding windows, soft-capping) when its shape rules hold (head_dim
  a multiple of 128), else the reference over the ``heads`` layout.
  Sliding-window layers take the ragged kernel in decode-sized programs too
  (the paged kernel has no window); sink layers run the reference.

``write_and_attend`` is what a model layer calls: it writes the step's keys
and values, then attends, and with a tensor-parallel mesh runs both inside a
``shard_map`` over the ``tp`` axis, each device on its own kv heads (and
their query heads, and those heads' sinks) with its shard of the cache: no
communication, and the Pallas kernels, which GSPMD cannot partition, see
plain local arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.kernels import cpu as cpu_kernel
from jaxserve.kernels import pallas_attention as pallas
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import QuantizedPages, is_quantized, scale_axis
from jaxserve.kernels.paged_attention import paged_attention, write_kv

BACKENDS = ("auto", "reference", "pallas", "cpu")
#: the mesh axis tensor parallelism shards heads over
TP_AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """The kernel choice of an engine (static, hashable: it lives in the model's graph definition).

    ``kernel``: ``reference``, ``cpu`` (the C++ kernel), ``gpu`` or ``tpu``. ``interpret``: run the
    Pallas kernels in interpret mode (CPU tests). ``ragged``: on TPU, run
    prefill-sized programs through the ragged kernel. ``max_kernel_tokens``:
    the largest program (token bucket) the per-token paged kernels serve;
    ``None``: ``max(max_num_seqs, 8)``, read from the step's block tables.
    """

    kernel: Literal["reference", "cpu", "gpu", "tpu"] = "reference"
    interpret: bool = False
    ragged: bool = False
    max_kernel_tokens: int | None = None

    @property
    def layout(self) -> str:
        """The KV cache layout this choice reads (``kv_cache.py``)."""
        return "blocks" if self.kernel in ("reference", "cpu") else "heads"

    def kernel_tokens(self, meta: AttentionMetadata) -> int:
        if self.max_kernel_tokens is not None:
            return self.max_kernel_tokens
        return max(meta.block_tables.shape[0] - 1, 8)


REFERENCE = AttentionImpl()


def select_attention(
    requested: str,
    *,
    head_dim: int,
    num_kv_heads: int,
    block_size: int,
    cache_dtype,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: bool = False,
    tensor_parallel_size: int = 1,
    platform: str | None = None,
) -> tuple[AttentionImpl, str]:
    """The kernel for ``requested`` (``EngineArgs.attention_backend``) on
    ``platform`` (default ``jax.default_backend()``), and a one-line reason.

    ``num_kv_heads`` is the model's; each tensor-parallel device holds
    ``num_kv_heads / tensor_parallel_size`` of them. ``sliding_window``
    (the window of the model's sliding layers, if any), ``logit_softcap``
    and ``sinks`` (whether any layer has them) do not change the choice
    (module docstring): they only let the reason say which layers run the
    reference. Raises ``ValueError`` for an unknown name, and for
    ``"pallas"`` where no shipped kernel fits."""
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    platform = platform or jax.default_backend()
    if requested == "reference":
        return REFERENCE, "attention_backend='reference'"
    if requested == "cpu" or (requested == "auto" and platform == "cpu"):
        why = cpu_kernel.unsupported(cache_dtype) if platform == "cpu" else f"platform {platform!r} is not the CPU"
        if why is None and not cpu_kernel.available():
            why = "the C++ kernel did not build (see the cpu_kernel.unavailable log line)"
        if why is None:
            return AttentionImpl(kernel="cpu"), "CPU: C++ paged-attention kernel"
        if requested == "cpu":
            raise ValueError(f"attention_backend='cpu' cannot run here: {why}")
        return REFERENCE, f"auto: reference ({why})"
    features = pallas.layer_features(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks or None)
    if platform in ("gpu", "cuda", "rocm"):
        why = pallas.gpu_kernel_unsupported(head_dim=head_dim, block_size=block_size)
        if why is None:
            reason = "GPU: shipped Pallas paged kernel for decode-sized programs"
            return AttentionImpl(kernel="gpu"), reason + _reference_layers(features, pallas.KERNEL_FEATURES["gpu"])
    elif platform == "tpu" and is_quantized(cache_dtype):
        why = "the shipped TPU kernels take no int8 cache with per-token scales in place (pallas_attention.py)"
    elif platform == "tpu":
        local_kv = max(1, num_kv_heads // max(1, tensor_parallel_size))
        ragged_why = pallas.tpu_ragged_unsupported(head_dim=head_dim, num_kv_heads=local_kv, cache_dtype=cache_dtype)
        reason = "TPU: shipped Pallas paged kernel for decode-sized programs, " + (
            "ragged kernel for the others" if ragged_why is None else f"reference for the others ({ragged_why})"
        )
        if ragged_why is None and "sliding_window" in features:
            reason += "; sliding-window layers: ragged kernel for all programs"
        served = pallas.KERNEL_FEATURES["tpu_ragged" if ragged_why is None else "tpu"]
        return AttentionImpl(kernel="tpu", ragged=ragged_why is None), reason + _reference_layers(features, served)
    else:
        why = f"no Pallas paged-attention kernel for platform {platform!r}"
    if requested == "pallas":
        raise ValueError(f"attention_backend='pallas' cannot run here: {why}")
    return REFERENCE, f"auto: reference ({why})"


_FEATURE_NAMES = {
    "sliding_window": "a sliding window",
    "logit_softcap": "logit soft-capping",
    "sinks": "attention sinks",
}


def _reference_layers(features: frozenset[str], served: frozenset[str]) -> str:
    """The reason's note on the layers that run the reference (features the kernel lacks)."""
    missing = [
        _FEATURE_NAMES[name] for name in ("sliding_window", "logit_softcap", "sinks") if name in features - served
    ]
    return f"; layers with {' or '.join(missing)}: reference" if missing else ""


def attend(
    impl: AttentionImpl,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    cache_dtype=None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """One layer's attention over a per-layer cache in ``impl.layout``
    (already holding this step's keys); ``[T, H, D]`` in ``q.dtype``.

    ``sliding_window``, ``logit_softcap`` (static) and ``sinks`` (float32
    ``[H]``) are this layer's (``paged_attention``); a shipped Pallas kernel
    serves the call only if it computes all of them (``KERNEL_FEATURES``),
    else the reference kernel does, over the same cache."""
    # every kernel's inputs, in the order all of them take them
    inputs = (q, k_cache, v_cache, meta, positions)
    if impl.kernel == "cpu":
        return cpu_kernel.paged_attention_cpu(
            *inputs, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks
        )
    T = q.shape[0]
    small = T <= impl.kernel_tokens(meta)
    features = pallas.layer_features(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    stored = jnp.int8 if isinstance(k_cache, QuantizedPages) else cache_dtype

    def serves(kernel: str) -> bool:
        return features <= pallas.KERNEL_FEATURES[kernel] and pallas.kernel_reads(kernel, stored)

    if impl.kernel in ("gpu", "tpu") and small and serves(impl.kernel):
        paged = pallas.gpu_paged_attention if impl.kernel == "gpu" else pallas.tpu_paged_attention
        return paged(
            *inputs, scale=scale, cache_dtype=cache_dtype, interpret=impl.interpret, logit_softcap=logit_softcap
        )
    if impl.kernel == "tpu" and impl.ragged and serves("tpu_ragged"):
        return pallas.tpu_ragged_attention(
            *inputs,
            scale=scale,
            sliding_window=sliding_window,
            cache_dtype=cache_dtype,
            interpret=impl.interpret,
            logit_softcap=logit_softcap,
        )
    return paged_attention(
        *inputs,
        block_size=block_size,
        scale=scale,
        sliding_window=sliding_window,
        cache_dtype=cache_dtype,
        layout=impl.layout,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )


def cache_spec(layout: str) -> P:
    """PartitionSpec of one layer's cache array: sharded on its kv-heads axis."""
    return P(TP_AXIS, None, None, None) if layout == "heads" else P(None, TP_AXIS, None, None)


def cache_specs(layout: str, pages, keys: bool):
    """``cache_spec`` for one layer's ``pages`` as they are: a plain array's,
    or for an int8 cache's ``QuantizedPages`` the values' and their scales'
    (the same axes without ``head_dim``)."""
    spec = cache_spec(layout)
    if not isinstance(pages, QuantizedPages):
        return spec
    drop = scale_axis(layout, keys) % len(spec)
    # a pytree of specs mirroring the pages (shard_map's in_specs/out_specs)
    return QuantizedPages(cast(Any, spec), cast(Any, P(*(axis for i, axis in enumerate(spec) if i != drop))))


def write_and_attend(
    impl: AttentionImpl,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    cache_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    query_meta: AttentionMetadata | None = None,
    query_positions: jax.Array | None = None,
    query_rope: tuple[jax.Array, jax.Array] | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's ``k``/``v`` ``[T, KVH, D]`` into one layer's cache and
    attend with ``q`` ``[T, H, D]``; returns ``(k_cache, v_cache, out)``.

    ``query_meta`` and ``query_positions`` (default: ``meta`` and
    ``positions``) describe the query tokens when they are not the step's
    ``T`` tokens, e.g. only the rows a step samples from (``q`` is then
    ``[R, H, D]``, and so is ``out``); the keys written are still all ``T``.

    ``query_rope`` (``cos``, ``sin`` ``[Tq, D]``; the C++ CPU kernel only,
    without a mesh): ``q`` is the fused projection's feature-major,
    not yet rotated ``[H * D, Tq]``, and the kernel rotates it (see
    ``kernels.cpu.paged_attention_cpu_fm``); ``out`` is ``[Tq, H, D]`` as ever.

    ``sliding_window``, ``logit_softcap`` (static Python values) and
    ``sinks`` (float32 ``[H]``, a weight) are this layer's attention
    features, all off by default (``paged_attention``): a model passes its
    own per layer.

    With ``mesh`` (tensor parallelism), both run per device on its heads
    (``shard_map`` over ``tp``): the cache must be sharded on its kv-heads
    axis (``cache_spec``), and ``q``/``k``/``v``/``out`` (and ``sinks``) are
    split on their heads axis (head ``h`` of device ``i`` uses kv head
    ``h // G`` of the same device, since both are split in contiguous, equal
    runs)."""

    query_meta = meta if query_meta is None else query_meta
    query_positions = positions if query_positions is None else query_positions
    if query_rope is not None and (impl.kernel != "cpu" or mesh is not None):
        raise ValueError(f"query_rope needs the cpu kernel without a mesh, not {impl.kernel!r} (mesh {mesh})")

    def local(q, k, v, k_cache, v_cache, meta, query_meta, query_positions, sinks=None):
        if impl.kernel == "cpu" and cpu_kernel.kv_write_serves(k_cache, k.shape[-1]):
            k_cache, v_cache = cpu_kernel.kv_write_cpu(k_cache, v_cache, k, v, meta.slot_mapping)
        else:
            k_cache, v_cache = write_kv(
                k_cache, v_cache, k, v, meta.slot_mapping, cache_dtype=cache_dtype, layout=impl.layout
            )
        if query_rope is not None:
            out = cpu_kernel.paged_attention_cpu_fm(
                q,
                *query_rope,
                k_cache,
                v_cache,
                query_meta,
                query_positions,
                scale=scale,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
                sinks=sinks,
            )
        else:
            out = attend(
                impl,
                q,
                k_cache,
                v_cache,
                query_meta,
                query_positions,
                block_size=block_size,
                scale=scale,
                sliding_window=sliding_window,
                cache_dtype=cache_dtype,
                logit_softcap=logit_softcap,
                sinks=sinks,
            )
        return k_cache, v_cache, out

    args: tuple = (q, k, v, k_cache, v_cache, meta, query_meta, query_positions)
    if sinks is not None:
        args += (sinks,)
    if mesh is None:
        return local(*args)
    heads = P(None, TP_AXIS, None)
    k_spec, v_spec = cache_specs(impl.layout, k_cache, True), cache_specs(impl.layout, v_cache, False)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, heads, heads, k_spec, v_spec, P(), P(), P()) + ((P(TP_AXIS),) if sinks is not None else ()),
        out_specs=(k_spec, v_spec, heads),
        check_vma=False,
    )
    return sharded(*args)


__all__ = [
    "AttentionImpl",
    "BACKENDS",
    "REFERENCE",
    "TP_AXIS",
    "attend",
    "cache_spec",
    "cache_specs",
    "select_attention",
    "write_and_attend",
]
