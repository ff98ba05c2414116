"""Batch document classification through the real broker (EchoEngine
worker): OpenAI Batch lines in and out (validated with the openai package's
own types), label scoring results, CSV and Parquet inputs with a template,
keys scoped to the file, resume with retry, key reuse, the response cache
and in-run deduplication."""

from __future__ import annotations

import asyncio
import csv
from pathlib import Path

import orjson
import pytest

from jaxserve.batch.inputs import InputOptions, read_items
from jaxserve.batch.run import BatchSettings, run_batch
from queue_support import AMQP_URL, EchoEngine, expected_completion

pytestmark = pytest.mark.timeout(120)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines))
    return path


def lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


async def batch(prefix: str, inp: Path, out: Path, **kw):
    defaults = {k: kw.pop(k) for k in ("max_tokens", "temperature", "seed") if k in kw}
    opts = InputOptions(defaults=defaults, **{k: kw.pop(k) for k in list(kw) if k in InputOptions.__dataclass_fields__})
    _, items = read_items(inp, opts)
    settings = BatchSettings(
        amqp_url=AMQP_URL, prefix=prefix, progress=False, idle_timeout=kw.pop("idle_timeout", 20), **kw
    )
    return await asyncio.to_thread(run_batch, items, out, settings)


def openai_line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


async def test_openai_batch_lines_validate_with_openai_types(harness, prefix, tmp_path):
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    await harness.start(EchoEngine(step_s=0.001, model_name="echo"))
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            openai_line("c-1", "/v1/completions", {"model": "echo", "prompt": "alpha beta", "max_tokens": 4}),
            openai_line(
                "chat-1",
                "/v1/chat/completions",
                {"model": "echo", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3},
            ),
            openai_line("emb-1", "/v1/embeddings", {"model": "echo", "input": "x"}),
            openai_line("wrong-model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}),
            openai_line(
                "fmt",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            ),
            openai_line("lp", "/v1/completions", {"prompt": "x", "logprobs": 2, "echo": True}),
            openai_line("too-long", "/v1/completions", {"prompt": "word " * 600, "max_tokens": 4}),
            b"{this line is not json",
        ],
    )
    out = tmp_path / "out.jsonl"
    summary = await batch(prefix, inp, out, served_model_name="echo")
    got = {x["custom_id"]: x for x in lines(out)}
    assert set(got) == {"c-1", "chat-1", "emb-1", "wrong-model", "fmt", "lp", "too-long"}
    for x in got.values():
        assert x["id"].startswith("batch_req_") and set(x) == {"id", "custom_id", "response", "error"}
    comp = Completion.model_validate(got["c-1"]["response"]["body"])
    assert (
        comp.object == "text_completion"
        and comp.model == "echo"
        and comp.usage.total_tokens == comp.usage.prompt_tokens + 4
    )
    assert comp.choices[0].text == expected_completion("alpha beta", 4)[0] and got["c-1"]["error"] is None
    chat = ChatCompletion.model_validate(got["chat-1"]["response"]["body"])
    assert (
        chat.object == "chat.completion"
        and chat.choices[0].message.role == "assistant"
        and chat.usage.completion_tokens == 3
    )
    for cid, code, needle in [
        ("emb-1", "invalid_request", "/v1/embeddings"),
        ("wrong-model", "unknown_model", "gpt-9"),
        ("fmt", "invalid_request", "tools"),
        ("lp", "invalid_request", "echo"),
        ("too-long", "context_length_exceeded", "context length"),
    ]:
        assert (
            got[cid]["response"] is None
            and got[cid]["error"]["code"] == code
            and needle in got[cid]["error"]["message"]
        ), got[cid]
        assert BatchError.model_validate(got[cid]["error"]).code == code  # openai's own type for a request's error
    assert summary.bad_lines == 5 and summary.exit_status == 1  # the four refused here plus the broken line


async def test_openai_lines_carry_the_usage_cost_a_jaxserve_line_carries(harness, prefix, tmp_path):
    from openai.types import Completion

    from jaxserve.cost.prices import PriceTable

    prices = PriceTable.from_values(prompt_per_million=2.0, completion_per_million=10.0)
    await harness.start(EchoEngine(step_s=0.001), prices=prices)
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            openai_line("c", "/v1/completions", {"prompt": "alpha beta", "max_tokens": 4}),
            openai_line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ],
    )
    assert (await batch(prefix, inp, tmp_path / "openai.out", max_tokens=3)).ok == 2
    assert (await batch(prefix, inp, tmp_path / "native.out", max_tokens=3, out_format="jaxserve")).ok == 2
    native = {x["custom_id"]: x["usage"] for x in lines(tmp_path / "native.out")}
    for x in lines(tmp_path / "openai.out"):
        usage = x["response"]["body"]["usage"]
        own = native[x["custom_id"]]
        cost = (own["prompt_tokens"] * 2.0 + own["completion_tokens"] * 10.0) / 1e6
        assert usage["cost"] == own["cost"] == {"amount": pytest.approx(cost), "currency": "USD"}, usage
    # Output lines come in finishing order, as OpenAI Batch's do, so the completion is found by its custom_id.
    by_id = {x["custom_id"]: x for x in lines(tmp_path / "openai.out")}
    assert Completion.model_validate(by_id["c"]["response"]["body"]).object == "text_completion"  # openai's shape


async def test_label_scoring_results_in_both_formats(harness, prefix, tmp_path):
    await harness.start(EchoEngine(step_s=0.001))
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            openai_line("d1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "the sports match"}]}),
            {"id": "d2", "prompt": "stock markets fell"},
        ],
    )
    out = tmp_path / "out.jsonl"
    summary = await batch(prefix, inp, out, labels=["sports", "business", "science"])
    assert summary.ok == 2 and summary.exit_status == 0
    got = {x["custom_id"]: x for x in lines(out)}
    body = got["d1"]["response"]["body"]
    assert [x["label"] for x in body["labels"]] == ["sports", "business", "science"]
    assert abs(sum(x["prob"] for x in body["labels"]) - 1.0) < 1e-9
    assert body["choices"][0]["message"]["content"] == max(body["labels"], key=lambda x: x["logprob"])["label"]
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 0
    plain = got["d2"]
    assert plain["status"] == "ok" and plain["text"] in ("sports", "business", "science") and len(plain["labels"]) == 3
    prompt_tokens = len(b"stock markets fell") + sum(len(x.encode()) for x in ("sports", "business", "science"))
    assert plain["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0}


async def test_csv_and_parquet_rows_through_a_template(harness, prefix, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    await harness.start(EchoEngine(step_s=0.001))
    rows = [{"doc_id": f"r{i}", "title": f"title{i}", "text": f"body {i}"} for i in range(5)]
    with open(tmp_path / "docs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["doc_id", "title", "text"])
        w.writeheader()
        w.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "docs.parquet")
    template = "Title: {{ title }} Text: {{ text }}"
    for name in ("docs.csv", "docs.parquet"):
        out = tmp_path / f"{name}.out.jsonl"
        summary = await batch(prefix, tmp_path / name, out, template=template, id_column="doc_id", max_tokens=3)
        assert summary.ok == 5 and summary.exit_status == 0
        got = {x["custom_id"]: x for x in lines(out)}
        assert set(got) == {f"r{i}" for i in range(5)}
        assert got["r2"]["text"] == expected_completion("Title: title2 Text: body 2", 3)[0]
    # a row the template cannot fill is reported and the exit status says so
    with open(tmp_path / "bad.csv", "w", newline="") as f:
        f.write("doc_id,title\nx1,only a title\n")
    summary = await batch(prefix, tmp_path / "bad.csv", tmp_path / "bad.out", template=template, id_column="doc_id")
    [line] = lines(tmp_path / "bad.out")
    assert summary.bad_lines == 1 and summary.exit_status == 1 and "text" in line["error"]["message"]


async def test_keys_are_scoped_to_the_file(harness, prefix, tmp_path):
    eng = EchoEngine(step_s=0.001)
    await harness.start(eng)
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "request-1", "prompt": "first file text", "max_tokens": 3}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "request-1", "prompt": "second file text", "max_tokens": 3}])
    await batch(prefix, a, tmp_path / "a.out")
    await batch(prefix, b, tmp_path / "b.out")
    [ra], [rb] = lines(tmp_path / "a.out"), lines(tmp_path / "b.out")
    assert ra["text"] == expected_completion("first file text", 3)[0]
    assert rb["text"] == expected_completion("second file text", 3)[0] and not rb.get("replayed")
    assert ra["id"] != rb["id"] and ra["custom_id"] == rb["custom_id"] == "request-1"


async def test_rerun_skips_done_lines_and_retries_retryable_errors(harness, prefix, tmp_path):
    eng = EchoEngine(step_s=0.001)
    await harness.start(eng)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"j{i}", "prompt": f"doc {i}", "max_tokens": 2} for i in range(4)])
    out = tmp_path / "out.jsonl"
    first = await batch(prefix, inp, out)
    assert first.ok == 4
    # pretend j1 failed retryably and j2 failed for good in the first run
    kept = []
    for x in lines(out):
        if x["custom_id"] == "j1":
            x = {
                "type": "result",
                "id": x["id"],
                "status": "error",
                "custom_id": "j1",
                "error": {"code": "internal", "message": "x", "retryable": True},
            }
        if x["custom_id"] == "j2":
            x = {
                "type": "result",
                "id": x["id"],
                "status": "error",
                "custom_id": "j2",
                "error": {"code": "invalid_request", "message": "x", "retryable": False},
            }
        kept.append(x)
    write_jsonl(out, kept)
    second = await batch(prefix, inp, out)
    assert second.skipped_already_done == 3 and second.retried == 1 and second.ok == 1
    got = {}
    for x in lines(out):
        got.setdefault(x["custom_id"], []).append(x)
    assert {k: len(v) for k, v in got.items()} == {"j0": 1, "j1": 1, "j2": 1, "j3": 1}
    assert got["j1"][0]["status"] == "ok" and got["j1"][0]["replayed"] is True  # the key's stored result
    assert got["j2"][0]["status"] == "error"


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


async def test_the_same_csv_with_other_options_is_a_new_run_and_the_same_options_resume(harness, prefix, tmp_path):
    """Keys cover what the job asks: the same CSV with a new --template or
    --max-tokens runs (never idempotency_key_reused, even on a restarted
    worker over the same SQLite store), and the same options again are
    answered from the store (replayed) without the engine."""
    from jaxserve.worker.store.sqlite import SqliteStore

    db = tmp_path / "store.sqlite3"
    eng = EchoEngine(step_s=0.001)
    w = await harness.start(eng, store=SqliteStore(db))
    docs = write_csv(tmp_path / "docs.csv", [{"doc_id": f"r{i}", "text": f"body {i}"} for i in range(3)])
    first = await batch(prefix, docs, tmp_path / "o1", template="A: {{ text }}", id_column="doc_id", max_tokens=2)
    assert first.ok == 3 and first.exit_status == 0
    await w.shutdown(drain_timeout=0.5)
    eng = EchoEngine(step_s=0.001)
    await harness.start(eng, store=SqliteStore(db))  # restarted: the store kept every key's result
    runs = [
        ("o2", {"template": "B: {{ text }}", "max_tokens": 2}, "B: body 1", 2),
        ("o3", {"template": "A: {{ text }}", "max_tokens": 3}, "A: body 1", 3),
    ]
    for out, options, prompt, n in runs:
        summary = await batch(prefix, docs, tmp_path / out, id_column="doc_id", **options)
        assert summary.ok == 3 and summary.errors == {} and summary.exit_status == 0, summary
        got = {x["custom_id"]: x for x in lines(tmp_path / out)}
        assert got["r1"]["text"] == expected_completion(prompt, n)[0] and not got["r1"].get("replayed")
    assert sum(eng.add_count.values()) == 6
    again = await batch(prefix, docs, tmp_path / "o4", template="A: {{ text }}", id_column="doc_id", max_tokens=2)
    assert again.ok == 3 and all(x["replayed"] for x in lines(tmp_path / "o4"))  # unchanged: resumed
    assert sum(eng.add_count.values()) == 6
    assert {x["id"] for x in lines(tmp_path / "o4")} == {x["id"] for x in lines(tmp_path / "o1")}


async def test_a_rerun_into_the_same_out_replaces_the_lines_of_changed_jobs(harness, prefix, tmp_path):
    """OUT answers a request only for the job it asked: a rerun with
    another template replaces every line (in both formats), a rerun with the
    same options skips them all."""
    eng = EchoEngine(step_s=0.001)
    await harness.start(eng)
    docs = write_csv(tmp_path / "docs.csv", [{"doc_id": f"r{i}", "text": f"body {i}"} for i in range(3)])
    inp = write_jsonl(
        tmp_path / "in.jsonl", [openai_line(f"c{i}", "/v1/completions", {"prompt": f"p {i}"}) for i in range(2)]
    )
    for path, opts in ((docs, {"id_column": "doc_id"}), (inp, {})):
        out = tmp_path / f"{path.name}.out"
        assert (await batch(prefix, path, out, template="A: {{ text }}", max_tokens=2, **opts)).ok
        first = {x["custom_id"]: x["id"] for x in lines(out)}
        same = await batch(prefix, path, out, template="A: {{ text }}", max_tokens=2, **opts)
        assert same.skipped_already_done == len(first) and same.replaced == 0 and same.ok == 0
        changed = await batch(prefix, path, out, template="B: {{ text }}", max_tokens=3, **opts)
        assert changed.replaced == len(first) and changed.ok == len(first) and changed.exit_status == 0
        now = {x["custom_id"]: x for x in lines(out)}
        assert set(now) == set(first) and all(now[c]["id"] != first[c] for c in first)  # one line each
    assert now["c1"]["response"]["body"]["choices"][0]["text"] == expected_completion("p 1", 3)[0]


async def test_a_batch_exits_non_zero_when_every_line_failed_or_one_is_unknown_model_or_invalid(
    harness, prefix, tmp_path
):
    await harness.start(EchoEngine(step_s=0.001, model_name="echo"))
    inp = write_jsonl(tmp_path / "long.jsonl", [{"id": f"j{i}", "prompt": "word " * 600} for i in range(2)])
    failed = await batch(prefix, inp, tmp_path / "o1")  # every line context_length_exceeded
    assert failed.ok == 0 and failed.errors == {"context_length_exceeded": 2} and failed.exit_status == 1
    mixed = [{"id": "ok", "prompt": "fine", "max_tokens": 2}]
    for code, line in (
        ("unknown_model", {"id": "m", "prompt": "x", "model": "gpt-9"}),
        ("invalid_request", {"id": "t", "prompt": "x", "temperature": 7}),
    ):
        inp = write_jsonl(tmp_path / f"{code}.jsonl", [*mixed, line])
        summary = await batch(prefix, inp, tmp_path / f"{code}.out")
        assert summary.ok == 1 and summary.errors == {code: 1} and summary.bad_lines == 0, summary
        assert summary.exit_status == 1
    fine = write_jsonl(tmp_path / "fine.jsonl", mixed)
    assert (await batch(prefix, fine, tmp_path / "fine.out")).exit_status == 0


async def test_the_cli_exits_1_when_every_row_failed(harness, prefix, tmp_path):
    from click.testing import CliRunner

    from jaxserve.cli.batch_command import batch as batch_command

    await harness.start(EchoEngine(step_s=0.001))
    docs = write_csv(tmp_path / "docs.csv", [{"doc_id": f"r{i}", "text": "word " * 600} for i in range(2)])
    args = [str(docs), "-o", str(tmp_path / "out"), "--prefix", prefix, "--amqp-url", AMQP_URL, "--no-progress"]
    args += ["--template", "{{ text }}", "--id-column", "doc_id", "--idle-timeout", "20"]
    result = await asyncio.to_thread(CliRunner().invoke, batch_command, args)
    assert result.exit_code == 1, result.output
    assert '"context_length_exceeded": 2' in result.output


async def test_response_cache_answers_a_second_key_without_the_engine(harness, client):
    eng = EchoEngine(step_s=0.001)
    w = await harness.start(eng)
    a = await client.submit("the same greedy job", max_tokens=5, temperature=0, timeout=10)
    b = await client.submit("the same greedy job", max_tokens=5, temperature=0, timeout=10)
    assert a.ok and not a.cached and b.cached and b.text == a.text and b.id != a.id
    assert eng.add_count[a.id] == 1 and eng.add_count[b.id] == 0 and w.stats["cache_hits"] == 1
    c = await client.submit("the same greedy job", max_tokens=5, temperature=0, cache=False, timeout=10)
    assert not c.cached and eng.add_count[c.id] == 1
    sampled = [await client.submit("a sampled job", max_tokens=5, temperature=0.9, timeout=10) for _ in range(2)]
    assert not any(r.cached for r in sampled)  # not deterministic: never cached
    labelled = [await client.submit("classify me", labels=["x", "y"], timeout=10) for _ in range(2)]
    assert not labelled[0].cached and labelled[1].cached and labelled[1].labels == labelled[0].labels


async def test_identical_documents_are_computed_once_per_run(harness, prefix, tmp_path):
    eng = EchoEngine(step_s=0.001)
    await harness.start(eng)
    docs = ["same text"] * 5 + ["other text"] * 2
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": f"d{i}", "prompt": t, "max_tokens": 3, "temperature": 0, "cache": False} for i, t in enumerate(docs)],
    )
    out = tmp_path / "out.jsonl"
    summary = await batch(prefix, inp, out)
    assert summary.ok == 7 and summary.deduplicated == 5
    assert sum(eng.add_count.values()) == 2
    got = {x["custom_id"]: x["text"] for x in lines(out)}
    assert len(got) == 7 and got["d0"] == got["d4"] == expected_completion("same text", 3)[0]
