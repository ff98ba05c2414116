"""The engine in a process of its own, so the event loop never waits for it.

Why a process and not only a thread: the engine thread and the event loop
share one GIL. The engine's host work (planning, filling the step's arrays,
detokenizing) is Python, and a loop that wakes for a broker frame while it
runs waits until the engine thread blocks in XLA or is forced off the GIL
after the switch interval (5 ms). Under a saturated batch queue on a 2-core
machine that was the interactive job's cost: the loop used a quarter of a
core, yet its lag had a median of 1.8 ms and a p90 of 7.4 ms, and the engine
thread spent an eighth of its time getting the GIL back after waking the
loop (py-spy; commit 4eda276). vLLM's V1 engine core runs in its
own process for the same reason. Here the worker's process keeps the event
loop, the broker connections and the tokenizer (prompts are encoded there);
the engine process builds the engine, compiles it and steps it, and nothing
in the worker's process imports JAX.

The engine process (:mod:`jaxserve.worker.engine_child`; what crosses
between the two: :mod:`jaxserve.worker.engine_wire`) runs the very same
engine thread as :class:`~jaxserve.worker.engine_thread.EngineThread`,
:class:`~jaxserve.worker.engine_loop.EngineLoop` (admissions join the next
plan, interactive tokens leave before it, a failing step is contained, N
failures in a row are fatal); only the two ends of it change:

- commands (``add_request``, ``add_score_request``, ``abort``, ``warmup``,
  ``stop``) travel as pickled tuples, each framed by its length, over a
  socket pair; the engine process's main thread reads them and hands them
  to the engine loop under their id, and each one's outcome comes back as a
  ``reply`` (a :class:`RequestError` keeps its code). The worker's end is an asyncio
  protocol: one read per wake-up takes every message waiting, and writes
  never block the loop;
- the engine loop's events (outputs, a failed step, a fatal failure) are sent at
  once, from the engine thread, as one message each; the outputs at a
  step's end carry the scheduler's snapshot, and the worker's end makes
  the :class:`~jaxserve.worker.engine_host.StepReport` of
  ``on_step_report`` from them and the interactive outputs sent before;
- the engine process logs as the worker does (same format and level, the
  same ``worker_id``, plus ``"process": "engine"``) on the same stderr;
- the watchdog's clocks (``busy_since_mono``, ``last_progress_mono``) and
  the counters (``steps``, ``busy_s``, ``num_computed_tokens``) live in
  shared memory, written by the engine process and read by the worker's
  without a message. ``time.monotonic()`` is one system-wide clock on
  Linux, so both processes read the same time, and so do request deadlines.

Lifetimes: the engine process ignores SIGINT and SIGTERM (the worker drains
first, then stops it); it stops when told, and when the worker's process
is gone (its pipe reaches end-of-file), so a SIGKILLed worker never leaves
an engine behind. An engine process that dies for any reason is the same
fatal failure as a dead engine thread: every pending command fails with
:class:`EngineThreadDead` and ``on_fatal`` is called.

The engine process is a fresh interpreter (``python -c``, never a fork of
a process that holds threads and locks, and never a re-run of the caller's
``__main__``, as multiprocessing's spawn would do). It inherits the
environment, is given the worker's ``sys.path``, and gets the factory by
pickle, so the factory must be a module-level callable (``functools.partial``
of one is fine) importable from that path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import pickle
import socket
import subprocess
import sys
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
)
from jaxserve.worker.engine_loop import EngineThreadDead, check_max_consecutive_step_failures
from jaxserve.worker.engine_wire import (
    BUSY_S,
    BUSY_SINCE,
    COMPUTED,
    LAST_PROGRESS,
    STEPS,
    UntransferableError,
    frame,
    new_status_file,
    shared_slot,
    unframe,
)
from jaxserve.worker.logs import logging_setup


class EngineBuildError(RuntimeError):
    """The engine process exited before it built the engine, or failed with
    an exception that cannot cross to the worker's process (the message
    holds its traceback). An exception that can is raised as itself."""


class RemoteEngine:
    """What the worker's process knows of an engine running in the engine
    process, in the shape of the engine: the fields of its
    :class:`EngineInfo` that are set, as attributes (so
    ``getattr(remote, name, default)`` answers as it would on the engine),
    and ``num_computed_tokens`` from shared memory. Kept for callers that
    read the engine's attributes; :attr:`EngineProcess.info` is the typed
    form."""

    def __init__(self, info: EngineInfo, status: Any) -> None:
        for field in dataclasses.fields(info):
            value = getattr(info, field.name)
            if value is not None and field.name != "has_scheduler":
                setattr(self, field.name, value)
        self._status = status

    @property
    def num_computed_tokens(self) -> int | None:
        value = self._status[COMPUTED]
        return None if math.isnan(value) else int(value)


_CHILD_COMMAND = "import sys; from jaxserve.worker.engine_child import engine_process_main; engine_process_main(int(sys.argv[1]), int(sys.argv[2]))"


# ---------------------------------------------------------------- the worker's side
class _EngineConnection(asyncio.Protocol):
    """The worker's end of the socket, on the event loop."""

    def __init__(self, owner: EngineProcess) -> None:
        self.owner = owner
        self._inbox = bytearray()

    def data_received(self, data: bytes) -> None:
        self._inbox += data
        for message in unframe(self._inbox):
            self.owner._dispatch(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._engine_process_gone()


class EngineProcess:
    """The :class:`~jaxserve.worker.engine_host.EngineHost` for an engine
    that runs in a process of its own (see the module docstring). Construct
    it on the event loop, then ``await open()`` (:class:`EngineInfo`), or
    ``await start()`` (the engine's attributes, :class:`RemoteEngine`), once
    the engine process has built it. The callbacks are those of
    :class:`~jaxserve.worker.engine_thread.EngineThread`, all on the loop."""

    def __init__(
        self,
        factory: Callable[[], Any],
        loop: asyncio.AbstractEventLoop,
        on_outputs: OutputsCallback,
        on_step_error: FailureCallback | None = None,
        *,
        on_step_report: StepReportCallback | None = None,
        on_fatal: FailureCallback | None = None,
        max_consecutive_step_failures: int = 5,
        name: str = "jaxserve-engine",
    ) -> None:
        check_max_consecutive_step_failures(max_consecutive_step_failures)
        # Fails here, in the caller, when the factory does not pickle.
        self._setup = (list(sys.path), pickle.dumps(factory), max_consecutive_step_failures, name, logging_setup())
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_step_error = on_step_error
        self.on_step_report = on_step_report
        self._urgent: list[RequestOutput] = []  # this step's, for its report
        self.on_fatal = on_fatal
        self._status_file, self._status = new_status_file()
        self._proc: subprocess.Popen | None = None
        self._transport: asyncio.Transport | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._built: asyncio.Future | None = None
        self._dead: tuple[str, BaseException | None] | None = None
        self._stop_requested = False
        self.engine: RemoteEngine | None = None
        self._info: EngineInfo | None = None
        #: what ended the engine, other than stop(); None while it lives
        self.fatal_error: BaseException | None = None

    # ---- life -----------------------------------------------------------
    async def start(self) -> RemoteEngine:
        """Start the engine process and wait until it has built the engine
        (:class:`EngineBuildError` if it could not)."""
        if self._stop_requested:
            raise EngineThreadDead("the engine process was stopped before it started")
        self._built = self.loop.create_future()
        mine, theirs = socket.socketpair()
        status_fd = self._status_file.fileno()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_COMMAND, str(theirs.fileno()), str(status_fd)],
                pass_fds=(theirs.fileno(), status_fd),
            )
        finally:
            theirs.close()  # its copy lives in the child: EOF here once the child is gone
            self._status_file.close()  # the mapping stays
        self._transport, _ = await self.loop.connect_accepted_socket(lambda: _EngineConnection(self), mine)
        self._send(self._setup)
        return await self._built

    async def open(self) -> EngineInfo:
        """:class:`~jaxserve.worker.engine_host.EngineHost`'s start:
        :meth:`start`, then :attr:`info`."""
        await self.start()
        return self.info

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the engine is not built yet: await open() first")
        return self._info

    @property
    def num_computed_tokens(self) -> int | None:
        value = self._status[COMPUTED]
        return None if math.isnan(value) else int(value)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the command or step in progress and wait for the engine
        process to exit (killed if it does not within ``timeout`` + 5 s).
        Blocking: call it off the loop (``asyncio.to_thread``). ``on_fatal``
        is not called."""
        self._stop_requested = True
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        try:
            if on_loop:
                self._send(("stop", timeout))
            else:
                self.loop.call_soon_threadsafe(self._send, ("stop", timeout))
        except Exception:  # noqa: BLE001 - already gone, or the loop is closed
            pass
        if self._proc is None:  # never started: later commands fail at once
            if self._dead is None:
                self._dead = ("the engine process was stopped", None)
            return
        try:
            self._proc.wait(None if timeout is None else timeout + 5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5.0)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    busy_since_mono = shared_slot(BUSY_SINCE, optional=True)
    last_progress_mono = shared_slot(LAST_PROGRESS)
    steps = shared_slot(STEPS, integer=True)
    busy_s = shared_slot(BUSY_S)

    # ---- commands (on the loop) ------------------------------------------
    def warmup(self) -> asyncio.Future:
        return self._command("warmup", (), {})

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
        """As :meth:`EngineThread.add_request`; ``deadline`` is a
        ``time.monotonic()`` value, the same clock in both processes."""
        kwargs: dict[str, Any] = {"request_class": request_class, "priority": priority, "deadline": deadline}
        if prior is not None:
            kwargs["prior"] = prior
        return self._command("add", (request_id, prompt, params), kwargs)

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
        return self._command(
            "score",
            (request_id, prompt, labels),
            {"request_class": request_class, "priority": priority, "deadline": deadline},
        )

    def abort(self, request_id: str) -> asyncio.Future:
        return self._command("abort", (request_id,), {})

    def _command(self, kind: str, args: tuple, kwargs: dict[str, Any]) -> asyncio.Future:
        fut = self.loop.create_future()
        if self._dead is not None:
            fut.set_exception(self._dead_error())
            return fut
        command_id = next(self._ids)
        self._pending[command_id] = fut
        try:
            self._send((kind, command_id, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - e.g. an argument that does not pickle
            del self._pending[command_id]
            fut.set_exception(exc)
        return fut

    def _send(self, message: tuple) -> None:
        """On the loop: queue one message for the engine process (the
        transport writes it when the socket takes it)."""
        if self._transport is None or self._transport.is_closing():
            raise EngineThreadDead("the engine process is not reachable")
        self._transport.write(frame(message))

    # ---- messages from the engine process (on the loop) -------------------
    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, stats, step_end = message
            # Tokens first; the metrics after.
            if outputs:
                self._callback(self.on_outputs, outputs)
            if not step_end:
                self._urgent.extend(outputs)
            else:
                urgent, self._urgent = self._urgent, []
                if self.on_step_report is not None:
                    self._callback(self.on_step_report, StepReport(urgent + outputs if urgent else outputs, stats))
        elif kind == "reply":
            _, command_id, ok, value = message
            fut = self._pending.pop(command_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        elif kind == "step_error":
            self._urgent = []  # the failed step's: no report carries them
            if self.on_step_error is not None:
                self._callback(self.on_step_error, message[1])
        elif kind == "fatal":
            self._died(message[1], f"the engine thread died: {message[1]!r}")
        elif kind == "built":
            self._info = message[1]
            self.engine = RemoteEngine(message[1], self._status)
            if self._built is not None and not self._built.done():
                self._built.set_result(self.engine)
        elif kind == "build_failed":
            _, exc, trace = message
            if isinstance(exc, Exception) and not isinstance(exc, UntransferableError):
                # Raised as itself (the command line turns a model that cannot
                # load into one line), the engine process's traceback noted.
                exc.add_note(f"in the engine process:\n{trace}")
            else:
                exc = EngineBuildError(f"the engine process could not build the engine: {exc!r}\n{trace}")
            if self._built is not None and not self._built.done():
                self._built.set_exception(exc)

    def _callback(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - as an event loop callback's exception would be
            self.loop.call_exception_handler({"message": f"engine process callback {fn!r} failed", "exception": exc})

    def _engine_process_gone(self) -> None:
        try:
            code = cast(subprocess.Popen, self._proc).wait(0.5)  # reap it, for its exit code (it was started)
        except subprocess.TimeoutExpired:
            code = None
        if self._built is not None and not self._built.done():
            self._built.set_exception(
                EngineBuildError(f"the engine process exited (exit code {code}) before the engine was built")
            )
        if self._dead is None:
            if self._stop_requested:
                self._dead = ("the engine process was stopped", None)
                self._fail_pending()
            else:
                self._died(RuntimeError(f"the engine process exited (exit code {code})"), None)

    def _died(self, cause: BaseException, message: str | None) -> None:
        """The engine is lost (a fatal failure reported by the engine
        process, or the process gone): fail every pending and later command
        and report it once."""
        if self._dead is not None:
            return
        self._dead = (message or f"the engine process died: {cause!r}", cause)
        self.fatal_error = cause
        self._fail_pending()
        if self.on_fatal is not None and not self._stop_requested:
            self._callback(self.on_fatal, cause)

    def _fail_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(self._dead_error())

    def _dead_error(self) -> EngineThreadDead:
        message, cause = cast("tuple[str, BaseException | None]", self._dead)  # set before it is called
        err = EngineThreadDead(message)
        err.__cause__ = cause
        return err


def _conforms(host: EngineProcess) -> EngineHost:
    """mypy holds EngineProcess to the EngineHost protocol here."""
    return host
