"""The continuous-batching engine: scheduler + runner + output processing.

One call to :meth:`Engine.step` is one iteration: the scheduler plans which
tokens of which requests to compute (host bookkeeping only), the runner
executes that plan on the device, and the sampled tokens are turned into
text deltas and stop decisions.

The engine is single-threaded by design. The queue worker runs it on its own
thread and talks to it through commands, so nothing here needs locks.

The step itself is one of four run modes (:mod:`jaxserve.engine.step_modes`),
each composed of the step parts the engine offers them (``schedule``,
``launch``, ``collect``, ``process``: the ``StepParts`` protocol); a failed
step is contained so that only its culprit fails
(:mod:`jaxserve.engine.containment`, whose books the engine holds in
``containment``); label scoring keeps its books in
:mod:`jaxserve.engine.score_processor`. What is left here is the
:class:`Engine` itself: its per-request state (requests, output states,
constraints, the step in flight) and the step parts, which read and write
that state on every step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import jax
import numpy as np
import structlog

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.block_allocator import BlockAllocator
from jaxserve.engine.containment import Containment
from jaxserve.engine.cpu_threads import configure as configure_cpu_threads
from jaxserve.engine.host_memory import release_free_heap
from jaxserve.engine.in_flight import Collected, InFlight, Pending, by_request
from jaxserve.engine.output_processor import OutputState
from jaxserve.engine.placement import enable_compilation_cache, place_model
from jaxserve.engine.request import PENDING_TOKEN, Request, RequestStatus
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.score_processor import ScoreProcessor
from jaxserve.engine.speculative import Drafter, accepted_run
from jaxserve.engine.step_inputs import draft_rows, grammar_masks, sampling_row, seq_work
from jaxserve.engine.step_modes import choose
from jaxserve.engine.structured import Constraint, StructuredBackend
from jaxserve.engine.types import PriorOutput, RequestClass, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


def stop_token_ids(tokenizer, cfg) -> tuple[int, ...]:
    """The tokens that end generation: the tokenizer's and the config's eos
    ids, and every end-of-turn token of the model's family that its
    vocabulary has (``<end_of_turn>``, ``<|im_end|>``: a chat template ends a
    turn with one, and a model that ends its answer there must stop)."""
    from jaxserve.models.registry import family

    ids = set(tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
    for token in family(cfg.family).end_of_turn:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            ids.add(token_id)
    return tuple(sorted(ids))


class Engine:
    """Continuous batching over a paged KV cache.

    Build with :meth:`from_args`, call :meth:`warmup` once (it compiles every
    shape bucket), then feed it with :meth:`add_request` and drive it with
    :meth:`step`.
    """

    def __init__(self, args: EngineArgs) -> None:
        from jaxserve.models.loader import load_model
        from jaxserve.models.registry import family
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
        # a family without a system role folds a system message into the first user turn
        self.tokenizer = Tokenizer.from_folder(folder, fold_system=family(cfg.family).fold_system)
        self.eos_token_ids = stop_token_ids(self.tokenizer, cfg)
        self.max_model_len = args.resolve_max_model_len(cfg.max_position_embeddings)
        self.max_num_seqs = args.max_num_seqs
        self.interactive_reserved_seqs = args.interactive_reserved_seqs
        params = jax.tree.leaves(loaded.model)
        weight_bytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params if hasattr(p, "dtype"))
        # --kv-cache-dtype; auto: the model's (not a leaf's: a quantized embedding's are int8 and float16)
        cache_dtype = args.resolve_kv_cache_dtype(loaded.model.dtype)
        self.attention, self.mesh = place_model(loaded.model, args, cache_dtype)
        #: the KV cache's size and why (logged below; the worker prints it at start)
        self.kv_cache_size = args.size_kv_cache(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            cache_dtype=cache_dtype,
            max_model_len=self.max_model_len,
            weight_bytes=weight_bytes,
        )
        self.num_blocks = self.kv_cache_size.num_blocks
        max_batched = args.resolve_max_num_batched_tokens()
        self.scheduler_config = args.scheduler_config(max_model_len=self.max_model_len, num_blocks=self.num_blocks)
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
            max_logits_rows=self.scheduler_config.max_num_logits_rows,
        )
        self._states: dict[str, OutputState] = {}
        # Structured output: the grammars (compiled once per distinct
        # constraint) and each constrained request's matcher.
        self.structured = StructuredBackend(folder / "tokenizer.json", cfg.vocab_size, self.eos_token_ids)
        self._constraints: dict[str, Constraint] = {}
        # top_logprobs of collected, unprocessed tokens: per request, one list per new token
        self._top: dict[str, list[list[tuple[int, float]]]] = {}
        # Speculative decoding (num_speculative_tokens > 0): the scheduler asks
        # the drafter for guesses, collect() keeps those the model agrees with.
        spec = args.speculative_config()
        self.drafter: Drafter | None = None
        if spec.num_speculative_tokens:
            self.drafter = Drafter(spec, self.runner.buckets.tokens, self._constraints, self._stop_ids)
            self.scheduler.drafter = self.drafter
        self.num_computed_tokens = 0  # tokens computed by every step (prefix-cache hits excluded)
        # Every request not yet reported finished, by id (the scheduler forgets
        # a request when it finishes it; recovery from a failed step may have
        # to bring it back, see Containment.recover).
        self._requests: dict[str, Request] = {}
        self._in_flight: InFlight | None = None  # launched, not collected; the step modes take and return it
        #: failure containment's books: suspects, touched plans, lost state (see step)
        self.containment = Containment()
        self._carried: list[RequestOutput] = []  # outputs of a step() that raised
        self._metrics: dict[str, dict[str, float]] = {}
        # label scoring (add_score_request): its jobs and their members
        self.scores = ScoreProcessor(self.scheduler, self._states, self._metrics, self._forget)
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
            dtype=self.kv_cache_size.dtype,
            bytes_per_token=self.kv_cache_size.bytes_per_token,
            max_model_len=self.max_model_len,
            concurrency_at_max_model_len=concurrency,
            reason=self.kv_cache_size.reason,
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
        self.runner.warmup(cache_forward=self.args.cache_forward_programs)
        release_free_heap()

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
        prior: PriorOutput | None = None,
    ) -> None:
        """Queue a request. Raises :class:`RequestError` (with a public error
        code) when it can never run: bad parameters, an over-long prompt, a
        duplicate id, an expired deadline, a ``prior`` output it cannot have
        produced.

        ``prior``: output an earlier run of this request produced (a worker
        that died mid-generation saved it). It is computed with the prompt
        and generation goes on after it, as the earlier run would have gone
        on (``_resume``); the first output's ``new_text`` carries its text."""
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
        state, output_ids = self._resume(request_id, params, prompt_ids, prior, constraint)
        request = Request(
            request_id,
            prompt_ids,
            params,
            request_class=request_class,
            priority=priority,
            deadline=deadline,
            cache_salt=self._cache_salt(len(prompt_ids)),
            output_token_ids=output_ids,
        )
        # The scheduler refuses duplicate ids, empty prompts, over-long requests
        # (context_length_exceeded) and a full waiting line (overloaded). After
        # it accepts, nothing here can fail: no half-admitted request.
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        self._states[request_id] = state
        if constraint is not None:
            self._constraints[request_id] = constraint
        self._metrics[request_id] = {"arrival": time.monotonic()}

    def _resume(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_ids: list[int],
        prior: PriorOutput | None,
        constraint: Constraint | None,
    ) -> tuple[OutputState, list[int]]:
        """A new request's output state, and the output it starts with: the
        ``prior`` tokens up to (not including) the first that would end it
        (a stop id, a stop string, ``max_tokens``), which it samples again.
        Everything that depends on the output so far reads these tokens as
        its own: the scheduler computes them with the prompt and counts
        them as output, the sampler's seeded stream goes on at their count
        (``SamplingRow.output_index``), the penalties see them in the
        history, the grammar's matcher has consumed them (checked here), and
        their logprobs come back in the final output."""
        state = OutputState(self.tokenizer, params, self.eos_token_ids, prompt_ids)
        if prior is None or not prior.token_ids:
            return state, []
        ids = list(prior.token_ids)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError("invalid_request", f"prior output token ids out of range [0, {vocab}): {bad[:5]}")
        logprobs = prior.logprobs if params.logprobs else None
        top = prior.top_logprobs if params.logprobs and params.top_logprobs else None
        if (logprobs is not None and len(logprobs) != len(ids)) or (top is not None and len(top) != len(ids)):
            raise RequestError("invalid_request", f"request {request_id!r}: prior logprobs do not match its tokens")
        if params.logprobs and (logprobs is None or (params.top_logprobs and top is None)):
            raise RequestError("invalid_request", f"request {request_id!r} asks for logprobs its prior output lacks")
        taken = state.resume(ids, logprobs, top)
        if taken < len(ids):  # a token that ends it: replay the ones before it on a fresh state
            ids = ids[:taken]
            state = OutputState(self.tokenizer, params, self.eos_token_ids, prompt_ids)
            state.resume(ids, None if logprobs is None else logprobs[:taken], None if top is None else top[:taken])
        if constraint is not None:
            constraint.catch_up(ids)
            if constraint.error is not None:
                raise RequestError("invalid_request", f"request {request_id!r}: prior output {constraint.error}")
        return state, ids

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
        label tokens, no completion. How it is computed (one shared prompt
        prefill, one fork per label): :mod:`jaxserve.engine.score_processor`.
        Raises :class:`RequestError` when it can never run.
        """
        prompt_ids = self._prompt_ids(prompt)
        try:
            label_ids = [[_token_id(t) for t in label] for label in labels]
        except (TypeError, ValueError) as exc:
            raise RequestError("invalid_request", f"labels must be lists of token ids: {exc}") from None
        members = self.scores.add(
            request_id,
            prompt_ids,
            label_ids,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            request_class=request_class,
            priority=priority,
            deadline=deadline,
            cache_salt=self._cache_salt(len(prompt_ids)),
        )
        for req in members:
            self._requests[req.request_id] = req
            self._states[req.request_id] = OutputState(self.tokenizer, req.sampling_params, self.eos_token_ids, None)
            self._metrics[req.request_id] = {}
        self._metrics[request_id] = {"arrival": time.monotonic()}  # the job's (its parent's, when it has one)

    @property
    def _long_rope_salt(self) -> object:
        return (self.model_name, "long_rope")

    def _cache_salt(self, num_prompt_tokens: int) -> object:
        """What a request's prefix-cache blocks are keyed by besides their
        tokens: the model's name. A longrope model's request whose prompt
        is past the original context rotates every position with the long
        factors, the others with the short ones (``families/phi3.py``): its
        salt says so, keeping the two kinds of keys apart in the cache, and
        ``launch`` reads it to tell the model."""
        original = self.runner.long_rope_original
        if original is not None and num_prompt_tokens > original:
            return self._long_rope_salt
        return self.model_name

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
        if self.scores.abort(request_id):
            return True
        existed = self.scheduler.abort(request_id)
        self._forget(request_id)
        return existed

    def _forget(self, request_id: str) -> None:
        """Drop the engine's own records of a request that ended."""
        self._states.pop(request_id, None)
        self._metrics.pop(request_id, None)
        self._requests.pop(request_id, None)
        self.containment.clear(request_id)
        self._constraints.pop(request_id, None)
        self._top.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request_id)

    def _stop_ids(self, request_id: str) -> set[int]:
        """The tokens that end ``request_id`` (none once it is forgotten)."""
        state = self._states.get(request_id)
        return state.stop_ids if state is not None else set()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # --------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the progress of every request it touched.

        Schedule, run, process: expire waiting requests past their deadline,
        then run the step in the mode :func:`jaxserve.engine.step_modes.choose`
        picks (pipelined, so the host detokenizes the collected step while
        the device runs the next; overlapped with ``async_scheduling``;
        interactive outputs first with ``on_urgent_outputs``; or one suspect
        alone after a failure), then hand a scoring job's members' outputs to
        their job. A request that a stop string ends was already part of the
        new step: its extra token is dropped.

        A failed step is contained (:mod:`jaxserve.engine.containment`): only
        the request that makes steps fail is failed. When the device state
        itself is lost, ``step`` raises :class:`EngineBroken` now and at every
        later call; it also re-raises a failure that touched no request.
        Outputs gathered by a call that raised are returned by the next one.
        """
        self.containment.check()
        outputs, self._carried = self._carried, []
        try:
            outputs.extend(self._expire_waiting())
            self.containment.keep_suspects(self._schedulable)
            in_flight, self._in_flight = self._in_flight, None
            stepped, self._in_flight = choose(self, in_flight).run(self, in_flight)
            outputs.extend(stepped)
            outputs = self.scores.route(outputs)
        except BaseException:
            self._carried = outputs
            raise
        return outputs

    def _schedulable(self, request_id: str) -> bool:
        req = self.scheduler.get_request(request_id)
        return req is not None and req.status != RequestStatus.PARKED

    def _fault_point(self, stage: str, request_ids: Sequence[str]) -> None:
        """Test seam; does nothing. Called with the ids of the requests
        concerned at ``"execute"`` (right before the runner launches a plan),
        ``"fetch"`` (before a launched step's tokens are fetched) and
        ``"process"`` (before one request's token is detokenized). Tests
        replace it to raise for a chosen request, as a failing array build,
        device program, fetch or detokenizer would."""

    # ------------------------------------------------- the step's parts
    # What the step modes compose (step_modes.StepParts), in a step's order:
    # schedule, launch, collect, process.

    def schedule(self) -> SchedulerOutput:
        """Plan the next batched step, after ``before_plan`` admitted what
        other threads queued. The plan counts as touched by the batched step
        in progress (``Containment.plan``)."""
        if self.before_plan is not None:
            self.before_plan()
        return self.containment.plan(self.scheduler.schedule)

    def launch(self, plan: SchedulerOutput, prev: InFlight | None = None) -> InFlight:
        """Build a plan's work and launch it on the device. ``prev``: the step
        in flight whose tokens are still pending on the device (an overlapped
        step reads them there, ``step_modes.OverlappedStep``)."""
        now = time.monotonic()
        masks, guess_masks = grammar_masks(self.structured, plan, self.scheduler.requests, self._constraints)
        feed = None if prev is None else prev.feed()
        work = []
        for s in plan.scheduled:
            req = cast(Request, self.scheduler.get_request(s.request_id))  # scheduled: it is there
            self._metrics[s.request_id].setdefault("first_scheduled", now)
            w = seq_work(s, sampling_row(req, masks.get(s.request_id)) if s.sample else None, feed)
            if s.draft_token_ids:  # speculative decoding: a sampled row after each guess
                w.draft_rows = draft_rows(req, s.draft_token_ids, guess_masks.get(s.request_id))
            if self.runner.long_rope_original is not None:  # longrope: one factor set per request (families/phi3.py)
                w.long_rope_from = 0 if req.cache_salt == self._long_rope_salt else self.max_model_len
            work.append(w)
        self._fault_point("execute", [s.request_id for s in plan.scheduled])
        result = self.runner.execute(
            work, prev_tokens=None if feed is None else feed[0], block_copies=plan.block_copies
        )
        self.num_steps += 1
        self.num_computed_tokens += plan.total_num_scheduled_tokens
        return InFlight(plan, result)

    def hold_pending(self, in_flight: InFlight) -> Pending:
        """Overlapped steps: the scheduler takes the in-flight step's tokens as
        placeholders, so that the next step can be planned before they are
        fetched (:meth:`collect` fills them in)."""
        self.num_overlapped_steps += 1
        sampling = in_flight.sampling_ids
        requests = {rid: self.scheduler.get_request(rid) for rid in sampling}
        finished_by_length = self.scheduler.update_from_output(in_flight.plan, dict.fromkeys(sampling, PENDING_TOKEN))
        return Pending(requests, set(finished_by_length))

    def collect(self, in_flight: InFlight, pending: Pending | None = None) -> Collected:
        """Wait for a launched step's tokens and apply them to the scheduler
        (``pending``: it holds them as placeholders already, to fill in)."""
        plan, result = in_flight.plan, in_flight.result
        sampling = in_flight.sampling_ids
        self._fault_point("fetch", [s.request_id for s in plan.scheduled])
        tokens, logprobs = result.fetch()
        top = result.fetch_top()
        runs: dict[str, list[int]] = {}
        run_logprobs: dict[str, list[float]] = {}
        if in_flight.drafted:
            sampled, sampled_logprobs = self._verify(plan, tokens, logprobs, top, runs, run_logprobs)
        else:
            sampled, sampled_logprobs = by_request(sampling, tokens, logprobs)
            if top is not None:
                self._keep_top([(rid, [row]) for row, rid in enumerate(sampling)], top)
        scores = result.fetch_scores()
        if pending is None:
            finished_by_length = set(self.scheduler.update_from_output(plan, {**sampled, **runs} if runs else sampled))
        else:
            pending.resolve(sampled)
            finished_by_length = pending.finished_by_length
        self.scores.record(plan, scores)  # (a feedable step has no score rows; parents may park)
        self._finish_stopped(sampled, finished_by_length)
        return Collected(sampled, sampled_logprobs, finished_by_length, runs, run_logprobs)

    def _verify(
        self,
        plan: SchedulerOutput,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        top: tuple[np.ndarray, np.ndarray] | None,
        runs: dict[str, list[int]],
        run_logprobs: dict[str, list[float]],
    ) -> tuple[dict[str, int], dict[str, float]]:
        """Speculative decoding's verdicts on a step whose rows carried
        guesses: each row sampled after its last known token and after each
        guess, as if the guesses were its output; a guess is kept while it
        equals the sample before it (``speculative.accepted_run``). Fills
        ``runs`` (and their log-probabilities) for the rows that carried
        guesses, and returns every sampling request's last token as
        ``by_request`` does. Greedy, a kept guess is the argmax there; sampled,
        it is the seeded draw of that position (``fold_in(seed,
        output_index)``), so a seeded job's tokens are those it draws without
        guesses, and each position's token comes from the target
        distribution whatever was guessed."""
        ids, lps = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()
        sampled: dict[str, int] = {}
        sampled_logprobs: dict[str, float] = {}
        rows: list[tuple[str, list[int]]] = []
        row = 0
        for s in plan.scheduled:
            if not s.sample:
                continue
            rid, guesses = s.request_id, s.draft_token_ids
            candidates = ids[row : row + 1 + len(guesses)]
            run = accepted_run(candidates, guesses, self._stop_ids(rid))
            if guesses:
                kept = 0
                while kept < len(guesses) and candidates[kept] == guesses[kept]:
                    kept += 1
                if self.drafter is not None:
                    self.drafter.verified(rid, len(guesses), kept)
                runs[rid] = run
                run_logprobs[rid] = lps[row : row + len(run)]
            sampled[rid] = run[-1]
            sampled_logprobs[rid] = lps[row + len(run) - 1]
            rows.append((rid, list(range(row, row + len(run)))))
            row += 1 + len(guesses)
        self._keep_top(rows, top)
        return sampled, sampled_logprobs

    def wants_drafts(self, in_flight: InFlight) -> bool:
        """Whether a sampling row of the in-flight step is likely to carry
        guesses in its next step (its known tokens end in an earlier match
        whose guesses it has been keeping): then that step is planned after
        the in-flight tokens are fetched, since a row whose last token is
        still on the device cannot be guessed for (``step_modes.choose``)."""
        if self.drafter is None:
            return False
        for rid in in_flight.sampling_ids:
            req = self.scheduler.get_request(rid)
            if req is not None and self.drafter.may_propose(req):
                return True
        return False

    def process(self, collected: Collected) -> list[RequestOutput]:
        """Detokenize collected tokens, apply stop strings, build outputs
        (the outputs of scoring jobs that finished first).

        Each request's token is handled on its own: when that raises (the
        detokenizer, a stop check), the failure is this request's, and it
        alone is finished with an ``internal`` error."""
        outputs = self.scores.take_outputs()
        outputs.extend(self.process_tokens(collected))
        return outputs

    def process_tokens(self, collected: Collected) -> list[RequestOutput]:
        """:meth:`process` for the collected tokens only."""
        outputs = []
        now = time.monotonic()
        finished_by_length = collected.finished_by_length
        for request_id in collected.sampled:
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
                # one token, or a speculative row's run (cut where it finishes)
                logprobs = collected.token_logprobs(request_id) if state.params.logprobs else None
                top = self._top.pop(request_id, None)
                delta, new_ids, finish = "", [], None
                for i, new in enumerate(collected.tokens(request_id)):
                    verdict = state.add_token(
                        new, None if logprobs is None else logprobs[i], None if top is None else top[i]
                    )
                    delta += verdict.delta
                    if verdict.accepted:
                        new_ids.append(new)
                    finish = verdict.finish_reason
                    if finish is not None:
                        break
                if finish is None and request_id in finished_by_length:
                    finish = "length"  # max_model_len reached before max_tokens
                    delta += state.force_finish("length")
                elif finish is not None and request_id not in finished_by_length:
                    # A stop string (or stop id, already ended in collect: then a no-op).
                    self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
                out = self._output(request_id, state, delta, new_ids, finish, now)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failed = self.fail_request(request_id, exc)
                if failed is not None:
                    outputs.append(failed)
                continue
            outputs.append(out)
        return outputs

    def fail_request(self, request_id: str, exc: Exception) -> RequestOutput | None:
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

    def is_urgent(self, request_id: str) -> bool:
        """An interactive request whose outputs are its own (not a member of
        a scoring job): ``on_urgent_outputs`` takes them first."""
        req = self._requests.get(request_id)
        return (
            req is not None and req.request_class is RequestClass.INTERACTIVE and not self.scores.is_member(request_id)
        )

    def awaits_first_token(self, request_id: str) -> bool:
        """The request has produced no output token yet."""
        state = self._states.get(request_id)
        return state is not None and not state.token_ids

    def recomputable(self, request_ids: list[str]) -> list[tuple[Request, int]]:
        """Those of ``request_ids`` the engine still serves, each with how
        many of its output tokens the caller has received: failure
        containment recomputes them from there (``Containment.recover``)."""
        return [(self._requests[rid], self._states[rid].num_tokens_seen) for rid in request_ids if rid in self._states]

    def _ended_with(self, request_id: str, state: OutputState, error: RequestError) -> RequestOutput:
        """The final output of a request ended by ``error`` (the scheduler
        already finished it); the engine forgets it."""
        metrics = self._metrics.get(request_id, {})
        self._forget(request_id)
        return state.error_output(request_id, error, metrics, time.monotonic())

    def _finish_stopped(self, sampled: dict[str, int], finished_by_length: set[str]) -> None:
        # EOS / stop id: end it before the next plan, so it takes no slot there.
        for request_id, token in sampled.items():
            state = self._states.get(request_id)
            if state is not None and token in state.stop_ids and request_id not in finished_by_length:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def _output(self, request_id, state, delta, new_ids, finish, now) -> RequestOutput:
        out = state.output(request_id, delta, new_ids, finish, self._metrics[request_id], now)
        if finish is not None:
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

    def _keep_top(self, request_rows: list[tuple[str, list[int]]], top) -> None:
        """Hold the ``top_logprobs`` alternatives of collected tokens until
        ``process_tokens`` gives them to the request's output state;
        ``request_rows``: each request's sampled rows, one per new token."""
        if top is None:
            return
        values, ids = top
        for request_id, rows in request_rows:
            state = self._states.get(request_id)
            n = state.params.top_logprobs if state is not None and state.params.logprobs else 0
            if n:
                self._top[request_id] = [list(zip(ids[r, :n].tolist(), values[r, :n].tolist())) for r in rows]

    def _fail_structured(self, request_id: str, state: OutputState, message: str) -> RequestOutput:
        """End a request whose grammar failed mid-generation (that request
        alone; not retryable: the same grammar fails the same way)."""
        log.warning("engine.structured_failed", request_id=request_id, error=message)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        return self._ended_with(request_id, state, RequestError("internal", message, retryable=False))


def _token_id(value) -> int:
    """A prompt token id: an integer (not a bool), else ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"token id {value!r} is not an integer")
    return int(value)
