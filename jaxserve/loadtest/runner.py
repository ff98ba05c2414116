"""Drive a running worker through the reference client, level after level.

Closed loop (``concurrency``): that many clients, each sending one job at a
time, the next as soon as the previous one ended, until the level's
duration is up; jobs still in flight then are waited for. Open loop
(``rate``): jobs arrive at that many per second with exponential gaps
(a Poisson process, seeded), each sent on arrival whatever is in flight,
up to ``max_in_flight`` (arrivals beyond it are counted as
``client_dropped``, not sent).

Each job becomes one :class:`~jaxserve.loadtest.records.JobRecord`
(:mod:`jaxserve.loadtest.records` says what it measures and what counts as
a rejection; its names are re-exported here). A closed-loop client
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

from jaxserve.loadtest.records import (
    QUEUE_FULL,
    REJECT_CODES,
    JobRecord,
    classify,
    itl_samples,
    mark_rejections,
)
from jaxserve.loadtest.workload import JobSpec, Workload

__all__ = [
    "QUEUE_FULL",
    "REJECT_CODES",
    "JobRecord",
    "LoadTest",
    "LoadTestError",
    "RunConfig",
    "build_body",
    "classify",
    "itl_samples",
    "mark_rejections",
]


class LoadTestError(RuntimeError):
    """The load test cannot run (no worker, no queue)."""


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
        self.queues: dict[str, str] = {}  # queue class -> the queue its jobs land in (_job_queues)

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
    async def _job_queues(self) -> dict[str, str]:
        """The queue each class's jobs land in: the default model's, unless
        the jobs name a model (``--model M``) whose own queues exist
        (``{prefix}.interactive.<q(M)>``, docs/protocol.md "Routing by
        model"): then the drain and depth checks must watch those."""
        topo = self.client.topo
        default = {q: topo.queue_for(q) for q in ("interactive", "batch")}
        model = self.workload.extra_params.get("model")
        if not isinstance(model, str):
            return default
        own = {q: topo.model_queue(q, model) for q in default}
        depths = await self.client.queue_depths(list(own.values()))
        return {q: own[q] if depths[own[q]]["messages"] >= 0 else default[q] for q in default}

    async def _preflight(self) -> None:
        self.queues = await self._job_queues()
        depths = await self.client.queue_depths(list(self.queues.values()))
        needed = {self.workload.kinds[n].queue for n in self.workload.names}
        for queue_class in sorted(needed):
            name = self.queues[queue_class]
            d = depths.get(name, {"messages": -1, "consumers": -1})
            if d["messages"] < 0:
                raise LoadTestError(f"no queue {name!r}: is a worker running with prefix {self.cfg.prefix!r}?")
            if d["consumers"] < 1:
                raise LoadTestError(f"nobody consumes {name!r}: start a worker with --prefix {self.cfg.prefix}")

    async def _depths(self) -> dict[str, int]:
        depths = await self.client.queue_depths(list(self.queues.values()))
        return {q: depths[name]["messages"] for q, name in self.queues.items()}

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
        wanted = {name: q for q, name in self.queues.items()}
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
