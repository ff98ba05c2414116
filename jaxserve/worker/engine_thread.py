"""The engine on a thread of the worker's process: the in-process
:class:`~jaxserve.worker.engine_host.EngineHost`.

The thread itself, with its ordering (arrivals join the next plan,
interactive tokens leave before it) and its failure handling (a failing
step is contained, ``EngineBroken`` or N failures in a row are fatal, a
dead thread fails every pending and later command with
:class:`EngineThreadDead`), is :class:`~jaxserve.worker.engine_loop.EngineLoop`;
the engine process runs the same loop. This host is its asyncio end:
commands return futures of the event loop, and every event reaches the loop
through ``loop.call_soon_threadsafe``:

- ``on_outputs(outputs)``: a step's outputs (interactive ones as soon as the
  engine hands them over, the rest when the step ends);
- ``on_step_report(StepReport)``: after the outputs of a step that produced
  any, every one of them and the scheduler's snapshot (the metrics);
- ``on_step_error(exc)``: a step failed; the engine goes on;
- ``on_fatal(exc)``: once, when the thread dies for any reason other than
  :meth:`EngineThread.stop`; ``exc`` is the ``EngineBroken`` that ``step()``
  raised, an ``EngineBroken`` naming the last of
  ``max_consecutive_step_failures`` failed steps (its ``__cause__``), or the
  exception that escaped the thread's loop. The engine must then be
  considered lost (restart the process).

The metrics run on the loop too (``on_step_report``), as in the engine
process: the scheduler's snapshot is taken on the engine thread, and the
report rides with the step's outputs in one callback (a step whose outputs
all left early adds one wake-up of the loop; a step without outputs, none).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, cast

from jaxserve.engine.types import PriorOutput, RequestClass, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.engine_host import (
    EngineHost,
    EngineInfo,
    FailureCallback,
    OutputsCallback,
    StepReport,
    StepReportCallback,
    engine_info,
)
from jaxserve.worker.engine_loop import EngineLoop, EngineThreadDead, check_max_consecutive_step_failures

__all__ = ["EngineThread", "EngineThreadDead", "check_max_consecutive_step_failures"]


class _OnEventLoop:
    """The engine loop's events, delivered on the host's asyncio event loop."""

    def __init__(self, host: EngineThread) -> None:
        self.host = host
        self.loop = host.loop

    def reply(self, token: Any, result: Any, error: BaseException | None) -> None:
        fut = cast(asyncio.Future, token)

        def done() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self.loop.call_soon_threadsafe(done)

    def urgent_outputs(self, outputs: list[RequestOutput]) -> None:
        self.loop.call_soon_threadsafe(self.host.on_outputs, outputs)

    def step_done(self, outputs: list[RequestOutput], urgent: list[RequestOutput], stats: Any) -> None:
        report = None
        if self.host.on_step_report is not None and (outputs or urgent):
            report = StepReport(urgent + outputs if urgent else outputs, stats)
        if outputs or report is not None:
            self.loop.call_soon_threadsafe(self.host._deliver, outputs, report)

    def step_error(self, exc: BaseException) -> None:
        if self.host.on_step_error is not None:
            self.loop.call_soon_threadsafe(self.host.on_step_error, exc)

    def fatal(self, exc: BaseException) -> None:
        if self.host.on_fatal is not None:
            self.loop.call_soon_threadsafe(self.host.on_fatal, exc)


class EngineThread:
    """Runs an engine on a thread of its own (see the module docstring).
    Construct it on the event loop with the engine, or with
    :meth:`from_factory` to have :meth:`open` build it."""

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        on_outputs: OutputsCallback,
        on_step_error: FailureCallback | None = None,
        *,
        on_step_report: StepReportCallback | None = None,
        on_fatal: FailureCallback | None = None,
        max_consecutive_step_failures: int = 5,
        name: str = "jaxserve-engine",
    ) -> None:
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_step_error = on_step_error
        self.on_step_report = on_step_report
        self.on_fatal = on_fatal
        self._factory: Callable[[], Any] | None = None  # set by from_factory; open() calls it
        self._info: EngineInfo | None = None
        self._engine_loop = EngineLoop(
            None,
            _OnEventLoop(self),
            with_stats=on_step_report is not None,
            max_consecutive_step_failures=max_consecutive_step_failures,
            name=name,
        )
        if engine is not None:
            self._attach(engine)

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[], Any],
        loop: asyncio.AbstractEventLoop,
        on_outputs: OutputsCallback,
        on_step_error: FailureCallback | None = None,
        **kwargs: Any,
    ) -> EngineThread:
        """A host that builds its engine in :meth:`open` (``factory()`` on a
        worker thread), as :class:`EngineProcess` does in its process: the
        worker constructs either host the same way, before the build, so a
        shutdown during the build finds it."""
        host = cls(None, loop, on_outputs, on_step_error, **kwargs)
        host._factory = factory
        return host

    def _attach(self, engine: Any) -> None:
        self._engine_loop.attach(engine)
        self._info = engine_info(engine)

    def _deliver(self, outputs: list[RequestOutput], report: StepReport | None) -> None:
        """On the loop: a step's outputs (tokens first), then its report."""
        try:
            if outputs:
                self.on_outputs(outputs)
        finally:
            if report is not None and self.on_step_report is not None:
                try:
                    self.on_step_report(report)
                except Exception as exc:  # noqa: BLE001 - metrics must never stop serving
                    self.loop.call_exception_handler({"message": "on_step_report failed", "exception": exc})

    # ---- life -----------------------------------------------------------
    def start(self) -> None:
        """Start the thread (the engine was given to the constructor)."""
        self._engine_loop.start()

    async def open(self) -> EngineInfo:
        """:class:`~jaxserve.worker.engine_host.EngineHost`'s start: build
        the engine (hosts made by :meth:`from_factory`), start the thread
        unless :meth:`start` did, and return :attr:`info`."""
        if self._engine_loop.stop_requested:  # before the build: it would only be thrown away
            raise EngineThreadDead("the engine thread was stopped before it started")
        if self._engine_loop.engine is None:
            factory = cast("Callable[[], Any]", self._factory)  # from_factory set it: engine is None
            self._attach(await asyncio.to_thread(factory))
        self._engine_loop.start()
        return self.info

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the command or step in progress; commands still queued
        then fail with :class:`EngineThreadDead`. ``on_fatal`` is not called.
        Blocking: from the loop, call it through ``asyncio.to_thread``."""
        self._engine_loop.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._engine_loop.alive

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the engine is not built yet: await open() first")
        return self._info

    @property
    def pid(self) -> int | None:
        """None: the engine runs in this process."""
        return None

    @property
    def engine(self) -> Any:
        return self._engine_loop.engine

    # ---- the engine loop's state, read where it lives -----------------------
    @property
    def fatal_error(self) -> BaseException | None:
        """What ended the thread, other than stop(); None while it lives."""
        return self._engine_loop.fatal_error

    @property
    def busy_since_mono(self) -> float | None:
        """time.monotonic() when the running step or command started; None when idle."""
        return self._engine_loop.busy_since_mono

    @property
    def last_progress_mono(self) -> float:
        """time.monotonic() when the last step or command completed."""
        return self._engine_loop.last_progress_mono

    @property
    def steps(self) -> int:
        return self._engine_loop.steps

    @property
    def busy_s(self) -> float:
        return self._engine_loop.busy_s

    @property
    def consecutive_step_failures(self) -> int:
        return self._engine_loop.consecutive_step_failures

    @property
    def max_consecutive_step_failures(self) -> int:
        return self._engine_loop.max_consecutive_step_failures

    @property
    def num_computed_tokens(self) -> int | None:
        computed = getattr(self._engine_loop.engine, "num_computed_tokens", None)
        return computed if isinstance(computed, int) else None

    @property
    def _thread(self) -> threading.Thread:
        return self._engine_loop.thread

    @property
    def _cmds(self) -> queue.SimpleQueue:
        return self._engine_loop._cmds

    # ---- commands (on the loop) ------------------------------------------
    def _call(self, fn: Callable[[], Any], admission: bool = False) -> asyncio.Future:
        fut = self.loop.create_future()
        dead = self._engine_loop.submit(fn, fut, admission)
        if dead is not None:
            fut.set_exception(dead)
        return fut

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread; a future of its result."""
        return self._call(lambda: fn(self._engine_loop.engine))

    def warmup(self) -> asyncio.Future:
        return self._call(lambda: self._engine_loop.engine.warmup())

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_class: RequestClass = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
        prior: PriorOutput | None = None,
    ) -> asyncio.Future:
        """Future: None once admitted, or a :class:`RequestError`
        (:class:`EngineThreadDead` if the thread is gone). ``prior`` is
        passed on only when given (an engine double may not take it)."""
        kwargs: dict[str, Any] = {"request_class": request_class, "priority": priority, "deadline": deadline}
        if prior is not None:
            kwargs["prior"] = prior
        return self._call(
            lambda: self._engine_loop.engine.add_request(request_id, prompt, params, **kwargs),
            admission=True,
        )

    def add_score_request(
        self,
        request_id: str,
        prompt: list[int],
        labels: list[list[int]],
        *,
        request_class: RequestClass = RequestClass.BATCH,
        priority: int = 0,
        deadline: float | None = None,
    ) -> asyncio.Future:
        """Label scoring (``Engine.add_score_request``): future as for
        :meth:`add_request`."""
        return self._call(
            lambda: self._engine_loop.engine.add_score_request(
                request_id, prompt, labels, request_class=request_class, priority=priority, deadline=deadline
            ),
            admission=True,
        )

    def abort(self, request_id: str) -> asyncio.Future:
        return self._call(lambda: self._engine_loop.engine.abort(request_id))


def _conforms(host: EngineThread) -> EngineHost:
    """mypy holds EngineThread to the EngineHost protocol here."""
    return host
