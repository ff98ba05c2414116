"""Tensor parallelism: the model's weights and KV cache over a one-axis ``tp`` mesh.

Megatron-style sharding, expressed as ``NamedSharding``s on the weights and
the cache, with XLA's GSPMD partitioning the dense layers of the one jitted
program per step bucket and a ``shard_map`` around each layer's cache write
and attention (``jaxserve.kernels.backends.write_and_attend``):

- ``wqkv`` ``[(H + 2 KVH) D, E]``: column-parallel, rows split over ``tp``.
  The fused rows are first reordered *group-major*: device ``i`` holds the
  rows of query heads ``i H/N .. (i+1) H/N - 1`` followed by those of kv
  heads ``i KVH/N .. (i+1) KVH/N - 1`` (keys, then values), so its matmul
  yields exactly the q, k and v of its own heads, and grouped-query pairs
  (head ``h`` reads kv head ``h // G``) stay on one device. ``bqkv``
  likewise.
- ``wo`` ``[E, H D]``: row-parallel (its input axis split); GSPMD sums the
  partial products (an all-reduce) into the replicated residual stream.
- ``w_gate_up`` ``[2 I, E]``: column-parallel, reordered group-major (gate
  then up rows per device) like ``wqkv``; ``w_down`` ``[E, I]``
  row-parallel.
- Mixture-of-experts stacks (``jaxserve.models.moe``): each expert split
  the way the dense MLP is, every device holding every expert's ``1/N`` of
  its intermediate width: ``experts_gate_up`` ``[X, 2I, E]`` on its rows
  (axis 1, group-major: each device its gate rows then the matching up
  rows), ``experts_b_gate_up`` likewise, ``experts_down`` ``[X, E, I]`` on
  its input axis. The router, ``b_router`` and ``experts_b_down`` are
  replicated. So every device routes every token the same way and computes
  every (token, expert) pair on its slice, a ``shard_map`` whose one
  ``psum`` adds the slices. Chosen over experts on devices (expert
  parallelism) because the work then does not depend on routing: with a
  whole expert per device, a decode step's ``k`` experts land unevenly (one
  device 5 of 8, another 3) and the step waits for the busiest; a slice of
  every expert gives each device ``1/N`` of every step, and the weight bytes
  each reads are the same ``1/N`` either way. The price is ``I / N`` rows per
  expert per device (768 / 4 = 192 for Qwen3-30B-A3B: still whole blocks of
  32 for quantized weights).
- Embedding, ``lm_head``, the norms and the row-parallel biases:
  replicated. ``lm_head`` stays whole on purpose: the sampler (sort-based
  top-k/top-p, penalties, log-probabilities) works on whole vocabulary rows
  with no gather, and every device computes the same tokens. Vocabulary
  sharding would cut each device's ``lm_head`` reads by ``N`` at the price
  of a gather in the sampler; not done.
- KV cache: every layer's arrays split on their kv-heads axis
  (``backends.cache_spec``), created sharded and donated step to step.

A size that does not divide the kv heads (nor, then, the query heads and
the intermediate size) is refused with ``ValueError``. The weights are
loaded on the first device and then placed, so the whole model must fit
there once (fine for what one host's devices hold; a per-shard loader is
the next step for bigger models).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.kernels.backends import TP_AXIS
from jaxserve.models.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int, num_devices: int | None = None) -> None:
    """Raise ``ValueError`` unless ``size`` devices can split this model."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    kvh = config.num_key_value_heads
    if kvh % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide num_key_value_heads={kvh}: "
            f"each device must hold whole kv heads (use a divisor of {kvh})"
        )
    if config.num_attention_heads % size:  # implied by the kv heads; kept for odd configs
        raise ValueError(
            f"tensor_parallel_size={size} does not divide num_attention_heads={config.num_attention_heads}"
        )
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size={config.intermediate_size}")
    if config.moe is not None and config.moe.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the experts' intermediate_size={config.moe.intermediate_size}"
        )
    if num_devices is None:
        num_devices = jax.device_count()
    if size > num_devices:
        raise ValueError(
            f"tensor_parallel_size={size} exceeds the {num_devices} {jax.default_backend()} device(s) available"
        )


def tensor_parallel_mesh(config: ModelConfig, size: int, devices=None) -> Mesh | None:
    """A one-axis ``tp`` mesh over the first ``size`` devices (``None`` for 1)."""
    devices = list(jax.devices() if devices is None else devices)
    check_tensor_parallel(config, size, len(devices))
    if size == 1:
        return None
    return Mesh(np.array(devices[:size]), (TP_AXIS,), axis_types=(AxisType.Auto,))


def _group_major(parts: list[int], groups: int) -> np.ndarray:
    """Row order that puts the ``i``-th ``1/groups`` of every part, in turn, in group ``i``."""
    starts = np.cumsum([0] + parts[:-1])
    order = []
    for g in range(groups):
        for start, size in zip(starts, parts):
            step = size // groups
            order.append(np.arange(start + g * step, start + (g + 1) * step))
    return np.concatenate(order)


#: per-layer parameter -> (PartitionSpec, fused parts to reorder group-major,
#: or None, the axis they are on); a weight not listed (norms, q/k norms,
#: the router) is replicated
def _layer_plan(config: ModelConfig) -> dict[str, tuple[P, list[int] | None, int]]:
    c = config
    qkv = [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim]
    gate_up = [c.intermediate_size, c.intermediate_size]
    plan = {
        "wqkv": (P(TP_AXIS, None), qkv, 0),
        "bqkv": (P(TP_AXIS), qkv, 0),
        "wo": (P(None, TP_AXIS), None, 0),
        "sinks": (P(TP_AXIS), None, 0),  # per query head: each device its own heads'
        "w_gate_up": (P(TP_AXIS, None), gate_up, 0),
        "b_gate_up": (P(TP_AXIS), gate_up, 0),
        "w_down": (P(None, TP_AXIS), None, 0),
    }
    if c.moe is not None:  # each expert split as the dense MLP is (see the module docstring)
        experts = [c.moe.intermediate_size, c.moe.intermediate_size]
        plan["experts_gate_up"] = (P(None, TP_AXIS, None), experts, 1)
        plan["experts_b_gate_up"] = (P(None, TP_AXIS), experts, 1)
        plan["experts_down"] = (P(None, None, TP_AXIS), None, 0)
    return plan


def shard_model(model, mesh: Mesh) -> None:
    """Reorder the fused weights group-major and place every weight with its
    ``NamedSharding`` on ``mesh`` (in place); the model then runs its forward
    pass tensor-parallel (``model.mesh``)."""
    size = mesh.shape[TP_AXIS]
    check_tensor_parallel(model.config, size, mesh.devices.size)
    plan = _layer_plan(model.config)
    replicated = NamedSharding(mesh, P())
    for layer in model.layers:
        for name in layer.NAMES:
            param = getattr(layer, name)
            if param is None:
                continue
            spec, parts, axis = plan.get(name, (P(), None, 0))
            value = param[...]
            if parts is not None:
                value = jax.numpy.take(value, _group_major(parts, size), axis=axis)
            param.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    for param in (model.embed, model.norm, model.lm_head):
        if param is not None:
            param.set_value(jax.device_put(param[...], replicated))
    model.mesh = mesh


def split_fused(x: jax.Array, parts: list[int], groups: int) -> list[jax.Array]:
    """Split group-major fused rows ``x`` ``[sum(parts), T]`` back into the
    parts in their original order (``groups == 1``: plain slices)."""
    if groups == 1:
        out, start = [], 0
        for size in parts:
            out.append(x[start : start + size])
            start += size
        return out
    grouped = x.reshape(groups, -1, *x.shape[1:])
    out, start = [], 0
    for size in parts:
        step = size // groups
        out.append(grouped[:, start : start + step].reshape(size, *x.shape[1:]))
        start += step
    return out


__all__ = ["check_tensor_parallel", "shard_model", "split_fused", "tensor_parallel_mesh"]
