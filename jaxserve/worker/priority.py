"""CPU priority for the worker's threads: the event loop ahead of compute.

On a worker whose cores are busy (the engine's Python thread, XLA's compute
threads, and often the broker on the same host), a thread that wakes up waits
for a core. The event loop wakes for every broker frame and every engine
output, and each of its hops then waits; an interactive job crosses about ten
of them between the broker and its first streamed token. So the worker runs
every thread of its process except the loop's at a lower priority (a higher
``nice`` value, Linux) when asked (``--compute-nice N``): the loop, which
only does I/O and bookkeeping, gets a core as soon as it wakes, while compute
keeps whatever it leaves. It is a trade, so it is off by default: on this
project's 2-core machines, with the broker on the same cores, nice 5 lowered
the interactive time to first token under a saturated batch queue in five of
eight A/B pairs (mean loaded median 17.2 -> 14.7 ms) and cost ~9% of the
jobs/s of a generating classification run, whose broker and client then win
the cores from the engine (commit ad73e71).

Threads started later inherit the value from the thread that starts them
(the engine thread, XLA's pools), so one call after the engine is built and
compiled covers them. With the engine in a process of its own (``jaxserve
worker``'s default), every thread of that process is niced instead and the
worker's own threads keep their priority. Lowering one's own priority needs no privilege; where
the platform has no per-thread priority (not Linux), nothing changes.
"""

from __future__ import annotations

import os
import threading

_TASKS = "/proc/self/task"


def deprioritize_other_threads(nice: int) -> int:
    """Set ``nice`` on every thread of this process except the calling one
    (the event loop's); returns how many threads were changed (0 where the
    platform cannot, or for ``nice`` 0)."""
    return _renice(_TASKS, nice, skip=threading.get_native_id())


def deprioritize_process(pid: int, nice: int) -> int:
    """Set ``nice`` on every thread of process ``pid`` (the worker's engine
    process: everything in it is compute); returns how many were changed."""
    return _renice(f"/proc/{pid}/task", nice, skip=None)


def _renice(tasks: str, nice: int, skip: int | None) -> int:
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise ValueError(f"nice must be an integer from 0 to 19, got {nice!r}")
    if nice == 0 or not os.path.isdir(tasks) or not hasattr(os, "setpriority"):
        return 0
    changed = 0
    for name in os.listdir(tasks):
        tid = int(name)
        if tid == skip:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (ProcessLookupError, PermissionError):  # gone meanwhile; or a policy forbids it
            continue
        changed += 1
    return changed
