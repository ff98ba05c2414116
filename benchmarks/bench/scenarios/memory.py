"""memory: resident memory of a worker serving SmolLM2-135M in int8 (and int4) against f32 and llama-server.

Each turn starts ``jaxserve worker --model M [--quantization Q]`` (its engine
in a process of its own, the CLI default), waits until it consumes, answers
``--jobs`` interactive jobs (so every compiled path the serving touches is
in memory), lets it settle for a second, and reads VmRSS of the worker and
all its descendants (``procs.tree_rss_mib``). ``int8-kv8`` is the int8
worker with ``--kv-cache-dtype int8``; ``int8-kv8-fresh`` that worker with
``--engine-arg cache_forward_programs=false`` (its forward programs compiled
at start, not loaded from the persistent compilation cache, where a
loaded one holds more than a fresh one on XLA:CPU; the turns' ``ready_s``
show the start it costs).

``llama-server``: llama.cpp's server (``peers/setup_llamacpp.sh``) on the
Q8_0 file (``peers/prepare_smollm2.py``) with the same capacity, ``-np``
``--max-num-seqs`` slots of ``--max-model-len`` tokens each (``-c`` their
product; its KV cache in float16, its default), 2 threads; measured the same
way: ready (``/health``), ``--jobs`` completions of 16 tokens answered over
HTTP at once, a second's settling, VmRSS of the process.

Systems alternate over ``--rounds``; the figures are int8's (int4's) RSS
against f32's (goal <= 0.4x) and int8's against llama-server's (goal <= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import models, rounds
from ..procs import tree_rss_mib
from ..record import Figure

ROOT = Path(__file__).resolve().parents[3]

NAME = "memory"
DESCRIPTION = "resident memory (worker + engine process) serving SmolLM2-135M: int8 and int4 vs f32"
COMMAND = ".venv/bin/python benchmarks/suite.py run memory"
DEFAULT_ROUNDS = 3
#: one start of each system first, so the timed rounds load what it compiled
#: from the persistent cache, as every restart does (a first start compiles
#: and holds about 150 MiB less)
DEFAULT_WARMUP_ROUNDS = 1
LABELS = {
    "f32": "worker f32",
    "int8": "worker int8",
    "int4": "worker int4",
    "int8-kv8": "worker int8, int8 KV",
    "int8-kv8-fresh": "worker int8, int8 KV, forward programs compiled at start",
    "llama-server": "llama-server Q8_0",
}
#: each system's extra worker flags (llama-server is not a worker)
WORKER_FLAGS = {
    "f32": [],
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
    "int8-kv8": ["--quantization", "int8", "--kv-cache-dtype", "int8"],
}
WORKER_FLAGS["int8-kv8-fresh"] = [*WORKER_FLAGS["int8-kv8"], "--engine-arg", "cache_forward_programs=false"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default())
    p.add_argument(
        "--systems",
        nargs="+",
        default=["f32", "int8", "int4", "int8-kv8", "int8-kv8-fresh", "llama-server"],
        choices=list(LABELS),
    )
    p.add_argument("--llamacpp-bin", default=str(ROOT / ".peers" / "llama.cpp" / "build" / "bin"))
    p.add_argument("--gguf-dir", default=str(models.PEER_DIR), help="folder of the Q8_0 GGUF file")
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


def reading(rss: float, rss_ready: float, ready_s: float, answered: int, jobs: int) -> dict[str, Any]:
    """One turn's record: the RSS after the jobs (the figure), at ready, and
    whether every job was answered (else the turn does not count)."""
    ok = answered == jobs
    return {
        "ok": ok,
        "value": rss,
        "rss_at_ready_mib": rss_ready,
        "ready_s": round(ready_s, 1),
        "answered": answered,
        **({} if ok else {"error": f"{answered}/{jobs} jobs answered"}),
    }


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
        extra = ["--store", "memory", "--log-level", "warning", *self.args.worker_arg, *WORKER_FLAGS[self.name]]
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
        return reading(rss, rss_ready, ready_s, answered, self.args.jobs)

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except OSError:
        return 0


def _complete(url: str, i: int) -> bool:
    body = json.dumps({"prompt": f"Write one sentence about the number {i}.", "n_predict": 16, "temperature": 0})
    req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status == 200 and bool(json.loads(r.read()).get("content") is not None)
    except OSError:
        return False


class LlamaServerContender:
    """llama-server on the Q8_0 file, started fresh each turn as a worker is."""

    def __init__(self, args: argparse.Namespace, ctx: Any) -> None:
        self.name, self.args, self.ctx, self.turns = "llama-server", args, ctx, 0
        self.binary = Path(args.llamacpp_bin) / "llama-server"
        self.gguf = Path(args.gguf_dir) / "SmolLM2-135M-Instruct.Q8_0.gguf"
        for path, how in ((self.binary, "peers/setup_llamacpp.sh"), (self.gguf, "peers/prepare_smollm2.py")):
            if not path.is_file():
                raise SystemExit(f"{path} missing: run benchmarks/{how}")

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        import queue_common as qc

        self.turns += 1
        port = qc.free_port()
        slots, per_slot = self.args.max_num_seqs, self.args.max_model_len
        cmd = [str(self.binary), "-m", str(self.gguf), "-c", str(slots * per_slot), "-np", str(slots)]
        cmd += ["--threads", "2", "--host", "127.0.0.1", "--port", str(port)]
        log = open(self.ctx.tmp / f"llama-server-{self.turns}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            while _get(f"{base}/health") != 200:
                if proc.poll() is not None or time.perf_counter() - t0 > 300:
                    return {"ok": False, "value": None, "error": f"llama-server did not start (rc {proc.poll()})"}
                time.sleep(0.2)
            ready_s = time.perf_counter() - t0
            rss_ready = tree_rss_mib(proc.pid)
            with ThreadPoolExecutor(self.args.jobs) as pool:
                answered = sum(pool.map(lambda i: _complete(f"{base}/completion", i), range(self.args.jobs)))
            time.sleep(1.0)
            rss = tree_rss_mib(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        return {**reading(rss, rss_ready, ready_s, answered, self.args.jobs), "cmd": cmd}

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    cs: list[Any] = [
        LlamaServerContender(args, ctx) if kind == "llama-server" else MemoryContender(kind, args, ctx)
        for kind in args.systems
    ]
    records = rounds.alternate(cs, ctx.rounds, ctx.warmup_rounds)
    figs = []
    what = f"resident memory of a worker serving {models.label(args.model)} (worker + engine process)"
    for kind in ("int8", "int8-kv8", "int8-kv8-fresh"):
        if kind in args.systems and "llama-server" in args.systems:
            goal = {"goal": "<= 2x", "goal_ratio": 2.0} if kind == "int8" else {}
            figs.append(
                rounds.figure(
                    records,
                    f"{what} against llama-server's process, {args.max_num_seqs} slots x {args.max_model_len} tokens",
                    kind,
                    "llama-server",
                    "MiB",
                    labels=LABELS,
                    higher_is_better=False,
                    **goal,
                )
            )
    for kind in args.systems:
        if kind in ("f32", "llama-server") or "f32" not in args.systems:
            continue
        goal = {"goal": "<= 0.4x", "goal_ratio": 0.4} if kind == "int8" else {}
        figs.append(
            rounds.figure(
                records,
                what,
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
