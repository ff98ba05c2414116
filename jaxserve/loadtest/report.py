"""Per-level figures, the markdown table and the plot of a load test.

Percentiles are numpy's (``numpy.percentile``, linear interpolation) over:

- TTFT: completed streaming jobs;
- ITL: every per-token sample of completed streaming jobs, pooled
  (:func:`jaxserve.loadtest.runner.itl_samples` says how a sample is made);
- end-to-end latency and output tokens: completed jobs.

Cancelled, rejected, failed and timed-out jobs are counted, not timed.
Completed jobs are also counted by the model that served them
(``served_by_model``, ``served_share``) and, when the worker asked a
fallback model, as ``served_by_fallback`` / ``fallback_share`` (the result's
``degraded`` holds ``model``); their ``usage.cost`` adds up to ``cost_total``.
Throughput figures divide by the level's window: its duration, or longer
when its last jobs ended after it (``elapsed_s``).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.loadtest.records import QUEUE_FULL, REJECT_CODES, JobRecord

PERCENTILES = (50, 90, 95, 99)


def percentiles(
    values: Iterable[float | None], name: str, unit: str = "_s", digits: int = 6
) -> dict[str, float | None]:
    """``{name_p50_s: ..., name_p90_s: ..., ...}``; None when there are no values."""
    xs = np.asarray([v for v in values if v is not None], dtype=float)
    if xs.size == 0:
        return {f"{name}_p{p}{unit}": None for p in PERCENTILES}
    qs = np.percentile(xs, PERCENTILES)
    return {f"{name}_p{p}{unit}": round(float(q), digits) for p, q in zip(PERCENTILES, qs)}


def _mean(values: Sequence[float]) -> float | None:
    return round(float(np.mean(values)), 3) if values else None


def _p95(values: Sequence[float]) -> float | None:
    return round(float(np.percentile(values, 95)), 3) if values else None


def summarize_level(
    records: list[JobRecord],
    *,
    mode: str,
    level: dict[str, Any],
    duration_s: float,
    elapsed_s: float,
    capacity: dict[str, Any] | None = None,
    client_dropped: int = 0,
) -> dict[str, Any]:
    """One entry of ``loadtest.json``."""
    ok = [r for r in records if r.status == "ok"]
    streamed_ok = [r for r in ok if r.stream]
    rejections: collections.Counter[str | None] = collections.Counter({QUEUE_FULL: 0, **dict.fromkeys(REJECT_CODES, 0)})
    errors: collections.Counter = collections.Counter()
    for r in records:
        if r.status == "rejected":
            rejections[r.code] += 1
        elif r.status in ("error", "timeout"):
            errors[r.code or r.status] += 1
    planned = [r for r in records if r.cancel_planned]
    sent = [r for r in planned if r.cancel_sent_s is not None]
    first_cancel = min((r.cancel_sent_s for r in sent if r.cancel_sent_s is not None), default=None)
    tokens = [r.completion_tokens for r in ok if r.completion_tokens is not None]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    total_tokens = int(sum(tokens))
    window = max(float(elapsed_s), 1e-9)
    entry: dict[str, Any] = {
        "mode": mode,
        **level,
        "duration_s": duration_s,
        "elapsed_s": round(window, 3),
        "requests": len(records),
        "completed": len(ok),
        "rejected": int(sum(rejections.values())),
        "rejections_by_code": dict(rejections),
        "errors": int(sum(errors.values())),
        "errors_by_code": dict(errors),
        "client_dropped": client_dropped,
        "cancellations": {
            "planned": len(planned),
            "sent": len(sent),
            "cancelled": sum(r.status == "cancelled" for r in records),
            "finished_before_cancel": sum(r.status == "ok" for r in sent),
            "no_chunk_before_end": len(planned) - len(sent),
            # jobs started after the level's first cancel that completed:
            # the cancelled jobs' capacity was given back
            "completed_after_first_cancel": (
                sum(1 for r in ok if r.t_start > first_cancel) if first_cancel is not None else None
            ),
        },
        **percentiles((r.ttft_s for r in streamed_ok), "ttft"),
        **percentiles((x for r in streamed_ok for x in r.itl_samples), "itl"),
        **percentiles((r.e2e_s for r in ok), "e2e"),
        **percentiles(tokens, "output_tokens", unit="", digits=2),
        "output_tokens_total": total_tokens,
        "output_tokens_per_s": round(total_tokens / window, 3),
        "requests_per_s": round(len(ok) / window, 3),
        "prompt_tokens_mean": _mean(prompts),
        "prompt_tokens_p95": _p95(prompts),
        "output_tokens_mean": _mean(tokens),
        "output_tokens_p95": _p95(tokens),
        "itl_samples": sum(len(r.itl_samples) for r in streamed_ok),
        "itl_method": "chunk gap / (completion_tokens / text deltas), one sample per gap, pooled",
    }
    timings = collections.defaultdict(list)
    for r in ok:
        for k, v in (r.worker_timings or {}).items():
            timings[k].append(v)
    hints = [r.retry_after_s for r in records if r.status == "rejected" and r.retry_after_s is not None]
    entry["retry_after_p50_s"] = round(float(np.median(hints)), 6) if hints else None
    entry["worker_timings_p50_s"] = {k: round(float(np.median(v)), 6) for k, v in sorted(timings.items())}
    by_kind: dict[str, Any] = {}
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in records if r.kind == kind]
        ks = [r for r in rs if r.status == "ok"]
        kt = [r.completion_tokens for r in ks if r.completion_tokens is not None]
        kp = [r.prompt_tokens for r in ks if r.prompt_tokens is not None]
        by_kind[kind] = {
            "queue": rs[0].queue,
            "stream": rs[0].stream,
            "requests": len(rs),
            "completed": len(ks),
            "rejected": sum(r.status == "rejected" for r in rs),
            "cancelled": sum(r.status == "cancelled" for r in rs),
            **{
                k: v
                for k, v in percentiles((r.ttft_s for r in ks if r.stream), "ttft").items()
                if k in ("ttft_p50_s", "ttft_p95_s")
            },
            **{k: v for k, v in percentiles((r.e2e_s for r in ks), "e2e").items() if k in ("e2e_p50_s", "e2e_p95_s")},
            "output_tokens_min": min(kt) if kt else None,
            "output_tokens_max": max(kt) if kt else None,
            "output_tokens_mean": _mean(kt),
            "prompt_tokens_mean": _mean(kp),
            "output_tokens_per_s": round(sum(kt) / window, 3),
        }
    entry["by_kind"] = by_kind
    entry.update(served_summary(ok))
    if capacity is not None:
        entry["capacity"] = capacity
        entry["capacity_back"] = capacity["capacity_back"]
    return entry


def served_summary(ok: list[JobRecord]) -> dict[str, Any]:
    """Who served the completed jobs, and what they cost."""
    by_model = collections.Counter(r.served_model or "unknown" for r in ok)
    fallback = sum(1 for r in ok if r.degraded and "model" in r.degraded)
    costs = [r.cost for r in ok if r.cost is not None]
    currencies = sorted({r.cost_currency for r in ok if r.cost_currency})
    n = max(len(ok), 1)
    return {
        "served_by_model": dict(sorted(by_model.items())),
        "served_share": {m: round(c / n, 6) for m, c in sorted(by_model.items())},
        "served_by_fallback": fallback,
        "fallback_share": round(fallback / n, 6) if ok else None,
        "degraded_jobs": sum(1 for r in ok if r.degraded),
        "cost_total": round(float(sum(costs)), 12) if costs else None,
        "cost_currency": currencies[0] if len(currencies) == 1 else (currencies or None),
    }


def level_value(entry: dict[str, Any]) -> float:
    return float(entry["concurrency"] if "concurrency" in entry else entry["rate"])


def plot_runs(
    runs: Sequence[tuple[str, list[dict[str, Any]]]],
    path: str | Path,
    *,
    title: str = "jaxserve load test",
    ttft_target_s: float | None = None,
) -> Path:
    """Runs side by side (a deployment with fallbacks allowed and one
    without, say), against the offered level: p95 TTFT of streaming jobs
    (with the target, if given), ``overloaded`` answers, and the share of
    completed jobs a fallback model served."""
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(13.5, 4.4), layout="constrained")
    ax_ttft, ax_over, ax_share = fig.subplots(1, 3)
    xlabel = "level (concurrency)" if runs and runs[0][1] and "concurrency" in runs[0][1][0] else "level (jobs/s)"
    for (label, levels), style in zip(runs, ("o-", "s--", "^-.", "d:")):
        x = [level_value(e) for e in levels]
        ttft = [(xi, e["ttft_p95_s"]) for xi, e in zip(x, levels) if e.get("ttft_p95_s") is not None]
        if ttft:
            ax_ttft.plot([p[0] for p in ttft], [p[1] for p in ttft], style, label=label)
        over = [e.get("rejections_by_code", {}).get("overloaded", 0) for e in levels]
        ax_over.plot(x, over, style, label=label)
        share = [(xi, e["fallback_share"]) for xi, e in zip(x, levels) if e.get("fallback_share") is not None]
        ax_share.plot([p[0] for p in share], [100 * p[1] for p in share], style, label=label)
    if ttft_target_s is not None:
        ax_ttft.axhline(
            ttft_target_s, color="tab:red", linestyle="--", linewidth=1, label=f"target {ttft_target_s:g} s"
        )
    for ax, ylabel, name in (
        (ax_ttft, "p95 TTFT (s)", "time to first token"),
        (ax_over, "jobs answered overloaded", "overloaded"),
        (ax_share, "% of completed jobs", "served by a fallback model"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def level_label(entry: dict[str, Any]) -> str:
    return f"c={entry['concurrency']}" if "concurrency" in entry else f"{entry['rate']:g}/s"


def _fmt(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown_table(levels: list[dict[str, Any]]) -> str:
    """The levels as a markdown table (latencies in ms)."""
    head = (
        "| level | requests | ok | rejected | cancelled | TTFT p50 / p95 ms | ITL p50 / p95 ms | e2e p50 / p95 ms "
        "| output tok/s | jobs/s | capacity back |"
    )
    rows = [head, "|" + "---|" * 11]
    for e in levels:
        mark = " (rejections begin)" if e.get("rejections_begin") else ""
        rows.append(
            f"| {level_label(e)}{mark} | {e['requests']} | {e['completed']} | {e['rejected']} | "
            f"{e['cancellations']['cancelled']}/{e['cancellations']['sent']} | "
            f"{_fmt(e['ttft_p50_s'], 1e3)} / {_fmt(e['ttft_p95_s'], 1e3)} | "
            f"{_fmt(e['itl_p50_s'], 1e3, 2)} / {_fmt(e['itl_p95_s'], 1e3, 2)} | "
            f"{_fmt(e['e2e_p50_s'], 1e3)} / {_fmt(e['e2e_p95_s'], 1e3)} | "
            f"{e['output_tokens_per_s']:.1f} | {e['requests_per_s']:.2f} | "
            f"{'-' if e.get('capacity_back') is None else ('yes' if e['capacity_back'] else 'NO')} |"
        )
    return "\n".join(rows)


def served_table(levels: list[dict[str, Any]]) -> str | None:
    """Who served each level and what it cost, as a markdown table; None
    when there is nothing to say (one model, no cost)."""
    models = sorted({m for e in levels for m in e.get("served_by_model", {})})
    if len(models) < 2 and not any(e.get("cost_total") is not None for e in levels):
        return None
    rows = ["| level | " + " | ".join(f"served by {m}" for m in models) + " | fallback share | cost |"]
    rows.append("|" + "---|" * (len(models) + 3))
    for e in levels:
        served = " | ".join(str(e.get("served_by_model", {}).get(m, 0)) for m in models)
        share = e.get("fallback_share")
        cost = e.get("cost_total")
        currency = e.get("cost_currency") if isinstance(e.get("cost_currency"), str) else ""
        rows.append(
            f"| {level_label(e)} | {served} | {'-' if share is None else f'{share * 100:.1f} %'} | "
            f"{'-' if cost is None else f'{cost:.6g} {currency}'.strip()} |"
        )
    return "\n".join(rows)


def plot(levels: list[dict[str, Any]], path: str | Path, title: str = "jaxserve load test") -> Path:
    """p95 TTFT and p95 end-to-end latency against output tokens/s, one
    point per level, the level where rejections begin marked."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    path = Path(path)
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    x = [e["output_tokens_per_s"] for e in levels]
    series = (("ttft_p95_s", "TTFT p95 (streaming jobs)", "o-"), ("e2e_p95_s", "end-to-end p95 (all jobs)", "s-"))
    ys_all: list[float] = []
    for key, label, style in series:
        pts = [(xi, e[key], level_label(e)) for xi, e in zip(x, levels) if e.get(key) is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        for px, py, text in pts:
            ax.annotate(text, (px, py), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ys_all += [p[1] for p in pts]
    first = next((i for i, e in enumerate(levels) if e.get("rejections_begin")), None)
    if first is not None:
        e = levels[first]
        ax.axvline(
            x[first],
            color="tab:red",
            linestyle="--",
            linewidth=1,
            label=f"rejections begin ({level_label(e)}: {e['rejected']} rejected)",
        )
        for key, _, _ in series:
            if e.get(key) is not None:
                ax.plot([x[first]], [e[key]], "o", markersize=13, markerfacecolor="none", markeredgecolor="tab:red")
    positive = [y for y in ys_all if y > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.set_xlabel("output tokens/s (completed jobs)")
    ax.set_ylabel("p95 latency (s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_outputs(
    levels: list[dict[str, Any]], jobs: list[dict[str, Any]], out_dir: str | Path, *, title: str, with_plot: bool = True
) -> dict[str, Path]:
    """``loadtest.json`` (the levels), ``loadtest-jobs.jsonl`` (every job)
    and ``loadtest.png`` (unless ``with_plot`` is false) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "loadtest.json", "jobs": out / "loadtest-jobs.jsonl", "png": out / "loadtest.png"}
    paths["json"].write_text(json.dumps(levels, indent=2) + "\n")
    with open(paths["jobs"], "w") as f:
        for j in jobs:
            f.write(json.dumps(j) + "\n")
    if with_plot:
        plot(levels, paths["png"], title=title)
    else:
        del paths["png"]
    return paths
