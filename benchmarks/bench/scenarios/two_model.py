"""two-model: a large and a small model on one prefix, past the large worker's capacity, with and without fallback.

Issue 28 item 4. Two workers on one private prefix: ``--large`` (default
``smollm2-135m``, served as ``large``, admission ``--target-ttft``) and
``--small`` (default ``tiny``, served as ``small``), both real engines, both
priced from one prices file (token prices, the large model dearer per token;
``two_model_deploy.write_prices``). The large model is SmolLM2-135M-Instruct,
not the random-weight ``llama-56m``: TTFT is the first streamed *text*, and
most of llama-56m's 32,000 tokens are reserved ones that decode to nothing,
so in a rehearsal 68 of its 115 completed jobs streamed no text and had no
TTFT at all. Steps:

1. ``jaxserve plan --measure`` for both presets (few sizes): the profiles
   ``jaxserve plan`` plans with;
2. the two workers;
3. a capacity probe: ``jaxserve loadtest --model large`` closed loop at
   ``--probe-concurrency`` for ``--probe-duration`` s; the large worker's
   capacity C is the jobs/s it completed;
4. the rates: ``--rate-multipliers`` x C (default 0.5, 1.5, 3: below, past
   and well past capacity), or ``--rates`` as given;
5. per round, two open-loop runs of ``jaxserve loadtest --model large
   --mix chat=1`` at those rates with the same ``--seed`` (the same Poisson
   arrivals and the same jobs: ``jaxserve/loadtest/runner.py`` seeds arrivals
   by (seed, level)): ``no-fallback``, and ``fallback`` with
   ``--fallback-models small --compare-with`` the first, which writes
   ``loadtest-compare.png`` (copied to ``docs/img/two-model-compare.png``);
6. ``jaxserve plan --profile LARGE --compare SMALL --primary-workers 1`` at
   the top rate with that level's measured token counts, once with the
   prices file and once with ``--hardware-per-hour``.

Figures, at the top rate: interactive p95 TTFT and the share of jobs answered
``overloaded``, fallback against no fallback; the share the small model
served; the measured cost per million tokens of the fallback run against
plan's (token prices: the completed jobs' ``usage.cost``, or, where the
worker does not price yet, their tokens priced by the same file, which the
result says; hardware: both workers' price per hour over the level's
elapsed time, divided by the tokens served). Load average and a matmul
probe before each run are recorded: on a shared machine the figures are
only as good as its quiet.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .. import rounds
from ..record import Figure
from . import two_model_deploy as deploy
from .two_model_figures import LABELS, figures, level_table

NAME = "two-model"
DESCRIPTION = (
    "smollm2-135m (large) + tiny (small) on one prefix, open loop past the large worker's capacity, "
    "same arrivals with and without --fallback-models small: p95 TTFT, overloaded, share served, cost vs plan"
)
COMMAND = ".venv/bin/python benchmarks/suite.py run two-model"
DEFAULT_ROUNDS = 1
DEFAULT_WARMUP_ROUNDS = 0
ROOT = Path(__file__).resolve().parents[3]
PLOT = ROOT / "docs" / "img" / "two-model-compare.png"
SYSTEMS = ("no-fallback", "fallback")
#: worker log events counted per worker (jaxserve/worker/fallback.py, job_log.py)
EVENTS = ("job_done", "job_degraded", "job_fallback_none_free", "job_reroute_failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--large", default="smollm2-135m", help="the large model's preset")
    p.add_argument("--small", default="tiny", help="the small model's preset")
    p.add_argument("--large-name", default="large")
    p.add_argument("--small-name", default="small")
    p.add_argument("--large-prices", default="0.40,1.20", help="USD per million prompt,completion tokens")
    p.add_argument("--small-prices", default="0.05,0.15")
    p.add_argument("--large-hardware-per-hour", type=float, default=4.0)
    p.add_argument("--small-hardware-per-hour", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--admission-ttft", type=float, default=0.5, help="the large worker's --target-ttft")
    p.add_argument("--ttft-target-s", type=float, default=2.0, help="the p95 TTFT target the figures are held to")
    p.add_argument("--probe-concurrency", type=int, default=8)
    p.add_argument("--probe-duration", type=float, default=12.0)
    p.add_argument("--rate-multipliers", default="0.5,1.5,3", help="levels as multiples of the probed capacity")
    p.add_argument("--rates", default=None, help="levels in jobs/s (instead of the probe's multiples)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--large-profile", default=None, help="reuse a plan --measure profile instead of measuring")
    p.add_argument("--small-profile", default=None)
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for both workers (repeatable)")


def _prices(text: str) -> tuple[float, float]:
    a, b = (float(x) for x in text.split(","))
    return a, b


def _specs(args: argparse.Namespace) -> tuple[deploy.ModelSpec, deploy.ModelSpec]:
    lp, lc = _prices(args.large_prices)
    sp, sc = _prices(args.small_prices)
    large = deploy.ModelSpec(args.large, args.large_name, lp, lc, args.large_hardware_per_hour)
    small = deploy.ModelSpec(args.small, args.small_name, sp, sc, args.small_hardware_per_hour)
    return large, small


def _jaxserve(line: str) -> list[str]:
    """``jaxserve`` with the arguments of one command line (values quoted
    with ``shlex.quote`` where they may hold spaces)."""
    import queue_common as qc  # benchmarks/ is on sys.path (suite.py)

    return [qc.jaxserve_exe(), *shlex.split(line)]


# ------------------------------------------------------------------ levels
def level_figures(entry: dict[str, Any], jobs: list[dict[str, Any]], prices: Any, hardware_per_hour: float) -> dict:
    """One level of one run, as the result keeps it: the loadtest.json
    figures the table and the section use, and the cost per million tokens
    measured two ways (module docstring)."""
    import numpy as np

    from jaxserve.cost.prices import PriceTable

    assert isinstance(prices, PriceTable)
    ok = [j for j in jobs if j.get("status") == "ok" and not j.get("probe")]
    tokens = sum((j.get("prompt_tokens") or 0) + (j.get("completion_tokens") or 0) for j in ok)
    billed = [j["cost"] for j in ok if j.get("cost") is not None]
    priced = 0.0
    for j in ok:
        c = prices.cost_of(j.get("served_model"), j.get("prompt_tokens") or 0, j.get("completion_tokens") or 0)
        priced += c.amount if c is not None else 0.0
    source = "usage.cost" if ok and len(billed) == len(ok) else "priced from tokens"
    token_cost = sum(billed) if source == "usage.cost" else priced
    hardware_cost = hardware_per_hour * entry["elapsed_s"] / 3600.0
    requests = entry["requests"]
    over = entry["rejections_by_code"].get("overloaded", 0)
    keep = (
        "rate requests completed rejected rejections_by_code errors_by_code elapsed_s requests_per_s "
        "output_tokens_per_s ttft_p50_s ttft_p95_s ttft_p99_s e2e_p95_s prompt_tokens_mean prompt_tokens_p95 "
        "output_tokens_mean output_tokens_p95 served_by_model served_share served_by_fallback fallback_share "
        "cost_total cost_currency capacity_back"
    ).split()
    by_model: dict[str, list[float]] = {}
    for j in ok:
        if j.get("ttft_s") is not None:
            by_model.setdefault(j.get("served_model") or "unknown", []).append(j["ttft_s"])
    return {
        **{k: entry.get(k) for k in keep},
        # who answered shapes the p95: a fallback's jobs and the large model's differ
        "ttft_p95_s_by_model": {m: round(float(np.percentile(v, 95)), 3) for m, v in sorted(by_model.items())},
        "ttft_p50_s_by_model": {m: round(float(np.percentile(v, 50)), 3) for m, v in sorted(by_model.items())},
        # TTFT is the first streamed text: a job whose tokens decode to no text has none
        "ttft_samples": sum(len(v) for v in by_model.values()),
        "overloaded_pct": round(100.0 * over / requests, 3) if requests else None,
        "tokens": tokens,
        "cost_source": source,
        "cost_per_million_tokens": round(token_cost / tokens * 1e6, 6) if tokens else None,
        "priced_per_million_tokens": round(priced / tokens * 1e6, 6) if tokens else None,
        "hardware_cost_per_million_tokens": round(hardware_cost / tokens * 1e6, 6) if tokens else None,
    }


class LoadtestRun:
    """One ``jaxserve loadtest`` over every rate: a contender of the rounds."""

    def __init__(self, name: str, state: dict[str, Any]) -> None:
        self.name, self.state, self.turns = name, state, 0

    def start(self) -> dict[str, Any]:
        return {}

    def turn(self) -> dict[str, Any]:
        s, a = self.state, self.state["args"]
        self.turns += 1
        out = s["tmp"] / f"{self.name}-{self.turns}"
        rates = ",".join(f"{r:g}" for r in s["rates"])
        cmd = _jaxserve(
            f"loadtest --prefix {s['prefix']} --model {a.large_name} --mix chat=1 --rate {rates} "
            f"--duration {s['duration']:g} --cancel-share 0 --seed {a.seed} --no-progress "
            f"--label {shlex.quote(LABELS[self.name])} --ttft-target-s {a.ttft_target_s:g} -o {shlex.quote(str(out))}"
        )
        if self.name == "fallback":
            cmd += ["--fallback-models", a.small_name]
            if s.get("last_no_fallback"):
                cmd += ["--compare-with", str(s["last_no_fallback"])]
        load_before = deploy.load_average()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        (out.parent / f"{out.name}.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode not in (0, 3) or not (out / "loadtest.json").is_file():  # 3: capacity not back, a figure
            return {"ok": False, "error": f"loadtest exited {proc.returncode}: {proc.stderr[-1500:]}"}
        if self.name == "no-fallback":
            s["last_no_fallback"] = out
        elif (out / "loadtest-compare.png").is_file():
            s["compare_png"] = out / "loadtest-compare.png"
        entries = json.loads((out / "loadtest.json").read_text())
        jobs = [json.loads(line) for line in (out / "loadtest-jobs.jsonl").read_text().splitlines() if line]
        levels = [
            level_figures(e, [j for j in jobs if j.get("level") == i], s["prices"], s["hardware_per_hour"])
            for i, e in enumerate(entries)
        ]
        top = levels[-1]
        return {
            "ok": top["ttft_p95_s"] is not None,
            "value": top["ttft_p95_s"],
            "levels": levels,
            "loadtest_exit": proc.returncode,
            "load_avg_before": load_before,
            "load_avg_after": deploy.load_average(),
            "folder": str(out),
            "command": " ".join(cmd[1:]),
        }

    def pids(self) -> list[int]:
        return []  # both runs share the workers: nothing to pause

    def stop(self) -> None:
        pass


# --------------------------------------------------------------- the probe
def probe_capacity(state: dict[str, Any]) -> dict[str, Any]:
    """Jobs/s the large worker completes under a closed loop: the unit of the rates."""
    a = state["args"]
    out = state["tmp"] / "probe"
    cmd = _jaxserve(
        f"loadtest --prefix {state['prefix']} --model {a.large_name} --mix chat=1 "
        f"--concurrency {a.probe_concurrency} --duration {state['probe_duration']:g} --cancel-share 0 "
        f"--seed {a.seed + 1} --no-progress --no-plot --no-capacity-check -o {shlex.quote(str(out))}"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"capacity probe exited {proc.returncode}: {proc.stderr[-1500:]}")
    entry = json.loads((out / "loadtest.json").read_text())[0]
    return {
        "jobs_per_s": entry["requests_per_s"],
        "output_tokens_per_s": entry["output_tokens_per_s"],
        "completed": entry["completed"],
        "rejections_by_code": entry["rejections_by_code"],
        "ttft_p95_s": entry["ttft_p95_s"],
        "command": " ".join(cmd[1:]),
    }


# ------------------------------------------------------------------- plan
def plan(state: dict[str, Any], level: dict[str, Any], hardware: bool) -> dict[str, Any]:
    """``jaxserve plan --compare`` for this deployment (one large worker
    kept, the small one taking the overflow) at the level's rate and
    measured token counts."""
    a, (large, small) = state["args"], state["specs"]
    profiles = state["profiles"]
    cmd = _jaxserve(
        f"plan --profile {shlex.quote(str(profiles['large']))} --compare {shlex.quote(str(profiles['small']))} "
        f"--primary-workers 1 --rps {level['rate']:g} "
        f"--prompt-tokens mean:{level['prompt_tokens_mean']:g},p95:{level['prompt_tokens_p95']:g} "
        f"--output-tokens mean:{level['output_tokens_mean']:g},p95:{level['output_tokens_p95']:g} "
        f"--ttft-target-s {a.ttft_target_s:g} --max-model-len {a.max_model_len} --json"
    )
    if hardware:
        cmd += _jaxserve(
            f"--hardware-per-hour {large.hardware_per_hour:g} "
            f"--fallback-hardware-per-hour {small.hardware_per_hour:g} --currency USD"
        )[1:]
    else:
        cmd += ["--prices", str(state["prices_file"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    text_cmd = [c for c in cmd if c != "--json"]
    text = subprocess.run(text_cmd, capture_output=True, text=True, cwd=ROOT, check=False).stdout
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        return {"error": f"plan exited {proc.returncode}: {proc.stderr[-1500:]}", "command": " ".join(cmd[1:])}
    out: dict[str, Any] = {"command": " ".join(text_cmd[1:]), "exit": proc.returncode, "text": text, "raw": data}
    for d in data.get("plans", []):
        key = "with_fallback" if "fallback" in d["name"] else "alone"
        out[key] = {
            "name": d["name"],
            "workers": d["workers"],
            "share": d["share"],
            "cost_per_day": d["cost_per_day"],
            "cost_per_million_tokens": d["cost_per_million_tokens"],
        }
    return out


# -------------------------------------------------------------------- run
def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    import queue_common as qc
    from jaxserve.cost.prices import PriceTable

    large, small = _specs(args)
    tmp: Path = ctx.tmp
    prices_file = deploy.write_prices(tmp / "prices.json", [large, small])
    state: dict[str, Any] = {
        "args": args,
        "tmp": tmp,
        "specs": (large, small),
        "prices_file": prices_file,
        "prices": PriceTable.from_file(prices_file),
        "hardware_per_hour": large.hardware_per_hour + small.hardware_per_hour,
        "duration": min(args.duration, 6.0) if ctx.smoke else args.duration,
        "probe_duration": min(args.probe_duration, 6.0) if ctx.smoke else args.probe_duration,
        "cores": ctx.machine.get("usable_cpus"),
        "profiles": {},
        "workers": {},
    }
    settings: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "func"}
    settings["load_avg_start"] = deploy.load_average()
    settings["prices"] = json.loads(prices_file.read_text())
    for role, spec, given in (("large", large, args.large_profile), ("small", small, args.small_profile)):
        if given:
            state["profiles"][role] = Path(given)
        else:
            rounds.log(f"plan --measure {spec.preset}")
            m = deploy.measure_profile(
                spec.preset, tmp / f"{spec.preset}-profile.json", tmp / f"measure-{role}.log", args.max_model_len
            )
            state["profiles"][role] = Path(m["profile"])
            settings[f"measure_{role}"] = m
        settings[f"profile_{role}"] = json.loads(state["profiles"][role].read_text())
    help_text = deploy.worker_help()
    worker_prices = "--prices" in help_text
    settings["worker_prices_flag"] = worker_prices
    # Both workers must agree which model is the deployment's default (the
    # one on the single-model queues): otherwise each takes itself for it.
    default_flag = ["--default-model", large.served] if "--default-model" in help_text else []
    settings["worker_default_model_flag"] = bool(default_flag)
    prefix = qc.new_prefix("two-model")
    state["prefix"] = prefix
    engine = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    records: list[dict[str, Any]] = []
    try:
        rounds.log(f"workers on {prefix}: {large.preset} as {large.served}, {small.preset} as {small.served}")
        w_large = deploy.start_worker(
            prefix,
            large,
            log=tmp / "worker-large.log",
            prices=prices_file if worker_prices else None,
            engine=engine,
            extra=["--target-ttft", f"{args.admission_ttft:g}", *default_flag, *args.worker_arg],
        )
        state["workers"]["large"] = w_large
        settings["large_ready_s"] = w_large.wait_consuming(900)
        routing = deploy.routing_declared(prefix)
        settings["routing_by_model"] = routing
        if routing:
            w_small = deploy.start_worker(
                prefix,
                small,
                log=tmp / "worker-small.log",
                prices=prices_file if worker_prices else None,
                engine=engine,
                extra=[*default_flag, *args.worker_arg],
            )
            state["workers"]["small"] = w_small
            settings["small_ready_s"] = w_small.wait_consuming(900)
        else:
            # A build that predates routing: a second worker on the prefix
            # would take the large model's jobs from the default queue.
            rounds.log("the worker does not route by model: the small worker is not started, nothing can fall back")
        settings["worker_commands"] = {k: " ".join(w.cmd[1:]) for k, w in state["workers"].items()}
        probe = probe_capacity(state)
        settings["capacity_probe"] = probe
        state["capacity"] = max(probe["jobs_per_s"], 0.1)
        if args.rates:
            state["rates"] = [float(x) for x in args.rates.split(",")]
        else:
            state["rates"] = [round(float(m) * state["capacity"], 1) for m in args.rate_multipliers.split(",")]
        settings["rates"] = state["rates"]
        rounds.log(f"large worker's capacity {probe['jobs_per_s']} jobs/s; rates {state['rates']}")
        contenders = [LoadtestRun(name, state) for name in SYSTEMS]
        records = rounds.alternate(contenders, ctx.rounds, ctx.warmup_rounds, pause=False)
        fb = [r for r in records if r["system"] == "fallback" and r.get("ok")]
        nf = [r for r in records if r["system"] == "no-fallback" and r.get("ok")]
        if fb:
            state["plans"] = {
                "tokens": plan(state, fb[-1]["levels"][-1], hardware=False),
                "hardware": plan(state, fb[-1]["levels"][-1], hardware=True),
            }
        if nf:
            state.setdefault("plans", {})["tokens_no_fallback_level"] = plan(
                state, nf[-1]["levels"][-1], hardware=False
            )
        settings["plans"] = state.get("plans", {})
        settings["worker_events"] = {k: {e: w.events(e) for e in EVENTS} for k, w in state["workers"].items()}
    finally:
        for w in state["workers"].values():
            w.stop()
        settings["deleted"] = deploy.delete_all(prefix, [large.served, small.served])
    settings["load_avg_end"] = deploy.load_average()
    settings["level_table"] = level_table(records, large.served, small.served)
    rounds.log("levels:\n" + settings["level_table"])
    for name, p in settings.get("plans", {}).items():
        rounds.log(f"plan ({name}):\n{p.get('text') or p.get('error')}")
    png = state.get("compare_png")
    if png is not None:
        settings["compare_png"] = str(png)
        if not ctx.smoke:
            PLOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, PLOT)
            settings["plot"] = str(PLOT.relative_to(ROOT))
    return figures(records, state), records, settings
