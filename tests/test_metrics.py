"""Engine metrics follow a real engine run."""

from __future__ import annotations

from prometheus_client import generate_latest

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.metrics import EngineMetrics
from jaxserve.sampling_params import SamplingParams


def test_metrics_count_tokens_and_latencies():
    engine = Engine(EngineArgs(model="tiny", max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64))
    engine.warmup()
    metrics = EngineMetrics("tiny")
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        metrics.record_step(engine, engine.step())
    text = generate_latest(metrics.registry).decode()
    assert 'jaxserve_generation_tokens_total{model_name="tiny"} 7.0' in text
    assert 'jaxserve_prompt_tokens_total{model_name="tiny"} 5.0' in text
    assert 'jaxserve_request_success_total{finished_reason="length",model_name="tiny"} 2.0' in text
    assert 'jaxserve_num_requests_running{model_name="tiny"} 0.0' in text


def test_latencies_by_queue_class_and_per_token_itl():
    metrics = EngineMetrics("m")
    text = generate_latest(metrics.registry).decode()
    # series exist from start-up, at zero, for both queue classes
    for q in ("interactive", "batch"):
        assert f'jaxserve_time_to_first_token_seconds_count{{model_name="m",queue="{q}"}} 0.0' in text
        assert (
            f'jaxserve_rejections_total{{code="overloaded",model_name="m",queue="{q}",reason="none",tenant="default"}} 0.0'
            in text
        )
    assert "jaxserve_process_resident_memory_bytes" in text
    metrics.observe_tokens("interactive", 0.3, 3)  # one chunk of 3 tokens, 0.3 s after the previous one
    metrics.observe_job(
        "batch",
        e2e=2.0,
        ttft=0.5,
        broker_wait=1.5,
        engine={"arrival": 10.0, "first_scheduled": 10.25, "first_token": 10.5, "finished": 12.0},
    )
    text = generate_latest(metrics.registry).decode()
    assert 'jaxserve_inter_token_latency_seconds_count{model_name="m",queue="interactive"} 3.0' in text
    assert 'jaxserve_inter_token_latency_seconds_sum{model_name="m",queue="interactive"} 0.3' in text
    assert 'jaxserve_time_to_first_token_seconds_count{model_name="m",queue="batch"} 1.0' in text
    assert 'jaxserve_broker_wait_seconds_sum{model_name="m",queue="batch"} 1.5' in text
    assert 'jaxserve_request_queue_time_seconds_sum{model_name="m",queue="batch"} 0.25' in text
    assert 'jaxserve_request_decode_time_seconds_sum{model_name="m",queue="batch"} 1.5' in text


def test_the_metrics_server_answers_its_three_paths_and_404_elsewhere():
    import socket
    import urllib.error
    import urllib.request

    from jaxserve.metrics import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve(EngineMetrics("m"), port, addr="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert r.status == 200 and b"jaxserve_process_resident_memory_bytes" in r.read()
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
            assert r.status == 200
        try:  # no readiness check registered: not ready, and not the metrics either
            urllib.request.urlopen(f"{base}/readyz", timeout=5)
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and b"no readiness check" in exc.read()
        for path in ("/", "/metric", "/metrics/extra", "/anything"):
            try:
                urllib.request.urlopen(f"{base}{path}", timeout=5)
            except urllib.error.HTTPError as exc:
                assert exc.code == 404 and b"try /metrics" in exc.read(), path
            else:
                raise AssertionError(f"{path} was answered")
    finally:
        server.shutdown()
