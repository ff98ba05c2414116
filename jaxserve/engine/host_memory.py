"""Hand the host heap that loading and compiling freed back to the OS.

glibc keeps freed memory in its arenas for reuse; after the weights are
converted and every program compiled, about 100 MB of it sits free in the
engine process and still counts as resident: a serving SmolLM2-135M int8
engine went from 1,162 to 1,059 MiB of anonymous memory when made to call
``malloc_trim(0)``, which returns the free pages of every arena (the memory
scenario in BENCHMARKS.md). Elsewhere (musl, macOS) there is nothing to
call and nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_free_heap() -> bool:
    """Return freed heap pages to the OS; whether there was a way to."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
