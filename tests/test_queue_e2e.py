"""End-to-end queue tests: worker and CLI as subprocesses, cut connections,
the CLI commands, and (when the engine imports) the real engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from queue_support import AMQP_URL, EchoEngine, expected_completion, rabbitmqctl, wait_until
from queue_support import (
    read_jsonl as _lines,
)
from queue_support import (
    start_worker_process as _start_worker,
)
from queue_support import (
    stop_process as _stop,
)
from queue_support import (
    wait_log as _wait_log,
)
from queue_support import (
    worker_env as _env,
)

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_kill_9_worker_during_batch_then_fresh_worker(prefix, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    jobs = {}
    with open(inp, "w") as f:
        for i in range(48):
            prompt = f"job {i} says hello"
            if i % 2:  # OpenAI Batch API line
                key = f"req-{i}"
                f.write(
                    json.dumps(
                        {
                            "custom_id": key,
                            "method": "POST",
                            "url": "/v1/completions",
                            "body": {"model": "echo", "prompt": prompt, "max_tokens": 20},
                        }
                    )
                    + "\n"
                )
            else:
                key = f"plain-{i}"
                f.write(json.dumps({"id": key, "prompt": prompt, "max_tokens": 20}) + "\n")
            jobs[key] = prompt
    w1_log, w2_log = tmp_path / "w1.log", tmp_path / "w2.log"
    w1 = _start_worker(prefix, w1_log, "--engine-arg", "step_s=0.01")
    w2 = batch_proc = None
    try:
        _wait_log(w1_log, "worker_consuming")
        batch_cmd = [
            sys.executable,
            "-c",
            "from jaxserve.cli.queue_commands import batch; batch()",
            str(inp),
            "-o",
            str(out),
            "--prefix",
            prefix,
            "--amqp-url",
            AMQP_URL,
            "--no-progress",
            "--idle-timeout",
            "60",
        ]
        batch_proc = subprocess.Popen(batch_cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        end = time.monotonic() + 60
        while len(_lines(out)) < 8 and time.monotonic() < end:
            time.sleep(0.02)
        assert len(_lines(out)) >= 8
        w1.kill()  # SIGKILL, mid-run: several jobs are unacked in its hands
        w1.wait(10)
        assert len(_lines(out)) < len(jobs)
        w2 = _start_worker(prefix, w2_log, "--engine-arg", "step_s=0.002")
        _, err = batch_proc.communicate(timeout=120)
        assert batch_proc.returncode == 0, err.decode()[-2000:]
        assert "batch summary" in err.decode()
        results = _lines(out)
        ids = [r["custom_id"] for r in results]
        assert sorted(ids) == sorted(jobs), "exactly one result per request"
        for r in results:
            want = expected_completion(jobs[r["custom_id"]], 20)[0]
            if r["custom_id"].startswith("req-"):  # OpenAI Batch line in, OpenAI Batch line out
                assert r["error"] is None and r["response"]["status_code"] == 200, r
                assert r["response"]["body"]["choices"][0]["text"] == want
            else:  # a jaxserve body in, a jaxserve result out, its key scoped to the file and the job
                assert r["status"] == "ok" and r["text"] == want, r
                assert f":{r['custom_id']}:" in r["id"]
        # the fresh worker picked up the jobs the killed one held
        assert "redelivered=True" in w2_log.read_text() or '"redelivered": true' in w2_log.read_text()
        # a rerun is resumable: nothing left to do, nothing appended
        rerun = subprocess.run(batch_cmd, cwd=REPO, env=_env(), capture_output=True, timeout=60)
        assert rerun.returncode == 0
        assert f'"skipped_already_done": {len(jobs)}' in rerun.stderr.decode()
        assert len(_lines(out)) == len(jobs)
    finally:
        for p in (batch_proc,):
            if p is not None and p.poll() is None:
                p.kill()
        for p in (w1, w2):
            if p is not None:
                _stop(p)


async def test_cut_connection_during_stream_loses_nothing(harness, client, prefix):
    eng = EchoEngine(step_s=0.02)
    w = await harness.start(eng, reconnect_interval=0.5)
    s = await client.stream("cut me off mid stream", max_tokens=120, timeout=60)
    other = await client.publish({"prompt": "a plain job", "max_tokens": 100}, queue="batch")
    got = []
    cut = False
    async for delta in s:
        got.append(delta)
        if len(got) == 10 and not cut:
            cut = True
            # The broker fault of the issue, as is: every connection of the
            # broker goes (worker consume+publish, client publish+replies).
            await asyncio.to_thread(rabbitmqctl, "close_all_connections", "test: connection cut")
    want = expected_completion("cut me off mid stream", 120)[0]
    assert "".join(got) == want == s.result.text
    r = await client.wait(other, timeout=30)
    assert r.ok and r.text == expected_completion("a plain job", 100)[0]
    # every connection comes back (a consumer whose queue had nothing left to
    # deliver may do so after both jobs ended, on a busy machine)
    names = ("reconnect_interactive", "reconnect_batch", "reconnect_publish")
    await wait_until(lambda: all(w.stats[n] >= 1 for n in names), timeout=20)
    assert eng.add_count[s.key] == 1 and eng.add_count[other] == 1  # never run twice
    # the redeliveries were fenced and acked: nothing left in the queues
    await wait_until(lambda: not w.runs, timeout=10)
    depths = await client.queue_depths()
    assert depths[f"{prefix}.interactive"]["messages"] == 0 and depths[f"{prefix}.batch"]["messages"] == 0
    assert depths[f"{prefix}.dead"]["messages"] == 0


def test_sigterm_drains_in_flight_work(prefix, tmp_path):
    from jaxserve.client import Client

    log = tmp_path / "w.log"
    w = _start_worker(prefix, log, "--engine-arg", "step_s=0.02", "--drain-timeout", "20")
    try:
        _wait_log(log, "worker_consuming")
        with Client(AMQP_URL, prefix=prefix) as c:
            key = c.publish({"prompt": "finish me", "max_tokens": 40})
            _wait_log(log, "job_start")
            w.send_signal(signal.SIGTERM)
            r = c.wait(key, timeout=30)
            assert r.ok and r.text == expected_completion("finish me", 40)[0]
            assert w.wait(20) == 0
            c._run(c._ac.delete_reply_queue())
        text = log.read_text()
        assert "worker_draining" in text and "worker_stopped" in text
    finally:
        _stop(w)


async def test_cli_submit_and_status(harness, prefix):
    from jaxserve.cli.queue_commands import status, submit

    await harness.start(EchoEngine())
    runner = CliRunner()
    base = ["--prefix", prefix, "--amqp-url", AMQP_URL]

    def run(cmd, args):
        return runner.invoke(cmd, args, catch_exceptions=False)

    res = await asyncio.to_thread(run, submit, ["hello there world", *base, "--max-tokens", "5"])

    # (the in-process worker's default structlog output lands in the same capture)
    def last(r):
        return [ln for ln in r.output.strip().splitlines() if "[info" not in ln and "[warning" not in ln][-1]

    assert res.exit_code == 0 and last(res).strip() == expected_completion("hello there world", 5)[0].strip()
    res = await asyncio.to_thread(run, submit, ["hi you", *base, "--max-tokens", "4", "--stream", "--chat"])
    assert res.exit_code == 0 and res.output.strip()
    res = await asyncio.to_thread(run, submit, ["x", *base, "--json", "--model", "nope"])
    assert res.exit_code == 1 and json.loads(last(res))["error"]["code"] == "unknown_model"
    res = await asyncio.to_thread(run, status, [*base, "--json", "--no-broker-details"])
    depths = json.loads(last(res))
    assert depths[f"{prefix}.interactive"]["consumers"] == 1 and depths[f"{prefix}.dead"]["messages"] == 0


async def test_cli_chat_streams_to_terminal(harness, prefix):
    from jaxserve.cli.queue_commands import chat

    await harness.start(EchoEngine())
    runner = CliRunner()
    res = await asyncio.to_thread(
        runner.invoke,
        chat,
        ["--prefix", prefix, "--amqp-url", AMQP_URL, "--max-tokens", "3"],
        input="first line\nsecond\n\n",
        catch_exceptions=False,
    )
    assert res.exit_code == 0
    assert res.output.count("\n") >= 2


def _real_engine_available() -> tuple[bool, str]:
    try:
        import jaxserve.engine.engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return False, f"jaxserve.engine.engine does not import yet: {exc!r}"
    return True, ""


_ok, _why = _real_engine_available()


@pytest.mark.skipif(not _ok, reason=_why or "real engine unavailable")
@pytest.mark.skipif(os.environ.get("JAXSERVE_TEST_NO_REAL_ENGINE") == "1", reason="JAXSERVE_TEST_NO_REAL_ENGINE=1")
async def test_real_engine_end_to_end(harness, client):
    from jaxserve.worker.factory import build_engine

    eng = await asyncio.to_thread(build_engine, "tiny", max_num_seqs=4, seed=0)
    w = await harness.start(eng)
    s = await client.stream("Hello, my name is", max_tokens=8, temperature=0.0, timeout=300)
    text = "".join([d async for d in s])
    assert s.result.ok and text == s.result.text and s.result.usage.completion_tokens >= 1
    r = await client.submit(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0, timeout=300)
    assert r.ok
    again = await client.submit(
        messages=[{"role": "user", "content": "hi"}], key=r.id, max_tokens=4, temperature=0.0, timeout=60
    )
    assert again.replayed and again.text == r.text
    reused = await client.submit(messages=[{"role": "user", "content": "hi"}], key=r.id, max_tokens=5, timeout=60)
    assert reused.error.code == "idempotency_key_reused"
    # label scoring through the queue: the most probable label, every label's
    # logprob and prob, prompt + label tokens in usage
    scored = await client.submit("The weather today is", labels=["sunny", "rainy and cold"], timeout=120)
    assert scored.ok and scored.text in ("sunny", "rainy and cold") and scored.finish_reason == "stop"
    assert [x.label for x in scored.labels] == ["sunny", "rainy and cold"]
    assert abs(sum(x.prob for x in scored.labels) - 1.0) < 1e-9 and scored.usage.completion_tokens == 0
    best = max(scored.labels, key=lambda x: x.logprob)
    assert scored.text == best.label
    # the worker counts a job once its delivery is acked, just after the
    # result the client already holds went out
    await wait_until(lambda: w.stats["done_ok"] >= 3, timeout=10)
    assert w.stats["done_ok"] == 3
    from prometheus_client import generate_latest

    scraped = generate_latest(w.served.metrics.registry).decode()
    assert 'jaxserve_jobs_total{model_name="tiny",outcome="ok",queue="interactive"} 3.0' in scraped
    assert 'jaxserve_jobs_total{model_name="tiny",outcome="replayed",queue="interactive"} 1.0' in scraped
    assert 'jaxserve_time_to_first_token_seconds_count{model_name="tiny",queue="interactive"} 2.0' in scraped
