"""jaxserve.wire.amqp_compat against the real RabbitMQ.

Bad properties are put on the wire by :class:`RawPublisher`, a minimal AMQP
0-9-1 client over a plain socket that writes the content-header bytes
verbatim (the broker accepts them; aio-pika could not produce them). The
consumers are ordinary ``aio_pika.connect_robust`` connections.

The unpatched case runs in a subprocess (``python tests/test_amqp_compat.py
--unpatched ...``) because :func:`amqp_compat.install` patches module globals
for the whole process. That mode imports nothing from jaxserve.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import os
import struct
import subprocess
import sys
import time
import uuid

import aio_pika
import pytest
from pamqp import commands

from raw_amqp import longstr, publish_all, table

AMQP_URL = os.environ.get("JAXSERVE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
BAD = b"\xff\xfe-not-utf8"

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- consumer
class Consumer:
    """A robust consumer like the worker's, recording what happens."""

    def __init__(self, queue: str, on_message=None) -> None:
        self.queue_name = queue
        self.on_message = on_message
        self.deliveries: collections.Counter = collections.Counter()
        self.messages: dict[bytes, aio_pika.abc.AbstractIncomingMessage] = {}
        self.reconnects = 0
        self.closes: list[str] = []

    async def start(self, **queue_kw) -> Consumer:
        self.conn = await aio_pika.connect_robust(AMQP_URL, reconnect_interval=0.1)
        self.conn.reconnect_callbacks.add(self._on_reconnect)
        self.conn.close_callbacks.add(self._on_close)
        self.channel = await self.conn.channel()
        await self.channel.set_qos(prefetch_count=16)
        self.queue = await self.channel.declare_queue(self.queue_name, **queue_kw)
        self.tag = await self.queue.consume(self._deliver)
        return self

    def _on_reconnect(self, *_) -> None:
        self.reconnects += 1

    def _on_close(self, _conn, exc=None) -> None:
        self.closes.append(repr(exc))

    async def _deliver(self, message) -> None:
        self.deliveries[message.body] += 1
        self.messages[message.body] = message
        if self.on_message is not None:
            self.on_message(message)
        await message.ack()

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(self.queue.cancel(self.tag), 2)
        except Exception:  # noqa: BLE001 - a dropped connection may not answer
            pass
        await self.conn.close()


async def wait_for(pred, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- fixtures
@pytest.fixture
def compat():
    from jaxserve.wire import amqp_compat

    amqp_compat.install()
    return amqp_compat


@pytest.fixture
async def names():
    """Unique queue names; every one of them is deleted afterwards."""
    prefix = f"amqpcompat-{uuid.uuid4().hex[:10]}"
    made: list[str] = []
    exchanges: list[str] = []

    def name(suffix: str, exchange: bool = False) -> str:
        n = f"{prefix}.{suffix}"
        (exchanges if exchange else made).append(n)
        return n

    yield name
    conn = await aio_pika.connect(AMQP_URL)
    try:
        ch = await conn.channel()
        for q in made:
            await ch.queue_delete(q)
        for x in exchanges:
            await ch.exchange_delete(x)
    finally:
        await conn.close()


# ---------------------------------------------------------------- patched
TS_MAX = 2**64 - 1
CASES = {
    "content_type": ({"content_type": BAD}, ["content_type"]),
    "content_encoding": ({"content_encoding": BAD}, ["content_encoding"]),
    "message_id": ({"message_id": BAD}, ["message_id"]),
    "correlation_id": ({"correlation_id": BAD}, ["correlation_id"]),
    "reply_to": ({"reply_to": BAD}, ["reply_to"]),
    "type": ({"type": BAD}, ["type"]),
    "app_id": ({"app_id": BAD}, ["app_id"]),
    "cluster_id": ({"cluster_id": BAD}, ["cluster_id"]),
    "timestamp_max": ({"timestamp": TS_MAX}, ["timestamp"]),
    "timestamp_ms_year_33658": ({"timestamp": 10**15}, ["timestamp"]),
    "header_key": ({"headers": table((BAD, longstr(b"v")), (b"ok", longstr(b"w")))}, ["headers"]),
    "nested_header_key": ({"headers": table((b"outer", b"F" + table((BAD, longstr(b"v")))))}, ["headers"]),
    "header_timestamp_value": ({"headers": table((b"t", b"T" + struct.pack(">Q", TS_MAX)))}, ["headers"]),
    "several": (
        {
            "content_type": BAD,
            "headers": table((BAD, b"I" + struct.pack(">i", 1))),
            "correlation_id": b"fine",
            "reply_to": BAD,
            "message_id": b"m-1",
            "timestamp": TS_MAX,
            "app_id": BAD,
        },
        ["content_type", "headers", "reply_to", "timestamp", "app_id"],
    ),
}
GOOD = {"content_type": b"application/json", "message_id": b"good", "timestamp": 1_700_000_000}


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_property_delivered_once_without_dropping_connection(compat, names, case):
    props, expected = CASES[case]
    q = names(case)
    seen: list[list[str]] = []
    c = await Consumer(q, on_message=lambda m: seen.append(compat.undecodable_properties(m))).start()
    try:
        await publish_all(q, [(b"before", GOOD), (b"bad", props), (b"after", GOOD)])
        await wait_for(lambda: len(c.deliveries) == 3)
        await asyncio.sleep(0.3)  # a drop would redeliver within reconnect_interval
        assert dict(c.deliveries) == {b"before": 1, b"bad": 1, b"after": 1}
        assert (c.reconnects, c.closes) == (0, [])
        assert not c.channel.is_closed
        assert seen == [[], expected, []]
        bad = c.messages[b"bad"]
        assert bad.body == b"bad" and not bad.redelivered
        for name in expected:
            value = getattr(bad, name)
            if name == "timestamp":
                assert isinstance(value, compat.UnrepresentableTimestamp) and value.raw == props["timestamp"]
            elif name != "headers":
                assert value == BAD, (name, value)
        for m in (c.messages[b"before"], c.messages[b"after"]):
            assert (m.content_type, m.message_id, m.timestamp) == (
                "application/json",
                "good",
                datetime.datetime.fromtimestamp(1_700_000_000, datetime.UTC),
            )
    finally:
        await c.stop()
    ch_conn = await aio_pika.connect(AMQP_URL)
    try:  # every delivery, the bad one included, was acked
        left = await (await ch_conn.channel()).declare_queue(q, passive=True)
        assert left.declaration_result.message_count == 0
    finally:
        await ch_conn.close()


async def test_header_values_and_keys_decoded(compat, names):
    q = names("headers")
    c = await Consumer(q).start()
    try:
        hdr = table(
            (BAD, longstr(b"v")),
            (b"nested", b"F" + table((b"k", b"A" + struct.pack(">I", 9) + b"T" + struct.pack(">Q", TS_MAX)))),
            (b"bin", longstr(BAD)),
        )
        await publish_all(q, [(b"x", {"headers": hdr})])
        await wait_for(lambda: c.deliveries[b"x"] == 1)
        h = c.messages[b"x"].headers
        assert h[BAD] == "v" and h["bin"] == BAD  # long strings were already lenient
        (ts,) = h["nested"]["k"]
        assert isinstance(ts, compat.UnrepresentableTimestamp) and ts.raw == TS_MAX
        assert compat.undecodable_properties(c.messages[b"x"]) == ["headers"]
    finally:
        await c.stop()


async def test_binary_header_value_is_not_reported(compat, names):
    q = names("binval")
    c = await Consumer(q).start()
    try:
        await publish_all(q, [(b"x", {"headers": table((b"k", longstr(BAD)))})])
        await wait_for(lambda: c.deliveries[b"x"] == 1)
        assert c.messages[b"x"].headers == {"k": BAD}
        assert compat.undecodable_properties(c.messages[b"x"]) == []
    finally:
        await c.stop()


async def test_valid_properties_unchanged(compat, names):
    """Everything that decoded before decodes to the same values."""
    q = names("valid")
    c = await Consumer(q).start()
    props = {
        "content_type": b"text/plain; charset=utf-8",
        "content_encoding": b"gzip",
        "headers": table(
            ("ключ".encode(), longstr("значение".encode())), (b"n", b"F" + table((b"i", b"l" + struct.pack(">q", -5))))
        ),
        "delivery_mode": 2,
        "priority": 3,
        "correlation_id": "корр".encode(),
        "reply_to": b"replies",
        "expiration": b"60000",
        "message_id": "идентификатор".encode(),
        "timestamp": 1_700_000_000_123,
        "type": b"job",
        "user_id": b"guest",
        "app_id": "приложение".encode(),
    }
    try:
        await publish_all(q, [(b"v", props)])
        await wait_for(lambda: c.deliveries[b"v"] == 1)
        m = c.messages[b"v"]
        assert compat.undecodable_properties(m) == []
        assert m.headers == {"ключ": "значение", "n": {"i": -5}}
        assert (m.content_type, m.content_encoding, m.delivery_mode, m.priority) == (
            "text/plain; charset=utf-8",
            "gzip",
            2,
            3,
        )
        assert (m.correlation_id, m.reply_to, m.expiration, m.message_id) == ("корр", "replies", 60.0, "идентификатор")
        assert (m.type, m.user_id, m.app_id) == ("job", "guest", "приложение")
        # upstream's "above 2**32 is milliseconds" rule is kept
        assert m.timestamp == datetime.datetime.fromtimestamp(1_700_000_000.123, datetime.UTC)
        assert type(m.timestamp) is datetime.datetime
    finally:
        await c.stop()


async def test_bad_routing_key(compat, names):
    """A Basic.Deliver whose routing key is not UTF-8 (via a fanout exchange)."""
    q, x = names("rk"), names("rk-fanout", exchange=True)
    c = await Consumer(q).start()
    try:
        ex = await c.channel.declare_exchange(x, aio_pika.ExchangeType.FANOUT)
        await c.queue.bind(ex)
        await publish_all("placeholder", [(b"bad", {})], exchange=x, raw_routing_key=BAD)
        await publish_all("ok", [(b"ok", {})], exchange=x)
        await wait_for(lambda: len(c.deliveries) == 2)
        await asyncio.sleep(0.3)
        assert dict(c.deliveries) == {b"bad": 1, b"ok": 1} and c.reconnects == 0
        assert c.messages[b"bad"].routing_key == BAD
        assert compat.undecodable_properties(c.messages[b"bad"]) == ["routing_key"]
        assert compat.undecodable_properties(c.messages[b"ok"]) == []
    finally:
        await c.stop()


async def test_broker_refuses_bad_user_id_and_expiration(compat, names):
    """Why user_id and expiration cannot arrive undecodable: RabbitMQ checks
    them. (Its Channel.Close quotes the bytes, which the patch also lets
    pamqp decode; unpatched the refusal itself is an UnmarshalingException.)"""
    q = names("refused")
    c = await Consumer(q).start()
    try:
        for props, text in (({"user_id": BAD}, "user_id property set to"), ({"expiration": BAD}, "invalid expiration")):
            with pytest.raises(RuntimeError, match=f"broker closed: 406 .*{text}"):
                await publish_all(q, [(b"x", props)])
    finally:
        await c.stop()


def test_incoming_message_with_bytes_expiration(compat):
    """Not reachable through RabbitMQ (see above), so built by hand: aio-pika
    raised ValueError("Invalid expiration type") for bytes."""
    from aiormq.abc import DeliveredMessage
    from pamqp import header

    props = commands.Basic.Properties(expiration=BAD, message_id=BAD)
    dm = DeliveredMessage(
        delivery=commands.Basic.Deliver(consumer_tag="t", delivery_tag=1, routing_key="r"),
        header=header.ContentHeader(properties=props),
        body=b"",
        channel=None,
    )
    m = aio_pika.IncomingMessage(dm)
    assert (m.expiration, m.message_id) == (BAD, BAD)
    assert compat.undecodable_properties(m) == ["expiration", "message_id"]


def test_install_is_idempotent(compat):
    from pamqp import decode

    before = (
        decode.METHODS["shortstr"],
        decode.METHODS["timestamp"],
        decode.METHODS["table"],
        decode.TABLE_MAPPING[b"T"],
        decode.TABLE_MAPPING[b"F"],
        aio_pika.IncomingMessage.__init__,
    )
    compat.install()
    compat.install()
    after = (
        decode.METHODS["shortstr"],
        decode.METHODS["timestamp"],
        decode.METHODS["table"],
        decode.TABLE_MAPPING[b"T"],
        decode.TABLE_MAPPING[b"F"],
        aio_pika.IncomingMessage.__init__,
    )
    assert before == after and compat.installed()
    assert decode.short_str is decode.METHODS["shortstr"] and decode.field_table is decode.TABLE_MAPPING[b"F"]
    # framing errors still raise
    with pytest.raises(ValueError):
        decode.timestamp(b"\x00\x01")
    with pytest.raises(ValueError):
        decode.field_table(struct.pack(">I", 50) + b"\x03ab")


# ---------------------------------------------------------------- unpatched
UNPATCHED_CASES = {
    "content_type": {"content_type": BAD},
    "timestamp": {"timestamp": TS_MAX},
    "header_key": {"headers": table((BAD, longstr(b"v")))},
}


async def _unpatched_main(queues: list[str], seconds: float) -> dict:
    """Consume each queue on its own robust connection, with pamqp and
    aio-pika as shipped; report what happened."""
    from pamqp import decode

    assert not getattr(decode.METHODS["shortstr"], "_jaxserve_amqp_compat", False)
    import logging

    errors: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            e = record.exc_info[1] if record.exc_info else None
            if e is not None and record.name == "aiormq.connection":
                errors.append(
                    f"{type(e).__name__}<-{type(e.__cause__).__name__}<-{type(e.__cause__.__cause__).__name__}"
                    if e.__cause__
                    else type(e).__name__
                )

    logging.getLogger("aiormq.connection").addHandler(Grab())
    consumers = [await Consumer(q).start() for q in queues]
    await asyncio.sleep(seconds)
    report = {
        c.queue_name: {
            "deliveries": {k.decode(): v for k, v in c.deliveries.items()},
            "reconnects": c.reconnects,
            "closes": len(c.closes),
        }
        for c in consumers
    }
    for c in consumers:
        await c.stop()
    return {"queues": report, "errors": collections.Counter(errors)}


async def test_unpatched_connection_drops(names):
    queues = {case: names(f"unpatched-{case}") for case in UNPATCHED_CASES}
    conn = await aio_pika.connect(AMQP_URL)
    try:
        ch = await conn.channel()
        for q in queues.values():
            await ch.declare_queue(q)
    finally:
        await conn.close()
    for case, q in queues.items():
        await publish_all(q, [(b"before", GOOD), (b"bad", UNPATCHED_CASES[case]), (b"after", GOOD)])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--unpatched",
        "1.5",
        *queues.values(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=os.path.dirname(__file__),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    for case, q in queues.items():
        r = report["queues"][q]
        assert r["reconnects"] >= 3, (case, r)  # dropped and reconnected again and again
        assert r["closes"] >= 3, (case, r)
        assert "bad" not in r["deliveries"] and "after" not in r["deliveries"], (case, r)
        assert r["deliveries"]["before"] >= 3, (case, r)  # the innocent job is redelivered each time
    # InvalidFrameError <- pamqp UnmarshalingException <- UnicodeDecodeError / ValueError
    assert set(report["errors"]) == {
        "InvalidFrameError<-UnmarshalingException<-UnicodeDecodeError",
        "InvalidFrameError<-UnmarshalingException<-ValueError",
    }, report


if __name__ == "__main__" and sys.argv[1:2] == ["--unpatched"]:
    print(json.dumps(asyncio.run(_unpatched_main(sys.argv[3:], float(sys.argv[2])))))
