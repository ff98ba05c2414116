"""Idempotency stores: a job key's final result, claims, cancels and the
tokens of jobs still running.

``make_store`` builds the one ``jaxserve worker --store`` names:
``sqlite`` (default, a durable file under ``--state-dir``), ``memory`` or
``redis``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxserve.worker.store.base import IdempotencyStore, Record, StoreUnavailable, TokenChunk
from jaxserve.worker.store.memory import MemoryStore
from jaxserve.worker.store.redis import RedisStore
from jaxserve.worker.store.sqlite import SqliteStore, default_state_dir

STORE_KINDS = ("sqlite", "memory", "redis")


def make_store(
    kind: str,
    *,
    redis_url: str | None = None,
    namespace: str = "jaxserve",
    state_dir: str | Path | None = None,
    max_entries: int = 100_000,
) -> Any:
    if kind == "sqlite":
        folder = Path(state_dir) if state_dir is not None else default_state_dir()
        return SqliteStore(folder / f"store-{namespace}.sqlite3")
    if kind == "memory":
        return MemoryStore(max_entries=max_entries)
    if kind == "redis":
        return RedisStore(redis_url or "redis://127.0.0.1:6379/0", namespace=namespace)
    raise ValueError(f"unknown store {kind!r}; expected one of {', '.join(STORE_KINDS)}")


__all__ = [
    "STORE_KINDS",
    "IdempotencyStore",
    "MemoryStore",
    "Record",
    "RedisStore",
    "SqliteStore",
    "StoreUnavailable",
    "TokenChunk",
    "default_state_dir",
    "make_store",
]
