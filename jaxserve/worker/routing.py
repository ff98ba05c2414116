"""Routing by model on the worker's side: which queues a worker serving a
model consumes, how it makes its names routable, and the re-route of a job
to one of its ``fallback_models``.

The worker calls it through :mod:`jaxserve.worker.fallback` (its routes,
and the admission step that re-routes an overloaded job), as follows.

At start, after ``declare_topology``::

    default = await claim_default(amqp_url, connection, topo, ("smollm2-135m", "chat"), explicit=None)
    routes = ModelRoutes(topo, served="smollm2-135m", aliases=("chat",), default=default.ours,
                         default_model=default.name)
    await declare_model_routes(connection, routes)
    for queue_class, queue in routes.queues().items():   # consume these
        ...

* The default model is the broker's record (:func:`claim_default`): the
  first worker on a prefix claims it for its served name, ``--default-model``
  sets it, every later worker reads it, and a worker of another model
  takes it over once the default model's workers are all gone. Two models
  started the plain way therefore never both take the default queues,
  where each would answer half of the other's jobs ``unknown_model``
  (``tests/test_queue_models.py``).
* ``default=True``: the worker serves the deployment's default model and
  consumes ``<prefix>.interactive`` / ``<prefix>.batch`` (the single-model
  names, unchanged); jobs without ``model`` reach it there.
* ``default=False``: it consumes ``<prefix>.interactive.<q(served)>`` /
  ``<prefix>.batch.<q(served)>`` (:func:`jaxserve.wire.topology.queue_safe`).
* Either way its job queues are bound to the direct exchange
  ``<prefix>.models`` under ``<class>.<name>`` for the served name and each
  alias (and its names are unbound from the queues it does not consume, so
  a model that was the default before, or was started before the claim
  existed, leaves no route behind to queues another model reads), so a job
  naming any of them reaches only this model's queue, and a job naming a
  model nobody binds is returned to its producer (``mandatory``), which
  answers ``unknown_model`` at once (:class:`jaxserve.client.UnknownModel`).
  A worker must accept every name in ``routes.names`` as its own model, and
  no other (``prompts.prepare_prompt``).

When admission would answer a job ``overloaded`` and the job has
``fallback_models`` (``Job.fallback_models``) and was not re-routed before
(:func:`was_rerouted` on the delivery's headers)::

    target = await find_fallback(connection, topo, job.fallback_models, queue_class, default_model=...)
    if target is not None:
        await reroute(connection, message, target, from_model=routes.served)
        # then ack the original delivery; the fallback's worker answers the job
    else:
        ...  # degrade (Job.degrade_max_tokens) or answer overloaded as today

The re-routed copy keeps the producer's body byte for byte (so its
idempotency fingerprint is the producer's) and carries the headers
``x-jaxserve-rerouted-from`` (the model that passed it on) and
``x-jaxserve-model`` (the model it is now to be served as): the fallback's
worker serves it as that model, reports ``served_model`` = that name and
``degraded: ["model"]``, and never re-routes it again.

Tests: tests/test_routing.py (against the real broker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import structlog

from jaxserve.wire.republish import copy_message
from jaxserve.wire.topology import QUEUE_CLASSES, Topology, route_key

log = structlog.get_logger("jaxserve.worker")

#: header naming the model a re-routed job was first sent to ("" for the default model)
REROUTED_FROM = "x-jaxserve-rerouted-from"
#: header naming the model a re-routed job is to be served as
SERVE_AS = "x-jaxserve-model"


class RerouteError(RuntimeError):
    """The job could not be re-routed (already re-routed once, or the broker
    did not confirm the copy); the caller answers it as it would have."""


@dataclasses.dataclass(frozen=True)
class ModelRoutes:
    """What a worker serving one model binds and consumes.

    ``served``: the served model name (``--served-model-name``, else the
    model folder's name). ``aliases``: further names jobs may use for it
    (the worker's settings map them to the same model). ``default``: this
    worker serves the deployment's default model, on the single-model
    queues."""

    topology: Topology
    served: str
    aliases: tuple[str, ...] = ()
    default: bool = False
    #: the deployment's default model as the claim names it (None: unknown)
    default_model: str | None = None

    def __post_init__(self) -> None:
        for name in self.names:
            for queue_class in QUEUE_CLASSES:
                route_key(queue_class, name)  # ValueError for a name no routing key can hold

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a job may give in ``model`` to reach this worker."""
        return tuple(dict.fromkeys((self.served, *self.aliases)))

    def queue(self, queue_class: str) -> str:
        return self.topology.model_queue(queue_class, None if self.default else self.served)

    def queues(self) -> dict[str, str]:
        """Queue class -> the queue this worker consumes."""
        return {queue_class: self.queue(queue_class) for queue_class in QUEUE_CLASSES}

    def bindings(self) -> list[tuple[str, str]]:
        """(queue, routing key) pairs on the models exchange."""
        return [(self.queue(qc), route_key(qc, name)) for qc in QUEUE_CLASSES for name in self.names]

    def stale_bindings(self) -> list[tuple[str, str]]:
        """The same names on the queues this worker does not consume: its
        model's own queues when it is the default, the default queues when
        it is not. Left bound, a direct exchange would copy its jobs there
        too, where another model (or nobody) reads them."""
        other = dataclasses.replace(self, default=not self.default)
        return other.bindings()


class RoutesView(Protocol):
    """What a job reads of the worker's connections
    (``jaxserve.worker.connections.Connections``): the routes it consumes,
    the queue it takes each class from, and the connection a job is passed
    on over."""

    @property
    def routes(self) -> ModelRoutes | None: ...

    def job_queue(self, queue_class: str) -> str: ...

    def control_connection(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class DefaultModel:
    """What the claim says: ``name``, the deployment's default model (None
    when it could not be read), whether it is one of this worker's names
    (``ours``), and the model it was taken over from (``previous``: its
    workers were all gone). ``alive``: the channel whose consumer tells
    later workers that a worker of the default model runs; keep it open
    while serving."""

    name: str | None
    ours: bool
    previous: str | None = None
    alive: Any = dataclasses.field(default=None, compare=False, repr=False)


class DefaultModelConflict(RuntimeError):
    """``--default-model`` names this worker's model while workers of
    another default model are running on the prefix."""


_CURRENT = re.compile(r"but current is '(.*)'")


async def _declare_claim(connection: Any, topo: Topology, name: str) -> str | None:
    """Declare the claim holding ``name``: None when it holds it now (it
    did, or did not exist); else the name it holds (406), "" if unreadable."""
    import aio_pika
    import aiormq.exceptions

    channel = await connection.channel()
    try:
        await channel.declare_exchange(
            topo.default_model, aio_pika.ExchangeType.FANOUT, durable=True, arguments={"alternate-exchange": name}
        )
        return None
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        found = _CURRENT.search(str(exc))
        return found.group(1) if found else ""
    finally:
        if not channel.is_closed:
            await channel.close()


async def _replace_claim(connection: Any, topo: Topology, name: str) -> None:
    channel = await connection.channel()
    try:
        await channel.exchange_delete(topo.default_model)
    finally:
        if not channel.is_closed:
            await channel.close()
    await _declare_claim(connection, topo, name)


async def _alive(connection: Any, topo: Topology) -> int:
    """Workers of the default model running now: the consumers of
    ``<prefix>.default-model.alive`` (0 when it does not exist)."""
    import aiormq.exceptions

    channel = await connection.channel()
    try:
        queue = await channel.declare_queue(topo.default_model_alive, passive=True)
        return int(queue.declaration_result.consumer_count or 0)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return 0
    finally:
        if not channel.is_closed:
            await channel.close()


async def _lock(connection: Any, topo: Topology, timeout_s: float) -> bool:
    """Hold ``<prefix>.default-model.lock`` (an exclusive queue: one
    connection at a time, released when that connection closes, however
    the worker ends). False when another worker kept it ``timeout_s``."""
    import aiormq.exceptions

    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while True:
        channel = await connection.channel()
        try:
            await channel.declare_queue(topo.default_model_lock, exclusive=True)
            return True
        except aiormq.exceptions.ChannelLockedResource:
            if loop.time() >= until:
                return False
        await asyncio.sleep(0.2)


async def claim_default(
    amqp_url: Any,
    connection: Any,
    topo: Topology,
    names: Sequence[str],
    explicit: str | None = None,
    *,
    lock_timeout_s: float = 30.0,
) -> DefaultModel:
    """Read the default model's claim, and take it when nobody holds it,
    or its model's workers are all gone, or ``explicit`` says so.

    Three names on the broker, each for what RabbitMQ guarantees about it:

    * ``<prefix>.default-model``, an exchange nothing is published to,
      holds the name in its ``alternate-exchange`` argument. RabbitMQ keeps
      an exchange's arguments as first declared and refuses (406) a
      declare with another value: the name survives restarts, and a
      declare tells "it holds mine" from "it holds another".
    * ``<prefix>.default-model.alive``, a queue nobody publishes to, has
      one consumer per running worker of the default model (on its robust
      control connection: a crash or a lost connection removes it). No
      consumer: the default model's workers are gone, and the next worker
      of another model takes the default over, so a user who stops one
      model and starts another is served without a flag, while a restarted
      worker of the default model takes its place back.
    * ``<prefix>.default-model.lock``, an exclusive queue on a connection
      of its own (``amqp_url``), orders the workers deciding at once: the
      decision and the alive consumer happen while it is held, so two
      workers starting together never both become the default.

    Without ``explicit`` the worker tries each of its ``names`` (the claim
    may hold an alias). ``explicit`` (``--default-model``) sets the claim
    when it holds another name whose workers are gone, or when this worker
    is not that model; naming this worker's model while another default
    model's workers run raises :class:`DefaultModelConflict`. Taking over
    from a gone model unbinds its name from the default queues, so its jobs
    are refused ``unknown_model`` by their producers until it starts
    again, instead of reaching the new default model. ``connection`` is
    the worker's robust control connection (the alive consumer's)."""
    import aio_pika

    lock = await aio_pika.connect(amqp_url)
    try:
        if not await _lock(lock, topo, lock_timeout_s):
            log.warning("default_model_lock_timeout", lock=topo.default_model_lock, waited_s=lock_timeout_s)
        held = ""
        if explicit is not None:
            current = await _declare_claim(lock, topo, explicit)
            if current is not None:
                running = await _alive(lock, topo)
                if running and explicit in names:
                    raise DefaultModelConflict(
                        f"--default-model {explicit!r} names this worker's model, but {running} worker(s) of the "
                        f"default model {current!r} run on prefix {topo.prefix!r}; stop them first, or start this "
                        "worker without --default-model"
                    )
                if not running:
                    await _replace_claim(lock, topo, explicit)
                    log.warning("default_model_moved", previous=current or None, default_model=explicit)
                    await _unbind_default(lock, topo, current, keep=names)
                    current = None
            claim = DefaultModel(explicit if current is None else (current or None), explicit in names)
        else:
            claim = DefaultModel(None, False)
            for name in names:
                current = await _declare_claim(lock, topo, name)
                if current is None:
                    claim = DefaultModel(name, True)
                    break
                held = current
            if not claim.ours and not await _alive(lock, topo):
                await _replace_claim(lock, topo, names[0])
                log.warning("default_model_moved", previous=held or None, default_model=names[0])
                await _unbind_default(lock, topo, held, keep=names)
                claim = DefaultModel(names[0], True, previous=held or None)
            elif not claim.ours:
                claim = DefaultModel(held or None, False)
        if claim.ours:
            channel = await connection.channel()
            queue = await channel.declare_queue(topo.default_model_alive, durable=False)
            await queue.consume(_ignore, no_ack=True)
            claim = dataclasses.replace(claim, alive=channel)
        return claim
    finally:
        await lock.close()


async def _ignore(_message: Any) -> None:
    """Nothing is published to the alive queue; its consumer is the point."""


async def _unbind_default(connection: Any, topo: Topology, name: str, keep: Sequence[str]) -> None:
    """Take a gone default model's name off the default queues."""
    if name and name not in keep:
        await _unbind(connection, topo, [(topo.model_queue(qc, None), route_key(qc, name)) for qc in QUEUE_CLASSES])


async def _unbind(connection: Any, topo: Topology, pairs: Iterable[tuple[str, str]]) -> None:
    """Remove these bindings where they exist (an unbind of a missing
    binding is a no-op; a missing queue closes the channel, so each queue
    gets a channel of its own)."""
    import aiormq.exceptions

    by_queue: dict[str, list[str]] = {}
    for queue_name, key in pairs:
        by_queue.setdefault(queue_name, []).append(key)
    for queue_name, keys in by_queue.items():
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(queue_name, passive=True)
            for key in keys:
                await queue.unbind(topo.models, routing_key=key)
        except aiormq.exceptions.ChannelNotFoundEntity:
            pass
        finally:
            if not channel.is_closed:
                await channel.close()


async def declare_model_routes(connection: Any, routes: ModelRoutes) -> None:
    """Declare the models exchange, this model's job queues (the same
    arguments as the default ones; a 406 raises ``TopologyMismatch``) and
    its bindings, and remove its names from the queues it does not consume
    (:meth:`ModelRoutes.stale_bindings`). Idempotent. The default model's
    queues come from ``declare_topology``, which must run first."""
    import aio_pika
    import aiormq.exceptions

    from jaxserve.wire.topology import explain_mismatch

    topo = routes.topology
    channel = await connection.channel()
    try:
        exchange = await channel.declare_exchange(topo.models, aio_pika.ExchangeType.DIRECT, durable=True)
        for queue_class, name in routes.queues().items():
            try:
                queue = await channel.declare_queue(name, durable=True, arguments=topo.job_queue_arguments(queue_class))
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                raise explain_mismatch(name, exc, topo) from None
            for queue_name, key in routes.bindings():
                if queue_name == name:
                    await queue.bind(exchange, routing_key=key)
    finally:
        if not channel.is_closed:
            await channel.close()
    await _unbind(connection, topo, routes.stale_bindings())


async def remove_model_routes(connection: Any, routes: ModelRoutes) -> None:
    """Unbind this model's names (its queues stay, with whatever waits in
    them): after this, jobs naming it are answered ``unknown_model`` by
    their producers. For an operator retiring a model, not for a worker's
    ordinary stop (another worker may serve the same model)."""
    channel = await connection.channel()
    try:
        for queue_name, key in routes.bindings():
            queue = await channel.get_queue(queue_name, ensure=False)
            await queue.unbind(routes.topology.models, routing_key=key)
    finally:
        if not channel.is_closed:
            await channel.close()


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A fallback model that can take the job now, and its queue."""

    model: str
    queue: str
    ready: int
    consumers: int


def fallback_queue(topo: Topology, model: str, queue_class: str, default_model: str | None = None) -> str:
    """The queue that serves ``model``: the single-model queue when it is the
    deployment's ``default_model``, else its own (``Topology.model_queue``)."""
    return topo.model_queue(queue_class, None if model == default_model else model)


async def find_fallback(
    connection: Any,
    topo: Topology,
    fallback_models: Iterable[str],
    queue_class: str,
    *,
    default_model: str | None = None,
    max_ready: int = 0,
) -> Fallback | None:
    """The first of ``fallback_models`` whose queue exists, has a consumer
    and has room, from one passive declare each; None when none does.

    Room: at most ``max_ready`` jobs ready in its queue. With the default 0
    a job waits there only when every consumer's prefetch window is full,
    so an empty queue with a consumer is a worker that will be handed the
    job at once (its own admission still decides; the copy is never
    re-routed again). Each probe uses a channel of its own, because the
    broker closes a channel whose passive declare names a missing queue
    (404). ``default_model``: the name the deployment's default model
    answers to, whose queue is ``<prefix>.<class>``; aliases are not
    resolved (a fallback names a served model)."""
    import aiormq.exceptions

    for model in fallback_models:
        name = fallback_queue(topo, model, queue_class, default_model)
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            continue
        finally:
            if not channel.is_closed:
                await channel.close()
        res = declared.declaration_result
        ready, consumers = int(res.message_count or 0), int(res.consumer_count or 0)
        if consumers > 0 and ready <= max_ready:
            return Fallback(model=model, queue=name, ready=ready, consumers=consumers)
    return None


def was_rerouted(headers: Mapping[str, Any] | None) -> bool:
    """Whether a delivery is already a re-routed copy (never re-route it twice)."""
    return bool(headers) and REROUTED_FROM in headers  # type: ignore[operator]


def serve_as(headers: Mapping[str, Any] | None) -> str | None:
    """The model a re-routed copy is to be served as, else None."""
    if not headers or REROUTED_FROM not in headers:
        return None
    value = headers.get(SERVE_AS)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value else None


async def reroute(
    connection: Any,
    message: Any,
    target: Fallback,
    *,
    from_model: str | None,
    login_user: str | None = None,
) -> None:
    """Publish a copy of ``message`` (an incoming aio-pika message) to the
    fallback's queue, once, and wait for the broker's confirm.

    The copy keeps the body and every producer property (the key, reply_to,
    correlation_id, expiration ...; ``wire.republish.copy_message``) and
    adds :data:`REROUTED_FROM` (``from_model``, "" for the default model)
    and :data:`SERVE_AS` (the fallback). Raises :class:`RerouteError` when
    the message was re-routed before, when the queue is gone (returned) or
    the broker nacks it (full): the caller then answers the job as it would
    have. The caller acks the original only after this returns."""
    import aio_pika
    import aiormq.exceptions

    headers = dict(message.headers or {})
    if was_rerouted(headers):
        raise RerouteError(f"job {message.message_id!r} was re-routed once already (from {headers[REROUTED_FROM]!r})")
    headers[REROUTED_FROM] = from_model or ""
    headers[SERVE_AS] = target.model
    copy = copy_message(message, headers, login_user=login_user, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
    # The broker's TTL starts again in the new queue; the worker's deadline
    # still counts from the producer's x-published-at-ms header, kept above.
    copy.expiration = message.expiration
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        await channel.default_exchange.publish(copy, routing_key=target.queue, mandatory=True)
    except aiormq.exceptions.PublishError:
        raise RerouteError(f"queue {target.queue!r} of fallback {target.model!r} is gone") from None
    except aiormq.exceptions.DeliveryError:
        raise RerouteError(f"queue {target.queue!r} of fallback {target.model!r} refused the job (full)") from None
    finally:
        if not channel.is_closed:
            await channel.close()


__all__ = [
    "REROUTED_FROM",
    "SERVE_AS",
    "DefaultModel",
    "DefaultModelConflict",
    "Fallback",
    "ModelRoutes",
    "RerouteError",
    "claim_default",
    "declare_model_routes",
    "fallback_queue",
    "find_fallback",
    "remove_model_routes",
    "reroute",
    "serve_as",
    "was_rerouted",
]
