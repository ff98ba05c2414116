"""Prices and costs (``jaxserve.cost``): a result's cost is its tokens times
the configured price, whether the price is given per million tokens or
derived from the hardware's price per hour and a measured profile; every
malformed price is refused with a message that names it."""

from __future__ import annotations

import json

import pytest

from jaxserve.cost.prices import Cost, ModelPrice, PriceError, PriceTable
from jaxserve.planning import Profile

PRICES_YAML = """\
currency: EUR
models:
  big: {prompt_per_million: 0.5, completion_per_million: 1.5}
  small: {hardware_per_hour: 3.6, prompt_tokens_per_s: 10000, completion_tokens_per_s: 500}
"""


def test_cost_is_the_tokens_times_the_configured_price(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text(PRICES_YAML)
    table = PriceTable.from_file(path)
    cost = table.cost_of("big", 1000, 200)
    # 1000 x 0.5 / 1e6 + 200 x 1.5 / 1e6
    assert cost == Cost(pytest.approx(0.0005 + 0.0003), "EUR")
    assert cost is not None and cost.to_dict() == {"amount": 0.0008, "currency": "EUR"}
    assert table.cost_of("big", 0, 0) == Cost(0.0, "EUR")
    # a checkpoint folder is served under its last path part
    assert table.cost_of("/models/big/", 1000, 200) == cost
    # no price, no default: no cost
    assert table.cost_of("other", 10, 10) is None
    assert table.cost_of(None, 10, 10) is None


def test_hardware_price_pays_for_the_hour_at_the_measured_rates(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text(PRICES_YAML)
    small = PriceTable.from_file(path).price_for("small")
    assert small is not None and small.basis == "hardware"
    # 3.6 per hour = 0.001 per second; 10000 prompt tokens/s -> 1e-7 each = 0.1 per million
    assert small.prompt_per_million == pytest.approx(0.1)
    assert small.completion_per_million == pytest.approx(2.0)  # 0.001 / 500 x 1e6
    # an hour of prefill at the measured rate costs the hour's price
    assert small.amount(10000 * 3600, 0) == pytest.approx(3.6)
    assert small.amount(0, 500 * 3600) == pytest.approx(3.6)
    half = ModelPrice.from_hardware(3.6, 10000, 500, utilization=0.5)
    assert half.completion_per_million == pytest.approx(4.0)  # idle half of the hour spread over the tokens


def test_hardware_price_from_a_plan_profile(tmp_path):
    profile = Profile(
        model="synthetic",
        prefill={256: 10000.0, 512: 12800.0},
        decode={128: {1: 100.0, 8: 640.0, 32: 1280.0}, 1024: {1: 90.0, 8: 500.0, 32: 1000.0}},
        kv_bytes_per_token=1024,
        block_size=16,
    )
    (tmp_path / "profiles").mkdir()
    profile.save(tmp_path / "profiles" / "p.json")
    prices = tmp_path / "prices.json"
    prices.write_text(
        json.dumps(
            {
                "models": {
                    "long": {"hardware_per_hour": 7.2, "profile": "profiles/p.json"},
                    "short": {"hardware_per_hour": 7.2, "profile": "profiles/p.json", "context": 128},
                }
            }
        )
    )
    table = PriceTable.from_file(prices)
    assert table.currency == "USD"
    long, short = table.price_for("long"), table.price_for("short")
    assert long is not None and short is not None
    # 7.2 / 3600 = 0.002 per second; best chunk 512 at 12800 tokens/s
    assert long.prompt_per_million == pytest.approx(0.002 / 12800 * 1e6)
    # the longest measured context unless told: b_sat 32 at 1000 tokens/s
    assert long.completion_per_million == pytest.approx(2.0)
    assert short.completion_per_million == pytest.approx(0.002 / 1280 * 1e6)
    assert long.derived_from["profile"] == str(tmp_path / "profiles" / "p.json")


def test_default_and_command_line_values():
    table = PriceTable.from_values(prompt_per_million=1.0, completion_per_million=3.0, currency="GBP")
    assert table.cost_of("anything", 2_000_000, 1_000_000) == Cost(pytest.approx(5.0), "GBP")
    one = PriceTable.from_values("big", hardware_per_hour=3.6, prompt_tokens_per_s=1000, completion_tokens_per_s=100)
    assert one.cost_of("small", 1, 1) is None
    assert one.cost_of("big", 1000, 0) == Cost(pytest.approx(0.001), "USD")


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"prompt_per_million": 1}, "completion_per_million is missing"),
        ({"prompt_per_million": -1, "completion_per_million": 1}, "prompt_per_million must be a number >= 0"),
        ({"prompt_per_million": 1, "completion_per_million": 1, "hardware_per_hour": 2}, "not both"),
        ({"hardware_per_hour": 2}, "needs a profile"),
        ({"hardware_per_hour": 2, "prompt_tokens_per_s": 0, "completion_tokens_per_s": 5}, "prompt_tokens_per_s"),
        (
            {"hardware_per_hour": 2, "prompt_tokens_per_s": 1, "completion_tokens_per_s": 5, "utilization": 1.5},
            "utilization",
        ),
        ({"hardware_per_hour": 2, "profile": "missing.json"}, "missing.json"),
        ({"price": 2}, "unknown keys ['price']"),
        ("cheap", "expected a mapping"),
    ],
)
def test_malformed_prices_name_the_model_and_the_problem(tmp_path, entry, message):
    path = tmp_path / "prices.yaml"
    path.write_text(json.dumps({"models": {"m": entry}}))
    with pytest.raises(PriceError) as err:
        PriceTable.from_file(path)
    assert "models.m" in str(err.value) and message in str(err.value)


def test_malformed_files(tmp_path):
    with pytest.raises(PriceError, match="cannot read the prices file"):
        PriceTable.from_file(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [1, 2\n")
    with pytest.raises(PriceError, match="not valid YAML"):
        PriceTable.from_file(bad)
    bad.write_text("currency: USD\nprices: {}\n")
    with pytest.raises(PriceError, match="unknown keys"):
        PriceTable.from_file(bad)


def _priced_command():
    import click

    from jaxserve.cli.price_options import price_options, prices_from_options

    @click.command()
    @price_options
    def cmd(**kw):
        table = prices_from_options(None, **kw)
        cost = None if table is None else table.cost_of("served", 1_000_000, 1_000_000)
        click.echo(json.dumps(None if cost is None else cost.to_dict()))

    return cmd


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], None),
        (["--price-prompt-per-million", "0.5", "--price-completion-per-million", "1.5"], 2.0),
        # 3.6 / hour = 0.001 / s: 1e6 tokens at 1000/s and at 100/s take 1000 s and 10000 s
        (["--price-hardware-per-hour", "3.6", "--price-tokens-per-s", "1000,100", "--price-currency", "EUR"], 11.0),
    ],
)
def test_worker_price_flags(args, expected):
    from click.testing import CliRunner

    res = CliRunner().invoke(_priced_command(), args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    if expected is None:
        assert out is None
    else:
        assert out["amount"] == pytest.approx(expected)
        assert out["currency"] == ("EUR" if "EUR" in args else "USD")


def test_worker_price_flags_refuse_two_sources_and_half_a_price(tmp_path):
    from click.testing import CliRunner

    prices = tmp_path / "p.yaml"
    prices.write_text(PRICES_YAML)
    res = CliRunner().invoke(_priced_command(), ["--prices", str(prices), "--price-prompt-per-million", "1"])
    assert res.exit_code == 2 and "not both" in res.output
    res = CliRunner().invoke(_priced_command(), ["--price-prompt-per-million", "1"])
    assert res.exit_code == 1 and "completion_per_million is missing" in res.output
    res = CliRunner().invoke(_priced_command(), ["--price-hardware-per-hour", "1", "--price-tokens-per-s", "5"])
    assert res.exit_code == 2 and "PROMPT,COMPLETION" in res.output
