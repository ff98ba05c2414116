"""Options that several commands declare the same way."""

from __future__ import annotations

import click

#: ``--quantization`` of ``generate``, ``bench offline`` and ``worker``; the
#: choices are :data:`jaxserve.models.quant.QUANTIZATIONS` (spelled out here:
#: the worker's process never imports JAX)
quantization_option = click.option(
    "--quantization",
    type=click.Choice(["int8", "int4"]),
    default=None,
    help="Weight-only quantization: int8 or int4 blocks of 32, quantized at load "
    "(a GGUF file's Q8_0 or Q4_0/Q4_1 blocks of that width are taken as they are).",
)
