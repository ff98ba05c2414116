"""In-process store: bounded LRU, gone with the process (``--store memory``)."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

from jaxserve.worker.store.base import Record, TokenChunk


class MemoryStore:
    """Results bounded to ``max_entries`` (least recently used go first);
    cancels live ``ttl_s`` and are bounded the same way, and so are the
    saved tokens of running jobs (useful only to a worker of this process
    taking a job back, as the tests do)."""

    def __init__(self, max_entries: int = 100_000, max_cached_responses: int = 10_000) -> None:
        self.max_entries = max_entries
        self.max_cached_responses = max_cached_responses
        self._responses: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._results: collections.OrderedDict[str, Record] = collections.OrderedDict()
        self._claims: dict[str, tuple[str, float]] = {}
        self._cancelled: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._tokens: collections.OrderedDict[str, list[TokenChunk]] = collections.OrderedDict()

    async def ping(self) -> None:
        pass  # in this process: always there

    async def get(self, key: str) -> Record | None:
        rec = self._results.get(key)
        if rec is not None:
            self._results.move_to_end(key)
        return rec

    async def put(self, key: str, record: Record) -> None:
        self._results[key] = Record(dict(record.result), list(record.delivered), record.fingerprint)
        self._results.move_to_end(key)
        while len(self._results) > self.max_entries:
            self._results.popitem(last=False)
        self._claims.pop(key, None)
        self._tokens.pop(key, None)

    async def save_tokens(self, chunks: Sequence[tuple[str, TokenChunk]]) -> None:
        for key, chunk in chunks:
            self._tokens.setdefault(key, []).append(chunk)
            self._tokens.move_to_end(key)
        while len(self._tokens) > self.max_entries:
            self._tokens.popitem(last=False)

    async def saved_tokens(self, key: str) -> list[TokenChunk]:
        return list(self._tokens.get(key, ()))

    async def drop_tokens(self, key: str) -> None:
        self._tokens.pop(key, None)

    async def mark_delivered(self, key: str, dest: str) -> None:
        rec = self._results.get(key)
        if rec is not None and dest not in rec.delivered:
            rec.delivered.append(dest)

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
            oldest, expires = next(iter(self._cancelled.items()))
            if expires > now and len(self._cancelled) <= self.max_entries:
                break
            del self._cancelled[oldest]

    async def is_cancelled(self, key: str) -> bool:
        expires = self._cancelled.get(key)
        return expires is not None and expires > time.monotonic()

    async def cache_get(self, cache_key: str) -> dict | None:
        hit = self._responses.get(cache_key)
        if hit is not None:
            self._responses.move_to_end(cache_key)
        return hit

    async def cache_put(self, cache_key: str, result: dict) -> None:
        self._responses[cache_key] = dict(result)
        self._responses.move_to_end(cache_key)
        while len(self._responses) > self.max_cached_responses:
            self._responses.popitem(last=False)

    async def close(self) -> None:
        pass
