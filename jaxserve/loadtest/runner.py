"""Drive a running worker through the reference client, level after level.

Closed loop (``concurrency``): that many clients, each sending one job at a
time, the next as soon as the previous one ended, until the level's
duration is up; jobs still in flight then are waited for. Open loop
(``rate``): jobs arrive at that many per second with exponential gaps
(a Poisson process, seeded), each sent on arrival whatever is in flight,
up to ``max_in_flight`` (arrivals beyond it are counted as
``client_dropped``, not sent).

Per job (one :class:`JobRecord`), on the load generator's monotonic clock:

- ``ttft_s``: from just before the publish to the first streamed chunk
  (streaming jobs only; none for the others);
- ``itl_samples``: one sample per gap between consecutive streamed chunks,
  the gap divided by the tokens a chunk carries. The wire does not say how
  many tokens a chunk holds (deltas that pile up are coalesced), so each
  chunk is taken to carry ``usage.completion_tokens / number of text
  deltas`` tokens (the final result's fill-in, if any, counts as a delta);
- ``e2e_s``: from just before the publish to the final result;
- ``completion_tokens`` / ``prompt_tokens``: the final's ``usage``;
- ``served_model``: the model that answered (the final's ``served_model``,
  else its ``model``), ``degraded``: what the answer gave up (``model``: a
  fallback answered, ``max_tokens``), ``cost``: the final's
  ``usage.cost`` amount and ``cost_currency`` (when the worker has prices).

A rejection is a publish the broker refused (``QueueFull``: the queue is at
its length limit), or a final with error code ``overloaded`` or
``rate_limited``; other error codes are counted by code. A closed-loop client
whose job was rejected waits ``reject_backoff_s``, or the rejection's
``retry_after_s`` when the worker gave a longer one (at most
``max_retry_after_s``), before its next job. Jobs marked for
cancellation (:mod:`jaxserve.loadtest.workload`) are cancelled with
``AsyncClient.cancel`` right after their first chunk.

After each level (unless disabled) the runner checks that the capacity came
back: the worker's job queues drain (no ready messages; no unacknowledged
ones either, when ``rabbitmqctl`` is there to ask), and a probe of short
streaming jobs sent all at once completes (a probe job that is rejected, by
admission or a tenant limit, is sent again after the backoff until the drain
timeout). Then it settles before the next
level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.loadtest.workload import JobSpec, Workload

#: error codes of a final result that count as rejections (with the client's QueueFull)
REJECT_CODES = ("overloaded", "rate_limited")
QUEUE_FULL = "queue_full"


class LoadTestError(RuntimeError):
    """The load test cannot run (no worker, no queue)."""


@dataclasses.dataclass
class JobRecord:
    index: int
    key: str
    kind: str
    queue: str
    stream: bool
    cancel_planned: bool
    t_start: float  # seconds since the level started
    status: str = "pending"  # ok | rejected | cancelled | error | timeout
    code: str | None = None  # error code (queue_full for a refused publish)
    t_end: float | None = None
    publish_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunks: int = 0
    deltas: int = 0
    itl_samples: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cancel_sent_s: float | None = None  # seconds since the level started
    retry_after_s: float | None = None  # a rejection's hint, when the worker gives one
    worker_timings: dict[str, float] | None = None
    probe: bool = False
    served_model: str | None = None
    degraded: list[str] | None = None
    cost: float | None = None
    cost_currency: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["itl_samples"] = [round(x, 6) for x in self.itl_samples]
        for k in ("t_start", "t_end", "publish_s", "ttft_s", "e2e_s", "cancel_sent_s"):
            if out[k] is not None:
                out[k] = round(out[k], 6)
        return out


def itl_samples(chunk_times: list[float], completion_tokens: int, deltas: int) -> list[float]:
    """Per-token inter-token latencies of one job (see the module docstring):
    each gap between consecutive chunk arrival times divided by the tokens a
    chunk carries on average, ``completion_tokens / deltas``."""
    if len(chunk_times) < 2 or completion_tokens <= 0 or deltas <= 0:
        return []
    per_chunk = completion_tokens / deltas
    return [(b - a) / per_chunk for a, b in zip(chunk_times, chunk_times[1:])]


@dataclasses.dataclass
class RunConfig:
    amqp_url: str
    prefix: str
    mode: str  # "closed" or "open"
    levels: list[float]
    duration_s: float
    settle_s: float = 2.0
    job_timeout_s: float = 120.0
    reject_backoff_s: float = 0.1
    max_retry_after_s: float = 5.0
    max_in_flight: int = 1000
    check_capacity: bool = True
    probe_jobs: int | None = None  # default: the level's concurrency, 2..8
    drain_timeout_s: float = 20.0
    broker_details: bool | None = None  # unacked counts from rabbitmqctl (default: when on PATH)
    progress: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be closed or open, got {self.mode!r}")
        if not self.levels:
            raise ValueError("give at least one level")
        for x in self.levels:
            if not x > 0:
                raise ValueError(f"levels must be > 0, got {x}")
            if self.mode == "closed" and int(x) != x:
                raise ValueError(f"a concurrency must be an integer, got {x}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")


class _Level:
    """State of the level being run."""

    def __init__(self, number: int, value: float) -> None:
        self.number = number
        self.value = value
        self.start = time.monotonic()
        self.records: list[JobRecord] = []
        self.first_cancel: float | None = None  # monotonic
        self.in_flight = 0
        self.client_dropped = 0

    def rel(self, t: float) -> float:
        return t - self.start


class LoadTest:
    """Runs the levels of one load test against ``prefix``'s worker(s)."""

    def __init__(
        self, cfg: RunConfig, workload: Workload, *, on_level: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.workload = workload
        self.on_level = on_level
        self.run_id = uuid.uuid4().hex[:8]
        self.client: Any = None
        self.jobs: list[dict[str, Any]] = []  # every job record, for DIR/loadtest-jobs.jsonl

    # ------------------------------------------------------------ public
    async def run(self) -> list[dict[str, Any]]:
        from jaxserve.client import AsyncClient
        from jaxserve.loadtest.report import summarize_level

        self.client = await AsyncClient(
            self.cfg.amqp_url, prefix=self.cfg.prefix, name=f"jaxserve-loadtest-{self.run_id}"
        ).connect()
        results: list[dict[str, Any]] = []
        try:
            await self._preflight()
            for number, value in enumerate(self.cfg.levels):
                if number:
                    await asyncio.sleep(self.cfg.settle_s)
                level = _Level(number, value)
                await self._run_level(level)
                # The level's window: its duration, or longer while its last jobs finished.
                ends = [r.t_end for r in level.records if r.t_end is not None]
                elapsed = max([self.cfg.duration_s, *ends])
                capacity = await self._check_capacity(level) if self.cfg.check_capacity else None
                key = "concurrency" if self.cfg.mode == "closed" else "rate"
                entry = summarize_level(
                    level.records,
                    mode=self.cfg.mode,
                    level={key: int(value) if key == "concurrency" else value},
                    duration_s=self.cfg.duration_s,
                    elapsed_s=elapsed,
                    capacity=capacity,
                    client_dropped=level.client_dropped,
                )
                results.append(entry)
                self.jobs.extend({"level": number, **r.to_dict()} for r in level.records)
                if self.on_level is not None:
                    self.on_level(entry)
        finally:
            try:
                await self.client.delete_reply_queue()
            finally:
                await self.client.close()
        mark_rejections(results)
        return results

    # ------------------------------------------------------------ checks
    async def _preflight(self) -> None:
        depths = await self.client.queue_depths()
        topo = self.client.topo
        needed = {self.workload.kinds[n].queue for n in self.workload.names}
        for queue_class in sorted(needed):
            name = topo.queue_for(queue_class)
            d = depths.get(name, {"messages": -1, "consumers": -1})
            if d["messages"] < 0:
                raise LoadTestError(f"no queue {name!r}: is a worker running with prefix {self.cfg.prefix!r}?")
            if d["consumers"] < 1:
                raise LoadTestError(f"nobody consumes {name!r}: start a worker with --prefix {self.cfg.prefix}")

    async def _depths(self) -> dict[str, int]:
        depths = await self.client.queue_depths()
        topo = self.client.topo
        return {q: depths[topo.queue_for(q)]["messages"] for q in ("interactive", "batch")}

    def _unacked(self) -> dict[str, int] | None:
        """messages_unacknowledged of the job queues (rabbitmqctl), or None."""
        use = self.cfg.broker_details
        if use is None:
            use = shutil.which("rabbitmqctl") is not None
        if not use:
            return None
        try:
            out = subprocess.run(
                ["rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        topo = self.client.topo
        wanted = {topo.queue_for(q): q for q in ("interactive", "batch")}
        counts: dict[str, int] = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in wanted and parts[1].isdigit():
                counts[wanted[parts[0]]] = int(parts[1])
        return counts

    async def _check_capacity(self, level: _Level) -> dict[str, Any]:
        """Queues drained, then a probe batch of short jobs completes."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.drain_timeout_s
        ready = await self._depths()
        while any(v > 0 for v in ready.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            ready = await self._depths()
        unacked = await asyncio.to_thread(self._unacked)
        while unacked and any(v > 0 for v in unacked.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            unacked = await asyncio.to_thread(self._unacked)
        drained = all(v == 0 for v in ready.values()) and (unacked is None or all(v == 0 for v in unacked.values()))
        drain_s = time.monotonic() - t0
        n = self.cfg.probe_jobs
        if n is None:
            n = int(min(8, max(2, level.value if self.cfg.mode == "closed" else round(level.value))))
        probes = [self.workload.probe(i) for i in range(n)]
        probe_deadline = time.monotonic() + self.cfg.drain_timeout_s
        attempts = [0]
        rejected_codes: set[str] = set()

        async def probe(spec: JobSpec) -> JobRecord:
            # a rejection (admission, a tenant limit, a full queue) is the
            # worker protecting itself, not lost capacity: retry it
            while True:
                attempts[0] += 1
                rec = await self._run_job(level, spec, probe=True)
                if rec.status != "rejected" or time.monotonic() >= probe_deadline:
                    return rec
                rejected_codes.add(rec.code or "")
                await asyncio.sleep(
                    max(self.cfg.reject_backoff_s, min(rec.retry_after_s or 0.0, self.cfg.max_retry_after_s))
                )

        recs = await asyncio.gather(*(probe(spec) for spec in probes))
        ok = sum(r.status == "ok" for r in recs)
        return {
            "queues_drained": drained,
            "ready_after": ready,
            "unacked_after": unacked,
            "drain_wait_s": round(drain_s, 3),
            "probe_jobs": n,
            "probe_ok": ok,
            "probe_attempts": attempts[0],
            "probe_rejections": sorted(rejected_codes),
            "probe_codes": sorted({r.code for r in recs if r.code}),
            "capacity_back": bool(drained and ok == n),
        }

    # ------------------------------------------------------------ levels
    async def _run_level(self, level: _Level) -> None:
        bar = None
        if self.cfg.progress:
            from tqdm import tqdm

            label = f"c={int(level.value)}" if self.cfg.mode == "closed" else f"{level.value:g}/s"
            bar = tqdm(
                total=round(self.cfg.duration_s, 1),
                desc=f"level {level.number + 1}/{len(self.cfg.levels)} {label}",
                unit="s",
                leave=True,
                bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f}s{postfix}",
            )
        ticker = asyncio.create_task(self._tick(level, bar)) if bar is not None else None
        try:
            if self.cfg.mode == "closed":
                await self._closed(level)
            else:
                await self._open(level)
        finally:
            if ticker is not None:
                ticker.cancel()
                try:
                    await ticker
                except asyncio.CancelledError:
                    pass
            if bar is not None:
                self._update_bar(level, bar)
                bar.close()

    def _update_bar(self, level: _Level, bar: Any) -> None:
        recs = level.records
        bar.n = round(min(level.rel(time.monotonic()), self.cfg.duration_s), 1)
        bar.set_postfix(
            ok=sum(r.status == "ok" for r in recs),
            rejected=sum(r.status == "rejected" for r in recs),
            cancelled=sum(r.status == "cancelled" for r in recs),
            in_flight=level.in_flight,
            refresh=False,
        )
        bar.refresh()

    async def _tick(self, level: _Level, bar: Any) -> None:
        while True:
            self._update_bar(level, bar)
            await asyncio.sleep(0.5)

    async def _closed(self, level: _Level) -> None:
        end = level.start + self.cfg.duration_s

        async def one_client() -> None:
            while time.monotonic() < end:
                rec = await self._run_job(level, self.workload.next())
                if rec.status == "rejected":
                    # the worker's retry_after_s when it gives one (at most
                    # max_retry_after_s), never less than the fixed backoff
                    wait = max(self.cfg.reject_backoff_s, min(rec.retry_after_s or 0.0, self.cfg.max_retry_after_s))
                    if wait > 0:
                        await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))

        await asyncio.gather(*(one_client() for _ in range(int(level.value))))

    async def _open(self, level: _Level) -> None:
        rng = np.random.default_rng([self.cfg.seed, level.number])
        end = level.start + self.cfg.duration_s
        t_next = level.start
        tasks: set[asyncio.Task] = set()
        while True:
            t_next += float(rng.exponential(1.0 / level.value))
            if t_next >= end:
                break
            delay = t_next - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if level.in_flight >= self.cfg.max_in_flight:
                level.client_dropped += 1
                continue
            task = asyncio.create_task(self._run_job(level, self.workload.next()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    # -------------------------------------------------------------- jobs
    async def _run_job(self, level: _Level, spec: JobSpec, *, probe: bool = False) -> JobRecord:
        from jaxserve.client import JobError, NoRoute, QueueFull, StreamDiverged

        client = self.client
        tag = "p" if probe else "j"
        key = f"lt-{self.run_id}-{level.number}-{tag}{spec.index}"
        t0 = time.monotonic()
        rec = JobRecord(
            spec.index, key, spec.kind, spec.queue, spec.stream, spec.cancel and not probe, level.rel(t0), probe=probe
        )
        if not probe:
            level.records.append(rec)
        level.in_flight += 1
        body = dict(spec.body)
        text_kw = {"prompt": body.pop("prompt", None), "messages": body.pop("messages", None)}
        result = None
        try:
            if spec.stream:
                stream = await client.stream(
                    **text_kw, queue=spec.queue, key=key, timeout=self.cfg.job_timeout_s, **body
                )
                rec.publish_s = time.monotonic() - t0
                chunk_times: list[float] = []
                try:
                    async for _delta in stream:
                        now = time.monotonic()
                        rec.deltas += 1
                        if stream.result is not None:
                            continue  # the final's fill-in, not a chunk
                        chunk_times.append(now)
                        if rec.cancel_planned and rec.cancel_sent_s is None:
                            rec.cancel_sent_s = level.rel(now)
                            if level.first_cancel is None:
                                level.first_cancel = now
                            await client.cancel(key)
                except JobError as exc:
                    result = exc.result
                except StreamDiverged as exc:
                    result = exc.result
                    rec.status, rec.code = "error", "stream_diverged"
                result = result or stream.result
                rec.chunks = len(chunk_times)
                if chunk_times:
                    rec.ttft_s = chunk_times[0] - t0
                if result is not None and result.ok and result.usage is not None:
                    rec.itl_samples = itl_samples(chunk_times, result.usage.completion_tokens, rec.deltas)
            else:
                await client.publish(build_body(text_kw, body), key=key, queue=spec.queue)
                rec.publish_s = time.monotonic() - t0
                result = await client.wait(key, self.cfg.job_timeout_s)
        except QueueFull:
            rec.status, rec.code = "rejected", QUEUE_FULL
        except NoRoute as exc:
            rec.status, rec.code = "error", "no_route"
            raise LoadTestError(str(exc)) from None
        except TimeoutError:
            rec.status, rec.code = "timeout", "timeout"
            client._futures.pop(key, None)
        finally:
            level.in_flight -= 1
            t_end = time.monotonic()
            rec.t_end = level.rel(t_end)
        if result is not None and rec.status == "pending":
            classify(rec, result)
        if rec.status in ("ok",):
            rec.e2e_s = t_end - t0
        return rec


def build_body(text_kw: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in text_kw.items() if v is not None}
    body.update(params)
    return body


def classify(rec: JobRecord, result: Any) -> None:
    """Fill a record's status, code, usage and timings from a final result."""
    rec.worker_timings = result.timings or None
    if result.ok:
        rec.status = "ok"
        served = getattr(result, "served_model", None) or getattr(result, "model", None)
        rec.served_model = served if isinstance(served, str) else None
        degraded = getattr(result, "degraded", None)
        rec.degraded = [str(d) for d in degraded] if isinstance(degraded, (list, tuple)) else None
        if result.usage is not None:
            rec.prompt_tokens = result.usage.prompt_tokens
            rec.completion_tokens = result.usage.completion_tokens
            cost = getattr(result.usage, "cost", None)  # {amount, currency}: an extra field of usage
            if isinstance(cost, dict) and isinstance(cost.get("amount"), (int, float)):
                rec.cost = float(cost["amount"])
                rec.cost_currency = str(cost.get("currency") or "") or None
        return
    code = result.error.code if result.error is not None else "unknown"
    rec.code = code
    hint = getattr(result.error, "retry_after_s", None)
    if isinstance(hint, (int, float)) and not isinstance(hint, bool):
        rec.retry_after_s = float(hint)
    if code in REJECT_CODES:
        rec.status = "rejected"
    elif code == "cancelled":
        rec.status = "cancelled"
    else:
        rec.status = "error"


def mark_rejections(levels: list[dict[str, Any]]) -> int | None:
    """Set ``rejections_begin`` on the first level with rejections (and
    False elsewhere); returns its index or None."""
    first = next((i for i, e in enumerate(levels) if e.get("rejected", 0) > 0), None)
    for i, e in enumerate(levels):
        e["rejections_begin"] = i == first
    return first
