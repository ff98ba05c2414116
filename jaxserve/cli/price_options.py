"""The price flags of a command that costs what it serves (``jaxserve
worker``): a prices file, or one price from values. Kept apart so the
worker's option list gains one decorator, and the rules live with the
prices (``jaxserve.cost``).

    --prices FILE                        a prices file (every model)
    --price-prompt-per-million X         with --price-completion-per-million Y
    --price-hardware-per-hour H          with --price-profile PROFILE.json,
                                         or --price-tokens-per-s P,D
    --price-currency USD

Values price the served model only; a file and values together are refused
(one source of truth per worker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from jaxserve.cost.prices import PriceError, PriceTable

_OPTIONS = (
    click.option(
        "--prices",
        "prices_file",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help="Prices file (YAML/JSON: currency, models, default): results carry usage.cost.",
    ),
    click.option(
        "--price-prompt-per-million",
        type=click.FloatRange(min=0),
        default=None,
        help="The served model's price per million prompt tokens (with --price-completion-per-million).",
    ),
    click.option(
        "--price-completion-per-million",
        type=click.FloatRange(min=0),
        default=None,
        help="The served model's price per million completion tokens.",
    ),
    click.option(
        "--price-hardware-per-hour",
        type=click.FloatRange(min=0),
        default=None,
        help="Price of this worker's machine per hour; with --price-profile or --price-tokens-per-s.",
    ),
    click.option(
        "--price-profile",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help="Profile (jaxserve plan --measure) whose rates turn --price-hardware-per-hour into token prices.",
    ),
    click.option(
        "--price-tokens-per-s",
        default=None,
        metavar="PROMPT,COMPLETION",
        help="Prompt and completion tokens/s of one worker, instead of --price-profile.",
    ),
    click.option("--price-currency", default="USD", show_default=True, help="Currency of the price values."),
)


def price_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add the price flags to a click command (see the module docstring)."""
    for option in reversed(_OPTIONS):
        f = option(f)
    return f


def prices_from_options(
    model: str | None,
    *,
    prices_file: str | None = None,
    price_prompt_per_million: float | None = None,
    price_completion_per_million: float | None = None,
    price_hardware_per_hour: float | None = None,
    price_profile: str | None = None,
    price_tokens_per_s: str | None = None,
    price_currency: str = "USD",
) -> PriceTable | None:
    """The worker's prices from its flags; None when none is given (its
    results then carry no cost). Raises ``click.UsageError`` /
    ``click.ClickException`` with the problem."""
    values = (price_prompt_per_million, price_completion_per_million, price_hardware_per_hour, price_profile)
    given = any(v is not None for v in values) or price_tokens_per_s is not None
    if prices_file is not None and given:
        raise click.UsageError("give --prices FILE or --price-* values, not both")
    try:
        if prices_file is not None:
            return PriceTable.from_file(prices_file)
        if not given:
            return None
        rates: list[float] = []
        if price_tokens_per_s is not None:
            try:
                rates = [float(x) for x in price_tokens_per_s.split(",")]
            except ValueError:
                rates = []
            if len(rates) != 2:
                raise click.BadParameter(
                    f"expected PROMPT,COMPLETION tokens/s, got {price_tokens_per_s!r}",
                    param_hint="--price-tokens-per-s",
                )
        return PriceTable.from_values(
            model,
            prompt_per_million=price_prompt_per_million,
            completion_per_million=price_completion_per_million,
            hardware_per_hour=price_hardware_per_hour,
            profile=price_profile,
            prompt_tokens_per_s=rates[0] if rates else None,
            completion_tokens_per_s=rates[1] if rates else None,
            currency=price_currency,
        )
    except PriceError as exc:
        raise click.ClickException(str(exc)) from None
