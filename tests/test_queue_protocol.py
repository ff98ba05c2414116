"""Queue contract pieces that need no broker: parsing, schemas, topology
description, the in-memory store, the engine thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import jsonschema
import orjson
import pytest

from jaxserve.engine.types import RequestClass
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.wire import ERROR_CODES, JobLimits, JobProperties, Result, parse_job
from jaxserve.wire.messages import Chunk
from jaxserve.wire.schemas import MODELS, render
from jaxserve.wire.topology import Topology
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.store import MemoryStore, Record
from queue_support import EchoEngine

QUEUES = Path(__file__).resolve().parent.parent / "queues"


def _schema(name: str) -> dict:
    s = json.loads((QUEUES / "schemas" / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(s)
    return s


def test_topology_json_matches_code():
    assert json.loads((QUEUES / "topology.json").read_text()) == Topology().describe()
    t = Topology()
    assert (t.interactive, t.batch, t.dlx, t.dead, t.results, t.control) == (
        "jaxserve.interactive",
        "jaxserve.batch",
        "jaxserve.dlx",
        "jaxserve.dead",
        "jaxserve.results",
        "jaxserve.control",
    )
    for qc in ("interactive", "batch"):
        args = t.job_queue_arguments(qc)
        assert args["x-queue-type"] == "quorum" and args["x-overflow"] == "reject-publish"
        assert args["x-dead-letter-strategy"] == "at-least-once" and args["x-delivery-limit"] > 0
        assert "x-max-priority" not in args
    assert "x-message-ttl" in t.job_queue_arguments("interactive") and "x-message-ttl" not in t.job_queue_arguments(
        "batch"
    )


def _props(**kw) -> JobProperties:
    return JobProperties(message_id=kw.pop("message_id", "k"), **kw)


def test_parse_job_fields_and_openai_names():
    body = orjson.dumps(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 1,
            "stop": "x",
            "stream": True,
            "model": "m",
            "tenant": "t",
        }
    )
    job = parse_job(body, _props(expiration=2.0, published_at=time.time(), priority=4))
    assert job.key == "k" and job.messages[0]["content"] == "hi" and job.stream
    assert job.params.max_tokens == 7 and job.params.top_k == 3 and job.params.stop == ("x",) and job.params.seed == 1
    # AMQP priority: higher is more urgent; the engine serves the lower value first
    assert job.priority == 4 and job.engine_priority == -4 and 0 < job.deadline - time.time() <= 2.0
    job = parse_job(
        orjson.dumps({"prompt": "p", "deadline": 5.0, "priority": 9}), _props(expiration="1000", priority=1)
    )
    assert job.deadline == 5.0 and job.priority == 9  # the body's priority wins


def test_unseeded_sampled_jobs_get_a_seed_from_their_key():
    a1 = parse_job(b'{"prompt": "p", "temperature": 0.9}', _props(message_id="a"))
    a2 = parse_job(b'{"prompt": "p", "temperature": 0.9}', _props(message_id="a"))
    b = parse_job(b'{"prompt": "p", "temperature": 0.9}', _props(message_id="b"))
    assert a1.params.seed == a2.params.seed != b.params.seed and not a1.seed_given
    assert 0 <= a1.params.seed < 2**64
    greedy = parse_job(b'{"prompt": "p", "temperature": 0}', _props())
    assert greedy.params.seed is None
    given = parse_job(b'{"prompt": "p", "seed": 7}', _props())
    assert given.params.seed == 7 and given.seed_given


def test_fingerprint_names_the_effect_not_the_delivery():
    fp = lambda body, **kw: parse_job(orjson.dumps(body), _props(**kw)).fingerprint  # noqa: E731
    base = fp({"prompt": "p"})
    assert base == fp(
        {"prompt": "p", "max_tokens": 16, "stream": True, "tenant": "x", "priority": 3}, message_id="other"
    )
    assert base == fp({"prompt": "p", "stop": None})
    assert base != fp({"prompt": "q"}) != fp({"prompt": "p", "max_tokens": 17})
    assert fp({"prompt": "p", "stop": "x"}) == fp({"prompt": "p", "stop": ["x"]})


@pytest.mark.parametrize(
    "body,kw,field",
    [
        (b"\xff\xfe", {}, "JSON"),
        (b"null", {}, "object"),
        (b"[" * 2000 + b"]" * 2000, {}, "JSON"),
        (orjson.dumps({"prompt": "p", "n": 2}), {}, "n"),
        (orjson.dumps({"prompt": "p", "top_p": 0}), {}, "top_p"),
        (orjson.dumps({"prompt": "p", "max_tokens": True}), {}, "max_tokens"),
        (orjson.dumps({"prompt": "p", "max_tokens": 2**31}), {}, "max_tokens"),
        (orjson.dumps({"prompt": "p", "seed": "1"}), {}, "seed"),
        (b'{"prompt": "p", "seed": 18446744073709551616}', {}, "seed"),
        (b'{"prompt": "p", "seed": -9223372036854775809}', {}, "seed"),
        (orjson.dumps({"prompt": "p", "seed": 1.5}), {}, "seed"),
        (orjson.dumps({"prompt": "p", "stop": ["", "a"]}), {}, "stop"),
        (orjson.dumps({"prompt": "p", "stop": ["a"] * 17}), {}, "stop"),
        (orjson.dumps({"messages": []}), {}, "messages"),
        (orjson.dumps({"messages": [{"role": "user", "content": {"nested": [1, [2]]}}]}), {}, "messages[0].content"),
        # nested as deep as the JSON parser allows: the message's repr of the value must not recurse
        (b'{"messages": [{"role": "user", "content": ' + b"[" * 1000 + b"]" * 1000 + b"}]}", {}, "messages[0].content"),
        (b'{"prompt": ' + b'{"a":' * 1000 + b"1" + b"}" * 1000 + b"}", {}, "prompt"),
        (orjson.dumps({"prompt": "p"}), {"content_type": "text/plain"}, "content_type"),
        (orjson.dumps({"prompt": "p"}), {"message_id": None}, "message_id"),
        (orjson.dumps({"prompt": "p"}), {"message_id": b"\xff"}, "message_id"),
        (b'{"prompt": "p", "temperature": -1}', {}, "temperature"),
        (b'{"prompt": "p", "temperature": 2.5}', {}, "temperature"),
        (b'{"prompt": "p", "temperature": 1e308}', {}, "temperature"),
        (b'{"prompt": "p", "temperature": "NaN"}', {}, "temperature"),
        (b'{"prompt": "p", "top_k": 1.5}', {}, "top_k"),
        (b'{"prompt": "p", "top_k": 1099511627776}', {}, "top_k"),
        (b'{"prompt": "p", "top_k": -1}', {}, "top_k"),
        (b'{"prompt": "p", "top_k": 33}', {"limits": JobLimits(vocab_size=32)}, "top_k"),
        (b'{"prompt": "p", "max_tokens": 600}', {"limits": JobLimits(max_model_len=512)}, "max_tokens"),
        (b'{"prompt": "p", "frequency_penalty": 2.01}', {}, "frequency_penalty"),
        (b'{"prompt": "p", "priority": 256}', {}, "priority"),
        (b'{"prompt": "p", "priority": -1}', {}, "priority"),
        (b'{"prompt": "p", "deadline": "soon"}', {}, "deadline"),
        (b'{"prompt": "p", "stream": "yes"}', {}, "stream"),
        (b'{"prompt": ["p"]}', {}, "prompt"),
        (b'{"prompt": "p", "messages": [{"role": "user", "content": "x"}]}', {}, "exactly one"),
        (b'{"prompt": "p", "tenant": {"a": 1}}', {}, "tenant"),
        (b'{"prompt": "p"}', {"limits": JobLimits(max_body_bytes=5)}, "bytes"),
    ],
)
def test_parse_job_rejects_naming_the_field(body, kw, field):
    limits = kw.pop("limits", JobLimits())
    with pytest.raises(RequestError) as info:
        parse_job(body, _props(**kw), limits)
    assert info.value.code == "invalid_request"
    assert field in info.value.message


def test_schemas_are_generated_from_the_models():
    for name in MODELS:
        assert (QUEUES / "schemas" / f"{name}.schema.json").read_text() == render(name), (
            f"queues/schemas/{name}.schema.json is stale: run python -m jaxserve.wire.schemas queues/schemas"
        )


def test_replies_match_schemas():
    result, chunk, cancel, job = _schema("result"), _schema("chunk"), _schema("cancel"), _schema("job")
    jsonschema.validate(Result.success("k", "t", "stop", 1, 2, {"total_s": 0.1}).to_dict(), result)
    jsonschema.validate({**Result.success("k", "t", "length", 1, 2, {}).to_dict(), "replayed": True}, result)
    for code in ERROR_CODES:
        jsonschema.validate(Result.failure("k", code, "m").to_dict(), result)
    jsonschema.validate(Result.failure(None, "invalid_request", "no message_id").to_dict(), result)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {
                **Result.failure("k", "internal", "m").to_dict(),
                "error": {"code": "teapot", "message": "m", "retryable": False},
            },
            result,
        )
    jsonschema.validate(Chunk(id="k", seq=0, text="he", run="run1").to_dict(), chunk)
    jsonschema.validate({"type": "cancel", "id": "k"}, cancel)
    jsonschema.validate({"prompt": "hi", "max_tokens": 3, "stream": True, "stop": ["\n"]}, job)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "hi", "messages": []}, job)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "hi", "temperature": 3}, job)
    assert Result.failure("k", "idempotency_key_reused", "m").error.retryable is False
    assert Result.failure("k", "internal", "m").error.retryable is True


async def test_memory_store_bounds_and_claims():
    s = MemoryStore(max_entries=3)
    for i in range(5):
        await s.put(f"k{i}", Record({"id": f"k{i}"}, [], "fp"))
    assert await s.get("k0") is None and (await s.get("k4")).result["id"] == "k4"
    await s.mark_delivered("k4", "q|c")
    assert (await s.get("k4")).delivered == ["q|c"] and (await s.get("k4")).fingerprint == "fp"
    assert await s.claim("a", "w1", 10) is None
    assert await s.claim("a", "w2", 10) == "w1"
    await s.release("a", "w2")
    assert await s.claim("a", "w2", 10) == "w1"
    await s.release("a", "w1")
    assert await s.claim("a", "w2", 0.01) is None
    await asyncio.sleep(0.02)
    assert await s.claim("a", "w3", 10) is None  # lease ran out
    await s.mark_cancelled("c", 10)
    assert await s.is_cancelled("c") and not await s.is_cancelled("d")


async def test_engine_thread_owns_the_engine():
    loop = asyncio.get_running_loop()
    eng = EchoEngine(step_s=0.001)
    got: dict[str, str] = {}
    done: set[str] = set()
    finished = asyncio.Event()
    errors: list = []

    def on_outputs(outs):
        assert threading.current_thread() is threading.main_thread()
        for o in outs:
            got[o.request_id] = got.get(o.request_id, "") + o.new_text
            if o.finished:
                done.add(o.request_id)
            if done >= {"a", "b"}:
                finished.set()

    et = EngineThread(eng, loop, on_outputs, errors.append)
    et.start()
    try:
        await et.warmup()
        await et.add_request(
            "a", eng.tokenizer.encode("x y"), SamplingParams(max_tokens=3), request_class=RequestClass.INTERACTIVE
        )
        await et.add_request("b", "p q", SamplingParams(max_tokens=2))
        with pytest.raises(RequestError):
            await et.add_request("c", "z " * 400, SamplingParams(max_tokens=2))
        await asyncio.wait_for(finished.wait(), 5)
        assert got == {"a": "x y x ", "b": "p q "}
        assert eng.thread_ids == {et._thread.ident}
        eng.fail_next_step = True
        await et.add_request("d", "p", SamplingParams(max_tokens=50))
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.01)
        assert errors and "injected" in str(errors[0])
        assert await et.abort("d") is True
    finally:
        et.stop()
    assert not et.alive
