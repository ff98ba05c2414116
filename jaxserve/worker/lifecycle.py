"""The life of one job key on one worker, as an explicit state machine.

A key is served by one :class:`KeyJob` at a time (the worker's active
table). Every AMQP delivery of that key (the first, a duplicate publish, a
redelivery after a lost channel) is one :class:`Delivery`, attached to the
job, and every delivery is settled exactly once: acked or requeued (nack
with requeue). :meth:`Delivery.settle` enforces "once" (a second
settlement is refused and counted as a bug), so no code path can ack twice
or forget one: a job only reaches a terminal state once none of its
deliveries is left unsettled.

States and transitions (anything else raises :class:`IllegalTransition`)::

    RECEIVED ──> ADMITTING ──> RUNNING ──> FINISHING ──> SETTLED
                   │  ^   └───────────────────^
                   v  │   (replay, refusal, cancel, expiry)
                   HELD  (claimed by another worker / store unreachable)

    RECEIVED, ADMITTING, HELD, RUNNING, FINISHING ──> REQUEUED
    ADMITTING ──> DEFERRED  (a batch job over its tenant's limit: republished, then acked)
    ADMITTING ──> REROUTED  (overloaded, passed to a fallback model's queue, then acked)

* ADMITTING: checks against the store (replay, key reuse, cancel), the
  deadline, the claim, the prompt.
* HELD: waiting for another worker's claim to end or for the store to come
  back; the delivery stays unacked (the prefetch bounds how many).
* RUNNING: in the engine.
* FINISHING: the final result is known; it is stored, then published to
  each delivery's reply destination, then each delivery is settled.
  Deliveries that arrive during FINISHING are answered by the same loop.
* SETTLED / REQUEUED / DEFERRED / REROUTED: terminal; the job has left the active table.

Settlement rule (``docs/protocol.md``, "Worker guarantees"): a delivery is
acked only after its final reply was confirmed by the broker, or when the
reply can never be delivered (its reply queue does not exist, or the broker
refuses the destination): then the result stays in the store for a
resubmission. A final that could not be published (no confirm before the
reply deadline, broker nacks) is requeued, and its redelivery is answered
from the store. A retryable ``internal`` failure is requeued without a
reply, so ``x-delivery-limit`` dead-letters a job that keeps failing.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from typing import Any

import structlog

from jaxserve.wire import Job, Result
from jaxserve.worker.config import published_at

log = structlog.get_logger("jaxserve.worker")


def engine_request_id(key: str, run_id: str) -> str:
    """The engine's id for one run of a key: unique per run, so late outputs
    of an aborted run can never reach a later run of the same key."""
    return f"{key}#{run_id}"


def job_key_of(request_id: str) -> str:
    """The job key inside an :func:`engine_request_id`."""
    return request_id.rpartition("#")[0] or request_id


class JobState(enum.Enum):
    RECEIVED = "received"
    ADMITTING = "admitting"
    HELD = "held"
    RUNNING = "running"
    FINISHING = "finishing"
    SETTLED = "settled"
    REQUEUED = "requeued"
    DEFERRED = "deferred"
    REROUTED = "rerouted"


_S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.RECEIVED: frozenset({_S.ADMITTING, _S.REQUEUED}),
    _S.ADMITTING: frozenset({_S.HELD, _S.RUNNING, _S.FINISHING, _S.REQUEUED, _S.DEFERRED, _S.REROUTED}),
    _S.HELD: frozenset({_S.ADMITTING, _S.REQUEUED}),
    _S.RUNNING: frozenset({_S.FINISHING, _S.REQUEUED}),
    _S.FINISHING: frozenset({_S.SETTLED, _S.REQUEUED}),
    _S.SETTLED: frozenset(),
    _S.REQUEUED: frozenset(),
    _S.DEFERRED: frozenset(),
    _S.REROUTED: frozenset(),
}
TERMINAL = frozenset({_S.SETTLED, _S.REQUEUED, _S.DEFERRED, _S.REROUTED})


class Abandoned(Exception):
    """The job left the phase a coroutine was serving (requeued, cancelled,
    finished by someone else): that coroutine stops quietly."""


class IllegalTransition(RuntimeError):
    """A bug: the worker tried a transition the state machine forbids."""


class Settlement(enum.Enum):
    ACK = "ack"
    REQUEUE = "requeue"


class Delivery:
    """One AMQP delivery. ``settle`` acks or requeues it on its own
    channel, once. If that channel is gone the broker has requeued the
    message already; the settlement then only records that."""

    def __init__(
        self, message: Any, queue_class: str, reply_to: str, correlation_id: str | None, stats: Any = None
    ) -> None:
        self.message = message
        self.stats = stats  # a Counter: acked / nacked_requeue / settle_skipped
        self.queue_class = queue_class
        self.reply_to = reply_to
        self.correlation_id = correlation_id
        self.received_mono = time.monotonic()
        self.settled: Settlement | None = None
        self.channel_lost = False

    @property
    def dest(self) -> str:
        return f"{self.reply_to}|{self.correlation_id or ''}"

    @property
    def redelivered(self) -> bool:
        return bool(getattr(self.message, "redelivered", False))

    @property
    def delivery_count(self) -> int:
        """Earlier deliveries of this message (quorum queues count them in
        ``x-delivery-count``); 0 when unknown."""
        value = (getattr(self.message, "headers", None) or {}).get("x-delivery-count")
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    async def settle(self, how: Settlement) -> bool:
        """Settle once; returns whether the broker got the settlement."""
        if self.settled is not None:
            log.error("delivery_settled_twice", first=self.settled.value, second=how.value, message_id=self._id())
            return False
        self.settled = how
        try:
            if how is Settlement.ACK:
                await self.message.ack()
            else:
                await self.message.nack(requeue=True)
            self._count("acked" if how is Settlement.ACK else f"nacked_{how.value}")
            return True
        except Exception as exc:  # noqa: BLE001 - channel closed / connection lost: the broker requeued it
            self.channel_lost = True
            self._count("settle_skipped")
            log.warning(
                "settle_skipped_channel_closed", message_id=self._id(), settlement=how.value, error=type(exc).__name__
            )
            return False

    def _count(self, name: str) -> None:
        if self.stats is not None:
            self.stats[name] += 1

    def _id(self) -> Any:
        return getattr(self.message, "message_id", None)


class KeyJob:
    """One key being served here: its state, its deliveries, its progress."""

    def __init__(self, key: str, job: Job, first: Delivery, received_at: float) -> None:
        self.key = key
        self.job = job
        self.state = JobState.RECEIVED
        self.deliveries: list[Delivery] = [first]
        self.queue_class = first.queue_class
        self.run_id = uuid.uuid4().hex[:12]  # this execution of the job (chunks carry it as ``run``)
        self.received_at = received_at
        self.received_mono = first.received_mono
        self.admitted_mono: float | None = None
        self.first_token_mono: float | None = None
        self.last_token_mono = 0.0
        self.engine_metrics: dict[str, float] | None = None  # the engine's timestamps of its request
        self.result: Result | None = None  # the final result, once known (its trace ends with it)
        self.label_ids: list[list[int]] | None = None  # label scoring: each label's tokens
        self.label_calibration: Any = None  # calibrated label scoring: the content-free scores (worker.calibration)
        self.cache_key: str | None = None  # response cache: set for deterministic jobs
        self.degraded: list[str] = []  # what its answer gave up instead of overloaded (worker.fallback)
        # streaming
        self.seq = 0
        self.pending_text: list[str] = []
        self.pending_tokens = 0  # tokens behind pending_text (and held-back bytes)
        self.text_parts: list[str] = []
        self.outbox = asyncio.Event()
        self.client_gone = False

    @property
    def request_id(self) -> str:
        return engine_request_id(self.key, self.run_id)

    @property
    def broker_wait_s(self) -> float | None:
        """Seconds from the producer's publish timestamp (header
        x-published-at-ms, else the AMQP timestamp) to receipt; None when the
        job carries none."""
        ts = published_at(self.primary.message)
        return None if ts is None else max(0.0, self.received_at - ts)

    @property
    def primary(self) -> Delivery:
        return self.deliveries[0]

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def unsettled(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.settled is None]

    def attach(self, delivery: Delivery) -> None:
        if self.terminal:
            raise IllegalTransition(f"attach to {self.key!r} in state {self.state.value}")
        self.deliveries.append(delivery)

    def to(self, state: JobState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"job {self.key!r}: {self.state.value} -> {state.value} is not allowed")
        self.state = state

    def next_unsettled(self) -> Delivery | None:
        for d in self.deliveries:
            if d.settled is None:
                return d
        return None
