"""speculative: speculative decoding on against off, output tokens/s at 1 and 8 concurrent jobs.

Systems, one engine each (``peers/jaxserve_spec.py``: the worker's ``serve``
profile, ``--max-num-seqs 8``), the same model and weights (``--model``,
float32 unless ``--quantization``):

- ``spec-on``: ``num_speculative_tokens`` as given (``--num-speculative-tokens``,
  default the engine's);
- ``spec-off``: ``num_speculative_tokens=0``.

Workloads (``--workloads``), each at each concurrency (``--concurrency``,
1 and 8: at most that many jobs in the engine at once, the next added as
one finishes), ``--jobs`` jobs a turn (default 4 at concurrency 1, 16 at 8):

- ``invoices``: the README's extraction jobs (docs/examples/invoices.csv
  with its chat question, docs/examples/invoice.schema.json enforced), greedy;
  the grammar's forced tokens (keys, quotes) and values copied from the
  invoice are what gets guessed;
- ``summaries``: ``benchmarks/data/summaries.jsonl``, summarize each text in
  two or three sentences (outputs that reuse the text's wording), greedy;
- ``random``: 64 random token ids to 128 tokens, greedy: nothing to copy.

Figure per workload and concurrency: ``spec-on`` against ``spec-off`` in
output tokens/s, the ratio within each round (goals: at least 1.5x on
invoices and summaries, at least 0.97x on random). Every turn also records
a digest of every job's tokens: greedy outputs are the same with and
without speculation, so the two systems' digests must agree (a figure's
note says whether they did), and the guesses made and kept.

Both systems stay loaded and alternate in rounds (``rounds.py``). Run it
once per weight type for the f32 and int8 figures (an int8 or int4 run is the
result and table rows `speculative-int8` / `-int4`, kept beside the f32 ones):

    .venv/bin/python benchmarks/suite.py run speculative
    .venv/bin/python benchmarks/suite.py run speculative --quantization int8

``--smoke``: one round of 2 jobs at concurrency 1 and 2 with 16-token
outputs, a check that the scenario runs, never a figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import models, rounds
from ..record import Figure
from .offline import ServeContender

NAME = "speculative"
DESCRIPTION = (
    "speculative decoding on vs off: output tok/s at 1 and 8 concurrent jobs on invoices, summaries, random prompts"
)
COMMAND = ".venv/bin/python benchmarks/suite.py run speculative [--quantization int8]"

ROOT = Path(__file__).resolve().parents[3]
PEER = ROOT / "benchmarks" / "peers" / "jaxserve_spec.py"
WORKLOADS = ("invoices", "summaries", "random")
GOALS = {"invoices": 1.5, "summaries": 1.5, "random": 0.97}
#: runs whose results (and table rows) are kept apart from the float32 one's: name -> the flags
VARIANTS = {"int8": "--quantization int8", "int4": "--quantization int4"}


def variant(args: argparse.Namespace) -> str | None:
    """The weights' variant this run measures (None: float32, the scenario itself)."""
    return args.quantization


LABELS = {"spec-on": "jaxserve, speculative decoding", "spec-off": "jaxserve, no speculation"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default(), help="preset, GGUF file or folder (bench/models.py)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"], help="weights (default float32)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="spec-on's (default: the engine's)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--concurrency", nargs="+", type=int, default=None, help="jobs in the engine at once (1 8)")
    p.add_argument("--jobs", type=int, default=None, help="jobs per turn (default 4 at concurrency 1, else 2x it)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one turn")


class SpecContender(ServeContender):
    """One engine (``peers/jaxserve_spec.py``), loaded once; a turn runs the
    workload and concurrency set before it."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, timeout: float) -> None:
        super().__init__(name, cmd, log_path, timeout, inner=1)
        self.work = ("random", 1, 1)

    def turn(self) -> dict[str, Any]:
        assert self.peer is not None
        workload, concurrency, jobs = self.work
        self.peer.send(f"run {workload} {concurrency} {jobs}")
        rec = self.peer.next_record(self.timeout)
        ok = rec.get("event") == "result"
        out = {"ok": ok, "value": rec.get("output_tokens_per_s")}
        for key in ("output_tokens", "elapsed_s", "steps", "draft_tokens", "accepted_tokens", "digest"):
            out[key] = rec.get(key)
        if not ok:
            out["error"] = str(rec)[:500]
            out["stderr_tail"] = self.peer.stderr_tail()
        return out


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    concurrency = args.concurrency or ([1, 2] if ctx.smoke else [1, 8])
    contenders = []
    for name in ("spec-on", "spec-off"):
        k = 0 if name == "spec-off" else args.num_speculative_tokens
        cmd = [sys.executable, str(PEER), "--model", args.model, "--serve", "--max-num-seqs", str(max(concurrency))]
        if k is not None:
            cmd += ["--num-speculative-tokens", str(k)]
        else:
            from jaxserve.engine.args import EngineArgs

            cmd += ["--num-speculative-tokens", str(EngineArgs().num_speculative_tokens)]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if ctx.smoke:
            cmd.append("--smoke")
        contenders.append(SpecContender(name, cmd, ctx.tmp / f"{name}.log", args.timeout))
    started: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    try:
        for c in contenders:
            c.start()
        for c in contenders:
            started[c.name] = c.wait_ready()
        for workload in args.workloads:
            for conc in concurrency:
                jobs = args.jobs or (2 if ctx.smoke else (4 if conc == 1 else 2 * conc))
                for c in contenders:
                    c.work = (workload, conc, jobs)
                tag = {"workload": workload, "concurrency": conc, "jobs": jobs}
                records += rounds.alternate(contenders, ctx.rounds, ctx.warmup_rounds, tag=tag)
    finally:
        for c in contenders:
            c.stop()
    weights = args.quantization or "float32"
    figs: list[Figure] = []
    for workload in args.workloads:
        for conc in concurrency:
            where = {"workload": workload, "concurrency": conc}
            what = f"output tok/s, {workload}, {conc} concurrent job(s), {models.label(args.model)} {weights}"
            fig = rounds.figure(
                records,
                what,
                "spec-on",
                "spec-off",
                "tok/s",
                where=where,
                labels=LABELS,
                goal=f">= {GOALS[workload]}x without speculation",
                goal_ratio=GOALS[workload],
                compare_swing=False,
            )
            fig.note = _note(records, where)
            figs.append(fig)
    settings = dict(vars(args))
    settings.update(concurrency=concurrency, started=started)
    return figs, records, settings


def _note(records: list[dict[str, Any]], where: dict[str, Any]) -> str:
    """Whether both systems produced the same tokens, and how many guesses spec-on kept."""
    mine = [r for r in records if r.get("ok") and all(r.get(k) == v for k, v in where.items())]
    digests = {r["system"]: {r.get("digest")} for r in mine}
    for r in mine:
        digests[r["system"]].add(r.get("digest"))
    same = len({d for ds in digests.values() for d in ds}) == 1
    on = [r for r in mine if r["system"] == "spec-on"]
    drafted = sum(r.get("draft_tokens") or 0 for r in on)
    kept = sum(r.get("accepted_tokens") or 0 for r in on)
    share = f"{kept / drafted:.0%}" if drafted else "n/a"
    return f"outputs {'identical' if same else 'DIFFER'} on/off; guesses kept {kept}/{drafted} ({share})"
