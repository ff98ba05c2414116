"""Token sampling on the device, one compiled function per sequence bucket.

Every per-request knob (temperature, top-k, top-p, min-p, penalties, seed)
arrives as an array with one row per sequence, so a batch mixing greedy and
sampled requests, or different seeds, runs the same compiled program.

Reproducibility: each row draws its randomness from
``fold_in(PRNGKey(seed), output_index)``, a function of the request's own
seed and of how many tokens it has produced so far. What else shares the
batch, or at which row the request sits, cannot change its tokens.

The expensive parts (a full-vocabulary sort for top-k/top-p, the penalty
scatter) sit under ``lax.cond`` and run only when some row needs them: a
greedy batch costs one max and one min over the vocabulary (see ``argmax``).

Structured output (``jaxserve.engine.structured``): a constrained row comes
with a bitmask of its allowed tokens (``token_mask``, int32 words, bit ``v %
32`` of word ``v // 32`` for token ``v``, llguidance's layout) and its
``masked`` flag; disallowed tokens become ``_NEG_INF`` after the penalties
and before temperature, filtering and the draw. The mask is an array
argument like every other knob, so one compiled program serves any mix,
and it is applied under ``lax.cond``: a batch with no constrained row skips
it, and a row whose flag is off keeps its logits bit for bit.

On the host a row is a :class:`SamplingRow`: the request's
:class:`~jaxserve.sampling_params.SamplingParams` as they are, and where the
request stands. Each array of :class:`SamplingTensors` is declared once,
with how it is read from a row, its padding value and whether the greedy
programs may ignore it (:class:`Knob`); filling the arrays
(:func:`host_sampling_tensors`), their shapes for compilation
(:func:`abstract_tensors`) and the choice of the greedy programs
(:func:`is_plain_greedy`) all follow from those declarations. A new knob is
a field of ``SamplingParams``, a knob here with its use in :func:`sample`,
and its line in ``tests/test_sampling_knobs.py``, which fails for a field
the sampler does not read or a knob the greedy check would wrongly ignore.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.blocks import ordered_sum
from jaxserve.sampling_params import SamplingParams

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One sampling row of a step on the host: the request's parameters and
    where the request stands (``jaxserve.engine.step_inputs.sampling_row``
    builds it from a request)."""

    params: SamplingParams
    #: tokens the request has generated so far: its draw's ``fold_in`` index
    output_index: int = 0
    #: the token ids the penalties look at, prompt first, then output; None
    #: when no penalty is active
    history: Sequence[int] | None = None
    #: how many leading ``history`` ids are prompt
    num_prompt: int = 0
    #: structured output: the allowed-token bits (``token_mask``'s layout)
    mask: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Knob:
    """How the host fills one per-row array of :class:`SamplingTensors`."""

    dtype: type
    #: a padding row's value, greedy and neutral: what the greedy programs assume
    pad: Any
    #: the value for a real row
    read: Callable[[SamplingRow], Any]
    #: a row the greedy programs may serve (temperature 0, every other knob at
    #: its ``pad``) takes the argmax whatever this value is
    greedy_ignores: bool = False


def _knob(dtype: type, pad: Any, read: Callable[[SamplingRow], Any], *, greedy_ignores: bool = False) -> Any:
    return dataclasses.field(metadata={"knob": Knob(dtype, pad, read, greedy_ignores)})


def _ids() -> Any:
    """An i32 ``[S, width]`` array per step, -1 for padding (filled by
    :func:`host_sampling_tensors` itself)."""
    return dataclasses.field(metadata={"ids": True})


def _seed(row: SamplingRow) -> int:
    seed = row.params.seed
    return 0 if seed is None else sampler_seed(seed)  # the engine gives every request one


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters for one step (``S`` rows, ``H`` history).

    Every field but ``history`` and ``token_mask`` is a :class:`Knob`, one
    value per row. ``history`` holds, per row, the token ids the penalties
    look at, padded with -1: prompt ids first, then output ids.
    ``num_prompt`` says how many leading entries are prompt (repetition
    penalty covers both, frequency and presence penalties only the output,
    as in OpenAI and vLLM).
    """

    temperature: jax.Array = _knob(np.float32, 0.0, lambda r: r.params.temperature)  # 0 means greedy
    top_k: jax.Array = _knob(np.int32, 0, lambda r: r.params.top_k, greedy_ignores=True)  # <= 0 disables
    top_p: jax.Array = _knob(np.float32, 1.0, lambda r: r.params.top_p, greedy_ignores=True)
    min_p: jax.Array = _knob(np.float32, 0.0, lambda r: r.params.min_p, greedy_ignores=True)
    seed: jax.Array = _knob(np.uint32, 0, _seed, greedy_ignores=True)
    output_index: jax.Array = _knob(np.int32, 0, lambda r: r.output_index, greedy_ignores=True)
    repetition_penalty: jax.Array = _knob(np.float32, 1.0, lambda r: r.params.repetition_penalty)
    frequency_penalty: jax.Array = _knob(np.float32, 0.0, lambda r: r.params.frequency_penalty)
    presence_penalty: jax.Array = _knob(np.float32, 0.0, lambda r: r.params.presence_penalty)
    history: jax.Array = _ids()  # i32 [S, H]
    num_prompt: jax.Array = _knob(np.int32, 0, lambda r: r.num_prompt, greedy_ignores=True)
    #: i32 [S, W]: allowed-token bits of constrained rows (W = ceil(vocab / 32))
    token_mask: jax.Array = _ids()
    #: the row is constrained (its token_mask applies)
    masked: jax.Array = _knob(np.bool_, False, lambda r: r.mask is not None)
    #: how many most likely tokens to report (0-20)
    top_logprobs: jax.Array = _knob(np.int32, 0, lambda r: r.params.top_logprobs if r.params.logprobs else 0)


#: the per-row knobs, by field name, in field order
KNOBS: tuple[tuple[str, Knob], ...] = tuple(
    (f.name, f.metadata["knob"]) for f in dataclasses.fields(SamplingTensors) if "knob" in f.metadata
)
_GREEDY_READS = tuple(knob for _, knob in KNOBS if not knob.greedy_ignores)


#: most alternatives a row may ask for (OpenAI's ``top_logprobs`` limit)
MAX_TOP_LOGPROBS = 20


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return -(-int(vocab_size) // 32)


def argmax(logits: jax.Array, axis: int = -1) -> jax.Array:
    """First index of the maximum along ``axis`` (the vocabulary axis), int32.

    Same result as ``jnp.argmax`` for finite logits, written as a max and a
    min over an iota: XLA's CPU backend lowers ``argmax`` to a variadic
    (value, index) reduction that it does not vectorise, measured 6x slower
    here (4.6 ms vs 0.8 ms for 64 x 32000). A row holding NaN yields index 0
    where the backend's max propagates NaN; XLA's CPU max skips NaN (its
    fast min/max, on by default), giving the first maximum of the other
    values there. (``jaxserve.kernels.cpu.vocab_argmax_cpu``, the CPU
    engine's greedy pick, returns 0 for such a row.)
    """
    vocab = logits.shape[axis]
    best = jnp.max(logits, axis=axis, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, axis % logits.ndim)
    first = jnp.min(jnp.where(logits == best, ids, vocab), axis=axis)
    return jnp.where(first < vocab, first, 0)


def _logsumexp(logits: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(logits))) along ``axis``, summed in an order fixed by the
    vocabulary alone (``ordered_sum``), so a row's value does not depend on
    the rows beside it: the same log-probabilities and the same draws with
    and without speculative guesses (tests/test_speculative.py)."""
    best = jnp.max(logits, axis=axis, keepdims=True)
    total = ordered_sum(jnp.exp(logits - best), axis=axis, keepdims=True)
    lse = jnp.log(total) + best
    return lse if keepdims else jnp.squeeze(lse, axis)


def _softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.softmax`` over the last axis, normalised by an ordered sum (:func:`_logsumexp`)."""
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / ordered_sum(e, axis=-1, keepdims=True)


def chosen_logprobs(logits: jax.Array, tokens: jax.Array, axis: int = -1) -> jax.Array:
    """Log-probability of each chosen token under the softmax along ``axis``,
    without materialising the whole log-softmax."""
    chosen = jnp.take_along_axis(logits, jnp.expand_dims(tokens, axis), axis=axis)
    return jnp.squeeze(chosen, axis) - _logsumexp(logits, axis=axis)


def apply_token_mask(logits: jax.Array, token_mask: jax.Array, masked: jax.Array) -> jax.Array:
    """Disallowed tokens of the ``masked`` rows become ``_NEG_INF``; other
    rows are returned unchanged. ``token_mask`` is ``[S, W]`` int32 words
    (bit ``v % 32`` of word ``v // 32`` allows token ``v``); tokens past
    ``32 * W`` are disallowed."""
    num_rows, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (token_mask[:, :, None] >> shifts[None, None, :]) & 1  # [S, W, 32]
    allowed = bits.reshape(num_rows, -1) != 0
    width = allowed.shape[1]
    if width >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - width)))
    return jnp.where(masked[:, None] & ~allowed, _NEG_INF, logits)


def top_logprobs(raw_logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """The ``MAX_TOP_LOGPROBS`` most likely tokens of every row under the raw
    distribution: ``(logprobs f32[S, 20], ids i32[S, 20])``, most likely
    first. Computed only when some row asks (``lax.cond``; zeros otherwise);
    the host keeps each row's first ``top_logprobs`` entries."""
    num_rows, vocab = raw_logits.shape
    k = min(MAX_TOP_LOGPROBS, vocab)

    def compute(x):
        values, ids = jax.lax.top_k(x - _logsumexp(x, keepdims=True), k)
        return values, ids.astype(jnp.int32)

    def skip(x):
        return jnp.zeros((num_rows, k), jnp.float32), jnp.zeros((num_rows, k), jnp.int32)

    return jax.lax.cond(jnp.any(t.top_logprobs > 0), compute, skip, raw_logits)


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    num_rows, vocab = logits.shape
    hist = t.history
    valid = hist >= 0
    ids = jnp.where(valid, hist, 0)
    is_output = valid & (jnp.arange(hist.shape[1])[None, :] >= t.num_prompt[:, None])
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], hist.shape)
    seen = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].max(valid)
    out_counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    rep = t.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    logits = logits - t.presence_penalty[:, None] * (out_counts > 0).astype(jnp.float32)
    return logits


def _filter(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """top-k, top-p and min-p over temperature-scaled logits: filtered-out
    tokens become ``_NEG_INF``."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    # top-k: keep values >= the k-th largest.
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    keep = scaled >= kth
    # top-p over the top-k survivors: keep the smallest prefix whose mass
    # reaches top_p (the token that crosses the line is kept).
    masked_sorted = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_desc, _NEG_INF)
    probs_sorted = _softmax(masked_sorted)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    cutoff_count = jnp.sum(mass_before < t.top_p[:, None], axis=-1)
    cutoff_value = jnp.take_along_axis(sorted_desc, jnp.maximum(cutoff_count - 1, 0)[:, None], axis=-1)
    keep = keep & (scaled >= cutoff_value)
    # min-p: drop tokens whose probability is below min_p * max probability.
    probs = _softmax(jnp.where(keep, scaled, _NEG_INF))
    keep = keep & (probs >= t.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True))
    return jnp.where(keep, scaled, _NEG_INF)


def _filter_and_sample(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    temp = jnp.where(t.temperature > 0, t.temperature, 1.0)
    scaled = logits / temp[:, None]
    # The full-vocabulary sort only when a sampled row filters: plain
    # temperature sampling (the default job) draws from the scaled logits
    # directly. Measured on llama-56m (vocab 32000), 24 rows: a step with
    # the sort 300 ms, greedy 41 ms.
    # Rows that do not filter keep their logits as they are even when the
    # sort runs for another row (top_p 1.0 could otherwise drop a tail token
    # on float rounding): what shares the batch never changes a row's draw.
    filters = (t.temperature > 0) & ((t.top_k > 0) | (t.top_p < 1.0) | (t.min_p > 0.0))
    filtered = jax.lax.cond(
        jnp.any(filters), lambda x, tt: jnp.where(filters[:, None], _filter(x, tt), x), lambda x, _: x, scaled, t
    )

    def draw(seed, index, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
        return jax.random.categorical(key, row)

    sampled = jax.vmap(draw)(t.seed, t.output_index, filtered)
    greedy = argmax(logits)
    return jnp.where(t.temperature > 0, sampled, greedy).astype(jnp.int32)


def sample(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row; returns ``(token_ids i32[S], logprobs f32[S])``.

    The log-probability is that of the chosen token under the model's raw
    distribution (before penalties, token mask and temperature), as vLLM
    reports it.
    """
    tokens, logprobs, _ = _sample(logits, t)
    return tokens, logprobs


def sample_with_top(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``sample`` plus ``top_logprobs``: ``(token_ids, logprobs, top values,
    top ids)``."""
    tokens, logprobs, raw_logits = _sample(logits, t)
    values, ids = top_logprobs(raw_logits, t)
    return tokens, logprobs, values, ids


def _sample(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array]:
    logits = logits.astype(jnp.float32)
    raw_logits = logits
    needs_penalty = jnp.any((t.repetition_penalty != 1.0) | (t.frequency_penalty != 0.0) | (t.presence_penalty != 0.0))
    logits = jax.lax.cond(needs_penalty, _apply_penalties, lambda x, _: x, logits, t)
    logits = jax.lax.cond(jnp.any(t.masked), lambda x: apply_token_mask(x, t.token_mask, t.masked), lambda x: x, logits)
    needs_sampling = jnp.any(t.temperature > 0)
    tokens = jax.lax.cond(
        needs_sampling,
        _filter_and_sample,
        lambda x, _: argmax(x),
        logits,
        t,
    )
    return tokens, chosen_logprobs(raw_logits, tokens), raw_logits


_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


def sampler_seed(seed: int) -> int:
    """Map a request's seed (any integer in ``[-2**63, 2**64 - 1]``) to the
    sampler's uint32 seed, deterministically.

    Seeds in ``[0, 2**32)`` map to themselves, so every seeded output
    produced before wider seeds were accepted stays the same. Any other seed
    is taken modulo ``2**64`` (so ``-1`` and ``2**64 - 1`` are one seed, as
    in two's complement), scrambled by the 64-bit finalizer of SplitMix64,
    and its two 32-bit halves are xor-ed together. A bare xor of the halves
    would send ``-k`` to ``k - 1`` (``-1`` to ``0``, ``-2`` to ``1``...), so
    common negative seeds would repeat the streams of small positive ones;
    the scrambling spreads them instead. Collisions are unavoidable (2**64
    seeds, 2**32 streams) but not systematic.
    """
    seed = int(seed)
    if 0 <= seed <= _U32:
        return seed
    z = seed & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    z ^= z >> 31
    return (z ^ (z >> 32)) & _U32


def is_plain_greedy(row: SamplingRow) -> bool:
    """Whether the greedy programs (an argmax over the raw logits: no
    penalty, no mask, no draw, no alternatives) give ``row`` exactly what
    :func:`sample` would: every knob they do not ignore is at its padding
    value. A knob is read here unless it is declared ``greedy_ignores``."""
    return all(knob.read(row) == knob.pad for knob in _GREEDY_READS)


def host_sampling_tensors(
    rows: Sequence[SamplingRow],
    num_rows: int,
    history_len: int,
    num_mask_words: int = 1,
) -> dict[str, np.ndarray]:
    """The numpy arrays of a :class:`SamplingTensors` for ``num_rows``
    rows, the first ``len(rows)`` of them ``rows``. Padding rows are greedy
    with neutral penalties and no mask (each knob's ``pad``). A row's
    ``history`` keeps its last ``history_len`` ids (0: none is asked for,
    and no row may carry one)."""
    n = len(rows)
    out: dict[str, np.ndarray] = {}
    for name, knob in KNOBS:
        array: np.ndarray = np.full(num_rows, knob.pad, knob.dtype)
        array[:n] = [knob.read(row) for row in rows]
        out[name] = array
    history = np.full((num_rows, history_len), -1, np.int32)
    token_mask = np.full((num_rows, num_mask_words), -1, np.int32)
    for i, row in enumerate(rows):
        if row.history is not None:
            ids = row.history[-history_len:]
            history[i, : len(ids)] = ids
        if row.mask is not None:
            token_mask[i] = row.mask
    out["history"] = history
    out["token_mask"] = token_mask
    return out


def abstract_tensors(num_rows: int, history_len: int, num_mask_words: int) -> SamplingTensors:
    """The shapes and dtypes of a step's :class:`SamplingTensors`, to
    compile the sampling program for ``num_rows`` rows."""
    spec: dict[str, Any] = {name: jax.ShapeDtypeStruct((num_rows,), knob.dtype) for name, knob in KNOBS}
    spec["history"] = jax.ShapeDtypeStruct((num_rows, history_len), np.int32)
    spec["token_mask"] = jax.ShapeDtypeStruct((num_rows, num_mask_words), np.int32)
    return SamplingTensors(**spec)
