"""The benchmark suite: named scenarios, one results schema, BENCHMARKS.md's table.

    .venv/bin/python benchmarks/suite.py list
    .venv/bin/python benchmarks/suite.py run offline-smollm2            # 5 alternated rounds, writes the table
    .venv/bin/python benchmarks/suite.py run ttft --rounds 3
    .venv/bin/python benchmarks/suite.py run memory --smoke --model tiny   # a quick check that it works
    .venv/bin/python benchmarks/suite.py table                          # regenerate the table from results/

``run`` measures the machine (``machine_rates.py``: CPU, flags, cores,
bandwidth, f32 and int8 GEMM rates), runs the scenario's systems alternated
in rounds (``bench/rounds.py``), writes ``benchmarks/results/<scenario>-<UTC>.json``
(``bench/record.py``) and regenerates the table between the markers at the
top of BENCHMARKS.md from the newest result of every scenario
(``bench/table.py``). ``--smoke`` (one round, no warm-up, quick machine
rates) writes under ``benchmarks/results/smoke/`` and leaves the table alone:
a check that the scenario runs, never a figure. Timing figures come only
from full runs on a quiet machine.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import machine, table
from bench.record import Result
from bench.scenarios import SCENARIOS


def run(args: argparse.Namespace) -> int:
    scenario = SCENARIOS[args.scenario]
    if args.smoke:
        args.rounds, args.warmup_rounds, args.quick_machine = min(args.rounds, 1), 0, True
    started = time.monotonic()
    print(f"== {scenario.NAME}: {args.rounds} rounds (+{args.warmup_rounds} warm-up)", file=sys.stderr, flush=True)
    mach = machine.measure(quick=args.quick_machine)
    ctx = SimpleNamespace(
        tmp=Path(tempfile.mkdtemp(prefix=f"jaxserve-{scenario.NAME}-")),
        rounds=args.rounds,
        warmup_rounds=args.warmup_rounds,
        machine=mach,
        smoke=args.smoke,
    )
    print(f"   working files in {ctx.tmp}", file=sys.stderr, flush=True)
    figures, runs, settings = scenario.run(args, ctx)
    # --no-doc changes where the table goes, not the figures: left out of the command to rerun
    rerun = [a for a in sys.argv[1:] if a != "--no-doc"]
    command = " ".join([".venv/bin/python", "benchmarks/suite.py", *map(shlex.quote, rerun)])
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items() if k != "func"}
    settings["wall_s"] = round(time.monotonic() - started, 1)
    git = settings.pop("git", None) or machine.git_state()  # a scenario that imports a report names its commit
    # a scenario's variant (speculative --quantization int8) is a result and table rows of its own
    variant = scenario.variant(args) if hasattr(scenario, "variant") else None
    result = Result(
        scenario=f"{scenario.NAME}-{variant}" if variant else scenario.NAME,
        command=command,
        machine=mach,
        git=git,
        settings=settings,
        figures=figures,
        runs=runs,
        smoke=args.smoke,
    )
    path = result.write()
    print(f"wrote {path}", file=sys.stderr)
    print("\n".join([table.HEADER, "|---|---|---|---|---|---|---|---|", *table.result_rows(result, path)]))
    if not args.smoke and not args.no_doc:
        write_table()
        print(f"table in {table.DOC} regenerated", file=sys.stderr)
    return 0


def write_table() -> None:
    rows = []
    for s in SCENARIOS.values():
        rows.append((s.NAME, s.DESCRIPTION, s.COMMAND))
        for v, flags in getattr(s, "VARIANTS", {}).items():
            rows.append((f"{s.NAME}-{v}", f"{s.DESCRIPTION} ({v})", f"{s.COMMAND} {flags}".rstrip()))
    table.write(table.render(rows))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the scenarios")
    sub.add_parser("table", help="regenerate BENCHMARKS.md's table from benchmarks/results/")
    run_p = sub.add_parser("run", help="run one scenario")
    scen = run_p.add_subparsers(dest="scenario", required=True)
    for name, mod in SCENARIOS.items():
        p = scen.add_parser(
            name, help=mod.DESCRIPTION, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument(
            "--rounds",
            type=int,
            default=getattr(mod, "DEFAULT_ROUNDS", 5),
            help="alternated rounds (the spread rule needs at least five)",
        )
        p.add_argument("--warmup-rounds", type=int, default=getattr(mod, "DEFAULT_WARMUP_ROUNDS", 1))
        p.add_argument("--smoke", action="store_true", help="one round, quick machine rates, results/smoke/, no table")
        p.add_argument("--quick-machine", action="store_true", help="small machine-rate probes")
        p.add_argument("--no-doc", action="store_true", help="leave BENCHMARKS.md alone")
        mod.add_arguments(p)
    args = ap.parse_args()
    if args.command == "list":
        for name, mod in SCENARIOS.items():
            print(f"{name:18} {mod.DESCRIPTION}\n{'':18} {mod.COMMAND}")
        return 0
    if args.command == "table":
        write_table()
        print(f"wrote the table in {table.DOC}")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
