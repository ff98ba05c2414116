"""The worker's thread priorities: once the engine is compiled, the engine
process (or, with the engine on a thread, every thread but the event
loop's) is niced (jaxserve.worker.priority)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jaxserve.worker.priority import deprioritize_other_threads
from queue_support import start_worker_process, stop_process, wait_log

# Run in a child process: renicing is per thread and cannot be undone
# without privilege, and this test process has threads of other tests.
_CHILD = textwrap.dedent(
    """
    import json, os, threading
    from jaxserve.worker.priority import deprioritize_other_threads

    started, release = threading.Event(), threading.Event()
    tids = []

    def work():
        tids.append(threading.get_native_id())
        started.set()
        release.wait()

    before = threading.Thread(target=work)
    before.start()
    started.wait()
    changed = deprioritize_other_threads(7)
    started.clear()
    after = threading.Thread(target=work)  # started by the (unchanged) caller
    after.start()
    started.wait()
    me = threading.get_native_id()
    out = {"changed": changed, "caller": os.getpriority(os.PRIO_PROCESS, me),
           "before": os.getpriority(os.PRIO_PROCESS, tids[0]), "after": os.getpriority(os.PRIO_PROCESS, tids[1]),
           "again": deprioritize_other_threads(7)}
    release.set()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_every_thread_but_the_callers_is_niced():
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if got["caller"] > 7:
        pytest.skip(f"this process already runs at nice {got['caller']}")
    assert got["before"] == 7  # an absolute value, not an increment: twice is the same
    assert got["after"] == got["caller"]  # a thread the caller starts later keeps the caller's value
    assert got["changed"] >= 1 and got["again"] >= 2


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "5"])
def test_a_nice_value_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="nice must be an integer from 0 to 19"):
        deprioritize_other_threads(bad)


def test_zero_changes_nothing():
    assert deprioritize_other_threads(0) == 0


def _nice_by_thread(pid: int) -> dict[int, int]:
    import os

    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_a_worker_with_compute_nice_runs_its_engine_process_niced(prefix, tmp_path):
    """``jaxserve worker --compute-nice 3`` (the engine in its own process,
    the default): once compiled, every thread of the engine process runs at
    nice 3 and the worker's own threads are left alone."""
    import os

    log = tmp_path / "w.log"
    w = start_worker_process(prefix, log, "--compute-nice", "3")
    try:
        wait_log(log, "worker_consuming", timeout=60)
        assert '"event": "compute_threads_deprioritized"' in log.read_text()
        base = os.getpriority(os.PRIO_PROCESS, 0)
        [engine_pid] = [int(p) for p in open(f"/proc/{w.pid}/task/{w.pid}/children").read().split()]
        engine = _nice_by_thread(engine_pid)
        assert len(engine) >= 2 and set(engine.values()) == {max(3, base)}, engine
        assert set(_nice_by_thread(w.pid).values()) == {base}
    finally:
        stop_process(w)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_a_worker_with_compute_nice_and_an_engine_thread_runs_all_but_its_loop_niced(prefix, tmp_path):
    """``--compute-nice 3 --engine-thread``: once compiled, the engine's
    thread and every other thread but the event loop's (the main thread,
    whose id is the process id) run at nice 3."""
    import os

    log = tmp_path / "w.log"
    w = start_worker_process(prefix, log, "--compute-nice", "3", "--engine-thread")
    try:
        wait_log(log, "worker_consuming", timeout=60)
        assert '"event": "compute_threads_deprioritized"' in log.read_text()
        nice = _nice_by_thread(w.pid)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert nice.pop(w.pid) == base
        assert nice and set(nice.values()) == {max(3, base)}, nice
    finally:
        stop_process(w)
