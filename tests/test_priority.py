"""jaxserve.worker.priority's renicing of every thread but the caller's.
``jaxserve worker`` no longer offers it (``--compute-nice`` was measured
and dropped, issue 26); these tests go with the module."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jaxserve.worker.priority import deprioritize_other_threads

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
