"""A worker whose Redis store goes away: it says so, takes no jobs, gives the
ones it holds back to the broker within ``--store-hold``, stops at once on
SIGTERM, and carries on by itself when Redis returns.

The finding this pins: with ``--store redis`` and Redis unreachable,
``/readyz`` said 200 "consuming", every job waited for ever after one
warning (``jaxserve submit --timeout 15`` gave up), and SIGTERM waited out
the whole drain. The worker runs as a real ``jaxserve worker`` process
against the real RabbitMQ and a private redis-server that the test stops
and starts, beside two busy loops.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import signal
import time
import urllib.error
import urllib.request

import orjson
import pytest

from busy_cpu import busy_cpu
from queue_support import free_port, start_worker_process
from test_queue_faults import queue_depth

pytestmark = pytest.mark.timeout(300)

HOLD_S = 2.0
DRAIN_S = 60.0  # what the drain would wait for a held job before


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, repr(exc)


def store_up(port: int) -> float | None:
    _, text = probe(port, "/metrics")
    m = re.search(r"^jaxserve_store_up\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return None if m is None else float(m.group(1))


async def until(pred, timeout: float, what: str) -> float:
    """Poll ``pred`` (run in a thread: it may block on HTTP; a coroutine
    it returns is awaited here) until true; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = await asyncio.to_thread(pred)
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


async def _depth_is(queue: str, n: int) -> bool:
    return await queue_depth(queue) == n


def _epoch(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"]).timestamp()


def events(log_path, name: str, key: str | None = None) -> list[dict]:
    out = []
    for line in log_path.read_bytes().splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("event") == name and (key is None or rec.get("key") == key):
            out.append(rec)
    return out


async def test_redis_down_the_worker_is_not_ready_gives_jobs_back_and_stops_at_once(
    prefix, client, tmp_path, private_redis
):
    port = free_port()
    log = tmp_path / "worker.log"
    interactive = f"{prefix}.interactive"
    with busy_cpu(2):
        w = start_worker_process(
            prefix,
            log,
            "--store",
            "redis",
            "--redis-url",
            private_redis.url,
            "--metrics-port",
            str(port),
            "--store-hold",
            str(HOLD_S),
            "--drain-timeout",
            str(DRAIN_S),
            "--target-ttft",
            "300",
        )
        try:
            await until(lambda: probe(port, "/readyz") == (200, "consuming\n"), 120, "ready before the outage")
            assert store_up(port) == 1.0
            before = await client.submit("before the outage", max_tokens=2, timeout=60)
            assert before.ok
            # its last store write (mark_delivered) comes after the reply: once
            # it is done, the next job is the first to find Redis gone
            await until(lambda: bool(events(log, "job_done", before.id)), 30, "the first job done")

            # Redis goes away; a job arrives and finds it gone
            private_redis.kill()
            key = await client.publish({"prompt": "during the outage", "max_tokens": 2})
            t_published = time.monotonic()
            await until(lambda: probe(port, "/readyz")[0] == 503, 30, "not ready while the store is down")
            status, reason = probe(port, "/readyz")
            assert status == 503 and reason.startswith("store unavailable") and "redis" in reason, reason
            assert store_up(port) == 0.0
            assert probe(port, "/healthz")[0] == 200  # alive: a restart would not bring Redis back
            # the held job goes back to the broker within the bound and stays
            # there: the worker takes no jobs while the store is down
            await until(lambda: _depth_is(interactive, 1), HOLD_S + 15, "the held job back in the broker")
            assert time.monotonic() - t_published < HOLD_S + 15
            [requeued] = events(log, "job_requeued", key)
            assert requeued["reason"].startswith("store unavailable")
            await asyncio.sleep(1.0)
            assert await queue_depth(interactive) == 1 and not events(log, "job_done", key)

            # Redis returns: ready again, the gauge 1, the job answered once
            private_redis.start()
            await until(lambda: probe(port, "/readyz") == (200, "consuming\n"), 60, "ready once the store answers")
            assert store_up(port) == 1.0
            result = await client.wait(key, timeout=60)
            assert result.ok and not result.replayed
            await until(lambda: bool(events(log, "job_done", key)), 30, "the job done")
            await asyncio.sleep(1.0)
            assert len(events(log, "job_done", key)) == 1  # answered once

            # SIGTERM during an outage: a job held in admission goes back at
            # once instead of holding the drain for --drain-timeout
            private_redis.kill()
            held = await client.publish({"prompt": "held at shutdown", "max_tokens": 2})
            await until(lambda: bool(events(log, "store_unavailable_waiting", held)), 30, "the job held")
            t0, t_sigterm = time.monotonic(), time.time()
            w.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(w.wait, DRAIN_S + 30) == 0
            took = time.monotonic() - t0
        finally:
            if w.poll() is None:
                w.kill()
                w.wait(10)
    # The worker is done within seconds of the signal; the process's own exit
    # (the interpreter's teardown beside two busy loops) takes some more.
    [stopped] = events(log, "worker_stopped")
    assert stopped["requeued"] == 1 and _epoch(stopped) - t_sigterm < 8.0, _epoch(stopped) - t_sigterm
    assert took < DRAIN_S / 2, took
    assert await queue_depth(interactive) == 1  # the held job is in the broker
