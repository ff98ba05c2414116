"""What one job costs: the estimate a tenant's daily budget is charged at
admission, the ``usage.cost`` of its result, and what it spent. The prices
are :mod:`jaxserve.cost.prices`' (``WorkerConfig.prices``, from ``jaxserve
worker --prices`` or the ``--price-*`` flags); without prices a job costs
nothing, its result carries no ``cost`` and the cost metric
(``job_log.record_cost``) stays at zero.

One rule throughout: a job is priced at the model that serves it, the
result's ``served_model`` when the job was served as another name than the
worker's own (a re-routed job), else the worker's served name. The budget
is charged the cost of prompt + ``max_tokens`` (as ``tokens_per_min`` is
charged tokens), and the part the job did not spend, estimate minus the
result's ``usage.cost``, goes back when its run ends
(``steps._release_tenant``). ``tests/test_queue_cost.py`` checks each
against the real broker.
"""

from __future__ import annotations

from jaxserve.cost.prices import PriceTable
from jaxserve.wire import Result


def estimate(prices: PriceTable | None, model: str | None, prompt_tokens: int, max_new_tokens: int) -> float:
    """The most a job can cost: its prompt and every token it may generate
    (0.0 without a price: the budget is then never charged)."""
    if prices is None:
        return 0.0
    cost = prices.cost_of(model, prompt_tokens, max_new_tokens)
    return 0.0 if cost is None else cost.amount


def with_cost(result: Result, prices: PriceTable | None, served_name: str | None) -> Result:
    """``result`` with ``usage.cost`` from its own tokens at the price of
    the model that served it; unchanged when it has no usage or that model
    has no price (the field is then absent, not zero)."""
    if prices is None or result.usage is None:
        return result
    usage = result.usage
    cost = prices.cost_of(result.served_model or served_name, usage.prompt_tokens, usage.completion_tokens)
    if cost is None:
        return result
    return result.model_copy(update={"usage": usage.model_copy(update={"cost": cost.to_dict()})})


def spent(result: Result) -> float:
    """What the result says the job cost (0.0 when it carries no cost)."""
    cost = None if result.usage is None else result.usage.cost
    return float(cost["amount"]) if cost is not None else 0.0
