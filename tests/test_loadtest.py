"""``jaxserve loadtest`` against a real broker and a worker subprocess
(EchoEngine: ``step_s`` per step, one word per step, exactly ``max_tokens``
words per job), plus the measurement rules on synthetic records.

Nothing here asserts speed: only what the figures must be whatever the
machine (percentiles ordered, token counts inside the workload's ranges,
every cancel seen by the worker, the capacity back, rejections counted by
their code).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.loadtest.report import markdown_table, percentiles, summarize_level
from jaxserve.loadtest.runner import JobRecord, itl_samples, mark_rejections
from jaxserve.loadtest.workload import IntRange, Workload, default_kinds, parse_mix
from queue_support import REPO, rabbitmqctl, start_worker_process, stop_process, wait_log, worker_env

pytestmark = pytest.mark.timeout(120)

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


def _loadtest(prefix: str, out, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "jaxserve",
        "loadtest",
        "--amqp-url",
        AMQP_URL,
        "--prefix",
        prefix,
        "--output",
        str(out),
        "--no-progress",
        "--settle",
        "0.5",
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)


def _worker(prefix: str, log, *extra: str):
    proc = start_worker_process(prefix, log, "--store", "memory", "--engine-arg", "max_model_len=8192", *extra)
    try:
        wait_log(log, "worker_consuming", timeout=60)
    except BaseException:
        stop_process(proc)
        raise
    return proc


def _ordered(entry: dict, name: str) -> None:
    qs = [entry[f"{name}_p{p}_s"] for p in (50, 90, 95, 99)]
    assert None not in qs, (name, qs)
    assert qs == sorted(qs), (name, qs)
    assert qs[0] > 0


def test_loadtest_closed_loop_against_echo_worker(prefix, tmp_path):
    log, out = tmp_path / "worker.log", tmp_path / "out"
    proc = _worker(prefix, log, "--engine-arg", "step_s=0.01")
    try:
        res = _loadtest(prefix, out, "--concurrency", "1,2", "--duration", "3", "--cancel-share", "0.4")
    finally:
        stop_process(proc)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| c=1 |" in res.stdout and "| c=2 |" in res.stdout  # the markdown table

    levels = json.loads((out / "loadtest.json").read_text())
    assert [e["concurrency"] for e in levels] == [1, 2]
    jobs = [json.loads(line) for line in (out / "loadtest-jobs.jsonl").read_text().splitlines()]
    worker_log = log.read_text()
    events = [json.loads(line) for line in worker_log.splitlines() if line.startswith("{")]
    cancels_seen = {ev.get("key") for ev in events if ev.get("event") == "cancel_received"}
    cancelled_total = after_cancel_total = 0
    for i, e in enumerate(levels):
        assert e["requests"] > 0 and e["completed"] > 0
        for name in ("ttft", "itl", "e2e"):
            _ordered(e, name)
        assert e["output_tokens_per_s"] > 0
        assert e["rejected"] == 0 and e["rejections_by_code"] == {"queue_full": 0, "overloaded": 0, "rate_limited": 0}
        assert e["errors"] == 0 and e["rejections_begin"] is False
        mine = [j for j in jobs if j["level"] == i]
        assert len(mine) == e["requests"]
        ok = [j for j in mine if j["status"] == "ok"]
        assert e["output_tokens_total"] == sum(j["completion_tokens"] for j in ok)
        assert e["output_tokens_per_s"] == pytest.approx(e["output_tokens_total"] / e["elapsed_s"], rel=1e-3)
        for j in ok:
            assert j["e2e_s"] > 0
            if j["stream"]:
                assert 0 < j["ttft_s"] <= j["e2e_s"]
            else:
                assert j["ttft_s"] is None
        # EchoEngine answers exactly max_tokens words: the workload's ranges
        chat, summ = e["by_kind"]["chat"], e["by_kind"]["summarize"]
        assert chat["queue"] == "interactive" and chat["stream"] is True
        assert summ["queue"] == "batch" and summ["stream"] is False and summ["ttft_p50_s"] is None
        if chat["completed"]:
            assert 16 <= chat["output_tokens_min"] <= chat["output_tokens_max"] <= 32
        if summ["completed"]:
            assert 64 <= summ["output_tokens_min"] <= summ["output_tokens_max"] <= 128
        # one token per EchoEngine step of 10 ms: a per-token ITL below the
        # step would mean the chunk's tokens were miscounted
        assert e["itl_p50_s"] >= 0.008
        c = e["cancellations"]
        assert c["cancelled"] + c["finished_before_cancel"] == c["sent"]
        assert c["sent"] + c["no_chunk_before_end"] == c["planned"]
        for j in mine:
            if j["status"] == "cancelled":
                assert j["cancel_planned"] and j["cancel_sent_s"] is not None
                assert j["key"] in cancels_seen  # the worker got this job's cancel
        cancelled_total += c["cancelled"]
        if c["cancelled"]:
            after_cancel_total += c["completed_after_first_cancel"]
        cap = e["capacity"]
        assert cap["queues_drained"] and cap["probe_ok"] == cap["probe_jobs"] > 0
        assert e["capacity_back"] is True
    assert cancelled_total > 0
    # a cancelled job gives its capacity back: jobs started after a level's
    # first cancel complete (summed over the levels: a level whose first
    # cancel lands at its very end has no time left to start another job)
    assert after_cancel_total > 0

    png = (out / "loadtest.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(str(out / "loadtest.png"))
    assert img.shape[0] > 200 and img.shape[1] > 200
    config = json.loads((out / "loadtest-config.json").read_text())
    assert config["workload"]["mix"] == {"chat": 0.8, "summarize": 0.2}
    # the load test removed its reply queue
    assert not [q for q in rabbitmqctl("list_queues", "name").split() if q.startswith(f"{prefix}.reply.")]


def test_loadtest_counts_rejections_by_code(prefix, tmp_path):
    """A worker that refuses in all three ways, each made certain rather
    than a race, and the load test counting each under its code.

    One running sequence, a prefetch of 3 and an admission budget of 1
    token: at 16 clients one job runs, the next waits in the engine holding
    its prompt in the budget, so every other delivery is ``overloaded`` while
    the two held jobs and the third slot's refusals leave the 2-message
    interactive queue full (QueueFull in the client). A tenant limit is
    judged before admission and a refused job gives its request back, so
    it is proved with a second load test as the tenant ``strict`` (one
    request, no refill), whose every job after the first is
    ``rate_limited``. At one client the worker refuses nothing."""
    limits = tmp_path / "limits.yaml"
    limits.write_text("tenants:\n  strict: {requests_per_s: 0.001, burst: 1}\n")
    log, out, strict_out = tmp_path / "worker.log", tmp_path / "out", tmp_path / "strict"
    proc = _worker(
        prefix,
        log,
        "--engine-arg",
        "step_s=0.05",
        "--engine-arg",
        "max_num_seqs=1",
        "--interactive-prefetch",
        "3",
        "--interactive-max-length",
        "2",
        "--max-queued-tokens",
        "1",
        "--limits",
        str(limits),
    )
    try:
        common = ("--duration", "2", "--mix", "chat=1", "--no-broker-details")
        res = _loadtest(prefix, out, "--concurrency", "1,16", *common)
        strict = _loadtest(
            prefix, strict_out, "--concurrency", "2", "--tenant", "strict", "--no-capacity-check", *common
        )
    finally:
        stop_process(proc)
    assert res.returncode == 0, res.stdout + res.stderr
    first, second = json.loads((out / "loadtest.json").read_text())
    assert first["rejected"] == 0 and first["rejections_begin"] is False
    assert second["rejections_begin"] is True
    by_code = second["rejections_by_code"]
    assert by_code["queue_full"] > 0 and by_code["overloaded"] > 0 and by_code["rate_limited"] == 0, by_code
    assert second["rejected"] == sum(by_code.values())
    assert second["retry_after_p50_s"] is not None  # the worker's hint was read
    assert second["completed"] > 0 and second["capacity_back"] is True
    assert "(rejections begin)" in res.stdout
    assert (out / "loadtest.png").stat().st_size > 1000

    assert strict.returncode == 0, strict.stdout + strict.stderr
    (level,) = json.loads((strict_out / "loadtest.json").read_text())
    assert level["completed"] == 1, level
    assert level["rejections_by_code"]["rate_limited"] == level["rejected"] > 0, level["rejections_by_code"]


def test_loadtest_watches_the_queues_of_the_model_it_names(prefix, tmp_path):
    """``loadtest --model beta`` against a worker that serves beta on its own
    queues (not the deployment's default model): the preflight finds beta's
    consumer, every job is answered by beta, and the drain check between
    levels reads beta's queue, not the default one nobody consumes."""
    log, out = tmp_path / "beta.log", tmp_path / "out"
    proc = start_worker_process(
        prefix,
        log,
        "--store",
        "memory",
        "--engine-arg",
        "model_name=beta",
        "--engine-arg",
        "step_s=0.01",
        "--served-model-name",
        "beta",
        "--default-model",
        "alpha",
    )
    try:
        wait_log(log, "worker_consuming", timeout=60)
        res = _loadtest(prefix, out, "--concurrency", "2", "--duration", "2", "--mix", "chat=1", "--model", "beta")
    finally:
        stop_process(proc)
    assert res.returncode == 0, res.stdout + res.stderr
    (level,) = json.loads((out / "loadtest.json").read_text())
    assert level["completed"] > 0 and level["errors"] == 0 and level["rejected"] == 0
    assert level["served_by_model"] == {"beta": level["completed"]}
    assert level["capacity"]["queues_drained"] and level["capacity_back"] is True


def test_loadtest_without_a_worker_is_one_line_error(prefix, tmp_path):
    res = _loadtest(prefix, tmp_path / "out", "--concurrency", "1", "--duration", "1")
    assert res.returncode == 1
    assert "no queue" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out" / "loadtest.json").exists()


# ------------------------------------------------------- measurement rules
def test_itl_method():
    # 3 chunks at 0.1, 0.2, 0.4 s, 6 tokens: 2 tokens per chunk -> gaps / 2
    assert itl_samples([0.1, 0.2, 0.4], 6, 3) == pytest.approx([0.05, 0.1])
    # a final that filled in text counts as a delta: 6 tokens / 4 deltas
    assert itl_samples([0.1, 0.2, 0.4], 6, 4) == pytest.approx([0.1 / 1.5, 0.2 / 1.5])
    assert itl_samples([0.1], 6, 1) == [] and itl_samples([0.1, 0.2], 0, 2) == []


def _rec(
    i, status="ok", *, kind="chat", stream=True, ttft=None, e2e=None, tokens=None, chunk_times=(), code=None, **kw
):
    r = JobRecord(
        i,
        f"k{i}",
        kind,
        "interactive" if stream else "batch",
        stream,
        kw.pop("cancel", False),
        kw.pop("t_start", 0.0),
        status=status,
        code=code,
        ttft_s=ttft,
        e2e_s=e2e,
        completion_tokens=tokens,
        prompt_tokens=kw.pop("prompt", 10),
        **kw,
    )
    if chunk_times:
        r.itl_samples = itl_samples(list(chunk_times), tokens, len(chunk_times))
    return r


def test_summarize_level_exact():
    recs = [
        _rec(0, ttft=0.1, e2e=1.0, tokens=4, chunk_times=(0.1, 0.2, 0.3, 0.4)),  # ITL samples 0.1 x 3
        _rec(1, ttft=0.3, e2e=2.0, tokens=4, chunk_times=(0.3, 0.7)),  # 2 tokens/chunk: 0.2
        _rec(2, kind="summarize", stream=False, e2e=3.0, tokens=10, prompt=100),
        _rec(3, "rejected", code="queue_full"),
        _rec(4, "rejected", code="overloaded", retry_after_s=0.5),
        _rec(5, "cancelled", code="cancelled", cancel=True, cancel_sent_s=0.5, t_start=0.2),
        _rec(6, "error", code="internal"),
        _rec(7, ttft=0.2, e2e=1.5, tokens=2, chunk_times=(0.2, 0.25), t_start=0.6),
    ]
    e = summarize_level(recs, mode="closed", level={"concurrency": 2}, duration_s=5.0, elapsed_s=5.0)
    assert e["requests"] == 8 and e["completed"] == 4
    assert e["rejected"] == 2 and e["rejections_by_code"] == {"queue_full": 1, "overloaded": 1, "rate_limited": 0}
    assert e["errors_by_code"] == {"internal": 1}
    assert e["retry_after_p50_s"] == 0.5
    assert e["ttft_p50_s"] == pytest.approx(0.2)  # streaming ok jobs: 0.1, 0.3, 0.2
    assert e["ttft_p95_s"] == pytest.approx(float(np.percentile([0.1, 0.3, 0.2], 95)))
    assert e["e2e_p50_s"] == pytest.approx(1.75)  # 1.0, 2.0, 3.0, 1.5
    itl = [0.1, 0.1, 0.1, 0.2, 0.05]
    assert e["itl_samples"] == 5
    assert e["itl_p50_s"] == pytest.approx(float(np.percentile(itl, 50)))
    assert e["itl_p99_s"] == pytest.approx(float(np.percentile(itl, 99)))
    assert e["output_tokens_total"] == 20 and e["output_tokens_per_s"] == pytest.approx(4.0)
    assert e["requests_per_s"] == pytest.approx(0.8)
    assert e["cancellations"] == {
        "planned": 1,
        "sent": 1,
        "cancelled": 1,
        "finished_before_cancel": 0,
        "no_chunk_before_end": 0,
        "completed_after_first_cancel": 1,
    }
    assert e["by_kind"]["summarize"]["ttft_p50_s"] is None and e["by_kind"]["summarize"]["prompt_tokens_mean"] == 100
    assert percentiles([], "x")["x_p50_s"] is None
    levels = [dict(e, concurrency=1, rejected=0), e]
    assert mark_rejections(levels) == 1 and [x["rejections_begin"] for x in levels] == [False, True]
    assert "c=2 (rejections begin)" in markdown_table(levels)


def test_workload_mix_lengths_and_cancel_share():
    w = Workload(default_kinds(), parse_mix("chat=0.8,summarize=0.2"), seed=1, cancel_share=0.05)
    specs = [w.next() for _ in range(2000)]
    chat = [s for s in specs if s.kind == "chat"]
    assert 0.77 < len(chat) / len(specs) < 0.83
    for s in specs:
        assert s.body["cache"] is False and "stream" not in s.body  # the client's stream() adds it
        if s.kind == "chat":
            assert s.queue == "interactive" and s.stream and "messages" in s.body
            assert 3 <= s.prompt_words <= 12 and 16 <= s.body["max_tokens"] <= 32
            assert len(s.body["messages"][0]["content"].split()) == s.prompt_words
        else:
            assert s.queue == "batch" and not s.stream and "prompt" in s.body and not s.cancel
            assert 150 <= s.prompt_words <= 300 and 64 <= s.body["max_tokens"] <= 128
    planned = sum(s.cancel for s in specs)
    # 5 % of all jobs, taken from the streaming ones (every 1 / (0.05 / 0.8)-th)
    assert planned == int(len(chat) * (0.05 / 0.8) + 1e-9)
    assert abs(planned - 0.05 * len(specs)) <= 0.05 * len(specs) * 0.1 + 1
    with pytest.raises(ValueError):
        Workload(default_kinds(), parse_mix("chat=1,poetry=1"))
    with pytest.raises(ValueError):
        parse_mix("chat=-1")
    assert IntRange.parse("16-32") == IntRange(16, 32) and IntRange.parse("7") == IntRange(7, 7)
    with pytest.raises(ValueError):
        IntRange.parse("32-16")
