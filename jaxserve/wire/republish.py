"""A received message copied for publishing again: the worker's deferral
(a batch job over its tenant's limit goes back to the tail of its queue)
and ``jaxserve dead requeue`` both re-send a job as the producer sent it,
with new headers."""

from __future__ import annotations

from typing import Any

import aio_pika

#: the producer's AMQP properties a copy carries over unchanged; the rest
#: (headers, delivery_mode, user_id) are decided by :func:`copy_message`
_PRODUCER_PROPERTIES = (
    "content_type",
    "content_encoding",
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "timestamp",
    "type",
    "app_id",
)


def copy_message(
    message: Any, headers: dict[str, Any], *, login_user: str | None = None, delivery_mode: Any = None
) -> aio_pika.Message:
    """``message`` (an incoming aio-pika message) with ``headers`` instead of
    its own and every producer property kept. ``user_id`` is kept only when
    it is ``login_user``: RabbitMQ refuses a user_id other than the
    publishing login. ``delivery_mode``: default the message's own, else
    persistent."""
    kept = {name: getattr(message, name) for name in _PRODUCER_PROPERTIES}
    return aio_pika.Message(
        body=bytes(message.body),
        headers=headers,
        delivery_mode=delivery_mode or message.delivery_mode or aio_pika.DeliveryMode.PERSISTENT,
        user_id=message.user_id if message.user_id == login_user else None,
        **kept,
    )
