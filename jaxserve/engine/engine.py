"""The continuous-batching engine: scheduler + runner + output processing.

One call to :meth:`Engine.step` is one iteration: the scheduler plans which
tokens of which requests to compute (host bookkeeping only), the runner
executes that plan on the device, and the sampled tokens are turned into
text deltas and stop decisions.

The engine is single-threaded by design. The queue worker runs it on its own
thread and talks to it through commands, so nothing here needs locks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.block_allocator import BlockAllocator
from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.output_processor import OutputState
from jaxserve.engine.request import PENDING_TOKEN, Request, RequestStatus
from jaxserve.engine.runner import ModelRunner, SeqWork
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.types import RequestClass, RequestError, RequestOutput, SamplingParams

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
        enable_compilation_cache(args.compilation_cache_dir)
        folder = Path(resolve_model(args.model))
        self.model_path = folder
        self.model_name = args.served_model_name or args.model
        loaded = load_model(folder, dtype=args.dtype)
        cfg = loaded.config
        self.model_config = cfg
        self.tokenizer = Tokenizer.from_folder(folder)
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)))
        self.max_model_len = args.resolve_max_model_len(cfg.max_position_embeddings)
        self.max_num_seqs = args.max_num_seqs
        self.interactive_reserved_seqs = args.interactive_reserved_seqs
        params = jax.tree.leaves(loaded.model)
        weight_bytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params if hasattr(p, "dtype"))
        cache_dtype = params[0].dtype if params else jnp.float32
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
        self._in_flight = None  # (plan, StepResult) dispatched but not collected
        self._metrics: dict[str, dict[str, float]] = {}
        self._seed_rng = random.Random(args.seed)
        self.special_token_ids = sorted(
            set(self.tokenizer.all_special_ids) | set(self.eos_token_ids)
        )
        self.num_steps = 0
        self.async_scheduling = args.async_scheduling
        self.num_overlapped_steps = 0  # steps collected after the next one was launched
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
    def from_args(cls, args: EngineArgs | None = None, **overrides) -> "Engine":
        args = dataclasses.replace(args or EngineArgs(), **overrides)
        return cls(args)

    # -------------------------------------------------------------- set-up

    def warmup(self) -> None:
        """Compile every shape bucket before the first request."""
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
        if deadline is not None and deadline <= time.monotonic():
            raise RequestError("expired", f"request {request_id!r} expired before admission")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError("invalid_request", f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(31))
        request = Request(
            request_id,
            prompt_ids,
            params,
            request_class=request_class,
            priority=priority,
            deadline=deadline,
            cache_salt=self.model_name,
        )
        # The scheduler refuses duplicate ids, empty prompts, over-long requests
        # (context_length_exceeded) and a full waiting line (overloaded).
        self.scheduler.add_request(request)
        self._states[request_id] = OutputState(self.tokenizer, params, self.eos_token_ids, prompt_ids)
        self._metrics[request_id] = {"arrival": time.monotonic()}

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Returns whether it existed."""
        existed = self.scheduler.abort(request_id)
        self._states.pop(request_id, None)
        self._metrics.pop(request_id, None)
        return existed

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
        """
        outputs = self._expire_waiting()
        if self.async_scheduling and self._in_flight is not None and self._in_flight[1].feedable:
            collected = self._collect_overlapped()
        else:
            collected = self._collect()
            self._dispatch()
        if collected is not None:
            outputs.extend(self._process(*collected))
        return outputs

    def _dispatch(self, prev: tuple[jax.Array, dict[str, int]] | None = None) -> None:
        """Plan and launch the next step. ``prev``: the in-flight step's device
        tokens and each sampling request's row in them, for tokens still
        pending (see ``_collect_overlapped``)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return
        now = time.monotonic()
        work = []
        for s in plan.scheduled:
            req = self.scheduler.get_request(s.request_id)
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
                )
            )
        self._in_flight = (plan, self.runner.execute(work, prev_tokens=None if prev is None else prev[0]))
        self.num_steps += 1

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
        sampled, sampled_logprobs = _by_request(sampling, *result.fetch())
        for request_id, token in sampled.items():
            req = requests[request_id]
            if req is not None and req.pending_index is not None:
                req.resolve_pending(token)
        self._finish_stopped(sampled, finished_by_length)
        return sampled, sampled_logprobs, finished_by_length

    def _collect(self):
        """Wait for the in-flight step and apply its tokens to the scheduler."""
        if self._in_flight is None:
            return None
        plan, result = self._in_flight
        self._in_flight = None
        sampling = [s.request_id for s in plan.scheduled if s.sample]
        sampled, sampled_logprobs = _by_request(sampling, *result.fetch())
        finished_by_length = set(self.scheduler.update_from_output(plan, sampled))
        self._finish_stopped(sampled, finished_by_length)
        return sampled, sampled_logprobs, finished_by_length

    def _finish_stopped(self, sampled: dict[str, int], finished_by_length: set[str]) -> None:
        # EOS / stop id: end it before the next plan, so it takes no slot there.
        for request_id, token in sampled.items():
            state = self._states.get(request_id)
            if state is not None and token in state.stop_ids and request_id not in finished_by_length:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def _process(self, sampled, sampled_logprobs, finished_by_length) -> list[RequestOutput]:
        """Detokenize collected tokens, apply stop strings, build outputs."""
        outputs = []
        now = time.monotonic()
        for request_id, token in sampled.items():
            state = self._states.get(request_id)
            if state is None:  # aborted while the step ran
                continue
            metrics = self._metrics[request_id]
            metrics.setdefault("first_token", now)
            verdict = state.add_token(token, sampled_logprobs[request_id] if state.params.logprobs else None)
            finish = verdict.finish_reason
            if finish is None and request_id in finished_by_length:
                finish = "length"  # max_model_len reached before max_tokens
                verdict.delta += state.force_finish("length")
            elif finish is not None and request_id not in finished_by_length:
                # A stop string (or stop id, already ended in _collect: then a no-op).
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            outputs.append(
                self._output(request_id, state, verdict.delta, [token] if verdict.accepted else [], finish, now)
            )
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
            del self._states[request_id]
            del self._metrics[request_id]
        return out

    def _expire_waiting(self) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for request_id in self.scheduler.expired_request_ids(now):
            req = self.scheduler.get_request(request_id)
            if req is None or req.status == RequestStatus.RUNNING:
                continue  # deadlines gate admission and waiting, not running work
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            state = self._states.pop(request_id, None)
            metrics = self._metrics.pop(request_id, {})
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
        row = {
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "seed": p.seed,
            "output_index": req.num_output_tokens,
            "repetition_penalty": p.repetition_penalty,
            "frequency_penalty": p.frequency_penalty,
            "presence_penalty": p.presence_penalty,
            "logprobs": p.logprobs,
        }
        if p.has_penalties:
            row["history"] = req.all_token_ids
            row["num_prompt"] = req.num_prompt_tokens
        return row


def _by_request(
    request_ids: list[str], tokens: np.ndarray, logprobs: np.ndarray
) -> tuple[dict[str, int], dict[str, float]]:
    """A step's sampled tokens and log-probabilities keyed by request, in
    the order the plan's sampling requests were given."""
    sampled = {rid: int(t) for rid, t in zip(request_ids, tokens)}
    sampled_logprobs = {rid: float(lp) for rid, lp in zip(request_ids, logprobs)}
    return sampled, sampled_logprobs
