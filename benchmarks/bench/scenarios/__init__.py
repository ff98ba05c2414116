"""The named scenarios, in the table's order.

Each has ``NAME``, ``DESCRIPTION``, ``COMMAND`` (the full run),
``add_arguments(parser)`` and ``run(args, ctx) -> (figures, runs, settings)``
(optionally ``DEFAULT_ROUNDS`` and ``DEFAULT_WARMUP_ROUNDS``); ``ctx``
carries ``tmp`` (a working folder), ``rounds``, ``warmup_rounds``,
``machine`` and ``smoke``.
"""

from __future__ import annotations

from typing import Any

from . import classify, gateway, kv_int8, memory, moe, offline, prefill, speculative, ttft, two_model
from .external import ACCURACY, QUANT_QUALITY, STRUCTURED

SCENARIOS: dict[str, Any] = {
    m.NAME: m
    for m in (
        offline,
        moe,
        prefill,
        classify,
        ttft,
        memory,
        two_model,
        gateway,
        kv_int8,
        speculative,
        ACCURACY,
        QUANT_QUALITY,
        STRUCTURED,
    )
}
