"""The broker's own latency, second by second, from a process of its own.

    .venv/bin/python benchmarks/broker_probe.py [--seconds 75] [--every-ms 20]

Publishes a small message to an exclusive queue every ``--every-ms`` and
consumes it on the same connection (no publisher confirms), printing per
second the median and worst publish -> delivery time. Run it beside a
benchmark (``queue_interactive_ttft.py``) to tell the broker's share of a
loaded delivery from the worker's: this process's event loop is idle, so
what grows here under load is the broker and the machine, not a worker's
loop. Writes ``results/broker-probe-<label>-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import aio_pika


async def probe(url: str, seconds: float, every_s: float) -> list[dict]:
    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel(publisher_confirms=False)
        q = await ch.declare_queue("", exclusive=True)
        got: dict[bytes, float] = {}

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            got[message.body] = time.monotonic()

        await q.consume(on_message, no_ack=True)
        sent: dict[bytes, tuple[float, float]] = {}  # body -> (monotonic, wall clock)
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            body = str(i).encode()
            sent[body] = (time.monotonic(), time.time())
            await ch.default_exchange.publish(aio_pika.Message(body), routing_key=q.name)
            i += 1
            await asyncio.sleep(every_s)
        await asyncio.sleep(0.5)
    finally:
        await conn.close()
    per_second: dict[int, list[float]] = {}
    for body, (t_mono, t_wall) in sent.items():
        if body in got:
            per_second.setdefault(int(t_wall), []).append(1000 * (got[body] - t_mono))
    return [
        {
            "utc": time.strftime("%H:%M:%S", time.gmtime(s)),
            "n": len(xs),
            "median_ms": round(statistics.median(xs), 3),
            "max_ms": round(max(xs), 3),
        }
        for s, xs in sorted(per_second.items())
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    ap.add_argument("--seconds", type=float, default=75.0)
    ap.add_argument("--every-ms", type=float, default=20.0)
    ap.add_argument("--label", default="run")
    args = ap.parse_args()
    rows = asyncio.run(probe(args.amqp_url, args.seconds, args.every_ms / 1000))
    for r in rows:
        print(f"{r['utc']}  median {r['median_ms']:.2f} ms  max {r['max_ms']:.1f} ms  ({r['n']})")
    out = Path(__file__).resolve().parent / "results" / f"broker-probe-{args.label}-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps({"benchmark": "broker_probe", "settings": vars(args), "seconds": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
