"""The engine's own thread.

The engine is not thread-safe, so exactly one thread (this one) touches it.
asyncio code sends commands through a thread-safe queue and gets results as
futures; step outputs are delivered to the event loop with
``loop.call_soon_threadsafe``. While the engine has work the thread loops
``step()``; when idle it blocks on the command queue.

Arrivals join the very next plan. ``Engine.step`` collects the step in
flight and plans the next one inside one call, so a request queued while a
step computes would otherwise wait for the plan after that one: a whole
extra step before an interactive prompt starts. The thread therefore sets
the engine's ``before_plan`` hook to run the admissions (``add_request``,
``add_score_request``) queued so far; any other command, and everything
queued behind it, keeps its order and runs after the step.

Interactive tokens leave first: the thread sets the engine's
``on_urgent_outputs`` hook, so an interactive request's outputs reach the
loop before the engine plans the next step (``on_outputs`` is called for
them separately, ahead of the step's other outputs; ``on_step`` sees both).

Failure handling:

- A ``step()`` that raises is reported to ``on_step_error`` (on the loop) and
  the thread carries on: the engine contains per-request failures itself,
  so an exception out of ``step()`` means the step as a whole failed.
- It is fatal when the engine says it cannot recover (``EngineBroken``) or
  when ``max_consecutive_step_failures`` steps in a row failed (a success in
  between resets the count): the thread stops and ``on_fatal(exc)`` is
  called on the loop, after the ``on_step_error`` of that failure.
- Whenever the thread has exited, for whatever reason, every command still
  queued and every later one fails with :class:`EngineThreadDead`, so no
  coroutine awaits a future that nothing will resolve. Any exit other than
  :meth:`EngineThread.stop` (a fatal step failure, an exception escaping the
  loop) also calls ``on_fatal``.
- For a watchdog: ``busy_since_mono`` is the ``time.monotonic()`` at which
  the step or command now running started (``None`` while the thread waits
  for work, so an idle engine never looks hung), and ``last_progress_mono``
  the time the last step or command completed. Busy for longer than a
  step can take means hung; note that ``warmup`` is a command and may run
  for minutes.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from jaxserve.engine.types import EngineBroken, RequestClass, RequestOutput, SamplingParams
from jaxserve.worker.engine_host import EngineHost, EngineInfo, engine_info

OutputsCallback = Callable[[list[RequestOutput]], None]
FailureCallback = Callable[[BaseException], None]

_STOP = object()


def check_max_consecutive_step_failures(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"max_consecutive_step_failures must be an integer >= 1, got {value!r}")


class EngineThreadDead(RuntimeError):
    """The engine thread has exited: a command sent to it will never run.
    ``__cause__`` is what ended it (``None`` after :meth:`EngineThread.stop`)."""


class EngineThread:
    """Runs an engine on a thread of its own (see the module docstring).

    ``on_fatal(exc)``: called on the loop once, when the thread dies for any
    reason other than :meth:`stop`; ``exc`` is the ``EngineBroken`` that
    ``step()`` raised, an ``EngineBroken`` naming the last of
    ``max_consecutive_step_failures`` failed steps (its ``__cause__``), or
    the exception that escaped the thread's loop. The engine must then be
    considered lost (restart the process).
    """

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        on_outputs: OutputsCallback,
        on_step_error: FailureCallback | None = None,
        *,
        on_step: Callable[[Any, list[RequestOutput]], None] | None = None,
        on_fatal: FailureCallback | None = None,
        max_consecutive_step_failures: int = 5,
        name: str = "jaxserve-engine",
    ) -> None:
        check_max_consecutive_step_failures(max_consecutive_step_failures)
        self.engine = engine
        self._factory: Callable[[], Any] | None = None  # set by from_factory; open() calls it
        self._info: EngineInfo | None = None
        # Runs on the engine thread after every step (metrics); must be cheap.
        self.on_step = on_step
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_step_error = on_step_error
        self.on_fatal = on_fatal
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()  # (fn, future, is_admission) or _STOP
        # Commands the before_plan hook took off the queue but left for the
        # loop (a non-admission, to keep the order); the loop runs them first.
        self._deferred: list[Any] = []
        # Interactive outputs the engine hands over before it plans the next
        # step go to the loop at once; on_step still sees them with the rest.
        self._urgent: list[RequestOutput] = []
        if engine is not None:
            self._attach(engine)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        # Guards the hand-over between _call queueing a command and the dying
        # thread draining the queue: a command is either queued before the
        # drain (and failed by it) or sees _dead set (and fails at once).
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
        """Take ``engine``: install the hooks it has room for."""
        self.engine = engine
        self._info = engine_info(engine)
        if hasattr(engine, "before_plan"):
            engine.before_plan = self._admit_arrivals
        if hasattr(engine, "on_urgent_outputs"):
            engine.on_urgent_outputs = self._post_urgent

    # ---- asyncio side -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    async def open(self) -> EngineInfo:
        """:class:`~jaxserve.worker.engine_host.EngineHost`'s start: build
        the engine (hosts made by :meth:`from_factory`), start the thread
        unless :meth:`start` did, and return :attr:`info`."""
        if self.engine is None:
            factory = cast("Callable[[], Any]", self._factory)  # from_factory set it: engine is None
            self._attach(await asyncio.to_thread(factory))
        with self._lock:  # stop() sets _stop_requested before it looks, under this lock, for a thread
            if self._stop_requested:
                raise EngineThreadDead("the engine thread was stopped before it started")
            if self._thread.ident is None:
                self._thread.start()
        return self.info

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
    def num_computed_tokens(self) -> int | None:
        computed = getattr(self.engine, "num_computed_tokens", None)
        return computed if isinstance(computed, int) else None

    def _call(self, fn: Callable[[], Any], admission: bool = False) -> asyncio.Future:
        fut = self.loop.create_future()
        with self._lock:
            dead = self._dead
            if dead is None:
                self._cmds.put((fn, fut, admission))
        if dead is not None:
            fut.set_exception(self._dead_error())
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
        """Future: None once admitted, or a :class:`RequestError`
        (:class:`EngineThreadDead` if the thread is gone)."""
        return self._call(
            lambda: self.engine.add_request(
                request_id, prompt, params, request_class=request_class, priority=priority, deadline=deadline
            ),
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
            lambda: self.engine.add_score_request(
                request_id, prompt, labels, request_class=request_class, priority=priority, deadline=deadline
            ),
            admission=True,
        )

    def abort(self, request_id: str) -> asyncio.Future:
        return self._call(lambda: self.engine.abort(request_id))

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the command or step in progress; commands still queued
        then fail with :class:`EngineThreadDead`. ``on_fatal`` is not called."""
        self._stop_requested = True
        with self._lock:
            started = self._thread.ident is not None
        if not started:  # stopped before open() started it: nothing else will fail the queued commands
            self._exit(None)
            return
        self._cmds.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- engine thread -----------------------------------------------
    def _dead_error(self) -> EngineThreadDead:
        message, cause = cast("tuple[str, BaseException | None]", self._dead)  # set before it is called
        err = EngineThreadDead(message)
        err.__cause__ = cause
        return err

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

    def _run_cmd(self, item: Any, within_step: bool = False) -> bool:
        if item is _STOP:
            return False
        fn, fut, _admission = item
        if not within_step:
            self.busy_since_mono = time.monotonic()
        result = error = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - forwarded to the awaiting coroutine
            error = exc
        # Not busy any more before the caller can see the outcome (within a
        # step, the step still is).
        self.last_progress_mono = time.monotonic()
        if not within_step:
            self.busy_since_mono = None
        self._resolve(fut, result, error)
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
            self.loop.call_soon_threadsafe(self.on_outputs, list(outputs))
        except RuntimeError:  # loop closed: the thread ends after this step
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
            if self.on_step is not None:
                try:
                    self.on_step(engine, urgent + outputs if urgent else outputs)
                except Exception:  # noqa: BLE001 - metrics must never stop serving
                    pass
            if outputs:
                try:
                    self.loop.call_soon_threadsafe(self.on_outputs, list(outputs))
                except RuntimeError:
                    return

    def _step_failed(self, exc: Exception) -> bool:
        """Report a failed step; returns whether the thread may go on."""
        if self.on_step_error is not None:
            try:
                self.loop.call_soon_threadsafe(self.on_step_error, exc)
            except RuntimeError:  # loop closed
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
            if cause is None:  # it returned because the event loop is closed
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
                self._resolve(item[1], exc=self._dead_error())
        # not stopped: the branch above set fatal_error
        fatal = self.fatal_error
        if not stopped and self.on_fatal is not None and fatal is not None:
            try:
                self.loop.call_soon_threadsafe(self.on_fatal, fatal)
            except RuntimeError:  # loop closed
                pass
        self._stopped.set()


def _conforms(host: EngineThread) -> EngineHost:
    """mypy holds EngineThread to the EngineHost protocol here."""
    return host
