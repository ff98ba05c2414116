"""Fixtures shared by the test modules; pytest finds them here.

The queue tests' plain helpers (the echo engine, the worker harness, process
control, a private Redis) live in ``queue_support.py`` and are imported by
name; only the fixtures built from them are here.
"""

from __future__ import annotations

import gc
import shutil
import sys

import pytest
import pytest_asyncio

from queue_support import AMQP_URL, PrivateRedis, WorkerHarness, delete_prefix, unique_prefix

#: mappings past which a test's end drops JAX's compiled programs: a quarter
#: of the kernel's usual ``vm.max_map_count`` (65,530)
MAPPINGS_BEFORE_CLEARING = 16_384


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: nothing to count, nothing to clear
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """After a test that leaves this process holding many memory mappings,
    drop JAX's caches of compiled programs.

    Every XLA:CPU executable holds a few mappings (about 6 for a small
    program, measured with ``/proc/self/maps``), and the jit caches keep them
    alive after their engine is gone. One pytest process compiles thousands
    of programs over the suite (``test_family_gguf`` alone passes 25,000
    mappings), and reaching ``vm.max_map_count`` makes the next compile or
    cache read die with SIGSEGV: the suite crashed that way at about 40 %
    (in ``test_kv_int8``, in ``test_last_layer_pruning``).
    ``jax.clear_caches()`` gives the mappings back; done only past
    :data:`MAPPINGS_BEFORE_CLEARING`, so module fixtures' programs are
    rarely compiled twice."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None and _memory_mappings() > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


@pytest_asyncio.fixture
async def prefix():
    """A fresh queue-name prefix; its queues and exchanges are deleted after."""
    p = unique_prefix()
    yield p
    await delete_prefix(p)


@pytest_asyncio.fixture
async def harness(prefix):
    """Starts in-process workers on ``prefix``; shuts them down after."""
    h = WorkerHarness(prefix)
    yield h
    await h.close()


@pytest_asyncio.fixture
async def client(prefix):
    """A connected ``AsyncClient`` on ``prefix``; its reply queue is deleted after."""
    from jaxserve.client import AsyncClient

    c = AsyncClient(AMQP_URL, prefix=prefix, name=f"test-client-{prefix}")
    await c.connect()
    yield c
    try:
        await c.delete_reply_queue()
    except Exception:  # noqa: BLE001 - clean-up after the test, whatever the broker says
        pass
    await c.close()


@pytest.fixture
def private_redis():
    """A redis-server of the test's own, which the test may kill and restart."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = PrivateRedis()
    r.start()
    yield r
    r.kill()
