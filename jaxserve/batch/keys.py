"""The idempotency key of each job a batch producer publishes.

A worker keeps every key's result beside a fingerprint of the body that
produced it, and answers a key seen again with another body
``idempotency_key_reused``. A batch key made of the file and the line's id
alone names the *request*, not the *job*: the same CSV run again with a new
``--template`` or ``--max-tokens`` reused every key, and every row came
back ``idempotency_key_reused`` (with the SQLite store, across restarts
too). So a key also carries a digest of the job as published: every body
field that can change its answer (prompt or messages as the template
filled them, model, sampling, ``max_tokens``, stop, labels and their
settings, the output constraint), and none of those that only say how or
for whom it runs (``stream``, ``tenant``, ``priority``, ``deadline``,
``cache``). A changed run gets new keys and runs; an unchanged one finds
its keys answered and resumes (``tests/test_batch_classification.py``).

:func:`job_key` is the one derivation: ``jaxserve batch`` calls it for every
line of a file, and any other producer that turns a batch of requests into
jobs (an OpenAI Batch upload, say) should call it too, so the same request
becomes the same job whichever way it came in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

#: body fields that change how or for whom a job runs, never what it answers
NOT_MEANING = frozenset({"stream", "stream_options", "tenant", "priority", "deadline", "cache", "user", "metadata"})
#: AMQP's message_id is a short string: 255 bytes
MAX_KEY_BYTES = 255


def job_digest(body: Mapping[str, Any] | None) -> str:
    """16 hex digits naming what ``body`` asks for (key order and the
    fields in :data:`NOT_MEANING` do not count); "" for no body (a line
    that could not be read)."""
    if body is None:
        return ""
    meaning = {k: v for k, v in body.items() if k not in NOT_MEANING}
    raw = orjson.dumps(meaning, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
    return hashlib.sha256(raw).hexdigest()[:16]


def job_key(scope: str, custom_id: str, body: Mapping[str, Any] | None) -> str:
    """The key of request ``custom_id`` of the batch ``scope`` (a file's
    content hash, ``--batch-id``, an uploaded batch's id) asking for
    ``body``: ``<scope>:<custom_id>:<digest>``. A custom_id too long for
    AMQP's 255-byte message_id is replaced by a hash of itself."""
    digest = job_digest(body)
    tail = f":{digest}" if digest else ""
    key = f"{scope}:{custom_id}{tail}"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        cid = "id-" + hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        key = f"{scope}:{cid}{tail}"
    return key


def line_id(custom_id: str, body: Mapping[str, Any] | None) -> str:
    """The ``id`` of an OpenAI Batch output line (``batch_req_...``): the
    same for the same request asking for the same job, so a resumed run
    can tell a line that answers its job from one a run with other options
    wrote (a jaxserve line tells it by its ``id``, the key)."""
    raw = f"{custom_id}\n{job_digest(body)}".encode("utf-8", "surrogatepass")
    return "batch_req_" + hashlib.sha256(raw).hexdigest()[:24]


def answers(line: Mapping[str, Any], custom_id: str, body: Mapping[str, Any] | None) -> bool:
    """Whether an output line (either format) answered ``custom_id`` asking
    for ``body``, rather than the same request with other options."""
    ident = line.get("id")
    if not isinstance(ident, str):
        return False
    if ident.startswith("batch_req_"):
        return ident == line_id(custom_id, body)
    digest = job_digest(body)
    return ident.endswith(f":{digest}") if digest else ident.endswith(f":{custom_id}")


__all__ = ["MAX_KEY_BYTES", "NOT_MEANING", "answers", "job_digest", "job_key", "line_id"]
