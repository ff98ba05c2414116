"""accuracy, quant-quality and structured: scripts of their own, their headline figures in the table.

Quality is not a speed: nothing alternates, the figures are computed once.

- ``accuracy``: ``benchmarks/classify_accuracy.py`` (labelled documents in
  ``benchmarks/data/``: accuracy per scoring method, confusion matrix, and
  jaxserve's label log-likelihoods against transformers');
- ``quant-quality``: ``benchmarks/quant_quality.py`` (int8/int4 weights and
  the int8 KV cache against f32: greedy agreement, largest logprob
  difference, perplexity);
- ``structured``: ``benchmarks/structured_bench.py`` (a full batch's decode
  step with 0, 1 and every row constrained, and extraction jobs/s with and
  without a JSON Schema; its own rounds alternate the variants).

How the suite runs them: ``classify_accuracy.py --out FILE`` and
``quant_quality.py --output-dir DIR`` (plus ``--script-arg`` values), into
the run's working folder, then reads the JSON report. The figures: for
``accuracy``, the accuracy of the default method and of the plain, chat,
calibrated and few-shot methods, and the largest log-likelihood difference
from transformers (:func:`accuracy_figures`); for ``quant-quality``, int8's,
int4's and the int8 KV cache's greedy agreement with f32 and their
perplexity against f32's (:func:`quant_figures`); for a report of another shape, its ``headline``, a
list of ``{"what", "value", "unit", "label"?, "goal"?, "goal_value"?,
"higher_is_better"?}`` or a mapping of name to number, failing that the
numbers of its ``summary``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..record import Figure, Stat

BENCH = Path(__file__).resolve().parents[2]


def _model_label(model: str) -> str:
    """The reports name a preset or a cached file; the table names the model."""
    return "SmolLM2-135M" if "smollm2" in model.lower() else Path(model).name or model


def headline_figures(data: dict[str, Any], source: str) -> list[Figure]:
    head = data.get("headline")
    items: list[dict[str, Any]] = []
    if isinstance(head, list):
        items = [h for h in head if isinstance(h, dict) and isinstance(h.get("value"), (int, float))]
    elif isinstance(head, dict):
        items = [{"what": k, "value": v} for k, v in head.items() if isinstance(v, (int, float))]
    elif isinstance(data.get("summary"), dict):
        items = [
            {"what": k, "value": v}
            for k, v in data["summary"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
    out = []
    for h in items:
        higher = bool(h.get("higher_is_better", True))
        goal_value = h.get("goal_value")
        out.append(
            Figure(
                str(h["what"]),
                Stat(str(h.get("label", source)), str(h.get("unit", "")), [float(h["value"])]),
                goal=h.get("goal"),
                goal_value=float(goal_value) if goal_value is not None else None,
                higher_is_better=higher,
            )
        )
    return out


def accuracy_figures(data: dict[str, Any], source: str) -> list[Figure]:
    """``classify_accuracy.py``'s report: accuracy on the whole labelled set per method."""
    methods = data.get("methods") or {}
    if not methods:
        return headline_figures(data, source)
    default = data.get("default_method")
    n = data.get("documents")
    model = _model_label(str(data.get("model", "")))
    out = []
    names = ([default] if default in methods else []) + [
        m for m in ("plain", "chat", "calibrated", "few-shot") if m != default and m in methods
    ]
    for name in names:
        r = methods[name]
        label = f"method {name}" + (" (the default)" if name == default else "")
        f = Figure(
            f"classification accuracy, {n} labelled documents, {model}",
            Stat(label, "%", [round(100 * r["accuracy"]["all"], 1)]),
            note=f"(half A {100 * r['accuracy']['A']:.1f} %, half B {100 * r['accuracy']['B']:.1f} %)",
        )
        if name == default:
            f.goal, f.goal_value = ">= 75 %", 75.0
        out.append(f)
    check = data.get("hf_check") or {}
    if check.get("max_abs_diff") is not None:
        out.append(
            Figure(
                f"label log-likelihoods against transformers on the same token ids ({check.get('labels_compared')} labels)",
                Stat("max abs difference", "nats", [float(check["max_abs_diff"])]),
                goal="<= 1e-4",
                goal_value=1e-4,
                higher_is_better=False,
            )
        )
    return out


def quant_figures(data: dict[str, Any], source: str) -> list[Figure]:
    """``quant_quality.py``'s report: agreement and perplexity of int8 and int4 against f32."""
    res = data.get("results") or {}
    if "f32" not in res:
        return headline_figures(data, source)
    f32 = res["f32"]
    model = _model_label(str(data.get("model") or "smollm2-135m"))
    goals = {"int8": (0.90, 1.02), "int4": (None, 1.10), "kv-int8": (0.97, 1.01)}
    labels = {"int8": "jaxserve int8", "int4": "jaxserve int4", "kv-int8": "jaxserve f32, int8 KV cache"}
    out = []
    for kind in ("int8", "int4", "kv-int8"):
        r = res.get(kind)
        if r is None:
            continue
        agree_goal, ppl_goal = goals[kind]
        f = Figure(
            f"greedy tokens equal to f32's over fixed prompts ({r.get('positions')} positions), {model}, {data.get('path')}",
            Stat(labels[kind], "%", [round(100 * r["greedy_agreement"], 1)]),
            note=f"(largest per-token logprob difference {r['max_token_logprob_diff']:.3g})",
        )
        if agree_goal is not None:
            f.goal, f.goal_value = f">= {100 * agree_goal:.0f} %", 100 * agree_goal
        out.append(f)
        out.append(
            Figure(
                f"perplexity on benchmarks/data/perplexity.txt ({r.get('perplexity_tokens')} tokens), {model}",
                Stat(labels[kind], "", [round(r["perplexity"], 4)]),
                Stat("jaxserve f32", "", [round(f32["perplexity"], 4)]),
                [round(r["perplexity"] / f32["perplexity"], 4)],
                goal=f"<= {ppl_goal}x",
                goal_ratio=ppl_goal,
                higher_is_better=False,
                compare_swing=False,
            )
        )
    return out


def structured_figures(data: dict[str, Any], source: str) -> list[Figure]:
    """``structured_bench.py``'s report: a full batch's decode step with 1
    and with every row constrained against none, and extraction jobs/s with
    the schema against without (issue 27: within 1.15x)."""
    if "step_ms" not in data and "jobs_per_s" not in data:
        return headline_figures(data, source)
    model = _model_label(str(data.get("model", "")))
    rows, out = data.get("rows"), []
    steps = data.get("step_ms") or {}
    base = steps.get("0_constrained")
    for name, ms in steps.items():
        if name == "0_constrained" or base is None:
            continue
        n = name.split("_", 1)[0]
        out.append(
            Figure(
                f"decode step of a {rows}-row batch with {n} constrained rows vs none, {model} (median ms)",
                Stat(f"{n} constrained", "ms", [ms]),
                Stat("0 constrained", "ms", [base]),
                [round(ms / base, 4)],
                higher_is_better=False,
                compare_swing=False,
            )
        )
    runs = data.get("jobs_runs") or {}
    schema, free = runs.get("schema") or [], runs.get("free") or []
    if schema and free:
        valid = sum(r.get("valid_json", 0) for r in schema)
        total = len(schema) * int(data.get("jobs") or 0)
        jobs = data.get("jobs")
        # jobs/s, then the same runs per output token: what constraining
        # costs once the schema's longer answers are taken out of the ratio
        kinds = [
            (
                "jobs_per_s",
                "jobs/s",
                f"{jobs} extraction jobs, JSON Schema vs unconstrained, {model} (jobs/s)",
                f"({valid} of {total} schema outputs valid JSON; free jobs stop at EOS, so their tokens differ)",
            ),
            (
                "tokens_per_s",
                "tok/s",
                f"the same {jobs} extraction jobs per output token, JSON Schema vs unconstrained, {model} (output tok/s)",
                "",
            ),
        ]
        for key, unit, what, note in kinds:
            if not all(key in r for r in schema + free):
                continue
            out.append(
                Figure(
                    what,
                    Stat("jaxserve, schema", unit, [r[key] for r in schema]),
                    Stat("jaxserve, no schema", unit, [r[key] for r in free]),
                    [a[key] / b[key] for a, b in zip(schema, free, strict=False)],
                    goal=">= 1/1.15 (0.87x)",
                    goal_ratio=1 / 1.15,
                    compare_swing=False,
                    note=note,
                )
            )
    return out


def run_script(script: Path, extra: list[str], ctx: Any, out_flag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``script`` with its report sent into the run's working folder
    (``out_flag``: ``--out`` and ``--json`` name a file, ``--output-dir`` a folder)."""
    if not script.is_file():
        raise SystemExit(f"{script} does not exist yet")
    out_dir = ctx.tmp / f"{script.stem}-out"
    out_dir.mkdir(exist_ok=True)
    target = out_dir / f"{script.stem}.json" if out_flag in ("--out", "--json") else out_dir
    cmd = [sys.executable, str(script), *extra, out_flag, str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH.parent)
    found = sorted(out_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
    run = {
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "stdout_tail": proc.stdout[-3000:],
        "stderr_tail": proc.stderr[-3000:],
        "output": str(found[-1]) if found else None,
    }
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{script.name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(found[-1].read_text()), run


class ExternalScenario:
    """One of the two quality scenarios (module-like: the suite reads these attributes)."""

    DEFAULT_ROUNDS = 1
    DEFAULT_WARMUP_ROUNDS = 0

    def __init__(self, name: str, script: str, description: str, extract: Any, out_flag: str) -> None:
        self.NAME, self.script, self.DESCRIPTION, self.extract = name, BENCH / script, description, extract
        self.out_flag = out_flag
        self.COMMAND = f".venv/bin/python benchmarks/suite.py run {name}"
        self.__doc__ = f"{name}: {description}\n\n" + (__doc__ or "")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--script-arg",
            action="append",
            default=[],
            help=f"an argument passed on to {self.script.name} (repeatable)",
        )
        p.add_argument(
            "--report",
            default=None,
            help=f"a report {self.script.name} already wrote (its own full run): take its figures "
            "instead of running it again; the result records the report's commit",
        )

    def run(self, args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
        if args.report:
            data = json.loads(Path(args.report).read_text())
            run = {"report": args.report, "report_command": data.get("command")}
        else:
            data, run = run_script(self.script, list(args.script_arg), ctx, self.out_flag)
        figs = self.extract(data, self.script.stem.replace("_", " "))
        return (
            figs,
            [{**run, "system": self.script.stem, "round": 0, "warmup": False, "ok": True}],
            {
                "script": str(self.script.relative_to(BENCH.parent)),
                "script_args": args.script_arg,
                "script_report": data,
                **(
                    {"git": {"commit": data.get("commit"), "jaxserve_dirty": None, "from_report": args.report}}
                    if args.report
                    else {}
                ),
            },
        )


ACCURACY = ExternalScenario(
    "accuracy",
    "classify_accuracy.py",
    "classification accuracy on the labelled set (benchmarks/data/) per method, SmolLM2-135M",
    accuracy_figures,
    "--out",
)
STRUCTURED = ExternalScenario(
    "structured",
    "structured_bench.py",
    "structured output's cost on SmolLM2-135M: a 64-row step with 0, 1 and 64 constrained rows; "
    "500 extraction jobs with and without a JSON Schema",
    structured_figures,
    "--json",
)
QUANT_QUALITY = ExternalScenario(
    "quant-quality",
    "quant_quality.py",
    "int8/int4 weights and the int8 KV cache against f32 on SmolLM2-135M: greedy agreement, logprob difference, "
    "perplexity",
    quant_figures,
    "--output-dir",
)
