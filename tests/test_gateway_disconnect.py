"""A client that goes away mid-stream cancels its job: the worker's engine
drops the sequence from its running set within a second, and a client
that goes away while its plain request waits cancels that job too. The
worker runs in this process (``queue_support.EchoEngine``, so the test
reads the engine's running set directly); the gateway is a subprocess."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import pytest

from gateway_support import GatewayProcess
from jaxserve.worker.lifecycle import job_key_of
from queue_support import EchoEngine, wait_until

pytestmark = pytest.mark.timeout(120)


def _open_stream(port: int, body: dict) -> http.client.HTTPConnection:
    """POST a streamed request and read up to its first event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    line = resp.fp.readline()
    while not line.startswith(b"data: "):
        line = resp.fp.readline()
    return conn


async def test_disconnects_cancel_their_jobs_and_free_the_sequence(harness, prefix, tmp_path):
    engine = EchoEngine(max_num_seqs=4, step_s=0.05)  # a 400-token answer takes 20 s
    await harness.start(engine)
    gateway = GatewayProcess(prefix, tmp_path / "state", tmp_path / "gateway.log")
    await asyncio.to_thread(gateway.start)
    try:
        body = {
            "model": "echo",
            "messages": [{"role": "user", "content": "a long answer please"}],
            "max_tokens": 400,
            "stream": True,
        }
        conn = await asyncio.to_thread(_open_stream, gateway.port, body)
        await wait_until(lambda: len(engine.running) == 1, timeout=5)
        (running_id,) = engine.running
        conn.sock.shutdown(2)  # the client goes away mid-stream
        conn.close()
        gone = time.monotonic()
        await wait_until(lambda: not engine.running, timeout=5)
        freed_after = time.monotonic() - gone
        assert freed_after < 1.0, f"the sequence ran on for {freed_after:.2f}s after the client left"
        key = job_key_of(running_id)
        assert key.startswith("gw-") and engine.aborted == [key]  # the gateway's job, aborted by its cancel

        # a plain (not streamed) request whose client leaves while it waits
        plain = {k: v for k, v in body.items() if k != "stream"}

        def leave_early() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
            conn.request("POST", "/v1/chat/completions", json.dumps(plain), {"Content-Type": "application/json"})
            time.sleep(0.5)
            conn.sock.shutdown(2)
            conn.close()

        await asyncio.to_thread(leave_early)
        await wait_until(lambda: len(engine.aborted) == 2 and not engine.running, timeout=5)
        events = [e.get("event") for e in gateway.log_events()]
        assert events.count("gateway_job_cancelled") == 2
    finally:
        await asyncio.to_thread(gateway.stop)
    metrics = [
        line
        for line in (tmp_path / "gateway.log").read_text().splitlines()
        if '"gateway_stream_end"' in line and '"status": 499' in line
    ]
    assert len(metrics) == 1
