"""memory: resident memory of a worker serving SmolLM2-135M in int8 (and int4) against f32.

Each turn starts ``jaxserve worker --model M [--quantization Q]`` (its engine
in a process of its own, the CLI default), waits until it consumes, answers
``--jobs`` interactive jobs (so every compiled path the serving touches is
in memory), lets it settle for a second, and reads VmRSS of the worker and
all its descendants (``procs.tree_rss_mib``). Systems alternate over
``--rounds``; the figure is int8's (int4's) RSS against f32's, goal <= 0.4x.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from .. import models, rounds
from ..procs import tree_rss_mib
from ..record import Figure

NAME = "memory"
DESCRIPTION = "resident memory (worker + engine process) serving SmolLM2-135M: int8 and int4 vs f32"
COMMAND = ".venv/bin/python benchmarks/suite.py run memory"
DEFAULT_ROUNDS = 3
DEFAULT_WARMUP_ROUNDS = 0
LABELS = {"f32": "worker f32", "int8": "worker int8", "int4": "worker int4"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default())
    p.add_argument("--systems", nargs="+", default=["f32", "int8", "int4"], choices=list(LABELS))
    p.add_argument("--jobs", type=int, default=8, help="interactive jobs answered before the reading")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--worker-arg", action="append", default=[], help="extra `jaxserve worker` flag (repeatable)")


async def _answer(prefix: str, n: int) -> int:
    import queue_common as qc  # benchmarks/ is on sys.path (suite.py)
    from jaxserve.client import AsyncClient

    client = await AsyncClient(qc.AMQP_URL, prefix=prefix, name="bench-memory").connect()
    try:
        results = await asyncio.gather(
            *(
                client.submit(
                    f"Write one sentence about the number {i}.",
                    queue="interactive",
                    max_tokens=16,
                    temperature=0,
                    cache=False,
                    timeout=300,
                )
                for i in range(n)
            )
        )
        return sum(1 for r in results if r.ok)
    finally:
        await client.delete_reply_queue()
        await client.close()


class MemoryContender:
    def __init__(self, kind: str, args: argparse.Namespace, ctx: Any) -> None:
        self.name, self.args, self.ctx, self.turns = kind, args, ctx, 0

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        import queue_common as qc

        self.turns += 1
        prefix = qc.new_prefix(f"mem-{self.name}")
        engine = {
            "model": self.args.model,
            "max_num_seqs": self.args.max_num_seqs,
            "max_model_len": self.args.max_model_len,
        }
        extra = ["--store", "memory", "--log-level", "warning", *self.args.worker_arg]
        if self.name != "f32":
            extra += ["--quantization", self.name]
        worker = qc.WorkerProc(prefix, engine, extra, self.ctx.tmp / f"worker-{self.name}-{self.turns}.log")
        try:
            ready_s = worker.wait_consuming(timeout=900)
            rss_ready = tree_rss_mib(worker.pid)
            answered = asyncio.run(_answer(prefix, self.args.jobs))
            time.sleep(1.0)
            rss = tree_rss_mib(worker.pid)
        finally:
            worker.stop()
            qc.delete_topology(prefix)
        ok = answered == self.args.jobs
        return {
            "ok": ok,
            "value": rss,
            "rss_at_ready_mib": rss_ready,
            "ready_s": round(ready_s, 1),
            "answered": answered,
            **({} if ok else {"error": f"{answered}/{self.args.jobs} jobs answered"}),
        }

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    cs = [MemoryContender(kind, args, ctx) for kind in args.systems]
    records = rounds.alternate(cs, ctx.rounds, ctx.warmup_rounds)
    figs = []
    for kind in args.systems:
        if kind == "f32" or "f32" not in args.systems:
            continue
        goal = {"goal": "<= 0.4x", "goal_ratio": 0.4} if kind == "int8" else {}
        figs.append(
            rounds.figure(
                records,
                f"resident memory of a worker serving {models.label(args.model)} (worker + engine process)",
                kind,
                "f32",
                "MiB",
                labels=LABELS,
                higher_is_better=False,
                compare_swing=False,
                **goal,
            )
        )
    if not figs:
        figs = [
            rounds.figure(
                records,
                f"resident memory of a worker serving {models.label(args.model)}",
                k,
                None,
                "MiB",
                labels=LABELS,
            )
            for k in args.systems
        ]
    return figs, records, dict(vars(args))
