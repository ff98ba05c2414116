"""One results schema for every scenario, and one naming rule.

A result is what one ``suite.py run SCENARIO`` measured: the machine, the
commit, the command, the settings, the raw per-turn records, and a list of
:class:`Figure` rows, which are what BENCHMARKS.md's table shows. A figure
compares a system with a peer (another system, or the same system in a
baseline condition: idle TTFT, f32 memory) turn by turn, so its ratio has a
spread of its own, not only the ratio of two medians.

Files: ``benchmarks/results/<scenario>-<UTC YYYY-mm-ddTHHMMSSZ>.json``;
smoke runs (``--smoke``) go to ``benchmarks/results/smoke/`` (ignored by
git) and never reach the table.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "jaxserve-benchmark/1"
RESULTS = Path(__file__).resolve().parents[1] / "results"


@dataclass
class Stat:
    """One system's figure over the rounds (``runs``: one value per round)."""

    label: str
    unit: str
    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    @property
    def spread(self) -> tuple[float, float] | None:
        return (min(self.runs), max(self.runs)) if self.runs else None

    @property
    def max_over_min(self) -> float | None:
        """How wide the runs swing: the spread rule compares this between systems."""
        if not self.runs or min(self.runs) <= 0:
            return None
        return max(self.runs) / min(self.runs)


@dataclass
class Figure:
    """One row of the table: ``system`` against ``peer`` (optional).

    ``ratio_runs``: system / peer within each round (the same round's two
    turns, measured back to back). ``goal``: the must-show as text, with
    ``goal_ratio`` (or ``goal_value`` for a figure without a peer) and
    ``higher_is_better`` to judge it."""

    what: str
    system: Stat
    peer: Stat | None = None
    ratio_runs: list[float] = field(default_factory=list)
    goal: str | None = None
    goal_ratio: float | None = None
    goal_value: float | None = None
    higher_is_better: bool = True
    note: str = ""
    #: False when the peer is the same system in a baseline condition (idle,
    #: f32): the spread rule compares systems, not conditions
    compare_swing: bool = True

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratio_runs) if self.ratio_runs else None

    @property
    def met(self) -> bool | None:
        """Whether the goal holds on the medians (None: no goal or no data)."""
        if self.goal_ratio is not None and self.ratio is not None:
            r = self.ratio
            return r >= self.goal_ratio if self.higher_is_better else r <= self.goal_ratio
        if self.goal_value is not None and self.system.median is not None:
            v = self.system.median
            return v >= self.goal_value if self.higher_is_better else v <= self.goal_value
        return None

    @property
    def spread_rule(self) -> bool | None:
        """The system's max/min no wider than the peer's (issue 25's spread rule)."""
        if not self.compare_swing or self.peer is None or len(self.system.runs) < 2 or len(self.peer.runs) < 2:
            return None
        a, b = self.system.max_over_min, self.peer.max_over_min
        return None if a is None or b is None else a <= b

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            ratio=self.ratio,
            met=self.met,
            spread_rule=self.spread_rule,
            system_median=self.system.median,
            peer_median=self.peer.median if self.peer else None,
        )
        return out

    @staticmethod
    def from_json(d: dict[str, Any]) -> Figure:
        keys = {f.name for f in dataclasses.fields(Figure)}
        kw = {k: v for k, v in d.items() if k in keys}
        kw["system"] = Stat(**d["system"])
        kw["peer"] = Stat(**d["peer"]) if d.get("peer") else None
        return Figure(**kw)


@dataclass
class Result:
    scenario: str
    command: str
    machine: dict[str, Any]
    git: dict[str, Any]
    settings: dict[str, Any]
    figures: list[Figure]
    runs: list[dict[str, Any]]
    smoke: bool = False
    date_utc: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime()))
    schema: str = SCHEMA

    def path(self) -> Path:
        folder = RESULTS / "smoke" if self.smoke else RESULTS
        return folder / f"{self.scenario}-{self.date_utc}.json"

    def write(self) -> Path:
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dataclasses.asdict(self)
        data["figures"] = [f.to_json() for f in self.figures]
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path

    @staticmethod
    def load(path: Path) -> Result:
        d = json.loads(path.read_text())
        if d.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {d.get('schema')!r}, expected {SCHEMA!r}")
        keys = {f.name for f in dataclasses.fields(Result)}
        kw = {k: v for k, v in d.items() if k in keys}
        kw["figures"] = [Figure.from_json(f) for f in d["figures"]]
        return Result(**kw)


def latest_results(folder: Path = RESULTS) -> dict[str, tuple[Path, Result]]:
    """The newest result of each scenario in ``folder`` (smoke runs live elsewhere)."""
    out: dict[str, tuple[Path, Result]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            res = Result.load(path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            continue  # another benchmark's file (faults-*.json, ...)
        if res.smoke:
            continue
        prev = out.get(res.scenario)
        if prev is None or res.date_utc > prev[1].date_utc:
            out[res.scenario] = (path, res)
    return out
