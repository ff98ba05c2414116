"""Interactive pressure, measured and acted on once a second.

The engine's cumulative computed tokens and busy time feed the interactive
admission's prefill rate (``InteractiveAdmission.observe``: its token
budget follows the engine's speed), and the pressure that results, the
interactive prompt tokens held against that budget, paces batch
consumption: a worker saturated with interactive work pauses its batch
consumer instead of holding batch jobs, and resumes it below half the
threshold (``Connections.pace_batch``; ``tests/test_queue_admission.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from jaxserve.worker.admission import InteractiveAdmission
from jaxserve.worker.engine_host import EngineHost


async def pace(
    host: EngineHost,
    admission: InteractiveAdmission,
    pace_batch: Callable[[float], Awaitable[None]],
    period_s: float = 1.0,
) -> None:
    while True:
        await asyncio.sleep(period_s)
        computed, busy_s = host.num_computed_tokens, host.busy_s
        if computed is not None and busy_s is not None:
            admission.observe(computed, busy_s)
        await pace_batch(admission.pressure)
