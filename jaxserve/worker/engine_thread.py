"""The engine's own thread.

The engine is not thread-safe, so exactly one thread (this one) touches it.
asyncio code sends commands through a thread-safe queue and gets results as
futures; step outputs are delivered to the event loop with
``loop.call_soon_threadsafe``. While the engine has work the thread loops
``step()``; when idle it blocks on the command queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable, Sequence

from jaxserve.engine.types import RequestClass, RequestOutput, SamplingParams

OutputsCallback = Callable[[Sequence[RequestOutput]], None]
FailureCallback = Callable[[BaseException], None]

_STOP = object()


class EngineThread:
    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        on_outputs: OutputsCallback,
        on_step_error: FailureCallback | None = None,
        *,
        on_step: Callable[[Any, Sequence[RequestOutput]], None] | None = None,
        name: str = "jaxserve-engine",
    ) -> None:
        self.engine = engine
        # Runs on the engine thread after every step (metrics); must be cheap.
        self.on_step = on_step
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_step_error = on_step_error
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self.steps = 0
        self.busy_s = 0.0

    # ---- asyncio side -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        fut = self.loop.create_future()
        self._cmds.put((fn, fut))
        return fut

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread; a future of its result."""
        return self._call(lambda: fn(self.engine))

    def warmup(self) -> asyncio.Future:
        return self._call(self.engine.warmup)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_class: RequestClass = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
    ) -> asyncio.Future:
        """Future: None once admitted, or a :class:`RequestError`."""
        return self._call(
            lambda: self.engine.add_request(
                request_id, prompt, params, request_class=request_class, priority=priority, deadline=deadline
            )
        )

    def abort(self, request_id: str) -> asyncio.Future:
        return self._call(lambda: self.engine.abort(request_id))

    def stop(self, timeout: float | None = 10.0) -> None:
        self._cmds.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- engine thread -----------------------------------------------
    def _resolve(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        try:
            self.loop.call_soon_threadsafe(done)
        except RuntimeError:  # loop closed
            pass

    def _run_cmd(self, item: Any) -> bool:
        if item is _STOP:
            return False
        fn, fut = item
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - forwarded to the awaiting coroutine
            self._resolve(fut, exc=exc)
        else:
            self._resolve(fut, result)
        return True

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block when idle; otherwise drain pending commands and step.
                if not engine.has_unfinished():
                    if not self._run_cmd(self._cmds.get()):
                        return
                while True:
                    try:
                        item = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    if not self._run_cmd(item):
                        return
                if not engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001
                    self.busy_s += time.perf_counter() - t0
                    if self.on_step_error is not None:
                        try:
                            self.loop.call_soon_threadsafe(self.on_step_error, exc)
                        except RuntimeError:
                            return
                    time.sleep(0.05)  # never spin hot on a broken engine
                    continue
                self.busy_s += time.perf_counter() - t0
                self.steps += 1
                if self.on_step is not None:
                    try:
                        self.on_step(engine, outputs)
                    except Exception:  # noqa: BLE001 - metrics must never stop serving
                        pass
                if outputs:
                    try:
                        self.loop.call_soon_threadsafe(self.on_outputs, list(outputs))
                    except RuntimeError:
                        return
        finally:
            self._stopped.set()
