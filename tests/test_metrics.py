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
    assert 'jaxserve_time_to_first_token_seconds_count{model_name="tiny"} 2.0' in text
    assert 'jaxserve_num_requests_running{model_name="tiny"} 0.0' in text
