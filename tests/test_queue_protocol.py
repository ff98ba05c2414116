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

from jaxserve.engine.types import RequestClass, RequestError, SamplingParams
from jaxserve.worker import protocol
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.idempotency import MemoryStore
from jaxserve.worker.topology import Topology
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
        "jaxserve.interactive", "jaxserve.batch", "jaxserve.dlx", "jaxserve.dead", "jaxserve.results", "jaxserve.control",
    )  # fmt: skip
    for qc in ("interactive", "batch"):
        args = t.job_queue_arguments(qc)
        assert args["x-queue-type"] == "quorum" and args["x-overflow"] == "reject-publish"
        assert args["x-dead-letter-strategy"] == "at-least-once" and args["x-delivery-limit"] > 0
        assert "x-max-priority" not in args
    assert "x-message-ttl" in t.job_queue_arguments("interactive") and "x-message-ttl" not in t.job_queue_arguments("batch")


def test_parse_job_fields_and_openai_names():
    body = orjson.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 1, "stop": "x", "stream": True, "model": "m", "tenant": "t"})
    job = protocol.parse_job(body, message_id="k", expiration=2.0, timestamp=time.time(), priority=4)
    assert job.key == "k" and job.messages[0]["content"] == "hi" and job.stream
    assert job.params.max_tokens == 7 and job.params.top_k == 3 and job.params.stop == ("x",) and job.params.seed == 1
    assert job.priority == 4 and 0 < job.deadline - time.time() <= 2.0
    job = protocol.parse_job(orjson.dumps({"prompt": "p", "deadline": 5.0}), message_id="k", expiration="1000")
    assert job.deadline == 5.0


@pytest.mark.parametrize(
    "body,kw",
    [
        (b"\xff\xfe", {}),
        (b"null", {}),
        (orjson.dumps({"prompt": "p", "n": 2}), {}),
        (orjson.dumps({"prompt": "p", "top_p": 0}), {}),
        (orjson.dumps({"prompt": "p", "max_tokens": True}), {}),
        (orjson.dumps({"prompt": "p", "seed": "1"}), {}),
        (orjson.dumps({"prompt": "p", "stop": ["", "a"]}), {}),
        (orjson.dumps({"messages": []}), {}),
        (orjson.dumps({"prompt": "p"}), {"content_type": "text/plain"}),
        (b'{"prompt": "p", "temperature": -1}', {}),
        (b'{"prompt": "p", "top_k": 1.5}', {}),
    ],
)
def test_parse_job_rejects(body, kw):
    with pytest.raises(RequestError) as info:
        protocol.parse_job(body, message_id="k", **kw)
    assert info.value.code == "invalid_request"


def test_replies_match_schemas():
    result, chunk, cancel, job = _schema("result"), _schema("chunk"), _schema("cancel"), _schema("job")
    jsonschema.validate(protocol.result_ok("k", "t", "stop", 1, 2, {"total_s": 0.1}), result)
    jsonschema.validate({**protocol.result_ok("k", "t", "length", 1, 2, {}), "replayed": True}, result)
    for code in protocol.ERROR_CODES:
        jsonschema.validate(protocol.result_error("k", code, "m"), result)
    jsonschema.validate(protocol.result_error(None, "invalid_request", "no message_id"), result)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(protocol.result_error("k", "teapot", "m"), result)
    jsonschema.validate(protocol.chunk("k", 0, "he", "run1"), chunk)
    jsonschema.validate({"type": "cancel", "id": "k"}, cancel)
    jsonschema.validate({"prompt": "hi", "max_tokens": 3, "stream": True, "stop": ["\n"]}, job)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "hi", "messages": []}, job)


async def test_memory_store_bounds_and_claims():
    s = MemoryStore(max_entries=3)
    for i in range(5):
        await s.put(f"k{i}", {"id": f"k{i}"})
    assert await s.get("k0") is None and (await s.get("k4"))["result"]["id"] == "k4"
    await s.mark_delivered("k4", "q|c")
    assert (await s.get("k4"))["delivered"] == ["q|c"]
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
        await et.add_request("a", eng.tokenizer.encode("x y"), SamplingParams(max_tokens=3), request_class=RequestClass.INTERACTIVE)
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
