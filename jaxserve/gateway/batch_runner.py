"""One Batch API batch, run through the queue with ``jaxserve batch``'s
machinery (:mod:`jaxserve.batch`): the input file read by ``read_items``
(one job per line, keys ``<batch id>:<custom_id>``), identical
deterministic lines computed once (``plan_publish``), results appended to a
work file as they arrive and resumed from it (``settled_custom_ids``), each
line in OpenAI's Batch output shape (``openai_format``).

Why it survives a ``kill -9`` of the gateway: the work file holds every
answered line; the batch's reply queue (``<prefix>.reply.gw-<batch id>``,
expiring only after the completion window) holds the answers that arrive
while no gateway runs; a gateway that takes the batch over publishes again
only what the work file lacks, and the workers' idempotency store answers a
job it already ran from its store (``replayed``) instead of running it
twice. At most ``max_in_flight`` jobs are published and unanswered, so a
restart republishes at most that many. ``tests/test_gateway_restart.py``
kills a gateway in the middle of a 500-line batch and counts the engine's
runs per key.

``completion_window`` is a deadline: every job carries it (``deadline``,
checked by the worker before it starts the job), and when it passes the
runner cancels what is still out and closes the batch ``expired``, each
unfinished request answered ``batch_expired`` in the error file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import orjson
import structlog

from jaxserve.batch import keys, openai_format
from jaxserve.batch.inputs import BatchItem, InputOptions, read_items
from jaxserve.batch.run import plan_publish, publish_item, settled_custom_ids
from jaxserve.client import AsyncClient
from jaxserve.gateway.files import Files, new_file_id
from jaxserve.gateway.metrics import GatewayMetrics, RecentEvents
from jaxserve.gateway.store import GatewayStore
from jaxserve.wire import Result

log = structlog.get_logger("jaxserve.gateway")

#: OpenAI's limit on the requests of one batch
MAX_REQUESTS = 50_000
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclasses.dataclass
class RunnerContext:
    """What every runner of one gateway shares."""

    amqp_url: str
    prefix: str
    store: GatewayStore
    files: Files
    work_dir: Path  # one folder per batch: its work file
    owner: str  # this gateway's id, the lease holder
    metrics: GatewayMetrics
    events: RecentEvents
    max_in_flight: int = 512
    lease_s: float = 30.0
    cancel_grace_s: float = 10.0


def _line_error(custom_id: str, code: str, message: str) -> dict[str, Any]:
    return openai_format.error_line(custom_id, code, message)


class BatchRunner:
    """Runs one batch to its end (or until this gateway stops)."""

    def __init__(self, ctx: RunnerContext, record: dict[str, Any]) -> None:
        self.ctx = ctx
        self.record = record
        self.id: str = record["id"]
        self.endpoint = ENDPOINTS[record["endpoint"]]
        self.work = ctx.work_dir / self.id / "results.jsonl"
        self.cancel = asyncio.Event()
        self.completed = 0
        self.failed = 0
        self.total = int(record["request_counts"]["total"])
        self.log = log.bind(batch_id=self.id, tenant=record.get("_tenant"))
        self._dirty = True
        self._out: Any = None

    # ------------------------------------------------------------ record
    def counts(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}

    async def _save(self, **fields: Any) -> None:
        self.record.update(fields)
        self.record["request_counts"] = self.counts()
        await self.ctx.store.put_batch(self.record)
        self._dirty = False

    async def _status(self, status: str, **fields: Any) -> None:
        stamp = {
            "in_progress": "in_progress_at",
            "finalizing": "finalizing_at",
            "completed": "completed_at",
            "failed": "failed_at",
            "expired": "expired_at",
            "cancelling": "cancelling_at",
            "cancelled": "cancelled_at",
        }.get(status)
        if stamp is not None and self.record.get(stamp) is None:
            fields[stamp] = int(time.time())
        self.log.info("gateway_batch_status", status=status, **self.counts())
        await self._save(status=status, **fields)

    # ------------------------------------------------------------ run
    async def run(self) -> None:
        status = self.record["status"]
        try:
            if status == "finalizing":
                await self._finalize(self.record.get("_end_status", "completed"))
                return
            if status == "cancelling" or await self.ctx.store.cancel_requested(self.id):
                self.cancel.set()
            items = await self._validate()
            if items is None:
                return
            end = await self._execute(items)
            await self._finalize(end)
        finally:
            if self._out is not None:
                self._out.close()
            await self.ctx.store.release(self.id, self.ctx.owner)

    async def _validate(self) -> list[BatchItem] | None:
        """The items, or None when the file fails validation (the batch is
        then ``failed`` with OpenAI's ``errors`` list, nothing run)."""
        path = self.ctx.files.path(self.record["input_file_id"])
        try:
            _, items = await asyncio.to_thread(read_items, path, InputOptions(batch_id=self.id))
        except (OSError, ValueError) as exc:
            await self._fail([{"code": "invalid_file", "message": f"The input file cannot be read: {exc}"}])
            return None
        errors: list[dict[str, Any]] = []
        if len(items) > MAX_REQUESTS:
            errors.append(
                {
                    "code": "batch_too_large",
                    "message": f"The input file has {len(items)} requests; a batch holds at most {MAX_REQUESTS}.",
                    "param": "input_file_id",
                    "line": None,
                }
            )
        for item in items:
            if len(errors) >= 100:
                break
            problem: tuple[str, str] | None = None
            if item.error is not None and (not item.named or "already used" in item.error[1]):
                problem = item.error  # a line that names no request, or names one twice
            elif item.endpoint is None:
                problem = (
                    "invalid_request",
                    f"line {item.lineno}: not a Batch API request line (custom_id, method, url, body)",
                )
            elif item.error is None and ENDPOINTS[self.record["endpoint"]] != item.endpoint:
                problem = (
                    "mismatched_url",
                    f"line {item.lineno}: the url must be the batch's endpoint {self.record['endpoint']}",
                )
            if problem is not None:
                errors.append({"code": problem[0], "message": problem[1], "param": None, "line": item.lineno})
        if errors:
            await self._fail(errors)
            return None
        self.total = len(items)
        if self.record["status"] == "validating":
            await self._status("in_progress")
        return items

    async def _fail(self, errors: list[dict[str, Any]]) -> None:
        for e in errors:
            e.setdefault("param", None)
            e.setdefault("line", None)
        self.log.warning("gateway_batch_invalid", errors=len(errors), first=errors[0]["message"])
        await self._status("failed", errors={"object": "list", "data": errors})

    def _write(self, line: dict[str, Any]) -> None:
        if self._out is None:
            self._out = open(self.work, "ab")
        self._out.write(orjson.dumps(line) + b"\n")
        self._out.flush()
        ok = line.get("error") is None
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        outcome = "ok" if ok else str((line.get("error") or {}).get("code", "error"))
        self.ctx.metrics.batch_requests.labels(outcome).inc()
        self._dirty = True

    async def _execute(self, items: list[BatchItem]) -> str:
        """Publish and collect; the status the batch ends with."""
        self.work.parent.mkdir(parents=True, exist_ok=True)
        done, _, _ = await asyncio.to_thread(settled_custom_ids, self.work, items)
        for raw in await asyncio.to_thread(self._read_work):
            if raw.get("error") is None:
                self.completed += 1
            else:
                self.failed += 1
        todo: list[BatchItem] = []
        models = self.record.get("_models")
        for item in items:
            if item.custom_id in done:
                continue
            if item.error is not None:
                self._write(_line_error(item.custom_id, *item.error))
                continue
            assert item.body is not None
            model = item.body.get("model")
            if models is not None and model not in models:
                self._write(
                    _line_error(
                        item.custom_id,
                        "model_not_found",
                        f"The model {model!r} does not exist or you do not have access to it.",
                    )
                )
                continue
            todo.append(item)
        publish, followers = plan_publish(todo)
        extra = {"tenant": self.record["_tenant"], "deadline": float(self.record["expires_at"])}
        if self.record.get("_priority") is not None:
            extra["priority"] = self.record["_priority"]
        for item in publish:
            assert item.body is not None
            item.body.update(extra)
        pending = {item.key: item for item in publish}
        if not pending:
            return "completed"
        return await self._exchange(publish, pending, followers)

    def _read_work(self) -> list[dict[str, Any]]:
        if not self.work.exists():
            return []
        out = []
        for line in self.work.read_bytes().splitlines():
            if line.strip():
                out.append(orjson.loads(line))
        return out

    async def _exchange(
        self, publish: list[BatchItem], pending: dict[str, BatchItem], followers: dict[str, list[BatchItem]]
    ) -> str:
        ctx = self.ctx
        window = asyncio.Semaphore(ctx.max_in_flight)
        all_done = asyncio.Event()

        def model_of(item: BatchItem, result: dict[str, Any]) -> str:
            body = item.body or {}
            return str(body.get("model") or result.get("served_model") or result.get("model") or "jaxserve")

        async def on_final(msg: Result) -> None:
            item = pending.pop(msg.id, None) if msg.id is not None else None
            if item is None:
                return  # a duplicate (at-least-once, or a republished job answered from the store)
            result = msg.to_dict()
            for one in (item, *followers.pop(item.key, ())):
                line = openai_format.output_line(
                    one.custom_id, result, self.endpoint, model_of(one, result), keys.line_id(one.custom_id, one.body)
                )
                self._write(line)
            ctx.events.add("answer", model_of(item, result), "batch")
            window.release()
            if not pending:
                all_done.set()

        # the queue outlives the window by a day; a fixed value, since a
        # gateway taking the batch over redeclares it with the same arguments
        window_s = int(self.record["expires_at"]) - int(self.record["created_at"])
        client = AsyncClient(
            ctx.amqp_url,
            prefix=ctx.prefix,
            reply_queue=f"{ctx.prefix}.reply.gw-{self.id}",
            reply_queue_expires_ms=(window_s + 86_400) * 1000,
            on_unclaimed=on_final,
            name=f"jaxserve-gateway-{self.id}",
        )
        await client.connect()
        keeper = asyncio.create_task(self._keep(all_done))
        try:
            publisher = asyncio.create_task(self._publish(client, publish, pending, window, on_final))
            stop = asyncio.create_task(self.cancel.wait())
            expiry = asyncio.create_task(asyncio.sleep(max(0.0, float(self.record["expires_at"]) - time.time())))
            finished = asyncio.create_task(all_done.wait())
            while True:
                done, _ = await asyncio.wait({stop, expiry, finished, publisher}, return_when=asyncio.FIRST_COMPLETED)
                failure = publisher.exception() if publisher in done and not publisher.cancelled() else None
                if failure is not None:
                    # the broker refused what retrying cannot cure (no queue under
                    # the prefix yet): this run ends, the adoption loop starts
                    # another in a few seconds, which resumes from the work file
                    for t in (stop, expiry, finished):
                        t.cancel()
                    raise failure
                if done - {publisher}:
                    break
            publisher.cancel()
            for t in (stop, expiry, finished):
                t.cancel()
            if all_done.is_set():
                end = "completed"
            else:
                end = "cancelled" if self.cancel.is_set() else "expired"
                if end == "cancelled":
                    await self._status("cancelling")
                await self._withdraw(client, pending, all_done)
                code, message = (
                    ("batch_cancelled", "This request was not run: the batch was cancelled.")
                    if end == "cancelled"
                    else ("batch_expired", "This request could not be executed before the completion window expired.")
                )
                for key in list(pending):
                    item = pending.pop(key)
                    for one in (item, *followers.pop(item.key, ())):
                        self._write(_line_error(one.custom_id, code, message))
            try:
                await client.delete_reply_queue()
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
            return end
        finally:
            keeper.cancel()
            await client.close()

    async def _publish(
        self,
        client: AsyncClient,
        publish: list[BatchItem],
        pending: dict[str, BatchItem],
        window: asyncio.Semaphore,
        on_final: Any,
    ) -> None:
        for item in publish:
            await window.acquire()
            if item.key not in pending:  # answered by a reply left from before a restart
                window.release()
                continue
            await publish_item(
                client,
                item,
                queue="batch",
                attempts=1_000_000,  # a full batch queue waits; the deadline or a cancel ends the wait
                on_final=on_final,
                priority=self.record.get("_priority"),
            )

    async def _withdraw(self, client: AsyncClient, pending: dict[str, BatchItem], all_done: asyncio.Event) -> None:
        """Cancel every job still out, and give their answers a moment to come back."""
        for key in list(pending):
            await client.cancel(key)
        try:
            await asyncio.wait_for(all_done.wait(), self.ctx.cancel_grace_s)
        except TimeoutError:
            pass

    async def _keep(self, all_done: asyncio.Event) -> None:
        """Every second: counts to the store, the lease renewed, a cancel
        asked through another replica noticed."""
        renewed = time.monotonic()
        while not all_done.is_set():
            await asyncio.sleep(1.0)
            if self._dirty:
                await self._save()
            if await self.ctx.store.cancel_requested(self.id):
                self.cancel.set()
            if time.monotonic() - renewed > self.ctx.lease_s / 3:
                if not await self.ctx.store.claim(self.id, self.ctx.owner, self.ctx.lease_s):
                    self.log.warning("gateway_batch_lease_lost")
                    self.cancel.set()
                renewed = time.monotonic()

    async def _finalize(self, end: str) -> None:
        """Split the work file into OpenAI's output (successes) and error
        files, register both, close the batch."""
        if self.record["status"] != "finalizing":
            await self._status("finalizing", _end_status=end)
        if self._out is not None:
            self._out.close()
            self._out = None
        lines = await asyncio.to_thread(self._read_work)
        self.completed = sum(1 for x in lines if x.get("error") is None)
        self.failed = len(lines) - self.completed
        fields: dict[str, Any] = {}
        for name, keep in (("output_file_id", True), ("error_file_id", False)):
            chosen = [x for x in lines if (x.get("error") is None) == keep]
            if not chosen and name == "error_file_id":
                continue
            file_id = self.record.get(name) or new_file_id()
            part = self.work.with_name(f"{name}.jsonl")
            part.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in chosen))
            size = await asyncio.to_thread(self.ctx.files.adopt, part, file_id)
            await self.ctx.files.register(
                file_id, size, f"{self.id}_{name.split('_')[0]}.jsonl", "batch_output", self.record["_tenant"]
            )
            fields[name] = file_id
        await self._status(end, **fields)
