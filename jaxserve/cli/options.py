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


#: The engine options of ``generate``, ``bench offline`` and ``worker`` whose
#: default is a profile's: flag -> (type, help). Each is the ``EngineArgs``
#: field of its name (``--kv-cache-dtype``: ``kv_cache_dtype``), so one table
#: gives the three commands the same choices and help.
_PROFILE_OPTIONS: dict[str, tuple[click.ParamType, str]] = {
    "--kv-cache-dtype": (click.Choice(list(KV_CACHE_DTYPES)), KV_CACHE_DTYPE_HELP),
    "--num-speculative-tokens": (click.IntRange(min=0), NUM_SPECULATIVE_TOKENS_HELP),
    "--speculative-method": (click.Choice(list(SPECULATIVE_METHODS)), SPECULATIVE_METHOD_HELP),
}


def kv_cache_dtype_option(profile: ProfileName, forward_unset: bool = False) -> Any:
    """``--kv-cache-dtype`` with ``profile``'s default (``engine_option``)."""
    return _profile_options(profile, forward_unset, "--kv-cache-dtype")


def speculative_options(profile: ProfileName, forward_unset: bool = False) -> Any:
    """``--num-speculative-tokens`` and ``--speculative-method`` with
    ``profile``'s defaults (``engine_option``)."""
    return _profile_options(profile, forward_unset, "--num-speculative-tokens", "--speculative-method")


def _profile_options(profile: ProfileName, forward_unset: bool, *flags: str) -> Any:
    """One decorator adding the :data:`_PROFILE_OPTIONS` ``flags``, listed
    by ``--help`` in the order given."""
    options = []
    for flag in flags:
        param_type, help_text = _PROFILE_OPTIONS[flag]
        field = flag.removeprefix("--").replace("-", "_")
        options.append(
            engine_option(
                flag, field=field, profile=profile, forward_unset=forward_unset, type=param_type, help=help_text
            )
        )

    def add_options(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return add_options


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
