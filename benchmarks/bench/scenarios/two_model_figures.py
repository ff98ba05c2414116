"""The table rows and the per-level table of a ``two-model`` result.

The rows (``figures``) are taken at the top rate, the one furthest past the
large worker's capacity, where fallback matters most: fallback against no
fallback for p95 TTFT and the share answered ``overloaded`` (per round, the
two runs of one round side by side), the share the small model served, and
the measured cost per million tokens against ``jaxserve plan``'s for the same
deployment (the ratio is measured / plan). ``level_table`` is every level of
every run, which BENCHMARKS.md's two-model section quotes.
"""

from __future__ import annotations

from typing import Any

from ..record import Figure, Stat

LABELS = {"no-fallback": "no fallback", "fallback": "fallback to small"}


def _per_round(records: list[dict[str, Any]], system: str, key: str) -> dict[int, float]:
    out = {}
    for r in records:
        if r["system"] == system and not r["warmup"] and r.get("ok") and r["levels"][-1].get(key) is not None:
            out[r["round"]] = float(r["levels"][-1][key])
    return out


def _pair(records: list[dict[str, Any]], what: str, key: str, unit: str, scale: float = 1.0, **kw: Any) -> Figure:
    a = {k: v * scale for k, v in _per_round(records, "fallback", key).items()}
    b = {k: v * scale for k, v in _per_round(records, "no-fallback", key).items()}
    ratios = [round(a[k] / b[k], 4) for k in sorted(a) if k in b and b[k] > 0]
    return Figure(
        what,
        Stat(LABELS["fallback"], unit, [a[k] for k in sorted(a)]),
        Stat(LABELS["no-fallback"], unit, [b[k] for k in sorted(b)]),
        ratios,
        higher_is_better=False,
        compare_swing=False,
        **kw,
    )


def _cost_figure(measured: list[float], planned: float | None, what: str, note: str) -> Figure:
    peer = Stat("jaxserve plan", "USD/Mtok", [] if planned is None else [planned])
    ratios = [round(m / planned, 4) for m in measured] if planned else []
    return Figure(
        what,
        Stat("measured", "USD/Mtok", measured),
        peer,
        ratios,
        higher_is_better=False,
        compare_swing=False,
        note=note,
    )


def figures(records: list[dict[str, Any]], state: dict[str, Any]) -> list[Figure]:
    a, rates = state["args"], state["rates"]
    top = f"{rates[-1]:g} jobs/s ({rates[-1] / state['capacity']:.1f}x the large worker's probed capacity)"
    loads = [r["load_avg_before"][0] for r in records if r.get("load_avg_before")]
    note = f"(load avg {min(loads):.1f}-{max(loads):.1f} on {state['cores']} shared cores)" if loads else ""
    figs = [
        _pair(
            records,
            f"interactive p95 TTFT at {top}, same arrivals",
            "ttft_p95_s",
            "s",
            goal=f"<= {a.ttft_target_s:g} s with fallback",
            goal_value=a.ttft_target_s,
            note=note,
        ),
        _pair(
            records,
            f"share of jobs answered overloaded at {top}",
            "overloaded_pct",
            "%",
            goal="<= 2 % with fallback",
            goal_value=2.0,
        ),
    ]
    small = a.small_name
    shares = [
        round(100.0 * (r["levels"][-1].get("served_share") or {}).get(small, 0.0), 2)
        for r in records
        if r["system"] == "fallback" and not r["warmup"] and r.get("ok")
    ]
    figs.append(
        Figure(f"share of completed jobs served by {small} ({a.small}) at {top}", Stat("fallback run", "%", shares))
    )
    fb = [r for r in records if r["system"] == "fallback" and not r["warmup"] and r.get("ok")]
    measured = [r["levels"][-1]["cost_per_million_tokens"] for r in fb if r["levels"][-1]["cost_per_million_tokens"]]
    hw = [
        r["levels"][-1]["hardware_cost_per_million_tokens"]
        for r in fb
        if r["levels"][-1]["hardware_cost_per_million_tokens"]
    ]
    plans = state.get("plans", {})
    lg, sm = state["specs"]
    source = sorted({r["levels"][-1]["cost_source"] for r in fb}) or ["no run"]
    tok_plan = (plans.get("tokens") or {}).get("with_fallback", {}).get("cost_per_million_tokens")
    hw_plan = (plans.get("hardware") or {}).get("with_fallback", {}).get("cost_per_million_tokens")
    figs.append(
        _cost_figure(
            measured,
            tok_plan,
            f"cost per million tokens at {top}, fallback run: token prices (large {lg.prompt_per_million:g}/"
            f"{lg.completion_per_million:g}, small {sm.prompt_per_million:g}/{sm.completion_per_million:g} USD "
            "per million prompt/completion tokens)",
            f"(measured: {', '.join(source)}; plan: 1 large worker kept, small takes the overflow)",
        )
    )
    figs.append(
        _cost_figure(
            hw,
            hw_plan,
            f"cost per million tokens at {top}, fallback run: hardware prices (large {lg.hardware_per_hour:g}, "
            f"small {sm.hardware_per_hour:g} USD/hour per worker)",
            "(measured: both workers' hours over the level / tokens served; plan: whole workers at 30 % headroom)",
        )
    )
    return figs


def _g(x: Any, d: int = 3) -> str:
    return "–" if x is None else f"{x:.{d}g}"


def level_table(records: list[dict[str, Any]], large: str, small: str) -> str:
    """Every level of every run as markdown: BENCHMARKS.md's section quotes it."""
    rows = [
        (
            "| run | rate jobs/s | sent | completed | overloaded | p95 TTFT s (large; small) | served by small "
            "| cost USD/Mtok (tokens; hardware) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if not r.get("levels"):
            continue
        for e in r["levels"]:
            share = (e.get("served_share") or {}).get(small, 0.0) * 100
            per = e.get("ttft_p95_s_by_model") or {}
            by_model = "; ".join(_g(per.get(m)) for m in (large, small))
            rows.append(
                f"| {LABELS[r['system']]} | {e['rate']:g} | {e['requests']} | {e['completed']} | "
                f"{e['rejections_by_code'].get('overloaded', 0)} ({_g(e['overloaded_pct'], 2)} %) | {_g(e['ttft_p95_s'])} ({by_model}) | "
                f"{share:.1f} % | {_g(e['cost_per_million_tokens'])}; {_g(e['hardware_cost_per_million_tokens'])} |"
            )
    return "\n".join(rows)
