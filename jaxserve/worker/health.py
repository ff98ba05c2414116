"""The worker's health: ``/readyz`` and ``/healthz`` for the metrics server,
and the watchdog that turns a dead or hung engine into a fatal stop
(``tests/test_queue_worker.py`` hangs an engine; ``tests/test_queue_faults.py``
kills an engine process).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from jaxserve.worker.engine_host import EngineHost, FailureCallback
from jaxserve.worker.store_health import StoreHealth
from jaxserve.worker.worker_state import WorkerStateView

LOOP_STALL_S = 30.0  # /healthz fails when the event loop has not ticked for this long


class Health:
    """The checks read the worker's state, its store's, whether its job
    consumers consume (``consuming``) and, once :meth:`watch` gave it, the
    engine's host."""

    def __init__(
        self,
        state: WorkerStateView,
        store_health: StoreHealth,
        consuming: Callable[[], bool],
        *,
        hang_timeout_s: float,
    ) -> None:
        self.state = state
        self.store_health = store_health
        self.consuming = consuming
        self.hang_timeout_s = hang_timeout_s
        self.host: EngineHost | None = None
        self.loop_tick = time.monotonic()  # the watchdog's last run (liveness)

    def watch(self, host: EngineHost) -> None:
        """The engine's host, from the moment it exists (the build included)."""
        self.host = host

    def readiness(self) -> tuple[bool, str]:
        """``/readyz`` (read from the metrics server's thread: reads only)."""
        state = self.state
        if state.closing or state.fatal_error is not None:
            return False, "stopping"
        if not state.ready:
            return False, "warming up"
        if not self.store_health.up:
            return False, f"store unavailable ({self.store_health.error})"
        if not self.consuming():
            return False, "not consuming"
        return True, "consuming"

    def liveness(self) -> tuple[bool, str]:
        """``/healthz``: false once the engine is dead or hung, or the event
        loop has not run the watchdog for 30 s."""
        host, state = self.host, self.state
        if state.fatal_error is not None:
            return False, f"engine failed: {state.fatal_error}"
        if host is None:
            return True, "starting"
        if not host.alive:
            return False, "the engine died (its thread or process is gone)"
        now = time.monotonic()
        since = host.busy_since_mono
        if state.ready and since is not None and now - since > self.hang_timeout_s:
            return False, f"the engine has been busy in one call for {now - since:.0f}s"
        if state.ready and now - self.loop_tick > LOOP_STALL_S:
            return False, f"the event loop has been stalled for {now - self.loop_tick:.0f}s"
        return True, "alive"

    async def watchdog_loop(self, on_fatal: FailureCallback) -> None:
        """An engine host (thread or process) that died or is stuck in one
        step is fatal: ``on_fatal`` is told, once."""
        host = self.host
        assert host is not None
        while True:
            await asyncio.sleep(1.0)
            self.loop_tick = time.monotonic()
            if not host.alive:
                on_fatal(RuntimeError("the engine died (its thread or process is gone)"))
                return
            since = host.busy_since_mono
            if since is not None and time.monotonic() - since > self.hang_timeout_s:
                on_fatal(RuntimeError(f"the engine has been busy in one call for over {self.hang_timeout_s:g}s"))
                return
