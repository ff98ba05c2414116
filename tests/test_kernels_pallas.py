"""The Pallas kernels JAX ships, through jaxserve's adapters, against the pure-JAX reference.

``JAXSERVE_PALLAS_MODE`` picks how the shipped kernels run:

- ``interpret`` (default; CPU): the GPU kernel with ``interpret=True``, the
  TPU paged kernel under ``force_tpu_interpret_mode``;
- ``device``: compiled for the machine's accelerator (``benchmarks/
  device_check.sh`` sets it on a GPU); tests of the other platform's kernel
  and interpret-only tests are skipped.

The ragged TPU kernel does not run in JAX 0.10.2's interpret mode (see
``pallas_attention.py``; ``test_ragged_kernel_interpret_mode_limitation``
pins the failure), so its adapter runs through the module's own pure-JAX
reference, which takes the same inputs in the same layout.

Per-layer features: the three kernels soft-cap (``logit_softcap``), the
ragged one also slides; none has sinks. ``attend`` sends each call to the
shipped kernel only when it has all of that call's features, else to the
reference over the same heads-layout cache
(``test_attend_takes_the_shipped_kernel_per_layer``).

Every case has shuffled block tables (a random permutation of the physical
blocks), garbage (x100) in unused blocks and block 0, padding tokens and
empty rows, GQA (4 query heads per kv head), and context lengths on both
sides of block boundaries (1, 15, 16, 17, 41, 100 and a full 128-token
table with 16-token blocks).

Tolerances (outputs are O(1): unit-normal values, softmax-weighted):

- float32, interpret mode: ``2e-5`` absolute and relative, as the reference's
  own tests: the same float32 arithmetic in a different order (flash splits,
  ``exp2(x log2 e)`` instead of ``exp``), a few float32 ulps apart;
- float32, on a GPU: ``5e-3``: Triton's ``dot`` rounds float32 operands to
  TF32 (10-bit mantissa, relative 2^-11 ~ 4.9e-4 per operand); with scores
  and outputs O(1) that is ~1e-3 at worst, 5e-3 leaves a margin;
- bfloat16 (both modes): relative Frobenius error below ``2e-2``, as the
  reference's bfloat16 test: queries, keys, values, probabilities and (GPU
  kernel) each split's partial output are rounded to bfloat16's 8-bit
  mantissa (relative 2^-9 ~ 2e-3 each);
- the TPU paged kernel, float32 too: the bfloat16 bound, because the shipped
  kernel casts every loaded key and value block to bfloat16
  (``_maybe_dequantize``'s default dtype) whatever the cache's dtype, as
  the TPU's default matmul precision does for float32 anyway.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.kernels import backends
from jaxserve.kernels import pallas_attention as pallas
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.backends import REFERENCE, AttentionImpl, select_attention
from jaxserve.kernels.kv_cache import (
    KVCache,
    blocks_to_heads,
    heads_to_blocks,
    keys_from_slots,
    to_storage,
    values_from_slots,
)
from jaxserve.kernels.paged_attention import paged_attention, write_kv

MODE = os.environ.get("JAXSERVE_PALLAS_MODE", "interpret")
if MODE not in ("interpret", "device"):
    raise ValueError(f"JAXSERVE_PALLAS_MODE must be 'interpret' or 'device', got {MODE!r}")
INTERPRET = MODE == "interpret"
PLATFORM = jax.default_backend()

BS = 16  # block size
NUM_BLOCKS = 40
KVH, H, D = 2, 8, 32  # GQA: 4 query heads per kv head
M = 8  # block-table width: 128 tokens at most
SCALE = 1.0 / math.sqrt(D)
EXTRA_ROWS = 2  # empty rows between the real ones and the padding row (the runner's unused rows)
NUM_PAD = 3

# (cached tokens, new tokens in this step)
DECODE = [(0, 1), (14, 1), (15, 1), (16, 1), (40, 1), (99, 1), (127, 1)]  # contexts 1, 15, 16, 17, 41, 100, 128
MIXED = [(36, 1), (10, 7), (0, 20), (16, 1), (50, 30), (127, 1)]  # prefill chunks, decodes, a full table


def _needs(kernel: str) -> None:
    """Skip unless the kernel can run here: interpret mode anywhere, else its own platform."""
    if not INTERPRET and PLATFORM != kernel:
        pytest.skip(f"JAXSERVE_PALLAS_MODE=device runs the {kernel} kernel on a {kernel} only (here: {PLATFORM})")


def _tolerance(dtype, bf16_kv: bool = False) -> dict:
    if bf16_kv or jnp.dtype(dtype) == jnp.bfloat16:
        return {"rel_norm": 2e-2}
    return {"atol": 2e-5, "rtol": 2e-5} if INTERPRET else {"atol": 5e-3, "rtol": 5e-3}


def _check(out, ref, n_real, dtype, bf16_kv: bool = False):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert out.shape == ref.shape
    tol = _tolerance(dtype, bf16_kv)
    if "rel_norm" in tol:
        rel = np.linalg.norm(out[:n_real] - ref[:n_real]) / np.linalg.norm(ref[:n_real])
        assert rel < tol["rel_norm"], rel
    else:
        np.testing.assert_allclose(out[:n_real], ref[:n_real], **tol)
    # padding tokens see nothing: exact zeros, never NaN
    np.testing.assert_array_equal(out[n_real:], 0.0)


def _case(seqs, *, seed: int, dtype=jnp.float32, num_blocks: int = NUM_BLOCKS):
    """A step over a cache that already holds every position of every sequence
    (the step's own keys included, as after ``write_kv``), in both layouts."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_blocks))  # shuffled physical blocks
    rows = len(seqs) + EXTRA_ROWS + 1  # real rows, empty rows, the padding row
    block_tables = np.zeros((rows, M), np.int32)
    slots = rng.standard_normal((2, num_blocks * BS, KVH, D)).astype(np.float32) * 100  # garbage everywhere
    nxt = 0
    for s, (cached, new) in enumerate(seqs):
        total = cached + new
        nb = -(-total // BS)
        block_tables[s, :nb] = perm[nxt : nxt + nb]
        nxt += nb
        for p in range(total):
            slot = block_tables[s, p // BS] * BS + p % BS
            slots[:, slot] = rng.standard_normal((2, KVH, D))
    tok_seq, pos, slot_mapping = [], [], []
    for s, (cached, new) in enumerate(seqs):
        for p in range(cached, cached + new):
            tok_seq.append(s)
            pos.append(p)
            slot_mapping.append(block_tables[s, p // BS] * BS + p % BS)
    n_real = len(tok_seq)
    for i in range(NUM_PAD):  # padding tokens: the padding row, position 0, block 0
        tok_seq.append(rows - 1)
        pos.append(0)
        slot_mapping.append(i)
    context_lens = np.zeros(rows, np.int32)
    context_lens[: len(seqs)] = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(np.array(slot_mapping, np.int32)),
        token_seq=jnp.asarray(np.array(tok_seq, np.int32)),
        block_tables=jnp.asarray(block_tables),
        context_lens=jnp.asarray(context_lens),
        logits_indices=jnp.zeros(rows - 1, jnp.int32),
    )
    q = jnp.asarray(rng.standard_normal((len(tok_seq), H, D)), dtype)
    k_slots = jnp.asarray(slots[0], dtype)
    v_slots = jnp.asarray(slots[1], dtype)
    kb, vb = keys_from_slots(to_storage(k_slots, dtype), BS), values_from_slots(to_storage(v_slots, dtype), BS)
    heads = jnp.transpose(jnp.stack([k_slots, v_slots]).reshape(2, num_blocks, BS, KVH, D), (0, 3, 1, 2, 4))
    return dict(
        q=q,
        meta=meta,
        positions=jnp.asarray(np.array(pos, np.int32)),
        n_real=n_real,
        dtype=dtype,
        blocks=(kb, vb),
        heads=(heads[0], heads[1]),
    )


def _reference(case, sliding_window=None, **features):
    kb, vb = case["blocks"]
    return paged_attention(
        case["q"],
        kb,
        vb,
        case["meta"],
        case["positions"],
        block_size=BS,
        scale=SCALE,
        sliding_window=sliding_window,
        cache_dtype=case["dtype"],
        **features,
    )


#: a soft-cap the scores of these cases (unit normal q and k, scale 1/sqrt(D)) cross
CAP = 1.5


def _sinks(heads: int = H) -> jax.Array:
    return jnp.asarray(np.random.default_rng(17).standard_normal(heads) * 2 + 1, jnp.float32)


# ------------------------------------------------------------------ layouts


def test_heads_layout_write_and_reference_equal_blocks_layout():
    """write_kv and the pure-JAX kernel in the heads layout give exactly what the blocks layout gives."""
    case = _case(MIXED, seed=1)
    kb, vb = case["blocks"]
    kh, vh = case["heads"]
    np.testing.assert_array_equal(np.asarray(blocks_to_heads(kb, vb)[0]), np.asarray(kh))
    np.testing.assert_array_equal(np.asarray(blocks_to_heads(kb, vb)[1]), np.asarray(vh))
    new = jnp.asarray(np.random.default_rng(2).standard_normal((2, case["q"].shape[0], KVH, D)), jnp.float32)
    slots = case["meta"].slot_mapping
    kb2, vb2 = write_kv(kb, vb, new[0], new[1], slots)
    kh2, vh2 = write_kv(kh, vh, new[0], new[1], slots, layout="heads")
    back = heads_to_blocks(kh2, vh2)
    np.testing.assert_array_equal(np.asarray(back[0]), np.asarray(kb2))
    np.testing.assert_array_equal(np.asarray(back[1]), np.asarray(vb2))
    for window, features in ((None, {}), (9, {}), (9, {"logit_softcap": CAP, "sinks": _sinks()})):
        ref = paged_attention(
            case["q"],
            kb2,
            vb2,
            case["meta"],
            case["positions"],
            block_size=BS,
            scale=SCALE,
            sliding_window=window,
            chunk_tokens=2 * BS,
            **features,
        )
        got = paged_attention(
            case["q"],
            kh2,
            vh2,
            case["meta"],
            case["positions"],
            block_size=BS,
            scale=SCALE,
            sliding_window=window,
            chunk_tokens=2 * BS,
            layout="heads",
            **features,
        )
        # the same float32 operands, gathered differently: on the CPU a few ulps at most; on an
        # accelerator XLA may pick other dot algorithms (split-K, TF32) per layout
        tol = 1e-6 if PLATFORM == "cpu" else 5e-3
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol)


def test_heads_cache_shapes_and_storage():
    c = KVCache.create(
        num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=jnp.bfloat16, layout="heads"
    )
    # typed bfloat16 (no uint16 bits: that is the CPU's blocks-layout workaround)
    assert c.k[0].shape == c.v[1].shape == (2, 5, 4, 8) and c.k[0].dtype == jnp.bfloat16
    assert (c.num_blocks, c.num_kv_heads, c.head_dim, c.layout) == (5, 2, 8, "heads")
    new = jnp.arange(3 * 2 * 8, dtype=jnp.float32).reshape(3, 2, 8)
    k, v = write_kv(c.k[1], c.v[1], new, -new, jnp.asarray([5, 9, 19]), layout="heads")
    k_read, v_read = c.replace(k=(c.k[0], k), v=(c.v[0], v)).read_slots(1, [5, 9, 19])
    np.testing.assert_array_equal(np.asarray(k_read, np.float32), np.asarray(new))
    np.testing.assert_array_equal(np.asarray(v_read, np.float32), -np.asarray(new))
    with pytest.raises(ValueError, match="'rows'"):
        KVCache.create(num_layers=1, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, layout="rows")


def test_combine_kv_pages_interleaves_heads():
    k = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    kv = pallas.combine_kv_pages(k, -k)
    assert kv.shape == (3, 4, 4, 5)
    for h in range(2):
        np.testing.assert_array_equal(np.asarray(kv[:, :, 2 * h]), np.asarray(k[h]))
        np.testing.assert_array_equal(np.asarray(kv[:, :, 2 * h + 1]), -np.asarray(k[h]))


@pytest.mark.parametrize("num_pages,block_size", [(1, 16), (8, 16), (33, 16), (64, 64), (200, 8), (3, 128)])
def test_gpu_split_fits_the_kernel(num_pages, block_size):
    ppcb, k_splits, width = pallas.gpu_split(num_pages, block_size)
    assert ppcb * block_size == max(block_size, 128)  # one 128-key inner iteration
    assert 1 <= k_splits <= 16 and width >= num_pages
    assert width % k_splits == 0 and (width // k_splits) % ppcb == 0  # the kernel's asserts
    assert width - num_pages < width // k_splits  # less than one partition of padding


# ------------------------------------------------------------- GPU kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_gpu_kernel_matches_reference(seqs, dtype):
    """Per-token rows through the shipped GPU kernel: decode steps, and mixed
    steps (prefill tokens included, each with its own causal length)."""
    _needs("gpu")
    case = _case(seqs, seed=3, dtype=dtype)
    kh, vh = case["heads"]
    fn = jax.jit(
        lambda q, k, v, meta, pos: pallas.gpu_paged_attention(q, k, v, meta, pos, scale=SCALE, interpret=INTERPRET)
    )
    out = fn(case["q"], kh, vh, case["meta"], case["positions"])
    assert out.dtype == dtype
    _check(out, _reference(case), case["n_real"], dtype)


def test_gpu_kernel_many_splits():
    """A narrow split (2 partitions of one 128-key iteration) merges partial softmaxes across partitions."""
    _needs("gpu")
    case = _case(DECODE, seed=4)
    kh, vh = case["heads"]
    assert pallas.gpu_split(M, BS) == (8, 1, 8)  # 8 pages of 16 keys: one iteration, one partition
    # the same step with 256-key tables (the extra columns are the null block): 2 partitions
    meta = case["meta"]
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, M)))
    wide = AttentionMetadata(meta.slot_mapping, meta.token_seq, tables, meta.context_lens, meta.logits_indices)
    assert pallas.gpu_split(2 * M, BS) == (8, 2, 16)
    out = pallas.gpu_paged_attention(case["q"], kh, vh, wide, case["positions"], scale=SCALE, interpret=INTERPRET)
    _check(out, _reference(case), case["n_real"], jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_gpu_kernel_soft_cap_matches_reference(seqs, dtype):
    """The kernel's own attn_logits_soft_cap on the adapter's scaled queries is
    the reference's cap * tanh(s / cap) of the scaled scores."""
    _needs("gpu")
    case = _case(seqs, seed=7, dtype=dtype)
    kh, vh = case["heads"]
    fn = jax.jit(
        lambda q, k, v, meta, pos: pallas.gpu_paged_attention(
            q, k, v, meta, pos, scale=SCALE, interpret=INTERPRET, logit_softcap=CAP
        )
    )
    out = fn(case["q"], kh, vh, case["meta"], case["positions"])
    ref = _reference(case, logit_softcap=CAP)
    _check(out, ref, case["n_real"], dtype)
    plain = np.asarray(_reference(case), np.float32)
    assert np.max(np.abs(plain - np.asarray(ref, np.float32))[: case["n_real"]]) > 0.05


# ------------------------------------------------------------- TPU kernels


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_paged_kernel_matches_reference(dtype):
    _needs("tpu")
    case = _case(DECODE, seed=5, dtype=dtype)
    kh, vh = case["heads"]
    out = pallas.tpu_paged_attention(
        case["q"], kh, vh, case["meta"], case["positions"], scale=SCALE, interpret=INTERPRET, pages_per_compute_block=4
    )
    assert out.dtype == dtype
    _check(out, _reference(case), case["n_real"], dtype, bf16_kv=True)


def test_tpu_paged_kernel_soft_cap_matches_reference():
    _needs("tpu")
    case = _case(DECODE, seed=8)
    kh, vh = case["heads"]
    out = pallas.tpu_paged_attention(
        case["q"],
        kh,
        vh,
        case["meta"],
        case["positions"],
        scale=SCALE,
        interpret=INTERPRET,
        pages_per_compute_block=4,
        logit_softcap=CAP,
    )
    _check(out, _reference(case, logit_softcap=CAP), case["n_real"], jnp.float32, bf16_kv=True)


@pytest.mark.parametrize(
    "dtype,num_blocks", [(jnp.float32, NUM_BLOCKS), (jnp.bfloat16, NUM_BLOCKS), (jnp.float32, 2 * NUM_BLOCKS)]
)
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_ragged_adapter_matches_reference(sliding_window, dtype, num_blocks):
    """The adapter's layout conversion and sequence metadata, through the ragged
    module's own reference (the kernel itself cannot be interpreted here).
    With 80 blocks the step's tables (9 rows x 8) name fewer blocks than the
    cache holds, and only those are converted."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    case = _case(MIXED, seed=6, dtype=dtype, num_blocks=num_blocks)
    kh, vh = case["heads"]
    inputs = pallas.ragged_inputs(case["meta"])
    n_seqs = len(MIXED)
    np.testing.assert_array_equal(np.asarray(inputs["num_seqs"]), [n_seqs])
    want_cu = np.concatenate([[0], np.cumsum([n for _, n in MIXED]), [case["n_real"]] * EXTRA_ROWS])
    np.testing.assert_array_equal(np.asarray(inputs["cu_q_lens"]), want_cu)
    out = pallas.tpu_ragged_attention(
        case["q"],
        kh,
        vh,
        case["meta"],
        case["positions"],
        scale=SCALE,
        sliding_window=sliding_window,
        kernel=ref_ragged_paged_attention,
    )
    _check(out, _reference(case, sliding_window), case["n_real"], dtype)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_ragged_adapter_soft_cap_matches_reference(sliding_window):
    """The ragged kernel's soft_cap (after its sm_scale of 1 on the adapter's
    scaled queries, before the mask), through the module's reference."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    case = _case(MIXED, seed=9)
    kh, vh = case["heads"]
    out = pallas.tpu_ragged_attention(
        case["q"],
        kh,
        vh,
        case["meta"],
        case["positions"],
        scale=SCALE,
        sliding_window=sliding_window,
        kernel=ref_ragged_paged_attention,
        logit_softcap=CAP,
    )
    _check(out, _reference(case, sliding_window, logit_softcap=CAP), case["n_real"], jnp.float32)


#: (kernel, program) -> [(layer features, the kernel attend must call)]: one
#: model's mixed layers; each call goes to the shipped kernel only if it has
#: all of that layer's features (KERNEL_FEATURES)
ROUTES = {
    ("gpu", "decode"): [
        ({}, "gpu"),
        ({"logit_softcap": CAP}, "gpu"),
        ({"sliding_window": 6}, "reference"),
        ({"logit_softcap": CAP, "sinks": True}, "reference"),
    ],
    ("gpu", "mixed"): [({"logit_softcap": CAP}, "reference")],
    ("tpu", "decode"): [
        ({"logit_softcap": CAP}, "tpu"),
        ({"sliding_window": 6}, "reference"),
        ({"sinks": True}, "reference"),
    ],
    ("tpu_ragged", "decode"): [
        ({"logit_softcap": CAP}, "tpu"),
        ({"sliding_window": 6, "logit_softcap": CAP}, "tpu_ragged"),
        ({"sinks": True}, "reference"),
    ],
    ("tpu_ragged", "mixed"): [
        ({"sliding_window": 6, "logit_softcap": CAP}, "tpu_ragged"),
        ({"sliding_window": 6, "sinks": True}, "reference"),
    ],
}


@pytest.mark.parametrize("kernel,program", list(ROUTES))
def test_attend_takes_the_shipped_kernel_per_layer(kernel, program, monkeypatch):
    """The layers of one model (one program for the GPU and TPU paged kernels)
    with different features: the kernel each call takes (recorded), and its
    result against the reference with that layer's features. Decode: every
    token within the paged kernels' program size; mixed: prefill-sized."""
    if kernel == "gpu":
        _needs("gpu")
    else:
        _needs("tpu")
    ragged = kernel == "tpu_ragged"
    impl = AttentionImpl(
        kernel="gpu" if kernel == "gpu" else "tpu", interpret=INTERPRET, ragged=ragged, max_kernel_tokens=16
    )
    calls: list[str] = []

    def recording(name, fn, **fixed):
        def run(*args, **kwargs):
            calls.append(name)
            return fn(*args, **{**kwargs, **fixed})

        return run

    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    monkeypatch.setattr(pallas, "gpu_paged_attention", recording("gpu", pallas.gpu_paged_attention))
    monkeypatch.setattr(pallas, "tpu_paged_attention", recording("tpu", pallas.tpu_paged_attention))
    # the ragged kernel itself cannot be interpreted: its module's reference, eagerly
    monkeypatch.setattr(
        pallas,
        "tpu_ragged_attention",
        recording("tpu_ragged", pallas.tpu_ragged_attention, kernel=ref_ragged_paged_attention),
    )
    monkeypatch.setattr(backends, "paged_attention", recording("reference", backends.paged_attention))
    case = _case(DECODE if program == "decode" else MIXED, seed=10)
    assert (case["q"].shape[0] <= 16) == (program == "decode")
    kh, vh = case["heads"]
    layers = ROUTES[(kernel, program)]
    sinks = _sinks()

    def model(q, kh, vh, meta, positions, sinks):
        return [
            backends.attend(
                impl,
                q,
                kh,
                vh,
                meta,
                positions,
                block_size=BS,
                scale=SCALE,
                cache_dtype=jnp.float32,
                **{**features, "sinks": sinks if features.get("sinks") else None},
            )
            for features, _ in layers
        ]

    run = model if ragged else jax.jit(model)  # the ragged reference needs concrete sequence counts
    outs = run(case["q"], kh, vh, case["meta"], case["positions"], sinks)
    assert calls == [want for _, want in layers]
    for out, (features, want) in zip(outs, layers):
        ref = _reference(case, **{**features, "sinks": sinks if features.get("sinks") else None})
        _check(out, ref, case["n_real"], jnp.float32, bf16_kv=want == "tpu")


@pytest.mark.skipif(not INTERPRET, reason="about the interpret mode")
def test_ragged_kernel_interpret_mode_limitation():
    """Pins the documented limitation: JAX 0.10.2's TPU interpreter cannot run
    the ragged kernel (a reshaped ref). If this starts passing, run the real
    kernel in test_ragged_adapter_matches_reference instead."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    d = 128  # below 128 it fails at trace time instead (its 128-lane softmax statistics)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 4, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((6, 4, 4, d)), jnp.float32)
    args = (
        q,
        kv,
        jnp.asarray([5, 3], jnp.int32),
        jnp.asarray([[1, 2], [3, 0]], jnp.int32),
        jnp.asarray([0, 4, 7], jnp.int32),
        jnp.asarray([2], jnp.int32),
    )
    with pytest.raises(Exception, match="ReshapeTransform"):
        with pltpu.force_tpu_interpret_mode():
            jax.block_until_ready(ragged_paged_attention(*args, num_kv_pages_per_block=1, num_queries_per_block=4))
    with pytest.raises(AssertionError):
        with pltpu.force_tpu_interpret_mode():
            ragged_paged_attention(
                q[..., :64], kv[..., :64], *args[2:], num_kv_pages_per_block=1, num_queries_per_block=4
            )


# -------------------------------------------------------------- selection


def test_select_attention():
    kw = dict(head_dim=64, num_kv_heads=8, block_size=64, sliding_window=None, cache_dtype=jnp.bfloat16)
    assert select_attention("auto", platform="cpu", **kw)[0] == REFERENCE
    assert select_attention("reference", platform="gpu", **kw)[0] == REFERENCE
    assert select_attention("auto", platform="gpu", **kw)[0] == AttentionImpl(kernel="gpu")
    assert select_attention("pallas", platform="gpu", **kw)[0].layout == "heads"
    tpu, reason = select_attention("auto", platform="tpu", **kw)
    assert tpu == AttentionImpl(kernel="tpu", ragged=False) and "head_dim a multiple of 128" in reason
    assert select_attention("auto", platform="tpu", **{**kw, "head_dim": 128})[0].ragged
    # shapes the GPU kernel cannot take: auto falls back, pallas refuses and says why
    for bad, match in (
        ({"head_dim": 80}, "head_dim"),
        ({"block_size": 48}, "block_size"),
    ):
        assert select_attention("auto", platform="gpu", **{**kw, **bad})[0] == REFERENCE
        with pytest.raises(ValueError, match=match):
            select_attention("pallas", platform="gpu", **{**kw, **bad})
    with pytest.raises(ValueError, match="platform 'cpu'"):
        select_attention("pallas", platform="cpu", **kw)
    with pytest.raises(ValueError, match="'fast'"):
        select_attention("fast", platform="gpu", **kw)


def test_select_attention_keeps_the_kernel_for_models_with_layer_features():
    """A sliding window, a soft-cap or sinks on some layers no longer sends the
    whole model to the reference: the Pallas kernel is kept, and the reason
    names the layers that run the reference (their calls do, see
    test_attend_takes_the_shipped_kernel_per_layer)."""
    kw = dict(head_dim=64, num_kv_heads=8, block_size=64, cache_dtype=jnp.bfloat16)
    impl, reason = select_attention("auto", platform="gpu", **kw)
    assert (
        impl == AttentionImpl(kernel="gpu") and reason == "GPU: shipped Pallas paged kernel for decode-sized programs"
    )
    impl, reason = select_attention("auto", platform="gpu", sliding_window=4096, logit_softcap=50.0, **kw)
    assert impl == AttentionImpl(kernel="gpu")
    assert reason.endswith("; layers with a sliding window: reference"), reason
    impl, reason = select_attention("pallas", platform="gpu", sliding_window=128, sinks=True, **kw)
    assert impl == AttentionImpl(kernel="gpu")
    assert reason.endswith("; layers with a sliding window or attention sinks: reference"), reason
    impl, reason = select_attention("auto", platform="tpu", sliding_window=4096, **kw)
    assert impl == AttentionImpl(kernel="tpu", ragged=False)
    assert reason.endswith("head_dim a multiple of 128, got 64); layers with a sliding window: reference"), reason
    impl, reason = select_attention("auto", platform="tpu", sliding_window=4096, sinks=True, **{**kw, "head_dim": 128})
    assert impl == AttentionImpl(kernel="tpu", ragged=True)
    assert reason == (
        "TPU: shipped Pallas paged kernel for decode-sized programs, ragged kernel for the others; "
        "sliding-window layers: ragged kernel for all programs; layers with attention sinks: reference"
    )
    assert "\n" not in reason


# ------------------------------------------------------------ model level


def _tiny_model(dtype):
    from jaxserve.models import CausalLM, ModelConfig

    cfg = ModelConfig.from_dict(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    model = CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(3))
    # bigger weights than the init's std of 0.02: no near ties between logits
    for layer in model.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            p = getattr(layer, name)
            p.set_value(p[...] * 10)
    for p in (model.embed, model.lm_head):
        p.set_value(p[...] * 50)
    return cfg, model


def _model_steps(model, cfg, impl, dtype, interpret_steps):
    """Prefill two prompts (a prefill-sized program) then decode 5 steps
    (decode-sized programs, through the Pallas kernel for impl); returns the
    greedy tokens and the last hidden states."""
    from jaxserve.models.functional import forward_fn, logits_fn

    model.attention = impl
    graphdef, state = nnx.split(model)
    S, width = 4, 8
    cache = KVCache.create(
        cfg.num_hidden_layers, 24, BS, cfg.num_key_value_heads, cfg.head_dim, dtype, layout=impl.layout
    )
    step = jax.jit(lambda st, ids, pos, c, meta: forward_fn(graphdef, st, ids, pos, c, meta), donate_argnums=(3,))
    logits = jax.jit(lambda st, h: logits_fn(graphdef, st, h))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (21, 35)]
    tables = np.zeros((S + 1, width), np.int32)
    tables[0, :3] = [7, 2, 11]
    tables[1, :4] = [5, 20, 1, 14]

    def run(tokens_by_row, starts, T):
        ids, pos, seq, slots = [], [], [], []
        for r, (toks, start) in enumerate(zip(tokens_by_row, starts)):
            for i, t in enumerate(toks):
                p = start + i
                ids.append(t)
                pos.append(p)
                seq.append(r)
                slots.append(tables[r, p // BS] * BS + p % BS)
        n = len(ids)
        last = np.cumsum([len(t) for t in tokens_by_row]) - 1
        pad = T - n
        ctx = np.zeros(S + 1, np.int32)
        ctx[: len(starts)] = [s + len(t) for s, t in zip(starts, tokens_by_row)]
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(np.array(slots + [0] * pad, np.int32)),
            token_seq=jnp.asarray(np.array(seq + [S] * pad, np.int32)),
            block_tables=jnp.asarray(tables),
            context_lens=jnp.asarray(ctx),
            logits_indices=jnp.asarray(np.pad(last, (0, S - len(last))).astype(np.int32)),
        )
        return np.array(ids + [0] * pad, np.int32), np.array(pos + [0] * pad, np.int32), meta

    ids, pos, meta = run(prompts, [0, 0], 64)  # 56 tokens: a prefill-sized program
    hidden, cache = step(state, ids, pos, cache, meta)
    rows = hidden[meta.logits_indices[:2]]
    out = [np.asarray(jnp.argmax(logits(state, rows), axis=-1))]
    lengths = [len(p) for p in prompts]
    for _ in range(interpret_steps):
        ids, pos, meta = run([[int(out[-1][0])], [int(out[-1][1])]], lengths, 8)  # decode-sized program
        hidden, cache = step(state, ids, pos, cache, meta)
        rows = hidden[meta.logits_indices[:2]]
        out.append(np.asarray(jnp.argmax(logits(state, rows), axis=-1)))
        lengths = [n + 1 for n in lengths]
    return np.stack(out), np.asarray(rows, np.float32)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_model_with_pallas_kernel_matches_reference(kernel):
    """The whole model, heads-layout cache and kernel hook included: prefill on
    the reference over the heads layout, decode steps through the shipped
    kernel; the same greedy tokens and hidden states as the reference model."""
    _needs(kernel)
    dtype = jnp.float32
    cfg, model = _tiny_model(dtype)
    want_tokens, want_hidden = _model_steps(model, cfg, REFERENCE, dtype, 5)
    got_tokens, got_hidden = _model_steps(model, cfg, AttentionImpl(kernel=kernel, interpret=INTERPRET), dtype, 5)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    # float32 rounding only, through two layers (GPU, interpreted); TF32 dots
    # (GPU, compiled); bfloat16 keys and values in the TPU kernel: observed
    # 1.1e-2 at most on these O(1) hidden states, against 2^-9 ~ 2e-3 per rounding
    tol = 3e-2 if kernel == "tpu" else (1e-4 if INTERPRET else 2e-2)
    np.testing.assert_allclose(got_hidden, want_hidden, rtol=tol, atol=tol)


def test_cache_layout_must_match_the_kernel():
    cfg, model = _tiny_model(jnp.float32)
    model.attention = AttentionImpl(kernel="gpu", interpret=True)
    cache = KVCache.create(cfg.num_hidden_layers, 8, BS, cfg.num_key_value_heads, cfg.head_dim)  # blocks layout
    meta = AttentionMetadata(
        *(jnp.zeros(n, jnp.int32) for n in (8, 8)),
        jnp.zeros((5, 4), jnp.int32),
        jnp.zeros(5, jnp.int32),
        jnp.zeros(4, jnp.int32),
    )
    with pytest.raises(ValueError, match="'blocks' layout but attention kernel 'gpu' reads 'heads'"):
        model(jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32), cache, meta)


# ------------------------------------------------------------ engine level


@pytest.mark.skipif(PLATFORM != "cpu", reason="the CPU's default path")
def test_engine_default_on_cpu_is_the_reference_over_the_blocks_layout():
    """auto on the CPU with a 16-bit cache: pure-JAX kernels, blocks layout,
    uint16 bits, no mesh (float32 caches take the C++ kernel over the same
    layout: tests/test_kernels_cpu.py); pallas is refused with the platform named."""
    pytest.importorskip("structlog")
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine

    engine = Engine(EngineArgs(model="tiny", dtype="bfloat16", max_num_seqs=2, max_model_len=128))
    assert engine.attention == REFERENCE and engine.mesh is None
    assert engine.runner.kv_cache.layout == "blocks" and engine.runner.kv_cache.k[0].dtype == jnp.uint16
    model = nnx.merge(engine.runner.graphdef, engine.runner.state)  # what the compiled programs trace
    assert model.attention == REFERENCE and model.mesh is None and model.tensor_parallel_size == 1
    with pytest.raises(ValueError, match="attention_backend='pallas' cannot run here: .*platform 'cpu'"):
        Engine(EngineArgs(model="tiny", attention_backend="pallas", max_num_seqs=2, max_model_len=128))
    with pytest.raises(ValueError, match="attention_backend must be one of auto, reference, pallas, cpu, got 'triton'"):
        EngineArgs(attention_backend="triton")
