"""One load-test job's record: what the load generator measured of it, and
how its final result is classified.

Per job (one :class:`JobRecord`), on the load generator's monotonic clock:

- ``ttft_s``: from just before the publish to the first streamed chunk
  (streaming jobs only; none for the others);
- ``itl_samples``: one sample per gap between consecutive streamed chunks,
  the gap divided by the tokens a chunk carries. The wire does not say how
  many tokens a chunk holds (deltas that pile up are coalesced), so each
  chunk is taken to carry ``usage.completion_tokens / number of text
  deltas`` tokens (the final result's fill-in, if any, counts as a delta);
- ``e2e_s``: from just before the publish to the final result;
- ``completion_tokens`` / ``prompt_tokens``: the final's ``usage``;
- ``served_model``: the model that answered (the final's ``served_model``,
  else its ``model``), ``degraded``: what the answer gave up (``model``: a
  fallback answered, ``max_tokens``), ``cost``: the final's
  ``usage.cost`` amount and ``cost_currency`` (when the worker has prices).

A rejection is a publish the broker refused (``QueueFull``: the queue is at
its length limit), or a final with error code ``overloaded`` or
``rate_limited``; other error codes are counted by code. A closed-loop client
whose job was rejected backs off before its next one
(:mod:`jaxserve.loadtest.runner`).

Kept apart from the runner, which drives the broker: the report
(:mod:`jaxserve.loadtest.report`) and the tests read records without it
(``tests/test_loadtest.py``, ``tests/test_loadtest_fallback.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: error codes of a final result that count as rejections (with the client's QueueFull)
REJECT_CODES = ("overloaded", "rate_limited")
QUEUE_FULL = "queue_full"


@dataclasses.dataclass
class JobRecord:
    index: int
    key: str
    kind: str
    queue: str
    stream: bool
    cancel_planned: bool
    t_start: float  # seconds since the level started
    status: str = "pending"  # ok | rejected | cancelled | error | timeout
    code: str | None = None  # error code (queue_full for a refused publish)
    t_end: float | None = None
    publish_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunks: int = 0
    deltas: int = 0
    itl_samples: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cancel_sent_s: float | None = None  # seconds since the level started
    retry_after_s: float | None = None  # a rejection's hint, when the worker gives one
    worker_timings: dict[str, float] | None = None
    probe: bool = False
    served_model: str | None = None
    degraded: list[str] | None = None
    cost: float | None = None
    cost_currency: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["itl_samples"] = [round(x, 6) for x in self.itl_samples]
        for k in ("t_start", "t_end", "publish_s", "ttft_s", "e2e_s", "cancel_sent_s"):
            if out[k] is not None:
                out[k] = round(out[k], 6)
        return out


def itl_samples(chunk_times: list[float], completion_tokens: int, deltas: int) -> list[float]:
    """Per-token inter-token latencies of one job (see the module docstring):
    each gap between consecutive chunk arrival times divided by the tokens a
    chunk carries on average, ``completion_tokens / deltas``."""
    if len(chunk_times) < 2 or completion_tokens <= 0 or deltas <= 0:
        return []
    per_chunk = completion_tokens / deltas
    return [(b - a) / per_chunk for a, b in zip(chunk_times, chunk_times[1:])]


def classify(rec: JobRecord, result: Any) -> None:
    """Fill a record's status, code, usage and timings from a final result."""
    rec.worker_timings = result.timings or None
    if result.ok:
        rec.status = "ok"
        served = getattr(result, "served_model", None) or getattr(result, "model", None)
        rec.served_model = served if isinstance(served, str) else None
        degraded = getattr(result, "degraded", None)
        rec.degraded = [str(d) for d in degraded] if isinstance(degraded, (list, tuple)) else None
        if result.usage is not None:
            rec.prompt_tokens = result.usage.prompt_tokens
            rec.completion_tokens = result.usage.completion_tokens
            cost = getattr(result.usage, "cost", None)  # {amount, currency}: an extra field of usage
            if isinstance(cost, dict) and isinstance(cost.get("amount"), (int, float)):
                rec.cost = float(cost["amount"])
                rec.cost_currency = str(cost.get("currency") or "") or None
        return
    code = result.error.code if result.error is not None else "unknown"
    rec.code = code
    hint = getattr(result.error, "retry_after_s", None)
    if isinstance(hint, (int, float)) and not isinstance(hint, bool):
        rec.retry_after_s = float(hint)
    if code in REJECT_CODES:
        rec.status = "rejected"
    elif code == "cancelled":
        rec.status = "cancelled"
    else:
        rec.status = "error"


def mark_rejections(levels: list[dict[str, Any]]) -> int | None:
    """Set ``rejections_begin`` on the first level with rejections (and
    False elsewhere); returns its index or None."""
    first = next((i for i, e in enumerate(levels) if e.get("rejected", 0) > 0), None)
    for i, e in enumerate(levels):
        e["rejections_begin"] = i == first
    return first
