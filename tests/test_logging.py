"""``--log-format json``: every line the process logs is one JSON object,
whichever logger wrote it (structlog, aio_pika, aiormq, asyncio, jax,
warnings), from whichever thread, and each carries the worker_id and model
bound with ``bind_worker_context``.

Logs go to stderr (stdout is the commands' output, e.g. ``generate --json``);
the subprocess tests capture both streams and check stdout stays empty.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import structlog

from jaxserve.worker import logs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_logging():
    """configure_logging rewires the root logger and structlog for the whole
    process: put pytest's handlers and structlog's settings back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    config = structlog.get_config()
    yield
    logs.clear_worker_context()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.configure(**config)


def parse_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "nothing was logged"
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\nall output:\n{text}") from None
    return out


def test_stdlib_and_structlog_lines_are_json_with_the_bound_context(restore_logging):
    import threading
    import warnings

    stream = io.StringIO()
    logs.configure_logging("json", "info", stream=stream)
    logs.bind_worker_context(worker_id="host-1-abc", model="tiny")

    structlog.get_logger("jaxserve.worker").info("job_done", key="k1", tokens=3)
    logging.getLogger("aio_pika.robust_connection").warning("reconnecting to %s in %ss", "amqp://x", 5)
    logging.getLogger("asyncio").error("Task exception was never retrieved", extra={"task": "t-1"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("aiormq.connection").exception("error when creating transport")
        structlog.get_logger("jaxserve.worker").error("worker_task_failed", exc_info=True)
    # another thread (engine thread, metrics server): context variables do
    # not cross threads, the bound context must anyway
    t = threading.Thread(target=lambda: logging.getLogger("jax._src.xla_bridge").warning("from a thread"))
    t.start()
    t.join()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    # below the level: nothing
    structlog.get_logger("jaxserve.worker").debug("too_chatty")
    logging.getLogger("aiormq.connection").info("libraries log warnings and up at --log-level info")

    records = parse_lines(stream.getvalue())
    events = [r["event"] for r in records]
    assert events == [
        "job_done",
        "reconnecting to amqp://x in 5s",
        "Task exception was never retrieved",
        "error when creating transport",
        "worker_task_failed",
        "from a thread",
        records[6]["event"],
    ]
    assert "DeprecationWarning: deprecated thing" in records[6]["event"]
    for r in records:
        assert r["worker_id"] == "host-1-abc" and r["model"] == "tiny", r
        assert r["level"] in ("info", "warning", "error")
        assert r["timestamp"].endswith("Z")
    assert records[0]["key"] == "k1" and records[0]["tokens"] == 3
    assert records[1]["logger"] == "aio_pika.robust_connection" and records[1]["level"] == "warning"
    assert records[2]["task"] == "t-1"  # stdlib extra= fields are kept
    for r in (records[3], records[4]):  # tracebacks stay inside the object
        assert r["exception"].startswith("Traceback") and "RuntimeError: boom" in r["exception"]
    assert records[5]["logger"] == "jax._src.xla_bridge"
    assert records[6]["logger"] == "py.warnings"


def test_context_bound_later_and_explicit_fields_win(restore_logging):
    stream = io.StringIO()
    logs.configure_logging("json", "info", stream=stream)
    logs.bind_worker_context(worker_id="w-2")
    structlog.get_logger().info("engine_building")
    logs.bind_worker_context(model="llama")  # once the engine knows its name
    structlog.get_logger().info("engine_ready")
    structlog.get_logger().info("other", model="explicit")
    a, b, c = parse_lines(stream.getvalue())
    assert a["worker_id"] == "w-2" and "model" not in a
    assert (b["worker_id"], b["model"]) == ("w-2", "llama")
    assert c["model"] == "explicit"


def test_console_format_carries_the_context_too(restore_logging):
    stream = io.StringIO()
    logs.configure_logging("console", "info", stream=stream)
    logs.bind_worker_context(worker_id="w-3", model="tiny")
    logging.getLogger("aiormq").warning("lost")
    structlog.get_logger().info("hello")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "lost" in lines[0] and "[aiormq]" in lines[0]
    for line in lines:
        assert "worker_id=w-3" in line and "model=tiny" in line
        assert not line.startswith("{")


def test_a_real_process_logs_only_json(tmp_path):
    """A fresh interpreter, as the worker runs: libraries imported after
    configure_logging (jax, aio_pika), a real failed AMQP connect (aiormq
    logs it with a traceback), asyncio's own error log, a jax warning;
    stderr holds only JSON lines with the bound fields and stdout nothing."""
    script = textwrap.dedent(
        """
        import asyncio, logging, socket
        from jaxserve.worker.logs import bind_worker_context, configure_logging
        configure_logging("json", "info")
        configure_logging("json", "info")  # a second call replaces, never doubles, the handler
        bind_worker_context(worker_id="proc-w", model="tiny")
        import structlog
        import jax, jax.numpy as jnp
        import aio_pika
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        async def main():
            try:
                await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{port}/")
            except Exception:
                structlog.get_logger("jaxserve.worker").warning("amqp_connect_failed", port=port)
            loop = asyncio.get_running_loop()
            loop.call_exception_handler({"message": "asyncio says so"})
        asyncio.run(main())
        jnp.ones(2).block_until_ready()
        logging.getLogger("jax").warning("jax warns")
        structlog.get_logger("jaxserve.worker").info("done")
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    records = parse_lines(proc.stderr)
    for r in records:
        assert r["worker_id"] == "proc-w" and r["model"] == "tiny", r
    events = [r["event"] for r in records]
    assert "error when creating transport" in " ".join(events)  # aiormq's record, as JSON
    assert "amqp_connect_failed" in events and "asyncio says so" in events
    assert events.count("jax warns") == 1 and events.count("done") == 1


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_forced_broker_disconnect_is_one_warning_per_connection(tmp_path, fmt):
    """The broker closes each of a worker's connections (CONNECTION_FORCED,
    as ``rabbitmqctl close_connection`` does; only this worker's, so tests
    beside it keep theirs). Each lost connection is one
    ``amqp_connection_lost`` warning with the broker's reason, then an info
    line once it is back; nothing from aiormq or aio-pika, no traceback."""
    import asyncio
    import re
    import time

    from jaxserve.client import Client
    from queue_support import (
        AMQP_URL,
        delete_prefix,
        rabbitmqctl,
        start_worker_process,
        stop_process,
        unique_prefix,
        wait_log,
    )

    prefix, log = unique_prefix(), tmp_path / "worker.log"
    proc = start_worker_process(prefix, log, "--store", "memory", "--engine-thread", "--log-format", fmt)
    try:
        wait_log(log, "worker_consuming", timeout=90)
        worker_id = re.search(r"worker_id[\"=:\s]+\"?([\w.-]+)", log.read_text()).group(1)
        before = len(log.read_text().splitlines())
        listed = rabbitmqctl("list_connections", "pid", "client_properties")
        pids = [line.split("\t")[0] for line in listed.splitlines() if worker_id in line]
        assert len(pids) == 5, listed  # control, interactive, batch and two reply publishers
        for pid in pids:
            rabbitmqctl("close_connection", pid, "test: forced close")
        end = time.monotonic() + 60
        while log.read_text().count("amqp_reconnected") < len(pids) and time.monotonic() < end:
            time.sleep(0.25)
        with Client(AMQP_URL, prefix=prefix) as client:  # and it serves as before
            assert client.submit("after the cut", max_tokens=2, timeout=30).ok
    finally:
        stop_process(proc)
        asyncio.run(delete_prefix(prefix))
    added = log.read_text().splitlines()[before:]
    text = "\n".join(added)
    assert "Traceback" not in text and "aiormq" not in text and "aio_pika" not in text, text
    lost = [line for line in added if "amqp_connection_lost" in line]
    assert len(lost) == len(pids) and all("CONNECTION_FORCED - test: forced close" in x for x in lost), text
    assert text.count("amqp_reconnected") == len(pids), text
    if fmt == "json":
        events = [json.loads(line) for line in added]
        loud = [e for e in events if e["level"] in ("warning", "error")]
        assert loud == [e for e in events if e["event"] == "amqp_connection_lost"], loud
