"""Shared store in Redis (``--store redis``): many workers, one truth.

``claim`` is ``SET NX PX`` with a lease the owner renews while it runs the
job, so a key in progress on one worker is not started on another; a crashed
owner's lease runs out. Every call has a socket timeout, and every failure
to reach Redis is :class:`StoreUnavailable`, so an outage makes the worker
wait instead of hanging or failing jobs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import orjson

from jaxserve.worker.store.base import Record, StoreUnavailable, TokenChunk

T = TypeVar("T")

# Extend or drop a claim only while we still own it.
_RELEASE_LUA = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore:
    """Results and their delivered sets expire after ``result_ttl_s``, and
    so do a job's saved tokens after its last save."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "jaxserve",
        result_ttl_s: float = 86400.0,
        timeout_s: float = 2.0,
    ) -> None:
        import redis.asyncio as aioredis
        import redis.exceptions

        self._r = aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._errors: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            OSError,
            TimeoutError,
        )
        self.ns = namespace
        self.result_ttl_ms = _ms(result_ttl_s)
        self._release = self._r.register_script(_RELEASE_LUA)
        self._renew = self._r.register_script(_RENEW_LUA)

    def _k(self, kind: str, key: str) -> str:
        return f"{self.ns}:{kind}:{key}"

    async def _call(self, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except self._errors as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        await self._call(self._r.ping())

    async def get(self, key: str) -> Record | None:
        async def fetch() -> tuple[Any, Any]:
            async with self._r.pipeline(transaction=False) as p:
                p.get(self._k("result", key))
                p.smembers(self._k("delivered", key))
                return tuple(await p.execute())

        raw, delivered = await self._call(fetch())
        if raw is None:
            return None
        rec = Record.from_json(orjson.loads(raw))
        rec.delivered = sorted({*rec.delivered, *(d.decode() if isinstance(d, bytes) else str(d) for d in delivered)})
        return rec

    async def put(self, key: str, record: Record) -> None:
        async def write() -> None:
            async with self._r.pipeline(transaction=True) as p:
                p.set(self._k("result", key), orjson.dumps(record.to_json()), px=self.result_ttl_ms)
                if record.delivered:
                    p.sadd(self._k("delivered", key), *record.delivered)
                    p.pexpire(self._k("delivered", key), self.result_ttl_ms)
                p.delete(self._k("claim", key))
                p.delete(self._k("tokens", key))
                await p.execute()

        await self._call(write())

    async def save_tokens(self, chunks: Sequence[tuple[str, TokenChunk]]) -> None:
        """One pipeline: each chunk pushed to its key's list, whose expiry
        restarts."""

        async def write() -> None:
            async with self._r.pipeline(transaction=False) as p:
                for key, chunk in chunks:
                    p.rpush(self._k("tokens", key), orjson.dumps(chunk.to_json()))
                    p.pexpire(self._k("tokens", key), self.result_ttl_ms)
                await p.execute()

        await self._call(write())

    async def saved_tokens(self, key: str) -> list[TokenChunk]:
        raw = await self._call(self._r.lrange(self._k("tokens", key), 0, -1))
        return [TokenChunk.from_json(orjson.loads(item)) for item in raw]

    async def drop_tokens(self, key: str) -> None:
        await self._call(self._r.delete(self._k("tokens", key)))

    async def mark_delivered(self, key: str, dest: str) -> None:
        async def write() -> None:
            async with self._r.pipeline(transaction=True) as p:
                p.sadd(self._k("delivered", key), dest)
                p.pexpire(self._k("delivered", key), self.result_ttl_ms)
                await p.execute()

        await self._call(write())

    async def claim(self, key: str, owner: str, lease_s: float) -> str | None:
        k = self._k("claim", key)
        for _ in range(2):  # a claim that expires between SET and GET: try once more
            if await self._call(self._r.set(k, owner, nx=True, px=_ms(lease_s))):
                return None
            held = await self._call(self._r.get(k))
            if held is not None:
                held = held.decode() if isinstance(held, bytes) else str(held)
                return None if held == owner else held
        return "unknown"

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        return bool(await self._call(self._renew(keys=[self._k("claim", key)], args=[owner, _ms(lease_s)])))

    async def release(self, key: str, owner: str) -> None:
        await self._call(self._release(keys=[self._k("claim", key)], args=[owner]))

    async def mark_cancelled(self, key: str, ttl_s: float) -> None:
        await self._call(self._r.set(self._k("cancel", key), b"1", px=_ms(ttl_s)))

    async def is_cancelled(self, key: str) -> bool:
        return bool(await self._call(self._r.exists(self._k("cancel", key))))

    async def cache_get(self, cache_key: str) -> dict | None:
        raw = await self._call(self._r.get(self._k("response", cache_key)))
        return None if raw is None else orjson.loads(raw)

    async def cache_put(self, cache_key: str, result: dict) -> None:
        # Bounded by the TTL (and by Redis' own maxmemory policy, if set).
        await self._call(self._r.set(self._k("response", cache_key), orjson.dumps(result), px=self.result_ttl_ms))

    async def close(self) -> None:
        try:
            await self._r.aclose()
        except self._errors:
            pass
