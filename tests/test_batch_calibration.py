"""Batch calibration of label scores (jaxserve.batch.calibration): the
offsets, both output formats, resumed runs, and ``jaxserve batch --labels``
end to end through the real broker (EchoEngine worker)."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import orjson
import pytest

from jaxserve.batch import calibration as C
from queue_support import AMQP_URL, EchoEngine

pytestmark = pytest.mark.timeout(120)


def _lsm(row):
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


def test_offsets_are_each_labels_mean_log_probability():
    rows = [[-1.0, -2.0, -4.0], [0.0, -3.0, -1.0]]
    want = [sum(_lsm(r)[k] for r in rows) / 2 for k in range(3)]
    assert C.offsets(rows) == pytest.approx(want)
    # a per-label constant on every row (content-free calibration) changes nothing
    shifted = [[x + c for x, c in zip(r, (5.0, -1.0, 0.5))] for r in rows]
    picks = [C.calibrated(r, C.offsets(rows))[0] for r in rows]
    assert [C.calibrated(r, C.offsets(shifted))[0] for r in shifted] == picks
    with pytest.raises(ValueError, match="rows of 2 and 3"):
        C.offsets([[0.0, 1.0, 2.0], [0.0, 1.0]])


def test_a_label_the_model_prefers_everywhere_stops_winning_everywhere():
    """Documents of three classes; the model adds +3 to label 0 whatever the
    document: raw argmax calls almost everything label 0, the calibrated
    pick recovers the classes."""
    rng = random.Random(0)
    gold, rows = [], []
    for i in range(300):
        g = i % 3
        row = [rng.gauss(0, 0.7) for _ in range(3)]
        row[g] += 2.0
        row[0] += 3.0  # the model's own preference
        gold.append(g)
        rows.append(row)
    raw = sum(max(range(3), key=lambda k: r[k]) == g for r, g in zip(rows, gold)) / len(rows)
    offs = C.offsets(rows)
    picks = [C.calibrated(r, offs)[0] for r in rows]
    cal = sum(p == g for p, g in zip(picks, gold)) / len(rows)
    assert raw < 0.5 and cal > 0.85, (raw, cal)
    _, probs = C.calibrated(rows[0], offs)
    assert sum(probs) == pytest.approx(1.0)


def _jaxserve_line(i: int, labels: list[str], scores: list[float]) -> dict:
    best = max(range(len(scores)), key=lambda k: scores[k])
    return {
        "id": f"k{i}",
        "custom_id": f"d{i}",
        "status": "ok",
        "text": labels[best],
        "labels": [{"label": x, "logprob": s, "prob": 0.0} for x, s in zip(labels, scores)],
    }


def _openai_line(i: int, labels: list[str], scores: list[float], chat: bool) -> dict:
    best = labels[max(range(len(scores)), key=lambda k: scores[k])]
    choice = {"index": 0, "message": {"role": "assistant", "content": best}} if chat else {"index": 0, "text": best}
    body = {"choices": [choice], "labels": [{"label": x, "logprob": s, "prob": 0.0} for x, s in zip(labels, scores)]}
    return {"id": f"batch_req_{i}", "custom_id": f"o{i}", "response": {"status_code": 200, "body": body}, "error": None}


def _biased(i: int) -> list[float]:
    # label "a" always ahead by 1; odd documents are really "b"
    return [0.0, -1.0 + (0.6 if i % 2 else 0.0)]


def test_records_in_both_formats_grouped_by_label_set():
    labels = ["a", "b"]
    recs: list = [_jaxserve_line(i, labels, _biased(i)) for i in range(20)]
    recs += [_openai_line(i, labels, _biased(i), chat=i % 4 < 2) for i in range(20)]
    recs += [_jaxserve_line(100 + i, ["x", "y"], [0.0, -1.0]) for i in range(3)]  # a group too small
    recs += [None, {"id": "e", "status": "error", "error": {"code": "internal"}}, {"status": "ok", "text": "hi"}]
    odd = _jaxserve_line(200, labels, [0.0, -1.0])
    odd["labels"][1]["logprob"] = None  # not written by a worker: left alone
    recs.append(odd)
    summary = C.calibrate_records(recs)
    assert summary.as_dict() == {"groups": 1, "documents": 40, "changed": 20, "too_few": 3}

    def pick(rec):
        if "response" in rec:
            choice = rec["response"]["body"]["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]
        return rec["text"]

    # before: every line said "a"; after: the odd ones say "b"
    assert [pick(r) for r in recs[:40]] == ["b" if (i % 20) % 2 else "a" for i in range(40)]
    for rec in recs[:40]:
        holder = rec["response"]["body"] if "response" in rec else rec
        assert holder["label_calibration"] == {"method": "batch", "documents": 40}
        assert sum(x["prob"] for x in holder["labels"]) == pytest.approx(1.0)
        assert [x["logprob"] for x in holder["labels"]] == _biased(int(rec["custom_id"][1:]))  # kept
    assert recs[40]["text"] == "x" and "label_calibration" not in recs[40]
    assert recs[-2] == {"status": "ok", "text": "hi"}
    assert recs[-1]["text"] == "a" and "label_calibration" not in recs[-1]


def test_a_file_is_rewritten_once_and_a_second_pass_changes_nothing(tmp_path):
    path = tmp_path / "out.jsonl"
    other = orjson.dumps({"id": "g", "status": "ok", "text": "generated"}) + b"\n"
    body = b"".join(orjson.dumps(_jaxserve_line(i, ["a", "b"], _biased(i))) + b"\n" for i in range(16))
    path.write_bytes(other + body + b'{"torn": \n')
    first = C.calibrate_file(path)
    assert first.changed == 8 and first.documents == 16
    once = path.read_bytes()
    assert once.startswith(other) and once.endswith(b'{"torn": \n')
    again = C.calibrate_file(path)
    assert again.changed == 0 and path.read_bytes() == once
    assert C.calibrate_file(tmp_path / "missing.jsonl").documents == 0


# -------------------------------------------------------- through the broker


def _run_cli(args: list[str]):
    from click.testing import CliRunner

    from jaxserve.cli.batch_command import batch

    return CliRunner().invoke(batch, args, catch_exceptions=False)


def _picks(path: Path) -> dict[str, tuple[str, list[float]]]:
    out = {}
    for raw in path.read_bytes().splitlines():
        rec = orjson.loads(raw)
        out[rec["custom_id"]] = (rec["text"], [x["logprob"] for x in rec["labels"]])
    return out


async def test_jaxserve_batch_labels_calibrates_over_the_run(harness, prefix, tmp_path):
    """The echo engine scores a label by its bytes missing from the prompt:
    documents holding "b" but no "a" are still called "a" (one byte against
    two), unless the run's mean takes label "a"'s advantage off."""
    await harness.start(EchoEngine(step_s=0.001))
    docs = tmp_path / "docs.jsonl"
    rows = [{"id": f"d{i}", "text": ("b" if i % 2 else "a") * (1 + i % 3)} for i in range(20)]
    docs.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    common = [
        "--labels",
        "a,bc",
        "--template",
        "{{ text }}",
        "--id-column",
        "id",
        "--label-prompt",
        "plain",
        "--no-calibrate",
    ]
    common += ["--amqp-url", AMQP_URL, "--prefix", prefix, "--no-progress", "--idle-timeout", "30"]
    raw_out, cal_out = tmp_path / "raw.jsonl", tmp_path / "cal.jsonl"
    res = await asyncio.to_thread(_run_cli, [str(docs), "-o", str(raw_out), "--no-batch-calibration", *common])
    assert res.exit_code == 0, res.output
    assert "batch_calibration" not in res.output
    res = await asyncio.to_thread(_run_cli, [str(docs), "-o", str(cal_out), *common])
    assert res.exit_code == 0, res.output
    assert '"batch_calibration": {"groups": 1, "documents": 20, "changed": 10, "too_few": 0}' in res.output
    raw, cal = _picks(raw_out), _picks(cal_out)
    assert {t for t, _ in raw.values()} == {"a"}  # the worker's own picks
    offs = C.offsets([s for _, s in cal.values()])
    for cid, (text, scores) in cal.items():
        assert scores == raw[cid][1]  # the worker's scores are kept
        assert text == ["a", "bc"][C.calibrated(scores, offs)[0]]
        assert text == ("bc" if int(cid[1:]) % 2 else "a")
