"""Where the gateway keeps files and batches: the one interface, and the
choice between its two homes.

Synchronous requests keep nothing here (the broker and the workers' store
hold them). Files and batches are records (JSON objects: OpenAI's fields,
plus internal ones whose names start with ``_``, never shown) and a lease
per batch, so exactly one gateway replica runs a batch at a time and
another takes it over when that one's lease runs out:

* :class:`~jaxserve.gateway.store_sqlite.SqliteGatewayStore` (the default):
  a file under ``--state-dir``, for one gateway (or several on one host);
* :class:`~jaxserve.gateway.store_redis.RedisGatewayStore` (``--store
  redis``): the Redis the workers use, for replicas on several hosts (with
  a shared ``--files-dir``).

``tests/test_gateway_store.py`` runs the same checks on both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

#: batch statuses that still have work: a gateway (re)starting picks these up
OPEN_STATUSES = frozenset({"validating", "in_progress", "finalizing", "cancelling"})


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The record as the API shows it (internal ``_`` fields dropped)."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


class GatewayStore(Protocol):
    async def put_file(self, record: dict[str, Any]) -> None: ...

    async def get_file(self, file_id: str) -> dict[str, Any] | None: ...

    async def delete_file(self, file_id: str) -> bool: ...

    async def list_files(self, tenant: str, limit: int) -> list[dict[str, Any]]:
        """The tenant's files, newest first."""
        ...

    async def put_batch(self, record: dict[str, Any]) -> None: ...

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None: ...

    async def list_batches(self, tenant: str | None, limit: int, after: str | None = None) -> list[dict[str, Any]]:
        """Newest first; ``tenant`` None: every tenant's (the status page);
        ``after``: the batches created before that one (OpenAI's cursor)."""
        ...

    async def open_batches(self) -> list[dict[str, Any]]: ...

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Take the batch's lease for ``owner``, or renew it; False while
        another owner holds it."""
        ...

    async def release(self, batch_id: str, owner: str) -> None: ...

    async def request_cancel(self, batch_id: str) -> None:
        """Ask whoever runs the batch to cancel it (a flag apart from the
        record, which its runner rewrites every second)."""
        ...

    async def cancel_requested(self, batch_id: str) -> bool: ...

    async def close(self) -> None: ...


def make_store(kind: str, *, state_dir: Path, redis_url: str, namespace: str) -> GatewayStore:
    if kind == "redis":
        from jaxserve.gateway.store_redis import RedisGatewayStore

        return RedisGatewayStore(redis_url, namespace=namespace)
    if kind == "sqlite":
        from jaxserve.gateway.store_sqlite import SqliteGatewayStore

        return SqliteGatewayStore(state_dir / f"gateway-{namespace}.sqlite3")
    raise ValueError(f"--store must be sqlite or redis, got {kind!r}")
