"""Mixture-of-experts MLP: routing and the experts, for the layers a config makes MoE.

A MoE layer holds, instead of the dense MLP's weights:

``router``              ``[X, E]``      one logit per expert (``b_router`` ``[X]``: gpt-oss)
``experts_gate_up``     ``[X, 2I, E]``  each expert's gate rows, then its up rows
``experts_b_gate_up``   ``[X, 2I]``     (gpt-oss)
``experts_down``        ``[X, E, I]``
``experts_b_down``      ``[X, E]``      (gpt-oss)

(``X`` experts of width ``I = MoEConfig.intermediate_size``, hidden ``E``,
Hugging Face's ``[out, in]`` per expert.) With ``--quantization`` the two
stacks are ``QuantizedWeight`` stacks (``jaxserve.models.quant``: the
blocks of each expert's rows, GGUF's Q8_0/Q4_0/Q4_1); the router stays
float32. :func:`route` picks each token's ``top_k`` experts and their
weights as the family does; :func:`moe_mlp` runs every token through its
experts only, the experts computed grouped: the ``T * k`` (token, expert)
pairs sorted by expert, each expert's matrices applied once to the rows of
the tokens routed to it. Nothing computes a token against an expert it was
not routed to, and no expert's weights are copied per token.

Three ways to run the groups, one result (tests/test_moe.py):

- the C++ CPU kernel (``jaxserve/kernels/cpu/moe_cpu.cc``; float32 or
  quantized stacks, one device): routes (so a token's choice never depends
  on how XLA sums a batch's logits), sorts the pairs, computes gate/up, the
  activation and down per expert over its rows, and adds each token's k
  results in its routing order, one XLA custom call per layer;
- pure JAX, ``jax.lax.ragged_dot_general`` over the sorted rows (TPU with
  float weights): the grouped GEMM JAX offers. How it lowers decides
  whether it is grouped: on TPU to XLA's native ragged dot; elsewhere it is
  expanded to a *dense* dot over every group (JAX's CPU lowering masks the
  rows into ``[X, P, E]`` and contracts over all experts; XLA's GPU
  rewriter does the same unless cuDNN's ragged-dot fusion takes it, which
  needs bf16/f16 and the experimental flag
  ``--xla_gpu_experimental_use_ragged_dot_fusion``). So it serves TPU only;
- pure JAX, a loop over (expert, tile of its rows) visits (every other
  backend, quantized stacks, tensor parallel): the sorted rows cut into
  tiles of ``B`` rows per expert (``B`` about the mean rows per expert), one
  ``lax.while_loop`` step per tile that holds rows, in sorted order, each
  step one expert's gate/up, activation and down on its tile. Visits are
  at most ``P / B + min(X, P)``; a tile running past its expert's rows
  computes rows of the next experts that their own visits, later, write
  over.

Tensor parallel (``mesh``): every device holds every expert with a
``1/N`` slice of its intermediate width (``jaxserve.models.sharding``), so
each device computes every pair on its slice and one ``psum`` adds the
partial outputs; routing is replicated.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.backends import TP_AXIS
from jaxserve.models import quant
from jaxserve.models.config import ModelConfig, MoEConfig

PARAM_NAMES = ("router", "b_router", "experts_gate_up", "experts_b_gate_up", "experts_down", "experts_b_down")


def param_shapes(c: ModelConfig, index: int) -> dict[str, tuple[int, ...] | None]:
    """The MoE weights of layer ``index`` (None for those it does not have)."""
    shapes: dict[str, tuple[int, ...] | None] = dict.fromkeys(PARAM_NAMES)
    if c.moe is None or not c.moe.is_moe_layer(index):
        return shapes
    m, E = c.moe, c.hidden_size
    X, I = m.num_experts, m.intermediate_size
    shapes["router"] = (X, E)
    shapes["experts_gate_up"] = (X, 2 * I, E)
    shapes["experts_down"] = (X, E, I)
    if m.router_bias:
        shapes["b_router"] = (X,)
    if m.expert_bias:
        shapes["experts_b_gate_up"] = (X, 2 * I)
        shapes["experts_b_down"] = (X, E)
    return shapes


def route(logits: jax.Array, m: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and weights from router logits ``[T, X]``:
    ``(ids int32 [T, k], weights float32 [T, k])``."""
    logits = logits.astype(jnp.float32)
    if m.router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, m.top_k)
        return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, m.top_k)
    if m.normalize_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def expert_activation(gate: jax.Array, up: jax.Array, m: MoEConfig) -> jax.Array:
    if m.activation == "swiglu_oss":
        limit = jnp.float32(m.swiglu_limit)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(jnp.float32(m.swiglu_alpha) * gate)
    return jax.nn.silu(gate) * up


def router_logits(xt: jax.Array, w: dict[str, Any]) -> jax.Array:
    """float32 router logits ``[T, X]`` of token-major ``xt`` ``[T, E]``."""
    logits = xt.astype(jnp.float32) @ w["router"].astype(jnp.float32).T
    if w["b_router"] is not None:
        logits = logits + w["b_router"].astype(jnp.float32)
    return logits


def moe_mlp(
    x: jax.Array,
    w: dict[str, Any],
    c: ModelConfig,
    *,
    cpu_kernel: bool = False,
    mesh=None,
    token_mask: jax.Array | None = None,
) -> jax.Array:
    """The MoE MLP of feature-major ``x`` ``[E, T]``: float32 ``[E, T]``.

    Each token's ``top_k`` experts only, grouped by expert (see the module
    docstring): the C++ kernel with ``cpu_kernel`` where it serves the
    weights, the pure-JAX groups otherwise; with a tensor-parallel ``mesh``
    each device its slice of every expert. ``token_mask`` (bool ``[T]``,
    optional): the tokens whose output is read; the others (a step's
    padding) may come back as anything. The C++ kernel leaves them out:
    padding tokens share one input, so they would add up to ``top_k``
    experts' weights to every layer's reads (in a decode step of 2
    sequences padded to 8 tokens, half as many again as the real tokens'
    16 experts)."""
    m = c.moe
    assert m is not None
    if mesh is None and cpu_kernel and cpu_kernels.moe_serves(w["experts_gate_up"], w["experts_down"], x):
        return cpu_kernels.moe_cpu(
            x,
            w["router"],
            w["b_router"],
            w["experts_gate_up"],
            w["experts_down"],
            w["experts_b_gate_up"],
            w["experts_b_down"],
            top_k=m.top_k,
            token_mask=token_mask,
            routing=m.router,
            normalize_topk=m.normalize_topk,
            activation=m.activation,
            swiglu_limit=m.swiglu_limit,
            swiglu_alpha=m.swiglu_alpha,
        )
    xt = x.astype(jnp.float32).T  # [T, E]
    ids, weights = route(router_logits(xt, w), m)
    if mesh is not None and mesh.shape[TP_AXIS] > 1:
        return _tensor_parallel(xt, ids, weights, w, m, mesh).T
    return grouped_experts(xt, ids, weights, w, m).T


# ---------------------------------------------------------------- pure JAX


def grouped_experts(
    xt: jax.Array, ids: jax.Array, weights: jax.Array, w: dict[str, Any], m: MoEConfig, impl: str | None = None
) -> jax.Array:
    """Token-major ``[T, E]`` float32: each token's experts' outputs weighted
    by its routing weights and added in routing order, the experts run
    grouped over the pairs sorted by expert. ``impl``: ``ragged``
    (``ragged_dot_general``) or ``loop`` (visits over expert tiles); None
    picks by backend and weights (:func:`default_impl`)."""
    T, k = ids.shape
    gate_up = w["experts_gate_up"]
    X = gate_up.shape[0]
    flat = ids.reshape(-1)  # pair p = t * k + j
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted row -> pair
    sizes = jnp.zeros((X,), jnp.int32).at[flat].add(1)
    xs = xt.astype(jnp.float32)[order // k]  # [P, E] rows grouped by expert
    impl = impl or default_impl(gate_up)
    run = _ragged_mlps if impl == "ragged" else _looped_mlps
    ys = run(xs, flat[order], sizes, w, m)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    pairs = ys[inverse].reshape(T, k, -1)  # back in token order, k per token
    return jnp.sum(pairs * weights[..., None].astype(jnp.float32), axis=1)


def default_impl(gate_up: Any) -> str:
    """``ragged`` where ``ragged_dot_general`` is a grouped GEMM (TPU, float
    weights), ``loop`` elsewhere (see the module docstring)."""
    return "ragged" if jax.default_backend() == "tpu" and not quant.is_quantized(gate_up) else "loop"


def _bias(b: jax.Array | None, experts: jax.Array) -> jax.Array | float:
    return 0.0 if b is None else b[experts].astype(jnp.float32)


def _ragged_mlps(xs, experts, sizes, w, m):
    """Each sorted row through its expert with two ``ragged_dot_general``s."""
    gate_up, down = w["experts_gate_up"], w["experts_down"]
    I = gate_up.shape[1] // 2
    # rhs [X, O, I]: group axis 0, contract its last axis with the rows' features
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    gu = jax.lax.ragged_dot_general(xs.astype(gate_up.dtype), gate_up, sizes, dims, preferred_element_type=jnp.float32)
    gu = gu + _bias(w["experts_b_gate_up"], experts)
    act = expert_activation(gu[:, :I], gu[:, I:], m)
    y = jax.lax.ragged_dot_general(act.astype(down.dtype), down, sizes, dims, preferred_element_type=jnp.float32)
    return y + _bias(w["experts_b_down"], experts)


def tile_rows(pairs: int, experts: int) -> int:
    """Rows per visit of :func:`_looped_mlps`: the power of two at or above
    the mean rows per expert, 1 to 64 (one row per visit in a one-token
    decode step, where every pair has its own expert)."""
    mean = pairs / max(experts, 1)
    return int(min(64, max(1, 2 ** math.ceil(math.log2(max(mean, 1.0))))))


def _expert_matmul(wx: Any, g: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``[B, in]`` through expert ``g``'s ``[out, in]``: float32 ``[B, out]``."""
    if quant.is_quantized(wx):
        return quant.matmul(wx.rows(g), rows.T).T
    wg = jax.lax.dynamic_index_in_dim(wx, g, axis=0, keepdims=False)
    return jax.lax.dot_general(rows.astype(wg.dtype), wg, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _looped_mlps(xs, experts, sizes, w, m):
    """Each sorted row through its expert, one loop step per tile of an
    expert's rows (see the module docstring)."""
    gate_up, down = w["experts_gate_up"], w["experts_down"]
    b_gate_up, b_down = w["experts_b_gate_up"], w["experts_b_down"]
    P, E = xs.shape
    X = sizes.shape[0]
    I = gate_up.shape[1] // 2
    B = tile_rows(P, X)
    tiles = (sizes + B - 1) // B
    ends = jnp.cumsum(tiles)
    offsets = jnp.cumsum(sizes) - sizes
    visits = -(-P // B) + min(X, P)  # static bound on sum(tiles)
    v = jnp.arange(visits, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(ends, v, side="right"), X - 1).astype(jnp.int32)
    first_row = offsets[expert] + (v - (ends[expert] - tiles[expert])) * B
    xs = jnp.pad(xs, ((0, B), (0, 0)))

    def visit(i, out):
        g, r = expert[i], first_row[i]
        rows = jax.lax.dynamic_slice_in_dim(xs, r, B, axis=0)
        gu = _expert_matmul(gate_up, g, rows)
        if b_gate_up is not None:
            gu = gu + b_gate_up[g].astype(jnp.float32)
        act = expert_activation(gu[:, :I], gu[:, I:], m)
        y = _expert_matmul(down, g, act)
        if b_down is not None:
            y = y + b_down[g].astype(jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, y, r, axis=0)

    out = jax.lax.fori_loop(0, ends[-1], visit, jnp.zeros((P + B, E), jnp.float32))
    return out[:P]


# ---------------------------------------------------------------- tensor parallel


def _tensor_parallel(xt, ids, weights, w, m, mesh) -> jax.Array:
    """Every device runs every pair on its slice of each expert's
    intermediate width (gate/up rows and down columns, ``sharding.py``);
    one ``psum`` adds the slices' outputs. ``b_down`` is added once,
    outside the sum."""
    specs = {
        "experts_gate_up": P(None, TP_AXIS, None),
        "experts_down": P(None, None, TP_AXIS),
        "experts_b_gate_up": P(None, TP_AXIS),
    }
    specs = {k: v for k, v in specs.items() if w[k] is not None}
    local_w = {k: w[k] for k in specs}

    def local(xt, ids, weights, lw):
        lw = {"experts_b_gate_up": None, **lw, "experts_b_down": None}
        return jax.lax.psum(grouped_experts(xt, ids, weights, lw, m), TP_AXIS)

    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P(), specs),
        out_specs=P(),
        check_vma=False,
    )(xt, ids, weights, local_w)
    if w["experts_b_down"] is not None:
        b = w["experts_b_down"].astype(jnp.float32)[ids]  # [T, k, E]
        out = out + jnp.sum(b * weights[..., None].astype(jnp.float32), axis=1)
    return out


__all__ = [
    "PARAM_NAMES",
    "default_impl",
    "expert_activation",
    "grouped_experts",
    "moe_mlp",
    "param_shapes",
    "route",
    "router_logits",
    "tile_rows",
]
