"""``jaxserve plan``'s cost figures and its comparison of a big model alone
with a big model plus a small fallback, checked against hand arithmetic.

Profiles (synthetic, KV memory 1 GiB per worker so compute binds):

    big    P = 12800 prompt tokens/s (512-token chunks), D(b_sat = 32) = 1280
    small  P = 51200, D(32) = 5120

Workload: 20 jobs/s, prompts mean 128 (p95 256), outputs mean 100 (p95
200), burst 8, TTFT target 2 s, headroom 0.2 (U = 0.8).

    big:   s = 128 / 12800 + 100 / 1280 = 0.088125 worker-s per job;
           workers >= 20 x 0.088125 / 0.8 = 2.2 -> 3; one worker carries
           0.8 / 0.088125 = 9.07801 jobs/s at U
    small: s = 128 / 51200 + 100 / 5120 = 0.02203125
    tokens per day: 20 x 86400 x 128 = 221184000 prompt, x 100 = 172800000
           completion; 393984000 in all
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jaxserve.cli.main import cli
from jaxserve.cost.deployments import compare_fallback, plan_cost
from jaxserve.cost.prices import ModelPrice
from jaxserve.planning import PlanOptions, PlanWorkload, Profile, TokenDist, make_plan

GIB = 2**30
TOKENS_PER_DAY = 393_984_000
OPTS = PlanOptions(kv_memory_bytes=GIB)


def big_profile() -> Profile:
    return Profile(
        model="big",
        prefill={256: 10000.0, 512: 12800.0},
        decode={1: 100.0, 8: 640.0, 32: 1280.0},
        kv_bytes_per_token=1024,
        block_size=16,
        weight_bytes=2**26,
        device_memory_bytes=GIB,
        max_model_len=4096,
    )


def small_profile() -> Profile:
    return Profile(
        model="small",
        prefill={512: 51200.0},
        decode={1: 400.0, 32: 5120.0},
        kv_bytes_per_token=256,
        block_size=16,
        weight_bytes=2**24,
        device_memory_bytes=GIB,
        max_model_len=4096,
    )


def workload(**kw) -> PlanWorkload:
    fields = dict(
        rps=20.0,
        prompt_tokens=TokenDist(128, 256),
        output_tokens=TokenDist(100, 200),
        burst=8,
        ttft_target_s=2.0,
        headroom=0.2,
    )
    fields.update(kw)
    return PlanWorkload(**fields)


def test_hardware_priced_plan_costs_its_workers_by_the_hour():
    plan = make_plan(workload(), big_profile(), OPTS)
    assert plan.workers == 3
    cost = plan_cost(plan, ModelPrice.from_profile(4.0, big_profile()), "USD")
    assert cost.basis == "hardware" and cost.hardware_per_hour == 4.0
    assert cost.per_day == pytest.approx(3 * 4.0 * 24)  # 288
    assert cost.per_million_tokens == pytest.approx(288 / TOKENS_PER_DAY * 1e6)
    assert (cost.prompt_tokens_per_day, cost.completion_tokens_per_day) == (221_184_000, 172_800_000)


def test_token_priced_plan_costs_its_tokens():
    plan = make_plan(workload(), big_profile(), OPTS)
    cost = plan_cost(plan, ModelPrice(0.5, 1.5), "EUR")
    # 221184000 x 0.5 / 1e6 + 172800000 x 1.5 / 1e6
    assert cost.per_day == pytest.approx(110.592 + 259.2)
    assert cost.per_million_tokens == pytest.approx(369.792 / 393.984)
    assert cost.basis == "tokens" and cost.currency == "EUR"


def test_small_fallback_takes_the_overflow_of_half_the_big_workers():
    c = compare_fallback(
        workload(),
        big_profile(),
        small_profile(),
        OPTS,
        primary_price=ModelPrice.from_profile(4.0, big_profile()),
        fallback_price=ModelPrice.from_profile(1.0, small_profile()),
        currency="USD",
    )
    assert c.alone.workers == 3 and c.alone.per_day == pytest.approx(288.0)
    big, small = c.with_fallback.parts
    # half of 3 workers = 1 keeps 0.8 / 0.088125 jobs/s; the small model serves the rest
    cap = 0.8 / 0.088125
    assert big.plan.workload.rps == pytest.approx(cap) and big.plan.workers == 1
    assert small.plan.workload.rps == pytest.approx(20 - cap)
    # 10.92 x 0.02203125 / 0.8 = 0.30: one small worker
    assert small.plan.workers == 1
    assert c.with_fallback.share["small"] == pytest.approx((20 - cap) / 20)
    assert c.with_fallback.per_day == pytest.approx(4.0 * 24 + 1.0 * 24)
    assert c.with_fallback.per_million_tokens == pytest.approx(120 / TOKENS_PER_DAY * 1e6)
    assert "| big + small fallback | 1 big + 1 small | big 45 %, small 55 % | 120.00 USD |" in c.text()


def test_fallback_share_and_no_overflow():
    c = compare_fallback(workload(), big_profile(), small_profile(), OPTS, fallback_share=0.25)
    big, small = c.with_fallback.parts
    assert (big.plan.workload.rps, small.plan.workload.rps) == (pytest.approx(15.0), pytest.approx(5.0))
    assert (big.plan.workload.burst, small.plan.workload.burst) == (6, 2)
    assert c.currency is None and c.with_fallback.per_day is None  # no prices: no cost
    # three big workers carry all 20 jobs/s: nothing overflows
    c = compare_fallback(workload(), big_profile(), small_profile(), OPTS, primary_workers=3)
    assert [p.role for p in c.with_fallback.parts] == ["primary"]
    assert c.with_fallback.share == {"big": 1.0}
    with pytest.raises(ValueError, match="not both"):
        compare_fallback(workload(), big_profile(), small_profile(), OPTS, primary_workers=1, fallback_share=0.5)


def _files(tmp_path):
    big_profile().save(tmp_path / "big.json")
    small_profile().save(tmp_path / "small.json")
    prices = tmp_path / "prices.yaml"
    prices.write_text(
        "currency: EUR\nmodels:\n  big: {hardware_per_hour: 4.0, profile: big.json}\n"
        "  small: {prompt_per_million: 0.01, completion_per_million: 0.02}\n"
    )
    return str(tmp_path / "big.json"), str(tmp_path / "small.json"), str(prices)


FLAGS = [
    "--rps",
    "20",
    "--prompt-tokens",
    "mean:128,p95:256",
    "--output-tokens",
    "mean:100,p95:200",
    "--burst",
    "8",
    "--ttft-target-s",
    "2",
    "--headroom",
    "0.2",
    "--kv-memory",
    "1GiB",
]


def test_cli_plan_reports_cost_per_day_and_per_million_tokens(tmp_path):
    big, _, prices = _files(tmp_path)
    res = CliRunner().invoke(cli, ["plan", "--profile", big, *FLAGS, "--prices", prices, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["workers"] == 3
    assert out["cost"]["per_day"] == pytest.approx(288.0) and out["cost"]["currency"] == "EUR"
    assert out["cost"]["per_million_tokens"] == pytest.approx(288 / TOKENS_PER_DAY * 1e6)
    res = CliRunner().invoke(cli, ["plan", "--profile", big, *FLAGS, "--hardware-per-hour", "2"])
    assert res.exit_code == 0, res.output
    assert "cost per day          144.00 USD" in res.output


def test_cli_compare_two_plans_for_the_same_workload(tmp_path):
    big, small, prices = _files(tmp_path)
    res = CliRunner().invoke(cli, ["plan", "--profile", big, "--compare", small, *FLAGS, "--prices", prices, "--json"])
    assert res.exit_code == 0, res.output
    alone, mixed = json.loads(res.output)["plans"]
    assert alone["cost_per_day"] == pytest.approx(288.0)
    cap = 0.8 / 0.088125
    small_day = (20 - cap) * 86400 * (128 * 0.01 + 100 * 0.02) / 1e6  # token prices: by its tokens
    assert mixed["cost_per_day"] == pytest.approx(96.0 + small_day)
    res = CliRunner().invoke(
        cli, ["plan", "--profile", big, "--compare", small, *FLAGS, "--prices", prices, "--fallback-share", "0.5"]
    )
    assert res.exit_code == 0, res.output
    assert "| big + small fallback |" in res.output and "big 50 %, small 50 %" in res.output


def test_cli_price_errors(tmp_path):
    big, _, _ = _files(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text("models:\n  llama: {prompt_per_million: 1, completion_per_million: 1}\n")
    res = CliRunner().invoke(cli, ["plan", "--profile", big, *FLAGS, "--prices", str(other)])
    assert res.exit_code == 1 and "no price for the profile's model 'big'" in res.output
    res = CliRunner().invoke(cli, ["plan", "--profile", big, *FLAGS, "--fallback-share", "0.5"])
    assert res.exit_code == 2 and "go with --compare" in res.output
