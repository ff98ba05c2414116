"""Continuous-batching scheduler: host bookkeeping only, no device work.

Each step, :meth:`Scheduler.schedule` turns the queues into a plan (which
tokens of which request to compute, in which blocks); the engine runs the
plan and feeds the sampled tokens back through
:meth:`Scheduler.update_from_output`. The two calls strictly alternate,
and every call (``add_request``, ``abort`` ...) must come from one thread:
the scheduler holds no lock.

There is no prefill or decode phase (vLLM v1 style). A request has
``num_tokens`` and ``num_computed_tokens``; a step gives it some of the gap.
A step whose chunk reaches ``num_tokens`` samples the next token; a partial
prompt chunk does not.

One step, in order:

1. Running requests, best first (interactive before batch; then arrival, or
   priority then arrival). Those needing one token (decodes) are served
   first, so a long prompt never delays a decode; then interactive prefill
   chunks and newly admitted interactive requests (step 3); only then batch
   prefill chunks and batch admissions: an interactive prefill never waits
   behind a batch chunk for the token budget. A chunk is capped by what is
   left of the token budget and by ``long_prefill_token_threshold``. The
   latency rules (``interactive_prefill_alone``, the batch prompt share and
   the interactive step cap) leave some batch work out of a step while
   interactive work is about: :mod:`jaxserve.engine.latency_policy`.
2. Blocks are allocated lazily to cover ``num_computed_tokens`` plus the
   chunk. When they run out, the worst running request (lowest class; then
   newest, or largest priority value then newest) is preempted: it loses all
   its blocks, its computed tokens are reset to 0 (its generated tokens are
   kept and recomputed with the prompt) and it goes back to the front of its
   waiting queue. A request only ever preempts one that ranks at or below
   it; when it ranks lowest it preempts itself.
3. If nothing was preempted, waiting requests are admitted while the budget,
   the sequence cap and the blocks allow: interactive first, then batch. An
   interactive request that finds every sequence slot taken preempts the
   worst running batch request that has no tokens in the step yet. A
   batch request must leave ``interactive_reserved_seqs`` sequence slots and
   ``interactive_reserved_blocks`` blocks free (running batch requests also
   never grow into the reserved blocks). Admission stops at the first
   request that does not fit (no overtaking within the order). A new request
   first looks up its longest cached prefix and skips those tokens, always
   leaving at least its last token to compute.

Two calls serve the engine's recovery from a failed step (see
:mod:`jaxserve.engine.containment`): :meth:`Scheduler.reset_for_recompute`
sends a request of the failed step back to waiting with only its delivered
tokens, and :meth:`Scheduler.schedule_isolated` plans a step for one request
alone.

Why this module is longer than the others: every method left here moves
requests between the same waiting lines, running list and block tables
(label scoring's forks included: parking a parent, starting its forks), and
they keep one invariant together (a request is in exactly one place, and
its blocks are freed exactly once). What does not touch that state lives
apart: the plan's types (:mod:`jaxserve.engine.scheduler_output`), the waiting line
(:mod:`jaxserve.engine.waiting_queue`), the latency rules
(:mod:`jaxserve.engine.latency_policy`) and the forks' books
(:mod:`jaxserve.engine.forks`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from jaxserve.engine.block_allocator import BlockAllocator
from jaxserve.engine.config import SchedulerConfig
from jaxserve.engine.forks import ForkTable
from jaxserve.engine.latency_policy import LatencyPolicy
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput, SchedulerStats
from jaxserve.engine.speculative import Drafter
from jaxserve.engine.types import RequestClass
from jaxserve.engine.waiting_queue import WaitingQueue
from jaxserve.request_error import RequestError

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "SchedulerStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _run(sampled: int | Sequence[int] | None) -> list[int]:
    """A step's tokens for one request: its sampled token, or the run of a
    request that carried guessed tokens."""
    if sampled is None:
        return []
    if isinstance(sampled, (list, tuple)):
        return [int(t) for t in sampled]
    return [int(cast(int, sampled))]


@dataclasses.dataclass
class _Admission:
    """What admitting a waiting request takes (``Scheduler._admission``)."""

    hits: list[int]  # prefix-cache blocks it reuses
    candidates: list  # the block hashes looked up
    num_tokens: int  # tokens it computes in its first step
    num_new_blocks: int  # blocks to allocate


class Scheduler:
    """Plans each step over the running and waiting requests."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator | None = None,
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
    ) -> None:
        """``clock``: seconds, for ``interactive_recent_s`` (tests pass a
        fake one). ``drafter``: speculative decoding's guesses
        (``jaxserve.engine.speculative``), used when
        ``config.num_speculative_tokens`` allows any."""
        config.validate()
        if allocator is None:
            allocator = BlockAllocator(config.num_blocks, config.block_size, config.enable_prefix_caching)
        elif (allocator.num_blocks, allocator.block_size) != (config.num_blocks, config.block_size):
            raise ValueError(
                f"allocator has {allocator.num_blocks} blocks of {allocator.block_size} tokens but the config says "
                f"{config.num_blocks} of {config.block_size}"
            )
        self.config = config
        self.allocator = allocator
        self.block_size = config.block_size
        self._prefix_caching = config.enable_prefix_caching and allocator.enable_prefix_caching

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self.forks = ForkTable()  # label scoring's parked prompts and their forks
        self._waiting = {cls: WaitingQueue(config.policy) for cls in RequestClass}
        self._finished_ids: list[str] = []
        self._aborted_ids: list[str] = []
        self._seq = itertools.count()
        self._step = 0

        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._rows_left = config.max_num_seqs  # logits rows left in the step being planned
        self.latency = LatencyPolicy(config, clock)
        self.drafter = drafter

    # ------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises ``RequestError``: ``invalid_request`` (duplicate id, bad
        sampling parameters), ``context_length_exceeded`` (prompt plus
        ``max_tokens`` over ``max_model_len``) or ``overloaded`` (retryable:
        the waiting queue is at ``max_num_waiting``).
        """
        # A request may come with output of an earlier run (Request's
        # ``output_token_ids``): computed with its prompt, like a preempted one's.
        if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"request {request.request_id!r} is not fresh (status {request.status.name})")
        if request.num_output_tokens >= request.max_tokens:
            raise ValueError(f"request {request.request_id!r} has its max_tokens of output already")
        rid = request.request_id
        if rid in self.requests:
            raise RequestError(
                "invalid_request", f"duplicate request id {rid!r}: a request with that id is still in progress"
            )
        request.sampling_params.validate()
        limit = self.config.max_model_len
        n_prompt = request.num_prompt_tokens
        if n_prompt >= limit:
            raise RequestError(
                "context_length_exceeded",
                f"the prompt has {n_prompt} tokens but the model's maximum context length is {limit} tokens, "
                f"which leaves no room to generate",
            )
        if n_prompt + request.max_tokens > limit:
            raise RequestError(
                "context_length_exceeded",
                f"the model's maximum context length is {limit} tokens, but {n_prompt + request.max_tokens} were "
                f"requested ({n_prompt} in the prompt + {request.max_tokens} max_tokens); lower max_tokens to at "
                f"most {limit - n_prompt}",
            )
        cap = self.config.max_num_waiting
        if cap and self.num_waiting >= cap:
            raise RequestError(
                "overloaded",
                f"{self.num_waiting} requests are already waiting (limit {cap}); retry later",
                retryable=True,
            )
        self.register(request)
        self._waiting[request.request_class].push(request)

    def register(self, request: Request) -> None:
        """Make a request known (not yet queued): its admission order and,
        with prefix caching, its block hashes (``add_request``, and a
        scoring job's forks when their parent parks)."""
        request.seq_no = next(self._seq)
        if self._prefix_caching:
            request.enable_block_hashing(self.block_size)
        self.requests[request.request_id] = request

    # ------------------------------------------------------------ planning

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring for the rules)."""
        self._step += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # request id -> (request, tokens, is_new); insertion order = plan order
        planned: dict[str, tuple[Request, int, bool]] = {}
        preempted: list[Request] = []

        self._start_forks()
        self.running.sort(key=self._key)
        self._rows_left = cfg.max_num_seqs  # logits rows: samples and score rows
        interactive = [r for r in self.running if r.request_class == RequestClass.INTERACTIVE]
        batch = [r for r in self.running if r.request_class != RequestClass.INTERACTIVE]
        # Interactive first in time: every decode, then interactive chunks and
        # newly arrived interactive requests, and only then batch chunks and
        # batch admissions, so an interactive prefill never waits behind a
        # batch prefill chunk for the token budget. The latency policy says
        # which batch work this step leaves out.
        rules = self.latency.rules(self.running, bool(self._waiting[RequestClass.INTERACTIVE]))
        budget = self._plan_running(rules.decodes, budget, planned, preempted)
        budget = self._plan_running([r for r in interactive if r.num_tokens_to_compute > 1], budget, planned, preempted)
        if not preempted:
            budget = self._admit_waiting(budget, planned, (RequestClass.INTERACTIVE,), preempted)
        if rules.prefill_started_alone(planned):
            return self._plan(planned, preempted, self._draft(planned, rules.step_cap))
        # no interactive prompt could start after all: the batch decodes as usual
        budget = self._plan_running(rules.held, budget, planned, preempted)
        budget = rules.batch_budget(budget, sum(n for _, n, _ in planned.values()))
        budget = self._plan_running([r for r in batch if r.num_tokens_to_compute > 1], budget, planned, preempted)
        if not preempted:
            self._admit_waiting(budget, planned, (RequestClass.BATCH,))
        return self._plan(planned, preempted, self._draft(planned, rules.step_cap))

    def _plan_running(
        self, reqs: list[Request], budget: int, planned: dict[str, tuple[Request, int, bool]], preempted: list[Request]
    ) -> int:
        """Give running requests their chunks (allocating blocks, preempting
        the worst running request when blocks run out); returns the budget
        left."""
        cap = self.config.long_prefill_token_threshold
        key = self._key
        for req in reqs:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING or req.request_id in planned:
                continue  # preempted earlier in this step
            n = min(req.num_tokens_to_compute, budget)
            if cap:
                n = min(n, cap)
            n = self._fit_rows(req, req.num_computed_tokens, n)
            if n <= 0:
                continue
            while True:
                need = _cdiv(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
                if need <= 0 or need <= self.free_blocks_for(req):
                    if need > 0:
                        blocks = self.allocator.allocate(need)
                        assert blocks is not None
                        req.block_ids.extend(blocks)
                    break
                victim = max(self.running, key=key)
                budget += self._preempt(victim, planned)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            planned[req.request_id] = (req, n, False)
            budget -= n
            self._rows_left -= self._rows_needed(req, req.num_computed_tokens, n)
        return budget

    @staticmethod
    def _rows_needed(req: Request, start: int, n: int) -> int:
        if req.score_from is not None:
            return len(req.score_rows(start, n))
        return int(req.samples and start + n == req.num_tokens)

    def _fit_rows(self, req: Request, start: int, n: int) -> int:
        """``n`` cut so the chunk's logits rows fit what the step has left
        (the runner picks at most ``max_num_seqs`` rows per step); 0 when
        nothing fits."""
        left = self._rows_left
        if req.score_from is not None:
            return min(n, max(0, req.score_from - start) + left)
        if self._rows_needed(req, start, n) > left:
            return n - 1 if n > 1 else 0  # stop short of the sampling position
        return n

    def _draft(self, planned: dict[str, tuple[Request, int, bool]], step_cap: int) -> dict[str, list[int]]:
        """Speculative decoding's guesses for the planned sampling chunks,
        planned last: the drafter (``jaxserve.engine.speculative``) sizes
        them within the token budget, the logits rows and (while
        interactive work is about) the step cap the plan leaves, and a
        guess takes a free block only while every running request could
        still get one next step. Blocks a guess takes stay with the request
        (it grows into them); they are registered in the prefix cache only
        once verified tokens fill them (``_register_full_blocks``)."""
        cfg = self.config
        drafter = self.drafter
        if drafter is None or not cfg.num_speculative_tokens or not planned:
            return {}
        base_tokens = sum(n for _, n, _ in planned.values())
        room = min(
            cfg.max_num_batched_tokens - base_tokens,
            cfg.max_num_logits_rows - (cfg.max_num_seqs - self._rows_left),
        )
        if step_cap:
            room = min(room, step_cap - base_tokens)
        if room <= 0:
            return {}
        proposals = []
        base_rows = 0
        for req, n, _ in planned.values():
            if not req.samples or req.num_computed_tokens + n != req.num_tokens:
                continue
            base_rows += 1
            # the run a step yields must stay within max_model_len
            k = min(drafter.limit(req), cfg.max_model_len - req.num_tokens - 1)
            proposal = drafter.propose(req, k) if k > 0 else None
            if proposal is not None:
                proposals.append(proposal)
        chosen = drafter.choose(proposals, base_tokens=base_tokens, base_rows=base_rows, max_tokens=room)
        by_id = {p.request_id: p for p in proposals}
        bs = self.block_size
        drafts: dict[str, list[int]] = {}
        for rid, tokens in chosen.items():
            req, n, _ = planned[rid]
            end = req.num_computed_tokens + n
            spare = max(0, self.free_blocks_for(req) - len(self.running))
            tokens = tokens[: max(0, (len(req.block_ids) + spare) * bs - end)]
            if not tokens:
                continue
            need = _cdiv(end + len(tokens), bs) - len(req.block_ids)
            if need > 0:
                blocks = self.allocator.allocate(need)
                assert blocks is not None
                req.block_ids.extend(blocks)
            drafter.drafted(rid, tokens, by_id[rid].num_forced, by_id[rid].match)
            drafts[rid] = tokens
        return drafts

    def _plan(
        self,
        planned: dict[str, tuple[Request, int, bool]],
        preempted: list[Request],
        drafts: Mapping[str, list[int]] | None = None,
    ) -> SchedulerOutput:
        """The step's plan from what ``schedule`` (or ``schedule_isolated``)
        decided; ``drafts``: guessed tokens appended to sampling chunks."""
        cfg = self.config
        scheduled = []
        total = 0
        drafts = drafts or {}
        for req, n, is_new in planned.values():
            self.latency.served(req.request_id, self._step)
            start = req.num_computed_tokens
            guess = drafts.get(req.request_id, [])
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    num_scheduled_tokens=n + len(guess),
                    start_position=start,
                    token_ids=req.all_token_ids[start : start + n] + guess,
                    block_ids=list(req.block_ids),
                    sample=req.samples and start + n == req.num_tokens,
                    is_new=is_new,
                    score_targets=req.score_rows(start, n),
                    draft_token_ids=list(guess),
                )
            )
            total += n + len(guess)
        assert total <= cfg.max_num_batched_tokens and len(scheduled) <= cfg.max_num_seqs
        rows = sum(s.num_logits_rows for s in scheduled)
        assert rows - sum(len(s.draft_token_ids) for s in scheduled) <= cfg.max_num_seqs
        assert rows <= cfg.max_num_logits_rows
        out = SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=[r.request_id for r in preempted],
            finished_req_ids=self._finished_ids,
            aborted_req_ids=self._aborted_ids,
            step=self._step,
            block_copies=self.forks.take_copies(),
        )
        self._finished_ids = []
        self._aborted_ids = []
        return out

    def _admit_waiting(
        self,
        budget: int,
        planned: dict[str, tuple[Request, int, bool]],
        classes: tuple[RequestClass, ...] = (RequestClass.INTERACTIVE, RequestClass.BATCH),
        preempted: list[Request] | None = None,
    ) -> int:
        """Admit waiting requests of ``classes`` in order while the budget,
        the sequence cap and the blocks allow. An interactive request that
        finds every sequence slot taken preempts the worst running batch
        request not planned in this step (when ``preempted`` is given)."""
        cfg = self.config
        batch_seq_limit = cfg.max_num_seqs - cfg.interactive_reserved_seqs
        now = time.monotonic()
        while budget > 0:
            queue = next((self._waiting[c] for c in classes if len(self._waiting[c])), None)
            if queue is None:
                break
            if len(self.running) >= cfg.max_num_seqs:
                if preempted is None or queue is not self._waiting[RequestClass.INTERACTIVE]:
                    break
                victims = [
                    r for r in self.running if r.request_class == RequestClass.BATCH and r.request_id not in planned
                ]
                if not victims:
                    break
                victim = max(victims, key=self._key)
                self._preempt(victim, planned)
                preempted.append(victim)
            req = queue.peek()
            if req.request_class == RequestClass.BATCH and len(self.running) >= batch_seq_limit:
                break
            admission = self._admission(req, budget)
            if admission.num_tokens <= 0 or not self._admission_fits(req, admission):
                break
            queue.pop()
            self._admit(req, admission, planned, now)
            budget -= admission.num_tokens
            self._rows_left -= self._rows_needed(req, req.num_computed_tokens, admission.num_tokens)
        return budget

    def _admission(self, req: Request, budget: int) -> _Admission:
        """What admitting ``req`` now would take: its prefix-cache hits and
        how many tokens and new blocks it would get."""
        bs = self.block_size
        cap = self.config.long_prefill_token_threshold
        hits: list[int] = []
        candidates = []
        if self._prefix_caching:
            # Keep at least the last token to compute: it yields the sample.
            candidates = req.block_hashes[: (req.num_tokens - 1) // bs]
            hits = self.allocator.find_cached_prefix(candidates)
        num_cached = len(hits) * bs
        n = min(req.num_tokens - num_cached, budget)
        if cap:
            n = min(n, cap)
        n = self._fit_rows(req, num_cached, n)
        num_new = _cdiv(num_cached + n, bs) - len(hits)
        return _Admission(hits, candidates, n, num_new)

    def _admission_fits(self, req: Request, admission: _Admission) -> bool:
        need = admission.num_new_blocks + self.allocator.num_blocks_to_touch(admission.hits)
        return need <= self.free_blocks_for(req)

    def _admit(
        self, req: Request, admission: _Admission, planned: dict[str, tuple[Request, int, bool]], now: float
    ) -> None:
        """Make a request just taken off its waiting queue running."""
        hits = admission.hits
        num_cached = len(hits) * self.block_size
        if self._prefix_caching:
            # Reference the hits (and count the query) before allocating,
            # so that allocate cannot evict them.
            taken = self.allocator.get_computed_blocks(admission.candidates)
            assert taken == hits
        new_blocks = self.allocator.allocate(admission.num_new_blocks)
        assert new_blocks is not None
        req.block_ids = hits + new_blocks
        req.num_registered_blocks = len(hits)
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            req.num_cached_tokens = num_cached
        if self._prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
        self.running.append(req)
        planned[req.request_id] = (req, admission.num_tokens, True)

    # ------------------------------------------------------------ forks

    def _park(self, req: Request) -> None:
        """A prefill-only request computed its prompt: it leaves the running
        list, keeping its blocks, and its forks become known
        (:mod:`jaxserve.engine.forks`)."""
        self.running.remove(req)
        req.status = RequestStatus.PARKED
        for child in self.forks.park(req):
            if child.request_id in self.requests:
                raise RequestError("invalid_request", f"duplicate request id {child.request_id!r}")
            self.register(child)

    def _start_forks(self) -> None:
        """Start the forks of parked requests while sequence slots and blocks
        allow, oldest parent first. A fork begins running at its parent's
        computed tokens: it references the parent's full blocks and gets its
        own copy of the partial last block (made by the runner before the
        next plan's forward). A parent whose forks have all started is
        finished, releasing its references."""
        cfg = self.config
        while (fork := self.forks.next_fork()) is not None:
            parent, child = fork
            if child is None:
                self.finish_request(parent.request_id, RequestStatus.FINISHED_STOPPED)  # leaves parked
                continue
            limit = cfg.max_num_seqs - (
                cfg.interactive_reserved_seqs if child.request_class == RequestClass.BATCH else 0
            )
            if len(self.running) >= limit:
                return
            computed = parent.num_computed_tokens
            full, partial = divmod(computed, self.block_size)
            own: list[int] = []
            if partial:
                if self.free_blocks_for(child) < 1:
                    return
                own = self.allocator.allocate(1) or []
                if not own:
                    return
            self.forks.started(parent, child, (parent.block_ids[full], own[0]) if own else None)
            shared = parent.block_ids[:full]
            self.allocator.touch(shared)
            child.block_ids = shared + own
            child.num_computed_tokens = computed
            child.num_registered_blocks = min(full, parent.num_registered_blocks)
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = time.monotonic()
            self.running.append(child)

    # ------------------------------------------------------------ isolation

    def schedule_isolated(self, request_id: str) -> SchedulerOutput:
        """Plan a step for one request alone (the engine's failure
        containment: after a failed step it runs each request of that step by
        itself until it has passed a step alone or failed alone).

        The request gets its usual chunk: its decode token, its next prefill
        chunk, or its admission (with its prefix-cache hits) if it waits.
        Other running requests keep their blocks but get no tokens; when the
        request needs room (blocks, or a sequence slot to be admitted into),
        they are preempted, worst first, whatever their rank: nothing else
        runs until the isolation ends, so waiting for them to free room would
        never end. Priority classes and the interactive reserve of sequence
        slots are not applied (one request runs); its class's block reserve
        is. Raises ``RuntimeError`` when the request cannot fit even alone,
        and ``ValueError`` for an unknown id.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"no unfinished request {request_id!r} to schedule")
        self._step += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        planned: dict[str, tuple[Request, int, bool]] = {}
        preempted: list[Request] = []
        self._rows_left = cfg.max_num_seqs

        def make_room() -> None:
            others = [r for r in self.running if r is not req]
            if not others:
                raise RuntimeError(f"request {request_id!r} does not fit in the KV cache even alone: {req!r}")
            victim = max(others, key=self._key)
            self._preempt(victim, planned)
            preempted.append(victim)

        if req.status == RequestStatus.RUNNING:
            n = min(req.num_tokens_to_compute, budget)
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            n = self._fit_rows(req, req.num_computed_tokens, n)
            need = _cdiv(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
            while need > self.free_blocks_for(req):
                make_room()
            if need > 0:
                blocks = self.allocator.allocate(need)
                assert blocks is not None
                req.block_ids.extend(blocks)
            planned[request_id] = (req, n, False)
        else:
            while True:
                admission = self._admission(req, budget)
                if len(self.running) < cfg.max_num_seqs and self._admission_fits(req, admission):
                    break
                make_room()
            self._waiting[req.request_class].remove(req)
            self._admit(req, admission, planned, time.monotonic())
        return self._plan(planned, preempted)

    def reset_for_recompute(self, request: Request, num_output_tokens: int) -> None:
        """Send a request back to waiting, holding no KV blocks and only its
        first ``num_output_tokens`` output tokens, to be recomputed from
        scratch (the engine's recovery after a failed step: the KV cache of
        the step's requests is not trusted, and the tokens the step sampled
        were never delivered).

        The request may be running, waiting, or finished since the failed
        step began (the step may have finished it by length or by a stop id
        before failing); it is then unfinished again. An aborted request is
        refused with ``ValueError``. The waiting queue takes it at the front
        (fcfs) or by its own key (priority), as a preemption does.
        """
        rid = request.request_id
        known = self.requests.get(rid)
        if known is not None and known is not request:
            raise ValueError(f"another request with id {rid!r} is in progress")
        if known is None:
            if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
                raise ValueError(f"request {rid!r} cannot be recomputed: {request!r}")
            if rid in self._finished_ids:  # not reported in a plan yet: it never finished after all
                self._finished_ids.remove(rid)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._waiting[request.request_class].remove(request)
        if request.block_ids:
            self.allocator.free(request.block_ids)
            request.block_ids = []
        request.num_registered_blocks = 0
        request.num_computed_tokens = 0
        request.truncate_output(num_output_tokens)
        request.status = RequestStatus.WAITING if request.first_scheduled_time is None else RequestStatus.PREEMPTED
        self.requests[rid] = request
        self._waiting[request.request_class].push_front(request)

    def _key(self, req: Request) -> tuple:
        return req.sort_key(self.config.policy)

    def free_blocks_for(self, req: Request) -> int:
        """Free blocks ``req`` may take: a batch request leaves
        ``interactive_reserved_blocks`` alone."""
        free = self.allocator.num_free_blocks
        if req.request_class == RequestClass.BATCH:
            free -= self.config.interactive_reserved_blocks
        return free

    def _preempt(self, req: Request, planned: dict[str, tuple[Request, int, bool]]) -> int:
        """Send a running request back to waiting; returns the tokens it had
        been given earlier in this step (back to the budget)."""
        entry = planned.pop(req.request_id, None)
        self.running.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting[req.request_class].push_front(req)
        return entry[1] if entry else 0

    # ------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int | Sequence[int] | None]
    ) -> list[str]:
        """Apply a finished step: advance computed tokens, append sampled
        tokens, cache newly full blocks, finish requests at ``max_tokens``.

        ``sampled_token_ids`` must hold a token for every scheduled request
        with ``sample`` set; entries for the others are ignored. Requests
        aborted or finished since the plan are skipped. Returns the ids that
        finished by length (their blocks are already freed). Stop tokens and
        strings are the engine's call (:meth:`finish_request`).

        A request that carried guessed tokens (``draft_token_ids``) gets its
        run instead: a list of 1 to ``len(draft_token_ids) + 1`` tokens, the
        guesses it kept and the token sampled after them. Its computed
        tokens then count its last known token and the kept guesses only:
        the keys and values written for rejected guesses sit past them and
        are overwritten when those positions are computed again.
        """
        live = []
        for s in scheduler_output.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            if req.num_computed_tokens != s.start_position:
                raise ValueError(
                    f"stale plan for {s.request_id!r}: it has {req.num_computed_tokens} computed tokens, the plan "
                    f"started at {s.start_position} (was this output applied twice?)"
                )
            if s.sample and sampled_token_ids.get(s.request_id) is None:
                raise ValueError(f"no sampled token for {s.request_id!r}, whose step was to sample one")
            if s.sample and not 1 <= len(_run(sampled_token_ids[s.request_id])) <= len(s.draft_token_ids) + 1:
                raise ValueError(
                    f"{s.request_id!r} carried {len(s.draft_token_ids)} guessed tokens, so its step yields 1 to "
                    f"{len(s.draft_token_ids) + 1} tokens, not {sampled_token_ids[s.request_id]!r}"
                )
            live.append((req, s))

        finished: list[str] = []
        limit = self.config.max_model_len
        for req, s in live:
            if s.sample:
                run = _run(sampled_token_ids[s.request_id])
                req.num_computed_tokens += s.num_scheduled_tokens - len(s.draft_token_ids) - 1 + len(run)
                for token in run:
                    req.append_output_token(token)
            else:
                req.num_computed_tokens += s.num_scheduled_tokens
            self._register_full_blocks(req)
            if not req.samples:
                if req.num_computed_tokens == req.num_tokens:
                    if req.prefill_only:
                        self._park(req)  # its forks take over
                    else:  # a scoring request has all its score rows
                        self._finish(req, RequestStatus.FINISHED_STOPPED)
                        finished.append(req.request_id)
                continue
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= limit:
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                finished.append(req.request_id)
        return finished

    def _register_full_blocks(self, req: Request) -> None:
        if not self._prefix_caching:
            return
        # blocks holding a token still on the device have no hash yet
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        start = req.num_registered_blocks
        if full > start:
            self.allocator.cache_full_blocks(req.block_ids[start:full], req.block_hashes[start:full])
            req.num_registered_blocks = full

    # ------------------------------------------------------------ finishing

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> bool:
        """End a request (running or waiting) now, freeing its blocks.
        Returns False if no unfinished request has that id."""
        status = RequestStatus(status)
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, status)
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a running or waiting request, freeing its blocks at once.
        Returns whether it existed (and was unfinished)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.PARKED:
            for child_id in self.forks.unpark(req, status):  # forks that never started go with it
                self.requests.pop(child_id, None)
        elif not self.forks.unfork(req):
            self._waiting[req.request_class].remove(req)
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        req.status = status
        del self.requests[req.request_id]
        self.latency.forget(req.request_id)
        self._finished_ids.append(req.request_id)
        if status == RequestStatus.FINISHED_ABORTED:
            self._aborted_ids.append(req.request_id)

    # ------------------------------------------------------------ queries

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Finished ids not yet reported in a plan."""
        return bool(self._finished_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def waiting_requests(self, request_class: RequestClass) -> list[Request]:
        """A class's waiting queue in admission order."""
        return list(self._waiting[RequestClass.parse(request_class)])

    def expired_request_ids(self, now: float | None = None) -> list[str]:
        """Unfinished requests past their deadline (the engine decides what to do)."""
        now = time.monotonic() if now is None else now
        return [rid for rid, r in self.requests.items() if r.is_expired(now)]

    def reset_prefix_cache(self) -> bool:
        return self.allocator.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_waiting_interactive=len(self._waiting[RequestClass.INTERACTIVE]),
            num_waiting_batch=len(self._waiting[RequestClass.BATCH]),
            kv_cache_usage=self.allocator.usage,
            num_free_blocks=self.allocator.num_free_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_steps=self._step,
            num_drafts=0 if self.drafter is None else self.drafter.num_drafts,
            num_draft_tokens=0 if self.drafter is None else self.drafter.num_draft_tokens,
            num_accepted_tokens=0 if self.drafter is None else self.drafter.num_accepted_tokens,
        )
