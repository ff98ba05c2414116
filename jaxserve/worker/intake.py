"""A delivery's way in: read it, refuse what cannot be a job, fence its key.

Properties that do not decode, a forbidden ``reply_to`` or a bad body get an
``invalid_request`` result (``jaxserve.wire`` does every range check) and are
acked. A key already served here attaches the delivery to its run (a
redelivery or a duplicate publish: a key never runs twice here; the run
answers it when it ends). A new key becomes a :class:`JobRun` in the
worker's run table, which then serves it (``jaxserve.worker.job_run``).
"""

from __future__ import annotations

import time

import aio_pika
import structlog

from jaxserve.request_error import RequestError
from jaxserve.wire import JobLimits, JobProperties, amqp_compat, check_reply_to, parse_job
from jaxserve.worker.config import published_at, text_or_none
from jaxserve.worker.job_run import JobRun, JobServices, refuse
from jaxserve.worker.lifecycle import Delivery
from jaxserve.worker.steps import reused

log = structlog.get_logger("jaxserve.worker")

Message = aio_pika.abc.AbstractIncomingMessage


class Intake:
    """The worker's way in for job deliveries, once its engine is up:
    ``limits`` are the engine's (body size, vocabulary, context); new runs
    get ``services``."""

    def __init__(self, services: JobServices, limits: JobLimits) -> None:
        self.services = services
        self.limits = limits
        self.results = services.cfg.topology.results

    async def take(self, message: Message, queue_class: str) -> None:
        """Every delivery ends answered and settled, whatever its content: an
        unexpected failure while reading it (a bug, a pathological body) is
        answered ``invalid_request`` and acked rather than left unsettled, which
        would hold a prefetch slot for ever
        (``tests/test_worker_lifecycle.py``)."""
        svc = self.services
        made: list[Delivery] = []
        try:
            run = await self._read(message, queue_class, made)
        except Exception as exc:  # noqa: BLE001
            svc.stats["unreadable"] += 1
            log.error("job_unreadable", message_id=text_or_none(message.message_id), error=repr(exc)[:300])
            d = made[-1] if made else Delivery(message, queue_class, self.results, None, svc.stats)
            if d.settled is None:  # never settle a delivery twice (the broker would close the channel)
                d.reply_to = self.results
                err = RequestError("invalid_request", f"the job could not be read ({type(exc).__name__})")
                await refuse(svc, d, text_or_none(message.message_id), err, len(message.body or b""))
            return
        if run is not None:
            await run.serve()

    async def _read(self, message: Message, queue_class: str, made: list[Delivery]) -> JobRun | None:
        """A delivery as a new run in the run table, or None when it was
        answered here (refused, or attached to the run already serving its key)."""
        svc = self.services
        received_at = time.time()
        svc.stats["received"] += 1
        key = text_or_none(message.message_id)
        reply_to = text_or_none(message.reply_to) or self.results
        bad = amqp_compat.undecodable_properties(message)
        if bad:
            if "reply_to" in bad:
                reply_to = self.results
            d = Delivery(message, queue_class, reply_to, text_or_none(message.correlation_id), svc.stats)
            made.append(d)
            err = RequestError("invalid_request", f"AMQP properties that do not decode: {', '.join(bad)}")
            await refuse(svc, d, key, err, len(message.body))
            return None
        d = Delivery(message, queue_class, reply_to, text_or_none(message.correlation_id), svc.stats)
        made.append(d)
        try:
            check_reply_to(message.reply_to, svc.cfg.topology.reserved_names())
        except RequestError as err:
            d.reply_to = self.results  # never into the worker's own queues
            await refuse(svc, d, key, err, len(message.body))
            return None
        try:
            job = parse_job(
                message.body,
                JobProperties(
                    message_id=message.message_id,
                    reply_to=message.reply_to,
                    correlation_id=message.correlation_id,
                    content_type=message.content_type,
                    expiration=message.expiration,
                    published_at=published_at(message),
                    priority=message.priority,
                ),
                self.limits,
                received_at=received_at,
            )
        except RequestError as err:
            await refuse(svc, d, key, err, len(message.body))
            return None

        existing = svc.runs.get(job.key)
        if existing is not None:
            if existing.job.fingerprint != job.fingerprint:
                await refuse(svc, d, job.key, reused(job.key), len(message.body))
                return None
            # A redelivery (our channel died) or a duplicate publish: never run
            # a key twice; the running job answers it when it ends.
            existing.attach(d)
            svc.stats["fenced"] += 1
            log.info("job_fenced", key=job.key, redelivered=d.redelivered, state=existing.state.value)
            return None
        run = JobRun(job, d, received_at, svc)
        trace = svc.tracing.start_job(
            message.headers,
            queue=svc.routing.job_queue(queue_class),
            queue_class=queue_class,
            message_id=job.key,
            correlation_id=d.correlation_id,
            body_size=len(message.body),
            redelivered=d.redelivered,
            received_mono=run.received_mono,
            broker_wait_s=run.broker_wait_s,
        )
        svc.runs.add(run, trace)
        return run
