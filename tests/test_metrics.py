"""Engine metrics follow a real engine run."""

from __future__ import annotations

from prometheus_client import generate_latest

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.types import SamplingParams
from jaxserve.metrics import EngineMetrics


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
