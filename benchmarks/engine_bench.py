"""Set-up shared by the benchmarks that drive a ``ModelRunner`` directly
(``trace_step.py``, ``cpu_matmul_ab.py``, ``matmul_kernel_ab.py``) or time
compiled programs against each other (``attention_kernel_ab.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def load_on_default_kernel(model: str, quantization: str | None = None) -> tuple[Any, Any, str]:
    """A preset's (or folder's) weights (``quantization``: ``int8``/``int4``
    as ``--quantization`` loads them) on the attention kernel the engine
    picks by default for a float32 cache with 64-token blocks: returns
    ``(loaded, attention_impl, reason)``."""
    import jax.numpy as jnp

    from jaxserve.kernels.backends import select_attention
    from jaxserve.models.loader import load_model
    from jaxserve.presets import resolve_model

    loaded = load_model(resolve_model(model), quantization=quantization)
    cfg = loaded.config
    impl, reason = select_attention(
        "auto",
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads,
        block_size=64,
        sliding_window=cfg.effective_sliding_window,
        cache_dtype=jnp.float32,
    )
    loaded.model.attention = impl
    return loaded, impl, reason


def alternate(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each ``runs[name]()`` over ``repeats`` rounds, the order of
    the runs reversed every other round (so neither always goes first)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t)
    return times
