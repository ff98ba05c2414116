"""The model runner: executes a step plan on the device.

The runner owns the physical KV cache and the compiled programs; it knows
nothing about requests, queues or scheduling policy. The engine hands it a
list of :class:`SeqWork` (which tokens of which sequence to compute this
step, where their blocks are) and gets back the sampled tokens.

Two compiled programs per step (forward, then sampling):

- ``forward`` for each token bucket ``T``: embeds the flat batch, runs every
  layer over the paged cache (donated, so updated in place) and returns the
  hidden state of each sampling sequence's last token, ``[max_num_seqs,
  hidden]`` (rows picked by ``meta.logits_indices``; ``[max_logits_rows,
  hidden]`` with speculative decoding, whose guessed tokens are sampled
  rows too: ``SeqWork.draft_rows``). In buckets of more
  tokens than that, the last layer computes only those rows past its
  key/value projection (``tests/test_last_layer_pruning.py``).
- ``sample`` for each sequence bucket ``S``: takes the first ``S`` of those
  rows, computes their logits and samples on the device. Logits never travel
  to the host, and the vocabulary projection runs on ``S`` rows, not ``T``.
  When every row is plain greedy, a leaner ``greedy`` program of the same
  bucket runs instead (two variants: with and without log-probabilities).

So the program count is ``len(token buckets) + 3 * len(sequence buckets)``.

A step's host arrays are packed by :mod:`jaxserve.engine.step_arrays`
(``SeqWork`` lives there, re-exported here). Everything is compiled in
:meth:`ModelRunner.warmup`; calling the compiled
executables directly (rather than a ``jax.jit`` wrapper) makes an unplanned
shape an error instead of a silent compilation in the middle of serving.

This stays one module on purpose: the traced program functions, the
abstract shapes :meth:`ModelRunner.warmup` compiles them for and
:meth:`ModelRunner.execute`'s choice of bucket must agree on every shape and
donated buffer, and apart they could drift into the unplanned-shape error
above. What does not share those shapes lives elsewhere: the step's host
arrays (:mod:`jaxserve.engine.step_arrays`) and the sampling tensors and
the choice of the greedy programs (:mod:`jaxserve.engine.sampler`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import structlog
from flax import nnx

from jaxserve.engine.buckets import Buckets
from jaxserve.engine.placement import persistent_cache
from jaxserve.engine.sampler import (
    SamplingRow,
    SamplingTensors,
    abstract_tensors,
    argmax,
    chosen_logprobs,
    host_sampling_tensors,
    is_plain_greedy,
    mask_words,
    sample_with_top,
)
from jaxserve.engine.step_arrays import SeqWork, block_major_plan, pack_step
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.backends import REFERENCE, cache_spec
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models.functional import forward_fn, logits_fn, logits_t_fn
from jaxserve.models.rope import long_rope_original

if TYPE_CHECKING:
    from jaxserve.models.decoder import CausalLM

log = structlog.get_logger(__name__)

# Block-major attention reads the whole cache; gathering reads the step's
# blocks but copies them first. Measured for llama-56m on a 2-core host (64
# decode tokens, 8 layers, 257 blocks of 64 tokens): see BENCHMARKS.md.
BLOCK_MAJOR_MIN_USE = 0.5


@dataclasses.dataclass
class StepResult:
    """Device results of a step; ``fetch`` blocks until they are on the host.

    ``tokens`` and ``logprobs`` are host arrays when the step sampled nothing
    or only their tokens came back (greedy inside the forward program)."""

    tokens: jax.Array | np.ndarray
    logprobs: jax.Array | np.ndarray
    num_sampled: int
    #: ``tokens`` is a device array of ``max_logits_rows`` rows that the next
    #: step can read its pending tokens from (``ModelRunner.execute``; never
    #: a step that sampled guesses)
    feedable: bool = False
    #: score rows' log-probabilities, in work order (see ``SeqWork.score_targets``)
    scores: Any = None
    num_scores: int = 0
    #: the sampling program's top-20 log-probabilities and ids (``[S, 20]``),
    #: when some row asked for ``top_logprobs``
    top_logprobs: Any = None
    top_ids: Any = None

    def fetch_top(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Each sampled row's 20 most likely tokens: ``(logprobs, ids)``, or
        None when no row asked for them."""
        if self.top_logprobs is None:
            return None
        return np.asarray(self.top_logprobs)[: self.num_sampled], np.asarray(self.top_ids)[: self.num_sampled]

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.asarray(self.tokens)[: self.num_sampled]
        logprobs = np.asarray(self.logprobs)[: self.num_sampled]
        return tokens, logprobs

    def fetch_scores(self) -> np.ndarray:
        if not self.num_scores:
            return np.zeros(0, np.float32)
        return np.asarray(self.scores)[: self.num_scores]


# The step's pytrees (AttentionMetadata, SamplingTensors) are annotated with
# what the compiled code sees, jax.Array. The host fills them with numpy
# arrays, which jit takes as they are, and lowering with ShapeDtypeStructs,
# which stand for arrays of that shape: these two aliases say so to the type
# checker (they are the same callables).
_host_meta = cast("Callable[..., AttentionMetadata]", AttentionMetadata)
_spec = cast("Callable[..., jax.Array]", jax.ShapeDtypeStruct)


class ModelRunner:
    """Compiled forward and sampling over a paged KV cache."""

    def __init__(
        self,
        model: CausalLM,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        cache_dtype: Any = jnp.float32,
        buckets: Buckets | None = None,
        max_logits_rows: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        #: rows of the forward's picked hidden states: sampled and scored rows,
        #: more than sequences when speculative decoding's guesses are sampled
        #: too (``SchedulerConfig.max_num_logits_rows``)
        self.max_logits_rows = max(max_num_seqs, max_logits_rows or max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # One sequence decoding on the C++ kernels (one device) gets a 1-token
        # program: in the 8-token bucket the matrix-vector kernel multiplies
        # every weight by seven padding tokens as well.
        single = getattr(model, "attention", REFERENCE).kernel == "cpu" and getattr(model, "mesh", None) is None
        base = buckets or Buckets.build(max_num_batched_tokens, max_num_seqs, single_token=single)
        # greedy tokens inside the forward: the decode-sized buckets (up to
        # max_num_seqs tokens, or the smallest padded one), and with guesses
        # the buckets up to max_logits_rows, when the step samples enough rows
        self._plain_greedy_tokens = max(max_num_seqs, next((t for t in base.tokens if t > 1), 1))
        self._greedy_forward_tokens = max(self._plain_greedy_tokens, self.max_logits_rows)
        if buckets is None and self.max_logits_rows > max_num_seqs:
            base = Buckets.build(
                max_num_batched_tokens, max_num_seqs, single_token=single, max_logits_rows=self.max_logits_rows
            )
        self.buckets = base
        # The model carries its kernel choice (the cache layout it reads) and
        # its tensor-parallel mesh (jaxserve.models.sharding): the cache is
        # created in that layout, sharded on its kv heads over the mesh.
        attention = getattr(model, "attention", REFERENCE)
        layout = attention.layout
        #: only the pure-JAX kernel reads the block-major plan (``step_arrays.block_major_plan``);
        #: for the others each step gets the same empty one, no host work
        self.plans_block_major = attention.kernel == REFERENCE.kernel
        self.mesh = getattr(model, "mesh", None)
        #: greedy picks by the C++ one-pass argmax where the C++ kernels serve (one device)
        self.cpu_argmax = attention.kernel == "cpu" and self.mesh is None
        self._replicated = (
            None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )
        #: int32 words of a row's structured-output token mask (``sampler.apply_token_mask``)
        self.num_mask_words = mask_words(model.config.vocab_size)
        #: a longrope model's original context: each step tells it where every row's long factors start
        self.long_rope_original = long_rope_original(model.config)
        self._no_mask: dict[int, jax.Array] = {}  # per seq bucket, see _sampling_arrays
        self.graphdef, self.state = nnx.split(model)
        self.kv_cache = KVCache.create(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=cache_dtype,
            sharding=None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, cache_spec(layout)),
            layout=layout,
        )
        self._forward: dict[int, Any] = {}
        self._sample: dict[int, Any] = {}
        self._greedy: dict[tuple[int, bool], Any] = {}  # (seq bucket, with logprobs)
        self._score: dict[int, Any] = {}  # per seq bucket: label-scoring rows
        self._copy: Any = None  # block copies, max_num_seqs pairs
        self._no_history: dict[int, jax.Array] = {}  # per seq bucket, see _sampling_arrays
        self.compile_seconds = 0.0
        #: share of the usable blocks a decode step must hold for block-major attention
        self.block_major_min_use = BLOCK_MAJOR_MIN_USE
        self.num_block_major_steps = 0
        # prev_tokens when nothing is pending
        self._no_prev = jax.device_put(np.zeros(self.max_logits_rows, np.int32), self._replicated)

    # ------------------------------------------------------------------ jit

    def _forward_fn(self, state, kv_cache, input_ids, positions, meta, greedy, prev_tokens, feed):
        """Forward pass; returns the sampling rows' hidden states, the cache and,
        in steps of at most ``max_num_seqs`` tokens when ``greedy`` is set, the
        greedy tokens of those rows (zeros otherwise). Decode steps of plain
        greedy rows so need no second program: one dispatch and no hand-over
        between programs per step (measured 29.0 -> 28.1 ms for 64 rows).

        Tokens whose ``feed`` entry is ``>= 0`` are read from
        ``prev_tokens[feed]`` (the previous step's greedy tokens, still on
        the device) instead of ``input_ids``."""
        input_ids = jnp.where(feed >= 0, prev_tokens[jnp.maximum(feed, 0)], input_ids)
        # only the sampled and scored rows go on (in programs of more tokens
        # than that, the last layer computes just them: CausalLM.__call__)
        hidden, kv_cache = forward_fn(self.graphdef, state, input_ids, positions, kv_cache, meta, meta.logits_indices)
        rows = min(input_ids.shape[0], self.max_logits_rows)
        if not self._greedy_in_forward(input_ids.shape[0]):
            return hidden, kv_cache, jnp.zeros(self.max_logits_rows, jnp.int32)
        tokens = jax.lax.cond(
            greedy,
            lambda h: self._vocab_argmax(logits_t_fn(self.graphdef, state, h[:rows])),
            lambda h: jnp.zeros(rows, jnp.int32),
            hidden,
        )
        return hidden, kv_cache, jnp.pad(tokens, (0, self.max_logits_rows - rows))

    def _vocab_argmax(self, logits_t: jax.Array) -> jax.Array:
        """``sampler.argmax`` over the vocabulary (axis 0 of ``[V, rows]``):
        the C++ kernel's one pass where it serves, XLA's three otherwise
        (the same tokens: first index of the maximum, 0 for a NaN row)."""
        if self.cpu_argmax and cpu_kernels.vocab_argmax_serves(logits_t):
            return cpu_kernels.vocab_argmax_cpu(logits_t)
        return argmax(logits_t, axis=0)

    def _greedy_in_forward(self, num_tokens: int) -> bool:
        """Whether the forward program of this token bucket can also pick greedy
        tokens: the buckets a decode step uses (up to ``max_num_seqs`` tokens,
        or the smallest padded bucket; with speculative decoding up to
        ``max_logits_rows``, where a step of guesses samples most of its
        tokens)."""
        return num_tokens <= self._greedy_forward_tokens

    def _greedy_in_forward_pays(self, num_tokens: int, num_rows: int) -> bool:
        """Whether a greedy step of ``num_rows`` sampled rows in this bucket
        takes its tokens from the forward program, which computes logits for
        ``min(num_tokens, max_logits_rows)`` rows: always in the
        decode-sized buckets, in the larger ones only when the step samples
        at least half of those rows (guesses), else the greedy program of
        its sequence bucket computes fewer."""
        if not self._greedy_in_forward(num_tokens):
            return False
        return num_tokens <= self._plain_greedy_tokens or 2 * num_rows >= min(num_tokens, self.max_logits_rows)

    def _greedy_fn(self, state, hidden, *, num_rows: int, logprobs: bool):
        """All rows greedy and unpenalized: argmax (and, with ``logprobs``, its
        log-probability; zeros otherwise), with no sort, no penalty scatter and
        no random draws, over logits in the ``[vocab, rows]`` orientation (the
        faster vocabulary matmul). Skipping the log-softmax saves two passes
        over the ``[vocab, rows]`` logits when no request asked for them."""
        logits_t = logits_t_fn(self.graphdef, state, hidden[:num_rows])
        tokens = self._vocab_argmax(logits_t)
        if not logprobs:
            return tokens, jnp.zeros(tokens.shape, jnp.float32)
        return tokens, chosen_logprobs(logits_t, tokens, axis=0)

    def _score_fn(self, state, hidden, targets, offset):
        """Label scoring: the log-probability of each target token at its
        score row, rows ``offset ..`` of the forward's picked hidden states
        (after the sampling rows)."""
        num_rows = targets.shape[0]
        rows = jnp.minimum(offset + jnp.arange(num_rows), hidden.shape[0] - 1)
        logits_t = logits_t_fn(self.graphdef, state, hidden[rows])
        return chosen_logprobs(logits_t, targets, axis=0)

    def _copy_fn(self, kv_cache, src, dst, n):
        """Copy whole blocks ``src[i] -> dst[i]`` for ``i < n`` in every layer
        (a fork's own copy of its parent's partial last block). One
        dynamic-slice update per pair, in place in the donated cache: twice
        as fast as a gather + scatter over padded pairs (measured, 256 pairs
        of 64 KiB blocks), and the padding costs nothing. An int8 cache's
        scales are copied with their blocks (their block axis is the
        values')."""
        axis = 0 if kv_cache.layout == "blocks" else 1

        def copy(a, i):
            block = jax.lax.dynamic_slice_in_dim(a, src[i], 1, axis)
            return jax.lax.dynamic_update_slice_in_dim(a, block, dst[i], axis)

        def body(i, kv):
            return jax.tree.map(lambda a: copy(a, i), kv)

        k, v = jax.lax.fori_loop(0, n, body, (tuple(kv_cache.k), tuple(kv_cache.v)))
        return kv_cache.replace(k, v)

    def _sample_fn(self, state, hidden, tensors):
        num_rows = tensors.temperature.shape[0]
        return sample_with_top(logits_fn(self.graphdef, state, hidden[:num_rows]), tensors)

    def _abstract_meta(self, num_tokens: int) -> AttentionMetadata:
        i32 = jnp.int32
        return AttentionMetadata(
            slot_mapping=_spec((num_tokens,), i32),
            token_seq=_spec((num_tokens,), i32),
            block_tables=_spec((self.max_num_seqs + 1, self.max_blocks_per_seq), i32),
            context_lens=_spec((self.max_num_seqs + 1,), i32),
            logits_indices=_spec((self.max_logits_rows,), i32),
            block_owner=_spec((self.num_blocks,), i32),
            block_index=_spec((self.num_blocks,), i32),
            block_major=_spec((), jnp.bool_),
            long_rope_from=None if self.long_rope_original is None else _spec((self.max_num_seqs + 1,), i32),
        )

    def warmup(self, cache_forward: bool = True) -> None:
        """Compile every bucket ahead of time (hits the persistent cache on
        restart; the forward programs only with ``cache_forward``, see
        ``EngineArgs.cache_forward_programs``)."""
        started = time.perf_counter()
        # with a mesh, weights and cache keep their shardings (other inputs: replicated)
        sharded = self.mesh is not None
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if sharded else None), tree
        )
        state_spec = abstract(self.state)
        cache_spec = abstract(self.kv_cache)
        out_shardings: dict[str, Any] = {}
        if sharded:  # the donated cache comes back as it went in
            out_shardings["out_shardings"] = (
                self._replicated,
                jax.tree.map(lambda x: x.sharding, self.kv_cache),
                self._replicated,
            )
        forward = jax.jit(self._forward_fn, donate_argnums=(1,), **out_shardings)
        with persistent_cache(cache_forward):
            for t in self.buckets.tokens:
                if t not in self._forward:
                    lowered = forward.lower(state_spec, cache_spec, *self._abstract_forward_inputs(t))
                    self._forward[t] = lowered.compile()
        hidden = self._hidden_spec()
        sampler = jax.jit(self._sample_fn)
        greedy = jax.jit(self._greedy_fn, static_argnames=("num_rows", "logprobs"))
        scorer = jax.jit(self._score_fn)
        i32 = jnp.int32
        copy_kw = {"out_shardings": jax.tree.map(lambda x: x.sharding, self.kv_cache)} if sharded else {}
        pairs = jax.ShapeDtypeStruct((self.max_num_seqs,), i32)
        if self._copy is None:
            count = jax.ShapeDtypeStruct((), i32)
            self._copy = (
                jax.jit(self._copy_fn, donate_argnums=(0,), **copy_kw).lower(cache_spec, pairs, pairs, count).compile()
            )
        # score rows stay within max_num_seqs (the scheduler's), guesses never score
        score_seqs = self.buckets.seq_bucket(self.max_num_seqs)
        for s in self.buckets.seqs:
            if s not in self._score and s <= score_seqs:
                rows = jax.ShapeDtypeStruct((s,), i32)
                self._score[s] = scorer.lower(state_spec, hidden, rows, jax.ShapeDtypeStruct((), i32)).compile()
            if s not in self._sample:
                self._sample[s] = sampler.lower(
                    state_spec, hidden, abstract_tensors(s, self.max_model_len, self.num_mask_words)
                ).compile()
                for with_logprobs in (False, True):
                    self._greedy[s, with_logprobs] = greedy.lower(
                        state_spec, hidden, num_rows=s, logprobs=with_logprobs
                    ).compile()
        self.compile_seconds += time.perf_counter() - started
        log.info(
            "runner.compiled",
            token_buckets=list(self.buckets.tokens),
            seq_buckets=list(self.buckets.seqs),
            programs=len(self._forward) + len(self._sample) + len(self._greedy) + len(self._score) + 1,
            seconds=round(self.compile_seconds, 2),
        )

    def forward_program(self, num_tokens: int) -> Any:
        """The compiled forward program a step of ``num_tokens`` tokens runs
        (after :meth:`warmup`): its HLO text names the ops a profile of the
        step shows (``benchmarks/trace_step.py``)."""
        return self._forward[self.buckets.token_bucket(num_tokens)]

    def _hidden_spec(self) -> jax.ShapeDtypeStruct:
        spec = jax.eval_shape(
            self._forward_fn, self.state, self.kv_cache, *self._abstract_forward_inputs(self.buckets.tokens[0])
        )
        return spec[0]

    def _abstract_forward_inputs(self, num_tokens: int) -> tuple:
        """Shapes of ``_forward_fn``'s per-step inputs after state and cache:
        ids, positions, meta, greedy flag, previous tokens, feed."""
        ids = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
        flag = jax.ShapeDtypeStruct((), jnp.bool_)
        prev = jax.ShapeDtypeStruct((self.max_logits_rows,), jnp.int32)
        return ids, ids, self._abstract_meta(num_tokens), flag, prev, ids

    # ----------------------------------------------------------------- step

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Make whole-block copies ``(src, dst)`` in the cache, in order with
        the steps around them (the device runs programs in dispatch order)."""
        for at in range(0, len(copies), self.max_num_seqs):
            chunk = copies[at : at + self.max_num_seqs]
            src = np.zeros(self.max_num_seqs, np.int32)
            dst = np.zeros(self.max_num_seqs, np.int32)
            src[: len(chunk)], dst[: len(chunk)] = zip(*chunk)
            self.kv_cache = self._copy(self.kv_cache, src, dst, np.asarray(len(chunk), np.int32))

    def execute(
        self,
        work: Sequence[SeqWork],
        prev_tokens: jax.Array | None = None,
        block_copies: Sequence[tuple[int, int]] = (),
    ) -> StepResult:
        """Run one step; returns device handles for the sampled tokens.

        ``prev_tokens``: the previous step's ``StepResult.tokens`` when it is
        ``feedable``; rows with ``pending_row`` set read their first token
        from it on the device (the host need not wait for it).
        ``block_copies`` are made first (``copy_blocks``)."""
        if block_copies:
            self.copy_blocks(block_copies)
        step = pack_step(
            work,
            self.buckets,
            max_num_seqs=self.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size,
            long_rope_original=self.long_rope_original,
            max_logits_rows=self.max_logits_rows,
        )
        if not step.has_pending:
            prev_tokens = self._no_prev
        elif prev_tokens is None:
            raise ValueError("a row has a pending token but no prev_tokens were given")
        block_owner, block_index, block_major = block_major_plan(
            step,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            min_use=self.block_major_min_use,
            enabled=self.plans_block_major,
        )
        self.num_block_major_steps += int(block_major)
        meta = _host_meta(
            slot_mapping=step.slot_mapping,
            token_seq=step.token_seq,
            block_tables=step.block_tables,
            context_lens=step.context_lens,
            logits_indices=step.logits_indices,
            block_owner=block_owner,
            block_index=block_index,
            block_major=block_major,
            long_rope_from=step.long_rope_from,
        )
        t_bucket, sampling_rows, num_score_rows = step.t_bucket, step.sampling_rows, step.num_score_rows
        greedy = bool(sampling_rows) and all(is_plain_greedy(r) for r in sampling_rows)
        with_logprobs = greedy and any(r.params.logprobs for r in sampling_rows)
        in_forward = (
            greedy
            and not with_logprobs
            and not num_score_rows
            and self._greedy_in_forward_pays(t_bucket, len(sampling_rows))
        )
        hidden, self.kv_cache, fwd_tokens = self._forward[t_bucket](
            self.state,
            self.kv_cache,
            step.input_ids,
            step.positions,
            meta,
            np.asarray(in_forward),
            prev_tokens,
            step.feed,
        )
        scores = None
        if num_score_rows:
            targets = np.zeros(self.buckets.seq_bucket(num_score_rows), np.int32)
            targets[: len(step.score_targets)] = step.score_targets
            scores = self._score[len(targets)](self.state, hidden, targets, np.asarray(len(sampling_rows), np.int32))
            scores.copy_to_host_async()
        if not sampling_rows:
            return StepResult(
                tokens=np.zeros(0, np.int32),
                logprobs=np.zeros(0, np.float32),
                num_sampled=0,
                scores=scores,
                num_scores=num_score_rows,
            )
        if in_forward:
            fwd_tokens.copy_to_host_async()
            zeros = np.zeros(len(sampling_rows), np.float32)
            # a step's tokens feed the next one's rows one per sequence: not so with guesses
            feedable = not any(w.draft_rows for w in work)
            return StepResult(tokens=fwd_tokens, logprobs=zeros, num_sampled=len(sampling_rows), feedable=feedable)
        s_bucket = self.buckets.seq_bucket(len(sampling_rows))
        top = {}
        if greedy:
            tokens, logprobs = self._greedy[s_bucket, with_logprobs](self.state, hidden)
        else:
            arrays = self._sampling_arrays(sampling_rows, s_bucket)
            tokens, logprobs, top_values, top_ids = self._sample[s_bucket](
                self.state, hidden, SamplingTensors(**arrays)
            )
            if np.any(arrays["top_logprobs"]):
                top_values.copy_to_host_async()
                top_ids.copy_to_host_async()
                top = {"top_logprobs": top_values, "top_ids": top_ids}
        # Start the device-to-host copy now; fetch() then only waits for it.
        tokens.copy_to_host_async()
        logprobs.copy_to_host_async()
        return StepResult(
            tokens=tokens,
            logprobs=logprobs,
            num_sampled=len(sampling_rows),
            scores=scores,
            num_scores=num_score_rows,
            **top,
        )

    def _sampling_arrays(self, rows: list[SamplingRow], s_bucket: int) -> dict:
        if any(r.mask is not None for r in rows):
            arrays = self._history_arrays(rows, s_bucket, self.num_mask_words)
        else:
            # No constrained row: one device array of -1 per bucket stands for
            # the masks (never read: every ``masked`` flag is off).
            arrays = self._history_arrays(rows, s_bucket, 1)
            if s_bucket not in self._no_mask:
                self._no_mask[s_bucket] = jax.device_put(
                    np.full((s_bucket, self.num_mask_words), -1, np.int32), self._replicated
                )
            arrays["token_mask"] = self._no_mask[s_bucket]
        return arrays

    def _history_arrays(self, rows: list[SamplingRow], s_bucket: int, num_mask_words: int) -> dict:
        needs_history = any(r.history is not None for r in rows)
        if needs_history:
            return host_sampling_tensors(rows, s_bucket, self.max_model_len, num_mask_words)
        arrays: dict[str, Any] = host_sampling_tensors(rows, s_bucket, 0, num_mask_words)
        # Without penalties the history is never read: reuse one device array
        # of -1 per bucket instead of shipping [S, max_model_len] every step.
        if s_bucket not in self._no_history:
            self._no_history[s_bucket] = jax.device_put(
                np.full((s_bucket, self.max_model_len), -1, np.int32), self._replicated
            )
        arrays["history"] = self._no_history[s_bucket]
        return arrays
