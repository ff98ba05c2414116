"""Idempotency store: job key -> final result, plus in-progress claims.

A record is ``{"result": <final result message>, "delivered": [DEST, ...]}``
where DEST is ``"<reply_to>|<correlation_id>"``: the reply destinations that
already received this final result (so a redelivery of the same message is
acked without a duplicate reply, while a second job with the same key but
another destination gets a replay).

Two backends:

* :class:`MemoryStore` (default): bounded LRU in the worker process.
* :class:`RedisStore`: shared by many workers. ``claim`` is ``SET NX PX``
  with a lease the owner renews while it runs the job, so a key in progress
  on one worker is not started on another; a crashed owner's lease expires.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Protocol

import orjson


class IdempotencyStore(Protocol):
    async def get(self, key: str) -> dict[str, Any] | None: ...
    async def put(self, key: str, result: dict[str, Any], delivered: list[str] | None = None) -> None: ...
    async def mark_delivered(self, key: str, dest: str) -> None: ...
    async def claim(self, key: str, owner: str, lease_s: float) -> str | None: ...
    async def renew(self, key: str, owner: str, lease_s: float) -> bool: ...
    async def release(self, key: str, owner: str) -> None: ...
    async def mark_cancelled(self, key: str, ttl_s: float) -> None: ...
    async def is_cancelled(self, key: str) -> bool: ...
    async def close(self) -> None: ...


class MemoryStore:
    """In-process store, bounded to ``max_entries`` results (LRU)."""

    def __init__(self, max_entries: int = 100_000, cancel_ttl_s: float = 600.0) -> None:
        self.max_entries = max_entries
        self._results: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._claims: dict[str, tuple[str, float]] = {}
        self._cancelled: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._cancel_ttl = cancel_ttl_s

    async def get(self, key: str) -> dict[str, Any] | None:
        rec = self._results.get(key)
        if rec is not None:
            self._results.move_to_end(key)
        return rec

    async def put(self, key: str, result: dict[str, Any], delivered: list[str] | None = None) -> None:
        self._results[key] = {"result": result, "delivered": list(delivered or [])}
        self._results.move_to_end(key)
        while len(self._results) > self.max_entries:
            self._results.popitem(last=False)
        self._claims.pop(key, None)

    async def mark_delivered(self, key: str, dest: str) -> None:
        rec = self._results.get(key)
        if rec is not None and dest not in rec["delivered"]:
            rec["delivered"].append(dest)

    async def claim(self, key: str, owner: str, lease_s: float) -> str | None:
        now = time.monotonic()
        held = self._claims.get(key)
        if held is not None and held[0] != owner and held[1] > now:
            return held[0]
        self._claims[key] = (owner, now + lease_s)
        return None

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        held = self._claims.get(key)
        if held is None or held[0] != owner:
            return False
        self._claims[key] = (owner, time.monotonic() + lease_s)
        return True

    async def release(self, key: str, owner: str) -> None:
        held = self._claims.get(key)
        if held is not None and held[0] == owner:
            del self._claims[key]

    async def mark_cancelled(self, key: str, ttl_s: float) -> None:
        now = time.monotonic()
        self._cancelled[key] = now + ttl_s
        self._cancelled.move_to_end(key)
        while self._cancelled:
            k, exp = next(iter(self._cancelled.items()))
            if exp > now and len(self._cancelled) <= self.max_entries:
                break
            self._cancelled.popitem(last=False)

    async def is_cancelled(self, key: str) -> bool:
        exp = self._cancelled.get(key)
        return exp is not None and exp > time.monotonic()

    async def close(self) -> None:
        pass


# Release a claim only if we still own it.
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end
"""
_RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end
"""


class RedisStore:
    """Shared store in Redis. Results expire after ``result_ttl_s``."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, namespace: str = "jaxserve", result_ttl_s: float = 86400.0) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.from_url(url)
        self.ns = namespace
        self.result_ttl_ms = int(result_ttl_s * 1000)
        self._release = self._r.register_script(_RELEASE_LUA)
        self._renew = self._r.register_script(_RENEW_LUA)

    def _k(self, kind: str, key: str) -> str:
        return f"{self.ns}:{kind}:{key}"

    async def get(self, key: str) -> dict[str, Any] | None:
        raw = await self._r.get(self._k("result", key))
        return None if raw is None else orjson.loads(raw)

    async def put(self, key: str, result: dict[str, Any], delivered: list[str] | None = None) -> None:
        rec = orjson.dumps({"result": result, "delivered": list(delivered or [])})
        async with self._r.pipeline(transaction=True) as p:
            p.set(self._k("result", key), rec, px=self.result_ttl_ms)
            p.delete(self._k("claim", key))
            await p.execute()

    async def mark_delivered(self, key: str, dest: str) -> None:
        rec = await self.get(key)
        if rec is not None and dest not in rec["delivered"]:
            rec["delivered"].append(dest)
            await self._r.set(self._k("result", key), orjson.dumps(rec), px=self.result_ttl_ms)

    async def claim(self, key: str, owner: str, lease_s: float) -> str | None:
        k = self._k("claim", key)
        ok = await self._r.set(k, owner, nx=True, px=max(1, int(lease_s * 1000)))
        if ok:
            return None
        held = await self._r.get(k)
        if held is None:  # expired in between: try once more
            ok = await self._r.set(k, owner, nx=True, px=max(1, int(lease_s * 1000)))
            return None if ok else "unknown"
        held = held.decode() if isinstance(held, bytes) else str(held)
        return None if held == owner else held

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        return bool(await self._renew(keys=[self._k("claim", key)], args=[owner, max(1, int(lease_s * 1000))]))

    async def release(self, key: str, owner: str) -> None:
        await self._release(keys=[self._k("claim", key)], args=[owner])

    async def mark_cancelled(self, key: str, ttl_s: float) -> None:
        await self._r.set(self._k("cancel", key), b"1", px=max(1, int(ttl_s * 1000)))

    async def is_cancelled(self, key: str) -> bool:
        return bool(await self._r.exists(self._k("cancel", key)))

    async def close(self) -> None:
        await self._r.aclose()


def make_store(kind: str, *, redis_url: str | None = None, namespace: str = "jaxserve", max_entries: int = 100_000) -> Any:
    if kind == "memory":
        return MemoryStore(max_entries=max_entries)
    if kind == "redis":
        return RedisStore(redis_url or "redis://127.0.0.1:6379/0", namespace=namespace)
    raise ValueError(f"unknown store {kind!r}; expected 'memory' or 'redis'")
