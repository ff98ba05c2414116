"""BENCHMARKS.md's current table, regenerated from the newest result of each scenario.

The table sits between two markers at the top of BENCHMARKS.md (as
RELIABILITY.md's table, written by ``benchmarks/faults.py``); everything
outside the markers is left alone. Scenarios with no result yet get one row
saying so, with the command that produces it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import machine as machine_mod
from .record import Figure, Result, latest_results

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "BENCHMARKS.md"
BEGIN = "<!-- benchmarks-table:begin (written by benchmarks/suite.py table; edit the scenarios, not this table) -->"
END = "<!-- benchmarks-table:end -->"
HEADER = "| what | figure | peer | ratio | spread (min-max over rounds) | machine | commit | command |"


def num(v: float | None) -> str:
    """Three significant figures, no exponent for everyday sizes."""
    if v is None:
        return "–"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _goal_cell(f: Figure) -> str:
    if f.goal is None:
        return ""
    met = f.met
    return f" (goal {f.goal}: {'met' if met else 'not met' if met is False else 'no data'})"


def row(f: Figure, res: Result, path: Path) -> str:
    s = f.system
    figure = f"{s.label} **{num(s.median)} {s.unit}".rstrip() + "**"
    peer = f"{f.peer.label} {num(f.peer.median)} {f.peer.unit}".rstrip() if f.peer else "–"
    if f.peer is not None:
        ratio = f"**{num(f.ratio)}x**{_goal_cell(f)}"
    else:
        ratio = f"–{_goal_cell(f)}"
    parts = []
    if len(s.runs) <= 1 and (f.peer is None or len(f.peer.runs) <= 1):
        parts.append("one run: no spread")
    elif f.ratio_runs:
        parts.append(f"ratio {num(min(f.ratio_runs))}-{num(max(f.ratio_runs))}x")
    for st in (s, f.peer):
        if st is not None and st.spread is not None and len(st.runs) > 1:
            lo, hi = st.spread
            swing = f", max/min {st.max_over_min:.2f}" if st.max_over_min else ""
            parts.append(f"{st.label} {num(lo)}-{num(hi)}{swing}")
    rule = f.spread_rule
    if rule is not None:
        parts.append("swing no wider than the peer's" if rule else "**swing wider than the peer's**")
    if len(s.runs) > 1:
        parts.append(f"{len(s.runs)} rounds")
    commit = f"{res.git.get('commit')}{' (dirty)' if res.git.get('jaxserve_dirty') else ''}"
    note = f" {f.note}" if f.note else ""
    cells = [
        f.what + note,
        figure,
        peer,
        ratio,
        "; ".join(parts),
        machine_mod.short(res.machine),
        f"{commit}, {res.date_utc[:10]}, [result]({_rel(path)})",
        f"`{res.command}`",
    ]
    return "| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |"


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def result_rows(res: Result, path: Path) -> list[str]:
    """The rows of one result (what ``suite.py run`` prints, smoke runs included)."""
    if not res.figures:
        return [
            (
                f"| {res.scenario}: no figures (see the result) | – | – | – | – | {machine_mod.short(res.machine)} | "
                f"[result]({_rel(path)}) | `{res.command}` |"
            )
        ]
    return [row(f, res, path) for f in res.figures]


def render(scenarios: Iterable[tuple[str, str, str]], results_dir: Path | None = None) -> str:
    """``scenarios``: (name, description, command) of every scenario, in table order."""
    latest = latest_results(results_dir) if results_dir else latest_results()
    lines = [HEADER, "|---|---|---|---|---|---|---|---|"]
    for name, description, command in scenarios:
        if name not in latest:
            lines.append(f"| {description} | not run yet | – | – | – | – | – | `{command}` |")
            continue
        path, res = latest[name]
        lines += result_rows(res, path)
    return "\n".join(lines)


def write(table: str, doc: Path = DOC) -> None:
    """Replace what is between the markers (add them after the title if absent)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n\n{table}\n\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        lines = text.splitlines(keepends=True)
        text = "".join(lines[:1]) + "\n" + block + "\n" + "".join(lines[1:])
    doc.write_text(text)
