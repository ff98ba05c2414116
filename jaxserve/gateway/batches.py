"""The Batch API's objects: create, read, list, cancel, and who runs what.

A batch is a record in the gateway store (OpenAI's Batch object, plus the
tenant, priority and models of the key that created it) and, while open,
a :class:`~jaxserve.gateway.batch_runner.BatchRunner` on the one replica
that holds its lease. :meth:`Batches.adopt` runs at start and then every few
seconds: it takes every open batch whose lease is free (a fresh start, a
replica that died), so a gateway restarted mid-batch picks each one up
where it was.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

import structlog

from jaxserve.gateway.batch_runner import ENDPOINTS, BatchRunner, RunnerContext
from jaxserve.gateway.errors import ApiError, invalid, not_found
from jaxserve.gateway.keys import Principal
from jaxserve.gateway.store import OPEN_STATUSES, public

log = structlog.get_logger("jaxserve.gateway")

_WINDOW = re.compile(r"^([1-9][0-9]*)(h|m|s)$")
_UNIT_S = {"h": 3600, "m": 60, "s": 1}
#: the longest completion_window accepted (a week)
MAX_WINDOW_S = 7 * 86400


def window_seconds(value: Any) -> int:
    """``completion_window`` in seconds: OpenAI's ``"24h"``, or any ``Nh``,
    ``Nm`` or ``Ns`` up to a week (a deadline of one's own choosing)."""
    m = _WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not m or seconds > MAX_WINDOW_S:
        raise invalid(
            f"completion_window must be '24h' (or any Nh, Nm, Ns up to 168h), got {value!r}",
            "completion_window",
            "invalid_value",
        )
    return seconds


class Batches:
    def __init__(self, ctx: RunnerContext, adopt_every_s: float = 5.0) -> None:
        self.ctx = ctx
        self.adopt_every_s = adopt_every_s
        self.runners: dict[str, BatchRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ running
    def _start(self, record: dict[str, Any]) -> None:
        runner = BatchRunner(self.ctx, record)
        self.runners[runner.id] = runner
        task = asyncio.create_task(self._guarded(runner), name=f"batch-{runner.id}")
        self._tasks[runner.id] = task

    async def _guarded(self, runner: BatchRunner) -> None:
        try:
            await runner.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # one batch's fault must not stop the gateway; another adoption retries it
            runner.log.exception("gateway_batch_crashed")
        finally:
            self.runners.pop(runner.id, None)
            self._tasks.pop(runner.id, None)

    async def adopt(self) -> int:
        """Start every open batch whose lease this gateway can take."""
        started = 0
        for record in await self.ctx.store.open_batches():
            if record["id"] in self.runners:
                continue
            if await self.ctx.store.claim(record["id"], self.ctx.owner, self.ctx.lease_s):
                log.info("gateway_batch_adopted", batch_id=record["id"], status=record["status"])
                self._start(record)
                started += 1
        return started

    async def run(self) -> None:
        """Adopt forever (a task of the app's lifespan); also refreshes the batch gauges."""
        while True:
            try:
                await self.adopt()
                await self._gauges()
            except Exception as exc:  # noqa: BLE001 - the store may be away for a while; try again
                log.warning("gateway_batch_adopt_failed", error=repr(exc))
            await asyncio.sleep(self.adopt_every_s)

    async def _gauges(self) -> None:
        counts = dict.fromkeys(OPEN_STATUSES, 0)
        for record in await self.ctx.store.open_batches():
            counts[record["status"]] = counts.get(record["status"], 0) + 1
        for status, n in counts.items():
            self.ctx.metrics.batches.labels(status).set(n)

    async def stop(self) -> None:
        """This gateway stops: its runners stop where they are and their
        leases are freed, so a restart (or another replica) resumes them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ API
    def _live(self, record: dict[str, Any]) -> dict[str, Any]:
        runner = self.runners.get(record["id"])
        out = public(record)
        if runner is not None:
            out["request_counts"] = runner.counts()
        return out

    async def _own(self, batch_id: str, principal: Principal) -> dict[str, Any]:
        record = await self.ctx.store.get_batch(batch_id)
        if record is None or record.get("_tenant") != principal.tenant:
            raise not_found(f"No batch found with id '{batch_id}'.", "batch_id")
        return record

    async def create(self, request: dict[str, Any], principal: Principal, priority: int | None) -> dict[str, Any]:
        endpoint = request.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise invalid(
                f"endpoint must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})", "endpoint", "invalid_value"
            )
        window_s = window_seconds(request.get("completion_window"))
        metadata = request.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > 16
            or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise invalid(
                "metadata is at most 16 string pairs (keys up to 64, values up to 512 characters)", "metadata"
            )
        file_id = request.get("input_file_id")
        if not isinstance(file_id, str):
            raise invalid("input_file_id is a required string", "input_file_id", "missing_required_parameter")
        record_file = await self.ctx.files.get(file_id, principal.tenant)
        if record_file["purpose"] != "batch":
            raise invalid(
                f"input_file_id {file_id} has purpose {record_file['purpose']!r}; a batch reads a file of purpose 'batch'",
                "input_file_id",
            )
        now = int(time.time())
        record: dict[str, Any] = {
            "id": "batch_" + uuid.uuid4().hex[:24],
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": request["completion_window"],
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + window_s,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
            "_tenant": principal.tenant,
            "_priority": priority,
            "_models": None if principal.models is None else sorted(principal.models),
        }
        await self.ctx.store.put_batch(record)
        if await self.ctx.store.claim(record["id"], self.ctx.owner, self.ctx.lease_s):
            self._start(record)
        log.info("gateway_batch_created", batch_id=record["id"], tenant=principal.tenant, input_file_id=file_id)
        return public(record)

    async def get(self, batch_id: str, principal: Principal) -> dict[str, Any]:
        return self._live(await self._own(batch_id, principal))

    async def listing(self, principal: Principal, after: str | None, limit: int) -> dict[str, Any]:
        records = await self.ctx.store.list_batches(principal.tenant, limit + 1, after)
        data = [self._live(r) for r in records[:limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(records) > limit,
        }

    async def cancel(self, batch_id: str, principal: Principal) -> dict[str, Any]:
        record = await self._own(batch_id, principal)
        if record["status"] not in ("validating", "in_progress", "cancelling"):
            raise ApiError(
                409,
                f"Cannot cancel a batch with status {record['status']!r}.",
                "invalid_request_error",
                None,
                "batch_not_cancellable",
            )
        await self.ctx.store.request_cancel(batch_id)
        runner = self.runners.get(batch_id)
        if runner is not None:
            runner.cancel.set()
        out = self._live(record)
        out["status"] = "cancelling"
        out["cancelling_at"] = out.get("cancelling_at") or int(time.time())
        return out

    async def everyone(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest batches of every tenant (the status page), live counts first-hand."""
        return [{**self._live(r), "tenant": r.get("_tenant")} for r in await self.ctx.store.list_batches(None, limit)]
