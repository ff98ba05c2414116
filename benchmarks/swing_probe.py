"""How much jaxserve's offline throughput swings from one run to the next, and why.

    .venv/bin/python benchmarks/swing_probe.py [--rounds 5] [--num-prompts 64] [--busy none,free,pinned]
        [--config NAME=VAR=VALUE,VAR=VALUE ...] [--taskset 0,1] [--nice -10] [--json]

Starts one jaxserve engine per ``--config`` (``benchmarks/peers/jaxserve_offline.py
--serve``: the engine ``jaxserve bench offline`` builds, kept loaded, the way
``offline_throughput.py`` interleaves it with its peers), each with its own
environment on top of this one (e.g. ``--config pjrt1=PJRT_NPROC=1``; the
default is one configuration, ``default``, with nothing changed). Then
``--rounds`` rounds: in each, every (configuration, background) pair does one
timed run of ``--num-prompts`` random ``--input-len``-token prompts to
``--output-len`` greedy tokens, in an order that rotates from round to round.
The background is ``none`` (jaxserve alone), ``free`` (one ``python -c "while
True: pass"`` beside it, placed by the OS) or ``pinned`` (that loop pinned to
the last allowed CPU), started just before the run and killed after it.

Per pair it prints the median output tokens/s, min, max and max/min, and two
measures that noise from other processes on a shared machine moves far less
than wall time: the engine process's CPU seconds per 1,000 output tokens (all
its threads; waiting that spins instead of blocking shows up here, and grows
when a busy loop takes a core) and its involuntary context switches per
output token (threads preempted: more runnable threads than cores).

``--nice`` runs the engines and the busy loop at that niceness (below 0 needs
root): on a machine that other people's compilers and tests keep busy, it
lets the comparison be between the configurations and the busy loop rather
than whatever else runs (both sides get the same priority).

Why these: a pool with more runnable threads than cores, or a thread spinning
on a core that the thread it waits for needs, makes throughput depend on which
thread the OS preempts; a design without either loses about the share of the
machine the busy loop takes (one core of two -> about 2/3 throughput with two
runnable compute threads) and no more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE / "peers" / "jaxserve_offline.py"
PREFIX = "@@bench "
BACKGROUNDS = ("none", "free", "pinned")


@dataclass
class Run:
    """One timed run: throughput and what the engine process spent on it."""

    tok_s: float
    cpu_s_per_1k: float
    nivcsw_per_token: float


@dataclass
class Pair:
    """A (configuration, background) pair's runs across rounds."""

    config: str
    background: str
    runs: list[Run] = field(default_factory=list)

    def summary(self) -> dict:
        rates = [r.tok_s for r in self.runs]
        return {
            "config": self.config,
            "background": self.background,
            "runs_tok_s": rates,
            "median_tok_s": round(statistics.median(rates), 1),
            "min_tok_s": min(rates),
            "max_tok_s": max(rates),
            "max_over_min": round(max(rates) / min(rates), 3),
            "median_cpu_s_per_1k_tokens": round(statistics.median(r.cpu_s_per_1k for r in self.runs), 3),
            "median_nivcsw_per_token": round(statistics.median(r.nivcsw_per_token for r in self.runs), 3),
        }


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=VAR=VALUE,VAR=VALUE`` (or just ``NAME``) -> (name, environment)."""
    name, _, rest = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--config needs NAME[=VAR=VALUE,...], got {text!r}")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not var or not eq:
            raise argparse.ArgumentTypeError(f"--config {name}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def process_counters(pid: int) -> tuple[float, int]:
    """(CPU seconds of every thread, involuntary context switches of every
    thread) of a live process, from /proc."""
    hz = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / hz
    nivcsw = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("nonvoluntary_ctxt_switches:"):
                        nivcsw += int(line.split()[1])
        except FileNotFoundError:  # the thread ended while we read
            pass
    return cpu, nivcsw


class Engine:
    """A served jaxserve engine (the offline peer's ``--serve`` protocol)."""

    def __init__(self, name: str, env: dict[str, str], argv: list[str], nice: int) -> None:
        self.name = name
        if nice:
            argv = ["nice", "-n", str(nice), *argv]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        self.ready = self._read("ready")

    def _read(self, event: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                record = json.loads(line[len(PREFIX) :])
                if record.get("event") == "error":
                    raise RuntimeError(f"{self.name}: {record.get('error')}")
                if record.get("event") == event:
                    return record
        raise RuntimeError(f"{self.name}: the engine exited ({self.proc.wait()}) before {event!r}")

    def run_once(self) -> Run:
        assert self.proc.stdin is not None
        cpu0, cs0 = process_counters(self.proc.pid)
        self.proc.stdin.write("run 1\n")
        self.proc.stdin.flush()
        record = self._read("result")
        cpu1, cs1 = process_counters(self.proc.pid)
        tokens = record["output_tokens"]
        return Run(
            record["output_tokens_per_s"], round((cpu1 - cpu0) * 1000 / tokens, 3), round((cs1 - cs0) / tokens, 3)
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_background(kind: str, nice: int) -> subprocess.Popen | None:
    if kind == "none":
        return None
    argv = [sys.executable, "-c", "while True: pass"]
    if kind == "pinned":
        argv = ["taskset", "-c", str(max(os.sched_getaffinity(0))), *argv]
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    return subprocess.Popen(argv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--busy",
        default="none,pinned",
        help=f"backgrounds to run each configuration with, comma-separated: {', '.join(BACKGROUNDS)}",
    )
    ap.add_argument(
        "--config",
        action="append",
        type=parse_config,
        default=None,
        help="NAME=VAR=VALUE,VAR=VALUE: an engine with these environment variables (repeatable)",
    )
    ap.add_argument(
        "--taskset",
        default=None,
        help="CPU list the engines may use (e.g. 0,1), as taskset -c",
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness of the engines and the busy loop (< 0: root)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    args = ap.parse_args()
    backgrounds = [b for b in args.busy.split(",") if b]
    for b in backgrounds:
        if b not in BACKGROUNDS:
            ap.error(f"--busy: {b!r} is not one of {', '.join(BACKGROUNDS)}")
    configs = args.config or [("default", {})]

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompts))
        argv = [
            sys.executable,
            str(PEER),
            "--model",
            args.model,
            "--prompts",
            str(prompt_file),
            "--output-len",
            str(args.output_len),
            "--serve",
        ]
        if args.taskset:
            argv = ["taskset", "-c", args.taskset, *argv]
        engines = {name: Engine(name, env, argv, args.nice) for name, env in configs}
        pairs = {(name, b): Pair(name, b) for name, _ in configs for b in backgrounds}
        order = list(pairs)
        try:
            for r in range(args.rounds):
                shift = r % len(order)
                for key in order[shift:] + order[:shift]:
                    busy = start_background(key[1], args.nice)
                    try:
                        time.sleep(0.2 if busy else 0)
                        run = engines[key[0]].run_once()
                    finally:
                        if busy:
                            busy.kill()
                            busy.wait()
                    pairs[key].runs.append(run)
                    print(
                        f"round {r} {key[0]:>12s} {key[1]:>6s}: {run.tok_s:8.1f} tok/s  "
                        f"{run.cpu_s_per_1k:6.2f} cpu-s/1k tok  {run.nivcsw_per_token:6.2f} nivcsw/tok",
                        flush=True,
                    )
        finally:
            for engine in engines.values():
                engine.close()

    summaries = [p.summary() for p in pairs.values()]
    print(
        f"\n{args.model}, {args.num_prompts} prompts, {args.input_len} -> {args.output_len}, "
        f"{args.rounds} rounds, nice {args.nice}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'config':>12s} {'busy':>6s} {'median':>8s} {'min':>8s} {'max':>8s} {'max/min':>7s} "
        f"{'cpu-s/1k':>8s} {'nivcsw/tok':>10s}"
    )
    for s in summaries:
        print(
            f"{s['config']:>12s} {s['background']:>6s} {s['median_tok_s']:8.1f} {s['min_tok_s']:8.1f} "
            f"{s['max_tok_s']:8.1f} {s['max_over_min']:7.3f} {s['median_cpu_s_per_1k_tokens']:8.2f} "
            f"{s['median_nivcsw_per_token']:10.2f}"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "num_prompts": args.num_prompts,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "rounds": args.rounds,
                    "pairs": summaries,
                }
            )
        )


if __name__ == "__main__":
    main()
