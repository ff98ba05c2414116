"""The real ``openai`` SDK against a real gateway, broker and worker (the
``tiny`` preset, engine process): chat and completions, plain and
streamed, JSON Schema output and logprobs; ``models.list()``; the Files and
Batches APIs end to end, every output line read by the SDK's own types; an
unknown model is the SDK's ``NotFoundError``; a client that drops a stream
ends the job on the worker."""

from __future__ import annotations

import http.client
import io
import json
import time
import types
from datetime import datetime

import jsonschema
import openai
import pytest
from openai.types import Batch, Completion, FileObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway_support import GatewayProcess, drop_prefix, openai_line
from queue_support import start_worker_process, stop_process, unique_prefix, wait_log

pytestmark = pytest.mark.timeout(900)

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prefix = unique_prefix()
    folder = tmp_path_factory.mktemp("gateway-sdk")
    worker = start_worker_process(
        prefix,
        folder / "worker.log",
        "--max-num-seqs",
        "8",
        "--engine-arg",
        "max_model_len=256",
        "--engine-arg",
        "max_num_batched_tokens=64",
        engine=None,
    )
    gateway = None
    try:
        wait_log(folder / "worker.log", "worker_consuming", timeout=600)
        gateway = GatewayProcess(prefix, folder / "state", folder / "gateway.log").start()
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-checked", max_retries=0, timeout=120)
        yield types.SimpleNamespace(prefix=prefix, worker_log=folder / "worker.log", gateway=gateway, sdk=sdk)
    finally:
        if gateway is not None:
            gateway.stop()
        stop_process(worker)
        drop_prefix(prefix)


def test_models_list_names_the_served_model(stack):
    models = stack.sdk.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].owned_by == "jaxserve" and models[0].object == "model"
    assert stack.sdk.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        stack.sdk.models.retrieve("no-such-model")


def test_chat_plain_and_streamed_agree(stack):
    plain = stack.sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert isinstance(plain, ChatCompletion) and plain.object == "chat.completion"
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens >= 1 and plain.usage.total_tokens == (
        plain.usage.prompt_tokens + plain.usage.completion_tokens
    )
    chunks = list(
        stack.sdk.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the stream says what the plain answer said
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_plain_streamed_and_logprobs(stack):
    plain = stack.sdk.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2
    )
    assert isinstance(plain, Completion) and plain.object == "text_completion"
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == plain.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    streamed = list(
        stack.sdk.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_chat_logprobs(stack):
    r = stack.sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content  # one entry per token of the answer, its exact bytes


def test_chat_json_schema(stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for _ in range(2):  # sampled: two draws, both valid
        r = stack.sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_refusals_in_openai_shape(stack):
    with pytest.raises(openai.NotFoundError) as info:
        stack.sdk.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.BadRequestError) as info:
        stack.sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2)
    assert info.value.param == "n" and "n" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        stack.sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x " * 300}], max_tokens=8
        )
    assert info.value.code == "context_length_exceeded"


def test_files_and_batches_end_to_end(stack):
    sdk = stack.sdk
    lines = [openai_line(f"req-{i}", f"question {i % 6}", model="tiny", max_tokens=5, temperature=0) for i in range(24)]
    lines.append(
        json.dumps(
            {
                "custom_id": "with-tools",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny",
                    "messages": MESSAGES,
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                },
            }
        )
    )
    upload = sdk.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    assert isinstance(upload, FileObject) and upload.purpose == "batch" and upload.bytes > 0
    assert sdk.files.retrieve(upload.id).filename == "requests.jsonl"
    batch = sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "sdk"}
    )
    seen_counts = []
    end = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < end:
        time.sleep(0.3)
        batch = sdk.batches.retrieve(batch.id)
        seen_counts.append(batch.request_counts.completed + batch.request_counts.failed)
    assert isinstance(batch, Batch) and batch.status == "completed", batch
    assert (
        batch.request_counts.total == 25 and batch.request_counts.completed == 24 and batch.request_counts.failed == 1
    )
    assert seen_counts == sorted(seen_counts)  # live counts only grow
    assert batch.metadata == {"run": "sdk"} and batch.output_file_id and batch.error_file_id
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in sdk.files.content(batch.error_file_id).text.splitlines()]
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.model == "tiny" and body.usage.completion_tokens >= 1
    assert [x["custom_id"] for x in err] == ["with-tools"] and err[0]["error"]["code"] == "invalid_request"
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted([f"req-{i}" for i in range(24)] + ["with-tools"])  # each custom_id once
    # identical greedy requests: one answer
    by_id = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in out}
    assert by_id["req-0"] == by_id["req-6"] == by_id["req-12"]
    assert any(b.id == batch.id for b in sdk.batches.list(limit=5).data)
    assert sdk.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert sdk.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(upload.id)


def test_batch_with_unreadable_lines_fails_validation(stack):
    sdk = stack.sdk
    body = openai_line("a", "hi", model="tiny") + "\n{not json\n" + openai_line("a", "again", model="tiny") + "\n"
    upload = sdk.files.create(file=("bad.jsonl", io.BytesIO(body.encode())), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    end = time.monotonic() + 60
    while batch.status == "validating" and time.monotonic() < end:
        time.sleep(0.2)
        batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_request"), (3, "invalid_request")]
    assert "already used" in batch.errors.data[1].message
    with pytest.raises(openai.BadRequestError) as info:
        sdk.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert info.value.param == "endpoint"


def _worker_event(log_path, key: str, event: str) -> dict | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if key in line and f'"event": "{event}"' in line:
            return json.loads(line)
    return None


def test_client_disconnect_mid_stream_cancels_the_job_on_the_worker(stack):
    conn = http.client.HTTPConnection("127.0.0.1", stack.gateway.port, timeout=60)
    # greedy, this prompt runs all 200 tokens (no EOS): the job is still running when the client leaves
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "cache": False, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    first = resp.fp.readline()
    while not first.startswith(b"data: "):  # the chunked framing's size line first
        first = resp.fp.readline()
    assert b'"role":"assistant"' in first
    conn.sock.shutdown(2)  # the client goes away mid-stream
    conn.close()
    gone_at = time.time()
    end = time.monotonic() + 10
    cancelled = None
    while cancelled is None and time.monotonic() < end:
        time.sleep(0.05)
        cancelled = next((e for e in stack.gateway.log_events() if e.get("event") == "gateway_job_cancelled"), None)
    assert cancelled is not None and cancelled["reason"] == "disconnect"
    key = cancelled["key"]
    done = None
    while done is None and time.monotonic() < end:
        time.sleep(0.05)
        done = _worker_event(stack.worker_log, key, "job_done")
    assert done is not None and done["code"] == "cancelled", done
    ended_at = datetime.fromisoformat(done["timestamp"].replace("Z", "+00:00")).timestamp()
    assert ended_at - gone_at < 1.0  # the worker ended the job (freed its sequence) within a second
