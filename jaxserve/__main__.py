"""``python -m jaxserve`` is the ``jaxserve`` command."""

from jaxserve.cli.main import cli

cli()
