"""Batch calibration of label scores: each label's mean score over a run's
documents is taken off before the pick.

Why: a small model prefers some labels whatever the document says. In the
chat form, SmolLM2-135M-Instruct answers "politics" for 221 of the 240
documents of ``benchmarks/data/topics.jsonl``. Content-free calibration
(the job field ``calibrate``, done by the worker) estimates that preference
from one input with the document removed; batch calibration estimates it
from the documents themselves: for every group of lines scored against the
same labels, a label's offset is its mean log-probability (log-softmax over
the label set) over the group, and each line's label is the argmax of its
scores minus the offsets. It is the log-space variant of Zhou et al. 2023
("Batch Calibration"), which divides by the mean probability instead; on
that set the log-space mean scored 80.8 % on the half the method was chosen
on and 77.5 % on the other (``benchmarks/classify_accuracy.py``, method
``batch-calibrated``; the probability-space mean 80.0 / 80.0 %; content-free
calibration alone 70.0 / 68.3 %).

A per-label constant added to every line (as content-free calibration's
offsets are) cancels out, so batch calibration gives the same picks with
or without ``calibrate``; the worker's content-free calibration still
serves runs too small to estimate the offsets from (fewer than
:data:`MIN_DOCUMENTS` lines in a group are left as the worker scored them).

Deterministic for a given output file: ``jaxserve batch`` applies it after
its run to every label line of OUT (:func:`calibrate_file`), from each
line's ``labels[].logprob`` (the worker's scores, never rewritten), so a
resumed run recomputes it over the old lines and the new alike. Each
calibrated line gets the calibrated pick as its text, each label's ``prob``
recomputed from the calibrated scores, and ``label_calibration``
``{"method": "batch", "documents": n}`` next to its ``labels``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from jaxserve.engine import scoring

#: fewest lines scored against one label set for their offsets to be
#: estimated; smaller groups keep the worker's pick
MIN_DOCUMENTS = 16


def _log_softmax(row: Sequence[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


def offsets(rows: Sequence[Sequence[float]]) -> list[float]:
    """Each label's mean log-probability over ``rows`` (one row of label
    scores per document, normalized over the labels first)."""
    if not rows:
        raise ValueError("batch calibration needs at least one row of scores")
    width = len(rows[0])
    sums = [0.0] * width
    for row in rows:
        if len(row) != width:
            raise ValueError(f"rows of {len(row)} and {width} label scores in one group")
        for k, v in enumerate(_log_softmax(row)):
            sums[k] += v
    return [s / len(rows) for s in sums]


def calibrated(row: Sequence[float], offs: Sequence[float]) -> tuple[int, list[float]]:
    """The pick (index of the best label, the first on a tie) and each
    label's probability over the label set, from scores minus offsets: the
    worker's own arithmetic for calibration offsets
    (:func:`jaxserve.engine.scoring.combine` and ``best``). The scores are
    already normalized, which ``"sum"`` leaves as they are (the token
    counts, 1 here, are not read)."""
    names = [str(k) for k in range(len(row))]
    scored = scoring.combine(names, row, [1] * len(row), "sum", offs)
    return int(scoring.best(scored).label), [x.prob for x in scored]


@dataclasses.dataclass
class CalibrationSummary:
    groups: int = 0  # label sets calibrated
    documents: int = 0  # lines calibrated
    changed: int = 0  # lines whose pick the calibration changed
    too_few: int = 0  # label lines left alone: their group had fewer than MIN_DOCUMENTS

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _label_view(rec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]] | None:
    """Where an ok label line keeps its labels and its pick: ``(container,
    holder, labels)``, the labels at ``container["labels"]`` and the pick at
    ``holder["text"]`` (``["content"]`` for a chat message); None for any
    other line. Both output formats: a jaxserve result line, and an
    OpenAI Batch output line (``jaxserve.batch.openai_format``)."""
    if "response" in rec:  # OpenAI Batch
        body = ((rec.get("response") or {}).get("body")) or {}
        labels, choices = body.get("labels"), body.get("choices") or []
        if not labels or not choices or rec.get("error") is not None:
            return None
        choice = choices[0]
        holder = choice.get("message") if isinstance(choice.get("message"), dict) else choice
        return body, holder, labels
    labels = rec.get("labels")
    if not labels or rec.get("status") != "ok":
        return None
    return rec, rec, labels


def _scores(labels: list[dict[str, Any]]) -> list[float] | None:
    """A line's label scores, or None when any is not a finite number (a
    line written by something else is left alone, never a crash)."""
    out = []
    for x in labels:
        v = x.get("logprob") if isinstance(x, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        out.append(float(v))
    return out


def _pick_key(holder: dict[str, Any]) -> str:
    """Where a holder keeps its pick: a chat message's ``content``, else ``text``."""
    return "content" if "role" in holder else "text"


def calibrate_records(
    records: Sequence[dict[str, Any] | None], min_documents: int = MIN_DOCUMENTS
) -> CalibrationSummary:
    """Batch-calibrate the label lines among ``records`` in place (lines of
    other kinds, and None for unreadable ones, are left alone)."""
    # per label set: each line's (container, holder, labels, scores)
    groups: dict[tuple[str, ...], list[tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], list[float]]]] = {}
    for rec in records:
        view = None if rec is None else _label_view(rec)
        scores = None if view is None else _scores(view[2])
        if view is None or scores is None:
            continue
        key = tuple(str(x.get("label")) for x in view[2])
        groups.setdefault(key, []).append((*view, scores))
    summary = CalibrationSummary()
    for names, members in groups.items():
        if len(members) < min_documents:
            summary.too_few += len(members)
            continue
        offs = offsets([scores for *_, scores in members])
        summary.groups += 1
        for container, holder, labels, scores in members:
            best, probs = calibrated(scores, offs)
            if holder.get(_pick_key(holder)) != names[best]:
                summary.changed += 1
            holder[_pick_key(holder)] = names[best]
            for x, p in zip(labels, probs, strict=True):
                x["prob"] = p
            container["label_calibration"] = {"method": "batch", "documents": len(members)}
            summary.documents += 1
    return summary


def calibrate_file(path: str | Path, min_documents: int = MIN_DOCUMENTS) -> CalibrationSummary:
    """Batch-calibrate every label line of an output file, rewriting it
    (atomically) when any line changed; the lines it did not change are
    kept byte for byte."""
    path = Path(path)
    if not path.exists():
        return CalibrationSummary()
    raw = [line for line in path.read_bytes().splitlines() if line.strip()]
    records: list[dict[str, Any] | None] = []
    for line in raw:
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            rec = None
        records.append(rec if isinstance(rec, dict) else None)
    before = [None if r is None else orjson.dumps(r) for r in records]
    summary = calibrate_records(records, min_documents)
    after = [None if r is None else orjson.dumps(r) for r in records]
    if after != before:
        lines = [a if a is not None and a != b else line for a, b, line in zip(after, before, raw, strict=True)]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(x + b"\n" for x in lines))
        os.replace(tmp, path)
    return summary
