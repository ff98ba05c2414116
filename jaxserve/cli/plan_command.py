"""``jaxserve plan``: size a deployment from a workload and a measured profile."""

from __future__ import annotations

import json
import re
import sys

import click

from jaxserve.cli.options import engine_option

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"1.5G"``, ``"1000000"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise click.BadParameter(
            f"expected a size such as 8GiB, 512MiB or a number of bytes, got {text!r}", param_hint="--kv-memory"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=what) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected integers >= 1, got {text!r}", param_hint=what)
    return values


@click.command("plan")
@click.option(
    "--measure", is_flag=True, help="Measure MODEL's prefill and decode rates with the real engine and write a profile."
)
@engine_option("--model", field="model", profile="offline", help="--measure: preset name or checkpoint folder.")
@click.option(
    "--output",
    "-o",
    "output",
    type=click.Path(dir_okay=False),
    default=None,
    help="--measure: the profile JSON to write.",
)
@click.option("--chunks", default="64,128,256,512", show_default=True, help="--measure: prefill chunk sizes (tokens).")
@click.option("--batches", default="1,4,16,32", show_default=True, help="--measure: decode batch sizes.")
@click.option(
    "--contexts",
    default="128,1024",
    show_default=True,
    help="--measure: context lengths (prompt tokens) of the decode batches.",
)
@click.option(
    "--decode-steps",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="--measure: decode steps timed per batch.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0.0, 2.0),
    default=1.0,
    show_default=True,
    help="--measure: sampling temperature (a job's default is 1; 0 is the much faster greedy path).",
)
@click.option(
    "--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="--measure: runs per size (median)."
)
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="--measure: default the checkpoint's."
)
@click.option(
    "--measure-max-model-len",
    type=click.IntRange(min=2),
    default=None,
    help="--measure: the engine's max_model_len (default: the model's, as a worker has it).",
)
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Profile JSON (from --measure) to plan with.",
)
@click.option(
    "--workload",
    "workload_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Workload as JSON or YAML (or a loadtest.json: its measured token counts); flags override it.",
)
@click.option("--rps", type=click.FloatRange(min=0, min_open=True), default=None, help="Mean arrival rate, jobs/s.")
@click.option(
    "--burst",
    type=click.IntRange(min=1),
    default=None,
    help="Jobs arriving at once that must meet the TTFT target (default 1).",
)
@click.option("--prompt-tokens", default=None, metavar="mean:N,p95:M", help="Prompt length distribution.")
@click.option("--output-tokens", default=None, metavar="mean:N,p95:M", help="Output length distribution.")
@click.option(
    "--ttft-target-s", type=click.FloatRange(min=0, min_open=True), default=None, help="p95 time to first token target."
)
@click.option(
    "--itl-target-s", type=click.FloatRange(min=0, min_open=True), default=None, help="Inter-token latency target."
)
@click.option(
    "--headroom", type=click.FloatRange(0.0, 1.0, max_open=True), default=None, help="Capacity kept free (default 0.3)."
)
@click.option(
    "--kv-memory",
    default=None,
    metavar="SIZE",
    help="KV cache memory per worker (default: device memory x --memory-fraction - weights).",
)
@click.option("--memory-fraction", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.9, show_default=True)
@click.option(
    "--chunk",
    type=click.IntRange(min=1),
    default=None,
    help="Prefill chunk / step budget (default: the profile's fastest).",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=2),
    default=None,
    help="The workers' max_model_len (default: the model's).",
)
@click.option(
    "--scaleout",
    "scaleout_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="A benchmarks/scaleout.py result: caps workers per broker, adds the event-loop and broker budgets.",
)
@click.option(
    "--scaleout-efficiency",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.75,
    show_default=True,
    help="Scale-out efficiency a broker's workers must keep.",
)
@click.option(
    "--broker-cores",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Cores one job queue's broker process can use.",
)
@click.option(
    "--prices",
    "prices_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Prices file (YAML/JSON, as jaxserve worker --prices): adds the plan's cost per day and per million tokens.",
)
@click.option(
    "--hardware-per-hour",
    type=click.FloatRange(min=0),
    default=None,
    help="Price of one worker's machine per hour: the plan costs workers x this x 24 a day (overrides --prices).",
)
@click.option("--currency", default=None, help="Currency of --hardware-per-hour (default: the prices file's, or USD).")
@click.option(
    "--compare",
    "compare_profile",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="A small model's profile: compare the --profile model alone with it plus this one taking the overflow.",
)
@click.option(
    "--primary-workers",
    type=click.IntRange(min=1),
    default=None,
    help="--compare: workers the primary keeps (default: half of what it needs alone); the rest overflows.",
)
@click.option(
    "--fallback-share",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="--compare: the share of jobs the fallback serves, instead of --primary-workers.",
)
@click.option(
    "--fallback-hardware-per-hour",
    type=click.FloatRange(min=0),
    default=None,
    help="--compare: price per hour of one fallback worker's machine (overrides --prices).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine output.")
def plan(
    measure,
    model,
    output,
    chunks,
    batches,
    contexts,
    decode_steps,
    temperature,
    repeats,
    dtype,
    measure_max_model_len,
    profile_path,
    workload_file,
    rps,
    burst,
    prompt_tokens,
    output_tokens,
    ttft_target_s,
    itl_target_s,
    headroom,
    kv_memory,
    memory_fraction,
    chunk,
    max_model_len,
    scaleout_file,
    scaleout_efficiency,
    broker_cores,
    prices_file,
    hardware_per_hour,
    currency,
    compare_profile,
    primary_workers,
    fallback_share,
    fallback_hardware_per_hour,
    as_json,
) -> None:
    """Number of workers, max_num_seqs and KV memory per worker for a workload.

    \b
    jaxserve plan --measure --model tiny --output tiny-profile.json
    jaxserve plan --profile tiny-profile.json --rps 20 --prompt-tokens mean:500,p95:900 \\
        --output-tokens mean:64,p95:128 --ttft-target-s 1 --itl-target-s 0.05 --burst 8

    Prints the arithmetic line by line and which budget binds (prefill
    compute, decode compute, KV memory, TTFT, ITL; worker event loop with
    --scaleout). Exit status 2 when no number of workers can meet the targets.

    \b
    Cost: --prices FILE or --hardware-per-hour X adds cost per day and per
    million tokens. --compare SMALL.json plans the same workload twice: the
    --profile model alone, and with SMALL taking its overflow:
    jaxserve plan --profile big.json --compare small.json --prices prices.yaml --rps 20 ...
    """
    if measure:
        _measure(
            model,
            output,
            chunks,
            batches,
            contexts,
            decode_steps,
            temperature,
            repeats,
            dtype,
            measure_max_model_len,
            as_json,
        )
        return
    from jaxserve.planning import (
        PlanInfeasible,
        PlanOptions,
        Profile,
        ProfileError,
        ScaleoutError,
        WorkloadError,
        build_workload,
        load_limits,
        make_plan,
        read_workload_file,
    )

    if profile_path is None:
        raise click.UsageError(
            "give --profile PROFILE.json (write one with: jaxserve plan --measure --model M --output PROFILE.json)"
        )
    try:
        profile = Profile.load(profile_path)
        fields = read_workload_file(workload_file) if workload_file else None
        workload = build_workload(
            fields,
            rps=rps,
            burst=burst,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            ttft_target_s=ttft_target_s,
            itl_target_s=itl_target_s,
            headroom=headroom,
        )
        limits = load_limits(scaleout_file, efficiency=scaleout_efficiency) if scaleout_file else None
    except (ProfileError, WorkloadError, ScaleoutError) as exc:
        raise click.ClickException(str(exc)) from None
    options = PlanOptions(
        kv_memory_bytes=parse_size(kv_memory) if kv_memory is not None else None,
        memory_fraction=memory_fraction,
        chunk=chunk,
        max_model_len=max_model_len,
        scaleout=limits,
        broker_cores=broker_cores,
    )
    if compare_profile is None and (primary_workers is not None or fallback_share is not None):
        raise click.UsageError("--primary-workers and --fallback-share go with --compare")
    if primary_workers is not None and fallback_share is not None:
        raise click.UsageError("give --primary-workers or --fallback-share, not both")
    from jaxserve.cost.deployments import compare_fallback, plan_cost

    try:
        price, cur = _price(profile, prices_file, hardware_per_hour, currency)
        if compare_profile is not None:
            small = Profile.load(compare_profile)
            small_price, small_cur = _price(small, prices_file, fallback_hardware_per_hour, currency)
            if small_cur is not None and cur is not None and small_cur != cur:
                raise click.ClickException(f"the two models are priced in {cur} and {small_cur}: use one currency")
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if compare_profile is not None:
            comparison = compare_fallback(
                workload,
                profile,
                small,
                options,
                primary_workers=primary_workers,
                fallback_share=fallback_share,
                primary_price=price,
                fallback_price=small_price,
                currency=cur or small_cur,
            )
        else:
            result = make_plan(workload, profile, options)
    except PlanInfeasible as exc:
        if as_json:
            click.echo(json.dumps({"feasible": False, "budget": exc.budget, "message": str(exc)}))
        else:
            click.echo(f"infeasible: {exc}", err=True)
        sys.exit(2)
    if compare_profile is not None:
        click.echo(json.dumps({"feasible": True, **comparison.to_dict()}, indent=2) if as_json else comparison.text())
        return
    cost = None if price is None or cur is None else plan_cost(result, price, cur)
    if as_json:
        out = {"feasible": True, **result.to_dict()}
        if cost is not None:
            out["cost"] = cost.to_dict()
            out["lines"] = out["lines"] + cost.lines
        click.echo(json.dumps(out, indent=2))
    else:
        text = result.text()
        if cost is not None:
            text += "\n" + "\n".join(
                [
                    *cost.lines,
                    f"cost per day          {cost.per_day:.2f} {cost.currency}",
                    f"per million tokens    {cost.per_million_tokens:.4g} {cost.currency}",
                ]
            )
        click.echo(text)


def _price(profile, prices_file, hardware_per_hour, currency):
    """The price of ``profile``'s model and its currency: --hardware-per-hour
    (with the profile's own rates), else its entry in --prices; (None, None)
    when there is neither."""
    from jaxserve.cost.prices import ModelPrice, PriceError, PriceTable

    if hardware_per_hour is not None:
        return ModelPrice.from_profile(hardware_per_hour, profile), currency or "USD"
    if prices_file is None:
        return None, None
    try:
        table = PriceTable.from_file(prices_file)
    except PriceError as exc:
        raise click.ClickException(str(exc)) from None
    if currency is not None and currency != table.currency:
        raise click.ClickException(f"{prices_file} prices in {table.currency}, not --currency {currency}")
    price = table.price_for(profile.model)
    if price is None:
        raise click.ClickException(f"{prices_file} has no price for the profile's model {profile.model!r}")
    return price, table.currency


def _measure(
    model, output, chunks, batches, contexts, decode_steps, temperature, repeats, dtype, max_model_len, as_json
) -> None:
    from jaxserve.cli.errors import user_errors
    from jaxserve.planning.profile import measure
    from jaxserve.worker.logs import configure_logging

    if output is None:
        raise click.UsageError("--measure needs --output PROFILE.json")
    configure_logging(level="warning")
    with user_errors():
        try:
            profile = measure(
                model,
                chunks=_ints(chunks, "--chunks"),
                batches=_ints(batches, "--batches"),
                contexts=_ints(contexts, "--contexts"),
                decode_steps=decode_steps,
                repeats=repeats,
                temperature=temperature,
                dtype=dtype,
                max_model_len=max_model_len,
                progress=None if as_json else (lambda msg: click.echo(msg, err=True)),
            )
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    path = profile.save(output)
    if as_json:
        click.echo(json.dumps(profile.to_dict(), indent=2))
    else:
        click.echo(
            f"wrote {path}: KV {profile.kv_bytes_per_token} B/token, block {profile.block_size}, "
            f"best prefill chunk {profile.best_chunk}, decode saturates at batch {profile.saturation_batch()}"
        )
