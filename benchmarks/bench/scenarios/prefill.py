"""int8-prefill: prompt-heavy work on the int8 units (AMX tiles or AVX-512 VNNI) against float32.

Workload: ``--num-prompts`` (128) prompts of ``--input-len`` (128) token ids
(``offline.make_prompts``), one new token each, prefix caching off, through
the engine as ``jaxserve bench offline`` builds it
(``peers/jaxserve_offline.py --output-len 1``) with its default step budget
of 2,048 tokens: 16 prompts a step, 8 steps a run, nothing but prefill. The
figure is prompt tokens over the run's wall time. Systems, the same weights
(``--model``):

- ``jaxserve-int8``: ``--quantization int8``, the quantized kernel's prefill
  loop on whatever this CPU gives it (``jaxserve.kernels.cpu.int8_units``:
  AMX tiles where the CPU has AMX-INT8, else AVX-512 VNNI; the machine
  record says which);
- ``jaxserve-int8-vnni``: the same with the kernels built without AMX
  (``JAXSERVE_CPU_KERNEL_CFLAGS="-mno-amx-tile -mno-amx-int8"``), only on a
  CPU whose build uses AMX: what the tiles add;
- ``jaxserve-f32``: float32 weights.

Against the machine: the layers' matmul operations (2 x the non-embedding
layer parameters per prompt token; the vocabulary projection is left out,
as a prefill step projects only the tokens it samples) over the run's time,
against the int8 GEMM rate (``machine_rates.py``: the better of a plain
VNNI GEMM and XLA's s8 dot, which is oneDNN's AMX GEMM where the CPU has
it). Goal on a CPU with AMX: at least 50 %. On one without, the figure is
the VNNI one, reported as such, without the goal, in a result and table
rows of its own (``int8-prefill-vnni``), so a VNNI machine's run never
replaces the AMX figures. The share counts all of
the step (attention, norms, the activations' quantization), not the matmuls
alone.

``--smoke`` without sizes given runs 16 prompts of 32 tokens: a check that
the scenario runs, never a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import machine, models, rounds
from ..record import Figure, Stat
from .offline import ServeContender, alternate_loaded, make_prompts, model_costs

NAME = "int8-prefill"
DESCRIPTION = (
    "int8 prefill (2,048-token steps) on AMX or VNNI vs float32: prompt tok/s and the int8 GEMM rate, SmolLM2-135M"
)
COMMAND = ".venv/bin/python benchmarks/suite.py run int8-prefill"

ROOT = Path(__file__).resolve().parents[3]
PEER = ROOT / "benchmarks" / "peers" / "jaxserve_offline.py"
SYSTEMS = ["jaxserve-int8", "jaxserve-int8-vnni", "jaxserve-f32"]
#: a build of the kernels without AMX (the VNNI prefill loop)
NO_AMX = {"JAXSERVE_CPU_KERNEL_CFLAGS": "-mno-amx-tile -mno-amx-int8"}
#: the share of the int8 GEMM rate a prefill should reach on a CPU with AMX
RATE_GOAL = 0.5
#: a run on a CPU without AMX gives the VNNI (or portable) figure, kept beside the AMX one
VARIANTS = machine.INT8_VARIANTS
#: (prompts, prompt tokens): the full run's, and --smoke's when none is given
FULL = (128, 128)
SMOKE = (16, 32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default(), help="preset, GGUF file or folder (bench/models.py)")
    p.add_argument("--num-prompts", type=int, default=None, help=f"prompts per run (default {FULL[0]})")
    p.add_argument("--input-len", type=int, default=None, help=f"tokens per prompt (default {FULL[1]})")
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one turn")


def variant(args: argparse.Namespace) -> str | None:
    return machine.int8_variant()


def labels(units: str | None) -> dict[str, str]:
    on = {"amx": "AMX", "avx512_vnni": "VNNI", "portable": "portable C++"}.get(units or "", units or "?")
    return {
        "jaxserve-int8": f"jaxserve int8 ({on})",
        "jaxserve-int8-vnni": "jaxserve int8 (VNNI, AMX off)",
        "jaxserve-f32": "jaxserve f32",
    }


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    from jaxserve.presets import resolve_model

    default = SMOKE if ctx.smoke else FULL
    num_prompts = args.num_prompts or default[0]
    input_len = args.input_len or default[1]
    units = ctx.machine.get("int8_kernel_units")
    systems = [s for s in args.systems if s != "jaxserve-int8-vnni" or units == "amx"]
    folder = Path(resolve_model(args.model))
    prompts_file = ctx.tmp / "prompts.json"
    prompts_file.write_text(json.dumps(make_prompts(folder, num_prompts, input_len)))
    contenders = []
    for name in systems:
        cmd = [sys.executable, str(PEER), "--model", args.model, "--prompts", str(prompts_file), "--output-len", "1"]
        cmd += ["--serve", *([] if name == "jaxserve-f32" else ["--quantization", "int8"])]
        env = NO_AMX if name == "jaxserve-int8-vnni" else None
        contenders.append(ServeContender(name, cmd, ctx.tmp / f"{name}.log", args.timeout, inner=1, env=env))
    records, started = alternate_loaded(contenders, ctx)
    for r in records:  # one new token per prompt: prompts/s -> prompt tokens/s
        if r.get("value") is not None:
            r["value"] = r["value"] * input_len
    layer_params = model_costs(folder)["layer_params"]
    figs = figures(records, systems, units, layer_params, ctx.machine, num_prompts, input_len, args.model)
    settings = dict(vars(args))
    settings.update(num_prompts=num_prompts, input_len=input_len, layer_params=layer_params, started=started)
    return figs, records, settings


def figures(
    records: list[dict[str, Any]],
    systems: list[str],
    units: str | None,
    layer_params: int,
    machine: dict[str, Any],
    num_prompts: int,
    input_len: int,
    model: str,
) -> list[Figure]:
    names = labels(units)
    what = f"prefill, {num_prompts} prompts x {input_len} tokens in 2,048-token steps, {models.label(model)}"
    figs = []
    for peer in ("jaxserve-f32", "jaxserve-int8-vnni"):
        if "jaxserve-int8" in systems and peer in systems:
            figs.append(rounds.figure(records, what, "jaxserve-int8", peer, "tok/s", labels=names, compare_swing=False))
    rate = machine.get("int8_gop_s")
    if "jaxserve-int8" in systems and rate:
        runs = [round(v * 2 * layer_params / 1e9, 1) for v in rounds.values(records, "jaxserve-int8")]
        goal = {}
        if units == "amx":
            goal = {
                "goal": f">= {int(100 * RATE_GOAL)}% of {rate} GOP/s int8 GEMM",
                "goal_value": round(RATE_GOAL * rate, 1),
            }
        figs.append(
            Figure(
                f"{what}: layer matmul ops per second (2 x layer parameters x prompt tok/s), every part of the step counted",
                Stat(names["jaxserve-int8"], "GOP/s", runs),
                note=f"(the int8 GEMM rate measured: {rate} GOP/s)",
                **goal,
            )
        )
    return figs
