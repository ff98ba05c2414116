"""``jaxserve loadtest`` for a two-model deployment: every job names its
fallback models, each result's ``served_model``, ``degraded`` and
``usage.cost`` are recorded per job and summed per level (share served by
each model and by a fallback, cost), and a second run is drawn beside a
first one. The runs use a real broker and an echo worker subprocess; the
re-routing itself is the worker's (``jaxserve.worker.routing``)."""

from __future__ import annotations

import json
import subprocess
import sys

import orjson
import pytest

from jaxserve.loadtest.report import plot_runs, served_table, summarize_level
from jaxserve.loadtest.runner import JobRecord, classify
from jaxserve.loadtest.workload import Workload, default_kinds
from jaxserve.wire.messages import decode_reply
from queue_support import REPO, start_worker_process, stop_process, wait_log, worker_env

pytestmark = pytest.mark.timeout(120)

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


def _result(key: str, served: str, degraded: list[str] | None, cost: float | None, completion: int = 10):
    usage: dict = {"prompt_tokens": 5, "completion_tokens": completion}
    if cost is not None:
        usage["cost"] = {"amount": cost, "currency": "EUR"}
    body = {
        "type": "result",
        "id": key,
        "status": "ok",
        "text": "x",
        "finish_reason": "length",
        "usage": usage,
        "timings": {},
        "model": served,
        "served_model": served,
    }
    if degraded:
        body["degraded"] = degraded
    return decode_reply(orjson.dumps(body))


def _record(i: int, result) -> JobRecord:
    rec = JobRecord(i, f"k{i}", "chat", "interactive", True, False, 0.0)
    classify(rec, result)
    return rec


def test_each_job_records_who_served_it_and_what_it_cost():
    rec = _record(0, _result("k0", "small", ["model"], 0.00025))
    assert (rec.status, rec.served_model, rec.degraded) == ("ok", "small", ["model"])
    assert (rec.cost, rec.cost_currency) == (0.00025, "EUR")
    rec = _record(1, _result("k1", "big", None, None))
    assert (rec.served_model, rec.degraded, rec.cost) == ("big", None, None)
    assert rec.to_dict()["served_model"] == "big"


def test_a_level_counts_the_share_served_by_each_model_and_its_cost():
    records = [_record(i, _result(f"k{i}", "big", None, 0.001)) for i in range(6)]
    records += [_record(6 + i, _result(f"k{6 + i}", "small", ["model"], 0.0001)) for i in range(3)]
    records += [_record(9, _result("k9", "big", ["max_tokens"], 0.0005))]
    refused = JobRecord(10, "k10", "chat", "interactive", True, False, 0.0, status="rejected", code="overloaded")
    entry = summarize_level([*records, refused], mode="closed", level={"concurrency": 4}, duration_s=1, elapsed_s=1)
    assert entry["served_by_model"] == {"big": 7, "small": 3}
    assert entry["served_share"] == {"big": 0.7, "small": 0.3}
    assert (entry["served_by_fallback"], entry["fallback_share"], entry["degraded_jobs"]) == (3, 0.3, 4)
    assert entry["cost_total"] == pytest.approx(6 * 0.001 + 3 * 0.0001 + 0.0005)
    assert entry["cost_currency"] == "EUR"
    assert entry["rejections_by_code"]["overloaded"] == 1


def test_fallback_models_go_into_every_job_and_probe():
    workload = Workload(default_kinds(), {"chat": 1.0}, extra_params={"model": "big", "fallback_models": ["small"]})
    assert workload.next().body["fallback_models"] == ["small"]
    assert workload.probe(0).body["fallback_models"] == ["small"]
    assert workload.describe()["params"]["fallback_models"] == ["small"]


def test_two_runs_side_by_side(tmp_path):
    def level(c: int, ttft: float, overloaded: int, share: float) -> dict:
        return {
            "concurrency": c,
            "ttft_p95_s": ttft,
            "rejections_by_code": {"overloaded": overloaded},
            "fallback_share": share,
        }

    without = [level(2, 0.2, 0, 0.0), level(8, 0.9, 40, 0.0)]
    with_fb = [level(2, 0.2, 0, 0.0), level(8, 0.4, 1, 0.45)]
    path = plot_runs([("fallback", with_fb), ("no fallback", without)], tmp_path / "cmp.png", ttft_target_s=0.5)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _loadtest(prefix: str, out, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxserve", "loadtest", "--amqp-url", AMQP_URL, "--prefix", prefix]
    cmd += ["--output", str(out), "--no-progress", "--settle", "0.2", "--no-capacity-check", *args]
    return subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=90)


def test_loadtest_with_fallback_models_and_a_comparison_plot(prefix, tmp_path):
    log = tmp_path / "worker.log"
    proc = start_worker_process(prefix, log, "--store", "memory", "--engine-arg", "step_s=0.01")
    try:
        wait_log(log, "worker_consuming", timeout=60)
        common = ["--concurrency", "2", "--duration", "1.5", "--mix", "chat=1", "--cancel-share", "0"]
        first = _loadtest(prefix, tmp_path / "a", *common)
        assert first.returncode == 0, first.stdout + first.stderr
        second = _loadtest(
            prefix,
            tmp_path / "b",
            *common,
            "--fallback-models",
            "small",
            "--compare-with",
            str(tmp_path / "a"),
            "--ttft-target-s",
            "1",
        )
    finally:
        stop_process(proc)
    assert second.returncode == 0, second.stdout + second.stderr
    config = json.loads((tmp_path / "b" / "loadtest-config.json").read_text())
    assert config["label"] == "fallback to small"
    assert config["workload"]["params"]["fallback_models"] == ["small"]
    assert json.loads((tmp_path / "a" / "loadtest-config.json").read_text())["label"] == "no fallback"
    assert (tmp_path / "b" / "loadtest-compare.png").read_bytes()[:4] == b"\x89PNG"
    levels = json.loads((tmp_path / "b" / "loadtest.json").read_text())
    jobs = [json.loads(x) for x in (tmp_path / "b" / "loadtest-jobs.jsonl").read_text().splitlines()]
    ok = [j for j in jobs if j["status"] == "ok"]
    assert ok and all(j["served_model"] for j in ok)  # the one model served them all, with room to spare
    assert sum(levels[0]["served_by_model"].values()) == levels[0]["completed"] == len(ok)
    assert levels[0]["served_by_fallback"] == 0


def test_served_table_only_when_there_is_something_to_say():
    one = {"concurrency": 1, "served_by_model": {"big": 4}, "fallback_share": 0.0, "cost_total": None}
    assert served_table([one]) is None
    two = {"concurrency": 8, "served_by_model": {"big": 6, "small": 4}, "fallback_share": 0.4, "cost_total": 0.0123}
    two["cost_currency"] = "EUR"
    table = served_table([one, two])
    assert table is not None
    assert "| level | served by big | served by small | fallback share | cost |" in table
    assert "| c=1 | 4 | 0 | 0.0 % | - |" in table
    assert "| c=8 | 6 | 4 | 40.0 % | 0.0123 EUR |" in table
