"""One job's run: the one owner of its state, of what it holds and of the
settlement of its deliveries.

A :class:`JobRun` is made by :mod:`jaxserve.worker.intake` for a new key and
lives until a terminal state. Follow one job here, delivery to ack:

1. :meth:`JobRun.serve` runs the admission steps in order
   (:data:`jaxserve.worker.steps.STEPS`: local cancel, tenant arrival, stored
   result, stored cancel, deadline, claim, prompt, response cache, saved
   tokens, calibration, tenant tokens, broker wait, interactive budget,
   what it accepts instead of overloaded); a step that answers, gives the
   job back or passes it to a fallback model (:meth:`rerouted`) ends the
   run there.
2. :meth:`_start` hands the prompt to the engine (``RUNNING``), with the
   tokens an earlier run saved when the job's last worker died
   (:mod:`jaxserve.worker.progress`).
3. Engine outputs reach :meth:`on_output` through the worker
   (``Worker.on_outputs`` finds the run by its engine request id): the
   tokens join the run's :class:`~jaxserve.worker.progress.Progress`, which
   the worker's token saver writes to the store as they pile up; stream
   chunks go to the run's sender task; the final output becomes the result
   (:func:`jaxserve.worker.results.build_result`).
4. :meth:`finish` releases what the run holds, stores an ok result, publishes
   the final to every delivery of the key with confirms and settles each
   (``FINISHING`` -> ``SETTLED``).

Everything else reaches a run as an event, a method call it judges against
its own state: :meth:`cancel` (a cancel message, a gone client, the
deadline timer), :meth:`lease_lost`, :meth:`step_failed`, :meth:`requeue`
(drain, a worker error) and a store outage (inside :meth:`store_call`).

What a run takes (claim, engine slot, saved tokens, admission hold, tenant
tokens, deadline timer, sender task) is registered in its :class:`Holdings`
when taken and released there by the terminal path, never by hand; the
only call of :meth:`Delivery.settle` is :func:`_settle`. What a run may use
of its worker is its :class:`JobServices`, never the worker itself.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aio_pika
import structlog

from jaxserve.cost.jobs import spent
from jaxserve.engine.types import PriorOutput, RequestClass, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.wire import INTERACTIVE, Chunk, Job, Result
from jaxserve.wire.republish import copy_message
from jaxserve.worker import steps
from jaxserve.worker.admission import InteractiveAdmission
from jaxserve.worker.calibration import LabelCalibrations
from jaxserve.worker.config import WorkerConfig
from jaxserve.worker.control import CancelCache
from jaxserve.worker.holdings import Ending, Holdings
from jaxserve.worker.job_log import log_job_done, log_job_start, record_cost
from jaxserve.worker.lifecycle import Abandoned, Delivery, JobState, KeyJob, Settlement
from jaxserve.worker.limits import Limiter
from jaxserve.worker.progress import Progress, TokenSaver
from jaxserve.worker.replies import PublishOutcome, Replies
from jaxserve.worker.results import build_result
from jaxserve.worker.routing import RoutesView
from jaxserve.worker.run_table import RunTable
from jaxserve.worker.startup import ServedEngine
from jaxserve.worker.store import IdempotencyStore, Record, StoreUnavailable
from jaxserve.worker.store_health import StoreHealth
from jaxserve.worker.tracing import JobTimes, Tracing
from jaxserve.worker.worker_state import WorkerStateView

log = structlog.get_logger("jaxserve.worker")

ADMISSION = frozenset({JobState.ADMITTING, JobState.HELD})
UNFINISHED = frozenset({*ADMISSION, JobState.RUNNING})

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]


@dataclasses.dataclass(frozen=True)
class JobServices:
    """What a run may use of the worker that holds it, each a narrow
    object the worker made once its engine was up: the engine it serves
    (requests in, metrics, how results are built), the store and its
    health, the token saver, the reply publishers, the table of runs
    (a run leaves it at its ending), the cancels seen here, the tenant
    limiter and the interactive admission, the label calibrations, the
    routes (re-routing to a fallback model), the tracing, the worker's own
    state (read only), its counters, and ``spawn`` (a task the worker owns:
    a shutdown cancels it)."""

    cfg: WorkerConfig
    engine: ServedEngine
    store: IdempotencyStore
    store_health: StoreHealth
    saver: TokenSaver
    replies: Replies
    runs: RunTable[JobRun]
    cancels: CancelCache
    limiter: Limiter | None
    admission: InteractiveAdmission
    calibrations: LabelCalibrations
    routing: RoutesView
    tracing: Tracing
    state: WorkerStateView
    stats: collections.Counter
    spawn: Spawn

    def count_job(self, queue_class: str, outcome: str) -> None:
        self.engine.metrics.job(queue_class, outcome)


async def _settle(d: Delivery, how: Settlement) -> None:
    """Every settlement of a delivery goes through here (lifecycle's
    settlement rule, ``docs/protocol.md``)."""
    await d.settle(how)


def settlement_after(outcome: PublishOutcome) -> Settlement:
    """A final that was confirmed, or that no one can ever take, is acked;
    one that could not be published is requeued (answered from the store
    on redelivery)."""
    return Settlement.ACK if outcome is PublishOutcome.CONFIRMED or outcome.undeliverable else Settlement.REQUEUE


async def refuse(services: JobServices, d: Delivery, key: str | None, err: RequestError, size: int) -> None:
    """Answer a delivery that never becomes a job (``jaxserve.worker.intake``), then settle it."""
    services.stats["invalid"] += 1
    services.count_job(d.queue_class, err.code)
    log.info("job_invalid", key=key, queue=d.queue_class, bytes=size, code=err.code, reason=err.message)
    result = Result.failure(key, err.code, err.message, err.retryable)
    trace_id = services.tracing.parent_trace_id(d.message.headers)  # never a job: no spans, the producer's id only
    if trace_id is not None:
        result = result.model_copy(update={"trace_id": trace_id})
    await _settle(d, settlement_after(await services.replies.final(d, result)))


class JobRun(KeyJob):
    """One key served here: its :class:`KeyJob` record and everything that moves it."""

    def __init__(self, job: Job, first: Delivery, received_at: float, services: JobServices) -> None:
        super().__init__(job.key, job, first, received_at)
        self.services = services
        self.holdings = Holdings()
        self.tenant_tokens = 0  # tokens charged to the tenant's limits while it holds "tenant"
        self.tenant_cost = 0.0  # and their estimated cost, charged to its daily budget (jaxserve.cost.jobs)
        self.progress: Progress | None = None  # its output so far, saved as it goes (jaxserve.worker.progress)
        self.resumed_tokens = 0  # tokens of an earlier run it continued from (they are not generated here)

    @property
    def in_engine(self) -> bool:
        return self.holdings.holds("engine")

    @property
    def claimed(self) -> bool:
        return self.holdings.holds("claim")

    @property
    def request_class(self) -> RequestClass:
        return RequestClass.INTERACTIVE if self.queue_class == INTERACTIVE else RequestClass.BATCH

    # ------------------------------------------------------------ admission
    async def serve(self) -> None:
        """Admit the job and start it; a worker bug gives it back, never loses it."""
        try:
            self.to(JobState.ADMITTING)
            prepared = steps.Prepared()
            for step in steps.STEPS:
                if not await step(self, prepared):
                    return
            await self._start(prepared)
        except Abandoned:
            pass
        except Exception as exc:  # a worker bug (logged with its traceback)
            self.services.stats["admit_failed"] += 1
            log.error("job_admit_failed", key=self.key, error=repr(exc), exc_info=exc)
            await self.requeue(f"worker error: {exc!r}")

    async def store_call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Call the store for this job. While the store is unreachable the
        job is HELD (in admission) and waits for the outage probe to find
        the store back (``jaxserve.worker.store_health``; the job itself
        does not call it meanwhile), at most ``store_hold_s``: then it goes
        back to the broker, once (the consumers are paused, so it is not
        redelivered here in a loop; ``tests/test_queue_store_outage.py``).
        Raises :class:`Abandoned` when the run leaves the phase it was in
        meanwhile, or went back."""
        svc = self.services
        phase = ADMISSION if self.state in ADMISSION else frozenset({self.state})
        health = svc.store_health
        give_up_at: float | None = None
        while True:
            if health.up:
                try:
                    value = await fn(*args)
                except StoreUnavailable as exc:
                    svc.stats["store_unavailable"] += 1
                    health.failed(exc)
                    if give_up_at is None:
                        log.warning(
                            "store_unavailable_waiting", key=self.key, error=str(exc), hold_s=svc.cfg.store_hold_s
                        )
                else:
                    if self.state not in phase:
                        raise Abandoned
                    if self.state is JobState.HELD:
                        self.to(JobState.ADMITTING)
                    return value
            if self.state is JobState.ADMITTING:
                self.to(JobState.HELD)
            if svc.state.closing or self.state not in phase:
                raise Abandoned from None
            now = time.monotonic()
            give_up_at = now + svc.cfg.store_hold_s if give_up_at is None else give_up_at
            back = await health.wait_up(max(0.0, give_up_at - now))
            if self.state not in phase:
                raise Abandoned from None
            if not back:
                svc.stats["store_hold_expired"] += 1
                await self.requeue(f"store unavailable for {svc.cfg.store_hold_s:g}s")
                raise Abandoned from None

    async def _start(self, p: steps.Prepared) -> None:
        svc, job = self.services, self.job
        prior = p.prior
        if prior is not None and len(prior.token_ids) >= job.params.max_tokens:  # (degraded meanwhile)
            prior = _first(prior, job.params.max_tokens - 1)
        log_job_start(self, len(p.prompt_ids), svc.cfg.log_text, 0 if prior is None else len(prior.token_ids))
        if job.stream:
            sender = svc.spawn(self._sender())
            self.holdings.take("sender", lambda end: self._stop_sender(sender, end))
        deadline_mono = None if job.deadline is None else time.monotonic() + (job.deadline - time.time())
        host = svc.engine.host
        self.to(JobState.RUNNING)
        self.holdings.take("engine", self._abort_in_engine)
        svc.runs.entered_engine(self)
        if p.label_ids is None and svc.saver.enabled:
            self._save_progress(prior)
        try:
            if p.label_ids is not None:
                await host.add_score_request(
                    self.request_id,
                    p.prompt_ids,
                    p.label_ids,
                    request_class=self.request_class,
                    priority=job.engine_priority,
                    deadline=deadline_mono,
                )
            else:
                # the same request from the saved tokens, and from nothing if the engine refuses them
                add_request = functools.partial(
                    host.add_request,
                    self.request_id,
                    p.prompt_ids,
                    job.params,
                    request_class=self.request_class,
                    priority=job.engine_priority,
                    deadline=deadline_mono,
                )
                try:
                    await add_request(prior=prior)
                except RequestError as err:
                    if prior is None or err.code != "invalid_request":
                        raise
                    # saved tokens the engine will not continue (another tokenizer, say): from nothing
                    log.warning("saved_tokens_refused", key=self.key, tokens=len(prior.token_ids), reason=err.message)
                    if self.progress is not None:
                        self.progress.resume(PriorOutput(()))
                    await add_request()
        except RequestError as err:
            self.holdings.forget("engine")
            if self.state is JobState.RUNNING:
                await self.finish(Result.failure(self.key, err.code, err.message, err.retryable))
            return
        except Exception as exc:  # noqa: BLE001 - the engine thread is gone
            self.holdings.forget("engine")
            await self.requeue(f"engine unavailable: {exc!r}")
            return
        self.admitted_mono = time.monotonic()

    def _save_progress(self, prior: PriorOutput | None) -> None:
        """Save the run's tokens as they come (from ``prior``, saved
        already, on); at its ending they are saved once more when it goes
        back to the broker still holding the key, dropped when it ends with
        an error, and gone with the stored result when it ends ok."""
        svc, params = self.services, self.job.params
        self.progress = progress = Progress(
            self.key,
            self.job.fingerprint,
            svc.engine.served_model_name,
            logprobs=params.logprobs,
            top=params.logprobs and params.top_logprobs > 0,
        )
        if prior is not None:
            progress.resume(prior)
        svc.saver.watch(progress)

        async def release(end: Ending) -> None:
            back = end.requeued and self.claimed  # lost to another worker: its tokens are the owner's now
            await svc.saver.unwatch(progress, save=back, drop=not end.ok and not end.requeued)

        self.holdings.take("progress", release)

    async def _abort_in_engine(self, end: Ending) -> None:
        try:
            await self.services.engine.host.abort(self.request_id)
        except Exception as exc:  # noqa: BLE001 - a dead engine holds nothing
            if not end.requeued:  # going back (a drain after the engine died, say) needs no word
                log.warning("engine_abort_failed", key=self.key, error=repr(exc))

    # --------------------------------------------------------------- events
    def on_output(self, out: RequestOutput) -> None:
        """One engine output of this run (while RUNNING)."""
        svc = self.services
        n_new = len(out.new_token_ids)
        if n_new and self.first_token_mono is not None:
            now = time.monotonic()
            svc.engine.metrics.observe_tokens(self.queue_class, now - self.last_token_mono, n_new)
            self.last_token_mono = now
        if n_new and self.first_token_mono is None:
            # a resumed request's first output starts where the engine took the saved tokens up
            self.resumed_tokens = max(0, out.completion_tokens - n_new)
        if self.progress is not None and n_new:
            self.progress.add(out)
            svc.saver.noted(self.progress)
        if self.job.stream:
            self.pending_tokens += n_new
            if n_new and self.first_token_mono is None:
                self.pending_tokens += self.resumed_tokens  # the first delta carries their text
        if out.new_text:
            if self.first_token_mono is None:
                self._first_token()
            self.text_parts.append(out.new_text)
            if self.job.stream:
                self.pending_text.append(out.new_text)
                self.outbox.set()
        elif out.new_token_ids and self.first_token_mono is None:
            self._first_token()
            if self.job.stream:
                # The first token goes out at once, even while its text is
                # held back (part of a UTF-8 character, a piece that may
                # merge with the next): the caller's time to first token is
                # this chunk, not the first decodable text.
                self.pending_text.append("")
                self.outbox.set()
        if out.finished:
            self.holdings.forget("engine")
            self.engine_metrics = out.metrics
            result = build_result(self, out, svc.engine.results)
            if result.error is not None and result.error.code == "internal" and result.error.retryable:
                svc.spawn(self.requeue(f"engine: {result.error.message}"))
            else:
                svc.spawn(self.finish(result))

    def _first_token(self) -> None:
        """From its first token on, a job's deadline no longer applies and
        its prompt leaves the interactive admission budget."""
        self.first_token_mono = self.last_token_mono = time.monotonic()
        self.holdings.release_now("deadline")
        self.holdings.release_now("admission")

    def on_deadline(self) -> None:
        if self.first_token_mono is None and self.services.runs.get(self.key) is self and self.state in UNFINISHED:
            self.services.spawn(self.cancel("expired", "the job's deadline passed while it waited"))

    async def cancel(self, code: str, message: str) -> None:
        """End a run that has not finished with an error result (a cancel,
        its deadline, its client gone)."""
        if self.state in UNFINISHED:
            await self.finish(Result.failure(self.key, code, message))

    async def lease_lost(self, owner: str) -> None:
        """Another worker runs the key now: give ours back (its claim is theirs)."""
        if self.state is JobState.RUNNING:
            self.services.stats["lease_lost"] += 1
            log.warning("claim_lost", key=self.key, owner=owner)
            self.holdings.forget("claim")
            await self.requeue(f"lease lost to {owner}")

    def step_failed(self, exc: BaseException) -> None:
        if self.in_engine and self.state is JobState.RUNNING:
            self.services.spawn(self.requeue(f"engine step failed: {exc!r}"))

    def drain_waits(self) -> bool:
        """Drain waits for a job that can finish: not for one held in
        admission (it has not started: it goes back to the broker at once),
        nor, while the store is down, for one that started (its result could
        not be stored)."""
        if self.state is JobState.HELD:
            return False
        return self.services.store_health.up or self.state in (JobState.RECEIVED, JobState.ADMITTING)

    # --------------------------------------------------------------- chunks
    async def _sender(self) -> None:
        """Publish this job's chunks in order, coalescing deltas that pile
        up while a confirm is pending. A run that continues an earlier
        one's saved tokens says so on its first chunk (``resumed``: how many
        of its tokens it did not generate; its text carries theirs)."""
        svc = self.services
        while True:
            await self.outbox.wait()
            self.outbox.clear()
            while self.pending_text:
                text = "".join(self.pending_text)
                self.pending_text.clear()
                chunk = Chunk(
                    id=self.key,
                    seq=self.seq,
                    text=text,
                    run=self.run_id,
                    tokens=self.pending_tokens,
                    resumed=self.resumed_tokens if self.seq == 0 and self.resumed_tokens else None,
                )
                self.pending_tokens = 0
                self.seq += 1
                outcome = await svc.replies.chunk(self.primary, chunk)
                svc.stats["chunks"] += 1
                if outcome.undeliverable and self.primary.reply_to != svc.cfg.topology.results and not self.client_gone:
                    # The requester's reply queue is gone: stop generating.
                    self.client_gone = True
                    svc.spawn(self.cancel("cancelled", "the reply queue disappeared (client gone)"))
            if self.state is not JobState.RUNNING:
                return

    async def _stop_sender(self, sender: asyncio.Task, end: Ending) -> None:
        """Requeued: stop sending. Finishing: every chunk goes out before the final."""
        if end.requeued:
            sender.cancel()
            return
        self.outbox.set()
        try:
            await sender
        except asyncio.CancelledError:
            pass

    # ------------------------------------------------------------- endings
    async def finish(self, result: Result, record: Record | None = None) -> None:
        """Store a fresh ok result, then answer every delivery of the key
        (those that arrive meanwhile too) and settle each once."""
        if self.state not in UNFINISHED:
            return
        svc = self.services
        self.to(JobState.FINISHING)
        trace = svc.runs.trace(self)
        if trace is not None:
            trace.result_ready(self.primary.reply_to)
            result = result.model_copy(update={"trace_id": trace.trace_id})
        self.result = result
        used = result.usage.prompt_tokens + result.usage.completion_tokens if result.usage is not None else 0
        ending = Ending(ok=result.ok, used_tokens=used, used_cost=spent(result))
        if record is None:  # served here now, not a replay
            record_cost(svc.engine.metrics, svc.cfg.limits, self.job.tenant, result)
        await self.holdings.release(ending, "deadline", "engine", "sender", "progress", "admission", "tenant")
        try:
            delivered = set(record.delivered) if record is not None else set()
            if result.ok and record is None:
                await self.store_call(svc.store.put, self.key, Record(result.to_dict(), [], self.job.fingerprint))
                if self.cache_key is not None and not result.cached:
                    await svc.store_health.best_effort(
                        "cache_put", svc.store.cache_put, self.cache_key, result.to_dict(), stats=svc.stats
                    )
            await self.holdings.release(ending, "claim")
        except Abandoned:
            return
        replies: collections.Counter = collections.Counter()
        while (d := self.next_unsettled()) is not None:
            if self.state is not JobState.FINISHING:
                return
            if result.ok and d.redelivered and d.dest in delivered:
                await _settle(d, Settlement.ACK)  # this very message was answered already (its ack was lost)
                replies["already"] += 1
                continue
            if d is self.primary and self.client_gone:
                outcome = PublishOutcome.UNROUTABLE
            else:
                replayed = result.ok and (record is not None or d is not self.primary)
                final = result.model_copy(update={"replayed": True}) if replayed else result
                outcome = await svc.replies.final(d, final)
            replies[outcome.value] += 1
            if d.settled is not None:  # requeued by a drain while we published
                continue
            if outcome is PublishOutcome.CONFIRMED and result.ok:
                delivered.add(d.dest)
                await svc.store_health.best_effort(
                    "mark_delivered", svc.store.mark_delivered, self.key, d.dest, stats=svc.stats
                )
            elif outcome.undeliverable:
                svc.stats["reply_undeliverable"] += 1  # nobody can take it; a resubmission is answered from the store
            await _settle(d, settlement_after(outcome))
        if self.state is not JobState.FINISHING:
            return
        self.to(JobState.SETTLED)
        self._leave()
        log_job_done(
            svc.stats,
            svc.engine.metrics,
            self,
            result,
            record is not None,
            replies,
            svc.cfg.log_text,
            self.resumed_tokens,
        )

    async def requeue(self, reason: str) -> None:
        """Give the job back to the broker: every unsettled delivery is
        nacked with requeue (drain, lost lease, retryable failure)."""
        if self.terminal:
            return
        svc = self.services
        self.to(JobState.REQUEUED)
        self._leave()
        await self.holdings.release(Ending(requeued=True))
        for d in self.unsettled():
            await _settle(d, Settlement.REQUEUE)
        svc.stats["requeued"] += 1
        svc.count_job(self.queue_class, "requeued")
        metrics = svc.engine.metrics  # bounded: drain, engine, lease, worker
        kind = reason.split(":")[0].split()[0].lower()
        metrics.requeues.labels(metrics.model_name, self.queue_class, kind).inc()
        log.info("job_requeued", key=self.key, queue=self.queue_class, reason=reason, deliveries=len(self.deliveries))

    async def defer(self, wait_s: float, reason: str) -> None:
        """A batch job over its tenant's limit waits in the broker: after a
        short pause it is published again at the tail of its queue (same
        body and properties, with a confirm) and only then acked, so the
        jobs of other tenants behind it come forward."""
        svc = self.services
        self.to(JobState.DEFERRED)
        self._leave()
        await self.holdings.release(Ending(requeued=True))
        await asyncio.sleep(min(max(wait_s, 0.0), svc.cfg.defer_wait_max_s))
        message = self.primary.message
        headers = dict(message.headers or {})
        headers["x-jaxserve-deferred"] = int(headers.get("x-jaxserve-deferred") or 0) + 1
        copy = copy_message(message, headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        try:
            outcome = await svc.replies.republish(self.queue_class, copy)
        except Exception as exc:  # noqa: BLE001 - not republished: it waits in the broker as it is
            log.warning("job_defer_republish_failed", key=self.key, error=repr(exc))
            outcome = PublishOutcome.FAILED
        how = Settlement.ACK if outcome is PublishOutcome.CONFIRMED else Settlement.REQUEUE
        for d in self.unsettled():
            await _settle(d, how)
        svc.stats["deferred"] += 1
        log.info("job_deferred", key=self.key, reason=reason, tenant=self.job.tenant, republished=how is Settlement.ACK)

    async def rerouted(self, model: str) -> None:
        """Overloaded here, the job was passed once to the queue of its
        fallback ``model`` (``jaxserve.worker.fallback``), whose worker
        answers it; the broker confirmed that copy, so every delivery is
        acked and what the run holds is given back (its tenant's request too:
        the fallback's worker counts it)."""
        svc = self.services
        self.to(JobState.REROUTED)
        self._leave()
        await self.holdings.release(Ending(requeued=True))
        for d in self.unsettled():
            await _settle(d, Settlement.ACK)
        svc.stats["rerouted"] += 1
        svc.count_job(self.queue_class, "rerouted")
        log.info("job_rerouted", key=self.key, queue=self.queue_class, to=model, deliveries=len(self.deliveries))

    def _leave(self) -> None:
        """Leave the worker's tables (only where this run still serves its
        key) and end the job's trace."""
        trace = self.services.runs.leave(self)
        if trace is not None:
            settled = self.state is JobState.SETTLED
            times = JobTimes.of(self, self.broker_wait_s, trace.result_ready_at)
            trace.end(times, self.result if settled else None, None if settled else self.state.value)


def _first(prior: PriorOutput, n: int) -> PriorOutput:
    """The first ``n`` tokens of ``prior`` (a job whose ``max_tokens`` is
    lower than what its earlier run generated)."""
    return PriorOutput(
        prior.token_ids[:n],
        None if prior.logprobs is None else prior.logprobs[:n],
        None if prior.top_logprobs is None else prior.top_logprobs[:n],
    )
