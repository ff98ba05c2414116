"""The status page's data: ``GET /status.json``, drawn by ``GET /``
(``static/status.html``, plain HTML and a little JavaScript, no build
step).

Per model and queue class: depth (ready and unacked), consumers and rates,
from the same broker look as ``jaxserve status`` (rabbitmqctl or the
management API; :mod:`jaxserve.gateway.broker_view`), the rates from the
management API when it is there and from the gateway's own answers
otherwise; the newest batches with their live counts; refusals by code
over the last ten minutes, from :class:`~jaxserve.gateway.metrics.RecentEvents`.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.gateway.batches import Batches
from jaxserve.gateway.broker_view import BrokerSnapshot
from jaxserve.gateway.metrics import GatewayMetrics, RecentEvents


def queue_rows(snap: BrokerSnapshot, events: RecentEvents) -> list[dict[str, Any]]:
    names: dict[str, list[str]] = {}
    for model in snap.models.values():
        for queue in model.queues.values():
            names.setdefault(queue, []).append(model.name)
    rates = events.rates()
    rows = []
    for q in snap.queues.values():
        if q.queue_class is None:
            continue
        served = sorted(names.get(q.name, []))
        label = served[0] if served else (q.model or "(default)")
        rows.append(
            {
                "model": label,
                "names": served,
                "class": q.queue_class,
                "queue": q.name,
                "ready": q.ready,
                "unacked": q.unacked,
                "consumers": q.consumers,
                "publish_rate": q.publish_rate,
                "ack_rate": q.ack_rate,
                "gateway_rate": round(sum(rates.get((n, q.queue_class), 0.0) for n in served or [label]), 3),
            }
        )
    return sorted(rows, key=lambda r: (r["model"] != "(default)", r["model"], r["class"]))


def set_gauges(metrics: GatewayMetrics, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        metrics.queue_depth.labels(row["model"], row["class"]).set(row["ready"])
        metrics.queue_consumers.labels(row["model"], row["class"]).set(row["consumers"])


async def status_data(snap: BrokerSnapshot, events: RecentEvents, batches: Batches) -> dict[str, Any]:
    bucket_s = 60.0
    return {
        "generated_at": int(time.time()),
        "broker": {
            "source": snap.source,
            "error": snap.error,
            "age_s": round(time.monotonic() - snap.taken_at, 1) if snap.taken_at else None,
        },
        "queues": queue_rows(snap, events),
        "batches": [
            {
                "id": b["id"],
                "tenant": b.get("tenant"),
                "status": b["status"],
                "endpoint": b["endpoint"],
                **b["request_counts"],
                "created_at": b["created_at"],
                "expires_at": b.get("expires_at"),
            }
            for b in await batches.everyone()
        ],
        "refusals": {
            "bucket_s": bucket_s,
            "window_s": events.window_s,
            "by_code": events.refusals(bucket_s),
        },
    }
