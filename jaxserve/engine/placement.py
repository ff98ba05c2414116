"""Where a freshly loaded model runs: the attention kernel, the
tensor-parallel mesh, and JAX's persistent compilation cache.

Done once, before the engine builds its runner (``Engine.__init__``); kept
apart from the engine's step because none of it changes while it serves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
import structlog
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from jaxserve.engine.args import EngineArgs

log = structlog.get_logger(__name__)


def enable_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at ``path`` (default under
    ``$JAXSERVE_CACHE_DIR`` or ``~/.cache/jaxserve``); ``""`` disables it."""
    if path == "":
        return
    if path is None:
        base = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
        path = os.path.join(base, "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@contextlib.contextmanager
def persistent_cache(enabled: bool) -> Iterator[None]:
    """Compilations inside neither read nor write the persistent compilation
    cache when ``enabled`` is False (jax memoizes whether the cache is on,
    hence the resets around the switch); a no-op when True."""
    if enabled:
        yield
        return
    was = jax.config.values["jax_enable_compilation_cache"]
    reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        reset_cache()


def place_model(model, args: EngineArgs, cache_dtype):
    """Kernel choice and tensor-parallel placement of a freshly loaded model
    (``EngineArgs.attention_backend``, ``EngineArgs.tensor_parallel_size``);
    returns ``(AttentionImpl, mesh or None)``. ``cache_dtype``: the KV
    cache's (``EngineArgs.resolve_kv_cache_dtype``: the kernel choice
    depends on it). Refuses a tensor-parallel size that does not divide the
    kv heads."""
    from jaxserve.kernels.backends import select_attention
    from jaxserve.models.sharding import shard_model, tensor_parallel_mesh

    cfg = model.config
    mesh = tensor_parallel_mesh(cfg, args.tensor_parallel_size)
    attention, reason = select_attention(
        args.attention_backend,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads,
        block_size=args.block_size,
        sliding_window=next((w for w in cfg.layer_windows if w is not None), None),
        logit_softcap=cfg.attn_logit_softcap,
        sinks=cfg.attention_sinks,
        cache_dtype=cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    model.attention = attention
    if mesh is not None:
        shard_model(model, mesh)
    log.info(
        "engine.placement",
        attention=attention.kernel,
        cache_layout=attention.layout,
        cache_dtype=str(cache_dtype),
        reason=reason,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    return attention, mesh
