"""Tracing across the queue: a producer's W3C ``traceparent`` (AMQP header,
set by ``jaxserve.client`` from the active OpenTelemetry span or the
TRACEPARENT variable) is continued by a real worker on the real broker,
whose spans (broker wait, admission, prefill, decode, publish) land under
the producer's span in an in-memory exporter; the result carries the trace
id. Without tracing configured nothing of OpenTelemetry is imported."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from jaxserve.wire import tracecontext
from jaxserve.wire.tracecontext import parse_traceparent
from jaxserve.worker import tracing as tracing_mod
from jaxserve.worker.tracing import Tracing
from queue_support import AMQP_URL, REPO, EchoEngine, wait_until

pytestmark = pytest.mark.timeout(120)

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class MeteredEcho(EchoEngine):
    """EchoEngine that keeps the real engine's per-request timestamps
    (``RequestOutput.metrics``: arrival, first_scheduled, first_token,
    finished), which bound the worker's prefill and decode spans."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.stamps: dict[str, dict[str, float]] = {}

    def add_request(self, request_id, prompt, params, **kw) -> None:
        self.stamps[request_id] = {"arrival": time.monotonic()}
        super().add_request(request_id, prompt, params, **kw)

    def step(self):
        waiting = {r.id for r in self.waiting}
        outs = super().step()
        now = time.monotonic()
        for rid in waiting - {r.id for r in self.waiting}:
            self.stamps[rid].setdefault("first_scheduled", now - 1e-4)
        for out in outs:
            m = self.stamps.get(out.request_id)
            if m is None:
                continue
            if out.new_token_ids:
                m.setdefault("first_token", now)
            if out.finished:
                m["finished"] = now
            out.metrics = dict(m)
        return outs


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def _worker(prefix_: str, tracing: Tracing):
    from jaxserve.wire.topology import Topology
    from jaxserve.worker.worker import Worker, WorkerConfig

    engine = MeteredEcho(step_s=0.003)
    w = Worker(lambda: engine, WorkerConfig(amqp_url=AMQP_URL, topology=Topology(prefix=prefix_)), tracing=tracing)
    await w.start()
    return w


def _job_spans(exporter: InMemorySpanExporter, trace_id: int) -> list:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id and s.name != "produce"]


# ------------------------------------------------------------------ headers
def test_traceparent_parsing_follows_w3c():
    tp = parse_traceparent(TP, "vendor=abc")
    assert tp is not None and tp.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and tp.span_id == "00f067aa0ba902b7"
    assert tp.sampled and tp.tracestate == "vendor=abc" and tp.header() == TP
    assert parse_traceparent(TP.encode()) == parse_traceparent(TP)  # AMQP may hand bytes
    assert parse_traceparent("01" + TP[2:] + "-future") is not None  # a later version: its first four fields
    bad = [
        None,
        "",
        "garbage",
        TP.upper(),
        TP + "-x",  # version 00 has exactly four fields
        "ff" + TP[2:],
        "00-" + "0" * 32 + TP[35:],
        TP[:36] + "0" * 16 + TP[52:],  # version ff, zero ids
        TP.replace("-", "_"),
        TP[:-1] + "g",
        55,
    ]
    for value in bad:
        assert parse_traceparent(value) is None, value
    assert parse_traceparent(TP, "x" * 600).tracestate is None  # oversized tracestate dropped, parent kept
    assert tracecontext.from_headers({"traceparent": "nope"}) is None
    assert tracecontext.from_headers(None) is None


def test_configuration_rules():
    wanted = tracing_mod.wanted
    assert not wanted(None, {})
    assert wanted("http://collector:4318", {})
    assert wanted(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert wanted(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert wanted(None, {"OTEL_TRACES_EXPORTER": "console"})
    assert not wanted(None, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert not wanted("http://c:4318", {"OTEL_SDK_DISABLED": "true"})
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER names zipkin"):
        tracing_mod.build_provider(None, {"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        tracing_mod.build_provider("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    provider = tracing_mod.build_provider("http://127.0.0.1:9", {})
    try:
        assert provider.resource.attributes["service.name"] == "jaxserve-worker"
    finally:
        provider.shutdown()


def test_off_imports_no_opentelemetry():
    """The worker, the client and an unconfigured Tracing load no
    OpenTelemetry module; a job's traceparent is still read."""
    code = (
        "import sys\n"
        "import jaxserve.worker.worker, jaxserve.client.client\n"
        "from jaxserve.worker.tracing import Tracing\n"
        "t = Tracing.configure(None, {})\n"
        f"j = t.start_job({{'traceparent': {TP!r}}}, queue='q', queue_class='batch', message_id='k', correlation_id=None,"
        " body_size=1, redelivered=False, received_mono=0.0, broker_wait_s=None)\n"
        "assert not t.enabled and j.trace_id == '4bf92f3577b34da6a3ce929d0e0e4736'\n"
        "assert t.start_job({}, queue='q', queue_class='batch', message_id='k', correlation_id=None, body_size=1,"
        " redelivered=False, received_mono=0.0, broker_wait_s=None) is None\n"
        "assert jaxserve.client.client.tracecontext.active() is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ------------------------------------------------------------ through a worker
async def test_span_tree_of_one_job_continues_the_producers_trace(prefix, client):
    provider, exporter = _provider()
    w = await _worker(prefix, Tracing(provider))
    try:
        producer = provider.get_tracer("test-producer")
        with producer.start_as_current_span("produce", kind=SpanKind.PRODUCER) as span:
            key = await client.publish({"prompt": "hello world, once more", "max_tokens": 4}, queue="batch")
        parent = span.get_span_context()
        result = await client.wait(key, timeout=30)
        assert result.ok
        assert result.trace_id == f"{parent.trace_id:032x}"
        await wait_until(lambda: any(s.name.startswith("process ") for s in exporter.get_finished_spans()), timeout=5)
    finally:
        await w.shutdown(drain_timeout=0.5)

    spans = _job_spans(exporter, parent.trace_id)
    (root,) = [s for s in spans if s.name == f"process {prefix}.batch"]
    assert root.kind is SpanKind.CONSUMER
    assert root.parent is not None and root.parent.span_id == parent.span_id and root.parent.is_remote
    attrs = root.attributes
    assert attrs["messaging.system"] == "rabbitmq" and attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.destination.name"] == f"{prefix}.batch" and attrs["messaging.message.id"] == key
    assert attrs["jaxserve.status"] == "ok" and attrs["gen_ai.usage.output_tokens"] == result.usage.completion_tokens
    assert attrs["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == (result.finish_reason,)

    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time)
    names = [s.name for s in children]
    assert names[:4] == ["broker wait", "admission", "prefill", "decode"]
    assert len(names) == 5 and names[4].startswith("publish")
    for s in children:
        assert s.parent.span_id == root.context.span_id, s.name
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time, s.name
    for before, after in zip(children, children[1:]):
        assert before.end_time <= after.start_time + 1000, (
            before.name,
            after.name,
        )  # they tile the job (1 µs rounding)
    publish = children[4]
    assert publish.kind is SpanKind.PRODUCER
    assert publish.attributes["messaging.destination.name"] == client.reply_queue
    assert publish.attributes["messaging.operation.type"] == "send"
    assert children[2].attributes["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert children[3].attributes["gen_ai.usage.output_tokens"] == result.usage.completion_tokens


async def test_no_traceparent_gets_a_root_trace_only_when_tracing_is_on(prefix, client, monkeypatch):
    monkeypatch.delenv("TRACEPARENT", raising=False)
    provider, exporter = _provider()
    w = await _worker(prefix, Tracing(provider))
    try:
        key = await client.publish({"prompt": "no trace here", "max_tokens": 3}, queue="interactive")
        result = await client.wait(key, timeout=30)
        assert result.ok and result.trace_id is not None and len(result.trace_id) == 32
        await wait_until(lambda: any(s.name.startswith("process ") for s in exporter.get_finished_spans()), timeout=5)
    finally:
        await w.shutdown(drain_timeout=0.5)
    spans = _job_spans(exporter, int(result.trace_id, 16))
    (root,) = [s for s in spans if s.name == f"process {prefix}.interactive"]
    assert root.parent is None  # a root of its own
    assert {s.name for s in spans} >= {"admission", "prefill", "decode"}
    assert "broker wait" in {s.name for s in spans}  # the client stamps x-published-at-ms

    # Off: no spans and no trace id for a job without traceparent; the
    # producer's id (here from the TRACEPARENT variable) still comes back.
    w = await _worker(prefix, Tracing())
    try:
        key = await client.publish({"prompt": "untraced", "max_tokens": 3}, queue="interactive")
        assert (await client.wait(key, timeout=30)).trace_id is None
        monkeypatch.setenv("TRACEPARENT", TP)
        key = await client.publish({"prompt": "traced by env", "max_tokens": 3}, queue="interactive")
        assert (await client.wait(key, timeout=30)).trace_id == TP[3:35]
    finally:
        await w.shutdown(drain_timeout=0.5)


async def test_failed_job_marks_its_span_as_error(prefix, client):
    provider, exporter = _provider()
    w = await _worker(prefix, Tracing(provider))
    try:
        with provider.get_tracer("t").start_as_current_span("produce") as span:
            key = await client.publish({"prompt": "x", "model": "not-served"}, queue="batch")
            refused = await client.publish({"prompt": "x", "max_tokens": 100000}, queue="batch")
        result = await client.wait(key, timeout=30)
        assert result.error.code == "unknown_model" and result.trace_id == f"{span.get_span_context().trace_id:032x}"
        # refused before it became a job: no spans, but the producer's trace id
        assert (await client.wait(refused, timeout=30)).trace_id == result.trace_id
        await wait_until(lambda: any(s.name.startswith("process ") for s in exporter.get_finished_spans()), timeout=5)
    finally:
        await w.shutdown(drain_timeout=0.5)
    (root,) = [s for s in _job_spans(exporter, span.get_span_context().trace_id) if s.name.startswith("process ")]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["error.type"] == result.error.code
    names = {s.name for s in _job_spans(exporter, span.get_span_context().trace_id)}
    assert "prefill" not in names and "admission" in names  # it never reached the engine


# ------------------------------------------ OTLP from a worker process and the CLI
class _Collector:
    """A minimal OTLP/HTTP traces endpoint: keeps every span it is sent."""

    def __init__(self) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list = []
        self.services: set[str] = set()
        spans, services = self.spans, self.services

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    services.update(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_worker_exports_over_otlp_and_jaxserve_batch_passes_traceparent(prefix, tmp_path):
    import json

    from queue_support import start_worker_process, stop_process, wait_log, worker_env

    collector = _Collector()
    log = tmp_path / "worker.log"
    proc = start_worker_process(prefix, log, "--store", "memory", "--otlp-endpoint", collector.url)
    try:
        wait_log(log, "worker_consuming", timeout=60)
        rows = tmp_path / "rows.csv"
        rows.write_text("id,text\na,first document\nb,second document\n")
        out = tmp_path / "out.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "jaxserve",
            "batch",
            str(rows),
            "-o",
            str(out),
            "--prefix",
            prefix,
            "--amqp-url",
            AMQP_URL,
        ]
        cmd += ["--template", "{{ text }}", "--id-column", "id", "--max-tokens", "3", "--no-progress"]
        subprocess.run(cmd, check=True, env=worker_env(TRACEPARENT=TP), timeout=120, capture_output=True)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(lines) == 2 and all(x["status"] == "ok" and x["trace_id"] == TP[3:35] for x in lines)
    finally:
        stop_process(proc)  # SIGTERM: the worker drains and flushes its spans
        collector.close()
    assert collector.services == {"jaxserve-worker"}
    ours = [s for s in collector.spans if s.trace_id.hex() == TP[3:35]]
    roots = [s for s in ours if s.name == f"process {prefix}.batch"]
    assert len(roots) == 2 and all(s.parent_span_id.hex() == TP[36:52] for s in roots)
    for root in roots:
        names = sorted(s.name for s in ours if s.parent_span_id == root.span_id)
        assert names[:4] == ["admission", "broker wait", "decode", "prefill"] and names[4].startswith("publish"), names
