"""A finished engine request as the job's :class:`Result`: one function,
:func:`build_result`, so every field a result carries (text or labels,
usage, timings, logprobs, parsed JSON) is decided in one place and a new
one (a cost, say) is added here only.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.cost.jobs import with_cost
from jaxserve.cost.prices import PriceTable
from jaxserve.engine import scoring
from jaxserve.engine.types import RequestOutput
from jaxserve.wire import Result, outputs
from jaxserve.worker.config import published_at
from jaxserve.worker.lifecycle import KeyJob


class ResultContext:
    """What results need from the worker: the served model name, the
    tokenizer (token bytes for logprobs, built on first use) and the prices
    (``usage.cost``; None: results carry no cost)."""

    def __init__(self, model: str | None, tokenizer: Any, prices: PriceTable | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prices = prices
        self._token_bytes: Any = None

    def token_bytes(self) -> Any:
        if self._token_bytes is None:
            self._token_bytes = outputs.token_bytes_for(self.tokenizer)
        return self._token_bytes


def timings(kj: KeyJob) -> dict[str, float]:
    """The result's ``timings``: total, admission, first token and broker wait."""
    now = time.monotonic()
    t: dict[str, float] = {"total_s": round(now - kj.received_mono, 6)}
    if kj.admitted_mono is not None:
        t["admit_s"] = round(kj.admitted_mono - kj.received_mono, 6)
    if kj.first_token_mono is not None:
        t["ttft_s"] = round(kj.first_token_mono - kj.received_mono, 6)
    ts = published_at(kj.primary.message)
    if ts is not None:
        t["queue_s"] = round(max(0.0, kj.received_at - ts), 6)
    return t


def build_result(kj: KeyJob, out: RequestOutput, ctx: ResultContext) -> Result:
    """The job's result from its final engine output, an ok one with
    ``usage.cost`` from its own tokens at the price of the model that
    served it (``served_model``, else the worker's; ``tests/test_queue_cost.py``)."""
    return with_cost(_build(kj, out, ctx), ctx.prices, ctx.model)


def _build(kj: KeyJob, out: RequestOutput, ctx: ResultContext) -> Result:
    if out.error is not None:
        return Result.failure(kj.key, out.error.code, out.error.message, out.error.retryable)
    reason = out.finish_reason
    if out.label_logprobs is not None and kj.job.labels is not None and kj.label_ids is not None:
        cal, norm = kj.label_calibration, kj.job.label_normalization
        offsets = None if cal is None else scoring.normalize(cal.logprobs, cal.token_counts, norm)
        scored = scoring.combine(kj.job.labels, out.label_logprobs, [len(ids) for ids in kj.label_ids], norm, offsets)
        labels = [{"label": s.label, "logprob": s.logprob, "prob": s.prob} for s in scored]
        return Result.success(
            kj.key,
            scoring.best(scored).label,
            "stop",
            out.prompt_tokens,
            0,
            timings(kj),
            labels=labels,
            model=ctx.model,
            served_model=ctx.model,
            degraded=kj.degraded,
        )
    if reason in ("stop", "length"):
        text = out.text if (out.text or not kj.text_parts) else "".join(kj.text_parts)
        return Result.success(
            kj.key,
            text,
            reason,
            out.prompt_tokens,
            out.completion_tokens,
            timings(kj),
            model=ctx.model,
            served_model=ctx.model,
            degraded=kj.degraded,
            **_extras(kj, out, text, ctx),
        )
    if reason == "abort":
        return Result.failure(kj.key, "cancelled", "the job was aborted")
    return Result.failure(kj.key, "internal", f"the engine failed the request (finish_reason={reason!r})", True)


def _extras(kj: KeyJob, out: RequestOutput, text: str, ctx: ResultContext) -> dict[str, Any]:
    """A result's logprobs (OpenAI's chat shape) and parsed JSON
    (``jaxserve.wire.outputs``), for the jobs that asked."""
    params, extras = kj.job.params, {}
    if params.logprobs and out.logprobs is not None:
        extras["logprobs"] = outputs.chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs, ctx.token_bytes())
    kind = None if params.structured is None else params.structured.kind
    parsed = outputs.parsed_json(kind, text, out.finish_reason)
    if parsed is not None:
        extras["parsed"] = parsed
    return extras
