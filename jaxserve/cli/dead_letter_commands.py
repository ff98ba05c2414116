"""``jaxserve dead``: look at and requeue the dead letters in ``<prefix>.dead``.

Jobs land there through ``<prefix>.dlx`` when the broker drops them: expired
(``expiration`` or the interactive TTL), over ``x-delivery-limit``, rejected
without requeue, or over a length limit. RabbitMQ records why in the
``x-first-death-*`` headers and the ``x-death`` list (queue, reason, count,
time of each death).

How the queue is read
---------------------
A quorum queue cannot be browsed: a message taken and handed back (nack with
requeue, or a closed channel) counts as a failed delivery, and RabbitMQ 4
drops a quorum-queue message after 20 of those by default (``.dead`` has no
dead-letter exchange of its own). So every sub-command *sweeps* the queue
once: it takes each message present when it starts, publishes it (publisher
confirms, ``mandatory``) either back to the tail of ``.dead`` or, for
``requeue``, to its original queue, and acks the taken message only once that
publish is confirmed. Nothing is ever dropped (a crash in between leaves a
duplicate, never a loss), no delivery is counted, and after a full sweep the
dead letters are in their original order.

The copy keeps the body, ``message_id`` and every property and header; it
also carries the death record as a ``jaxserve-death`` header (JSON), since
RabbitMQ 3.13+ treats ``x-`` headers published by a client as plain data. A
requeued job gets its producer's headers back without the broker's death
headers, plus ``jaxserve-requeues`` (how many times it was requeued).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from jaxserve.cli.queue_options import amqp_option, prefix_option

DEATH_HEADER = "jaxserve-death"
REQUEUES_HEADER = "jaxserve-requeues"
# Headers the broker owns: dropped from a requeued job.
_BROKER_HEADERS = ("x-death", "x-delivery-count")
_BROKER_HEADER_PREFIXES = ("x-first-death-", "x-last-death-")
CONFIRM_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ records
def _plain(value: Any) -> Any:
    """A JSON-able copy of an AMQP header value."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _text(value: Any) -> str | None:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return None if value is None else str(value)


def _epoch(value: Any) -> float | None:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


@dataclasses.dataclass
class Death:
    queue: str | None
    reason: str | None
    count: int
    time: float | None  # epoch seconds of the latest death of this kind

    def to_dict(self) -> dict[str, Any]:
        return {"queue": self.queue, "reason": self.reason, "count": self.count, "time": self.time}


@dataclasses.dataclass
class DeadLetter:
    """One message of ``<prefix>.dead`` and what its headers say about it."""

    key: str | None
    queue: str | None  # where it died first: where requeue sends it
    reason: str | None  # x-first-death-reason
    deaths: list[Death]  # most recent first, as RabbitMQ keeps x-death
    message: Any  # the aio_pika IncomingMessage

    @property
    def count(self) -> int:
        return sum(d.count for d in self.deaths) or 1

    @property
    def died_at(self) -> float | None:
        times = [d.time for d in self.deaths if d.time is not None]
        return max(times) if times else None

    def age_s(self, now: float) -> float | None:
        return None if self.died_at is None else max(0.0, now - self.died_at)

    @classmethod
    def from_message(cls, message: Any) -> DeadLetter:
        headers = message.headers or {}
        deaths = [
            Death(
                queue=_text(entry.get("queue")),
                reason=_text(entry.get("reason")),
                count=int(entry.get("count") or 1),
                time=_epoch(entry.get("time")),
            )
            for entry in headers.get("x-death") or []
            if isinstance(entry, dict)
        ]
        queue = _text(headers.get("x-first-death-queue"))
        reason = _text(headers.get("x-first-death-reason"))
        saved = _saved_death(headers)
        if not deaths and saved is not None:
            deaths = [
                Death(d.get("queue"), d.get("reason"), int(d.get("count") or 1), d.get("time"))
                for d in saved.get("deaths", [])
            ]
        if queue is None:
            queue = (saved or {}).get("queue") or (deaths[-1].queue if deaths else None)
        if reason is None:
            reason = (saved or {}).get("reason") or (deaths[-1].reason if deaths else None)
        return cls(key=_text(message.message_id), queue=queue, reason=reason, deaths=deaths, message=message)

    def death_record(self) -> str:
        """What the ``jaxserve-death`` header of a copy holds."""
        return json.dumps({"queue": self.queue, "reason": self.reason, "deaths": [d.to_dict() for d in self.deaths]})

    def summary(self, now: float) -> dict[str, Any]:
        age = self.age_s(now)
        return {
            "key": self.key,
            "queue": self.queue,
            "reason": self.reason,
            "count": self.count,
            "age_s": None if age is None else round(age, 3),
            "deaths": [d.to_dict() for d in self.deaths],
        }

    def details(self, now: float) -> dict[str, Any]:
        m = self.message
        body = bytes(m.body)
        try:
            shown: Any = json.loads(body)
            encoding = "json"
        except ValueError:
            try:
                shown, encoding = body.decode("utf-8"), "text"
            except UnicodeDecodeError:
                shown, encoding = base64.b64encode(body).decode(), "base64"
        props = {
            "message_id": m.message_id,
            "correlation_id": m.correlation_id,
            "reply_to": m.reply_to,
            "content_type": m.content_type,
            "content_encoding": m.content_encoding,
            "delivery_mode": int(m.delivery_mode) if m.delivery_mode is not None else None,
            "priority": m.priority,
            "timestamp": m.timestamp,
            "type": m.type,
            "user_id": m.user_id,
            "app_id": m.app_id,
        }
        return {
            **self.summary(now),
            "properties": _plain(props),
            "headers": _plain(m.headers or {}),
            "body_bytes": len(body),
            "body_encoding": encoding,
            "body": shown,
        }


def _saved_death(headers: dict[str, Any]) -> dict[str, Any] | None:
    raw = headers.get(DEATH_HEADER)
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", "replace")
    if not isinstance(raw, str):
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------- sweep
@dataclasses.dataclass
class SweepReport:
    seen: list[DeadLetter] = dataclasses.field(default_factory=list)
    requeued: list[tuple[DeadLetter, str]] = dataclasses.field(default_factory=list)
    failed: list[tuple[DeadLetter, str]] = dataclasses.field(default_factory=list)  # kept in dead, with why


def _requeue_headers(headers: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: v
        for k, v in headers.items()
        if k not in _BROKER_HEADERS and k != DEATH_HEADER and not k.startswith(_BROKER_HEADER_PREFIXES)
    }
    try:
        out[REQUEUES_HEADER] = int(headers.get(REQUEUES_HEADER) or 0) + 1
    except (TypeError, ValueError):
        out[REQUEUES_HEADER] = 1
    return out


def _dead_headers(letter: DeadLetter) -> dict[str, Any]:
    headers = {k: v for k, v in (letter.message.headers or {}).items() if k != "x-delivery-count"}
    headers[DEATH_HEADER] = letter.death_record()
    return headers


async def sweep(amqp_url: str, prefix: str, choose: Callable[[DeadLetter], str | None]) -> SweepReport:
    """Take every message present in ``<prefix>.dead`` once. ``choose``
    returns the queue to requeue a letter into, or None to keep it (it goes
    to the tail of dead). Each taken message is acked only after its new copy
    is confirmed; a requeue that the broker refuses (no such queue, queue
    full) keeps the letter in dead and is reported in ``failed``."""
    import aio_pika
    import aiormq.exceptions
    from yarl import URL

    from jaxserve.wire import amqp_compat
    from jaxserve.wire.republish import copy_message
    from jaxserve.wire.topology import Topology

    amqp_compat.install()
    topo = Topology(prefix=prefix)
    report = SweepReport()
    user = URL(amqp_url).user or "guest"
    conn = await aio_pika.connect(amqp_url, client_properties={"connection_name": "jaxserve-dead"})
    try:
        ch = await conn.channel(publisher_confirms=True, on_return_raises=True)
        try:
            dead = await ch.declare_queue(topo.dead, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise click.ClickException(
                f"no queue {topo.dead!r}: has a worker with prefix {prefix!r} ever run?"
            ) from None
        pending = int(dead.declaration_result.message_count or 0)
        exchange = ch.default_exchange

        async def publish(message: Any, routing_key: str) -> None:
            await asyncio.wait_for(
                exchange.publish(message, routing_key=routing_key, mandatory=True), CONFIRM_TIMEOUT_S
            )

        for _ in range(pending):
            message = await dead.get(no_ack=False, fail=False)
            if message is None:  # someone else took the rest
                break
            letter = DeadLetter.from_message(message)
            report.seen.append(letter)
            target = choose(letter)
            if target is not None:
                try:
                    await publish(
                        copy_message(message, _requeue_headers(message.headers or {}), login_user=user), target
                    )
                except (TimeoutError, aio_pika.exceptions.PublishError, aiormq.exceptions.DeliveryError) as exc:
                    report.failed.append((letter, _why(exc, target)))
                    target = None
                else:
                    report.requeued.append((letter, target))
            if target is None:
                try:
                    await publish(copy_message(message, _dead_headers(letter), login_user=user), topo.dead)
                except BaseException:
                    # Not copied: hand it back untouched (one counted
                    # delivery) rather than lose it.
                    if not ch.is_closed:
                        await message.reject(requeue=True)
                    raise
            await message.ack()
    finally:
        await conn.close()
    return report


def _why(exc: BaseException, target: str) -> str:
    import aio_pika

    if isinstance(exc, asyncio.TimeoutError):
        return f"no confirm from the broker for {target!r} within {CONFIRM_TIMEOUT_S:g}s"
    if isinstance(exc, aio_pika.exceptions.PublishError):
        return f"queue {target!r} does not exist (the publish was returned unroutable)"
    return f"the broker refused the publish to {target!r} (queue full?): {' '.join(str(exc).split())}"


# --------------------------------------------------------------- commands
def _run(amqp_url: str, prefix: str, choose: Callable[[DeadLetter], str | None]) -> SweepReport:
    from jaxserve.cli.errors import broker_errors

    with broker_errors(amqp_url):
        return asyncio.run(sweep(amqp_url, prefix, choose))


def _age(seconds: float | None) -> str:
    """``42s``, ``3m07s``, ``5h02m``, ``2d03h``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size, sub_unit, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // sub_size:02d}{sub_unit}"
    return f"{s}s"


def _deaths_text(letter: DeadLetter) -> str:
    return ", ".join(f"{d.reason or '?'}@{d.queue or '?'} x{d.count}" for d in letter.deaths) or "-"


@click.group("dead")
def dead() -> None:
    """Dead letters in PREFIX.dead: list, show, requeue.

    Each command passes over the queue once, moving every message to its
    tail (or, for requeue, to its original queue) with publisher confirms
    before acking it: nothing is lost, no delivery is counted against the
    quorum queue's delivery limit, and the order is kept."""


@dead.command("list")
@amqp_option
@prefix_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per dead letter.")
@click.option("--limit", type=click.IntRange(min=0), default=0, help="Print at most this many (0: all).")
def list_command(amqp_url: str, prefix: str, as_json: bool, limit: int) -> None:
    """Key, original queue, reason, death count and age of each dead letter."""
    import time

    report = _run(amqp_url, prefix, lambda _letter: None)
    now = time.time()
    letters = report.seen[:limit] if limit else report.seen
    if as_json:
        for letter in letters:
            click.echo(json.dumps(letter.summary(now)))
        return
    if not report.seen:
        click.echo(f"no dead letters in {prefix}.dead")
        return
    click.echo(f"{'key':36s} {'queue':28s} {'reason':14s} {'count':>5s} {'age':>8s}  deaths")
    for letter in letters:
        click.echo(
            f"{(letter.key or '(no message_id)'):36s} {(letter.queue or '?'):28s} {(letter.reason or '?'):14s} "
            f"{letter.count:>5d} {_age(letter.age_s(now)):>8s}  {_deaths_text(letter)}"
        )
    shown = len(letters)
    click.echo(
        f"{len(report.seen)} dead letter(s) in {prefix}.dead"
        + (f" ({shown} shown)" if shown < len(report.seen) else "")
    )


@dead.command("show")
@click.argument("key")
@amqp_option
@prefix_option
def show_command(key: str, amqp_url: str, prefix: str) -> None:
    """Properties, headers and body of the dead letter with message_id KEY
    (as JSON)."""
    import time

    report = _run(amqp_url, prefix, lambda _letter: None)
    matches = [letter for letter in report.seen if letter.key == key]
    if not matches:
        raise click.ClickException(f"no dead letter with key {key!r} in {prefix}.dead ({len(report.seen)} there)")
    out = matches[0].details(time.time())
    if len(matches) > 1:
        out["copies"] = len(matches)
    click.echo(json.dumps(out, indent=2, ensure_ascii=False))


@dead.command("requeue")
@click.argument("key", required=False)
@click.option("--all", "all_", is_flag=True, help="Requeue every dead letter.")
@amqp_option
@prefix_option
def requeue_command(key: str | None, all_: bool, amqp_url: str, prefix: str) -> None:
    """Publish dead letter KEY (every copy of it), or --all of them, back to
    the queue each died in, with the same message_id, properties and
    headers; each leaves PREFIX.dead only once the broker confirmed it."""
    if (key is None) == (not all_):
        raise click.UsageError("give a KEY or --all (not both)")
    dead_queue = f"{prefix}.dead"

    def choose(letter: DeadLetter) -> str | None:
        if not all_ and letter.key != key:
            return None
        if letter.queue is None or letter.queue == dead_queue:
            failed_unknown.append(letter)
            return None
        return letter.queue

    failed_unknown: list[DeadLetter] = []
    report = _run(amqp_url, prefix, choose)
    for letter, target in report.requeued:
        click.echo(f"requeued {letter.key} -> {target}")
    for letter, why in report.failed:
        click.echo(f"kept {letter.key} in {dead_queue}: {why}", err=True)
    for letter in failed_unknown:
        click.echo(
            f"kept {letter.key} in {dead_queue}: its original queue is not recorded (no x-death / x-first-death-queue)",
            err=True,
        )
    if key is not None and not report.requeued and not report.failed and not failed_unknown:
        raise click.ClickException(f"no dead letter with key {key!r} in {dead_queue} ({len(report.seen)} there)")
    click.echo(
        f"{len(report.requeued)} requeued, {len(report.seen) - len(report.requeued)} left in {dead_queue}", err=True
    )
    if report.failed or failed_unknown:
        sys.exit(1)
