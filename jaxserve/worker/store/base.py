"""What every idempotency store offers, and the one error they raise.

A store maps a job key to its final result (a :class:`Record`), holds the
claims that keep a key from running on two workers at once, remembers
cancels, keeps the tokens of running jobs as they are generated (a
:class:`TokenChunk` at a time: a job whose worker dies continues from them
on the next, ``jaxserve.worker.progress``), and keeps the bounded response
cache (deterministic results by what determines them, shared by every
worker on the same backend). Backends: :mod:`.sqlite` (the default: a durable file, so a worker
killed between publishing a result and acking it answers the redelivery from
disk), :mod:`.memory` (per process, bounded) and :mod:`.redis` (shared by
many workers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol


class StoreUnavailable(Exception):
    """The store could not be reached (Redis down, a timeout). The worker
    never answers a job with an error because of it: it stops taking jobs,
    holds the ones it has for a bounded time, gives them back to the broker,
    and probes the store (``ping``) until it answers
    (``jaxserve.worker.store_health``)."""


@dataclasses.dataclass
class Record:
    """A key's final result, the reply destinations that received it
    (``"<reply_to>|<correlation_id>"``), and the fingerprint of the job body
    that produced it (None for records written before fingerprints)."""

    result: dict[str, Any]
    delivered: list[str] = dataclasses.field(default_factory=list)
    fingerprint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, "delivered": self.delivered, "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        return cls(dict(data["result"]), list(data.get("delivered") or []), data.get("fingerprint"))


@dataclasses.dataclass(frozen=True)
class TokenChunk:
    """Tokens a running job generated, from output position ``start`` on,
    with their logprobs where the job asks for them. A job's chunks, read
    back in the order written, give its output so far (a chunk overrides
    what earlier chunks said from its ``start`` on). ``fingerprint``: the
    job body's, and ``model``: the served model that generated them, so a
    key reused for another body, or served by another model, never
    continues these tokens."""

    start: int
    token_ids: tuple[int, ...]
    fingerprint: str | None
    model: str | None
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"start": self.start, "tokens": list(self.token_ids)}
        data.update(fingerprint=self.fingerprint, model=self.model)
        if self.logprobs is not None:
            data["logprobs"] = list(self.logprobs)
        if self.top_logprobs is not None:
            data["top"] = [[list(pair) for pair in row] for row in self.top_logprobs]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenChunk:
        top = data.get("top")
        logprobs = data.get("logprobs")
        return cls(
            int(data["start"]),
            tuple(int(t) for t in data["tokens"]),
            data.get("fingerprint"),
            data.get("model"),
            None if logprobs is None else tuple(float(x) for x in logprobs),
            None if top is None else tuple(tuple((int(t), float(lp)) for t, lp in row) for row in top),
        )


class IdempotencyStore(Protocol):
    async def ping(self) -> None:
        """Return when the store answers; :class:`StoreUnavailable` when
        it does not (the outage probe's question)."""

    async def get(self, key: str) -> Record | None: ...
    async def put(self, key: str, record: Record) -> None:
        """Store the key's result; its claim and its saved tokens end with it."""

    async def save_tokens(self, chunks: Sequence[tuple[str, TokenChunk]]) -> None:
        """Append each (key, chunk) to its key's saved tokens: the chunks of
        every running job at once, in one write."""

    async def saved_tokens(self, key: str) -> list[TokenChunk]:
        """The key's saved chunks, in the order they were written."""

    async def drop_tokens(self, key: str) -> None: ...
    async def mark_delivered(self, key: str, dest: str) -> None: ...
    async def claim(self, key: str, owner: str, lease_s: float) -> str | None:
        """Take the key for ``owner``; None on success, else the holder."""

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        """Extend ``owner``'s claim; False when it is no longer held by it."""

    async def release(self, key: str, owner: str) -> None: ...
    async def mark_cancelled(self, key: str, ttl_s: float) -> None: ...
    async def is_cancelled(self, key: str) -> bool: ...
    async def cache_get(self, cache_key: str) -> dict[str, Any] | None:
        """The response cache: a deterministic job's result by what
        determines it (model, prompt ids, parameters), whatever its key."""

    async def cache_put(self, cache_key: str, result: dict[str, Any]) -> None: ...
    async def close(self) -> None: ...
