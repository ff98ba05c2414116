"""Options that several commands declare the same way."""

from __future__ import annotations

from typing import Any

import click

from jaxserve.engine.args import KV_CACHE_DTYPES, ProfileName, profile_values
from jaxserve.engine.speculative import SPECULATIVE_METHODS

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


#: ``--kv-cache-dtype`` (vLLM's name) of ``generate``, ``bench offline`` and
#: ``worker``: ``EngineArgs.kv_cache_dtype``, its default the profile's
KV_CACHE_DTYPE_HELP = (
    "KV cache element type: auto (the model's dtype), float32, bfloat16, or int8 (a float32 scale per "
    "token and kv head: a quarter of float32's bytes)."
)


def kv_cache_dtype_option(profile: ProfileName, forward_unset: bool = False) -> Any:
    """``--kv-cache-dtype`` with ``profile``'s default (``engine_option``)."""
    return engine_option(
        "--kv-cache-dtype",
        field="kv_cache_dtype",
        profile=profile,
        forward_unset=forward_unset,
        type=click.Choice(list(KV_CACHE_DTYPES)),
        help=KV_CACHE_DTYPE_HELP,
    )


#: ``--num-speculative-tokens`` / ``--speculative-method`` (vLLM's names) of
#: ``generate``, ``bench offline`` and ``worker``
NUM_SPECULATIVE_TOKENS_HELP = (
    "Speculative decoding: most guessed tokens a sequence carries into one engine step, verified there by the "
    "model (the output is the one without them; 0 turns it off). Guesses are made where they pay for the bigger "
    "step: copying from the prompt, repeats, a grammar's forced tokens."
)
SPECULATIVE_METHOD_HELP = (
    "Where guesses come from: ngram (the sequence's last tokens matched earlier in its prompt and output; under "
    "a grammar, the tokens it forces)."
)


def speculative_options(profile: ProfileName, forward_unset: bool = False) -> Any:
    """``--num-speculative-tokens`` and ``--speculative-method`` with
    ``profile``'s defaults (``engine_option``)."""
    tokens = engine_option(
        "--num-speculative-tokens",
        field="num_speculative_tokens",
        profile=profile,
        forward_unset=forward_unset,
        type=click.IntRange(min=0),
        help=NUM_SPECULATIVE_TOKENS_HELP,
    )
    method = engine_option(
        "--speculative-method",
        field="speculative_method",
        profile=profile,
        forward_unset=forward_unset,
        type=click.Choice(list(SPECULATIVE_METHODS)),
        help=SPECULATIVE_METHOD_HELP,
    )
    return lambda command: tokens(method(command))


def engine_option(*decls: str, field: str, profile: ProfileName, forward_unset: bool = False, **attrs: Any) -> Any:
    """A ``click.option`` for the ``EngineArgs`` field ``field`` whose
    default is that profile's (``jaxserve.engine.args.PROFILES``), read, not
    written again (``tests/test_settings_sources.py``).

    ``forward_unset``: the option's value is ``None`` unless given, and
    ``--help`` shows the profile's value. ``jaxserve worker`` declares its
    engine options so: it hands the factory only what the operator set, so
    another ``--engine`` factory keeps its own defaults and the ``serve``
    profile derives the rest (a quarter of the given ``--max-num-seqs``)."""
    value = profile_values(profile)[field]
    if forward_unset:
        return click.option(*decls, default=None, show_default=str(value), **attrs)
    return click.option(*decls, default=value, show_default=True, **attrs)
