"""A minimal AMQP 0-9-1 publisher over a plain socket, for tests that must
put bytes on the wire that no client library would produce (properties that
are not valid UTF-8, timestamps no datetime can hold). The broker accepts
them; consumers then have to cope. Imports nothing from jaxserve.
"""

from __future__ import annotations

import asyncio
import os
import struct

from pamqp import commands
from pamqp import frame as pframe

HOST = os.environ.get("JAXSERVE_TEST_AMQP_HOST", "127.0.0.1")
PORT = int(os.environ.get("JAXSERVE_TEST_AMQP_PORT", "5672"))

FRAME_END = b"\xce"
# Basic property flag bits in wire order (AMQP 0-9-1 class basic), aio-pika names.
PROP_BITS = (
    ("content_type", 15, "s"),
    ("content_encoding", 14, "s"),
    ("headers", 13, "F"),
    ("delivery_mode", 12, "o"),
    ("priority", 11, "o"),
    ("correlation_id", 10, "s"),
    ("reply_to", 9, "s"),
    ("expiration", 8, "s"),
    ("message_id", 7, "s"),
    ("timestamp", 6, "T"),
    ("type", 5, "s"),
    ("user_id", 4, "s"),
    ("app_id", 3, "s"),
    ("cluster_id", 2, "s"),
)


def shortstr(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def table(*entries: tuple[bytes, bytes]) -> bytes:
    """Encoded field table from (raw key, type tag + encoded value) pairs."""
    body = b"".join(shortstr(k) + v for k, v in entries)
    return struct.pack(">I", len(body)) + body


def longstr(raw: bytes) -> bytes:
    return b"S" + struct.pack(">I", len(raw)) + raw


def encode_properties(props: dict) -> bytes:
    unknown = set(props) - {n for n, _, _ in PROP_BITS}
    assert not unknown, unknown
    flags, parts = 0, []
    for name, bit, kind in PROP_BITS:
        if name not in props:
            continue
        v = props[name]
        flags |= 1 << bit
        if kind == "s":
            parts.append(shortstr(v if isinstance(v, bytes) else v.encode()))
        elif kind == "o":
            parts.append(bytes([v]))
        elif kind == "T":
            parts.append(struct.pack(">Q", v))
        else:  # a table, already encoded
            parts.append(v)
    return struct.pack(">H", flags) + b"".join(parts)


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + FRAME_END


class RawPublisher:
    """Just enough AMQP to publish with confirms, independent of aiormq."""

    async def open(self, host: str = HOST, port: int = PORT) -> RawPublisher:
        self.tag = 0
        self.reader, self.writer = await asyncio.open_connection(host, port)
        self.writer.write(b"AMQP\x00\x00\x09\x01")
        await self._expect(commands.Connection.Start)
        self._send(
            0,
            commands.Connection.StartOk(
                client_properties={"product": "amqpcompat-raw"}, mechanism="PLAIN", response="\0guest\0guest"
            ),
        )
        tune = await self._expect(commands.Connection.Tune)
        self._send(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
        self._send(0, commands.Connection.Open(virtual_host="/"))
        await self._expect(commands.Connection.OpenOk)
        self._send(1, commands.Channel.Open())
        await self._expect(commands.Channel.OpenOk)
        self._send(1, commands.Confirm.Select())
        await self._expect(commands.Confirm.SelectOk)
        return self

    def _send(self, channel: int, method) -> None:
        self.writer.write(pframe.marshal(method, channel))

    async def _read(self):
        head = await self.reader.readexactly(7)
        (size,) = struct.unpack(">I", head[3:7])
        f = pframe.unmarshal(head + await self.reader.readexactly(size + 1))[2]
        if isinstance(f, (commands.Connection.Close, commands.Channel.Close)):
            raise RuntimeError(f"broker closed: {f.reply_code} {f.reply_text!r}")
        return f

    async def _expect(self, kind):
        while not isinstance(f := await self._read(), kind):
            pass
        return f

    async def publish(
        self,
        routing_key: str,
        body: bytes,
        props: dict | None = None,
        *,
        exchange: str = "",
        raw_routing_key: bytes | None = None,
    ) -> None:
        """Publish ``props`` verbatim; return once the broker confirmed it."""
        method = pframe.marshal(commands.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True), 1)
        if raw_routing_key is not None:
            # class, method, ticket, exchange, then the routing key
            at = 4 + 2 + len(shortstr(exchange.encode()))
            payload = method[7:-1]
            assert payload[at:].startswith(shortstr(routing_key.encode()))
            payload = payload[:at] + shortstr(raw_routing_key) + payload[at + 1 + len(routing_key) :]
            method = _frame(1, 1, payload)
        header = struct.pack(">HHQ", 60, 0, len(body)) + encode_properties(props or {})
        self.writer.write(method + _frame(2, 1, header) + _frame(3, 1, body))
        self.tag += 1
        while True:
            f = await self._read()
            if isinstance(f, (commands.Basic.Return, commands.Basic.Nack)):
                raise RuntimeError(f"not accepted: {f!r}")
            if isinstance(f, commands.Basic.Ack) and f.delivery_tag >= self.tag:
                return

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


async def publish_all(queue: str, items: list[tuple[bytes, dict]], **kw) -> None:
    pub = await RawPublisher().open()
    try:
        for body, props in items:
            await pub.publish(queue, body, props, **kw)
    finally:
        await pub.close()
