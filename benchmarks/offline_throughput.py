"""Side-by-side offline throughput: jaxserve, vLLM (CPU) and transformers.

All three systems load the same checkpoint folder (default: the
``llama-56m`` preset, materialized by ``jaxserve.presets.resolve_model``) and
run N prompts of ``--input-len`` random token ids to exactly ``--output-len``
new tokens each, greedy, EOS ignored, for N in ``--num-prompts`` (default 64
and 1).

    .venv/bin/python benchmarks/offline_throughput.py            # the full run
    .venv/bin/python benchmarks/offline_throughput.py --repeats 1 --num-prompts 1

How: these machines are shared, and their speed moves by a factor of three
within minutes, so the systems must be measured close together in time. For
each N every system is started once, in ``--serve`` mode (``peers/``: loads,
warms up, waits), and then, after ``--warmup-rounds`` untimed runs of each (default 1,
recorded as round -1), ``--repeats`` rounds each time one run per system
in turn (rotating order), only one system computing at a time: the idle
peers are paused (SIGSTOP to their process trees, SIGCONT after the run;
left running, vLLM's idle engine core used up to 0.6 CPU-seconds during a
6-second run of another system), and their CPU use during each run is
recorded to show it (``--no-pause-idle`` leaves them running). Medians
are reported, and ratios both of medians and within each round. A 1 s numpy
matmul probe before each run records how loaded the machine was.

- jaxserve: ``peers/jaxserve_offline.py``, the engine exactly as ``jaxserve
  bench offline`` builds it; after the rounds the CLI itself (``.venv/bin/
  jaxserve bench offline --model FOLDER --num-prompts N --input-len 128
  --output-len 128 --json``) runs once as a cross-check.
- vLLM: ``peers/vllm_offline.py`` under ``--vllm-python`` (default
  ``.venv-vllm/bin/python``; see benchmarks/README.md to build it).
- transformers: ``peers/hf_offline.py`` under this Python.

Prompts are written to a JSON file with jaxserve's bench recipe:
``np.random.default_rng(0).choice(pool, size=input_len)`` per prompt,
``pool`` the non-special token ids, so all systems, the CLI included, get
the same token ids.

Machine rates (``benchmarks/machine_rates.py``) are measured before and
after; the better of the two is the reference. At N > 1 the run is compute
bound: achieved FLOP/s = output tok/s x 2 x (non-embedding + lm_head
parameters), compared with the measured float32 matmul rate (the share
counting the timed run's prefill work is given too). At N = 1 it is
bandwidth bound: achieved bytes/s = output tok/s x (bytes of those weights +
the KV cache read per token), compared with the measured read bandwidth.

Writes ``benchmarks/results/offline-<UTC date-time>.json`` and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
PREFIX = "@@bench "  # peers/common.py's result lines
SYSTEMS = ("jaxserve", "vllm", "transformers")


# ------------------------------------------------------------------ prompts


def special_token_ids(folder: Path) -> set[int]:
    """The ids jaxserve's bench keeps out of its prompt pool: tokenizer
    special ids plus every EOS id of tokenizer, config and generation config."""
    from jaxserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    special = set(tok.all_special_ids) | set(tok.eos_token_ids)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                special.add(eos)
            elif isinstance(eos, list):
                special.update(int(e) for e in eos)
    return special


def make_prompts(folder: Path, num_prompts: int, input_len: int, seed: int = 0) -> list[list[int]]:
    from jaxserve.tokenizer.tokenizer import Tokenizer

    config = json.loads((folder / "config.json").read_text())
    vocab = min(Tokenizer.from_folder(folder).vocab_size, int(config["vocab_size"]))
    special = special_token_ids(folder)
    pool = np.array([i for i in range(vocab) if i not in special])
    rng = np.random.default_rng(seed)
    return [rng.choice(pool, size=input_len).tolist() for _ in range(num_prompts)]


# -------------------------------------------------------------- model maths


def model_costs(folder: Path, input_len: int, output_len: int) -> dict:
    """Per-output-token work of a decode step of the checkpoint."""
    c = json.loads((folder / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    head_dim = c.get("head_dim") or h // heads
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[c.get("torch_dtype") or c.get("dtype") or "float32"]
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * inter
    layer_params = layers * per_layer
    lm_head = h * vocab
    matmul_params = layer_params + lm_head
    # Average context a decode step attends over.
    mean_ctx = input_len + (output_len + 1) / 2
    attn_flops = layers * 2 * 2 * mean_ctx * q_dim  # QK^T and PV
    kv_bytes = layers * 2 * mean_ctx * kv_dim * itemsize
    return {
        "layer_params": layer_params,
        "lm_head_params": lm_head,
        "matmul_params_per_token": matmul_params,
        "flops_per_output_token": 2 * matmul_params,
        "attention_flops_per_output_token": attn_flops,
        # Everything the timed run computes, prefill included (the last
        # prompt token's logits are the first output token's).
        "run_flops_per_prompt": 2 * layer_params * input_len
        + (2 * layer_params + attn_flops) * (output_len - 1) + 2 * lm_head * output_len,
        "weight_bytes_per_token": matmul_params * itemsize,
        "kv_bytes_per_token": kv_bytes,
        "itemsize": itemsize,
    }


# -------------------------------------------------------------------- runs


class Peer:
    """One system in ``--serve`` mode: started once per prompt count, then
    asked for timed runs one at a time (see ``peers/common.py``)."""

    def __init__(self, system: str, cmd: list[str], log_path: Path) -> None:
        self.system = system
        self.cmd = cmd
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1, cwd=ROOT)
        self.records: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                try:
                    self.records.put(json.loads(line[len(PREFIX):]))
                except json.JSONDecodeError:
                    pass
        self.records.put({"event": "exit", "returncode": self.proc.wait()})

    def next_record(self, timeout: float) -> dict:
        try:
            return self.records.get(timeout=timeout)
        except queue.Empty:
            return {"event": "timeout", "error": f"no answer within {timeout} s"}

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("quit")
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()  # this process only: the one we started
            self.proc.wait()
        self.log.close()


def peer_command(system: str, args, folder: Path, prompts_file: Path) -> list[str]:
    common = ["--model", str(folder), "--prompts", str(prompts_file), "--output-len", str(args.output_len), "--serve"]
    if system == "jaxserve":
        return [sys.executable, str(HERE / "peers" / "jaxserve_offline.py"), *common]
    if system == "vllm":
        return [args.vllm_python, str(HERE / "peers" / "vllm_offline.py"), *common,
                "--threads-bind", args.vllm_threads_bind]
    if system == "transformers":
        return [sys.executable, str(HERE / "peers" / "hf_offline.py"), *common]
    raise ValueError(system)


def cli_command(args, folder: Path, n: int) -> list[str]:
    return [
        str(ROOT / ".venv" / "bin" / "jaxserve"), "bench", "offline", "--model", str(folder),
        "--num-prompts", str(n), "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--json",
    ]


def run_cli(cmd: list[str], timeout: float) -> dict:
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                continue
            result.update(ok=True, process_s=round(time.perf_counter() - started, 1))
            return result
    return {"ok": False, "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}


def _process_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Children of every process and each one's user + system CPU seconds (Linux /proc)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    return children, stats


def tree_pids(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``pid`` and its descendants (``children``: a ``_process_table`` already read)."""
    if children is None:
        children, _ = _process_table()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (Linux /proc)."""
    children, stats = _process_table()
    return sum(stats.get(p, 0.0) for p in tree_pids(pid, children))


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` and its descendants (gone ones are skipped)."""
    for p in tree_pids(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def matmul_probe(seconds: float = 1.0, n: int = 1024) -> float:
    """GFLOP/s of float32 numpy matmuls over about ``seconds``: how loaded the machine is right now."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return round(2 * n**3 * count / (time.perf_counter() - t0) / 1e9, 1)


def git_state() -> dict:
    """The commit measured, and whether jaxserve/ had uncommitted changes."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None
    return {"head": git("rev-parse", "--short", "HEAD"), "jaxserve_dirty": bool(git("status", "--porcelain", "jaxserve"))}


def machine_rates() -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "machine_rates.py"), "--json"],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_prompt_count(n: int, args, folder: Path, prompts_file: Path, logdir: Path, log) -> tuple[list, dict]:
    """Start every system's peer for ``n`` prompts, then interleave timed runs."""
    inner = args.inner or (1 if n >= 8 else 3)
    peers = {}
    runs: list[dict] = []
    ready: dict[str, dict] = {}
    try:
        for system in args.systems:
            peers[system] = Peer(system, peer_command(system, args, folder, prompts_file),
                                 logdir / f"{system}-{n}.log")
        for system, peer in peers.items():
            rec = peer.next_record(args.timeout)
            if rec.get("event") != "ready":
                raise RuntimeError(f"{system} did not start: {rec}\n{peer.stderr_tail()}")
            ready[system] = rec
            log(f"{system} ready ({rec.get('startup_s')} s to load and warm up)")
        def one_run(system: str, rnd: int) -> dict:
            """One run of ``system`` with the other peers paused."""
            others = {s: tree_cpu_seconds(p.proc.pid) for s, p in peers.items() if s != system}
            probe = matmul_probe() if args.probe else None
            load = os.getloadavg()[0]
            paused = [peers[s].proc.pid for s in others] if args.pause_idle else []
            for pid in paused:  # idle peers may still spin (vLLM's engine core polls)
                signal_tree(pid, signal.SIGSTOP)
            try:
                peers[system].send(f"run {inner}")
                rec = peers[system].next_record(args.timeout)
            finally:
                for pid in paused:
                    signal_tree(pid, signal.SIGCONT)
            idle_cpu = {s: round(tree_cpu_seconds(peers[s].proc.pid) - c, 2) for s, c in others.items()}
            rec.update(system=system, num_prompts=n, round=rnd, ok=rec.get("event") == "result",
                       load_avg_1m_before=round(load, 2), probe_gflop_s_before=probe, idle_peers_cpu_s=idle_cpu)
            what = "warm-up" if rnd < 0 else f"round {rnd + 1}/{args.repeats}"
            if rec["ok"]:
                log(f"{what}, {n} prompts: {system} "
                    f"{rec['output_tokens_per_s']:.1f} tok/s (probe {probe} GFLOP/s, idle peers {idle_cpu})")
            else:
                rec["stderr_tail"] = peers[system].stderr_tail()
                log(f"{what}, {n} prompts: {system} FAILED {json.dumps(rec)[:1500]}")
            return rec

        # Untimed first runs of the full workload (round -1, left out of the
        # summary): each system's first run after the others' start-up moved
        # by up to a fifth from its later ones (session 8).
        for _ in range(args.warmup_rounds):
            for system in args.systems:
                warm = one_run(system, -1)
                warm["warmup"] = True
                runs.append(warm)
        for rnd in range(args.repeats):
            k = rnd % len(args.systems)
            order = args.systems[k:] + args.systems[:k]
            for system in order:
                rec = one_run(system, rnd)
                runs.append(rec)
    finally:
        for peer in peers.values():
            peer.stop()
    return runs, ready


# ---------------------------------------------------------------- summary


def _median(values):
    return statistics.median(values) if values else None


def summarize(runs: list[dict], nums: list[int], systems: list[str], costs: dict, rates: dict) -> dict:
    summary = {}
    matmul = rates["matmul_gflop_s"] * 1e9
    bandwidth = rates["read_gb_s"] * 1e9
    for n in nums:
        row = {}
        for s in systems:
            tps = [r["output_tokens_per_s"] for r in runs
                   if r["system"] == s and r["num_prompts"] == n and r["ok"] and r["round"] >= 0]
            row[s] = {"median_tok_s": _median(tps), "runs_tok_s": tps}
        j = row.get("jaxserve", {}).get("median_tok_s")
        for peer in systems:
            if peer == "jaxserve" or not j or not row[peer]["median_tok_s"]:
                continue
            row[f"jaxserve_over_{peer}"] = round(j / row[peer]["median_tok_s"], 3)
            per_round = []
            for rnd in sorted({r["round"] for r in runs if r["round"] >= 0}):
                a = [r for r in runs if r["round"] == rnd and r["num_prompts"] == n and r["ok"]]
                js = [r["output_tokens_per_s"] for r in a if r["system"] == "jaxserve"]
                ps = [r["output_tokens_per_s"] for r in a if r["system"] == peer]
                if js and ps:
                    per_round.append(round(js[0] / ps[0], 3))
            row[f"jaxserve_over_{peer}_per_round"] = per_round
        for s in systems:
            tps = row[s]["median_tok_s"]
            if not tps:
                continue
            flops = tps * costs["flops_per_output_token"]
            run_flops = tps / args_output_len(runs) * costs["run_flops_per_prompt"]
            # One step reads the weights once for its n tokens, and each
            # sequence's own keys and values.
            bytes_s = tps / n * costs["weight_bytes_per_token"] + tps * costs["kv_bytes_per_token"]
            row[s].update(
                gflop_s=round(flops / 1e9, 2),
                share_of_matmul=round(flops / matmul, 4),
                gflop_s_with_prefill=round(run_flops / 1e9, 2),
                share_of_matmul_with_prefill=round(run_flops / matmul, 4),
                weight_gb_s=round(bytes_s / 1e9, 2),
                share_of_bandwidth=round(bytes_s / bandwidth, 4),
            )
        summary[str(n)] = row
    return summary


def args_output_len(runs: list[dict]) -> int:
    for r in runs:
        if r.get("ok"):
            return r["output_len"]
    return 1


def markdown(summary: dict, systems: list[str], nums: list[int]) -> str:
    lines = []
    head = "| prompts | " + " | ".join(f"{s} tok/s" for s in systems)
    peers = [p for p in systems if p != "jaxserve"]
    head += "".join(f" | jaxserve / {p}" for p in peers) + " | jaxserve share of machine |"
    lines.append(head)
    lines.append("|" + "---|" * (2 + len(systems) + len(peers)))
    for n in nums:
        row = summary[str(n)]
        cells = [str(n)]
        for s in systems:
            m = row[s]["median_tok_s"]
            runs = ", ".join(f"{v:.0f}" for v in row[s]["runs_tok_s"])
            cells.append(f"**{m:.1f}** ({runs})" if m else "n/a")
        for p in peers:
            ratio = row.get(f"jaxserve_over_{p}")
            per_round = ", ".join(f"{v:.2f}" for v in row.get(f"jaxserve_over_{p}_per_round", []))
            cells.append(f"**{ratio:.2f}x** ({per_round})" if ratio else "n/a")
        j = row.get("jaxserve", {})
        if j.get("median_tok_s"):
            if n > 1:
                cells.append(f"{j['gflop_s']:.1f} GFLOP/s = {100 * j['share_of_matmul']:.0f}% of matmul "
                             f"({100 * j['share_of_matmul_with_prefill']:.0f}% counting prefill)")
            else:
                cells.append(f"{j['weight_gb_s']:.1f} GB/s = {100 * j['share_of_bandwidth']:.0f}% of bandwidth")
        else:
            cells.append("n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m", help="preset name or checkpoint folder")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per prompt count")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="untimed runs of each system first (recorded as round -1, not in the summary)")
    parser.add_argument("--inner", type=int, default=0,
                        help="timed runs per turn, their median is the turn's figure (default: 1, or 3 below 8 prompts)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vllm-threads-bind", default="0-1",
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM ('auto' reserves a core for its scheduler)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for a peer's answer")
    parser.add_argument("--no-cli", action="store_true", help="skip the `jaxserve bench offline` cross-check runs")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="skip the 1 s matmul load probe before each timed run")
    parser.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                        help="leave the idle peers running during a run (default: SIGSTOP them, SIGCONT after)")
    parser.add_argument("--skip-machine-rates", action="store_true")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/offline-<date>.json)")
    args = parser.parse_args()

    from jaxserve.presets import resolve_model

    folder = Path(resolve_model(args.model)).resolve()
    costs = model_costs(folder, args.input_len, args.output_len)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    out = Path(args.out) if args.out else HERE / "results" / f"offline-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    rates_runs = []
    if not args.skip_machine_rates:
        log("machine rates (before)")
        rates_runs.append(machine_rates())

    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-offline-"))
    log(f"prompts and peer logs in {tmp}")
    runs: list[dict] = []
    startups: dict[str, dict] = {}
    cli: dict[str, dict] = {}
    for n in args.num_prompts:
        prompts_file = tmp / f"prompts-{n}.json"
        prompts_file.write_text(json.dumps(make_prompts(folder, n, args.input_len)))
        n_runs, ready = run_prompt_count(n, args, folder, prompts_file, tmp, log)
        runs.extend(n_runs)
        startups[str(n)] = {s: {k: r.get(k) for k in ("startup_s", "compile_s", "settings", "version")}
                            for s, r in ready.items()}
        if "jaxserve" in args.systems and not args.no_cli:
            log(f"cross-check: jaxserve bench offline, {n} prompts")
            cli[str(n)] = run_cli(cli_command(args, folder, n), args.timeout)
            log(f"  {cli[str(n)].get('output_tokens_per_s')} tok/s")
        out.write_text(json.dumps({"partial": True, "runs": runs, "cli": cli}, indent=1))

    if not args.skip_machine_rates:
        log("machine rates (after)")
        rates_runs.append(machine_rates())
    if rates_runs:
        rates = {
            "matmul_gflop_s": max(r["matmul_gflop_s"]["best"] for r in rates_runs),
            "read_gb_s": max(r["bandwidth_gb_s"]["best_read"] for r in rates_runs),
        }
    else:
        # The figures of serving-engines.md for these 2-core machines.
        rates = {"matmul_gflop_s": 75.0, "read_gb_s": 21.0, "assumed": True}

    summary = summarize(runs, args.num_prompts, args.systems, costs, rates)
    table = markdown(summary, args.systems, args.num_prompts)
    record = {
        "command": " ".join([".venv/bin/python", "benchmarks/offline_throughput.py"] + sys.argv[1:]),
        "date_utc": stamp,
        "git": git_state(),
        "model": args.model,
        "folder": str(folder),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "machine": {
            "cpu": rates_runs[0]["machine"]["cpu"] if rates_runs else platform.processor(),
            "logical_cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "machine_rates": rates,
        "machine_rates_runs": rates_runs,
        "model_costs": costs,
        "summary": summary,
        "startup": startups,
        "cli_cross_check": cli,
        "runs": runs,
        "table": table,
    }
    out.write_text(json.dumps(record, indent=1))
    log(f"wrote {out}")
    print(table)
    for n, c in cli.items():
        if c.get("ok"):
            print(f"\n`jaxserve bench offline` at {n} prompts, run alone after the rounds: "
                  f"{c['output_tokens_per_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
