"""``jaxserve loadtest``: latency and throughput of a running worker, level by level."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import click

from jaxserve.cli.queue_commands import _amqp_option, _prefix_option


def _levels(text: str | None, what: str, integer: bool) -> list[float] | None:
    if text is None:
        return None
    try:
        values = [int(x) if integer else float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated {'integers' if integer else 'numbers'}, got {text!r}", param_hint=what
        ) from None
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"every level must be > 0, got {text!r}", param_hint=what)
    return values


def _range(value: str, what: str):
    from jaxserve.loadtest.workload import IntRange

    try:
        return IntRange.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=what) from None


@click.command("loadtest")
@_amqp_option
@_prefix_option
@click.option(
    "--concurrency",
    default=None,
    metavar="N,N,...",
    help="Closed loop: levels of concurrent clients, each sending one job at a time (default 1,4,8).",
)
@click.option(
    "--rate", default=None, metavar="R,R,...", help="Open loop instead: levels of Poisson arrival rates (jobs/s)."
)
@click.option(
    "--duration", type=click.FloatRange(min=0.1), default=30.0, show_default=True, help="Seconds of sending per level."
)
@click.option(
    "--output",
    "-o",
    "output",
    type=click.Path(file_okay=False),
    required=True,
    help="Folder for loadtest.json, loadtest-jobs.jsonl, loadtest-config.json and loadtest.png.",
)
@click.option("--mix", default="chat=0.8,summarize=0.2", show_default=True, help="Job kinds and their weights.")
@click.option(
    "--chat-prompt-words", default="3-12", show_default=True, help="chat: words in the user message (N or LOW-HIGH)."
)
@click.option("--chat-max-tokens", default="16-32", show_default=True, help="chat: max_tokens (N or LOW-HIGH).")
@click.option(
    "--summary-prompt-words", default="150-300", show_default=True, help="summarize: words of text in the prompt."
)
@click.option("--summary-max-tokens", default="64-128", show_default=True, help="summarize: max_tokens.")
@click.option(
    "--summary-stream/--no-summary-stream", default=False, show_default=True, help="Stream summarize jobs too."
)
@click.option(
    "--temperature",
    type=click.FloatRange(0.0, 2.0),
    default=None,
    help="Every job's temperature (default: the worker's).",
)
@click.option("--model", default=None, help="Model name the jobs ask for (default: none, any).")
@click.option("--tenant", default=None, help="Every job's tenant (the worker's --limits apply per tenant).")
@click.option(
    "--fallback-models",
    default=None,
    metavar="NAME,NAME",
    help="Every job's fallback_models: models it may be re-routed to instead of being answered overloaded.",
)
@click.option(
    "--label",
    default=None,
    help="This run's name in a comparison plot (default: its fallback models, or 'no fallback').",
)
@click.option(
    "--compare-with",
    "compare_with",
    type=click.Path(exists=True),
    default=None,
    help="Another run's output folder (or its loadtest.json): loadtest-compare.png shows both runs side by side.",
)
@click.option(
    "--ttft-target-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="The TTFT target, drawn in the comparison plot.",
)
@click.option(
    "--cancel-share",
    type=click.FloatRange(0.0, 1.0),
    default=0.05,
    show_default=True,
    help="Share of all jobs cancelled after their first chunk (taken from the streaming jobs).",
)
@click.option(
    "--settle", type=click.FloatRange(min=0.0), default=2.0, show_default=True, help="Seconds between levels."
)
@click.option(
    "--job-timeout", type=click.FloatRange(min=0.1), default=120.0, show_default=True, help="Seconds a job may take."
)
@click.option(
    "--reject-backoff",
    type=click.FloatRange(min=0.0),
    default=0.1,
    show_default=True,
    help="Closed loop: seconds a client waits after a rejection (or the rejection's retry_after_s, if longer).",
)
@click.option(
    "--max-retry-after",
    type=click.FloatRange(min=0.0),
    default=5.0,
    show_default=True,
    help="Closed loop: most seconds of a retry_after_s a client honours.",
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Open loop: arrivals beyond this many jobs in flight are dropped (counted).",
)
@click.option(
    "--capacity-check/--no-capacity-check",
    default=True,
    show_default=True,
    help="After each level: wait for the queues to drain, then send a probe of short jobs at once.",
)
@click.option(
    "--probe-jobs", type=click.IntRange(min=1), default=None, help="Probe size (default: the level's concurrency, 2-8)."
)
@click.option(
    "--broker-details/--no-broker-details",
    default=None,
    help="Also check unacknowledged messages with rabbitmqctl (default: when on PATH).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--plot/--no-plot",
    default=True,
    show_default=True,
    help="Write loadtest.png (needs matplotlib: the loadtest extra).",
)
@click.option("--json", "as_json", is_flag=True, help="Print loadtest.json to stdout instead of the table.")
def loadtest(
    amqp_url,
    prefix,
    concurrency,
    rate,
    duration,
    output,
    mix,
    chat_prompt_words,
    chat_max_tokens,
    summary_prompt_words,
    summary_max_tokens,
    summary_stream,
    temperature,
    model,
    tenant,
    fallback_models,
    label,
    compare_with,
    ttft_target_s,
    cancel_share,
    settle,
    job_timeout,
    reject_backoff,
    max_retry_after,
    max_in_flight,
    capacity_check,
    probe_jobs,
    broker_details,
    seed,
    progress,
    plot,
    as_json,
) -> None:
    """Load-test the worker(s) serving PREFIX, one level after another.

    Default workload: 80 % short chat jobs (interactive queue, streamed, a
    user message of 3-12 words, 16-32 new tokens) and 20 % summarization
    jobs (batch queue, not streamed, 150-300 words of text, 64-128 new
    tokens); 5 % of all jobs cancelled after their first chunk. Per level:
    p50/p90/p95/p99 of TTFT, inter-token latency (chunk gap divided by
    completion_tokens / chunks) and end-to-end latency, output tokens/s,
    rejections by code (queue_full, overloaded, rate_limited), cancellations,
    and whether the capacity came back (queues drained, a probe batch
    completed), and which model served the completed jobs (served_by_model,
    fallback_share) and what they cost. Exit status 3 when the capacity did
    not come back after some level.

    \b
    Two-model deployment, past the large model's capacity, with and without
    fallbacks, one plot of both runs:
    jaxserve loadtest --model big --rate 2,4,8 -o no-fallback
    jaxserve loadtest --model big --fallback-models small --rate 2,4,8 -o fallback \\
        --compare-with no-fallback --ttft-target-s 1
    """
    from jaxserve.cli.errors import broker_errors
    from jaxserve.loadtest.report import markdown_table, served_table, write_outputs
    from jaxserve.loadtest.runner import LoadTest, LoadTestError, RunConfig
    from jaxserve.loadtest.workload import Workload, default_kinds, parse_mix

    if plot and importlib.util.find_spec("matplotlib") is None:  # checked before the run, not after it
        raise click.ClickException("the plot needs matplotlib: pip install 'jaxserve[loadtest]' (or pass --no-plot)")
    fallbacks = [m.strip() for m in fallback_models.split(",") if m.strip()] if fallback_models else None
    if fallback_models is not None and not fallbacks:
        raise click.BadParameter("name at least one model", param_hint="--fallback-models")
    compared = _read_run(compare_with) if compare_with is not None else None
    if compared is not None and not plot:
        raise click.UsageError("--compare-with draws a plot: drop --no-plot")
    label = label or ("fallback to " + ", ".join(fallbacks) if fallbacks else "no fallback")
    if concurrency is not None and rate is not None:
        raise click.UsageError("give --concurrency or --rate, not both")
    closed = rate is None
    levels = _levels(concurrency or "1,4,8", "--concurrency", True) if closed else _levels(rate, "--rate", False)
    assert levels is not None  # open: --rate was given
    try:
        weights = parse_mix(mix)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mix") from None
    kinds = default_kinds(
        chat_prompt_words=_range(chat_prompt_words, "--chat-prompt-words"),
        chat_max_tokens=_range(chat_max_tokens, "--chat-max-tokens"),
        summary_prompt_words=_range(summary_prompt_words, "--summary-prompt-words"),
        summary_max_tokens=_range(summary_max_tokens, "--summary-max-tokens"),
        summary_stream=summary_stream,
    )
    try:
        workload = Workload(
            kinds,
            weights,
            seed=seed,
            cancel_share=cancel_share,
            extra_params={"temperature": temperature, "model": model, "tenant": tenant, "fallback_models": fallbacks},
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mix") from None
    cfg = RunConfig(
        amqp_url=amqp_url,
        prefix=prefix,
        mode="closed" if closed else "open",
        levels=levels,
        duration_s=duration,
        settle_s=settle,
        job_timeout_s=job_timeout,
        reject_backoff_s=reject_backoff,
        max_retry_after_s=max_retry_after,
        max_in_flight=max_in_flight,
        check_capacity=capacity_check,
        probe_jobs=probe_jobs,
        broker_details=broker_details,
        progress=progress,
        seed=seed,
    )
    started = time.time()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []

    def on_level(entry: dict) -> None:
        # what is finished survives an interrupted run; the full files are written at the end
        done.append(entry)
        (out / "loadtest.json").write_text(json.dumps(done, indent=2) + "\n")

    test = LoadTest(cfg, workload, on_level=on_level)
    with broker_errors(amqp_url):
        try:
            results = asyncio.run(test.run())
        except LoadTestError as exc:
            raise click.ClickException(str(exc)) from None
    title = f"jaxserve load test ({prefix}, {'concurrency' if closed else 'rate'} {','.join(f'{v:g}' for v in levels)})"
    paths = write_outputs(results, test.jobs, out, title=title, with_plot=plot)
    config = {
        "command": " ".join(["jaxserve", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("jaxserve") else None,
        "started_unix": round(started, 3),
        "prefix": prefix,
        "mode": cfg.mode,
        "levels": levels,
        "duration_s": duration,
        "settle_s": settle,
        "job_timeout_s": job_timeout,
        "seed": seed,
        "label": label,
        "workload": workload.describe(),
    }
    (out / "loadtest-config.json").write_text(json.dumps(config, indent=2) + "\n")
    if compared is not None:
        from jaxserve.loadtest.report import plot_runs

        paths["compare"] = plot_runs(
            [(label, results), compared],
            out / "loadtest-compare.png",
            title=f"jaxserve load test: {label} vs {compared[0]}",
            ttft_target_s=ttft_target_s,
        )
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        click.echo(markdown_table(results))
        served = served_table(results)
        if served is not None:
            click.echo("\n" + served)
        click.echo("\nwrote " + ", ".join(str(p) for p in paths.values()))
    lost = [e for e in results if e.get("capacity_back") is False]
    if lost:
        from jaxserve.loadtest.report import level_label

        click.echo(
            "capacity did not come back after "
            + ", ".join(level_label(e) for e in lost)
            + " (see capacity in loadtest.json)",
            err=True,
        )
        sys.exit(3)


def _read_run(path: str) -> tuple[str, list[dict]]:
    """A finished run to compare with: its label (from its
    loadtest-config.json, else its folder's name) and its levels."""
    p = Path(path)
    folder, levels_file = (p, p / "loadtest.json") if p.is_dir() else (p.parent, p)
    try:
        levels = json.loads(levels_file.read_text())
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"cannot read {levels_file}: {exc}", param_hint="--compare-with") from None
    if not isinstance(levels, list) or not all(isinstance(e, dict) for e in levels):
        raise click.BadParameter(
            f"{levels_file} is not a loadtest.json (a list of levels)", param_hint="--compare-with"
        )
    try:
        name = json.loads((folder / "loadtest-config.json").read_text()).get("label")
    except (OSError, ValueError, AttributeError):
        name = None
    return str(name or folder.name), levels
