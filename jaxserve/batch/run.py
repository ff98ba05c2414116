"""Run a batch file through the queue: publish, collect, resume, deduplicate.

* **Resumable.** OUT is appended to as results arrive. A rerun over the same
  OUT skips requests that have a final line there for the same job (``ok``,
  or an error that retrying cannot fix) and runs again those that ended in
  a retryable error and those whose line answered the request with other
  options (``jaxserve.batch.keys.answers``); their old lines are dropped
  first. Results that arrive while the command is down wait in its durable
  reply queue, named after OUT.
* **Deduplicated.** Within one run, deterministic requests (label scoring,
  temperature 0, or a seed given) with identical bodies are published once;
  each line still gets its own output line.
* **Routed.** A body's ``model`` routes it to that model's workers
  (``AsyncClient.publish``); a model no worker serves gets its
  ``unknown_model`` line at once, and the other lines run.
* **Bounded.** At most ``max_in_flight`` jobs are published and unanswered;
  when no result arrives for ``idle_timeout`` seconds the run gives up,
  whether or not its window is full.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson

from jaxserve.batch import keys, openai_format
from jaxserve.batch.inputs import BatchItem, canonical, is_deterministic
from jaxserve.wire import RETRYABLE_CODES, Result

if TYPE_CHECKING:
    from jaxserve.client import AsyncClient


@dataclasses.dataclass
class BatchSettings:
    amqp_url: str
    prefix: str
    queue: str = "batch"
    max_in_flight: int = 512
    idle_timeout: float = 600.0
    progress: bool = True
    out_format: str = "auto"  # auto | openai | jaxserve
    served_model_name: str | None = None


@dataclasses.dataclass
class BatchSummary:
    ok: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    skipped_already_done: int = 0
    retried: int = 0
    #: requests whose line in OUT answered them with other options (template, model, sampling ...)
    replaced: int = 0
    bad_lines: int = 0
    deduplicated: int = 0
    missing: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def exit_status(self) -> int:
        """2: results missing; 1: a line was bad, a request named a model
        nobody serves or was refused as invalid, or every request run failed
        (a run that produced nothing is not a success); else 0."""
        if self.missing:
            return 2
        if self.bad_lines or self.errors.get("unknown_model") or self.errors.get("invalid_request"):
            return 1
        return 1 if self.errors and not self.ok else 0


def _output_lines(path: Path) -> list[tuple[bytes, dict[str, Any] | None]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            rec = None  # a torn last line from a crash
        out.append((line, rec if isinstance(rec, dict) else None))
    return out


def settled_custom_ids(out_path: Path, items: list[BatchItem]) -> tuple[set[str], int, int]:
    """custom_ids that OUT answers for good, for the job each of ``items``
    asks now; rewrites OUT without the lines of retryable errors (and torn
    lines) and without the lines that answered a request with other options
    (a changed template, model, sampling ...: that request is a new job).
    Lines of requests the input no longer has are kept. Returns (done,
    retried, replaced)."""
    lines = _output_lines(out_path)
    asked: dict[str, BatchItem] = {}
    for item in items:
        asked.setdefault(item.custom_id, item)  # a repeated custom_id's own item is an error line
    done: set[str] = set()
    keep: list[bytes] = []
    retried = replaced = 0
    for raw, rec in lines:
        if rec is None:
            retried += 1
            continue
        cid, code = openai_format.line_outcome(rec)
        asks = asked.get(str(cid)) if cid is not None else None
        if asks is None:
            keep.append(raw)
            continue
        if not keys.answers(rec, asks.custom_id, asks.body):
            replaced += 1
            continue
        if code is not None and code in RETRYABLE_CODES:
            retried += 1
            continue
        done.add(asks.custom_id)
        keep.append(raw)
    if retried or replaced:
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_bytes(b"".join(k + b"\n" for k in keep))
        os.replace(tmp, out_path)
    return done, retried, replaced


class _Writer:
    """One output line per item, in the format its input asked for."""

    def __init__(self, path: Path, settings: BatchSettings, summary: BatchSummary) -> None:
        self.f = open(path, "ab")
        self.settings = settings
        self.summary = summary

    def _format(self, item: BatchItem) -> str:
        if self.settings.out_format != "auto":
            return self.settings.out_format
        return "openai" if item.endpoint is not None else "jaxserve"

    def result(self, item: BatchItem, result: dict[str, Any]) -> None:
        if self._format(item) == "openai":
            endpoint = item.endpoint or ("chat" if item.body and "messages" in item.body else "completions")
            model = self.settings.served_model_name or result.get("served_model") or result.get("model") or "jaxserve"
            line = openai_format.output_line(
                item.custom_id, result, endpoint, model, line_id=keys.line_id(item.custom_id, item.body)
            )
        else:
            line = {**result, "id": item.key, "custom_id": item.custom_id}
        self._write(line)
        if result.get("status") == "ok":
            self.summary.ok += 1
        else:
            code = (result.get("error") or {}).get("code", "unknown")
            self.summary.errors[code] = self.summary.errors.get(code, 0) + 1

    def error(self, item: BatchItem, code: str, message: str) -> None:
        self.result(item, Result.failure(item.key, code, message).to_dict())

    def _write(self, line: dict[str, Any]) -> None:
        self.f.write(orjson.dumps(line) + b"\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def reply_queue_name(prefix: str, out_path: Path) -> str:
    return f"{prefix}.reply.batch-{hashlib.sha256(str(out_path.resolve()).encode()).hexdigest()[:16]}"


def plan_publish(todo: list[BatchItem]) -> tuple[list[BatchItem], dict[str, list[BatchItem]]]:
    """The items to publish, and for each published key the items that ride
    on it: deterministic requests with identical bodies are computed once
    (every item still gets its own output line). Shared by ``jaxserve
    batch`` and the gateway's Batch API (``jaxserve.gateway.batch_runner``)."""
    followers: dict[str, list[BatchItem]] = collections.defaultdict(list)
    leaders: dict[bytes, BatchItem] = {}
    publish: list[BatchItem] = []
    for item in todo:
        assert item.body is not None
        if is_deterministic(item.body):
            ident = canonical(item.body)
            lead = leaders.get(ident)
            if lead is not None:
                followers[lead.key].append(item)
                continue
            leaders[ident] = item
        publish.append(item)
    return publish, dict(followers)


async def publish_item(
    client: AsyncClient,
    item: BatchItem,
    *,
    queue: str,
    attempts: int,
    on_final: Callable[[Result], Awaitable[None]],
    priority: int | None = None,
) -> None:
    """Publish the job of ``item`` (one :func:`plan_publish` publishes, so
    its body is set) to ``queue`` with its answer going to the client's
    reply queue, retrying (backoff up to 5 s) while the queue is full, at
    most ``attempts`` times; a ``body.model`` no worker serves is never
    queued, and its ``unknown_model`` result goes to ``on_final`` at once.
    Both batch runners publish through it (``jaxserve batch`` here, the
    gateway's Batch API in ``jaxserve.gateway.batch_runner``), so a full
    queue and an unknown model end the same way in either's output."""
    from jaxserve.client import QueueFull, UnknownModel, retry_with_backoff

    try:
        await retry_with_backoff(
            functools.partial(
                client.publish,
                cast(dict[str, Any], item.body),
                key=item.key,
                queue=queue,
                expect_reply=False,
                priority=priority,
            ),
            attempts=attempts,
            max_delay=5.0,
            retry_on=(QueueFull,),
        )
    except UnknownModel as exc:  # body.model names no served model: its line now, nothing queued
        await on_final(exc.result)


def run_batch(items: list[BatchItem], out_path: str | Path, settings: BatchSettings) -> BatchSummary:
    out_path = Path(out_path)
    summary = BatchSummary()
    done, summary.retried, summary.replaced = settled_custom_ids(out_path, items)
    if summary.replaced:
        print(
            f"{summary.replaced} requests in {out_path} were answered with other options (template, model, "
            "sampling, labels or schema); their old lines are replaced by this run's",
            file=sys.stderr,
        )
    writer = _Writer(out_path, settings, summary)
    todo: list[BatchItem] = []
    for item in items:
        if item.custom_id in done:
            summary.skipped_already_done += 1
            continue
        if item.error is not None:
            code, message = item.error
            print(message, file=sys.stderr)
            summary.bad_lines += 1  # reported, and the exit status says so
            if item.named:
                writer.error(item, code, message)  # a request the file names gets its error line
            continue
        todo.append(item)
    publish, followers = plan_publish(todo)
    summary.deduplicated = sum(len(v) for v in followers.values())
    try:
        summary.missing = asyncio.run(_run(publish, followers, writer, out_path, settings))
    finally:
        writer.close()
    return summary


async def _run(
    publish: list[BatchItem],
    followers: dict[str, list[BatchItem]],
    writer: _Writer,
    out_path: Path,
    settings: BatchSettings,
) -> int:
    from tqdm import tqdm

    from jaxserve.client import AsyncClient

    pending = {item.key: item for item in publish}
    total = len(publish) + sum(len(v) for v in followers.values())
    bar = tqdm(total=total, disable=not settings.progress, unit="job", file=sys.stderr)
    window = asyncio.Semaphore(settings.max_in_flight)
    last_result = [time.monotonic()]
    all_done = asyncio.Event()
    if not pending:
        all_done.set()

    async def on_final(msg: Result) -> None:
        item = pending.pop(msg.id, None) if msg.id is not None else None
        if item is None:
            return  # a duplicate (at-least-once) or a key of another run
        result = msg.to_dict()
        for one in (item, *followers.pop(item.key, ())):
            writer.result(one, result)
            bar.update(1)
        last_result[0] = time.monotonic()
        window.release()
        if not pending:
            all_done.set()

    def idle() -> bool:
        return time.monotonic() - last_result[0] > settings.idle_timeout

    async def take_slot() -> bool:
        """A place in the in-flight window, unless results stop coming for
        ``idle_timeout`` (a full window must not hang the run)."""
        while True:
            try:
                await asyncio.wait_for(window.acquire(), 1.0)
                return True
            except TimeoutError:
                if idle():
                    return False

    client = AsyncClient(
        settings.amqp_url,
        prefix=settings.prefix,
        reply_queue=reply_queue_name(settings.prefix, out_path),
        reply_queue_expires_ms=86_400_000,
        on_unclaimed=on_final,
        name="jaxserve-batch",
    )
    await client.connect()
    try:
        for item in publish:
            if not await take_slot():
                print(
                    f"no result for {settings.idle_timeout:g}s with {settings.max_in_flight} jobs in flight; giving up",
                    file=sys.stderr,
                )
                break
            if item.key not in pending:  # answered by a leftover reply already
                window.release()
                continue
            await publish_item(client, item, queue=settings.queue, attempts=30, on_final=on_final)
        while not all_done.is_set():
            try:
                await asyncio.wait_for(all_done.wait(), 1.0)
            except TimeoutError:
                if idle():
                    break
    finally:
        bar.close()
        if not pending:
            try:
                await client.delete_reply_queue()
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
        await client.close()
    return len(pending) + sum(len(followers.get(k, ())) for k in pending)
