"""The worker's health: ``/readyz`` and ``/healthz`` for the metrics server,
and the watchdog that turns a dead or hung engine into a fatal stop
(``tests/test_queue_worker.py`` hangs an engine; ``tests/test_queue_faults.py``
kills an engine process).

The watchdog's one-second tick also feeds the admission's prefill rate and
paces the batch consumer, so those run at the same cadence the liveness
check watches.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.worker.worker import Worker

LOOP_STALL_S = 30.0  # /healthz fails when the event loop has not ticked for this long


class Health:
    def __init__(self, w: Worker) -> None:
        self.w = w
        self.loop_tick = time.monotonic()  # the watchdog's last run (liveness)

    def readiness(self) -> tuple[bool, str]:
        """``/readyz`` (read from the metrics server's thread: reads only)."""
        w = self.w
        if w._closing or w._fatal.is_set():
            return False, "stopping"
        if not w.ready.is_set():
            return False, "warming up"
        if not w.store_health.up:
            return False, f"store unavailable ({w.store_health.error})"
        if not w.connections.consuming:
            return False, "not consuming"
        return True, "consuming"

    def liveness(self) -> tuple[bool, str]:
        """``/healthz``: false once the engine is dead or hung, or the event
        loop has not run the watchdog for 30 s."""
        w = self.w
        host = w.host
        if w._fatal.is_set():
            return False, f"engine failed: {w.fatal_error}"
        if host is None:
            return True, "starting"
        if not host.alive:
            return False, "the engine died (its thread or process is gone)"
        now = time.monotonic()
        since = host.busy_since_mono
        if w.ready.is_set() and since is not None and now - since > w.cfg.engine_hang_timeout_s:
            return False, f"the engine has been busy in one call for {now - since:.0f}s"
        if w.ready.is_set() and now - self.loop_tick > LOOP_STALL_S:
            return False, f"the event loop has been stalled for {now - self.loop_tick:.0f}s"
        return True, "alive"

    async def watchdog_loop(self) -> None:
        """An engine host (thread or process) that died or is stuck in one step is fatal."""
        w = self.w
        host = w.host
        assert host is not None
        while True:
            await asyncio.sleep(1.0)
            self.loop_tick = time.monotonic()
            computed, busy_s = host.num_computed_tokens, host.busy_s
            if computed is not None and busy_s is not None:
                w.admission.observe(computed, busy_s)
            await w.connections.pace_batch()
            if not host.alive:
                w.on_engine_fatal(RuntimeError("the engine died (its thread or process is gone)"))
                return
            since = host.busy_since_mono
            if since is not None and time.monotonic() - since > w.cfg.engine_hang_timeout_s:
                w.on_engine_fatal(
                    RuntimeError(f"the engine has been busy in one call for over {w.cfg.engine_hang_timeout_s:g}s")
                )
                return
