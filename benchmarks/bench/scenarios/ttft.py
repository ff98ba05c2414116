"""ttft: interactive time to first token on SmolLM2-135M, idle and behind 300 queued batch jobs, f32 and int8.

Each turn is one run of ``benchmarks/queue_interactive_ttft.py`` on a fresh
worker (``--model``, default ``bench/models.py``; ``--quantization int8``
for the int8 system): ``--samples`` streamed interactive jobs (varied
prompts, ``cache: false``, so no answer comes from the response cache) on
the idle worker, then the same number with the batch queue kept at least
``--min-depth`` (300) deep; TTFT = publish to the first streamed chunk, as
the reference client sees it. The turn's figures are the two medians. f32
and int8 alternate over ``--rounds`` (default 3; the issue asks for the
median of at least three runs).

Figures per system: the loaded median against the idle median (ratio
loaded/idle, goal <= 1.5x) and the loaded median itself (goal < 300 ms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .. import models, rounds
from ..record import Figure, Stat

NAME = "ttft"
DESCRIPTION = "interactive TTFT on SmolLM2-135M (streaming, varied prompts, no cache), idle vs 300 queued batch jobs, f32 and int8"
COMMAND = ".venv/bin/python benchmarks/suite.py run ttft"
DEFAULT_ROUNDS = 3
DEFAULT_WARMUP_ROUNDS = 0
SCRIPT = Path(__file__).resolve().parents[2] / "queue_interactive_ttft.py"
LABELS = {"f32": "jaxserve f32", "int8": "jaxserve int8", "int4": "jaxserve int4"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default())
    p.add_argument("--systems", nargs="+", default=["f32", "int8"], choices=list(LABELS))
    p.add_argument("--samples", type=int, default=10, help="interactive jobs per phase and turn")
    p.add_argument("--batch-depth", type=int, default=400)
    p.add_argument("--min-depth", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--worker-arg", action="append", default=[], help="extra `jaxserve worker` flag (repeatable)")


class TtftContender:
    def __init__(self, kind: str, args: argparse.Namespace, ctx: Any) -> None:
        self.name, self.args, self.ctx, self.turns = kind, args, ctx, 0

    def start(self) -> dict[str, Any]:
        return {}

    def command(self, out: Path) -> list[str]:
        a = self.args
        cmd = [
            sys.executable,
            str(SCRIPT),
            "--model",
            a.model,
            "--rounds",
            "1",
            "--samples",
            str(a.samples),
            "--batch-depth",
            str(a.batch_depth),
            "--min-depth",
            str(a.min_depth),
            "--max-tokens",
            str(a.max_tokens),
            "--batch-max-tokens",
            str(a.batch_max_tokens),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--max-model-len",
            str(a.max_model_len),
            "--json-out",
            str(out),
        ]
        extra = list(a.worker_arg) + ([] if self.name == "f32" else [f"--quantization={self.name}"])
        return cmd + [f"--worker-arg={x}" for x in extra]

    def turn(self) -> dict[str, Any]:
        self.turns += 1
        out = self.ctx.tmp / f"ttft-{self.name}-{self.turns}.json"
        proc = subprocess.run(self.command(out), capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            return {"ok": False, "error": f"rc {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
        data = json.loads(out.read_text())
        s = data["summary"]
        return {
            "ok": True,
            "value": round(1000 * s["ttft_loaded_median_s"], 2),
            "idle_ms": round(1000 * s["ttft_idle_median_s"], 2),
            "summary": s,
            "loaded_ok": data["loaded"]["n"],
            "worker_command": data.get("worker_command"),
        }

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def figures(records: list[dict[str, Any]], systems: list[str], model: str) -> list[Figure]:
    out = []
    depth = min((r["summary"]["min_batch_depth_at_loaded_publish"] for r in records if r.get("ok")), default=0)
    for kind in systems:
        rows = sorted(
            (r for r in records if r["system"] == kind and not r["warmup"] and r.get("ok")), key=lambda r: r["round"]
        )
        loaded = Stat(f"{LABELS[kind]} loaded", "ms", [r["value"] for r in rows])
        idle = Stat(f"{LABELS[kind]} idle", "ms", [r["idle_ms"] for r in rows])
        ratios = [round(r["value"] / r["idle_ms"], 3) for r in rows if r["idle_ms"]]
        what = f"interactive TTFT p50 on {model}, {depth}+ queued batch jobs vs idle"
        out.append(
            Figure(
                what, loaded, idle, ratios, goal="<= 1.5x", goal_ratio=1.5, higher_is_better=False, compare_swing=False
            )
        )
        out.append(
            Figure(
                f"interactive TTFT p50 under {depth}+ queued batch jobs, {model}",
                Stat(f"{LABELS[kind]} loaded", "ms", list(loaded.runs)),
                goal="< 300 ms",
                goal_value=300.0,
                higher_is_better=False,
            )
        )
    return out


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    cs = [TtftContender(kind, args, ctx) for kind in args.systems]
    records = rounds.alternate(cs, ctx.rounds, ctx.warmup_rounds)
    return figures(records, args.systems, models.label(args.model)), records, dict(vars(args))
