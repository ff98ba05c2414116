"""``jaxserve batch``: a file of requests or documents through the queue."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from jaxserve.wire.topology import DEFAULT_AMQP_URL, DEFAULT_PREFIX

#: How ``--labels`` scores by default: the method with the best accuracy on
#: benchmarks/data/topics.jsonl with SmolLM2-135M-Instruct
#: (benchmarks/classify_accuracy.py reports every method; its results JSON in benchmarks/results/).
DEFAULT_LABEL_PROMPT = "chat"
DEFAULT_CALIBRATE = True
#: after the run, each label's mean score over the run's documents is taken
#: off before the pick (jaxserve.batch.calibration; 79.2 % against 69.2 %
#: for content-free calibration alone on that set)
DEFAULT_BATCH_CALIBRATION = True


def _labels(value: str | None) -> list[str] | None:
    if value is None:
        return None
    labels = [x.strip() for x in value.split(",") if x.strip()]
    if len(labels) < 2:
        raise click.BadParameter(f"give at least two comma-separated labels, got {value!r}")
    return labels


def _label_defaults(
    labels: list[str] | None,
    template: str | None,
    chat: bool,
    label_prompt: str | None,
    normalization: str | None,
    calibrate: bool | None,
    calibration_input: str | None,
    few_shot_path: str | None,
) -> dict[str, Any]:
    """The label-scoring fields every labelled line gets unless it sets its
    own: the CLI's defaults (the measured best method) or the flags."""
    from jaxserve.batch.inputs import content_free, read_few_shot

    if chat and label_prompt == "plain":
        raise click.BadParameter(
            "--chat sends each row as a chat message, which is scored in the chat form; drop --label-prompt plain"
        )
    if calibration_input is not None and calibrate is False:
        raise click.BadParameter("--calibration-input is used with --calibrate")
    out: dict[str, Any] = {
        "label_prompt": "chat" if chat else (label_prompt or DEFAULT_LABEL_PROMPT),
        "label_normalization": normalization,
    }
    if calibrate if calibrate is not None else DEFAULT_CALIBRATE:
        out["calibrate"] = True
        if calibration_input is None and template is not None:
            calibration_input = content_free(template)
        out["calibration_input"] = calibration_input
    if few_shot_path is not None:
        out["few_shot"] = read_few_shot(few_shot_path, template, labels)
    return out


def _output_constraint(json_schema_path: str | None, choices: str | None, labels: list[str] | None) -> dict[str, Any]:
    """The body fields ``--json-schema`` / ``--choices`` give every row that
    sets no constraint of its own. The schema is checked here, once, so a
    schema the grammar compiler refuses stops the run before any publish."""
    if json_schema_path is None and choices is None:
        return {}
    if json_schema_path is not None and choices is not None:
        raise click.BadParameter("give --json-schema or --choices, not both")
    if labels is not None:
        raise click.BadParameter("--labels scores labels; --json-schema / --choices constrain generated text: pick one")
    if choices is not None:
        options = [x.strip() for x in choices.split(",") if x.strip()]
        if not options:
            raise click.BadParameter(f"give at least one comma-separated choice, got {choices!r}")
        return {"guided_choice": options}
    assert json_schema_path is not None  # neither both nor none, and not --choices
    from pathlib import Path

    import llguidance

    try:
        schema = json.loads(Path(json_schema_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise click.BadParameter(
            f"{json_schema_path}: not a readable JSON file ({exc})", param_hint="--json-schema"
        ) from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{json_schema_path}: a JSON Schema is an object", param_hint="--json-schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as exc:
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise click.BadParameter(
            f"{json_schema_path}: the schema is refused: {error.strip()}", param_hint="--json-schema"
        )
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in Path(json_schema_path).stem)[:64] or "schema"
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}


@click.command("batch")
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="OUT.jsonl: one line per request, appended; a rerun resumes it.",
)
@click.option(
    "--amqp-url",
    envvar="JAXSERVE_AMQP_URL",
    default=DEFAULT_AMQP_URL,
    show_default=True,
    help="RabbitMQ URL (env JAXSERVE_AMQP_URL).",
)
@click.option(
    "--prefix",
    envvar="JAXSERVE_PREFIX",
    default=DEFAULT_PREFIX,
    show_default=True,
    help="Name prefix of queues (env JAXSERVE_PREFIX).",
)
@click.option("--queue", type=click.Choice(["interactive", "batch"]), default="batch", show_default=True)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Jobs published but not answered yet.",
)
@click.option(
    "--idle-timeout",
    type=click.FloatRange(min=0.1),
    default=600.0,
    show_default=True,
    help="Give up when no result arrives for this long (exit status 2).",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["auto", "openai", "jaxserve"]),
    default="auto",
    show_default=True,
    help="Output lines: OpenAI Batch lines (auto: for OpenAI Batch input) or jaxserve result messages.",
)
@click.option(
    "--template",
    default=None,
    metavar="TEXT|@FILE",
    help="Jinja2 template filling each row's prompt from its fields (CSV, Parquet, JSONL rows).",
)
@click.option("--chat", is_flag=True, help="Send the filled template as one user message (the model's chat template).")
@click.option("--id-column", default=None, help="The row field holding each row's id (custom_id).")
@click.option("--batch-id", default=None, help="Scope of the keys (default: a hash of INPUT's content).")
@click.option(
    "--labels", "labels", default=None, metavar="A,B,C", help="Score these labels for every row instead of generating."
)
@click.option(
    "--label-normalization",
    type=click.Choice(["sum", "mean", "first"]),
    default=None,
    help="With --labels: sum (default), mean per token, or the first token alone.",
)
@click.option(
    "--label-prompt",
    type=click.Choice(["chat", "plain"]),
    default=None,
    help=f"With --labels: score each label as the assistant's answer in the model's chat template (chat) or as a "
    f"continuation of the prompt text (plain). Default {DEFAULT_LABEL_PROMPT}; --chat implies chat.",
)
@click.option(
    "--calibrate/--no-calibrate",
    default=None,
    help=f"With --labels: subtract each label's score on a content-free input (the template filled with N/A) "
    f"before the softmax. Default {'on' if DEFAULT_CALIBRATE else 'off'}.",
)
@click.option(
    "--calibration-input",
    default=None,
    metavar="TEXT",
    help="With --calibrate: the content-free input (default: the template filled with N/A, else N/A).",
)
@click.option(
    "--few-shot",
    "few_shot_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="With --labels: worked examples (JSONL with a label field; filled through --template like the rows, else their text field).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="The model name requests use in body.model, written in OpenAI output bodies; lines naming another "
    "model are unknown_model, and the rest run on the default model's queues. Without it, body.model routes "
    "each line to that model's workers.",
)
@click.option(
    "--model",
    default=None,
    help="Route every line or row that names no model to this model's workers (default: the deployment's "
    "default model).",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=None, help="Default max_tokens for rows that set none."
)
@click.option(
    "--temperature", type=click.FloatRange(0.0, 2.0), default=None, help="Default temperature for rows that set none."
)
@click.option("--seed", type=int, default=None, help="Default seed for rows that set none.")
@click.option(
    "--json-schema",
    "json_schema_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="Every row's output is JSON following this JSON Schema (enforced token by token); lines keep the parsed JSON next to the text.",
)
@click.option(
    "--choices",
    default=None,
    metavar="A,B,C",
    help="Every row's output is exactly one of these strings (constrained generation).",
)
@click.option(
    "--batch-calibration/--no-batch-calibration",
    default=DEFAULT_BATCH_CALIBRATION,
    show_default=True,
    help="Label scoring: after the run, take each label's mean log-probability over the run's documents "
    "(lines scored against the same labels, at least 16) off its scores and pick again; OUT keeps the worker's "
    "scores in labels[].logprob, so a resumed run recomputes it over every line.",
)
@click.option(
    "--cache/--no-cache",
    default=True,
    show_default=True,
    help="Let the workers answer deterministic rows from their response cache.",
)
def batch(
    input_path: str,
    output_path: str,
    amqp_url: str,
    prefix: str,
    queue: str,
    max_in_flight: int,
    idle_timeout: float,
    progress: bool,
    out_format: str,
    template: str | None,
    chat: bool,
    id_column: str | None,
    batch_id: str | None,
    labels: str | None,
    label_normalization: str | None,
    served_model_name: str | None,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    cache: bool,
    label_prompt: str | None = None,
    calibrate: bool | None = None,
    calibration_input: str | None = None,
    few_shot_path: str | None = None,
    json_schema_path: str | None = None,
    choices: str | None = None,
    model: str | None = None,
    batch_calibration: bool = DEFAULT_BATCH_CALIBRATION,
) -> None:
    """Run every line or row of INPUT (.jsonl, .csv, .parquet) as a job and
    write one output line per request to OUT.

    OpenAI Batch lines (custom_id, method, url, body) get OpenAI Batch output
    lines; keys are scoped to the file and to what each job asks (template,
    model, sampling, labels, schema), so a run with other options is a new
    run; a rerun skips requests answered in OUT for the same job and retries
    those that ended in a retryable error. A line's body.model routes it to
    that model's workers; a model no worker serves gets its unknown_model
    line at once. Exit status: 0 done, 1 some lines were bad (reported), a
    request got unknown_model or invalid_request, or every request failed,
    2 results still missing after --idle-timeout."""
    from jaxserve.batch.inputs import InputError, InputOptions, read_items
    from jaxserve.batch.run import BatchSettings, run_batch

    defaults: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "model": model}
    if not cache:
        defaults["cache"] = False
    label_list = _labels(labels)
    defaults.update(_output_constraint(json_schema_path, choices, label_list))
    opts = InputOptions(
        template=template,
        chat=chat,
        id_column=id_column,
        batch_id=batch_id,
        labels=label_list,
        served_model_name=served_model_name,
        defaults=defaults,
    )
    try:
        opts.label_defaults = _label_defaults(
            label_list, template, chat, label_prompt, label_normalization, calibrate, calibration_input, few_shot_path
        )
        _, items = read_items(input_path, opts)
    except (InputError, OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(str(exc)) from None
    from jaxserve.cli.errors import broker_errors, check_broker

    check_broker(amqp_url)  # one line, not a traceback, when the broker is down
    settings = BatchSettings(
        amqp_url=amqp_url,
        prefix=prefix,
        queue=queue,
        max_in_flight=max_in_flight,
        idle_timeout=idle_timeout,
        progress=progress,
        out_format=out_format,
        served_model_name=served_model_name,
    )
    from jaxserve.client import QueueError

    with broker_errors(amqp_url, mute=False):
        try:
            summary = run_batch(items, output_path, settings)
        except QueueError as exc:  # no queue under --prefix (no worker ever declared it)
            raise click.ClickException(str(exc)) from None
    report: dict[str, Any] = summary.as_dict()
    if batch_calibration:
        from jaxserve.batch.calibration import calibrate_file

        calibration = calibrate_file(output_path)
        if calibration.groups or calibration.too_few:
            report["batch_calibration"] = calibration.as_dict()
    click.echo(f"batch summary: {json.dumps(report)}", err=True)
    if summary.exit_status:
        sys.exit(summary.exit_status)
