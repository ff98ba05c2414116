"""Systems alternated in rounds, and the figures made of them.

Every scenario measures its systems the same way: each is started once
(loaded, warmed up, not timed), then ``warmup_rounds`` untimed turns of each
(recorded as round -1: a system's first run after the others' start-up moved
by up to a fifth from its later ones), then ``rounds`` rounds in which every
system gets one timed turn, in an order that rotates by one each round, with
the other systems' processes paused (``procs.Paused``). A 0.5 s numpy matmul
probe before each turn records how loaded the machine was. A figure is then
the median over rounds of each system, the spread (min-max) of each, and the
ratio within each round (two turns back to back), whose median and spread
are reported too.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .procs import Paused
from .record import Figure, Stat


class Contender(Protocol):
    """One system in a scenario's rounds."""

    name: str

    def start(self) -> dict[str, Any]:
        """Load and warm up (untimed); returns facts to record (versions, start-up time)."""

    def turn(self) -> dict[str, Any]:
        """One timed turn: ``{"ok": bool, "value": float, ...}`` (value in the scenario's unit)."""

    def pids(self) -> list[int]:
        """Processes to pause while another system runs (empty when none stays resident)."""

    def stop(self) -> None: ...


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_probe(seconds: float = 0.5, n: int = 512) -> float:
    """GFLOP/s of float32 numpy matmuls right now: how busy the machine is."""
    import numpy as np

    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return round(2 * n**3 * count / (time.perf_counter() - t0) / 1e9, 1)


def alternate(
    contenders: Sequence[Contender],
    rounds: int,
    warmup_rounds: int = 1,
    *,
    pause: bool = True,
    probe: bool = True,
    tag: dict[str, Any] | None = None,
    on_turn: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every contender's turns, round by round (see the module docstring).
    ``tag`` is merged into every record (e.g. the prompt count)."""
    records: list[dict[str, Any]] = []
    n = len(contenders)
    for rnd in range(-warmup_rounds, rounds):
        order = list(contenders) if rnd < 0 else [contenders[(rnd + i) % n] for i in range(n)]
        for c in order:
            others = [pid for o in contenders if o is not c for pid in o.pids()]
            load = round(os.getloadavg()[0], 2)
            gflops = load_probe() if probe else None
            with Paused(others if pause else []):
                t0 = time.perf_counter()
                try:
                    rec = c.turn()
                except Exception as exc:  # noqa: BLE001 - one failed turn is recorded, the rounds go on
                    rec = {"ok": False, "error": repr(exc)}
                turn_s = time.perf_counter() - t0
            rec = {
                **rec,
                **(tag or {}),
                "system": c.name,
                "round": rnd,
                "warmup": rnd < 0,
                "turn_s": round(turn_s, 2),
                "load_avg_1m_before": load,
                "probe_gflop_s_before": gflops,
            }
            records.append(rec)
            what = "warm-up" if rnd < 0 else f"round {rnd + 1}/{rounds}"
            shown = (
                f"{rec['value']:.4g}"
                if rec.get("ok") and rec.get("value") is not None
                else f"FAILED {rec.get('error')}"
            )
            log(f"{what} {tag or ''}: {c.name} {shown} (probe {gflops} GFLOP/s, load {load})")
            if on_turn:
                on_turn(rec)
    return records


def values(records: list[dict[str, Any]], system: str, where: dict[str, Any] | None = None) -> list[float]:
    """``system``'s timed value in each round, in round order (warm-ups and
    failed turns left out), restricted to records matching ``where``."""
    a = _by_round(records, system, where or {})
    return [a[k] for k in sorted(a)]


def _by_round(records: list[dict[str, Any]], system: str, where: dict[str, Any]) -> dict[int, float]:
    out = {}
    for r in records:
        if r["system"] != system or r["warmup"] or not r.get("ok") or r.get("value") is None:
            continue
        if any(r.get(k) != v for k, v in where.items()):
            continue
        out[r["round"]] = float(r["value"])
    return out


def figure(
    records: list[dict[str, Any]],
    what: str,
    system: str,
    peer: str | None,
    unit: str,
    *,
    where: dict[str, Any] | None = None,
    labels: dict[str, str] | None = None,
    **goal: Any,
) -> Figure:
    """A table row from the records: ``system`` (and ``peer``) per round,
    restricted to records matching ``where``; ``goal``: Figure's goal fields."""
    where = where or {}
    labels = labels or {}
    a = _by_round(records, system, where)
    sys_stat = Stat(labels.get(system, system), unit, values(records, system, where))
    if peer is None:
        return Figure(what, sys_stat, **goal)
    b = _by_round(records, peer, where)
    peer_stat = Stat(labels.get(peer, peer), unit, [b[k] for k in sorted(b)])
    ratios = [round(a[k] / b[k], 4) for k in sorted(a) if k in b and b[k] > 0]
    return Figure(what, sys_stat, peer_stat, ratios, **goal)
