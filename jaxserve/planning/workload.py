"""The workload a plan is for: arrival rate, burst, token distributions, targets.

From flags (``--rps 5 --prompt-tokens mean:500,p95:900 --output-tokens
mean:64,p95:128 --ttft-target-s 1 --itl-target-s 0.05 --burst 8
--headroom 0.3``) or a JSON/YAML file with the same names::

    rps: 5
    burst: 8
    prompt_tokens: {mean: 500, p95: 900}
    output_tokens: {mean: 64, p95: 128}
    ttft_target_s: 1.0
    itl_target_s: 0.05
    headroom: 0.3

A ``loadtest.json`` (``jaxserve loadtest``) works as a file too: its token
distributions are the ones the worker reported for the completed jobs of its
first level that has any (``prompt_tokens_mean``/``_p95``,
``output_tokens_mean``/``_p95``); rate and targets then come from the flags.
Flags given on the command line win over the file.

- ``rps``: mean arrival rate, jobs/s, all workers together.
- ``burst``: jobs that may arrive at the same instant on top of that rate,
  and must still meet the TTFT target (1: no burst beyond single arrivals).
- ``headroom``: share of every worker's capacity kept free (0.3: plan to run
  at 70 %); it absorbs the queueing of random arrivals and noise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxserve.json_files import parse_json, read_text


class WorkloadError(ValueError):
    """A workload that cannot be planned for (a bad field, a missing one)."""


@dataclasses.dataclass(frozen=True)
class TokenDist:
    """Mean and 95th percentile of a token count."""

    mean: float
    p95: float

    def __post_init__(self) -> None:
        for name in ("mean", "p95"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise WorkloadError(f"token counts must be positive numbers, got {name}={v!r}")

    @classmethod
    def parse(cls, value: Any, what: str = "tokens") -> TokenDist:
        """``"mean:500,p95:900"``, ``"500"`` (both 500), ``{"mean": .., "p95": ..}``."""
        if isinstance(value, TokenDist):
            return value
        if isinstance(value, Mapping):
            fields = dict(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            fields = {"mean": value}
        else:
            fields = {}
            for part in str(value).split(","):
                part = part.strip()
                if not part:
                    continue
                name, sep, number = part.partition(":")
                if not sep:
                    name, number = "mean", name
                fields[name.strip()] = number
        unknown = sorted(set(fields) - {"mean", "p95"})
        if unknown or "mean" not in fields:
            raise WorkloadError(f"{what}: expected mean:N[,p95:M], got {value!r}")
        try:
            mean = float(fields["mean"])
            p95 = float(fields.get("p95", mean))
        except (TypeError, ValueError):
            raise WorkloadError(f"{what}: expected numbers in mean:N[,p95:M], got {value!r}") from None
        try:
            return cls(mean, p95)
        except WorkloadError as exc:
            raise WorkloadError(f"{what}: {exc}") from None

    def __str__(self) -> str:
        return f"mean {self.mean:g} / p95 {self.p95:g}"


@dataclasses.dataclass(frozen=True)
class PlanWorkload:
    rps: float
    prompt_tokens: TokenDist
    output_tokens: TokenDist
    burst: int = 1
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    headroom: float = 0.3

    def __post_init__(self) -> None:
        if not (isinstance(self.rps, (int, float)) and math.isfinite(self.rps) and self.rps > 0):
            raise WorkloadError(f"rps must be a number > 0, got {self.rps!r}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise WorkloadError(f"burst must be an integer >= 1, got {self.burst!r}")
        for name in ("ttft_target_s", "itl_target_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise WorkloadError(f"{name} must be a number > 0, got {v!r}")
        if not (isinstance(self.headroom, (int, float)) and 0 <= self.headroom < 1):
            raise WorkloadError(f"headroom must be in [0, 1), got {self.headroom!r}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return out


def _from_loadtest(levels: list) -> dict[str, Any]:
    for e in levels:
        if isinstance(e, Mapping) and e.get("completed") and e.get("prompt_tokens_mean"):
            return {
                "prompt_tokens": {"mean": e["prompt_tokens_mean"], "p95": e["prompt_tokens_p95"]},
                "output_tokens": {"mean": e["output_tokens_mean"], "p95": e["output_tokens_p95"]},
            }
    raise WorkloadError("the loadtest.json has no level with completed jobs to take token counts from")


def read_workload_file(path: str | Path) -> dict[str, Any]:
    """The fields of a JSON or YAML workload file (or of a loadtest.json)."""
    path = Path(path)
    text = read_text(path, WorkloadError, "the workload file ")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise WorkloadError("a YAML workload file needs PyYAML (pip install pyyaml), or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise WorkloadError(f"{path}: not valid YAML: {exc}") from None
    else:
        data = parse_json(text, path, WorkloadError)
    if isinstance(data, list):
        return _from_loadtest(data)
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{path}: expected a mapping of workload fields")
    known = {f.name for f in dataclasses.fields(PlanWorkload)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise WorkloadError(f"{path}: unknown workload fields {unknown}; known: {sorted(known)}")
    return dict(data)


def build_workload(file_fields: Mapping[str, Any] | None = None, **flags: Any) -> PlanWorkload:
    """A :class:`PlanWorkload` from file fields overridden by the flags that
    are not None."""
    fields = dict(file_fields or {})
    fields.update({k: v for k, v in flags.items() if v is not None})
    missing = [n for n in ("rps", "prompt_tokens", "output_tokens") if n not in fields]
    if missing:
        raise WorkloadError(
            f"the workload needs {', '.join(missing)} (flags --rps, --prompt-tokens, --output-tokens or a file)"
        )
    fields["prompt_tokens"] = TokenDist.parse(fields["prompt_tokens"], "prompt_tokens")
    fields["output_tokens"] = TokenDist.parse(fields["output_tokens"], "output_tokens")
    if isinstance(fields.get("rps"), str):
        raise WorkloadError(f"rps must be a number, got {fields['rps']!r}")
    if "burst" in fields and isinstance(fields["burst"], float) and fields["burst"].is_integer():
        fields["burst"] = int(fields["burst"])
    return PlanWorkload(**fields)
