"""Queue topology: names and arguments of every exchange and queue.

Pure data plus one coroutine that declares it; importing this module pulls in
nothing heavy, so producers (``jaxserve.client``) and the worker share the
names through ``jaxserve.wire``.

With the default prefix ``jaxserve`` the topology is::

    jaxserve.interactive   quorum queue, message TTL, length limit, DLX
    jaxserve.batch         quorum queue, length limit, DLX
    jaxserve.dlx           fanout exchange for dead letters
    jaxserve.dead          quorum queue bound to jaxserve.dlx
    jaxserve.results       quorum queue: replies of jobs without reply_to
    jaxserve.control       fanout exchange for cancel messages
    jaxserve.models        direct exchange routing jobs by model
    jaxserve.default-model fanout exchange naming the default model (nothing is published to it)
    jaxserve.default-model.alive  a queue each running worker of the default model consumes

Routing by model. The two job queues above are the *default model's*: a job
without ``model`` goes there through the default exchange, exactly as in a
single-model deployment. Every other served model M has queues of its own,
``jaxserve.interactive.<q(M)>`` and ``jaxserve.batch.<q(M)>`` (``q`` is
:func:`queue_safe`), with the same arguments. A worker binds its job queues
to ``jaxserve.models`` under the routing keys ``<class>.<name>`` for its
served name and every alias (the default model's worker binds the two
queues above), and a job naming a model is published to ``jaxserve.models``
with routing key ``<class>.<model>`` and ``mandatory``: a model nobody binds
comes back as basic.return, so the producer answers ``unknown_model`` at
once instead of leaving the job in a queue no worker reads. The declaring
side lives in :mod:`jaxserve.worker.routing`.

Which model is the default is the broker's record, not each worker's
guess: the first worker to start on a prefix (or one told
``--default-model``) declares ``jaxserve.default-model`` with its name in
the exchange's ``alternate-exchange`` argument, and the default model's
running workers each consume ``jaxserve.default-model.alive``
(``jaxserve.worker.routing.claim_default`` explains the three names).

The arguments are stable on purpose: RabbitMQ refuses (406) to redeclare a
queue with different arguments. Change optional arguments of an existing
deployment with a policy (``rabbitmqctl set_policy``) instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, overload

DEFAULT_PREFIX = "jaxserve"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"

INTERACTIVE = "interactive"
BATCH = "batch"
QUEUE_CLASSES = (INTERACTIVE, BATCH)

#: AMQP's limit on a routing key and on a queue name (a short string)
AMQP_NAME_MAX = 255
#: a model's part of a queue name: at most this many characters kept as written
QUEUE_SAFE_MAX = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def queue_safe(model: str) -> str:
    """The part of a queue name that stands for ``model``.

    A name made only of ``A-Z a-z 0-9 _ . -`` and at most 64 characters is
    kept as it is (``smollm2-135m``); any other (``org/Model:v2``, a path, a
    long name) has its other characters replaced by ``_``, is cut to 64
    characters and gets ``@`` and 8 hex digits of its SHA-256, so two names
    that differ only in replaced characters never share a queue
    (tests/test_routing_wire.py)."""
    if not model:
        raise ValueError("a model name is not empty")
    if len(model) <= QUEUE_SAFE_MAX and not _UNSAFE.search(model):
        return model
    digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    # "@": outside the kept characters (so never part of a plain name) and
    # inside what AMQP client libraries accept in a queue name
    return f"{_UNSAFE.sub('_', model)[:QUEUE_SAFE_MAX]}@{digest}"


def route_key(queue_class: str, model: str) -> str:
    """The routing key of ``model``'s ``queue_class`` queue on the models
    exchange: ``interactive.smollm2-135m``. The model name is used as
    written (a direct exchange matches it exactly); raises ValueError when
    the key would pass AMQP's 255 bytes (no worker can bind such a name)."""
    if queue_class not in QUEUE_CLASSES:
        raise ValueError(f"unknown queue class {queue_class!r}; expected 'interactive' or 'batch'")
    key = f"{queue_class}.{model}"
    if len(key.encode("utf-8", "surrogatepass")) > AMQP_NAME_MAX:
        raise ValueError(f"model name of {len(model)} characters is too long for a routing key")
    return key


class TopologyMismatch(RuntimeError):
    """An existing queue or exchange was declared with other arguments."""


class _Prefixed:
    """A name of the topology: its ``prefix``, a dot and ``suffix``
    (``jaxserve.interactive``), read like an attribute. Every exchange and
    queue name is built so; one descriptor keeps the rule in one place."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    @overload
    def __get__(self, topology: None, owner: type | None = None) -> _Prefixed: ...
    @overload
    def __get__(self, topology: Topology, owner: type | None = None) -> str: ...
    def __get__(self, topology: Topology | None, owner: type | None = None) -> str | _Prefixed:
        if topology is None:  # on the class itself
            return self
        return f"{topology.prefix}.{self.suffix}"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Names and arguments. Every field has a stable default."""

    prefix: str = DEFAULT_PREFIX
    delivery_limit: int = 10
    interactive_max_length: int = 10_000
    batch_max_length: int = 1_000_000
    interactive_ttl_ms: int = 120_000

    # ---- names: PREFIX.<suffix> -----------------------------------------
    interactive = _Prefixed("interactive")
    batch = _Prefixed("batch")
    dlx = _Prefixed("dlx")
    dead = _Prefixed("dead")
    results = _Prefixed("results")
    control = _Prefixed("control")
    #: the direct exchange that routes jobs naming a model
    models = _Prefixed("models")
    #: the exchange whose ``alternate-exchange`` argument names the default
    #: model (``jaxserve.worker.routing.claim_default``)
    default_model = _Prefixed("default-model")
    #: the queue each running worker of the default model consumes
    default_model_alive = _Prefixed("default-model.alive")
    #: the exclusive queue a starting worker holds while it decides
    default_model_lock = _Prefixed("default-model.lock")

    def reserved_names(self) -> frozenset[str]:
        """The worker's own queues and exchanges: a job's ``reply_to`` must
        not name any of them (a reply there would be consumed as a job, show
        up as a dead letter or reach every worker as a control message).
        Other models' job queues (``<interactive>.<q(M)>``) are refused by
        :func:`jaxserve.wire.job.check_reply_to` from this set's names."""
        return frozenset(
            {
                self.interactive,
                self.batch,
                self.dead,
                self.dlx,
                self.control,
                self.models,
                self.default_model,
                self.default_model_alive,
                self.default_model_lock,
            }
        )

    def model_queue(self, queue_class: str, model: str | None) -> str:
        """The ``queue_class`` queue of a model that is not the default:
        ``<prefix>.interactive.<q(model)>``; ``None`` names the default
        model's queue (:meth:`queue_for`)."""
        base = self.queue_for(queue_class)
        return base if model is None else f"{base}.{queue_safe(model)}"

    def queue_for(self, queue_class: str) -> str:
        if queue_class == INTERACTIVE:
            return self.interactive
        if queue_class == BATCH:
            return self.batch
        raise ValueError(f"unknown queue class {queue_class!r}; expected 'interactive' or 'batch'")

    # ---- arguments ---------------------------------------------------
    def job_queue_arguments(self, queue_class: str) -> dict[str, Any]:
        args: dict[str, Any] = {
            "x-queue-type": "quorum",
            "x-delivery-limit": int(self.delivery_limit),
            "x-dead-letter-exchange": self.dlx,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }
        if queue_class == INTERACTIVE:
            args["x-max-length"] = int(self.interactive_max_length)
            args["x-message-ttl"] = int(self.interactive_ttl_ms)
        else:
            args["x-max-length"] = int(self.batch_max_length)
        return args

    def queue_arguments(self) -> dict[str, dict[str, Any]]:
        """Every durable queue and its arguments."""
        return {
            self.interactive: self.job_queue_arguments(INTERACTIVE),
            self.batch: self.job_queue_arguments(BATCH),
            self.dead: {"x-queue-type": "quorum"},
            self.results: {"x-queue-type": "quorum"},
        }

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (what ``queues/topology.json`` holds)."""
        return {
            "prefix": self.prefix,
            "exchanges": {
                self.dlx: {"type": "fanout", "durable": True},
                self.control: {"type": "fanout", "durable": True},
            },
            "queues": {name: {"durable": True, "arguments": args} for name, args in self.queue_arguments().items()},
            "bindings": [{"exchange": self.dlx, "queue": self.dead, "routing_key": ""}],
            "publish": {
                "exchange": "",
                "routing_keys": {INTERACTIVE: self.interactive, BATCH: self.batch},
            },
            "models": {
                "exchange": self.models,
                "type": "direct",
                "durable": True,
                "declared_by": "jaxserve.worker.routing.declare_model_routes",
                "routing_key": "<class>.<model>",
                "queues": {
                    INTERACTIVE: f"{self.interactive}.<q(model)>",
                    BATCH: f"{self.batch}.<q(model)>",
                },
                "default_model_queues": {INTERACTIVE: self.interactive, BATCH: self.batch},
                "default_model": {
                    "exchange": self.default_model,
                    "type": "fanout",
                    "durable": True,
                    "argument": "alternate-exchange",
                    "holds": "the default model's name, set by the first worker (or --default-model)",
                    "alive_queue": self.default_model_alive,
                    "lock_queue": self.default_model_lock,
                    "declared_by": "jaxserve.worker.routing.claim_default",
                },
                "mandatory": True,
                "unroutable": "unknown_model",
            },
        }


def explain_mismatch(name: str, exc: BaseException, topo: Topology) -> TopologyMismatch:
    return TopologyMismatch(
        f"RabbitMQ refused to declare {name!r} (406 PRECONDITION_FAILED: {exc}). "
        f"It already exists with other arguments than this worker's "
        f"{topo.queue_arguments().get(name, '(exchange: fanout, durable)')}. "
        "Either start the worker with options matching the existing queue "
        "(--delivery-limit, --interactive-max-length, --batch-max-length, --interactive-ttl-ms), "
        "change optional arguments through a policy (rabbitmqctl set_policy), "
        f"or delete it when it is empty (rabbitmqctl delete_queue {name})."
    )


async def declare_topology(connection: Any, topo: Topology) -> None:
    """Declare every exchange, queue and binding (idempotent).

    Uses a throwaway channel: a 406 closes the channel it happened on.
    Raises :class:`TopologyMismatch` with an explanation on a 406.
    """
    import aio_pika
    import aiormq.exceptions

    async def on_fresh_channel(fn: Any, name: str) -> Any:
        channel = await connection.channel()
        try:
            return await fn(channel)
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise explain_mismatch(name, exc, topo) from None
        finally:
            if not channel.is_closed:
                await channel.close()

    for exch in (topo.dlx, topo.control):
        await on_fresh_channel(
            lambda ch, exch=exch: ch.declare_exchange(exch, aio_pika.ExchangeType.FANOUT, durable=True), exch
        )
    for name, args in topo.queue_arguments().items():
        await on_fresh_channel(
            lambda ch, name=name, args=args: ch.declare_queue(name, durable=True, arguments=args), name
        )

    async def bind(ch: Any) -> None:
        queue = await ch.get_queue(topo.dead, ensure=True)
        await queue.bind(topo.dlx, routing_key="")

    await on_fresh_channel(bind, topo.dead)


async def delete_topology(connection: Any, topo: Topology) -> None:
    """Delete every queue and exchange of ``topo`` (tests, teardown)."""
    channel = await connection.channel()
    try:
        for name in (*topo.queue_arguments(), topo.default_model_alive):
            await channel.queue_delete(name)
        for exch in (topo.dlx, topo.control, topo.models, topo.default_model):
            await channel.exchange_delete(exch)
    finally:
        if not channel.is_closed:
            await channel.close()
