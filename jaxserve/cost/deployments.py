"""What a planned deployment costs, and two plans for one workload compared.

**Cost of a plan** (:func:`plan_cost`). The workload's tokens per day are
``rps x 86400 x Lp`` prompt and ``rps x 86400 x Lo`` completion tokens
(means). The cost per day depends on what the price is:

- a *hardware* price (``hardware_per_hour`` per worker, in the prices file
  or ``--hardware-per-hour``): the deployment is paid whether busy or
  not, so ``per_day = workers x hardware_per_hour x 24``;
- a *token* price (per million prompt and completion tokens): ``per_day =
  (prompt tokens x prompt price + completion tokens x completion price) /
  1e6``; the number of workers does not change it.

Either way ``per_million_tokens = per_day / (prompt + completion tokens per
day) x 1e6``: what a million of the workload's tokens cost on this plan,
headroom and rounding up to whole workers included.

**A big model with a small fallback** (:func:`compare_fallback`). The same
workload is planned twice: on the primary (big) profile alone, and split
between the primary and a fallback (small) profile that takes the overflow.
The primary keeps ``primary_workers`` workers (default: half of what it
needs alone, at least one) and serves what they carry at the planned
headroom: ``min(rps, primary_workers x capacity per worker at U)`` jobs/s,
and ``min(burst, primary_workers x k)`` of a burst (k: burst prompts per
worker that meet the TTFT target); the fallback is planned for the rest.
``fallback_share`` instead fixes the share of jobs (and of the burst) the
fallback serves. Each part is then planned as usual (``make_plan``), so a
part can still need more workers than it was given (its TTFT or KV budget
binds). ``tests/test_plan_cost.py`` checks the split and the costs by hand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.cost.prices import PER, ModelPrice
from jaxserve.planning.planner import Plan, PlanOptions, make_plan
from jaxserve.planning.profile import Profile
from jaxserve.planning.workload import PlanWorkload

DAY_S = 86400.0


def _g(x: float) -> str:
    return f"{x:.6g}"


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """The money side of one plan."""

    model: str
    currency: str
    basis: str  # hardware | tokens
    workers: int
    rps: float
    prompt_tokens_per_day: float
    completion_tokens_per_day: float
    per_day: float
    per_million_tokens: float
    hardware_per_hour: float | None
    price: dict[str, Any]
    lines: list[str]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("lines")
        return out


def hardware_per_hour(price: ModelPrice) -> float | None:
    """The per-worker price per hour a price was derived from, if it was."""
    value = price.derived_from.get("hardware_per_hour") if price.basis == "hardware" else None
    return None if value is None else float(value)


def plan_cost(plan: Plan, price: ModelPrice, currency: str) -> PlanCost:
    """What ``plan`` costs per day and per million tokens (module docstring)."""
    w = plan.workload
    prompt_day = w.rps * DAY_S * w.prompt_tokens.mean
    completion_day = w.rps * DAY_S * w.output_tokens.mean
    tokens_day = prompt_day + completion_day
    hph = hardware_per_hour(price)
    lines = [
        (
            f"tokens:   lam x 86400 x Lp = {_g(w.rps)} x 86400 x {_g(w.prompt_tokens.mean)} = {_g(prompt_day)} prompt, "
            f"x Lo = {_g(completion_day)} completion tokens/day"
        )
    ]
    if hph is not None:
        per_day = plan.workers * hph * 24.0
        lines.append(
            f"cost:     {plan.workers} workers x {_g(hph)} {currency}/hour x 24 = {_g(per_day)} {currency}/day "
            f"(hardware price; at full use it is {_g(price.prompt_per_million)} / {_g(price.completion_per_million)} "
            f"{currency} per million prompt / completion tokens)"
        )
    else:
        per_day = (prompt_day * price.prompt_per_million + completion_day * price.completion_per_million) / PER
        lines.append(
            f"cost:     ({_g(prompt_day)} x {_g(price.prompt_per_million)} + {_g(completion_day)} x "
            f"{_g(price.completion_per_million)}) / 1e6 = {_g(per_day)} {currency}/day (token prices)"
        )
    per_million = per_day / tokens_day * PER
    lines.append(
        f"          {_g(per_day)} / {_g(tokens_day)} tokens x 1e6 = {_g(per_million)} {currency} per million tokens"
    )
    return PlanCost(
        model=plan.profile.model,
        currency=currency,
        basis="hardware" if hph is not None else "tokens",
        workers=plan.workers,
        rps=w.rps,
        prompt_tokens_per_day=prompt_day,
        completion_tokens_per_day=completion_day,
        per_day=per_day,
        per_million_tokens=per_million,
        hardware_per_hour=hph,
        price=price.describe(),
        lines=lines,
    )


@dataclasses.dataclass
class Part:
    """One model's share of a deployment: its plan and, priced, its cost."""

    role: str  # primary | fallback
    plan: Plan
    cost: PlanCost | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "model": self.plan.profile.model,
            "rps": self.plan.workload.rps,
            "burst": self.plan.workload.burst,
            "workers": self.plan.workers,
            "binding": self.plan.binding,
            "worker_flags": self.plan.worker_flags,
            "cost": None if self.cost is None else self.cost.to_dict(),
        }


@dataclasses.dataclass
class Deployment:
    """A plan of one or two models for the whole workload."""

    name: str
    parts: list[Part]
    workload: PlanWorkload

    @property
    def workers(self) -> int:
        return sum(p.plan.workers for p in self.parts)

    @property
    def share(self) -> dict[str, float]:
        """The share of jobs each model serves."""
        return {p.plan.profile.model: p.plan.workload.rps / self.workload.rps for p in self.parts}

    @property
    def per_day(self) -> float | None:
        costs = [p.cost for p in self.parts]
        return None if any(c is None for c in costs) else sum(c.per_day for c in costs if c is not None)

    @property
    def per_million_tokens(self) -> float | None:
        day = self.per_day
        if day is None:
            return None
        w = self.workload
        return day / (w.rps * DAY_S * (w.prompt_tokens.mean + w.output_tokens.mean)) * PER

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "workers": self.workers,
            "share": self.share,
            "cost_per_day": self.per_day,
            "cost_per_million_tokens": self.per_million_tokens,
            "parts": [p.to_dict() for p in self.parts],
        }


@dataclasses.dataclass
class Comparison:
    alone: Deployment
    with_fallback: Deployment
    currency: str | None
    lines: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "currency": self.currency,
            "plans": [self.alone.to_dict(), self.with_fallback.to_dict()],
            "lines": self.lines,
        }

    def text(self) -> str:
        cur = self.currency or ""
        rows = [
            "| plan | workers | share served | cost/day | per million tokens |",
            "|---|---|---|---|---|",
        ]
        for d in (self.alone, self.with_fallback):
            share = ", ".join(f"{m} {s * 100:.0f} %" for m, s in d.share.items())
            workers = " + ".join(f"{p.plan.workers} {p.plan.profile.model}" for p in d.parts)
            day, per_m = d.per_day, d.per_million_tokens
            rows.append(
                f"| {d.name} | {workers} | {share} | {'-' if day is None else f'{day:.2f} {cur}'} | "
                f"{'-' if per_m is None else f'{per_m:.4g} {cur}'} |"
            )
        return "\n".join([*self.lines, "", *rows])


def _priced(role: str, plan: Plan, price: ModelPrice | None, currency: str | None) -> Part:
    return Part(role, plan, None if price is None or currency is None else plan_cost(plan, price, currency))


def compare_fallback(
    workload: PlanWorkload,
    primary: Profile,
    fallback: Profile,
    options: PlanOptions | None = None,
    *,
    primary_workers: int | None = None,
    fallback_share: float | None = None,
    primary_price: ModelPrice | None = None,
    fallback_price: ModelPrice | None = None,
    currency: str | None = None,
) -> Comparison:
    """The primary alone vs the primary with ``fallback`` taking the
    overflow (module docstring). Raises ``PlanInfeasible`` as ``make_plan``."""
    if primary_workers is not None and fallback_share is not None:
        raise ValueError("give primary_workers or fallback_share, not both")
    if fallback_share is not None and not 0.0 <= fallback_share <= 1.0:
        raise ValueError(f"fallback_share must be in [0, 1], got {fallback_share!r}")
    if primary_workers is not None and primary_workers < 1:
        raise ValueError(f"primary_workers must be >= 1, got {primary_workers!r}")
    lam, burst = workload.rps, workload.burst
    lines: list[str] = []
    say = lines.append
    alone_plan = make_plan(workload, primary, options)
    alone = Deployment(f"{primary.model} alone", [_priced("primary", alone_plan, primary_price, currency)], workload)
    say(f"alone:    {primary.model} needs {alone_plan.workers} workers (binding: {alone_plan.binding})")

    if fallback_share is None:
        n = primary_workers if primary_workers is not None else max(1, alone_plan.workers // 2)
        cap = float(alone_plan.derived["capacity_jobs_per_s_per_worker_at_headroom"])
        k = alone_plan.derived["ttft_burst_prompts_per_worker"]
        rps_p = min(lam, n * cap)
        burst_p = burst if k is None else min(burst, n * int(k))
        say(
            f"split:    {primary.model} keeps {n} workers"
            + (" (half of alone)" if primary_workers is None else "")
            + f": min(lam, {n} x {_g(cap)} jobs/s at U) = {_g(rps_p)} jobs/s"
            + ("" if k is None else f", min(burst, {n} x k = {n * int(k)}) = {burst_p} of the burst")
        )
    else:
        rps_p = lam * (1.0 - fallback_share)
        burst_p = math.floor(burst * (1.0 - fallback_share) + 1e-9)
        say(f"split:    the fallback serves {_g(fallback_share)} of the jobs: {primary.model} {_g(rps_p)} jobs/s")
    rps_f = max(0.0, lam - rps_p)
    parts: list[Part] = []
    if rps_p > 1e-12:
        p_plan = make_plan(dataclasses.replace(workload, rps=rps_p, burst=max(1, burst_p)), primary, options)
        parts.append(_priced("primary", p_plan, primary_price, currency))
    if rps_f > 1e-12 * lam:
        f_burst = max(1, burst - burst_p)
        f_plan = make_plan(dataclasses.replace(workload, rps=rps_f, burst=f_burst), fallback, options)
        parts.append(_priced("fallback", f_plan, fallback_price, currency))
        say(
            f"          {fallback.model} takes the overflow: {_g(rps_f)} jobs/s, burst {f_burst}: "
            f"{f_plan.workers} workers (binding: {f_plan.binding})"
        )
    else:
        say(f"          {primary.model}'s workers carry the whole workload: no overflow for {fallback.model}")
    with_fallback = Deployment(f"{primary.model} + {fallback.model} fallback", parts, workload)
    for d in (alone, with_fallback):
        for part in d.parts:
            if part.cost is not None:  # its per-day line; the table has the rest
                per_day = part.cost.lines[1].removeprefix("cost:").strip()
                say(f"cost:     {d.name}, {part.plan.profile.model}: {per_day}")
    return Comparison(alone, with_fallback, currency, lines)
