"""Structured output and logprobs through the broker: a real worker (tiny
model, engine process) answers response_format / guided_* / logprobs jobs,
refuses what it cannot honour with invalid_request, and `jaxserve batch`
with a schema for every row writes lines that OpenAI's own types read, the
parsed JSON next to the text."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import orjson
import pytest

from jaxserve.batch.inputs import InputOptions, read_items
from jaxserve.batch.run import BatchSettings, run_batch
from jaxserve.client.client import AsyncClient
from jaxserve.wire.job import JobProperties, parse_job
from queue_support import AMQP_URL, start_worker_process, stop_process, wait_log

pytestmark = pytest.mark.timeout(900)

SCHEMA = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "maxLength": 12},
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "currency": {"enum": ["EUR", "USD"]},
    },
    "required": ["party", "amount", "currency"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": SCHEMA, "strict": True}}


@pytest.fixture
def worker(prefix, tmp_path):
    log = tmp_path / "worker.log"
    proc = start_worker_process(
        prefix,
        log,
        "--store",
        "memory",
        "--max-num-seqs",
        "8",
        "--engine-arg",
        "max_model_len=256",
        "--engine-arg",
        "max_num_batched_tokens=64",
        engine=None,
    )
    try:
        wait_log(log, "worker_consuming", timeout=600)
        yield proc
    finally:
        stop_process(proc)


def test_job_fields_translate_and_unhonourable_fields_are_refused():
    def parse(body: dict):
        return parse_job(orjson.dumps(body), JobProperties(message_id="k"))

    job = parse({"prompt": "x", "response_format": RESPONSE_FORMAT, "logprobs": True, "top_logprobs": 4})
    assert job.params.structured.kind == "json_schema" and json.loads(job.params.structured.value) == SCHEMA
    assert job.params.logprobs and job.params.top_logprobs == 4
    assert parse({"prompt": "x", "logprobs": 3}).params.top_logprobs == 3  # completions' integer form
    assert parse({"prompt": "x", "response_format": {"type": "text"}}).params.structured is None
    assert parse({"prompt": "x", "response_format": {"type": "json_object"}}).params.structured.kind == "json_object"
    assert parse({"prompt": "x", "guided_choice": ["a", "b"]}).params.structured.value == ("a", "b")
    assert parse({"prompt": "x", "guided_regex": "a+"}).params.structured.kind == "regex"
    assert parse({"prompt": "x", "tools": [], "echo": False, "best_of": 1}).params.structured is None  # harmless values
    # a different schema is a different job (a key reused with it is refused)
    assert (
        parse({"prompt": "x", "guided_regex": "a+"}).fingerprint
        != parse({"prompt": "x", "guided_regex": "b+"}).fingerprint
    )
    refused = {
        "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "n": {"n": 2},
        "logit_bias": {"logit_bias": {"5": 10}},
        "best_of": {"best_of": 3},
        "echo": {"echo": True},
        "top_logprobs": {"top_logprobs": 2},  # without logprobs
        "top_logprobs ": {"logprobs": True, "top_logprobs": 21},
        "response_format": {"response_format": {"type": "yaml"}},
        "at most one": {"guided_regex": "a", "guided_choice": ["a"]},
        "labels": {"labels": ["a", "b"], "guided_regex": "a"},
    }
    for needle, extra in refused.items():
        with pytest.raises(Exception) as info:
            parse({"prompt": "x", **extra})
        assert getattr(info.value, "code", None) == "invalid_request", (needle, info.value)
        assert needle.strip() in str(info.value), (needle, str(info.value))


def test_batch_cli_constraint_options(tmp_path):
    import click

    from jaxserve.cli.batch_command import _output_constraint

    assert _output_constraint(None, None, None) == {}
    assert _output_constraint(None, " yes, no ,maybe", None) == {"guided_choice": ["yes", "no", "maybe"]}
    good = tmp_path / "invoice v2.json"
    good.write_text(json.dumps(SCHEMA))
    fmt = _output_constraint(str(good), None, None)["response_format"]
    assert (
        fmt["type"] == "json_schema"
        and fmt["json_schema"]["schema"] == SCHEMA
        and fmt["json_schema"]["name"] == "invoice_v2"
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}))
    for args, needle in [
        ((str(bad), None, None), "nope"),
        ((str(good), "a,b", None), "not both"),
        ((str(good), None, ["x", "y"]), "--labels"),
        ((None, " , ", None), "at least one"),
    ]:
        with pytest.raises(click.BadParameter, match=needle):
            _output_constraint(*args)
    notjson = tmp_path / "x.json"
    notjson.write_text("{oops")
    with pytest.raises(click.BadParameter, match="not a readable JSON"):
        _output_constraint(str(notjson), None, None)


async def test_a_worker_answers_constrained_and_logprobs_jobs(prefix, worker, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    client = AsyncClient(AMQP_URL, prefix=prefix)
    await client.connect()
    try:
        jobs = {
            "schema": dict(prompt="Invoice:", response_format=RESPONSE_FORMAT, max_tokens=120, temperature=1.0, seed=3),
            "chat-schema": dict(
                messages=[{"role": "user", "content": "hi"}],
                response_format=RESPONSE_FORMAT,
                max_tokens=120,
                temperature=0,
            ),
            "choice": dict(prompt="Mood:", guided_choice=["happy", "sad"], max_tokens=8, temperature=1.0, seed=1),
            "regex": dict(prompt="Code:", guided_regex="[A-Z]{2}-[0-9]{3}", max_tokens=16, temperature=1.0, seed=2),
            "logprobs": dict(prompt="Hello", max_tokens=6, temperature=1.0, seed=4, logprobs=True, top_logprobs=3),
            "bad-schema": dict(
                prompt="x",
                response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}},
            ),
            "tools": dict(prompt="x", tools=[{"type": "function", "function": {"name": "f"}}]),
        }
        results = dict(
            zip(jobs, await asyncio.gather(*(client.submit(**kw, queue="batch", timeout=300) for kw in jobs.values())))
        )
        # streaming: the chunks of a constrained job concatenate to its JSON
        stream = await client.stream(
            "Invoice:", response_format=RESPONSE_FORMAT, max_tokens=120, temperature=1.0, seed=9, timeout=300
        )
        streamed = "".join([piece async for piece in stream])
    finally:
        await client.close()
    assert stream.result.ok and streamed == stream.result.text
    jsonschema.validate(json.loads(streamed), SCHEMA)
    for name in ("schema", "chat-schema"):
        r = results[name]
        assert r.ok and r.finish_reason == "stop", r
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.parsed == json.loads(r.text)
    assert results["choice"].text in ("happy", "sad")
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", results["regex"].text)
    lp = results["logprobs"]
    content = lp.logprobs["content"]
    assert len(content) == lp.usage.completion_tokens == 6
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", errors="replace") == lp.text
    for c in content:
        assert c["logprob"] <= 0 and len(c["top_logprobs"]) == 3
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and c["logprob"] <= tops[0] + 1e-5
    for name, needle in (("bad-schema", "nope"), ("tools", "tools")):
        r = results[name]
        assert not r.ok and r.error.code == "invalid_request" and needle in r.error.message, r
    # the results in OpenAI's shapes, read by OpenAI's own types
    from jaxserve.batch.openai_format import response_body

    chat = ChatCompletion.model_validate(response_body(results["chat-schema"].to_dict(), "chat", "tiny"))
    assert json.loads(chat.choices[0].message.content) == results["chat-schema"].parsed
    comp = Completion.model_validate(response_body(results["logprobs"].to_dict(), "completions", "tiny"))
    assert comp.choices[0].logprobs.token_logprobs == [c["logprob"] for c in content]
    assert all(len(t) <= 3 for t in comp.choices[0].logprobs.top_logprobs)
    chat_lp = ChatCompletion.model_validate(response_body(results["logprobs"].to_dict(), "chat", "tiny"))
    assert [t.logprob for t in chat_lp.choices[0].logprobs.content] == [c["logprob"] for c in content]


async def test_jaxserve_batch_with_a_schema_for_every_row(prefix, worker, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from jaxserve.cli.batch_command import _output_constraint

    schema_file = tmp_path / "invoice.json"
    schema_file.write_text(json.dumps(SCHEMA))
    defaults = {"max_tokens": 120, "temperature": 1.0, **_output_constraint(str(schema_file), None, None)}
    rows = tmp_path / "docs.csv"
    rows.write_text("doc_id,text\n" + "".join(f"d{i},Invoice {i} from ACME for {i * 10} EUR\n" for i in range(6)))
    out = tmp_path / "out.jsonl"
    _, items = read_items(rows, InputOptions(template="Extract: {{ text }}", id_column="doc_id", defaults=defaults))
    settings = BatchSettings(amqp_url=AMQP_URL, prefix=prefix, progress=False, idle_timeout=300)
    await asyncio.to_thread(run_batch, items, out, settings)
    got = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert len(got) == 6
    for line in got:
        assert line["status"] == "ok" and line["finish_reason"] == "stop", line
        jsonschema.validate(line["parsed"], SCHEMA)
        assert json.loads(line["text"]) == line["parsed"]
    # OpenAI Batch input: response_format and logprobs on the lines themselves
    openai_in = tmp_path / "openai.jsonl"
    lines = [
        {
            "custom_id": "chat-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "Invoice from Bob"}],
                "response_format": RESPONSE_FORMAT,
                "max_tokens": 120,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
        {
            "custom_id": "comp-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": "Invoice from Eve",
                "response_format": {"type": "json_object"},
                "max_tokens": 160,
                "temperature": 0,
                "logprobs": 2,
            },
        },
        {
            "custom_id": "tools-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
        },
    ]
    openai_in.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    out2 = tmp_path / "openai_out.jsonl"
    _, items = read_items(openai_in, InputOptions(served_model_name="tiny"))
    await asyncio.to_thread(
        run_batch,
        items,
        out2,
        BatchSettings(amqp_url=AMQP_URL, prefix=prefix, progress=False, idle_timeout=300, served_model_name="tiny"),
    )
    got = {x["custom_id"]: x for x in (orjson.loads(b) for b in out2.read_bytes().splitlines())}
    chat = ChatCompletion.model_validate(got["chat-1"]["response"]["body"])
    message = got["chat-1"]["response"]["body"]["choices"][0]["message"]
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    assert message["parsed"] == json.loads(chat.choices[0].message.content)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    comp = Completion.model_validate(got["comp-1"]["response"]["body"])
    assert comp.choices[0].logprobs is not None and len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
    if comp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(comp.choices[0].text), dict)
    assert got["tools-1"]["response"] is None and got["tools-1"]["error"]["code"] == "invalid_request"


def test_batch_command_refuses_a_bad_schema_before_publishing(tmp_path):
    from click.testing import CliRunner

    from jaxserve.cli.main import cli

    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": "a", "prompt": "x"}\n')
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "nope"}}}')
    result = CliRunner().invoke(
        cli,
        [
            "batch",
            str(rows),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--json-schema",
            str(schema),
            "--amqp-url",
            "amqp://guest:guest@127.0.0.1:1/",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "--json-schema" in result.output and "nope" in result.output
    assert not (tmp_path / "out.jsonl").exists()
