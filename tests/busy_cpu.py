"""Other processes keeping the CPU busy while a test runs.

The operator's findings on tenant limits and store outages came from a
loaded machine (a compiler build, busy loops beside the worker); the tests
that pin their fixes run beside busy loops of their own, so a timing that
only holds on an idle machine fails here.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def busy_cpu(processes: int = 2) -> Iterator[list[subprocess.Popen]]:
    """``processes`` Python busy loops, killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)
