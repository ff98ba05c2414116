"""The engine loop: the one thread that touches the engine, which both
engine hosts run.

The engine is not thread-safe, so exactly one thread (this one) touches it.
Commands arrive through a thread-safe queue, each with a *token* (the
caller's handle for its outcome); everything the thread has to say goes to
a :class:`LoopEvents`. :class:`~jaxserve.worker.engine_thread.EngineThread`
gives it a sink that resolves asyncio futures and calls back on the event
loop; the engine process (:mod:`jaxserve.worker.engine_process`) gives it
one that writes each event to the worker's process as a message. While the
engine has work the thread loops ``step()``; when idle it blocks on the
command queue.

Arrivals join the very next plan. ``Engine.step`` collects the step in
flight and plans the next one inside one call, so a request queued while a
step computes would otherwise wait for the plan after that one: a whole
extra step before an interactive prompt starts. The loop therefore sets
the engine's ``before_plan`` hook to run the admissions (``add_request``,
``add_score_request``) queued so far; any other command, and everything
queued behind it, keeps its order and runs after the step.

Interactive tokens leave first: the loop sets the engine's
``on_urgent_outputs`` hook, so an interactive request's outputs reach the
sink (:meth:`LoopEvents.urgent_outputs`) before the engine plans the next
step; :meth:`LoopEvents.step_done` then gets the step's other outputs, with
the urgent ones beside them.

Failure handling:

- A ``step()`` that raises is reported to :meth:`LoopEvents.step_error` and
  the thread carries on: the engine contains per-request failures itself,
  so an exception out of ``step()`` means the step as a whole failed.
- It is fatal when the engine says it cannot recover (``EngineBroken``) or
  when ``max_consecutive_step_failures`` steps in a row failed (a success in
  between resets the count): the thread stops and :meth:`LoopEvents.fatal`
  gets the error, after the ``step_error`` of that failure.
- Whenever the thread has exited, for whatever reason, every command still
  queued and every later one fails with :class:`EngineThreadDead`, so no
  caller waits for an outcome that will never come. Any exit other than
  :meth:`EngineLoop.stop` (a fatal step failure, an exception escaping the
  loop, a sink whose receiver is gone) is also reported to ``fatal``.
- For a watchdog: ``busy_since_mono`` is the ``time.monotonic()`` at which
  the step or command now running started (``None`` while the thread waits
  for work, so an idle engine never looks hung), and ``last_progress_mono``
  the time the last step or command completed. Busy for longer than a
  step can take means hung; note that ``warmup`` is a command and may run
  for minutes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from jaxserve.engine.types import EngineBroken, RequestOutput
from jaxserve.worker.engine_host import scheduler_stats

_STOP = object()


def check_max_consecutive_step_failures(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"max_consecutive_step_failures must be an integer >= 1, got {value!r}")


class EngineThreadDead(RuntimeError):
    """The engine thread has exited: a command sent to it will never run.
    ``__cause__`` is what ended it (``None`` after a stop)."""


class LoopEvents(Protocol):
    """Where the engine thread's events go. Every method runs on the engine
    thread and must return quickly; a ``RuntimeError`` means its receiver is
    gone (a closed event loop, a worker process that exited)."""

    def reply(self, token: Any, result: Any, error: BaseException | None) -> None:
        """A command's outcome: its result, or the exception it raised."""

    def urgent_outputs(self, outputs: list[RequestOutput]) -> None:
        """Interactive outputs the engine handed over before the step ended."""

    def step_done(self, outputs: list[RequestOutput], urgent: list[RequestOutput], stats: Any) -> None:
        """A step completed: its ``outputs`` (the urgent ones, already sent,
        not among them; ``urgent`` holds those), and the scheduler's snapshot
        after it when the loop was asked for one (else ``None``)."""

    def step_error(self, exc: BaseException) -> None:
        """A step raised; the thread carries on unless it is fatal."""

    def fatal(self, exc: BaseException) -> None:
        """The thread is ending for a reason other than stop()."""


class EngineLoop:
    """Runs an engine on a thread of its own (see the module docstring).

    ``engine`` may be attached later (:meth:`attach`), before :meth:`start`.
    With ``with_stats``, :meth:`LoopEvents.step_done` gets the scheduler's
    snapshot of every step.
    """

    def __init__(
        self,
        engine: Any,
        sink: LoopEvents,
        *,
        with_stats: bool = False,
        max_consecutive_step_failures: int = 5,
        name: str = "jaxserve-engine",
    ) -> None:
        check_max_consecutive_step_failures(max_consecutive_step_failures)
        self.sink = sink
        self.with_stats = with_stats
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()  # (fn, token, is_admission) or _STOP
        # Commands the before_plan hook took off the queue but left for the
        # loop (a non-admission, to keep the order); the loop runs them first.
        self._deferred: list[Any] = []
        # Interactive outputs handed over during the step now running.
        self._urgent: list[RequestOutput] = []
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Guards the hand-over between submit() queueing a command and the
        # dying thread draining the queue: a command is either queued before
        # the drain (and failed by it) or sees _dead set (and fails at once);
        # and a start() against a stop() that came first.
        self._lock = threading.Lock()
        self._dead: tuple[str, BaseException | None] | None = None  # (message, cause) once exited
        self._stop_requested = False
        self.steps = 0
        self.busy_s = 0.0
        self.consecutive_step_failures = 0
        #: what ended the thread, other than stop(); None while it lives
        self.fatal_error: BaseException | None = None
        #: time.monotonic() when the last step or command completed
        self.last_progress_mono = time.monotonic()
        #: time.monotonic() when the running step or command started; None when idle
        self.busy_since_mono: float | None = None
        self.engine: Any = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Any) -> None:
        """Take ``engine``, installing the hooks it has room for."""
        self.engine = engine
        if hasattr(engine, "before_plan"):
            engine.before_plan = self._admit_arrivals
        if hasattr(engine, "on_urgent_outputs"):
            engine.on_urgent_outputs = self._post_urgent

    # ---- any thread ---------------------------------------------------
    def start(self) -> None:
        """Start the thread; EngineThreadDead if :meth:`stop` came first."""
        with self._lock:  # stop() sets _stop_requested before it looks, under this lock, for a thread
            if self._stop_requested:
                raise EngineThreadDead("the engine thread was stopped before it started")
            if self.thread.ident is None:
                self.thread.start()

    def submit(self, fn: Callable[[], Any], token: Any, admission: bool = False) -> EngineThreadDead | None:
        """Queue ``fn()`` for the engine thread; its outcome goes to
        :meth:`LoopEvents.reply` with ``token``. Returns the error to fail it
        with at once when the thread has exited (the sink is not called)."""
        with self._lock:
            if self._dead is None:
                self._cmds.put((fn, token, admission))
                return None
        return self.dead_error()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the command or step in progress; commands still queued
        then fail with :class:`EngineThreadDead`. ``fatal`` is not called."""
        self._stop_requested = True
        with self._lock:
            started = self.thread.ident is not None
        if not started:  # nothing else will fail the queued commands
            self._exit(None)
            return
        self._cmds.put(_STOP)
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def dead_error(self) -> EngineThreadDead:
        message, cause = cast("tuple[str, BaseException | None]", self._dead)  # set before it is called
        err = EngineThreadDead(message)
        err.__cause__ = cause
        return err

    # ---- engine thread -----------------------------------------------
    def _reply(self, token: Any, result: Any = None, error: BaseException | None = None) -> None:
        try:
            self.sink.reply(token, result, error)
        except RuntimeError:  # its receiver is gone: nobody waits for it
            pass

    def _run_cmd(self, item: Any, within_step: bool = False) -> bool:
        if item is _STOP:
            return False
        fn, token, _admission = item
        if not within_step:
            self.busy_since_mono = time.monotonic()
        result = error = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - forwarded to the caller
            error = exc
        # Not busy any more before the caller can see the outcome (within a
        # step, the step still is).
        self.last_progress_mono = time.monotonic()
        if not within_step:
            self.busy_since_mono = None
        self._reply(token, result, error)
        return True

    def _admit_arrivals(self) -> None:
        """The engine's ``before_plan`` hook (see the module docstring): run
        the admissions queued so far; stop at the first other command, which
        waits in ``_deferred`` for the loop, with everything behind it still
        queued."""
        if self._deferred:
            return
        while True:
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return
            if item is _STOP or not item[2]:
                self._deferred.append(item)
                return
            self._run_cmd(item, within_step=True)

    def _post_urgent(self, outputs: list[RequestOutput]) -> None:
        """The engine's ``on_urgent_outputs`` hook: must not raise."""
        self._urgent.extend(outputs)
        try:
            self.sink.urgent_outputs(list(outputs))
        except RuntimeError:  # receiver gone: the thread ends after this step
            pass

    def _run(self) -> None:
        escaped: BaseException | None = None
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread dies; see _exit
            escaped = exc
        finally:
            self._exit(escaped)

    def _loop(self) -> None:
        """Serve commands and step the engine until stopped or fatal."""
        engine = self.engine
        while True:
            # Block when idle; otherwise drain pending commands and step.
            if not engine.has_unfinished() and not self._deferred:
                if not self._run_cmd(self._cmds.get()):
                    return
            while True:
                if self._deferred:
                    item = self._deferred.pop(0)
                else:
                    try:
                        item = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                if not self._run_cmd(item):
                    return
            if not engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            self.busy_since_mono = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001
                self.busy_s += time.perf_counter() - t0
                self.busy_since_mono = None
                self._urgent = []
                if not self._step_failed(exc):
                    return
                time.sleep(0.05)  # never spin hot on a broken engine
                continue
            self.busy_s += time.perf_counter() - t0
            self.steps += 1
            self.consecutive_step_failures = 0
            self.last_progress_mono = time.monotonic()
            self.busy_since_mono = None
            urgent, self._urgent = self._urgent, []
            stats = None
            if self.with_stats:
                try:
                    stats = scheduler_stats(engine)
                except Exception:  # noqa: BLE001 - metrics must never stop serving: a missing snapshot
                    stats = None
            try:
                self.sink.step_done(list(outputs), urgent, stats)
            except RuntimeError:
                return

    def _step_failed(self, exc: Exception) -> bool:
        """Report a failed step; returns whether the thread may go on."""
        try:
            self.sink.step_error(exc)
        except RuntimeError:  # receiver gone
            return False
        self.consecutive_step_failures += 1
        if isinstance(exc, EngineBroken):
            self.fatal_error = exc
            return False
        if self.consecutive_step_failures >= self.max_consecutive_step_failures:
            fatal = EngineBroken(
                f"{self.consecutive_step_failures} engine steps in a row failed; the last with {exc!r}"
            )
            fatal.__cause__ = exc
            self.fatal_error = fatal
            return False
        return True

    def _exit(self, escaped: BaseException | None) -> None:
        """The thread is ending: fail every queued command (and, through
        ``_dead``, every later one), and report a death other than stop()."""
        self.busy_since_mono = None
        if self.fatal_error is None and escaped is not None:
            self.fatal_error = escaped
        stopped = self._stop_requested
        if stopped:
            dead: tuple[str, BaseException | None] = ("the engine thread was stopped", None)
        else:
            cause = self.fatal_error
            if cause is None:  # it returned because the sink's receiver is gone
                cause = self.fatal_error = RuntimeError("the event loop closed under the engine thread")
            dead = (f"the engine thread died: {cause!r}", cause)
        with self._lock:
            self._dead = dead
            pending, self._deferred = self._deferred, []
            while True:
                try:
                    pending.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
        for item in pending:
            if item is not _STOP:
                self._reply(item[1], error=self.dead_error())
        # not stopped: the branch above set fatal_error
        fatal = self.fatal_error
        if not stopped and fatal is not None:
            try:
                self.sink.fatal(fatal)
            except RuntimeError:  # receiver gone
                pass
