"""What a request costs: per-model prices and the cost of a result's tokens.

A price is per million prompt tokens and per million completion tokens, in
one currency. It is either given as such (what a hosted API charges, or an
internal transfer price), or derived from what the hardware costs per hour
and how many tokens per second one worker gets through on it:

    prompt_per_million     = hardware_per_hour / 3600 / P x 1e6 / utilization
    completion_per_million = hardware_per_hour / 3600 / D x 1e6 / utilization

where P is the prefill rate and D the decode rate of a full batch. A prompt
token takes 1 / P seconds of the worker and a completion token 1 / D (its
share of a decode step of ``b_sat`` sequences), so at full use these prices
pay for the hour exactly; ``utilization`` (default 1) spreads the idle
share of the hour over the tokens that are served. P and D are given, or
read from the profile ``jaxserve plan --measure`` writes (its fastest
prefill chunk, and the decode rate at its saturation batch, at the longest
measured context unless ``context`` says which).

The prices file (YAML or JSON; ``jaxserve worker --prices FILE``,
``jaxserve plan --prices FILE``)::

    currency: USD
    models:
      llama-1b: {prompt_per_million: 0.20, completion_per_million: 0.60}
      tiny: {hardware_per_hour: 3.50, profile: tiny-profile.json, utilization: 0.7}
      smollm2-135m: {hardware_per_hour: 3.50, prompt_tokens_per_s: 20000, completion_tokens_per_s: 900}
    default: {prompt_per_million: 1.0, completion_per_million: 2.0}

A model is looked up by its name, then by the last part of a path (the
name a worker serves a checkpoint folder under), then ``default``; a model
with no price has no cost (``cost_of`` returns None). One currency per
table: tenant budgets (``cost_per_day`` in ``jaxserve.worker.limits``) and
the cost metric add amounts, which only makes sense in one currency.
Profile paths are relative to the prices file.

``tests/test_cost.py`` checks each way of pricing against hand-computed
figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PER = 1_000_000  # prices are per million tokens
_TOKEN_KEYS = ("prompt_per_million", "completion_per_million")
_HARDWARE_KEYS = (
    "hardware_per_hour",
    "profile",
    "prompt_tokens_per_s",
    "completion_tokens_per_s",
    "utilization",
    "context",
)


class PriceError(ValueError):
    """A price (file or values) that cannot be used; the message names it."""


@dataclasses.dataclass(frozen=True)
class Cost:
    """An amount of money: what ``usage.cost`` carries."""

    amount: float
    currency: str

    def to_dict(self) -> dict[str, Any]:
        # 12 significant digits: drops float noise (0.30000000000000004), keeps
        # the cost of a single token of a cheap model (1e-8 and below)
        return {"amount": float(f"{self.amount:.12g}"), "currency": self.currency}


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    """One model's price per million prompt and completion tokens.

    ``basis`` says where the figures came from (``tokens``: given;
    ``hardware``: derived, with the inputs kept in ``derived_from``) so a
    plan or a status line can show it."""

    prompt_per_million: float
    completion_per_million: float
    basis: str = "tokens"
    derived_from: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _TOKEN_KEYS:
            value = getattr(self, name)
            if not _nonnegative(value):
                raise PriceError(f"{name} must be a number >= 0, got {value!r}")

    @classmethod
    def from_hardware(
        cls,
        hardware_per_hour: float,
        prompt_tokens_per_s: float,
        completion_tokens_per_s: float,
        *,
        utilization: float = 1.0,
        source: str | None = None,
    ) -> ModelPrice:
        """The prices that pay for ``hardware_per_hour`` of one worker that
        prefills ``prompt_tokens_per_s`` and decodes ``completion_tokens_per_s``,
        busy ``utilization`` of the time (see the module docstring)."""
        if not _nonnegative(hardware_per_hour):
            raise PriceError(f"hardware_per_hour must be a number >= 0, got {hardware_per_hour!r}")
        for name, rate in (
            ("prompt_tokens_per_s", prompt_tokens_per_s),
            ("completion_tokens_per_s", completion_tokens_per_s),
        ):
            if not _positive(rate):
                raise PriceError(f"{name} must be a number > 0, got {rate!r}")
        if not (_positive(utilization) and utilization <= 1.0):
            raise PriceError(f"utilization must be in (0, 1], got {utilization!r}")
        per_s = hardware_per_hour / 3600.0 / utilization
        inputs: dict[str, Any] = {
            "hardware_per_hour": hardware_per_hour,
            "prompt_tokens_per_s": prompt_tokens_per_s,
            "completion_tokens_per_s": completion_tokens_per_s,
            "utilization": utilization,
        }
        if source is not None:
            inputs["profile"] = source
        return cls(
            prompt_per_million=per_s / prompt_tokens_per_s * PER,
            completion_per_million=per_s / completion_tokens_per_s * PER,
            basis="hardware",
            derived_from=inputs,
        )

    @classmethod
    def from_profile(
        cls,
        hardware_per_hour: float,
        profile: Any,
        *,
        utilization: float = 1.0,
        context: float | None = None,
        source: str | None = None,
    ) -> ModelPrice:
        """:meth:`from_hardware` with the rates of a plan profile
        (``jaxserve.planning.Profile``): its fastest prefill chunk, and its
        decode rate at the saturation batch and ``context`` (default: the
        longest measured one)."""
        prefill = profile.prefill_rate(profile.best_chunk)
        decode = profile.decode_rate(profile.saturation_batch(context), context)
        return cls.from_hardware(hardware_per_hour, prefill, decode, utilization=utilization, source=source)

    def amount(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt_per_million + completion_tokens * self.completion_per_million) / PER

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_per_million": self.prompt_per_million,
            "completion_per_million": self.completion_per_million,
            "basis": self.basis,
        }
        if self.derived_from:
            out["derived_from"] = dict(self.derived_from)
        return out


@dataclasses.dataclass(frozen=True)
class PriceTable:
    """Prices by model name, one currency. The worker's API:
    ``PriceTable.from_file(path).cost_of(model, prompt_tokens, completion_tokens)``."""

    models: Mapping[str, ModelPrice] = dataclasses.field(default_factory=dict)
    currency: str = "USD"
    default: ModelPrice | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.currency, str) or not self.currency.strip():
            raise PriceError(f"currency must be a non-empty string such as USD, got {self.currency!r}")

    def price_for(self, model: str | None) -> ModelPrice | None:
        """The model's price: by name, then by the last part of a path, then the default."""
        if model:
            found = self.models.get(model)
            if found is None:
                found = self.models.get(os.path.basename(str(model).rstrip("/")))
            if found is not None:
                return found
        return self.default

    def cost_of(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> Cost | None:
        """What ``prompt_tokens`` + ``completion_tokens`` of ``model`` cost;
        None when the model has no price (the result then carries no cost)."""
        price = self.price_for(model)
        if price is None:
            return None
        return Cost(price.amount(int(prompt_tokens), int(completion_tokens)), self.currency)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "currency": self.currency,
            "models": {name: p.describe() for name, p in sorted(self.models.items())},
        }
        if self.default is not None:
            out["default"] = self.default.describe()
        return out

    # ------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, data: Any, *, base_dir: str | Path = ".", where: str = "prices") -> PriceTable:
        """The documented shape (module docstring); profile paths relative to ``base_dir``."""
        if not isinstance(data, dict):
            raise PriceError(f"{where}: expected a mapping with 'currency', 'models' and 'default', got {data!r}")
        unknown = set(data) - {"currency", "models", "default"}
        if unknown:
            raise PriceError(f"{where}: unknown keys {sorted(unknown)}; known: currency, models, default")
        models = data.get("models") or {}
        if not isinstance(models, dict):
            raise PriceError(f"{where}: 'models' must map model names to prices")
        default = data.get("default")
        return cls(
            models={str(name): _price(f"{where}: models.{name}", raw, base_dir) for name, raw in models.items()},
            currency=str(data.get("currency") or "USD"),
            default=None if default is None else _price(f"{where}: default", default, base_dir),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> PriceTable:
        """Read a prices file (YAML, of which JSON is a subset)."""
        import yaml

        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PriceError(f"cannot read the prices file {str(path)!r}: {exc.strerror or exc}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise PriceError(f"{path}: not valid YAML or JSON: {exc}") from None
        return cls.from_dict(data, base_dir=path.parent, where=str(path))

    @classmethod
    def from_values(
        cls,
        model: str | None = None,
        *,
        prompt_per_million: float | None = None,
        completion_per_million: float | None = None,
        hardware_per_hour: float | None = None,
        profile: str | Path | None = None,
        prompt_tokens_per_s: float | None = None,
        completion_tokens_per_s: float | None = None,
        utilization: float | None = None,
        currency: str = "USD",
    ) -> PriceTable:
        """One price from command-line values: for ``model``, or (None) the
        default for every model. The same rules as one entry of the file."""
        raw = {
            "prompt_per_million": prompt_per_million,
            "completion_per_million": completion_per_million,
            "hardware_per_hour": hardware_per_hour,
            "profile": None if profile is None else str(profile),
            "prompt_tokens_per_s": prompt_tokens_per_s,
            "completion_tokens_per_s": completion_tokens_per_s,
            "utilization": utilization,
        }
        price = _price("price options", {k: v for k, v in raw.items() if v is not None}, ".")
        if model is None:
            return cls(currency=currency, default=price)
        return cls(models={model: price}, currency=currency)


def _nonnegative(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _positive(x: Any) -> bool:
    return _nonnegative(x) and x > 0


def _price(where: str, raw: Any, base_dir: str | Path) -> ModelPrice:
    """One entry: the two per-million prices, or the hardware's price per
    hour with a profile or both rates (not both kinds)."""
    if isinstance(raw, ModelPrice):
        return raw
    if not isinstance(raw, dict):
        raise PriceError(f"{where}: expected a mapping, got {raw!r}")
    known = _TOKEN_KEYS + _HARDWARE_KEYS
    unknown = set(raw) - set(known)
    if unknown:
        raise PriceError(f"{where}: unknown keys {sorted(unknown)}; known: {', '.join(known)}")
    token_keys = [k for k in _TOKEN_KEYS if k in raw]
    if token_keys and "hardware_per_hour" in raw:
        raise PriceError(f"{where}: give per-million prices or hardware_per_hour, not both")
    try:
        if token_keys:
            missing = [k for k in _TOKEN_KEYS if k not in raw]
            if missing:
                raise PriceError(f"{where}: {missing[0]} is missing (give both per-million prices)")
            extra = [k for k in _HARDWARE_KEYS if k in raw]
            if extra:
                raise PriceError(f"{where}: {extra[0]} only goes with hardware_per_hour")
            return ModelPrice(raw["prompt_per_million"], raw["completion_per_million"])
        if "hardware_per_hour" not in raw:
            raise PriceError(f"{where}: give prompt_per_million and completion_per_million, or hardware_per_hour")
        utilization = raw.get("utilization", 1.0)
        if "profile" in raw:
            if "prompt_tokens_per_s" in raw or "completion_tokens_per_s" in raw:
                raise PriceError(f"{where}: give a profile or the two tokens_per_s rates, not both")
            return _from_profile_file(where, raw, Path(base_dir), utilization)
        if "context" in raw:
            raise PriceError(f"{where}: context only goes with a profile")
        if "prompt_tokens_per_s" not in raw or "completion_tokens_per_s" not in raw:
            raise PriceError(
                f"{where}: hardware_per_hour needs a profile (jaxserve plan --measure) "
                "or prompt_tokens_per_s and completion_tokens_per_s"
            )
        return ModelPrice.from_hardware(
            raw["hardware_per_hour"],
            raw["prompt_tokens_per_s"],
            raw["completion_tokens_per_s"],
            utilization=utilization,
        )
    except PriceError as exc:
        msg = str(exc)
        raise PriceError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _from_profile_file(where: str, raw: dict[str, Any], base_dir: Path, utilization: Any) -> ModelPrice:
    from jaxserve.planning.profile import Profile, ProfileError

    path = Path(str(raw["profile"]))
    if not path.is_absolute():
        path = base_dir / path
    try:
        profile = Profile.load(path)
    except ProfileError as exc:
        raise PriceError(f"{where}: {exc}") from None
    context = raw.get("context")
    if context is not None and not _positive(context):
        raise PriceError(f"{where}: context must be a number of tokens > 0, got {context!r}")
    return ModelPrice.from_profile(
        raw["hardware_per_hour"], profile, utilization=utilization, context=context, source=str(path)
    )


def cost_dict(cost: Cost | None) -> dict[str, Any] | None:
    """``usage.cost`` as the wire carries it (``{"amount", "currency"}``), or None."""
    return None if cost is None else cost.to_dict()


__all__ = ["PER", "Cost", "ModelPrice", "PriceError", "PriceTable", "cost_dict"]
