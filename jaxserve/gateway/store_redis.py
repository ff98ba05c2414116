"""The gateway's files and batches in Redis (``--store redis``), for
several gateway replicas: the same Redis the workers keep their
idempotency store and limits in, under ``<prefix>:gateway:``.

A batch's lease is one key written with ``SET NX PX`` and renewed by a
short script that checks the owner, so two replicas never run one batch
and a replica's death frees its batches when the lease runs out.
"""

from __future__ import annotations

from typing import Any

import orjson
import redis.asyncio as aioredis

from jaxserve.gateway.store import OPEN_STATUSES

# take the lease if free or ours; renew it if ours
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisGatewayStore:
    def __init__(self, url: str, *, namespace: str) -> None:
        self._r = aioredis.Redis.from_url(url)
        self._ns = f"{namespace}:gateway"

    def _k(self, *parts: str) -> str:
        return ":".join((self._ns, *parts))

    # ------------------------------------------------------------ files
    async def put_file(self, record: dict[str, Any]) -> None:
        async with self._r.pipeline(transaction=True) as p:
            p.set(self._k("file", record["id"]), orjson.dumps(record))
            p.zadd(self._k("files", record["_tenant"]), {record["id"]: record["created_at"]})
            await p.execute()

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        raw = await self._r.get(self._k("file", file_id))
        return None if raw is None else orjson.loads(raw)

    async def delete_file(self, file_id: str) -> bool:
        record = await self.get_file(file_id)
        if record is None:
            return False
        async with self._r.pipeline(transaction=True) as p:
            p.delete(self._k("file", file_id))
            p.zrem(self._k("files", record["_tenant"]), file_id)
            await p.execute()
        return True

    async def list_files(self, tenant: str, limit: int) -> list[dict[str, Any]]:
        ids = await self._r.zrevrange(self._k("files", tenant), 0, limit - 1)
        return await self._many("file", ids)

    async def _many(self, kind: str, ids: list[Any]) -> list[dict[str, Any]]:
        if not ids:
            return []
        raws = await self._r.mget([self._k(kind, i.decode() if isinstance(i, bytes) else i) for i in ids])
        return [orjson.loads(r) for r in raws if r is not None]

    # ------------------------------------------------------------ batches
    async def put_batch(self, record: dict[str, Any]) -> None:
        bid = record["id"]
        async with self._r.pipeline(transaction=True) as p:
            p.set(self._k("batch", bid), orjson.dumps(record))
            p.zadd(self._k("batches", record["_tenant"]), {bid: record["created_at"]})
            p.zadd(self._k("batches"), {bid: record["created_at"]})
            if record["status"] in OPEN_STATUSES:
                p.sadd(self._k("open"), bid)
            else:
                p.srem(self._k("open"), bid)
            await p.execute()

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        raw = await self._r.get(self._k("batch", batch_id))
        return None if raw is None else orjson.loads(raw)

    async def list_batches(self, tenant: str | None, limit: int, after: str | None = None) -> list[dict[str, Any]]:
        index = self._k("batches", tenant) if tenant is not None else self._k("batches")
        start = 0
        if after is not None:
            rank = await self._r.zrevrank(index, after)
            start = 0 if not isinstance(rank, int) else rank + 1
        ids = await self._r.zrevrange(index, start, start + limit - 1)
        return await self._many("batch", ids)

    async def open_batches(self) -> list[dict[str, Any]]:
        records = await self._many("batch", list(await self._r.smembers(self._k("open"))))
        return sorted(records, key=lambda r: r["created_at"])

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        got = await self._r.eval(_CLAIM, 1, self._k("lease", batch_id), owner, int(lease_s * 1000))
        return bool(got)

    async def release(self, batch_id: str, owner: str) -> None:
        await self._r.eval(_RELEASE, 1, self._k("lease", batch_id), owner)

    async def request_cancel(self, batch_id: str) -> None:
        await self._r.set(self._k("cancel", batch_id), b"1", ex=7 * 86400)

    async def cancel_requested(self, batch_id: str) -> bool:
        return bool(await self._r.exists(self._k("cancel", batch_id)))

    async def close(self) -> None:
        await self._r.aclose()
