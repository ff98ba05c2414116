"""The suite's own record of every reply.

:class:`Collector` owns one durable classic queue per scenario
(``<prefix>.collector``, with ``x-expires``, so it survives a broker restart
and a dropped connection and goes away if the suite dies). Jobs the suite
publishes itself name it as ``reply_to``. It can also consume further queues
(``<prefix>.results``), and, for runs of ``jaxserve batch`` (whose reply
queue is its own), take copies from RabbitMQ's firehose tracer
(``amq.rabbitmq.trace``): ``publish.`` copies of every reply the worker
published, with ``routed_queues`` telling whether it reached a queue, and
``deliver.<prefix>.reply.#`` copies of what the batch command was handed.

Every message is recorded, duplicates included. A message redelivered to the
collector itself (its ack was lost when its connection dropped) is marked
``transport_dup`` when an identical body was already recorded from the same
source, so it does not count as the worker answering twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import time
from typing import Any

import aio_pika
import orjson

TAG_RE = re.compile(r"(?:ord|mal|hst|flood|cut|str|sig|res|ref|prb|job)-[0-9a-z]+(?:-[0-9]+)?")


@dataclasses.dataclass
class Rec:
    t: float
    source: str  # "<queue>" | "trace-publish" | "trace-deliver"
    kind: str  # result | chunk | job | other | garbage
    id: Any
    status: str | None = None
    code: str | None = None
    message: str | None = None
    text: str | None = None
    seq: int | None = None
    run: str | None = None
    correlation_id: str | None = None
    dest: str | None = None  # the routing key (trace) or the consumed queue
    routed: bool | None = None
    redelivered: bool = False
    transport_dup: bool = False
    replayed: bool = False
    digest: str = ""
    tokens: int | None = None  # a chunk's tokens; a result's usage.completion_tokens
    resumed: int | None = None  # a chunk's: of its tokens, those an earlier run saved

    def tag(self) -> str | None:
        """The suite's key of the job this reply belongs to: the result id,
        else the tag found in the id or correlation id."""
        for v in (self.id, self.correlation_id):
            if isinstance(v, str):
                m = TAG_RE.search(v)
                if m:
                    return m.group(0)
        return self.id if isinstance(self.id, str) else None


def _tokens(msg: dict[str, Any], kind: str) -> int | None:
    if kind == "chunk":
        value = msg.get("tokens")
    elif kind == "result":
        value = (msg.get("usage") or {}).get("completion_tokens") if isinstance(msg.get("usage"), dict) else None
    else:
        value = None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _s(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


class Collector:
    def __init__(self, url: str, prefix: str, *, expires_ms: int = 3_600_000) -> None:
        self.url = url
        self.prefix = prefix
        self.queue = f"{prefix}.collector"
        self.expires_ms = expires_ms
        self.records: list[Rec] = []
        self.last_event = time.monotonic()
        self.final_count: dict[str, int] = {}
        self.n_finals = 0
        # called synchronously, inside the consumer callback, for every final
        # counted (the sigkill scenario freezes the worker from here)
        self.on_final: Any = None
        self._seen: set[tuple[str, str]] = set()
        self._conn: aio_pika.abc.AbstractRobustConnection | None = None
        self._ch: aio_pika.abc.AbstractRobustChannel | None = None
        self.trace = False
        self.reconnects = 0

    async def start(self) -> Collector:
        self._conn = await aio_pika.connect_robust(
            self.url, reconnect_interval=0.5, client_properties={"connection_name": "faults-collector"}
        )
        self._conn.reconnect_callbacks.add(self._on_reconnect)
        self._ch = await self._conn.channel()
        await self._ch.set_qos(prefetch_count=2000)
        q = await self._ch.declare_queue(self.queue, durable=True, arguments={"x-expires": self.expires_ms})
        await q.consume(self._make_cb(self.queue))
        return self

    def _on_reconnect(self, *_: Any) -> None:
        self.reconnects += 1

    async def consume(self, name: str) -> None:
        """Also consume an existing queue (e.g. ``<prefix>.results``)."""
        assert self._ch is not None
        q = await self._ch.get_queue(name, ensure=True)
        await q.consume(self._make_cb(name))

    async def enable_trace(self) -> None:
        """Bind the collector queue to the firehose: publishes through the
        default exchange and deliveries from ``<prefix>.reply.*`` queues
        (the broker's ``trace_on`` is the caller's job)."""
        assert self._ch is not None
        q = await self._ch.get_queue(self.queue, ensure=False)
        await q.bind("amq.rabbitmq.trace", routing_key="publish.")
        await q.bind("amq.rabbitmq.trace", routing_key=f"deliver.{self.prefix}.reply.#")
        self.trace = True

    def _make_cb(self, source: str):
        async def cb(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            try:
                self._record(source, message)
            finally:
                await message.ack()

        return cb

    def _record(self, source: str, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        body = message.body
        now = time.monotonic()
        props: dict[str, Any] = {"correlation_id": message.correlation_id}
        dest = source
        routed = None
        redelivered = bool(message.redelivered)
        if message.exchange == "amq.rabbitmq.trace":
            h = message.headers or {}
            rks = [_s(x) for x in (h.get("routing_keys") or [])]
            dest = rks[0] if rks else None
            if message.routing_key == "publish.":
                if not dest or not dest.startswith(self.prefix + "."):
                    return
                source = "trace-publish"
                routed = bool(h.get("routed_queues"))
            else:
                source = "trace-deliver"
                dest = (message.routing_key or "")[len("deliver.") :]
                redelivered = bool(h.get("redelivered"))
            p = h.get("properties") or {}
            props = {"correlation_id": _s(p.get("correlation_id"))}
        digest = hashlib.blake2b(body, digest_size=10).hexdigest()
        try:
            msg = orjson.loads(body)
        except orjson.JSONDecodeError:
            msg = None
        if not isinstance(msg, dict):
            self.records.append(Rec(now, source, "garbage", None, dest=dest, routed=routed, digest=digest))
            self.last_event = now
            return
        mtype = msg.get("type")
        if (
            source == "trace-publish"
            and dest in (f"{self.prefix}.interactive", f"{self.prefix}.batch")
            and mtype not in ("result", "chunk")
        ):
            kind = "job"
        else:
            kind = mtype if mtype in ("result", "chunk") else "other"
        err = msg.get("error") if isinstance(msg.get("error"), dict) else {}
        rec = Rec(
            now,
            source,
            kind,
            msg.get("id"),
            status=msg.get("status"),
            code=err.get("code"),
            message=_s(err.get("message"))[:300] if err.get("message") else None,
            text=msg.get("text") if kind in ("result", "chunk") else None,
            seq=msg.get("seq") if kind == "chunk" else None,
            run=msg.get("run") if kind == "chunk" else None,
            correlation_id=_s(props.get("correlation_id")),
            dest=dest,
            routed=routed,
            redelivered=redelivered,
            replayed=bool(msg.get("replayed")),
            digest=digest,
            tokens=_tokens(msg, kind),
            resumed=msg.get("resumed") if kind == "chunk" and isinstance(msg.get("resumed"), int) else None,
        )
        seen_key = (source, digest)
        if redelivered and seen_key in self._seen and source != "trace-publish":
            rec.transport_dup = True
        self._seen.add(seen_key)
        self.records.append(rec)
        self.last_event = now
        if kind == "result" and self._counts_as_final(rec):
            tag = rec.tag()
            self.n_finals += 1
            if tag is not None:
                self.final_count[tag] = self.final_count.get(tag, 0) + 1
            if self.on_final is not None:
                self.on_final(rec)

    def _counts_as_final(self, rec: Rec) -> bool:
        """A final that reached a requester's queue: consumed from one of the
        collector's queues, or (firehose) published and routed to a queue."""
        if rec.transport_dup:
            return False
        if rec.source == "trace-publish":
            # a reply to the collector's own queue is counted when consumed
            return bool(rec.routed) and rec.dest != self.queue
        if rec.source == "trace-deliver":
            return False
        return True

    def finals(self) -> list[Rec]:
        return [r for r in self.records if r.kind == "result" and self._counts_as_final(r)]

    def answered(self, keys: Any) -> int:
        return sum(1 for k in keys if self.final_count.get(k))

    async def wait_answered(self, keys: list[str], *, idle_s: float, timeout: float, extra_done: Any = None) -> str:
        """Wait until every key has a final, or nothing arrived for ``idle_s``,
        or ``timeout``. Returns 'complete', 'idle' or 'timeout'."""
        t_end = time.monotonic() + timeout
        while True:
            if self.answered(keys) >= len(keys) and (extra_done is None or extra_done()):
                return "complete"
            now = time.monotonic()
            if now - self.last_event > idle_s:
                return "idle"
            if now > t_end:
                return "timeout"
            await asyncio.sleep(0.2)

    async def close(self, delete: bool = True) -> None:
        if self._conn is None:
            return
        try:
            if delete and self._ch is not None and not self._ch.is_closed:
                await self._ch.queue_delete(self.queue)
        except Exception:  # noqa: BLE001
            pass
        try:
            await self._conn.close()
        except Exception:  # noqa: BLE001
            pass


def analyze(records: list[Rec], finals: list[Rec], expected: dict[str, str]) -> dict[str, Any]:
    """Per-scenario counts. ``expected``: key -> category (``ordinary``,
    ``stream``, ``malformed``, ...) of every job that should get a final."""
    by_key: dict[str, list[Rec]] = {}
    unknown = 0
    for r in finals:
        k = r.tag()
        if k is None or k not in expected:
            unknown += 1
            continue
        by_key.setdefault(k, []).append(r)
    twice = [k for k, rs in by_key.items() if len(rs) > 1]
    # Two byte-identical ok finals are one publish delivered twice (a publish
    # retried after a lost confirm): an ok final carries per-run timings.
    # Error finals carry none, so identical error finals may be separate
    # handlings of a redelivered job.
    twice_copies = [
        k for k in twice if len({r.digest for r in by_key[k]}) == 1 and all(r.status == "ok" for r in by_key[k])
    ]
    diff_ok = [k for k, rs in by_key.items() if len({r.text for r in rs if r.status == "ok"}) > 1]
    ordinary = {k for k, c in expected.items() if c in ("ordinary", "stream")}
    harmed = sorted(k for k in ordinary if any(r.status != "ok" for r in by_key.get(k, [])))
    harm_codes: dict[str, int] = {}
    for k in harmed:
        for r in by_key[k]:
            if r.status != "ok":
                harm_codes[r.code or "?"] = harm_codes.get(r.code or "?", 0) + 1
    missing = sorted(k for k in expected if k not in by_key)
    return {
        "finals_received": sum(len(v) for v in by_key.values()),
        "finals_unattributed": unknown,
        "keys_answered": len(by_key),
        "missing": len(missing),
        "missing_sample": missing[:10],
        "missing_by_category": _count_by(missing, expected),
        "answered_twice": len(twice),
        "answered_twice_sample": twice[:10],
        "answered_twice_identical_copies": len(twice_copies),
        "answered_twice_keys": twice,
        "twice_replayed_same_text": [
            k for k in twice if any(r.replayed for r in by_key[k]) and len({r.text for r in by_key[k]}) == 1
        ],
        "twice_with_errors": [k for k in twice if any(r.status != "ok" for r in by_key[k])],
        "answered_twice_detail": {
            k: [
                {
                    "source": r.source,
                    "status": r.status,
                    "code": r.code,
                    "text": (r.text or "")[:60],
                    "replayed": r.replayed,
                    "digest": r.digest,
                }
                for r in by_key[k]
            ]
            for k in twice[:5]
        },
        "different_ok_texts": len(diff_ok),
        "different_ok_texts_sample": diff_ok[:10],
        "ordinary_harmed": len(harmed),
        "ordinary_harmed_codes": harm_codes,
        "ordinary_harmed_sample": harmed[:10],
        "transport_redeliveries": sum(1 for r in records if r.transport_dup),
        "replayed_finals": sum(1 for r in finals if r.replayed),
    }


def _count_by(keys: list[str], expected: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[expected[k]] = out.get(expected[k], 0) + 1
    return out


def stream_check(records: list[Rec], stream_keys: set[str]) -> dict[str, Any]:
    """Chunks of streaming jobs: duplicates, gaps, and whether the chunks of
    the run that finished concatenate to the final text."""
    chunks: dict[str, dict[str, dict[int, str]]] = {}
    dups = 0
    for r in records:
        if r.kind != "chunk" or r.transport_dup or r.tag() not in stream_keys:
            continue
        runs = chunks.setdefault(r.tag(), {})
        seqs = runs.setdefault(r.run or "", {})
        if r.seq in seqs:
            dups += 1
            continue
        seqs[int(r.seq or 0)] = r.text or ""
    finals = {r.tag(): r for r in records if r.kind == "result" and r.tag() in stream_keys and r.status == "ok"}
    mismatched, gaps, restarted = 0, 0, 0
    for k, f in finals.items():
        runs = chunks.get(k, {})
        if len(runs) > 1:
            restarted += 1
        ok = False
        for seqs in runs.values():
            if seqs and sorted(seqs) != list(range(len(seqs))):
                gaps += 1
            if "".join(seqs[i] for i in sorted(seqs)) == (f.text or ""):
                ok = True
        if not ok and (f.text or runs):
            mismatched += 1
    return {
        "stream_jobs": len(stream_keys),
        "stream_ok_finals": len(finals),
        "chunk_duplicates": dups,
        "runs_with_gaps": gaps,
        "restarted_streams": restarted,
        "chunks_not_matching_final": mismatched,
    }


def resume_check(records: list[Rec], keys: set[str]) -> dict[str, Any]:
    """Work done twice for streaming jobs whose worker was killed, from
    their chunks: each run's tokens (its chunks' ``tokens``) less those it
    continued from (its first chunk's ``resumed``) is what that run
    generated; what every run of a key generated, less the tokens its ok
    final holds, was generated twice (recomputed). The chunks a dead run
    published are a lower bound of what it generated (one in flight at the
    kill is lost), so recomputed tokens can be under-counted by about one
    chunk per killed run."""
    per_run: dict[tuple[str, str], dict[str, int]] = {}
    seen: set[tuple[str, str, int]] = set()
    for r in records:
        k = r.tag()
        if r.kind != "chunk" or r.transport_dup or k not in keys:
            continue
        if (k, r.run or "", int(r.seq or 0)) in seen:
            continue
        seen.add((k, r.run or "", int(r.seq or 0)))
        run = per_run.setdefault((k, r.run or ""), {"tokens": 0, "resumed": 0})
        run["tokens"] += r.tokens or 0
        run["resumed"] = max(run["resumed"], r.resumed or 0)
    finals = {r.tag(): r for r in records if r.kind == "result" and r.tag() in keys and r.status == "ok"}
    needed = sum(f.tokens or 0 for f in finals.values())
    generated = sum(max(0, v["tokens"] - v["resumed"]) for v in per_run.values())
    runs_per_key: dict[str, int] = {}
    for k, _ in per_run:
        runs_per_key[k] = runs_per_key.get(k, 0) + 1
    restarted = {k for k, n in runs_per_key.items() if n > 1}
    resumed_runs = [v for v in per_run.values() if v["resumed"]]
    recomputed = max(0, generated - needed)
    resumed = sum(v["resumed"] for v in resumed_runs)
    return {
        "jobs": len(keys),
        "ok_finals": len(finals),
        "tokens_needed": needed,
        "tokens_generated": generated,
        "tokens_recomputed": recomputed,
        "recomputed_frac": round(recomputed / needed, 4) if needed else None,
        "jobs_restarted": len(restarted),
        "runs_resumed": len(resumed_runs),
        "tokens_resumed": resumed,
        # without saved tokens every resumed token would have been generated again
        "tokens_recomputed_without_saving": recomputed + resumed,
    }
