"""The continuous-batching engine: scheduler + runner + output processing.

One call to :meth:`Engine.step` is one iteration: the scheduler plans which
tokens of which requests to compute (host bookkeeping only), the runner
executes that plan on the device, and the sampled tokens are turned into
text deltas and stop decisions.

The engine is single-threaded by design. The queue worker runs it on its own
thread and talks to it through commands, so nothing here needs locks.

Failure containment
-------------------
A step is a batch: one bad request could make the whole step raise (while
planning, filling the step's arrays, running the device programs or reading
their results), and every request in it would fail with it. Instead, a
failed step is *contained* (see :meth:`Engine.step`): the requests it
touched go back to waiting, are recomputed one at a time in steps of their
own, and only the one that fails alone is finished with an ``internal``
error; the others end exactly as they would have alone. Only when the
device state itself is lost does ``step`` raise :class:`EngineBroken`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.block_allocator import BlockAllocator
from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.cpu_threads import configure as configure_cpu_threads
from jaxserve.engine.output_processor import OutputState
from jaxserve.engine.request import PENDING_TOKEN, Request, RequestStatus
from jaxserve.engine.runner import ModelRunner, SeqWork, StepResult
from jaxserve.engine.sampler import sampler_seed
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.structured import Constraint, StructuredBackend
from jaxserve.engine.types import EngineBroken, RequestClass, RequestError, RequestOutput, SamplingParams

log = structlog.get_logger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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


class Engine:
    """Continuous batching over a paged KV cache.

    Build with :meth:`from_args`, call :meth:`warmup` once (it compiles every
    shape bucket), then feed it with :meth:`add_request` and drive it with
    :meth:`step`.
    """

    def __init__(self, args: EngineArgs) -> None:
        from jaxserve.models.loader import load_model
        from jaxserve.presets import resolve_model
        from jaxserve.tokenizer.tokenizer import Tokenizer

        logging.getLogger("jax").setLevel(logging.WARNING)
        self.args = args
        # before anything starts JAX's backend: XLA's CPU pool sized to the usable CPUs
        self.cpu_threads = configure_cpu_threads()
        enable_compilation_cache(args.compilation_cache_dir)
        folder = Path(resolve_model(args.model))
        self.model_path = folder
        self.model_name = args.served_model_name or args.model
        loaded = load_model(folder, dtype=args.dtype, quantization=args.quantization)
        cfg = loaded.config
        self.model_config = cfg
        self.tokenizer = Tokenizer.from_folder(folder)
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)))
        self.max_model_len = args.resolve_max_model_len(cfg.max_position_embeddings)
        self.max_num_seqs = args.max_num_seqs
        self.interactive_reserved_seqs = args.interactive_reserved_seqs
        params = jax.tree.leaves(loaded.model)
        weight_bytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params if hasattr(p, "dtype"))
        cache_dtype = loaded.model.dtype  # (not a leaf's: a quantized embedding's are int8 and float16)
        self.attention, self.mesh = _place_model(loaded.model, args, cache_dtype)
        self.num_blocks = args.resolve_num_blocks(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            cache_dtype=cache_dtype,
            max_model_len=self.max_model_len,
            weight_bytes=weight_bytes,
        )
        max_batched = args.resolve_max_num_batched_tokens()
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            num_blocks=self.num_blocks,
            policy=args.policy,
            interactive_reserved_seqs=args.interactive_reserved_seqs,
            interactive_reserved_blocks=args.interactive_reserved_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_num_waiting=args.max_num_waiting,
            interactive_prefill_alone=args.interactive_prefill_alone,
            interactive_batch_prefill_tokens=args.interactive_batch_prefill_tokens,
            interactive_recent_s=args.interactive_recent_s,
            interactive_step_tokens=args.interactive_step_tokens,
        )
        self.allocator = BlockAllocator(
            self.num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, self.allocator)
        self.runner = ModelRunner(
            loaded.model,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            num_blocks=self.num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=self.max_model_len,
            cache_dtype=cache_dtype,
        )
        self._states: dict[str, OutputState] = {}
        # Structured output: the grammars (compiled once per distinct
        # constraint) and each constrained request's matcher.
        self.structured = StructuredBackend(folder / "tokenizer.json", cfg.vocab_size, self.eos_token_ids)
        self._constraints: dict[str, Constraint] = {}
        self._top: dict[str, list[tuple[int, float]]] = {}  # top_logprobs of collected, unprocessed tokens
        # Label scoring (add_score_request): groups by their public id, and
        # each member request's group (the parent has the public id itself).
        self._groups: dict[str, _ScoreGroup] = {}
        self._group_of: dict[str, str] = {}
        self._group_outputs: list[RequestOutput] = []  # finished groups, for the next _process
        self.num_computed_tokens = 0  # tokens computed by every step (prefix-cache hits excluded)
        # Every request not yet reported finished, by id (the scheduler forgets
        # a request when it finishes it; recovery from a failed step may have
        # to bring it back, see _recover).
        self._requests: dict[str, Request] = {}
        self._in_flight: tuple[SchedulerOutput, StepResult] | None = None  # dispatched but not collected
        # Failure containment (see step): requests of a failed step, in service
        # order, each to be run alone until it passes a sampling step.
        self._suspects: dict[str, None] = {}
        self._touched: list[SchedulerOutput] = []  # plans the batched step in progress has used
        self._planning = False  # the scheduler is planning (a failure there touches everyone)
        self._broken: EngineBroken | None = None
        self._carried: list[RequestOutput] = []  # outputs of a step() that raised
        self.num_failed_steps = 0  # batched steps that failed and were contained
        self.num_isolated_steps = 0  # steps run for one suspect alone
        self._metrics: dict[str, dict[str, float]] = {}
        self._seed_rng = random.Random(args.seed)
        self.special_token_ids = sorted(set(self.tokenizer.all_special_ids) | set(self.eos_token_ids))
        self.num_steps = 0
        self.async_scheduling = args.async_scheduling
        self.num_overlapped_steps = 0  # steps collected after the next one was launched
        # Called on the engine's thread right before each batched step is
        # planned (inside step(), after the step in flight was collected or,
        # with async scheduling, launched): a caller that queues requests
        # from other threads admits them here, so that a request that arrived
        # while the previous step computed joins this plan, not the next one
        # (the worker's EngineThread does). It must not raise.
        self.before_plan: Callable[[], None] | None = None
        # Called on the engine's thread with the outputs of interactive
        # requests as soon as a step's tokens are collected, before the next
        # step is planned and launched (not pipelined: the caller sees an
        # interactive token one plan-and-launch earlier, which on a busy
        # batch is most of a step's host work). Those outputs are then not in
        # step()'s return value. Only on the pipelined path without async
        # scheduling (there, planning happens before the wait). It must not
        # raise.
        self.on_urgent_outputs: Callable[[list[RequestOutput]], None] | None = None
        concurrency = (self.num_blocks - 1) // self.scheduler_config.max_blocks_per_seq
        log.info(
            "engine.kv_cache",
            num_blocks=self.num_blocks,
            block_size=args.block_size,
            bytes=self.runner.kv_cache.nbytes,
            max_model_len=self.max_model_len,
            concurrency_at_max_model_len=concurrency,
        )

    @classmethod
    def from_args(cls, args: EngineArgs | None = None, **overrides) -> Engine:
        args = dataclasses.replace(args or EngineArgs(), **overrides)
        return cls(args)

    # -------------------------------------------------------------- set-up

    def warmup(self) -> None:
        """Compile every shape bucket before the first request."""
        import threading

        # meanwhile, structured output's tokenizer (StructuredBackend.prepare)
        threading.Thread(target=self.structured.prepare, name="structured-prepare", daemon=True).start()
        self.runner.warmup()

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    # ---------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_class: RequestClass | str = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Queue a request. Raises :class:`RequestError` (with a public error
        code) when it can never run: bad parameters, an over-long prompt, a
        duplicate id, an expired deadline."""
        params = params or SamplingParams()
        params.validate()
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise RequestError(
                "invalid_request", f"top_k must be in [0, {vocab}] (the vocabulary size), got {params.top_k}"
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestError("invalid_request", f"stop_token_ids out of range [0, {vocab}): {bad[:5]}")
        if deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real) or math.isnan(deadline):
                raise RequestError("invalid_request", f"deadline must be a time.monotonic() value, got {deadline!r}")
            if deadline <= time.monotonic():
                raise RequestError("expired", f"request {request_id!r} expired before admission")
        prompt_ids = self._prompt_ids(prompt)
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError("invalid_request", f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(31))
        constraint = None if params.structured is None else self.structured.start(params.structured)
        request = Request(
            request_id,
            prompt_ids,
            params,
            request_class=request_class,
            priority=priority,
            deadline=deadline,
            cache_salt=self.model_name,
        )
        state = OutputState(self.tokenizer, params, self.eos_token_ids, prompt_ids)
        # The scheduler refuses duplicate ids, empty prompts, over-long requests
        # (context_length_exceeded) and a full waiting line (overloaded). After
        # it accepts, nothing here can fail: no half-admitted request.
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        self._states[request_id] = state
        if constraint is not None:
            self._constraints[request_id] = constraint
        self._metrics[request_id] = {"arrival": time.monotonic()}

    def add_score_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        labels: Sequence[Sequence[int]],
        *,
        request_class: RequestClass | str = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Queue a label-scoring request: each label (token ids) is scored as
        a continuation of the prompt, by the sum of its tokens'
        log-probabilities; one finished ``RequestOutput`` carries them in
        ``label_logprobs`` (labels' order), ``prompt_tokens`` = prompt plus
        label tokens, no completion.

        How: the prompt but its last token is prefilled once by a
        prefill-only request; then one fork per label continues it, sharing
        its KV blocks through the block table (a copy of the partial last
        block each), and computes the prompt's last token and the label's
        tokens but the last, every one a score row whose logits give the
        next label token's probability. So the job computes ``len(prompt) -
        1 + sum(len(label))`` tokens whatever the number of labels, and its
        results do not depend on what else is in the batch."""
        vocab = self.model_config.vocab_size
        prompt_ids = self._prompt_ids(prompt)
        try:
            label_ids = [[_token_id(t) for t in label] for label in labels]
        except (TypeError, ValueError) as exc:
            raise RequestError("invalid_request", f"labels must be lists of token ids: {exc}") from None
        if not prompt_ids:
            raise RequestError("invalid_request", f"request {request_id!r} has an empty prompt")
        if not 1 <= len(label_ids) <= MAX_SCORE_LABELS or any(not ids for ids in label_ids):
            raise RequestError("invalid_request", f"give 1 to {MAX_SCORE_LABELS} labels of at least one token each")
        bad = [t for t in prompt_ids + [t for ids in label_ids for t in ids] if not 0 <= t < vocab]
        if bad:
            raise RequestError("invalid_request", f"token ids out of range [0, {vocab}): {bad[:5]}")
        longest = max(len(ids) for ids in label_ids)
        if len(prompt_ids) + longest > self.max_model_len:
            raise RequestError(
                "context_length_exceeded",
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and the longest label {longest}",
            )
        if deadline is not None and deadline <= time.monotonic():
            raise RequestError("expired", f"request {request_id!r} expired before admission")
        if request_id in self._groups or self.scheduler.get_request(request_id) is not None:
            raise RequestError("invalid_request", f"duplicate request id {request_id!r}: it is still in progress")
        greedy1 = SamplingParams(max_tokens=1, temperature=0.0)
        kw: dict[str, Any] = dict(request_class=request_class, priority=priority, cache_salt=self.model_name)
        n_prompt = len(prompt_ids)
        children = []
        for i, ids in enumerate(label_ids):
            child = Request(f"{request_id}\x1flabel{i}", prompt_ids + ids[:-1], greedy1, **kw)
            child.score_from = n_prompt - 1
            child.score_targets = list(ids)
            children.append(child)
        group = _ScoreGroup(
            request_id,
            [c.request_id for c in children],
            [len(ids) for ids in label_ids],
            n_prompt + sum(len(ids) for ids in label_ids),
        )
        if n_prompt > 1:
            parent = Request(request_id, prompt_ids[:-1], greedy1, deadline=deadline, **kw)
            parent.prefill_only = True
            parent.fork_children = children
            self.scheduler.add_request(parent)
            members = [parent, *children]
        else:  # nothing to share: the forks start from scratch
            for child in children:
                self.scheduler.add_request(child)
            members = children
        for req in members:
            self._requests[req.request_id] = req
            self._states[req.request_id] = OutputState(self.tokenizer, greedy1, self.eos_token_ids, None)
            self._group_of[req.request_id] = request_id
            self._metrics[req.request_id] = {}
        self._groups[request_id] = group
        self._metrics[request_id] = {"arrival": time.monotonic()}  # the job's (its parent's, when it has one)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt as token ids: a string is encoded, a sequence must hold
        integers (``RequestError`` otherwise)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        try:
            return [_token_id(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise RequestError("invalid_request", f"prompt must be a string or a list of token ids: {exc}") from None

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Returns whether it existed."""
        group = self._groups.get(request_id)
        if group is not None:
            self._end_group(group)
            return True
        existed = self.scheduler.abort(request_id)
        self._forget(request_id)
        return existed

    def _end_group(self, group: _ScoreGroup) -> None:
        """Abort whatever of a scoring job is still running and forget it."""
        self.scheduler.abort(group.request_id)  # the parent, with its unstarted forks
        for rid in group.children:
            self.scheduler.abort(rid)
        for rid in (group.request_id, *group.children):
            self._forget(rid)
            self._group_of.pop(rid, None)
        self._groups.pop(group.request_id, None)
        self._metrics.pop(group.request_id, None)

    def _record_scores(self, plan: SchedulerOutput, scores: np.ndarray) -> None:
        """Apply a collected step's score rows, and finish the scoring jobs
        whose every label is complete."""
        at = 0
        for s in plan.scheduled:
            n = len(s.score_targets)
            if not n:
                if s.request_id in self._groups:
                    parent = self.scheduler.get_request(s.request_id)
                    if parent is not None and parent.status == RequestStatus.PARKED:
                        # its forks take over; a recovery must not recompute it
                        self._states.pop(s.request_id, None)
                continue
            values = scores[at : at + n]
            at += n
            gid = self._group_of.get(s.request_id)
            group = self._groups.get(gid) if gid is not None else None
            if group is None:
                continue
            first = s.start_position + s.num_scheduled_tokens - n
            got = group.scores.setdefault(s.request_id, {})
            for j, value in enumerate(values):
                got[first + j] = float(value)  # by position: a recomputation overwrites
            if self.scheduler.get_request(s.request_id) is None:  # all its rows computed
                self._forget(s.request_id)
        for group in [g for g in self._groups.values() if g.complete]:
            out = group.output(self._metrics.get(group.request_id, {}))
            self._end_group(group)
            self._group_outputs.append(out)

    def _route_group_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs of a scoring job's member requests become the job's: a
        member's failure fails the job (the rest is aborted)."""
        routed = []
        for out in outputs:
            gid = self._group_of.get(out.request_id)
            if gid is None:
                routed.append(out)
                continue
            group = self._groups.get(gid)
            if group is None or not out.finished:
                continue
            self._end_group(group)
            routed.append(dataclasses.replace(out, request_id=gid, prompt_tokens=group.prompt_tokens))
        return routed

    def _forget(self, request_id: str) -> None:
        """Drop the engine's own records of a request that ended."""
        self._states.pop(request_id, None)
        self._metrics.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._suspects.pop(request_id, None)
        self._constraints.pop(request_id, None)
        self._top.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # --------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the progress of every request it touched.

        Pipelined so the host works while the device computes: the step
        dispatched by the previous call is collected first (its tokens are
        applied to the scheduler, and EOS / stop ids / length end requests at
        once), the next step is planned and dispatched asynchronously, and only
        then is the collected step detokenized and checked for stop strings,
        while the device runs the new one. A request that a stop string ends
        was already part of the new step: its extra token is dropped.

        With ``async_scheduling``, when the in-flight step's tokens stay on
        the device (all-greedy steps), the next step is launched before the
        wait instead (``_collect_overlapped``).

        Interactive first in time (with ``on_urgent_outputs`` set, as the
        worker does): the collected tokens of interactive requests are
        processed and handed over before the next step is planned, and when
        the step just launched is an interactive prompt's own (the scheduler
        gives one to a starting interactive prompt), it is waited for at once
        and its first tokens handed over in this call, before the batch rows
        collected earlier are processed.

        Failure containment. An exception while one request's token is
        detokenized fails that request alone (``_process``). Any other
        exception (while planning, building the step's arrays, running the
        device programs or fetching their results) cannot be pinned on one
        request of the batch, so ``_recover``:

        - drops the in-flight step and sends every request the failed work
          touched (the collected step's and the new plan's; everyone's when
          planning itself failed) back to waiting with its KV blocks freed,
          since their cache contents are not trusted, and with only the
          tokens already delivered to the caller: tokens the failed step
          produced are sampled again. Recomputation is exact: greedy tokens
          are a function of the tokens, and a seeded draw is
          ``fold_in(seed, output_index)``, as for preemption;
        - marks those requests *suspects*. While there are suspects, each
          step runs the first of them alone (``Scheduler.schedule_isolated``,
          not pipelined) until it has passed a step in which it sampled a
          token (it is cleared and rejoins the batch) or failed alone (it is
          finished with ``RequestOutput.error = RequestError('internal',
          ..., retryable=True)``). Other requests wait meanwhile.

        So only the request that makes steps fail is failed, at the price of
        recomputing the others once. A request that passes alone and later
        fails again in a batch (a failure that depends on its progress) is
        isolated again: each round it advances at least one token, so it
        ends. The one thing recovery cannot repair is the device: when the
        failure deleted (donated) or poisoned the KV cache buffers, ``step``
        raises :class:`EngineBroken` now and at every later call. ``step``
        also re-raises a failure that touched no request at all.
        """
        if self._broken is not None:
            raise EngineBroken(str(self._broken)) from self._broken
        # Outputs of a call that raised are returned by the next one.
        outputs, self._carried = self._carried, []
        try:
            outputs.extend(self._expire_waiting())
            for request_id in [rid for rid in self._suspects if not self._schedulable(rid)]:
                del self._suspects[request_id]  # ended meanwhile (aborted, expired), or parked
            if self._suspects:
                outputs.extend(self._step_isolated(next(iter(self._suspects))))
            else:
                outputs.extend(self._step_batched())
            outputs = self._route_group_outputs(outputs)
        except BaseException:
            self._carried = outputs
            raise
        return outputs

    def _schedulable(self, request_id: str) -> bool:
        req = self.scheduler.get_request(request_id)
        return req is not None and req.status != RequestStatus.PARKED

    def _step_batched(self) -> list[RequestOutput]:
        """The pipelined step of ``step``, with its failures contained."""
        self._touched = [] if self._in_flight is None else [self._in_flight[0]]
        extra = None
        try:
            if self.async_scheduling and self._in_flight is not None and self._in_flight[1].feedable:
                collected = self._collect_overlapped()
            else:
                collected = self._collect()
                if collected is not None and self.on_urgent_outputs is not None:
                    collected = self._emit_urgent(*collected)
                self._dispatch()
                if self.on_urgent_outputs is not None and self._first_tokens_in_flight():
                    # An interactive prompt's own step (the scheduler gives it
                    # one): wait for it now and hand its first tokens over,
                    # instead of first processing the collected batch rows.
                    more = self._emit_urgent(*self._collect())
                    self._dispatch()
                    if more[0]:
                        extra = more
        except Exception as exc:  # noqa: BLE001 - contained, see step's docstring
            self._recover(exc)
            return []
        finally:
            self._touched = []
            self._planning = False
        outputs = [] if collected is None else self._process(*collected)
        if extra is not None:
            outputs.extend(self._process_tokens(*extra))
        return outputs

    def _first_tokens_in_flight(self) -> bool:
        """Whether the step in flight holds interactive requests only (no
        scoring group's members), one of them about to sample its first
        token."""
        if self._in_flight is None:
            return False
        first = False
        for s in self._in_flight[0].scheduled:
            req = self._requests.get(s.request_id)
            if req is None or req.request_class is not RequestClass.INTERACTIVE or s.request_id in self._group_of:
                return False
            state = self._states.get(s.request_id)
            first = first or (s.sample and state is not None and not state.token_ids)
        return first

    def _emit_urgent(self, sampled, sampled_logprobs, finished_by_length):
        """Process the collected tokens of interactive requests now and hand
        their outputs to ``on_urgent_outputs``; returns the rest of the
        collected step for ``_process`` after the next launch. Members of a
        scoring group are never urgent (their outputs are the group's)."""
        urgent = {}
        for rid in sampled:
            req = self._requests.get(rid)
            if req is not None and req.request_class is RequestClass.INTERACTIVE and rid not in self._group_of:
                urgent[rid] = sampled[rid]
        if not urgent:
            return sampled, sampled_logprobs, finished_by_length
        rest = {rid: tok for rid, tok in sampled.items() if rid not in urgent}
        outputs = self._process_tokens(urgent, sampled_logprobs, finished_by_length)
        if outputs:
            self.on_urgent_outputs(outputs)
        return rest, sampled_logprobs, finished_by_length

    def _fault_point(self, stage: str, request_ids: Sequence[str]) -> None:
        """Test seam; does nothing. Called with the ids of the requests
        concerned at ``"execute"`` (right before the runner launches a plan),
        ``"fetch"`` (before a launched step's tokens are fetched) and
        ``"process"`` (before one request's token is detokenized). Tests
        replace it to raise for a chosen request, as a failing array build,
        device program, fetch or detokenizer would."""

    def _dispatch(self, prev: tuple[jax.Array, dict[str, int]] | None = None) -> None:
        """Plan and launch the next step. ``prev``: the in-flight step's device
        tokens and each sampling request's row in them, for tokens still
        pending (see ``_collect_overlapped``)."""
        if self.before_plan is not None:
            self.before_plan()
        self._planning = True
        plan = self.scheduler.schedule()
        self._planning = False
        self._touched.append(plan)
        if not plan.is_empty:
            self._launch(plan, prev)

    def _launch(self, plan: SchedulerOutput, prev: tuple[jax.Array, dict[str, int]] | None = None) -> None:
        """Build a plan's work and launch it on the device (``_in_flight``)."""
        now = time.monotonic()
        work = []
        for s in plan.scheduled:
            req = cast(Request, self.scheduler.get_request(s.request_id))  # scheduled: it is there
            self._metrics[s.request_id].setdefault("first_scheduled", now)
            pending_row = None
            if PENDING_TOKEN in s.token_ids:
                if prev is None or s.num_scheduled_tokens != 1:
                    raise RuntimeError(f"request {s.request_id!r} was planned with a pending token out of place")
                pending_row = prev[1][s.request_id]
            work.append(
                SeqWork(
                    token_ids=s.token_ids,
                    start_pos=s.start_position,
                    block_ids=s.block_ids,
                    sampling=self._sampling_row(req) if s.sample else None,
                    pending_row=pending_row,
                    score_targets=s.score_targets,
                )
            )
        self._fill_masks(work)
        self._fault_point("execute", [s.request_id for s in plan.scheduled])
        result = self.runner.execute(
            work, prev_tokens=None if prev is None else prev[0], block_copies=plan.block_copies
        )
        self._in_flight = (plan, result)
        self.num_steps += 1
        self.num_computed_tokens += plan.total_num_scheduled_tokens

    def _step_isolated(self, request_id: str) -> list[RequestOutput]:
        """One step of a suspect alone, not pipelined, so that a failure
        anywhere in it is this request's (see ``step``)."""
        self.num_isolated_steps += 1
        try:
            plan = self.scheduler.schedule_isolated(request_id)
            self._launch(plan)
            collected = self._collect()
            outputs = self._process(*collected)
        except Exception as exc:  # noqa: BLE001 - it failed alone: it is the culprit
            self._in_flight = None
            self._raise_if_device_lost(exc)
            failed = self._fail_request(request_id, exc)
            return [] if failed is None else [failed]
        req = self.scheduler.get_request(request_id)
        if plan.scheduled[0].sample or req is None or not req.samples:
            self._suspects.pop(request_id, None)  # passed a whole step alone
        return outputs

    def _recover(self, exc: Exception) -> None:
        """Contain a failed batched step (see ``step``)."""
        plans = list(self._touched)
        if self._in_flight is not None:
            plans.append(self._in_flight[0])
            self._in_flight = None
        self._raise_if_device_lost(exc)
        involved = list(dict.fromkeys(s.request_id for plan in plans for s in plan.scheduled))
        if self._planning:
            involved.extend(rid for rid in self.scheduler.requests if rid not in involved)
        restore = [self._requests[rid] for rid in involved if rid in self._states]
        if not restore:
            raise exc
        policy = self.scheduler_config.policy
        restore.sort(key=lambda r: r.sort_key(policy))
        try:
            # Worst first, so the best ends up at the front of its queue.
            for req in reversed(restore):
                self.scheduler.reset_for_recompute(req, self._states[req.request_id].num_tokens_seen)
        except Exception as recovery_exc:
            self._broken = EngineBroken(
                f"recovering from a failed step ({exc!r}) failed: {recovery_exc!r}; the engine's state is lost"
            )
            raise self._broken from recovery_exc
        for req in restore:
            self._suspects[req.request_id] = None
        self.num_failed_steps += 1
        log.warning(
            "engine.step_failed",
            error=repr(exc),
            suspects=[r.request_id for r in restore],
            exc_info=exc,
        )

    def _raise_if_device_lost(self, exc: Exception) -> None:
        """Raise ``EngineBroken`` (from ``exc``) when the failure took the
        device state with it: a KV cache or weight buffer was deleted (a
        failing call that had it donated), or the cache holds a failed
        computation. Called with no step in flight."""
        lost = None
        arrays = jax.tree.leaves(self.runner.kv_cache) + jax.tree.leaves(self.runner.state)
        if any(a.is_deleted() for a in arrays if isinstance(a, jax.Array)):
            lost = "a KV cache or weight buffer was deleted"
        else:
            try:
                jax.block_until_ready(self.runner.kv_cache)
            except Exception as cache_exc:  # noqa: BLE001
                lost = f"the KV cache holds a failed computation ({cache_exc!r})"
        if lost is not None:
            self._broken = EngineBroken(f"engine step failed and {lost}: {exc!r}; restart the engine")
            raise self._broken from exc

    def _fail_request(self, request_id: str, exc: Exception) -> RequestOutput | None:
        """End a request whose own work raised, with an ``internal`` error."""
        log.error("engine.request_failed", request_id=request_id, error=repr(exc), exc_info=exc)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)  # no-op if it already ended
        state = self._states.get(request_id)
        if state is None:
            self._forget(request_id)
            return None
        return self._ended_with(
            request_id, state, RequestError("internal", f"engine step failed for this request: {exc!r}", retryable=True)
        )

    def _ended_with(self, request_id: str, state: OutputState, error: RequestError) -> RequestOutput:
        """The final output of a request ended by ``error`` (the scheduler
        already finished it); the engine forgets it."""
        metrics = self._metrics.get(request_id, {})
        self._forget(request_id)
        metrics["finished"] = time.monotonic()
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            prompt_tokens=state.num_prompt_tokens,
            completion_tokens=len(state.token_ids),
            error=error,
            metrics=metrics,
        )

    def _collect_overlapped(self):
        """``_collect`` and ``_dispatch`` with the next step launched *before*
        waiting for the in-flight one (vLLM's async scheduling).

        The in-flight step's sampled tokens enter the scheduler as pending
        placeholders; the next step is planned and launched at once, reading
        those tokens on the device; only then does the host wait, fill the
        placeholders in, and end requests that hit a stop id (they already
        hold a row in the launched step, whose token for them is dropped, as
        for stop strings). The device so never idles while the host plans.
        Used when the in-flight step's tokens came from the forward program's
        greedy pick (``StepResult.feedable``)."""
        plan, result = self._in_flight
        self._in_flight = None
        self.num_overlapped_steps += 1
        sampling = [s.request_id for s in plan.scheduled if s.sample]
        requests = {rid: self.scheduler.get_request(rid) for rid in sampling}
        placeholders = dict.fromkeys(sampling, PENDING_TOKEN)
        finished_by_length = set(self.scheduler.update_from_output(plan, placeholders))
        self._dispatch(prev=(result.tokens, {rid: i for i, rid in enumerate(sampling)}))
        self._fault_point("fetch", [s.request_id for s in plan.scheduled])
        sampled, sampled_logprobs = _by_request(sampling, *result.fetch())
        for request_id, token in sampled.items():
            req = requests[request_id]
            if req is not None and req.pending_index is not None:
                req.resolve_pending(token)
        self._record_scores(plan, result.fetch_scores())  # (a feedable step has no score rows; parents may park)
        self._finish_stopped(sampled, finished_by_length)
        return sampled, sampled_logprobs, finished_by_length

    def _collect(self):
        """Wait for the in-flight step and apply its tokens to the scheduler."""
        if self._in_flight is None:
            return None
        plan, result = self._in_flight
        self._in_flight = None
        sampling = [s.request_id for s in plan.scheduled if s.sample]
        self._fault_point("fetch", [s.request_id for s in plan.scheduled])
        sampled, sampled_logprobs = _by_request(sampling, *result.fetch())
        self._keep_top(sampling, result.fetch_top())
        scores = result.fetch_scores()
        finished_by_length = set(self.scheduler.update_from_output(plan, sampled))
        self._record_scores(plan, scores)
        self._finish_stopped(sampled, finished_by_length)
        return sampled, sampled_logprobs, finished_by_length

    def _finish_stopped(self, sampled: dict[str, int], finished_by_length: set[str]) -> None:
        # EOS / stop id: end it before the next plan, so it takes no slot there.
        for request_id, token in sampled.items():
            state = self._states.get(request_id)
            if state is not None and token in state.stop_ids and request_id not in finished_by_length:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def _process(self, sampled, sampled_logprobs, finished_by_length) -> list[RequestOutput]:
        """Detokenize collected tokens, apply stop strings, build outputs.

        Each request's token is handled on its own: when that raises (the
        detokenizer, a stop check), the failure is this request's, and it
        alone is finished with an ``internal`` error."""
        outputs, self._group_outputs = self._group_outputs, []
        outputs.extend(self._process_tokens(sampled, sampled_logprobs, finished_by_length))
        return outputs

    def _process_tokens(self, sampled, sampled_logprobs, finished_by_length) -> list[RequestOutput]:
        """``_process`` for the requests of ``sampled`` only."""
        outputs = []
        now = time.monotonic()
        for request_id, token in sampled.items():
            state = self._states.get(request_id)
            if state is None:  # aborted while the step ran
                continue
            try:
                self._fault_point("process", [request_id])
                metrics = self._metrics[request_id]
                metrics.setdefault("first_token", now)
                constraint = self._constraints.get(request_id)
                if constraint is not None and constraint.error is not None:
                    outputs.append(self._fail_structured(request_id, state, constraint.error))
                    continue
                verdict = state.add_token(
                    token,
                    sampled_logprobs[request_id] if state.params.logprobs else None,
                    self._top.pop(request_id, None),
                )
                finish = verdict.finish_reason
                if finish is None and request_id in finished_by_length:
                    finish = "length"  # max_model_len reached before max_tokens
                    verdict.delta += state.force_finish("length")
                elif finish is not None and request_id not in finished_by_length:
                    # A stop string (or stop id, already ended in _collect: then a no-op).
                    self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
                out = self._output(request_id, state, verdict.delta, [token] if verdict.accepted else [], finish, now)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failed = self._fail_request(request_id, exc)
                if failed is not None:
                    outputs.append(failed)
                continue
            outputs.append(out)
        return outputs

    def _output(self, request_id, state, delta, new_ids, finish, now) -> RequestOutput:
        metrics = self._metrics[request_id]
        out = RequestOutput(
            request_id=request_id,
            new_token_ids=new_ids,
            new_text=delta,
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=state.num_prompt_tokens,
            completion_tokens=len(state.token_ids),
            metrics=metrics,
        )
        if finish is not None:
            metrics["finished"] = now
            out.text = state.text
            out.token_ids = list(state.token_ids)
            out.logprobs = list(state.logprobs) if state.params.logprobs else None
            out.top_logprobs = list(state.top_logprobs) if state.params.logprobs and state.params.top_logprobs else None
            self._forget(request_id)
        return out

    def _expire_waiting(self) -> list[RequestOutput]:
        """Fail waiting requests past their deadline. A deadline gates only
        work that has produced nothing yet: ``Request.is_expired`` is false
        once the request has its first output token, so a request preempted
        back to waiting after that (or recomputed after a failed step) is
        never expired; neither is a running one."""
        outputs = []
        now = time.monotonic()
        for request_id in self.scheduler.expired_request_ids(now):
            req = self.scheduler.get_request(request_id)
            if req is None or req.status == RequestStatus.RUNNING:
                continue  # deadlines gate admission and waiting, not running work
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            state = self._states.get(request_id)
            metrics = self._metrics.get(request_id, {})
            self._forget(request_id)
            metrics["finished"] = now
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason="error",
                    prompt_tokens=state.num_prompt_tokens if state else 0,
                    error=RequestError("expired", f"request {request_id!r} passed its deadline while waiting"),
                    metrics=metrics,
                )
            )
        return outputs

    def _sampling_row(self, req: Request) -> dict:
        p = req.sampling_params
        row: dict[str, Any] = {
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "seed": sampler_seed(cast(int, p.seed)),  # add_request gave it one
            "output_index": req.num_output_tokens,
            "repetition_penalty": p.repetition_penalty,
            "frequency_penalty": p.frequency_penalty,
            "presence_penalty": p.presence_penalty,
            "logprobs": p.logprobs,
            "top_logprobs": p.top_logprobs if p.logprobs else 0,
        }
        constraint = self._constraints.get(req.request_id)
        if constraint is not None:
            row["constraint"] = (constraint, req.output_token_ids)  # its mask: _fill_masks, the step's rows at once
        if p.has_penalties:
            row["history"] = req.all_token_ids
            row["num_prompt"] = req.num_prompt_tokens
        return row

    def _fill_masks(self, work: list[SeqWork]) -> None:
        """Structured output: the token masks of a step's constrained rows,
        computed together (``StructuredBackend.fill_masks``)."""
        rows = [w.sampling for w in work if w.sampling is not None and "constraint" in w.sampling]
        if not rows:
            return
        masks = self.structured.fill_masks([row.pop("constraint") for row in rows])
        for row, mask in zip(rows, masks):
            row["mask"] = mask

    def _keep_top(self, request_ids: list[str], top) -> None:
        """Hold the ``top_logprobs`` alternatives of collected tokens until
        ``_process_tokens`` gives them to the request's output state."""
        if top is None:
            return
        values, ids = top
        for row, request_id in enumerate(request_ids):
            state = self._states.get(request_id)
            n = state.params.top_logprobs if state is not None and state.params.logprobs else 0
            if n:
                self._top[request_id] = list(zip(ids[row, :n].tolist(), values[row, :n].tolist()))

    def _fail_structured(self, request_id: str, state: OutputState, message: str) -> RequestOutput:
        """End a request whose grammar failed mid-generation (that request
        alone; not retryable: the same grammar fails the same way)."""
        log.warning("engine.structured_failed", request_id=request_id, error=message)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        return self._ended_with(request_id, state, RequestError("internal", message, retryable=False))


def _place_model(model, args: EngineArgs, cache_dtype):
    """Kernel choice and tensor-parallel placement of a freshly loaded model
    (``EngineArgs.attention_backend``, ``EngineArgs.tensor_parallel_size``);
    returns ``(AttentionImpl, mesh or None)``. Refuses a tensor-parallel size
    that does not divide the kv heads."""
    from jaxserve.kernels.backends import select_attention
    from jaxserve.models.sharding import shard_model, tensor_parallel_mesh

    cfg = model.config
    mesh = tensor_parallel_mesh(cfg, args.tensor_parallel_size)
    attention, reason = select_attention(
        args.attention_backend,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads,
        block_size=args.block_size,
        sliding_window=cfg.effective_sliding_window,
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
        reason=reason,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    return attention, mesh


def _token_id(value) -> int:
    """A prompt token id: an integer (not a bool), else ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"token id {value!r} is not an integer")
    return int(value)


def _by_request(
    request_ids: list[str], tokens: np.ndarray, logprobs: np.ndarray
) -> tuple[dict[str, int], dict[str, float]]:
    """A step's sampled tokens and log-probabilities keyed by request, in
    the order the plan's sampling requests were given (``tolist`` makes the
    Python numbers in one call: ``int()`` per numpy scalar took ~5% of the
    engine thread's samples in a 64-sequence offline run, py-spy)."""
    sampled = dict(zip(request_ids, np.asarray(tokens).tolist()))
    return sampled, dict(zip(request_ids, np.asarray(logprobs).tolist()))


#: at most this many labels per scoring request (the wire allows 64)
MAX_SCORE_LABELS = 256


@dataclasses.dataclass
class _ScoreGroup:
    """A label-scoring request: its forks (one per label, in order), their
    score rows' log-probabilities by position, and the prompt + label tokens
    it reports."""

    request_id: str
    children: list[str]
    label_lengths: list[int]
    prompt_tokens: int
    scores: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(len(self.scores.get(c, ())) == n for c, n in zip(self.children, self.label_lengths))

    def output(self, metrics: dict[str, float]) -> RequestOutput:
        now = time.monotonic()
        metrics.setdefault("first_token", now)
        metrics["finished"] = now
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="stop",
            prompt_tokens=self.prompt_tokens,
            completion_tokens=0,
            label_logprobs=[sum(self.scores[c].values()) for c in self.children],
            metrics=metrics,
        )
