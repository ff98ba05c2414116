"""What the broker says about the served models and their queues.

``GET /v1/models``, the "no worker for this model" answer (503), the status
page and the gateway's queue gauges all read one :class:`BrokerSnapshot`,
refreshed in the background every few seconds. Its sources, best first:

* RabbitMQ's management API (``--management-url``; the compose file and the
  Kubernetes manifests run the management plugin): the bindings of
  ``<prefix>.models`` (every served name and alias, and the queue it
  routes to) and every queue's depth, consumers and publish/ack rates;
* ``rabbitmqctl`` on this host (what ``jaxserve status`` reads): the same
  bindings and depths, no rates;
* AMQP alone: passive declares of the default model's queues and of the
  queues seen before; no names (AMQP cannot list bindings).

Names come from the routing exchange because that is where the workers
declare them (``jaxserve.worker.routing``): a model is listed exactly when a
job naming it would be routed.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import aio_pika
import aiormq.exceptions
import structlog

from jaxserve.wire.topology import QUEUE_CLASSES, Topology

log = structlog.get_logger("jaxserve.gateway")


@dataclasses.dataclass(frozen=True)
class QueueStats:
    name: str
    queue_class: str | None  # interactive | batch for job queues
    model: str | None  # the served name it belongs to (None: the default model's)
    ready: int
    unacked: int | None
    consumers: int
    publish_rate: float | None = None  # messages/s, from the management API
    ack_rate: float | None = None


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One name a job may give in ``model``, and the queues it reaches."""

    name: str
    queues: dict[str, str]  # queue class -> queue
    default: bool  # routed to the default model's (single-model) queues
    root: str  # the model behind the name: its queue's model part, or the name on the default queues


@dataclasses.dataclass
class BrokerSnapshot:
    taken_at: float = 0.0
    source: str = "none"  # management | rabbitmqctl | amqp | none
    models: dict[str, ServedModel] = dataclasses.field(default_factory=dict)
    queues: dict[str, QueueStats] = dataclasses.field(default_factory=dict)
    error: str | None = None

    def aliases(self, model: ServedModel) -> list[str]:
        """Every name bound to the same interactive queue as ``model``."""
        q = model.queues.get("interactive")
        return sorted(m.name for m in self.models.values() if m.queues.get("interactive") == q)


def _vhost(amqp_url: str) -> str:
    path = urllib.parse.urlparse(amqp_url).path
    return urllib.parse.unquote(path[1:]) if len(path) > 1 else "/"


def _job_queue(topo: Topology, name: str) -> tuple[str | None, str | None]:
    """(class, model part) of a job queue name; (None, None) for other queues."""
    for qc in QUEUE_CLASSES:
        base = topo.queue_for(qc)
        if name == base:
            return qc, None
        if name.startswith(base + "."):
            return qc, name[len(base) + 1 :]
    return None, None


class BrokerView:
    """Keeps the latest :class:`BrokerSnapshot`; :meth:`run` refreshes it."""

    def __init__(
        self,
        amqp_url: str,
        topo: Topology,
        *,
        management_url: str | None = None,
        use_rabbitmqctl: bool | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.amqp_url = amqp_url
        self.topo = topo
        self.vhost = _vhost(amqp_url)
        self.management_url = management_url.rstrip("/") if management_url else None
        self.use_rabbitmqctl = shutil.which("rabbitmqctl") is not None if use_rabbitmqctl is None else use_rabbitmqctl
        self.interval_s = interval_s
        #: how often the bindings and the listing are read: every look from
        #: the management API (an HTTP call); rabbitmqctl starts an Erlang VM
        #: (half a CPU-second), so at most every 30 s, the depths and
        #: consumers coming from passive declares every look
        self.listing_every_s = interval_s if self.management_url else max(30.0, interval_s)
        self.snapshot = BrokerSnapshot()
        self._conn: aio_pika.abc.AbstractRobustConnection | None = None
        self._lock = asyncio.Lock()
        self._listing: tuple[list[tuple[str, str]], dict[str, QueueStats]] = ([], {})
        self._listed_at: float | None = None
        self._listing_error: str | None = None

    @property
    def source(self) -> str:
        if self.management_url:
            return "management"
        return "rabbitmqctl" if self.use_rabbitmqctl else "amqp"

    async def connect(self) -> None:
        self._conn = await aio_pika.connect_robust(
            self.amqp_url, reconnect_interval=1.0, client_properties={"connection_name": "jaxserve-gateway-view"}
        )

    async def close(self) -> None:
        if self._conn is not None and not self._conn.is_closed:
            await self._conn.close()

    async def run(self) -> None:
        """Refresh forever (a task of the app's lifespan)."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def fresh(self, max_age_s: float) -> BrokerSnapshot:
        """A snapshot at most ``max_age_s`` old (refreshed now if older)."""
        if time.monotonic() - self.snapshot.taken_at > max_age_s:
            await self.refresh()
        return self.snapshot

    async def refresh(self) -> BrokerSnapshot:
        async with self._lock:
            now = time.monotonic()
            if self._listed_at is None or now - self._listed_at >= self.listing_every_s:
                await self._list(now)
            bindings, queues = self._listing
            snap = BrokerSnapshot(taken_at=now, source=self.source, error=self._listing_error)
            snap.models = self._models(bindings)
            snap.queues = await self._from_amqp(snap.models, queues)
            self.snapshot = snap
            return snap

    async def _list(self, now: float) -> None:
        """Read the bindings and the queue listing; a failed read keeps the
        last one (and says why in the snapshot's ``error``)."""
        try:
            if self.management_url:
                self._listing = await asyncio.to_thread(self._from_management)
            elif self.use_rabbitmqctl:
                self._listing = await self._from_rabbitmqctl()
            self._listing_error = None
        except Exception as exc:  # noqa: BLE001 - the last listing keeps serving
            self._listing_error = f"{self.source}: {exc}"
            log.warning("gateway_broker_view_failed", error=self._listing_error)
        self._listed_at = now

    # ------------------------------------------------------------ sources
    def _models(self, bindings: list[tuple[str, str]]) -> dict[str, ServedModel]:
        """Served names from the (routing key, queue) bindings of the models exchange."""
        found: dict[str, dict[str, str]] = {}
        for key, queue in bindings:
            qc, _, name = key.partition(".")
            if qc in QUEUE_CLASSES and name:
                found.setdefault(name, {})[qc] = queue
        out: dict[str, ServedModel] = {}
        for name, queues in sorted(found.items()):
            _, part = _job_queue(self.topo, queues.get("interactive") or next(iter(queues.values())))
            out[name] = ServedModel(name, queues, default=part is None, root=part or name)
        return out

    def _stats(self, name: str, ready: int, unacked: int | None, consumers: int, **rates: Any) -> QueueStats | None:
        qc, model = _job_queue(self.topo, name)
        if qc is None and name not in (self.topo.dead, self.topo.results):
            return None
        return QueueStats(name, qc, model, ready, unacked, consumers, **rates)

    def _from_management(self) -> tuple[list[tuple[str, str]], dict[str, QueueStats]]:
        assert self.management_url is not None
        parsed = urllib.parse.urlparse(self.management_url)
        base = parsed._replace(
            netloc=(parsed.hostname or "localhost") + (f":{parsed.port}" if parsed.port else "")
        ).geturl()
        user = urllib.parse.unquote(parsed.username or "guest")
        password = urllib.parse.unquote(parsed.password or "guest")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        vhost = urllib.parse.quote(self.vhost, safe="")

        def get(path: str) -> Any:
            req = urllib.request.Request(base + path, headers={"Authorization": auth})
            with urllib.request.urlopen(req, timeout=5) as resp:
                return json.loads(resp.read())

        exchange = urllib.parse.quote(self.topo.models, safe="")
        try:
            raw_bindings = get(f"/api/exchanges/{vhost}/{exchange}/bindings/source")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: no models exchange yet (no routing-aware worker)
                raise
            raw_bindings = []
        bindings = [(b["routing_key"], b["destination"]) for b in raw_bindings if b.get("destination_type") == "queue"]
        queues: dict[str, QueueStats] = {}
        cols = "name,messages_ready,messages_unacknowledged,consumers,message_stats"
        for q in get(f"/api/queues/{vhost}?columns={cols}"):
            stats = q.get("message_stats") or {}
            one = self._stats(
                q["name"],
                int(q.get("messages_ready") or 0),
                int(q.get("messages_unacknowledged") or 0),
                int(q.get("consumers") or 0),
                publish_rate=float((stats.get("publish_details") or {}).get("rate", 0.0)),
                ack_rate=float((stats.get("ack_details") or {}).get("rate", 0.0)),
            )
            if one is not None:
                queues[one.name] = one
        return bindings, queues

    async def _rabbitmqctl(self, *args: str) -> list[list[str]]:
        proc = await asyncio.create_subprocess_exec(
            "rabbitmqctl",
            "-q",
            *args,
            "-p",
            self.vhost,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"rabbitmqctl {args[0]} did not answer within 20s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {args[0]} failed: {err.decode(errors='replace').strip()[:200]}")
        return [line.split("\t") for line in out.decode(errors="replace").splitlines() if line.strip()]

    async def _from_rabbitmqctl(self) -> tuple[list[tuple[str, str]], dict[str, QueueStats]]:
        rows = await self._rabbitmqctl("list_bindings", "source_name", "routing_key", "destination_name")
        bindings = [(r[1], r[2]) for r in rows if len(r) >= 3 and r[0] == self.topo.models]
        queues: dict[str, QueueStats] = {}
        for r in await self._rabbitmqctl(
            "list_queues", "name", "messages_ready", "messages_unacknowledged", "consumers"
        ):
            if len(r) >= 4 and r[0].startswith(self.topo.prefix + ".") and all(x.isdigit() for x in r[1:4]):
                one = self._stats(r[0], int(r[1]), int(r[2]), int(r[3]))
                if one is not None:
                    queues[one.name] = one
        return bindings, queues

    async def _from_amqp(self, models: dict[str, ServedModel], listed: dict[str, QueueStats]) -> dict[str, QueueStats]:
        """Ready messages and consumers of every job queue by passive
        declares, over what the listing said: the broker's own answer of
        the moment, where rabbitmqctl's counts of a quorum queue lag its
        consumers by seconds (a worker that just started shows none)."""
        names = [self.topo.interactive, self.topo.batch, self.topo.dead, self.topo.results]
        names += [q for m in models.values() for q in m.queues.values()]
        names += [n for n in listed if n not in names]
        names += [n for n in self.snapshot.queues if n not in names]
        out: dict[str, QueueStats] = {}
        for name in dict.fromkeys(names):
            declared = await self.declare(name)
            if declared is None:
                continue
            before = listed.get(name)
            one = (
                dataclasses.replace(before, ready=declared[0], consumers=declared[1])
                if before is not None
                else self._stats(name, declared[0], None, declared[1])
            )
            if one is not None:
                out[name] = one
        return out

    async def declare(self, name: str) -> tuple[int, int] | None:
        """(ready, consumers) of one queue by a passive declare, now; None
        when it does not exist or the broker cannot be asked."""
        if self._conn is None:
            return None
        try:
            ch = await self._conn.channel()
        except Exception:  # noqa: BLE001 - the broker is away: nothing to say
            return None
        try:
            q = await ch.declare_queue(name, passive=True)
            res = q.declaration_result
            return int(res.message_count or 0), int(res.consumer_count or 0)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        finally:
            if not ch.is_closed:
                await ch.close()

    async def consumers_now(self, queue: str) -> int | None:
        declared = await self.declare(queue)
        return None if declared is None else declared[1]
