"""The gateway's pieces that need no broker: the status code of each
jaxserve error, the keys file, OpenAI requests as job bodies, the
server-sent chunks as the SDK's own types read them, the completion window,
the status page's recent events."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from jaxserve.gateway.batches import window_seconds
from jaxserve.gateway.errors import ApiError, from_error, param_of
from jaxserve.gateway.keys import OPEN, KeyRing, KeysFileError, Principal, priority_header, queue_header
from jaxserve.gateway.metrics import RecentEvents
from jaxserve.gateway.translate import ChunkWriter, job_body, validate
from jaxserve.wire import ERROR_CODES, Result


def test_every_error_code_has_openais_status_and_retry_after_only_where_a_retry_helps():
    want = {
        "invalid_request": 400,
        "context_length_exceeded": 400,
        "unknown_model": 404,
        "overloaded": 429,
        "rate_limited": 429,
        "expired": 504,
        "cancelled": 409,
        "internal": 500,
        "idempotency_key_reused": 409,
    }
    assert set(want) == set(ERROR_CODES)
    for code, status in want.items():
        err = from_error(code, "why", retry_after_s=2.5)
        assert err.status == status, code
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
        assert ("Retry-After" in err.headers()) == (status == 429), code
    assert from_error("overloaded", "busy", 2.5).headers() == {"Retry-After": "3"}
    assert from_error("rate_limited", "slow down", 0.01).headers() == {"Retry-After": "1"}  # never 0
    assert from_error("unknown_model", "x").body()["error"]["code"] == "model_not_found"
    assert from_error("unknown_model", "x").param == "model"


def test_invalid_request_names_its_field():
    assert param_of("top_logprobs: needs logprobs: true") == "top_logprobs"
    assert param_of("messages[0].content must be ...") == "messages[0].content"
    assert param_of("   nothing here") is None
    assert from_error("invalid_request", "n: Input should be 1 (got 2)").param == "n"


def test_keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n  sk-abcdefgh-1:\n    tenant: a\n    priority: 9\n    models: [m1]\n  sk-zzzzzzzz-2: {tenant: b}\n"
    )
    ring = KeyRing.load(path)
    assert ring.authenticate("Bearer sk-abcdefgh-1") == Principal("a", 9, frozenset({"m1"}), "gh-1")
    assert ring.authenticate("bearer sk-zzzzzzzz-2").tenant == "b"
    for header in (None, "", "Bearer", "Basic sk-abcdefgh-1", "Bearer sk-wrong-key"):
        with pytest.raises(ApiError) as info:
            ring.authenticate(header)
        assert info.value.status == 401 and info.value.code == "invalid_api_key"
    assert KeyRing().authenticate(None) is OPEN and OPEN.tenant == "default"
    with pytest.raises(ApiError) as info:
        ring.authenticate("Bearer sk-abcdefgh-1").check_model("m2")
    assert info.value.status == 404
    for bad, needle in [
        ("keys: {}\n", "expected a mapping"),
        ("keys:\n  short: {tenant: a}\n", "at least 8"),
        ("keys:\n  sk-abcdefgh: {tenant: ''}\n", "tenant"),
        ("keys:\n  sk-abcdefgh: {tenant: a, priority: 256}\n", "priority"),
        ("keys:\n  sk-abcdefgh: {tenant: a, models: m1}\n", "models"),
    ]:
        path.write_text(bad)
        with pytest.raises(KeysFileError, match=needle):
            KeyRing.load(path)


def test_priority_header():
    assert priority_header(None, 5) == 5 and priority_header("0", 5) == 0 and priority_header("255", None) == 255
    for bad in ("256", "-1", "high", "1.5"):
        with pytest.raises(ApiError) as info:
            priority_header(bad, None)
        assert info.value.status == 400 and info.value.param == "X-Jaxserve-Priority"
    assert queue_header(None) == "interactive" and queue_header("batch") == "batch"
    with pytest.raises(ApiError) as info:
        queue_header("fast")
    assert info.value.status == 400 and info.value.param == "X-Jaxserve-Queue"


def test_requests_become_job_bodies_with_the_callers_tenant():
    who = Principal("team", 7)
    body = job_body(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u-1",
            "tenant": "someone-else",
            "priority": 255,
        },
        "chat",
        who,
        3,
    )
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "tenant": "team",
        "priority": 3,
    }
    assert job_body({"model": "m", "prompt": ["one"]}, "completions", who, None)["prompt"] == "one"
    refused = [
        ({"messages": []}, "chat", "model"),
        ({"model": "m"}, "chat", "messages"),
        ({"model": "m", "prompt": "x", "messages": []}, "chat", "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "completions", "prompt"),
        ({"model": "m", "prompt": 5}, "completions", "prompt"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "completions", "stream_options"),
    ]
    for request, endpoint, param in refused:
        with pytest.raises(ApiError) as info:
            job_body(request, endpoint, who, None)
        assert info.value.status == 400 and info.value.param == param, request


def test_the_wires_checks_answer_400_before_anything_is_published():
    who = Principal("t")
    for extra, param in [({"n": 2}, "n"), ({"temperature": 3}, "temperature"), ({"top_logprobs": 2}, "top_logprobs")]:
        body = job_body({"model": "m", "prompt": "x", **extra}, "completions", who, None)
        with pytest.raises(ApiError) as info:
            validate(body, "k")
        assert info.value.status == 400 and info.value.param == param, (extra, info.value.message)
    assert json.loads(validate(job_body({"model": "m", "prompt": "x"}, "completions", who, None), "k"))["tenant"] == "t"


def _events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_stream_chunks_are_what_the_sdk_reads():
    result = Result.success("k", "Hello world", "stop", 3, 2, {"total_s": 0.1})
    writer = ChunkWriter("chat", "m", include_usage=True)
    events = _events(writer.opening() + writer.delta("Hello") + writer.delta(" world") + writer.closing(result))
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    plain = ChunkWriter("completions", "m", include_usage=False)
    events = _events(plain.opening() + plain.delta("Hi") + plain.closing(result))
    # OpenAI streams text_completion objects whose finish_reason is null until
    # the last; the SDK builds them unvalidated, and the last one validates
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["", "Hi", ""]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "stop"]
    assert Completion.model_validate(events[-2]).choices[0].finish_reason == "stop"
    error = _events(ChunkWriter.error(from_error("overloaded", "busy", 1.0)))
    assert error[0]["error"]["code"] == "overloaded" and error[1] == "[DONE]"


def test_completion_window():
    assert window_seconds("24h") == 86400 and window_seconds("90m") == 5400 and window_seconds("30s") == 30
    for bad in ("", "24", "0h", "1d", "169h", 24, None):
        with pytest.raises(ApiError) as info:
            window_seconds(bad)
        assert info.value.param == "completion_window"


def test_recent_events_count_refusals_by_code_and_answers_by_class():
    events = RecentEvents(window_s=600)
    for code in ("overloaded", "overloaded", "invalid_api_key"):
        events.add("refusal", "m", code)
    for _ in range(6):
        events.add("answer", "m", "interactive")
    by_code = events.refusals(60)
    assert {k: sum(v) for k, v in by_code.items()} == {"overloaded": 2, "invalid_api_key": 1}
    assert len(by_code["overloaded"]) == 10 and by_code["overloaded"][-1] == 2  # the newest minute last
    assert events.rates(60) == {("m", "interactive"): pytest.approx(0.1)}


def test_a_file_over_the_limit_is_refused_and_nothing_is_kept(tmp_path):
    import io

    from jaxserve.gateway.files import Files

    files = Files(store=None, folder=tmp_path, max_bytes=1000)  # type: ignore[arg-type]
    assert files.write_upload(io.BytesIO(b"x" * 1000), "file-ok1") == 1000
    with pytest.raises(ApiError) as info:
        files.write_upload(io.BytesIO(b"x" * 1001), "file-big1")
    assert info.value.status == 400 and info.value.code == "file_too_large" and info.value.param == "file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file-ok1"]
    for bad in ("../etc", "file-../x", "batch_1"):
        with pytest.raises(ApiError):
            files.path(bad)
