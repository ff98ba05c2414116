"""offline-moe: a mixture of experts of Qwen3-30B-A3B's layer shape, jaxserve int8 against llama.cpp, one Q8_0 file.

Model: random weights, Qwen3-MoE architecture with Qwen3-30B-A3B's layer
(hidden 2048, 128 experts of width 768, 8 active, 32 query / 4 kv heads of
128, q/k norms), as many layers as the machine holds twice (``--layers``,
default 8: about 5.5 GB), SmolLM2's tokenizer and vocabulary; written by
``benchmarks/peers/prepare_moe.py`` as one Q8_0 GGUF (llama.cpp's converter
and ``llama-quantize``), which both systems read:

- ``jaxserve-int8``: ``peers/jaxserve_offline.py --model FILE --quantization
  int8`` (the engine as ``jaxserve bench offline`` builds it; the file's
  Q8_0 blocks taken as they are, the experts through ``moe_cpu.cc``);
- ``llamacpp-Q8_0``: ``llama-batched-bench`` on the same file, 2 threads,
  ``-npp 128 -ntg 128 -npl N``. On some Intel VMs its Q8_0 weight repacking
  dies with SIGILL (rc 132; ``/work/shared/reference/llamacpp-as-peer.md``):
  a short probe run first, and if repacking crashes the peer runs with
  ``-nr`` (no repacking), which the result records (``settings.startups``;
  ``offline.LlamaCppContender``).

Workload and figure as offline-smollm2's: N prompts of 128 random token ids
to exactly 128 new tokens, greedy, EOS ignored, at N = 64 and 1; output
tokens over the wall time of the whole run, prefill included; below 8
prompts a turn is the median of 3 runs. Goals: jaxserve at least 1.0x
llama.cpp at 1 prompt and 1.5x at 64.

Against the machine, at 1 prompt: the bytes a decoded token reads (each
layer's attention matrices, its router and its 8 experts, and ``lm_head``,
as the file stores them) times tok/s, against the measured read bandwidth;
goal: at least 60 % (this counts the prefill's time too, so it understates
the decode rate a little).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import rounds
from ..record import Figure
from .offline import LlamaCppContender, ServeContender, bandwidth_figure, make_prompts

NAME = "offline-moe"
DESCRIPTION = (
    "offline MoE (Qwen3-30B-A3B layer shape, random, one Q8_0 GGUF) 128 -> 128 tok/s at 64 and 1 prompts: "
    "jaxserve int8 vs llama.cpp"
)
COMMAND = ".venv/bin/python benchmarks/suite.py run offline-moe"

ROOT = Path(__file__).resolve().parents[3]
PEERS = ROOT / "benchmarks" / "peers"
MOE_DIR = ROOT / ".peers" / "moe"
SYSTEMS = ["jaxserve-int8", "llamacpp-Q8_0"]
LABELS = {"jaxserve-int8": "jaxserve int8", "llamacpp-Q8_0": "llama.cpp Q8_0"}
GOALS = {1: 1.0, 64: 1.5}
#: the share of the read bandwidth a one-prompt run should move
BANDWIDTH_GOAL = 0.6


def default_gguf(layers: int) -> Path:
    return MOE_DIR / f"qwen3moe-30b-a3b-shape-L{layers}.Q8_0.gguf"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8, help="which prepared file (prepare_moe.py --layers)")
    p.add_argument("--gguf", default=None, help="the Q8_0 file (default: .peers/moe's for --layers)")
    p.add_argument("--hf-model", default=str(MOE_DIR / "hf"), help="its config and tokenizer (prompts)")
    p.add_argument("--llamacpp-bin", default=str(ROOT / ".peers" / "llama.cpp" / "build" / "bin"))
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
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
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait for one peer's answer")


def read_costs(gguf: Path) -> dict[str, Any]:
    """Bytes of the file's tensors, and those one decoded token reads: per
    layer the attention matrices, the router and ``k`` of the experts (a
    ``1/X`` share of each stacked expert tensor per expert), and ``lm_head``."""
    import gguf as gg

    reader = gg.GGUFReader(str(gguf), "r")
    arch = str(reader.fields["general.architecture"].contents())
    k = int(reader.fields[f"{arch}.expert_used_count"].contents())
    X = int(reader.fields[f"{arch}.expert_count"].contents())
    total = active = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        total += n
        name = t.name
        if name.startswith("blk.") and "_exps." in name:
            active += n * k // X
        elif name.startswith("blk.") or name == "output.weight":
            active += n
    return {"file_bytes": total, "active_bytes_per_token": active, "experts": X, "experts_per_token": k}


def contender(name: str, args: argparse.Namespace, gguf: Path, n: int, prompts_file: Path, tmp: Path) -> Any:
    inner = 1 if n >= 8 else 3
    if name == "jaxserve-int8":
        cmd = [sys.executable, str(PEERS / "jaxserve_offline.py"), "--model", str(gguf)]
        cmd += [
            "--prompts",
            str(prompts_file),
            "--output-len",
            str(args.output_len),
            "--serve",
            "--quantization",
            "int8",
        ]
        return ServeContender(name, cmd, tmp / f"{name}-{n}.log", args.timeout, inner)
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


def figures(
    records: list[dict[str, Any]],
    systems: list[str],
    nums: list[int],
    costs: dict[str, Any],
    machine: dict[str, Any],
    args,
) -> list[Figure]:
    out = []
    layers = costs.get("layers")
    for n in nums:
        what = (
            f"offline MoE (Qwen3-30B-A3B layer x{layers}, Q8_0) {args.input_len} -> {args.output_len}, "
            f"{n} prompt{'s' if n > 1 else ''}"
        )
        peer = "llamacpp-Q8_0" if "llamacpp-Q8_0" in systems and "jaxserve-int8" in systems else None
        system = "jaxserve-int8" if "jaxserve-int8" in systems else systems[0]
        goal_ratio = GOALS.get(n) if peer else None
        f = rounds.figure(
            records,
            what,
            system,
            peer,
            "tok/s",
            where={"num_prompts": n},
            labels=LABELS,
            goal=f">= {goal_ratio}x" if goal_ratio else None,
            goal_ratio=goal_ratio,
        )
        out.append(f)
        if n != 1:
            continue
        bw = machine.get("read_gb_s")
        per_token = costs["active_bytes_per_token"]
        notes = []
        for s in [st for st in (f.system, f.peer) if st is not None and st.median]:
            gb_s = s.median * per_token / 1e9
            notes.append(
                f"{s.label} moves {gb_s:.1f} GB/s" + (f" ({100 * gb_s / bw:.0f}% of read bandwidth)" if bw else "")
            )
        f.note = f"({per_token / 1e6:.0f} MB read per token; " + "; ".join(notes) + ")" if notes else ""
        if bw and system == "jaxserve-int8":
            out.append(
                bandwidth_figure(
                    f"{what}: weight bytes per token x tok/s",
                    LABELS[system],
                    f.system.runs,
                    per_token,
                    bw,
                    BANDWIDTH_GOAL,
                )
            )
    return out


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    gguf = Path(args.gguf) if args.gguf else default_gguf(args.layers)
    hf = Path(args.hf_model)
    for path, how in (
        (gguf, "benchmarks/peers/prepare_moe.py"),
        (hf / "config.json", "benchmarks/peers/prepare_moe.py"),
    ):
        if not path.is_file():
            raise SystemExit(f"{path} missing: run .venv/bin/python {how} --layers {args.layers}")
    costs = read_costs(gguf)
    costs["layers"] = json.loads((hf / "config.json").read_text()).get("num_hidden_layers")
    records: list[dict[str, Any]] = []
    startups: dict[str, Any] = {}
    for n in args.num_prompts:
        prompts_file = ctx.tmp / f"prompts-{n}.json"
        prompts_file.write_text(json.dumps(make_prompts(hf, n, args.input_len)))
        cs = [contender(name, args, gguf, n, prompts_file, ctx.tmp) for name in args.systems]
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
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    settings.update(gguf=str(gguf), costs=costs, startups=startups)
    return figures(records, args.systems, args.num_prompts, costs, ctx.machine, args), records, settings
