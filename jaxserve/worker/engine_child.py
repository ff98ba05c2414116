"""The engine process's side (started by
:class:`~jaxserve.worker.engine_process.EngineProcess`, whose module
docstring tells the whole design): build the engine with the worker's
factory, then run the :class:`~jaxserve.worker.engine_loop.EngineLoop` on
it, commands read off the socket by this process's main thread, every event
of the loop written back as one message."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from jaxserve.engine.types import RequestOutput
from jaxserve.worker.engine_host import engine_info
from jaxserve.worker.engine_loop import EngineLoop
from jaxserve.worker.engine_wire import (
    BUSY_S,
    BUSY_SINCE,
    COMPUTED,
    LAST_PROGRESS,
    STEPS,
    frame,
    map_status,
    portable,
    shared_slot,
    unframe,
)
from jaxserve.worker.logs import apply_logging_setup

# The engine process's GIL switch interval: its main thread takes a
# command off the pipe within this even while the engine thread runs Python.
_CHILD_SWITCH_INTERVAL_S = 0.001


class _SharedStatusLoop(EngineLoop):
    """An EngineLoop whose watchdog clocks and counters live in the shared
    status array (the worker's process reads them there)."""

    busy_since_mono = shared_slot(BUSY_SINCE, optional=True)
    last_progress_mono = shared_slot(LAST_PROGRESS)
    steps = shared_slot(STEPS, integer=True)
    busy_s = shared_slot(BUSY_S)

    def __init__(self, status: Any, *args: Any, **kwargs: Any) -> None:
        self._status = status
        super().__init__(*args, **kwargs)


class _Pipe:
    """The engine process's end of the socket (blocking): sends from any
    thread, one message at a time, and receives on the main thread. A
    send to a worker that is gone raises RuntimeError, which the loop reads
    as "the receiver is gone" and ends on."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._inbox = bytearray()
        self._ready: list[tuple] = []

    def send(self, message: tuple) -> None:
        data = frame(message)  # a message that does not pickle fails here, the stream intact
        try:
            with self._lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise RuntimeError("the worker process is gone") from exc

    def recv(self) -> tuple:
        """The next message; EOFError once the worker's end is closed."""
        while not self._ready:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("the worker process closed its end")
            self._inbox += chunk
            self._ready.extend(unframe(self._inbox))
        return self._ready.pop(0)


class _PipeEvents:
    """The engine loop's events, each sent to the worker's process as one message
    at once (from the engine thread). A command's token is its id."""

    def __init__(self, pipe: _Pipe, status: Any) -> None:
        self.pipe = pipe
        self.status = status
        self.engine: Any = None

    def reply(self, token: Any, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.pipe.send(("reply", token, False, portable(error)))
            return
        try:
            self.pipe.send(("reply", token, True, result))
        except RuntimeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle fails its command only
            self.pipe.send(("reply", token, False, RuntimeError(f"the result could not be sent: {exc!r}")))

    def urgent_outputs(self, outputs: list[RequestOutput]) -> None:
        self.pipe.send(("outputs", outputs, None, False))

    def step_done(self, outputs: list[RequestOutput], urgent: list[RequestOutput], stats: Any) -> None:
        computed = getattr(self.engine, "num_computed_tokens", None)
        if isinstance(computed, int):
            self.status[COMPUTED] = float(computed)
        if outputs or urgent:  # a step without any waits for the next one's snapshot
            self.pipe.send(("outputs", outputs, stats, True))

    def step_error(self, exc: BaseException) -> None:
        self.pipe.send(("step_error", portable(exc)))

    def fatal(self, exc: BaseException) -> None:
        self.pipe.send(("fatal", portable(exc)))


# The engine's method each command runs, and whether it is an admission
# (joins the next plan: jaxserve.worker.engine_loop).
_COMMANDS = {
    "add": ("add_request", True),
    "score": ("add_score_request", True),
    "abort": ("abort", False),
    "warmup": ("warmup", False),
}


def engine_process_main(conn_fd: int, status_fd: int) -> None:
    """The engine process (started by :class:`EngineProcess`): take the
    worker's ``sys.path`` and the factory, build, report, then serve
    commands until told to stop or until the worker's process is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.setswitchinterval(_CHILD_SWITCH_INTERVAL_S)
    status = map_status(status_fd)
    os.close(status_fd)  # the mapping stays
    pipe = _Pipe(socket.socket(fileno=conn_fd))
    try:
        path, factory_bytes, max_failures, name, log_setup = pipe.recv()
        if log_setup is not None:  # the worker's format on the same stderr, its lines marked
            apply_logging_setup(log_setup, process="engine")
        sys.path[:] = path
        factory = pickle.loads(factory_bytes)
        engine = factory()
    except BaseException as exc:  # noqa: BLE001 - reported to the worker, which fails its start
        pipe.send(("build_failed", portable(exc), traceback.format_exc()))
        return
    pipe.send(("built", engine_info(engine)))

    sink = _PipeEvents(pipe, status)
    sink.engine = engine
    engine_loop = _SharedStatusLoop(
        status, engine, sink, with_stats=True, max_consecutive_step_failures=max_failures, name=name
    )
    engine_loop.start()
    while True:
        try:
            message = pipe.recv()
        except (EOFError, OSError):  # the worker's process is gone
            engine_loop.stop()
            return
        kind = message[0]
        if kind == "stop":
            engine_loop.stop(message[1])
            return
        command_id, args, kwargs = message[1], message[2], message[3]
        method, admission = _COMMANDS[kind]
        dead = engine_loop.submit(functools.partial(getattr(engine, method), *args, **kwargs), command_id, admission)
        if dead is not None:
            sink.reply(command_id, None, dead)
