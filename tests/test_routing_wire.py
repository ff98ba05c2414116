"""Routing by model, the parts that need no broker: queue names,
routing keys, the new job fields' validation and the result fields."""

from __future__ import annotations

import orjson
import pytest

from jaxserve.request_error import RequestError
from jaxserve.wire import JobProperties, Result, parse_job
from jaxserve.wire.job import check_reply_to
from jaxserve.wire.topology import Topology, queue_safe, route_key
from jaxserve.worker.routing import ModelRoutes, fallback_queue, serve_as, was_rerouted


def _parse(**body):
    return parse_job(orjson.dumps({"prompt": "x", **body}), JobProperties(message_id="k"))


def _refused(**body) -> str:
    with pytest.raises(RequestError) as info:
        _parse(**body)
    assert info.value.code == "invalid_request"
    return str(info.value)


def test_default_model_keeps_the_single_model_names():
    t = Topology(prefix="p")
    assert t.model_queue("interactive", None) == "p.interactive" == t.interactive
    assert t.model_queue("batch", None) == "p.batch"
    assert t.model_queue("interactive", "smollm2-135m") == "p.interactive.smollm2-135m"
    assert t.model_queue("batch", "Qwen2.5-0.5B") == "p.batch.Qwen2.5-0.5B"
    assert t.models == "p.models"
    with pytest.raises(ValueError):
        t.model_queue("bulk", "m")


def test_queue_safe_keeps_plain_names_and_separates_the_others():
    assert queue_safe("llama-3.2_1b.q8") == "llama-3.2_1b.q8"
    a, b = queue_safe("org/model:v2"), queue_safe("org_model_v2")
    assert b == "org_model_v2" and a.startswith("org_model_v2@") and a != b
    assert queue_safe("/models/Llama 3") != queue_safe("/models/Llama_3")
    long = "m" * 300
    assert len(queue_safe(long)) == 64 + 9 and queue_safe(long) != queue_safe("m" * 299)
    with pytest.raises(ValueError):
        queue_safe("")


def test_route_key_is_the_name_as_written_within_amqp_limits():
    assert route_key("interactive", "org/model:v2") == "interactive.org/model:v2"
    assert route_key("batch", "x") == "batch.x"
    with pytest.raises(ValueError, match="too long"):
        route_key("interactive", "m" * 250)
    with pytest.raises(ValueError):
        route_key("other", "m")


def test_model_routes_bind_every_name_to_the_served_queues():
    t = Topology(prefix="p")
    default = ModelRoutes(t, served="alpha", aliases=("chat", "alpha"), default=True)
    assert default.names == ("alpha", "chat")
    assert default.queues() == {"interactive": "p.interactive", "batch": "p.batch"}
    assert sorted(default.bindings()) == [
        ("p.batch", "batch.alpha"),
        ("p.batch", "batch.chat"),
        ("p.interactive", "interactive.alpha"),
        ("p.interactive", "interactive.chat"),
    ]
    other = ModelRoutes(t, served="beta")
    assert other.queues() == {"interactive": "p.interactive.beta", "batch": "p.batch.beta"}
    assert fallback_queue(t, "alpha", "batch", default_model="alpha") == "p.batch"
    assert fallback_queue(t, "beta", "batch", default_model="alpha") == "p.batch.beta"
    with pytest.raises(ValueError):
        ModelRoutes(t, served="m" * 260)


def test_rerouted_headers():
    assert not was_rerouted(None) and not was_rerouted({"x-published-at-ms": 1})
    assert was_rerouted({"x-jaxserve-rerouted-from": ""})
    assert serve_as({"x-jaxserve-rerouted-from": "a", "x-jaxserve-model": b"beta"}) == "beta"
    assert serve_as({"x-jaxserve-model": "beta"}) is None  # only a re-routed copy names another model


def test_fallback_and_degrade_fields_parse():
    job = _parse(model="alpha", fallback_models=["beta", "gamma"], degrade={"max_tokens": 4}, max_tokens=32)
    assert job.fallback_models == ("beta", "gamma") and job.degrade_max_tokens == 4
    plain = _parse()
    assert plain.fallback_models == () and plain.degrade_max_tokens is None
    # the default max_tokens (16) is what degrade must stay under
    assert _parse(degrade={"max_tokens": 15}).degrade_max_tokens == 15
    # the fields do not change what the key's fingerprint says the job is
    assert _parse(fallback_models=["beta"]).fingerprint == plain.fingerprint


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"fallback_models": ["beta", "beta"]}, "fallback_models must be distinct, got 'beta' twice"),
        ({"model": "alpha", "fallback_models": ["beta", "alpha"]}, "fallback_models[1] 'alpha' is the job's own"),
        ({"fallback_models": ["a", "b", "c", "d", "e"]}, "fallback_models"),
        ({"fallback_models": []}, "fallback_models"),
        ({"fallback_models": "beta"}, "fallback_models"),
        ({"fallback_models": [""]}, "fallback_models[0]"),
        ({"fallback_models": [7]}, "fallback_models[0]"),
        ({"degrade": {"max_tokens": 16}}, "degrade.max_tokens must be smaller than the job's max_tokens 16, got 16"),
        (
            {"degrade": {"max_tokens": 40}, "max_completion_tokens": 32},
            "smaller than the job's max_completion_tokens 32, got 40",
        ),
        ({"degrade": {"max_tokens": 0}}, "degrade.max_tokens"),
        ({"degrade": {"max_tokens": 2.5}}, "degrade.max_tokens"),
        ({"degrade": {}}, "degrade.max_tokens"),
        ({"degrade": 8}, "degrade"),
    ],
)
def test_bad_fallback_and_degrade_name_field_and_value(body, needle):
    assert needle in _refused(**body)


def test_reply_to_may_not_name_another_models_job_queue():
    reserved = Topology(prefix="p").reserved_names()
    for name in ("p.interactive.beta", "p.batch.org_model@12345678", "p.models"):
        with pytest.raises(RequestError, match="reply_to"):
            check_reply_to(name, reserved)
    check_reply_to("p.reply.abc", reserved)
    check_reply_to("p.interactively", reserved)


def test_result_says_which_model_answered_and_what_was_degraded():
    r = Result.success("k", "hi", "length", 3, 2, {"total_s": 0.1}, served_model="beta", degraded=["model"])
    assert r.to_dict()["served_model"] == "beta" and r.to_dict()["degraded"] == ["model"]
    plain = Result.success("k", "hi", "stop", 3, 2, {"total_s": 0.1}).to_dict()
    assert "served_model" not in plain and "degraded" not in plain
    with pytest.raises(ValueError):
        Result.success("k", "hi", "stop", 3, 2, {}, degraded=["temperature"])
