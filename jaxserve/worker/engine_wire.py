"""What crosses between the worker's process and the engine process
(:mod:`jaxserve.worker.engine_process`, :mod:`jaxserve.worker.engine_child`):
messages, each a pickled tuple framed by its length on a socket pair;
exceptions, as themselves where they pickle; and the status array, float64
slots in a file both processes map, where the engine process writes the
watchdog's clocks and counters for the worker's to read without a message.
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

# Slots of the shared status array (float64; NaN: no value).
BUSY_SINCE, LAST_PROGRESS, STEPS, BUSY_S, COMPUTED = range(5)
SLOTS = 5


class UntransferableError(RuntimeError):
    """Stands for an exception of the engine process that does not pickle
    (an XLA error, say): its ``repr``."""


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an UntransferableError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - anything unpicklable is described instead
        return UntransferableError(repr(exc))


def shared_slot(slot: int, *, optional: bool = False, integer: bool = False) -> property:
    """A property kept in ``self._status[slot]``: how the engine process's
    engine loop writes its clocks and counters, and how EngineProcess reads them."""

    def get(self: Any) -> Any:
        value = self._status[slot]
        if math.isnan(value):
            return None
        return int(value) if integer else value

    def put(self: Any, value: Any) -> None:
        if value is None and not optional:
            raise ValueError(f"status slot {slot} needs a number")
        self._status[slot] = math.nan if value is None else float(value)

    return property(get, put)


_LENGTH = struct.Struct("!I")


def frame(message: tuple) -> bytes:
    """One message on the wire: its pickle's length, then the pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def unframe(buffer: bytearray) -> Iterator[tuple]:
    """Every whole message at the front of ``buffer``, consumed from it."""
    start = 0
    while len(buffer) - start >= _LENGTH.size:
        (size,) = _LENGTH.unpack_from(buffer, start)
        end = start + _LENGTH.size + size
        if len(buffer) < end:
            break
        with memoryview(buffer) as view:  # released before the buffer is trimmed
            message = pickle.loads(view[start + _LENGTH.size : end])
        start = end
        yield message
    del buffer[:start]


def map_status(fd: int) -> memoryview[float]:
    """The shared status array: float64 slots in a file both processes map."""
    return memoryview(mmap.mmap(fd, SLOTS * 8)).cast("d")


def new_status_file() -> tuple[Any, memoryview[float]]:
    """An unlinked temporary file sized for the status array (its descriptor
    is inherited by the engine process), mapped here, every slot NaN."""
    handle = tempfile.TemporaryFile()
    os.ftruncate(handle.fileno(), SLOTS * 8)
    status = map_status(handle.fileno())
    for slot in range(SLOTS):
        status[slot] = math.nan
    return handle, status
