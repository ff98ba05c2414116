"""One job's run: the one owner of its state, of what it holds and of the
settlement of its deliveries.

A :class:`JobRun` is made by :mod:`jaxserve.worker.intake` for a new key and
lives until a terminal state. Follow one job here, delivery to ack:

1. :meth:`JobRun.serve` runs the admission steps in order
   (:data:`jaxserve.worker.steps.STEPS`: local cancel, tenant arrival, stored
   result, stored cancel, deadline, claim, prompt, response cache,
   calibration, tenant tokens, broker wait, interactive budget, what it
   accepts instead of overloaded); a step that answers, gives the job back
   or passes it to a fallback model (:meth:`rerouted`) ends the run there.
2. :meth:`_start` hands the prompt to the engine (``RUNNING``).
3. Engine outputs arrive as :meth:`on_output`: stream chunks go to the run's
   sender task; the final output becomes the result
   (:func:`jaxserve.worker.results.build_result`).
4. :meth:`finish` releases what the run holds, stores an ok result, publishes
   the final to every delivery of the key with confirms and settles each
   (``FINISHING`` -> ``SETTLED``).

Everything else reaches a run as an event, a method call it judges against
its own state: :meth:`cancel` (a cancel message, a gone client, the
deadline timer), :meth:`lease_lost`, :meth:`step_failed`, :meth:`requeue`
(drain, a worker error) and a store outage (inside :meth:`store_call`).

What a run takes (claim, engine slot, admission hold, tenant tokens,
deadline timer, sender task) is registered in its :class:`Holdings` when
taken and released there by the terminal path, never by hand; the only
call of :meth:`Delivery.settle` is :func:`_settle`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aio_pika
import structlog

from jaxserve.cost.jobs import spent
from jaxserve.engine.types import RequestClass, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.wire import INTERACTIVE, Chunk, Job, Result
from jaxserve.wire.republish import copy_message
from jaxserve.worker import steps
from jaxserve.worker.holdings import Ending, Holdings
from jaxserve.worker.job_log import log_job_done, log_job_start, record_cost
from jaxserve.worker.lifecycle import Abandoned, Delivery, JobState, KeyJob, Settlement
from jaxserve.worker.replies import PublishOutcome
from jaxserve.worker.results import build_result
from jaxserve.worker.store import Record
from jaxserve.worker.store_health import call_held
from jaxserve.worker.tracing import JobTimes

if TYPE_CHECKING:
    from jaxserve.worker.worker import Worker

log = structlog.get_logger("jaxserve.worker")

ADMISSION = frozenset({JobState.ADMITTING, JobState.HELD})
UNFINISHED = frozenset({*ADMISSION, JobState.RUNNING})


async def _settle(d: Delivery, how: Settlement) -> None:
    """Every settlement of a delivery goes through here (lifecycle's
    settlement rule, ``docs/protocol.md``)."""
    await d.settle(how)


def settlement_after(outcome: PublishOutcome) -> Settlement:
    """A final that was confirmed, or that no one can ever take, is acked;
    one that could not be published is requeued (answered from the store
    on redelivery)."""
    return Settlement.ACK if outcome is PublishOutcome.CONFIRMED or outcome.undeliverable else Settlement.REQUEUE


async def refuse(w: Worker, d: Delivery, key: str | None, err: RequestError, size: int) -> None:
    """Answer a delivery that never becomes a job (``jaxserve.worker.intake``), then settle it."""
    w.stats["invalid"] += 1
    w.count_job(d.queue_class, err.code)
    log.info("job_invalid", key=key, queue=d.queue_class, bytes=size, code=err.code, reason=err.message)
    result = Result.failure(key, err.code, err.message, err.retryable)
    trace_id = w.tracing.parent_trace_id(d.message.headers)  # never a job: no spans, the producer's id only
    if trace_id is not None:
        result = result.model_copy(update={"trace_id": trace_id})
    await _settle(d, settlement_after(await w.replies.final(d, result)))


class JobRun(KeyJob):
    """One key served here: its :class:`KeyJob` record and everything that moves it."""

    def __init__(self, w: Worker, job: Job, first: Delivery, received_at: float) -> None:
        super().__init__(job.key, job, first, received_at)
        self.w = w
        self.res = Holdings()
        self.tenant_tokens = 0  # tokens charged to the tenant's limits while it holds "tenant"
        self.tenant_cost = 0.0  # and their estimated cost, charged to its daily budget (jaxserve.cost.jobs)

    @property
    def in_engine(self) -> bool:
        return self.res.holds("engine")

    @property
    def claimed(self) -> bool:
        return self.res.holds("claim")

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
            self.w.stats["admit_failed"] += 1
            log.error("job_admit_failed", key=self.key, error=repr(exc), exc_info=exc)
            await self.requeue(f"worker error: {exc!r}")

    async def store_call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Call the store, holding the job through an outage (``store_health.call_held``)."""
        return await call_held(self, fn, *args)

    async def _start(self, p: steps.Prepared) -> None:
        w, job = self.w, self.job
        log_job_start(self, len(p.prompt_ids), w.cfg.log_text)
        if job.stream:
            sender = w.spawn(self._sender())
            self.res.take("sender", lambda end: self._stop_sender(sender, end))
        deadline_mono = None if job.deadline is None else time.monotonic() + (job.deadline - time.time())
        assert w.host is not None
        host = w.host
        self.to(JobState.RUNNING)
        self.res.take("engine", self._abort_in_engine)
        w.by_rid[self.request_id] = self
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
                await host.add_request(
                    self.request_id,
                    p.prompt_ids,
                    job.params,
                    request_class=self.request_class,
                    priority=job.engine_priority,
                    deadline=deadline_mono,
                )
        except RequestError as err:
            self.res.forget("engine")
            if self.state is JobState.RUNNING:
                await self.finish(Result.failure(self.key, err.code, err.message, err.retryable))
            return
        except Exception as exc:  # noqa: BLE001 - the engine thread is gone
            self.res.forget("engine")
            await self.requeue(f"engine unavailable: {exc!r}")
            return
        self.admitted_mono = time.monotonic()

    async def _abort_in_engine(self, end: Ending) -> None:
        host = self.w.host
        if host is None:
            return
        try:
            await host.abort(self.request_id)
        except Exception as exc:  # noqa: BLE001 - a dead engine holds nothing
            if not end.requeued:  # going back (a drain after the engine died, say) needs no word
                log.warning("engine_abort_failed", key=self.key, error=repr(exc))

    # --------------------------------------------------------------- events
    def on_output(self, out: RequestOutput) -> None:
        """One engine output of this run (while RUNNING)."""
        w = self.w
        n_new = len(out.new_token_ids)
        if n_new and self.first_token_mono is not None and w.metrics is not None:
            now = time.monotonic()
            w.metrics.observe_tokens(self.queue_class, now - self.last_token_mono, n_new)
            self.last_token_mono = now
        if self.job.stream:
            self.pending_tokens += n_new
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
            self.res.forget("engine")
            self.engine_metrics = out.metrics
            result = build_result(self, out, w.result_context)
            if result.error is not None and result.error.code == "internal" and result.error.retryable:
                w.spawn(self.requeue(f"engine: {result.error.message}"))
            else:
                w.spawn(self.finish(result))

    def _first_token(self) -> None:
        """From its first token on, a job's deadline no longer applies and
        its prompt leaves the interactive admission budget."""
        self.first_token_mono = self.last_token_mono = time.monotonic()
        self.res.release_now("deadline")
        self.res.release_now("admission")

    def on_deadline(self) -> None:
        if self.first_token_mono is None and self.w.active.get(self.key) is self and self.state in UNFINISHED:
            self.w.spawn(self.cancel("expired", "the job's deadline passed while it waited"))

    async def cancel(self, code: str, message: str) -> None:
        """End a run that has not finished with an error result (a cancel,
        its deadline, its client gone)."""
        if self.state in UNFINISHED:
            await self.finish(Result.failure(self.key, code, message))

    async def lease_lost(self, owner: str) -> None:
        """Another worker runs the key now: give ours back (its claim is theirs)."""
        if self.state is JobState.RUNNING:
            self.w.stats["lease_lost"] += 1
            log.warning("claim_lost", key=self.key, owner=owner)
            self.res.forget("claim")
            await self.requeue(f"lease lost to {owner}")

    def step_failed(self, exc: BaseException) -> None:
        if self.in_engine and self.state is JobState.RUNNING:
            self.w.spawn(self.requeue(f"engine step failed: {exc!r}"))

    def drain_waits(self) -> bool:
        """Drain waits for a job that can finish: not for one held in
        admission (it has not started: it goes back to the broker at once),
        nor, while the store is down, for one that started (its result could
        not be stored)."""
        if self.state is JobState.HELD:
            return False
        return self.w.store_health.up or self.state in (JobState.RECEIVED, JobState.ADMITTING)

    # --------------------------------------------------------------- chunks
    async def _sender(self) -> None:
        """Publish this job's chunks in order, coalescing deltas that pile
        up while a confirm is pending."""
        w = self.w
        while True:
            await self.outbox.wait()
            self.outbox.clear()
            while self.pending_text:
                text = "".join(self.pending_text)
                self.pending_text.clear()
                chunk = Chunk(id=self.key, seq=self.seq, text=text, run=self.run, tokens=self.pending_tokens)
                self.pending_tokens = 0
                self.seq += 1
                outcome = await w.replies.chunk(self.primary, chunk)
                w.stats["chunks"] += 1
                if outcome.undeliverable and self.primary.reply_to != w.topo.results and not self.client_gone:
                    # The requester's reply queue is gone: stop generating.
                    self.client_gone = True
                    w.spawn(self.cancel("cancelled", "the reply queue disappeared (client gone)"))
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
        w = self.w
        self.to(JobState.FINISHING)
        trace = w.traces.get(self.request_id)
        if trace is not None:
            trace.result_ready(self.primary.reply_to)
            result = result.model_copy(update={"trace_id": trace.trace_id})
        self.result = result
        used = result.usage.prompt_tokens + result.usage.completion_tokens if result.usage is not None else 0
        ending = Ending(ok=result.ok, used_tokens=used, used_cost=spent(result))
        if record is None:  # served here now, not a replay
            record_cost(w, self.job.tenant, result)
        await self.res.release(ending, "deadline", "engine", "sender", "admission", "tenant")
        try:
            delivered = set(record.delivered) if record is not None else set()
            if result.ok and record is None:
                await self.store_call(w.store.put, self.key, Record(result.to_dict(), [], self.job.fingerprint))
                if self.cache_key is not None and not result.cached:
                    await w.best_effort("cache_put", w.store.cache_put, self.cache_key, result.to_dict())
            await self.res.release(ending, "claim")
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
                outcome = await w.replies.final(d, result.model_copy(update={"replayed": True}) if replayed else result)
            replies[outcome.value] += 1
            if d.settled is not None:  # requeued by a drain while we published
                continue
            if outcome is PublishOutcome.CONFIRMED and result.ok:
                delivered.add(d.dest)
                await w.best_effort("mark_delivered", w.store.mark_delivered, self.key, d.dest)
            elif outcome.undeliverable:
                w.stats["reply_undeliverable"] += 1  # nobody can take it; a resubmission is answered from the store
            await _settle(d, settlement_after(outcome))
        if self.state is not JobState.FINISHING:
            return
        self.to(JobState.SETTLED)
        self._forget()
        log_job_done(w, self, result, record is not None, replies)

    async def requeue(self, reason: str) -> None:
        """Give the job back to the broker: every unsettled delivery is
        nacked with requeue (drain, lost lease, retryable failure)."""
        if self.terminal:
            return
        w = self.w
        self.to(JobState.REQUEUED)
        self._forget()
        await self.res.release(Ending(requeued=True))
        for d in self.unsettled():
            await _settle(d, Settlement.REQUEUE)
        w.stats["requeued"] += 1
        w.count_job(self.queue_class, "requeued")
        if w.metrics is not None:  # bounded: drain, engine, lease, worker
            kind = reason.split(":")[0].split()[0].lower()
            w.metrics.requeues.labels(w.metrics.model_name, self.queue_class, kind).inc()
        log.info("job_requeued", key=self.key, queue=self.queue_class, reason=reason, deliveries=len(self.deliveries))

    async def defer(self, wait_s: float, reason: str) -> None:
        """A batch job over its tenant's limit waits in the broker: after a
        short pause it is published again at the tail of its queue (same
        body and properties, with a confirm) and only then acked, so the
        jobs of other tenants behind it come forward."""
        w = self.w
        self.to(JobState.DEFERRED)
        self._forget()
        await self.res.release(Ending(requeued=True))
        await asyncio.sleep(min(max(wait_s, 0.0), w.cfg.defer_wait_max_s))
        message = self.primary.message
        headers = dict(message.headers or {})
        headers["x-jaxserve-deferred"] = int(headers.get("x-jaxserve-deferred") or 0) + 1
        copy = copy_message(message, headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        try:
            outcome = await w.replies.republish(self.queue_class, copy)
        except Exception as exc:  # noqa: BLE001 - not republished: it waits in the broker as it is
            log.warning("job_defer_republish_failed", key=self.key, error=repr(exc))
            outcome = PublishOutcome.FAILED
        how = Settlement.ACK if outcome is PublishOutcome.CONFIRMED else Settlement.REQUEUE
        for d in self.unsettled():
            await _settle(d, how)
        w.stats["deferred"] += 1
        log.info("job_deferred", key=self.key, reason=reason, tenant=self.job.tenant, republished=how is Settlement.ACK)

    async def rerouted(self, model: str) -> None:
        """Overloaded here, the job was passed once to the queue of its
        fallback ``model`` (``jaxserve.worker.fallback``), whose worker
        answers it; the broker confirmed that copy, so every delivery is
        acked and what the run holds is given back (its tenant's request too:
        the fallback's worker counts it)."""
        w = self.w
        self.to(JobState.REROUTED)
        self._forget()
        await self.res.release(Ending(requeued=True))
        for d in self.unsettled():
            await _settle(d, Settlement.ACK)
        w.stats["rerouted"] += 1
        w.count_job(self.queue_class, "rerouted")
        log.info("job_rerouted", key=self.key, queue=self.queue_class, to=model, deliveries=len(self.deliveries))

    def _forget(self) -> None:
        """Leave the worker's tables (only where this run still serves its
        key) and end the job's trace."""
        w = self.w
        if w.active.get(self.key) is self:
            del w.active[self.key]
        if w.by_rid.get(self.request_id) is self:
            del w.by_rid[self.request_id]
        trace = w.traces.pop(self.request_id, None)
        if trace is not None:
            settled = self.state is JobState.SETTLED
            times = JobTimes.of(self, w.broker_wait(self), trace.result_ready_at)
            trace.end(times, self.result if settled else None, None if settled else self.state.value)
