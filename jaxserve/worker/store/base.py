"""What every idempotency store offers, and the one error they raise.

A store maps a job key to its final result (a :class:`Record`), holds the
claims that keep a key from running on two workers at once, remembers
cancels, and keeps the bounded response cache (deterministic results by
what determines them, shared by every worker on the same backend). Backends: :mod:`.sqlite` (the default: a durable file, so a worker
killed between publishing a result and acking it answers the redelivery from
disk), :mod:`.memory` (per process, bounded) and :mod:`.redis` (shared by
many workers).
"""

from __future__ import annotations

import dataclasses
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


class IdempotencyStore(Protocol):
    async def ping(self) -> None:
        """Return when the store answers; :class:`StoreUnavailable` when
        it does not (the outage probe's question)."""

    async def get(self, key: str) -> Record | None: ...
    async def put(self, key: str, record: Record) -> None: ...
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
