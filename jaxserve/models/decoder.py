"""The decoder every family runs: a Flax NNX module over the paged KV cache.

One forward pass for all families (:mod:`jaxserve.models.families`), built
from the blocks in :mod:`jaxserve.models.blocks` and
:mod:`jaxserve.models.moe` and switched by the
:class:`~jaxserve.models.config.ModelConfig` a family reads: which norms a
layer has and where (Llama's two pre-norms, Gemma's four, OLMo 2's two
post-norms), q/k norms, per-layer sliding windows and rope (or none),
partial rotary, attention soft-capping and sinks, a dense GLU MLP or a
mixture of experts, the embedding scale and final logit soft-capping. A
switch the config leaves at its default (Llama's) adds nothing to the
compiled program.

Each layer has its own weight arrays and its own pair of KV cache arrays,
and the forward pass is a Python loop over the layers (unrolled at trace
time). A ``lax.scan`` over stacked ``[L, ...]`` weights and cache compiles
faster but makes XLA copy each layer's slice of the stacked arrays before a
matmul can use it (weights and, for the block-major decode attention, the
layer's whole cache); per-layer arrays are read in place (see
``kv_cache.py``). Compile time grows with depth instead (about 2-3x for 8
layers), which the persistent compilation cache absorbs on restarts.

Fused projections: a layer's ``wqkv`` is ``[(H + 2*KVH) * head_dim, hidden]``
(q, k, v rows in that order) and its ``w_gate_up`` ``[2 * intermediate,
hidden]`` (gate then up). Linear weights are stored ``[out, in]``, as Hugging Face
stores them, and ``lm_head`` is ``[vocab, hidden]`` like the embedding.

Feature-major activations: inside the layers the residual stream is
``[hidden, T]`` and every projection is ``W @ x`` (``[out, in] @ [in, T]``).
On the CPU the matmul libraries run this orientation faster for the small
token counts of decode steps (measured for llama-56m's 8 layers at 64 tokens:
20.4 ms vs 23.2 ms for ``x @ W``; equal at 512 tokens). Attention, RoPE and
the KV writes work on small ``[T, heads, head_dim]`` transposes, except that
the C++ CPU kernel takes the queries as the projection leaves them and
rotates them itself (float32 weights, one device): XLA's transposing,
rotating fusion for q cost about as much as that attention in prefill steps.

Numerics: weights in ``dtype`` (float32 or bfloat16); matmuls in that dtype
with float32 accumulation; RMSNorm, RoPE, softmax and the residual stream in
float32. The returned hidden state is float32.

Quantized weights (``--quantization``, ``jaxserve.models.quant``): any linear
weight, the embedding and ``lm_head`` may hold a ``QuantizedWeight`` instead
of an array; ``_mm`` and the vocabulary projection dispatch on the type (the
C++ kernels where they serve, ``quant.matmul`` otherwise) and the embedding
lookup gathers quantized rows and dequantizes them. ``dtype`` stays the
float type of the norms, the activations and the KV cache.

Two static attributes, set by the engine before it splits the model, choose
how a layer attends: ``attention`` (``jaxserve.kernels.backends.AttentionImpl``:
the pure-JAX reference by default, or a shipped Pallas kernel over the
``heads`` cache layout) and ``mesh`` (tensor parallelism over its ``tp``
axis, ``jaxserve.models.sharding``; ``None``: one device). The cache handed
to ``__call__`` must be in ``attention.layout``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.backends import REFERENCE, TP_AXIS, write_and_attend
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models import moe, quant
from jaxserve.models.blocks import gated_activation, head_rms_norm, rms_norm, softcap
from jaxserve.models.config import NORM_PLACES, ModelConfig, RopeConfig
from jaxserve.models.rope import apply_rope, inv_frequencies, long_rope_tokens, longrope_cos_sin, rope_cos_sin
from jaxserve.models.sharding import split_fused

_INIT_STD = 0.02


def _mm(w: jax.Array | quant.QuantizedWeight, x: jax.Array, cpu_kernel: bool = False) -> jax.Array:
    """``w @ x`` (``[out, in] @ [in, T]``) in the weight dtype with float32
    accumulation; float32 result. With ``cpu_kernel``, the C++ kernels take
    the float32 shapes where they pay (:func:`_cpu_matmul`). A quantized
    ``w`` goes to the quantized kernels (:func:`_quantized_mm`)."""
    if quant.is_quantized(w):
        return _quantized_mm(w, x, cpu_kernel)
    kernel = _cpu_matmul(w, x) if cpu_kernel else None
    if kernel is not None:
        return kernel(w, x)
    return jnp.dot(w, x.astype(w.dtype), preferred_element_type=jnp.float32)


def _cpu_matmul(w: jax.Array, x: jax.Array):
    """The C++ kernel that pays for ``w @ x``, or ``None`` (XLA's matmul): up
    to 16 tokens the matrix-vector kernel (weights streamed once), 32-64
    tokens the register-tiled matmul (decode steps of dozens of sequences)."""
    if cpu_kernels.matvec_pays(w, x):
        return cpu_kernels.matvec_cpu
    if cpu_kernels.matmul_pays(w, x):
        return cpu_kernels.matmul_cpu
    return None


def _quantized_mm(w: quant.QuantizedWeight, x: jax.Array, cpu_kernel: bool) -> jax.Array:
    """``dequantize(w) @ x`` with per-token int8 activations: the C++ kernel
    (``qmatmul_cpu.cc``) on the CPU kernels' path, ``quant.matmul`` (pure
    JAX: GPU, TPU, ``JAXSERVE_CPU_KERNEL=0``) otherwise; the same integer
    dots either way."""
    if cpu_kernel and cpu_kernels.qmatmul_serves(w, x):
        return cpu_kernels.qmatmul_cpu(w, x)
    return quant.matmul(w, x.astype(jnp.float32))


def _value(p: nnx.Param):
    """A parameter's array, or its ``QuantizedWeight``."""
    v = p.get_value()
    return v if quant.is_quantized(v) else p[...]


def _add_bias(x: jax.Array, b: jax.Array | None) -> jax.Array:
    return x if b is None else x + b.astype(jnp.float32)[:, None]


def _qkv_kv_token_major(w: dict, x: jax.Array, q_size: int, kv_size: int) -> tuple[jax.Array, ...]:
    """The fused projection of one device's layer (rows q, k, v) as q
    feature-major ``[q_size, T]`` and k, v token-major ``[T, kv_size]``,
    biases added; float32 weights (the CPU kernels' path)."""
    wqkv, b = w["wqkv"], w["bqkv"]
    q = _add_bias(_mm(wqkv[:q_size], x), None if b is None else b[:q_size])
    kv = jnp.dot(x.T, wqkv[q_size:].T, preferred_element_type=jnp.float32)
    if b is not None:
        kv = kv + b[q_size:].astype(jnp.float32)[None, :]
    return q, kv[:, :kv_size], kv[:, kv_size:]


def _param(rngs: nnx.Rngs, shape, dtype, init: str) -> nnx.Param:
    if init == "ones":
        return nnx.Param(jnp.ones(shape, dtype))
    if init == "zeros":
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD).astype(dtype))


class DecoderLayer(nnx.Module):
    """One decoder layer's weights; which exist is the config's business
    (norms by place, biases, q/k norms, sinks, a dense MLP or experts)."""

    #: every weight a layer may hold (:meth:`arrays` gives each, or None)
    NAMES = (
        "attn_norm",
        "q_norm",
        "k_norm",
        "wqkv",
        "bqkv",
        "wo",
        "bo",
        "sinks",
        "attn_out_norm",
        "ffn_norm",
        "w_gate_up",
        "b_gate_up",
        "w_down",
        "b_down",
        "ffn_out_norm",
        *moe.PARAM_NAMES,
    )

    def __init__(self, config: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
        c = config
        E, I, D = c.hidden_size, c.intermediate_size, c.head_dim
        H, KVH = c.num_attention_heads, c.num_key_value_heads
        qkv_out = (H + 2 * KVH) * D
        norm_init = "zeros" if c.norm_weight_offset else "ones"  # the stored weight is w - offset

        def maybe(cond: bool, shape: tuple[int, ...], init: str) -> nnx.Param | None:
            return _param(rngs, shape, dtype, init) if cond else None

        for place in NORM_PLACES:
            setattr(self, f"{place}_norm", maybe(place in c.norms, (E,), norm_init))
        qn, kn = ((H * D,), (KVH * D,)) if c.qk_norm == "full" else ((D,), (D,))
        self.q_norm = maybe(c.qk_norm is not None, qn, norm_init)
        self.k_norm = maybe(c.qk_norm is not None, kn, norm_init)
        self.wqkv = _param(rngs, (qkv_out, E), dtype, "normal")
        self.bqkv = maybe(c.qkv_bias, (qkv_out,), "zeros")
        self.wo = _param(rngs, (E, H * D), dtype, "normal")
        self.bo = maybe(c.o_bias, (E,), "zeros")
        self.sinks = maybe(c.attention_sinks, (H,), "zeros")
        dense = not c.is_moe_layer(index)
        self.w_gate_up = maybe(dense, (2 * I, E), "normal")
        self.b_gate_up = maybe(dense and c.mlp_bias, (2 * I,), "zeros")
        self.w_down = maybe(dense, (E, I), "normal")
        self.b_down = maybe(dense and c.mlp_bias, (E,), "zeros")
        for name, shape in moe.param_shapes(c, index).items():
            setattr(self, name, None if shape is None else _param(rngs, shape, dtype, _init_of(name)))

    def arrays(self) -> dict[str, Any]:
        """The raw weight arrays: ``jax.Array``, ``QuantizedWeight`` for a
        quantized matrix, None for a weight this layer does not have."""
        out = {}
        for n in self.NAMES:
            p = getattr(self, n)
            out[n] = None if p is None else _value(p)
        return out


def _init_of(name: str) -> str:
    return "zeros" if name.startswith("b_") or "_b_" in name else "normal"


class CausalLM(nnx.Module):
    """Every family's causal LM over the paged KV cache (the config says what
    each layer has; see the module docstring).

    ``model(input_ids[T], positions[T], kv_cache, meta[, output_rows[R]]) -> (hidden[T or R, E] float32, kv_cache)``
    and ``model.compute_logits(hidden[N, E]) -> float32[N, vocab]``.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        c = config
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), self.dtype, "normal")
        self.layers = nnx.List([DecoderLayer(c, i, dtype=self.dtype, rngs=rngs) for i in range(c.num_hidden_layers)])
        self.norm = _param(rngs, (c.hidden_size,), self.dtype, "zeros" if c.norm_weight_offset else "ones")
        if c.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(rngs, (c.vocab_size, c.hidden_size), self.dtype, "normal")
        #: attention kernel choice (static; see the module docstring)
        self.attention = REFERENCE
        #: tensor-parallel mesh (static), set by ``jaxserve.models.sharding.shard_model``
        self.mesh = None

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.shape[TP_AXIS])

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        output_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """The final-norm hidden state ``[T, E]`` of every token, or with
        ``output_rows`` (int32 ``[R]``) of those token rows only, ``[R, E]``
        in that order.

        When ``R < T`` the last layer computes its keys and values for every
        token (the cache needs them) but its queries, attention, output
        projection and MLP only for the wanted rows: nothing reads the other
        tokens' last-layer output. In a prefill step, where a few rows per
        prompt are sampled or scored, that is most of one layer's work
        (about 1/L of the step) saved exactly. Otherwise the rows are picked
        from the full pass."""
        c = self.config
        T = input_ids.shape[0]
        H, KVH, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_size, kv_size = H * D, KVH * D
        eps, offset = c.rms_norm_eps, c.norm_weight_offset
        dtype = self.dtype
        block_size = kv_cache.block_size
        cache_dtype = kv_cache.dtype
        scale = c.attn_scale if c.attn_scale is not None else 1.0 / math.sqrt(D)
        rotary = c.rotary_dim or D
        windows = c.layer_windows
        attention, mesh, groups = self.attention, self.mesh, self.tensor_parallel_size
        if kv_cache.layout != attention.layout:
            raise ValueError(
                f"the KV cache is in the {kv_cache.layout!r} layout but attention kernel "
                f"{attention.kernel!r} reads {attention.layout!r}"
            )

        positions = positions.astype(jnp.int32)
        tables: dict[RopeConfig, tuple[jax.Array, jax.Array]] = {}  # cos/sin per distinct rope (Gemma 3 has two)

        def rope_tables(rope: RopeConfig) -> tuple[jax.Array, jax.Array]:
            if rope not in tables:
                if rope.rope_type == "longrope":  # short or long factors, token by token
                    long = long_rope_tokens(
                        positions,
                        rope.original_max_position_embeddings,
                        meta.token_seq,
                        meta.context_lens,
                        meta.long_rope_from,
                    )
                    tables[rope] = longrope_cos_sin(positions, rope, rotary, long)
                else:
                    tables[rope] = rope_cos_sin(positions, inv_frequencies(rope, rotary), rope.attention_factor)
            return tables[rope]

        embed = _value(self.embed)
        if quant.is_quantized(embed):
            h = quant.embed(embed, input_ids).T  # [E, T]: the rows gathered quantized, then dequantized
        else:
            h = jnp.take(embed, input_ids, axis=0).astype(jnp.float32).T  # [E, T]
        if c.embed_scale is not None:  # rounded to the weight dtype first, as transformers does
            h = h * jnp.asarray(c.embed_scale, dtype).astype(jnp.float32)

        def heads(x: jax.Array, n: int) -> jax.Array:  # [n * D, tokens] -> [tokens, n, D]
            return jnp.transpose(x.reshape(n, D, x.shape[-1]), (2, 0, 1))

        # The C++ kernel takes q as the projection leaves it (feature-major, not
        # rotated): no transposed, rotated copy of q per layer. float32 weights
        # only (the other path rounds q to the weight dtype first), and rope
        # over the whole head. On the same path the dense layers of
        # decode-sized programs use the C++ matmuls (``_cpu_matmul`` says
        # which shapes) and the residual stream's norms the C++ RMSNorm.
        cpu_dense = self._cpu_kernels()

        def norm(x: jax.Array, weight: jax.Array | None) -> jax.Array:  # feature-major; absent norm: x
            if weight is None:
                return x
            if cpu_dense:  # one custom call in place of ordered_sum's tree (rms_norm_cpu.cc says why)
                return cpu_kernels.rms_norm_cpu(x, weight, eps, offset)
            return rms_norm(x, weight, eps, axis=0, offset=offset)

        prune = output_rows is not None and output_rows.shape[0] < T
        mm = functools.partial(_mm, cpu_kernel=cpu_dense)
        last = len(self.layers) - 1
        k_layers, v_layers = list(kv_cache.k), list(kv_cache.v)
        for i, block in enumerate(self.layers):
            w = block.arrays()
            rope = c.layer_rope(i)
            cos_sin = None if rope is None else rope_tables(rope)  # None: a layer without rope
            x = norm(h, w["attn_norm"])
            if (
                cpu_dense
                and not quant.is_quantized(w["wqkv"])
                and (_cpu_matmul(w["wqkv"], x) is None or T > cpu_kernels.MATMUL_QKV_MAX_TOKENS)
            ):
                # XLA's matmul here; it would transpose feature-major keys and
                # values to token-major at ~1 GB/s (3.6 ms a layer at 4096
                # tokens), while a second dot leaves them token-major for free
                q_rows, k_tm, v_tm = _qkv_kv_token_major(w, x, q_size, kv_size)
                k, v = k_tm.reshape(T, KVH, D), v_tm.reshape(T, KVH, D)
            else:
                qkv = _add_bias(mm(w["wqkv"], x), w["bqkv"])
                # tensor parallel: rows are group-major (jaxserve.models.sharding)
                q_rows, k_rows, v_rows = split_fused(qkv, [q_size, kv_size, kv_size], groups)
                k, v = heads(k_rows, KVH), heads(v_rows, KVH)
            if c.qk_norm == "head":
                q_rows = head_rms_norm(q_rows, w["q_norm"], H, eps, offset)
                k = rms_norm(k, w["k_norm"], eps, offset=offset)
            elif c.qk_norm == "full":
                q_rows = rms_norm(q_rows, w["q_norm"], eps, axis=0, offset=offset)
                k = rms_norm(k.reshape(T, kv_size), w["k_norm"], eps, offset=offset).reshape(T, KVH, D)
            if cos_sin is not None:
                k = cpu_kernels.rope_cpu(k, *cos_sin) if cpu_dense else apply_rope(k, *cos_sin)
            q_meta, q_positions, q_cos_sin = meta, positions, cos_sin
            if prune and i == last:  # from here on only the wanted rows
                q_rows, h = q_rows[:, output_rows], h[:, output_rows]
                q_positions = positions[output_rows]
                if cos_sin is not None:
                    q_cos_sin = (cos_sin[0][output_rows], cos_sin[1][output_rows])
                # (no block-major plan: that is for steps of one token per sequence)
                q_meta = dataclasses.replace(
                    meta,
                    token_seq=meta.token_seq[output_rows],
                    slot_mapping=meta.slot_mapping[output_rows],
                    block_owner=None,
                    block_index=None,
                    block_major=None,
                )
            if cpu_dense and q_cos_sin is not None and rotary == D:  # the kernel rotates and scales q as it reads it
                q, q_rope = q_rows, q_cos_sin
            elif q_cos_sin is not None:
                q, q_rope = apply_rope(heads(q_rows, H), *q_cos_sin).astype(dtype), None
            else:
                q, q_rope = heads(q_rows, H).astype(dtype), None
            features: dict[str, Any] = {}  # attention features only some families have
            if c.attn_logit_softcap is not None:
                features["logit_softcap"] = c.attn_logit_softcap
            if w["sinks"] is not None:
                features["sinks"] = w["sinks"].astype(jnp.float32)
            k_layers[i], v_layers[i], attn = write_and_attend(
                attention,
                q,
                k,
                v,
                k_layers[i],
                v_layers[i],
                meta,
                positions,
                block_size=block_size,
                scale=scale,
                sliding_window=windows[i],
                cache_dtype=cache_dtype,
                mesh=mesh,
                query_meta=q_meta,
                query_positions=q_positions,
                query_rope=q_rope,
                **features,
            )
            a = _add_bias(mm(w["wo"], attn.reshape(attn.shape[0], q_size).T), w["bo"])
            h = h + norm(a, w["attn_out_norm"])
            x = norm(h, w["ffn_norm"])
            if w["w_gate_up"] is None:
                # a step's padding tokens belong to a row with an empty context
                real = q_meta.context_lens[q_meta.token_seq] > 0
                m = moe.moe_mlp(x, w, c, cpu_kernel=cpu_dense, mesh=mesh, token_mask=real)
            else:
                gu = _add_bias(mm(w["w_gate_up"], x), w["b_gate_up"])
                if groups == 1:
                    g, u = jnp.split(gu, 2, axis=0)
                else:
                    g, u = split_fused(gu, [c.intermediate_size, c.intermediate_size], groups)
                m = _add_bias(mm(w["w_down"], gated_activation(g, u, c.hidden_act)), w["b_down"])
            h = h + norm(m, w["ffn_out_norm"])

        # Token-major for the caller. The barrier keeps XLA from folding this
        # transpose into a later vocabulary matmul: a dot contracting its
        # left operand's first dimension has no bfloat16 kernel on the CPU
        # ("Unsupported element type for DotThunk: BF16 x BF16 = F32").
        if output_rows is not None and not prune:
            h = h[:, output_rows]
        h = jax.lax.optimization_barrier(norm(h, self.norm[...]).T)
        return h, kv_cache.replace(k=k_layers, v=v_layers)

    def output_embedding(self) -> jax.Array | quant.QuantizedWeight:
        """The ``[vocab, hidden]`` matrix of the vocabulary projection (a
        ``QuantizedWeight`` in a quantized model)."""
        return _value(self.embed) if self.lm_head is None else _value(self.lm_head)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits ``[N, vocab]`` for hidden states ``[N, hidden_size]``."""
        w = self.output_embedding()
        if quant.is_quantized(w):
            logits = _mm(w, hidden.T, cpu_kernel=self._cpu_kernels()).T
        else:
            logits = jnp.einsum("ne,ve->nv", hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)
        return softcap(logits, self.config.final_logit_softcap)

    def compute_logits_t(self, hidden: jax.Array) -> jax.Array:
        """float32 logits *transposed*, ``[vocab, N]``: the orientation in which
        the CPU runs the vocabulary matmul fastest for few rows (11.5 ms vs
        13.5 ms for 64 x 512 x 32000 here); the greedy sampler reduces over
        axis 0 directly."""
        logits_t = _mm(self.output_embedding(), hidden.T, cpu_kernel=self._cpu_kernels())
        return softcap(logits_t, self.config.final_logit_softcap)

    def _cpu_kernels(self) -> bool:
        """Whether the C++ kernels serve this model's float32 programs: the
        CPU attention kernel chosen (so the library is built and
        registered), one device and float32 weights."""
        return self.attention.kernel == "cpu" and self.mesh is None and self.dtype == jnp.float32

    # convenience -----------------------------------------------------------
    def make_kv_cache(self, num_blocks: int, block_size: int, dtype=None) -> KVCache:
        """A zeroed cache matching this model (cache dtype defaults to the weight dtype)."""
        c = self.config
        return KVCache.create(
            c.num_hidden_layers,
            num_blocks,
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            dtype or self.dtype,
            layout=self.attention.layout,
        )
