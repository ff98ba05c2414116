"""The cost metric: served jobs' costs add up by model and tenant, with the
tenant label bounded the way the rejection metric bounds it (listed tenants
by name, every other one as "other")."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from jaxserve.cost.prices import PriceTable
from jaxserve.metrics import EngineMetrics
from jaxserve.worker.limits import LimitsConfig, TenantLimit


def sample(metrics: EngineMetrics, tenant: str, currency: str = "USD") -> float | None:
    return metrics.registry.get_sample_value(
        "jaxserve_cost_total", {"model_name": "big", "tenant": tenant, "currency": currency}
    )


def test_cost_adds_up_by_model_and_bounded_tenant():
    prices = PriceTable.from_values(prompt_per_million=0.5, completion_per_million=1.5)
    limits = LimitsConfig(tenants={"acme": TenantLimit(cost_per_day=10.0)})
    metrics = EngineMetrics("big")
    served = [("acme", 1000, 200), ("acme", 10, 20), ("", 500, 0)] + [(f"t{i}", 100, 100) for i in range(50)]
    for tenant, prompt, completion in served:
        cost = prices.cost_of("big", prompt, completion)
        assert cost is not None
        metrics.record_cost(limits.metric_label(tenant), cost.amount, cost.currency)
    assert sample(metrics, "acme") == pytest.approx((1010 * 0.5 + 220 * 1.5) / 1e6)
    assert sample(metrics, "default") == pytest.approx(500 * 0.5 / 1e6)
    # fifty unlisted tenants: one series
    assert sample(metrics, "other") == pytest.approx(50 * (100 * 0.5 + 100 * 1.5) / 1e6)
    text = generate_latest(metrics.registry).decode()
    assert text.count("jaxserve_cost_total{") == 3


def test_a_job_that_cost_nothing_adds_no_series():
    metrics = EngineMetrics("big")
    metrics.record_cost("acme", 0.0, "USD")
    assert sample(metrics, "acme") is None
