"""``jaxserve batch``: a file of requests or documents through the queue."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from jaxserve.wire.topology import DEFAULT_AMQP_URL, DEFAULT_PREFIX


def _labels(value: str | None) -> list[str] | None:
    if value is None:
        return None
    labels = [x.strip() for x in value.split(",") if x.strip()]
    if len(labels) < 2:
        raise click.BadParameter(f"give at least two comma-separated labels, got {value!r}")
    return labels


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
    from pathlib import Path

    import llguidance

    try:
        schema = json.loads(Path(json_schema_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"{json_schema_path}: not a readable JSON file ({exc})", param_hint="--json-schema") from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{json_schema_path}: a JSON Schema is an object", param_hint="--json-schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as exc:
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise click.BadParameter(f"{json_schema_path}: the schema is refused: {error.strip()}", param_hint="--json-schema")
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in Path(json_schema_path).stem)[:64] or "schema"
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}


@click.command("batch")
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="OUT.jsonl: one line per request, appended; a rerun resumes it.")
@click.option("--amqp-url", envvar="JAXSERVE_AMQP_URL", default=DEFAULT_AMQP_URL, show_default=True, help="RabbitMQ URL (env JAXSERVE_AMQP_URL).")
@click.option("--prefix", envvar="JAXSERVE_PREFIX", default=DEFAULT_PREFIX, show_default=True, help="Name prefix of queues (env JAXSERVE_PREFIX).")
@click.option("--queue", type=click.Choice(["interactive", "batch"]), default="batch", show_default=True)
@click.option("--max-in-flight", type=click.IntRange(min=1), default=512, show_default=True, help="Jobs published but not answered yet.")
@click.option("--idle-timeout", type=click.FloatRange(min=0.1), default=600.0, show_default=True,
              help="Give up when no result arrives for this long (exit status 2).")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--format", "out_format", type=click.Choice(["auto", "openai", "jaxserve"]), default="auto", show_default=True,
              help="Output lines: OpenAI Batch lines (auto: for OpenAI Batch input) or jaxserve result messages.")
@click.option("--template", default=None, metavar="TEXT|@FILE",
              help="Jinja2 template filling each row's prompt from its fields (CSV, Parquet, JSONL rows).")
@click.option("--chat", is_flag=True, help="Send the filled template as one user message (the model's chat template).")
@click.option("--id-column", default=None, help="The row field holding each row's id (custom_id).")
@click.option("--batch-id", default=None, help="Scope of the keys (default: a hash of INPUT's content).")
@click.option("--labels", "labels", default=None, metavar="A,B,C", help="Score these labels for every row instead of generating.")
@click.option("--label-normalization", type=click.Choice(["sum", "mean"]), default=None, help="With --labels: sum (default) or mean.")
@click.option("--served-model-name", default=None, help="The model name requests use in body.model, written in OpenAI output bodies.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Default max_tokens for rows that set none.")
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=None, help="Default temperature for rows that set none.")
@click.option("--seed", type=int, default=None, help="Default seed for rows that set none.")
@click.option("--json-schema", "json_schema_path", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Every row's output is JSON following this JSON Schema (enforced token by token); lines keep the parsed JSON next to the text.")
@click.option("--choices", default=None, metavar="A,B,C", help="Every row's output is exactly one of these strings (constrained generation).")
@click.option("--cache/--no-cache", default=True, show_default=True, help="Let the workers answer deterministic rows from their response cache.")
def batch(
    input_path: str, output_path: str, amqp_url: str, prefix: str, queue: str, max_in_flight: int,
    idle_timeout: float, progress: bool, out_format: str, template: str | None, chat: bool,
    id_column: str | None, batch_id: str | None, labels: str | None, label_normalization: str | None,
    served_model_name: str | None, max_tokens: int | None, temperature: float | None, seed: int | None, cache: bool,
    json_schema_path: str | None = None, choices: str | None = None,
) -> None:  # fmt: skip
    """Run every line or row of INPUT (.jsonl, .csv, .parquet) as a job and
    write one output line per request to OUT.

    OpenAI Batch lines (custom_id, method, url, body) get OpenAI Batch output
    lines; keys are scoped to the file; a rerun skips requests answered in
    OUT and retries those that ended in a retryable error. Exit status: 0
    done, 1 some lines were bad (reported), 2 results still missing after
    --idle-timeout."""
    from jaxserve.batch.inputs import InputError, InputOptions, read_items
    from jaxserve.batch.run import BatchSettings, run_batch

    defaults: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    if label_normalization is not None:
        defaults["label_normalization"] = label_normalization
    if not cache:
        defaults["cache"] = False
    label_list = _labels(labels)
    defaults.update(_output_constraint(json_schema_path, choices, label_list))
    opts = InputOptions(
        template=template, chat=chat, id_column=id_column, batch_id=batch_id,
        labels=label_list, served_model_name=served_model_name, defaults=defaults,
    )  # fmt: skip
    try:
        _, items = read_items(input_path, opts)
    except (InputError, OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(str(exc)) from None
    from jaxserve.cli.errors import broker_errors, check_broker

    check_broker(amqp_url)  # one line, not a traceback, when the broker is down
    settings = BatchSettings(
        amqp_url=amqp_url, prefix=prefix, queue=queue, max_in_flight=max_in_flight, idle_timeout=idle_timeout,
        progress=progress, out_format=out_format, served_model_name=served_model_name,
    )  # fmt: skip
    from jaxserve.client import QueueError

    with broker_errors(amqp_url, mute=False):
        try:
            summary = run_batch(items, output_path, settings)
        except QueueError as exc:  # no queue under --prefix (no worker ever declared it)
            raise click.ClickException(str(exc)) from None
    click.echo(f"batch summary: {json.dumps(summary.as_dict())}", err=True)
    if summary.exit_status:
        sys.exit(summary.exit_status)
