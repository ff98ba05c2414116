"""kv-int8: the int8 KV cache against the float32 one, decoding over long contexts.

Workload: ``--num-seqs`` (64) prompts of ``--context`` (1,024) token ids
(``offline.make_prompts``, jaxserve bench's recipe), all added at once,
``--output-len`` (64) new tokens each, greedy, EOS ignored, prefix caching
off. Figure: the decode rate, the tokens generated after every sequence has
its first token over the time from then to the end
(``peers/jaxserve_kv_decode.py``): the part of the run whose speed the
cache's dtype changes (each decode step reads every sequence's whole
context); prefill only writes it. Systems, the same engine and weights
(``--model``, float32 unless ``--quantization``):

- ``kv-f32``: ``--kv-cache-dtype float32``;
- ``kv-int8``: ``--kv-cache-dtype int8`` (``jaxserve/kernels/kv_cache.py``:
  int8 values and a float32 scale per token and kv head).

Both stay loaded and alternate in rounds (``rounds.py``). A second figure is
the KV bytes per token of each (from the engine, not timed: 46,080 against
12,240 for SmolLM2-135M's 30 layers of 3 kv heads of 64). Greedy agreement
and perplexity with the int8 cache are the ``quant-quality`` scenario's
(``quant_quality.py``'s ``kv-int8`` row).

``--smoke`` without sizes given runs 4 sequences of 64 tokens, 8 new ones:
a check that the scenario runs, never a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import models, rounds
from ..record import Figure, Stat
from .offline import ServeContender, alternate_loaded, make_prompts

NAME = "kv-int8"
DESCRIPTION = "int8 vs float32 KV cache: decode tok/s at 64 sequences of 1,024-token contexts and KV bytes per token, SmolLM2-135M"
COMMAND = ".venv/bin/python benchmarks/suite.py run kv-int8"

ROOT = Path(__file__).resolve().parents[3]
PEER = ROOT / "benchmarks" / "peers" / "jaxserve_kv_decode.py"
SYSTEMS = {"kv-f32": "float32", "kv-int8": "int8"}
LABELS = {"kv-f32": "jaxserve, float32 KV", "kv-int8": "jaxserve, int8 KV"}
#: (sequences, context, new tokens): the full run's, and --smoke's when none is given
FULL = (64, 1024, 64)
SMOKE = (4, 64, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.jaxserve_default(), help="preset, GGUF file or folder (bench/models.py)")
    p.add_argument("--num-seqs", type=int, default=None, help=f"sequences decoding together (default {FULL[0]})")
    p.add_argument("--context", type=int, default=None, help=f"prompt tokens per sequence (default {FULL[1]})")
    p.add_argument("--output-len", type=int, default=None, help=f"new tokens per sequence (default {FULL[2]})")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"], help="weights (default float32)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one turn")


def _sizes(args: argparse.Namespace, smoke: bool) -> tuple[int, int, int]:
    default = SMOKE if smoke else FULL
    given = (args.num_seqs, args.context, args.output_len)
    return tuple(g if g is not None else d for g, d in zip(given, default))  # type: ignore[return-value]


def run(args: argparse.Namespace, ctx: Any) -> tuple[list[Figure], list[dict[str, Any]], dict[str, Any]]:
    from jaxserve.presets import resolve_model

    seqs, context, output_len = _sizes(args, ctx.smoke)
    folder = Path(resolve_model(args.model))
    prompts_file = ctx.tmp / "prompts.json"
    prompts_file.write_text(json.dumps(make_prompts(folder, seqs, context)))
    contenders = []
    for name in args.systems:
        cmd = [
            sys.executable,
            str(PEER),
            "--model",
            args.model,
            "--prompts",
            str(prompts_file),
            "--output-len",
            str(output_len),
            "--kv-cache-dtype",
            SYSTEMS[name],
            "--serve",
            *(["--quantization", args.quantization] if args.quantization else []),
        ]
        contenders.append(ServeContender(name, cmd, ctx.tmp / f"{name}.log", args.timeout, inner=1))
    records, started = alternate_loaded(contenders, ctx)
    weights = args.quantization or "float32"
    what = f"decode tok/s, {seqs} sequences of {context}-token contexts (+{output_len}), {models.label(args.model)} {weights} weights"
    figs: list[Figure] = []
    if len(args.systems) == 2:
        figs.append(rounds.figure(records, what, "kv-int8", "kv-f32", "tok/s", labels=LABELS, compare_swing=False))
    else:
        figs += [rounds.figure(records, what, s, None, "tok/s", labels=LABELS) for s in args.systems]
    per_token = {name: (info.get("settings") or {}).get("kv_bytes_per_token") for name, info in started.items() if info}
    if all(per_token.get(s) for s in args.systems) and len(args.systems) == 2:
        a, b = float(per_token["kv-int8"]), float(per_token["kv-f32"])
        figs.append(
            Figure(
                f"KV cache bytes per token (every layer, keys and values, int8's scales included), {models.label(args.model)}",
                Stat(LABELS["kv-int8"], "B", [a]),
                Stat(LABELS["kv-f32"], "B", [b]),
                [round(a / b, 4)],
                higher_is_better=False,
                compare_swing=False,
            )
        )
    settings = dict(vars(args))
    settings.update(num_seqs=seqs, context=context, output_len=output_len, started=started)
    return figs, records, settings
