"""Lenient decoding of AMQP message properties (pamqp 4.0.1, aiormq 7.2.4,
aio-pika 10.2.1).

Upstream behaviour
------------------
RabbitMQ does not validate most basic properties: it stores and delivers a
shortstr (content_type, content_encoding, correlation_id, reply_to,
message_id, type, app_id, cluster_id) that is not UTF-8, any 64-bit
``timestamp``, and field-table keys that are not UTF-8. (It does check
``user_id`` against the login and ``expiration`` for being an integer, and
refuses those publishes.) pamqp 4.0.1 cannot decode what it stores:

* ``pamqp.decode.short_str`` calls ``bytes.decode('utf-8')`` with no fallback
  (``long_str`` falls back to ``bytes``); the ``UnicodeDecodeError`` escapes.
* ``pamqp.decode.timestamp`` divides values above ``0xFFFFFFFF`` by 1000 and
  calls ``datetime.fromtimestamp``, which raises ``ValueError`` ("year ... is
  out of range", e.g. for ``2**64-1`` or ``10**15``); ``OverflowError`` or
  ``OSError`` on other platforms.
* ``pamqp.decode.field_table`` decodes every key as UTF-8 inline.

``pamqp.frame._unmarshal_header_frame`` turns the ``ValueError`` into
``UnmarshalingException``; aiormq's ``FrameReceiver.get_frame`` raises it as
``InvalidFrameError``, which ends the connection's reader task, and
``Connection._on_reader_done`` closes the whole connection. aio-pika's robust
connection reconnects, the broker redelivers everything that connection had
unacked (acks sent just before the drop are lost), and the next delivery of
the bad message drops it again: the loop repeats until ``x-delivery-limit``
dead-letters the bad message *and* the innocent jobs that were delivered on
the same connection. The same shortstr failure hits method frames too (a
``Basic.Deliver`` with a routing key that is not UTF-8, a ``Channel.Close``
whose reply text quotes such bytes).

The patch
---------
:func:`install` wraps the three decoders and puts the wrappers everywhere
pamqp looks them up: the module attributes, ``decode.METHODS`` (used by
``by_type``, which ``Basic.Properties.unmarshal`` and ``Frame.unmarshal``
call) and ``decode.TABLE_MAPPING`` (used for values inside tables and
arrays); both dicts hold the functions captured at import time. A wrapper
first calls the upstream decoder and only handles the failure:

* a shortstr or table key that is not UTF-8 comes back as the raw ``bytes``
  (what ``long_str`` already does) with the same byte count consumed;
* a timestamp that ``datetime`` cannot represent comes back as an
  :class:`UnrepresentableTimestamp` (a ``datetime`` at the epoch, UTC, with
  the wire value in ``.raw``).

It is safe because every frame upstream decodes is decoded identically (the
upstream function runs first and its result is returned as is), framing
errors (truncated data, bad lengths) still raise, and the byte accounting of
a fallback is exactly upstream's. Encoding is not touched.

aio-pika's ``IncomingMessage.__init__`` passes correlation_id, reply_to,
message_id, type, user_id and app_id through ``str()``, which would turn
``b'\\xff'`` into the text ``"b'\\\\xff'"``; the wrapped ``__init__`` puts
the raw bytes back. ``decode_expiration`` gets a ``bytes`` case (it raised
``ValueError`` for them). content_type, content_encoding, cluster_id,
headers and timestamp pass through aio-pika unchanged.

Use: call :func:`install` once when the worker module is imported; in the
delivery handler call :func:`undecodable_properties` first and answer a
message that has any with an ``invalid_request`` error naming them.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

import aio_pika.message
from pamqp import common, decode

__all__ = ["UnrepresentableTimestamp", "install", "installed", "undecodable_properties"]

# Properties that are shortstrs, in wire order, as aio-pika names them.
_SHORTSTR_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)
# aio-pika attribute -> pamqp property for the ones aio-pika passes through str().
_STR_CONVERTED = (
    ("correlation_id", "correlation_id"),
    ("reply_to", "reply_to"),
    ("message_id", "message_id"),
    ("type", "message_type"),
    ("user_id", "user_id"),
    ("app_id", "app_id"),
)
_MARK = "_jaxserve_amqp_compat"


class UnrepresentableTimestamp(datetime.datetime):
    """A timestamp ``datetime`` cannot represent: 1970-01-01 UTC, with the
    64-bit wire value in :attr:`raw`."""

    raw: int | None = None

    def __repr__(self) -> str:
        return f"UnrepresentableTimestamp(raw={self.raw!r})"


def _unrepresentable(raw: int) -> UnrepresentableTimestamp:
    ts = UnrepresentableTimestamp(1970, 1, 1, tzinfo=datetime.UTC)
    ts.raw = raw
    return ts


def _marked(fn: Any) -> Any:
    setattr(fn, _MARK, True)
    return fn


def _wrap_short_str(upstream):
    def short_str(value: bytes) -> tuple[int, str | bytes]:
        try:
            return upstream(value)
        except UnicodeDecodeError:
            length = value[0]
            return length + 1, bytes(value[1 : length + 1])

    return _marked(short_str)


def _wrap_timestamp(upstream):
    def timestamp(value: bytes) -> tuple[int, datetime.datetime]:
        try:
            raw = common.Struct.timestamp.unpack(value[0:8])[0]
        except (struct.error, TypeError):
            return upstream(value)  # truncated: let upstream raise its error
        try:
            return upstream(value)
        except (OverflowError, OSError, ValueError):
            return 8, _unrepresentable(raw)

    return _marked(timestamp)


def _lenient_table(value: bytes) -> tuple[int, dict]:
    """Upstream's table layout, with a key that is not UTF-8 kept as bytes."""
    try:
        end = 4 + common.Struct.integer.unpack(value[0:4])[0]
        if end > len(value):
            raise ValueError("Field table length exceeds available data")
        offset, data = 4, {}
        while offset < end:
            key_length = value[offset]
            offset += 1
            if offset + key_length > end:
                raise ValueError("Field table key length exceeds data")
            raw = value[offset : offset + key_length]
            offset += key_length
            try:
                key: str | bytes = raw.decode("utf-8")
            except UnicodeDecodeError:
                key = bytes(raw)
            consumed, data[key] = decode.embedded_value(value[offset:])
            offset += consumed
        return end, data
    except (struct.error, TypeError, IndexError) as err:
        raise ValueError("Could not unpack data") from err


def _wrap_field_table(upstream):
    def field_table(value: bytes) -> tuple[int, dict]:
        try:
            return upstream(value)
        except UnicodeDecodeError:  # only a key can raise it (values are lenient)
            return _lenient_table(value)

    return _marked(field_table)


def _wrap_incoming_init(upstream):
    def __init__(self, message, *args, **kwargs) -> None:
        upstream(self, message, *args, **kwargs)
        props = message.header.properties
        for attr, prop in _STR_CONVERTED:
            raw = getattr(props, prop, None)
            if isinstance(raw, bytes):
                object.__setattr__(self, attr, raw)  # bypasses the message lock

    return _marked(__init__)


def installed() -> bool:
    return getattr(decode.METHODS["shortstr"], _MARK, False)


def install() -> None:
    """Make property decoding lenient (see the module docstring). Idempotent."""
    if installed():
        return
    short_str = _wrap_short_str(decode.short_str)
    timestamp = _wrap_timestamp(decode.timestamp)
    field_table = _wrap_field_table(decode.field_table)
    decode.short_str, decode.timestamp, decode.field_table = short_str, timestamp, field_table
    decode.TABLE_MAPPING[b"T"] = timestamp
    decode.TABLE_MAPPING[b"F"] = field_table
    aio_pika.message.decode_expiration.register(bytes, lambda raw: raw)
    cls = aio_pika.message.IncomingMessage
    cls.__init__ = _wrap_incoming_init(cls.__init__)  # type: ignore[method-assign]  # the patch this module is for
    # Last: installed() reads this one.
    decode.METHODS["timestamp"] = timestamp
    decode.METHODS["table"] = field_table
    decode.METHODS["shortstr"] = short_str


def _table_undecodable(value: Any) -> bool:
    if isinstance(value, UnrepresentableTimestamp):
        return True
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _table_undecodable(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_table_undecodable(v) for v in value)
    return False


def undecodable_properties(message: Any) -> list[str]:
    """Names (aio-pika's, in wire order) of the properties of an incoming
    message that did not decode: a shortstr kept as bytes, an
    :class:`UnrepresentableTimestamp`, or ``headers`` when a key at any depth
    is not a str or a timestamp value in it is unrepresentable. Binary
    *values* in headers are ordinary AMQP and are not reported. A routing key
    or exchange that is not UTF-8 is reported as ``routing_key``/``exchange``.
    """
    found = {name for name in _SHORTSTR_PROPERTIES if isinstance(getattr(message, name, None), bytes)}
    if isinstance(getattr(message, "timestamp", None), UnrepresentableTimestamp):
        found.add("timestamp")
    if _table_undecodable(getattr(message, "headers", None) or {}):
        found.add("headers")
    order = (
        "content_type",
        "content_encoding",
        "headers",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
        "cluster_id",
    )
    names = [n for n in order if n in found]
    names += [n for n in ("exchange", "routing_key") if isinstance(getattr(message, n, None), bytes)]
    return names
