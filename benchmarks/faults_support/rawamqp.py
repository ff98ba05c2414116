"""Raw AMQP publisher and lenient reader (run as a subprocess of the suite).

aio-pika/pamqp refuse to *encode* what a hostile or buggy producer can put
on the wire (short strings that are not UTF-8, timestamps of 2**64-1,
double-precision header values, header names that are not UTF-8), and
refuse to *decode* it again (an exception in the connection's reader). This
module patches pamqp's codec tables inside its own process only:

* ``publish SPEC OUT``: publish every message of SPEC (a pickle list of
  ``{"tag", "rk", "body": bytes, "props": {...}}``) with publisher confirms;
  property values may be ``bytes`` (sent as they are), ``timestamp`` an
  ``int`` (sent as the raw 64-bit value), ``headers`` a tuple
  ``("raw", bytes)`` (a field table encoded by :func:`encode_table`). Writes ``{"published": [...], "failed": {...}}``
  to OUT (JSON).
* ``drain QUEUE OUT``: take every message of QUEUE (basic.get, no ack) with
  lenient decoding and write one JSON line per message to OUT.

Usage: ``python rawamqp.py publish|drain URL ARG OUT``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import pickle
import struct
import sys
from typing import Any


class RawTable(bytes):
    """A field table already encoded (its 4-byte length prefix included)."""


def _shortstr(b: bytes) -> bytes:
    return struct.pack(">B", len(b)) + b


def encode_table(items: list[tuple[bytes, str, Any]]) -> tuple[str, bytes]:
    """Encode ``[(name bytes, type char, value), ...]`` as an AMQP field table,
    without any validation (types: t bool, b int8, s int16, I int32, l int64,
    f float32, d float64, S longstr bytes, x byte array, T timestamp (raw
    uint64), V void, F nested list of items, A list of (type, value)).
    The result is what ``props["headers"]`` takes."""
    return ("raw", _table(items))


def _value(t: str, v: Any) -> bytes:
    if t == "t":
        return b"t" + struct.pack(">B", 1 if v else 0)
    if t == "b":
        return b"b" + struct.pack(">b", v)
    if t == "s":
        return b"s" + struct.pack(">h", v)
    if t == "I":
        return b"I" + struct.pack(">i", v)
    if t == "l":
        return b"l" + struct.pack(">q", v)
    if t == "f":
        return b"f" + struct.pack(">f", v)
    if t == "d":
        return b"d" + struct.pack(">d", v)
    if t in ("S", "x"):
        raw = v if isinstance(v, (bytes, bytearray)) else str(v).encode()
        return t.encode() + struct.pack(">I", len(raw)) + bytes(raw)
    if t == "T":
        return b"T" + struct.pack(">Q", v)
    if t == "V":
        return b"V"
    if t == "F":
        return b"F" + _table(v)
    if t == "A":
        inner = b"".join(_value(tt, vv) for tt, vv in v)
        return b"A" + struct.pack(">I", len(inner)) + inner
    raise ValueError(f"unknown field type {t!r}")


def _table(items: list[tuple[bytes, str, Any]]) -> bytes:
    data = b"".join(_shortstr(k) + _value(t, v) for k, t, v in items)
    return struct.pack(">I", len(data)) + data


# ------------------------------------------------------------- pamqp patches
def patch_encoder() -> None:
    from pamqp import common, encode

    orig_short, orig_ts, orig_table = encode.METHODS["shortstr"], encode.METHODS["timestamp"], encode.METHODS["table"]

    def shortstr(value: Any) -> bytes:
        if isinstance(value, (bytes, bytearray)):
            return _shortstr(bytes(value)[:255])
        return orig_short(value)

    def timestamp(value: Any) -> bytes:
        if isinstance(value, int):
            return common.Struct.timestamp.pack(value)
        return orig_ts(value)

    def table(value: Any) -> bytes:
        if isinstance(value, RawTable):
            return bytes(value)
        return orig_table(value)

    encode.METHODS["shortstr"] = shortstr
    encode.METHODS["timestamp"] = timestamp
    encode.METHODS["table"] = table


def patch_decoder() -> None:
    from pamqp import common, decode

    def short_str(value: bytes) -> tuple[int, str]:
        length = common.Struct.byte.unpack(value[0:1])[0]
        return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")

    def timestamp(value: bytes) -> tuple[int, Any]:
        raw = common.Struct.timestamp.unpack(value[0:8])[0]
        try:
            return 8, datetime.datetime.fromtimestamp(raw if raw <= 0xFFFFFFFF else raw / 1000.0, tz=datetime.UTC)
        except (ValueError, OverflowError, OSError):
            return 8, raw

    def field_table(value: bytes) -> tuple[int, dict]:
        length = common.Struct.integer.unpack(value[0:4])[0]
        offset, end, data = 4, 4 + length, {}
        while offset < end:
            klen = value[offset]
            offset += 1
            key = value[offset : offset + klen].decode("utf-8", "surrogateescape")
            offset += klen
            consumed, result = decode.embedded_value(value[offset:])
            offset += consumed
            data[key] = result
        return end, data

    decode.METHODS["shortstr"] = short_str
    decode.METHODS["timestamp"] = timestamp
    decode.METHODS["table"] = field_table
    decode.TABLE_MAPPING[b"F"] = field_table  # tables nested in tables
    decode.TABLE_MAPPING[b"T"] = timestamp


def lossy(v: Any) -> Any:
    """A JSON-able, readable form of a leniently decoded value."""
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, dict):
        return {lossy(k): lossy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [lossy(x) for x in v]
    if isinstance(v, datetime.datetime):
        return v.isoformat()
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    return repr(v)


# ------------------------------------------------------------------ commands
def _risky(m: dict[str, Any]) -> bool:
    """A message the broker itself may refuse by closing the connection
    (e.g. it cannot parse a NaN double in a header table): sent on its own."""
    p = m["props"]
    return any(isinstance(v, (bytes, bytearray, tuple)) for v in p.values()) or isinstance(p.get("timestamp"), int)


async def publish(url: str, spec_path: str, out_path: str, window: int = 256) -> None:
    """Pipelined publishes with confirms, ``window`` at a time; a risky
    message is sent alone after the window before it is confirmed, so a
    connection the broker closes on it takes nothing else with it (a
    message whose confirm was lost is reported ``unconfirmed``, never
    republished: it may be in the queue)."""
    import aiormq
    from pamqp import commands as spec

    with open(spec_path, "rb") as f:
        msgs = pickle.load(f)
    published: list[str] = []
    failed: dict[str, str] = {}
    state = {"conn": await aiormq.connect(url), "reconnects": 0}
    state["ch"] = await state["conn"].channel()

    def props_of(m: dict[str, Any]) -> Any:
        kw = dict(m["props"])
        if isinstance(kw.get("headers"), tuple) and kw["headers"][0] == "raw":
            kw["headers"] = RawTable(kw["headers"][1])
        return spec.Basic.Properties(**kw)

    async def reconnect() -> None:
        state["reconnects"] += 1
        try:
            await state["conn"].close()
        except Exception:  # noqa: BLE001
            pass
        state["conn"] = await aiormq.connect(url)
        state["ch"] = await state["conn"].channel()

    async def send(batch: list[dict[str, Any]], alone: bool) -> None:
        if not batch:
            return
        futs = []
        for m in batch:
            try:
                futs.append(
                    state["ch"].basic_publish(
                        m["body"], exchange="", routing_key=m["rk"], properties=props_of(m), mandatory=False
                    )
                )
            except Exception as exc:  # noqa: BLE001 - refused by the (patched) encoder
                futs.append(asyncio.sleep(0, result=exc))
        results = await asyncio.gather(*futs, return_exceptions=True)
        broken = False
        for m, r in zip(batch, results):
            if isinstance(r, BaseException):
                gone = state["ch"].is_closed or state["conn"].is_closed
                why = f"{type(r).__name__}: {r}"[:300]
                failed[m["tag"]] = ("refused by the broker: " if alone else "unconfirmed: ") + why if gone else why
                broken = broken or gone
            elif type(r).__name__ == "Nack":
                failed[m["tag"]] = "nacked"
            else:
                published.append(m["tag"])
        if broken:
            await reconnect()

    pending: list[dict[str, Any]] = []
    for m in msgs:
        if _risky(m):
            await send(pending, alone=False)
            pending = []
            await send([m], alone=True)
            continue
        pending.append(m)
        if len(pending) >= window:
            await send(pending, alone=False)
            pending = []
    await send(pending, alone=False)
    await state["conn"].close()
    with open(out_path, "w") as f:
        json.dump({"published": published, "failed": failed, "reconnects": state["reconnects"]}, f)


async def drain(url: str, queue: str, out_path: str) -> None:
    import aiormq
    from pamqp import commands as spec

    conn = await aiormq.connect(url)
    ch = await conn.channel()
    n = 0
    with open(out_path, "a") as out:
        while True:
            try:
                msg = await ch.basic_get(queue, no_ack=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                break
            if msg is None or isinstance(msg.delivery, spec.Basic.GetEmpty):
                break
            p = msg.header.properties
            headers = p.headers or {}
            body = msg.body
            btype = None
            bid = None
            try:
                parsed = json.loads(body)
                if isinstance(parsed, dict):
                    btype, bid = parsed.get("type"), parsed.get("id")
            except (ValueError, UnicodeDecodeError, RecursionError):
                pass
            rec = {
                "message_id": lossy(p.message_id),
                "correlation_id": lossy(p.correlation_id),
                "reply_to": lossy(p.reply_to),
                "first_death_reason": lossy(headers.get("x-first-death-reason")),
                "first_death_queue": lossy(headers.get("x-first-death-queue")),
                "deaths": len(headers.get("x-death") or []),
                "delivery_count": lossy(headers.get("x-delivery-count")),
                "body_len": len(body),
                "body_type": lossy(btype),
                "body_id": lossy(bid) if isinstance(bid, str) else None,
            }
            out.write(json.dumps(rec) + "\n")
            n += 1
    await conn.close()
    print(json.dumps({"drained": n}))


def main(argv: list[str]) -> None:
    cmd, url, arg, out = argv[1:5]
    if cmd == "publish":
        patch_encoder()
        asyncio.run(publish(url, arg, out))
    elif cmd == "drain":
        patch_decoder()
        asyncio.run(drain(url, arg, out))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv)
