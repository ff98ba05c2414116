"""The gateway's files and batches in one SQLite file (the default home).

WAL mode, one connection, every call on a worker thread
(``asyncio.to_thread``) behind a lock, so a slow disk never stalls the
event loop that streams tokens. Several gateways on one host may share the
file: the lease column decides who runs each batch.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from jaxserve.gateway.store import OPEN_STATUSES

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, created);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL, status TEXT NOT NULL, data BLOB NOT NULL,
    owner TEXT, lease_until REAL NOT NULL DEFAULT 0, cancel INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
"""


class SqliteGatewayStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn(self._db)

        return await asyncio.to_thread(locked)

    # ------------------------------------------------------------ files
    async def put_file(self, record: dict[str, Any]) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO files (id, tenant, created, data) VALUES (?, ?, ?, ?)",
                (record["id"], record["_tenant"], record["created_at"], orjson.dumps(record)),
            )
        )

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        row = await self._run(lambda db: db.execute("SELECT data FROM files WHERE id = ?", (file_id,)).fetchone())
        return None if row is None else orjson.loads(row[0])

    async def delete_file(self, file_id: str) -> bool:
        cur = await self._run(lambda db: db.execute("DELETE FROM files WHERE id = ?", (file_id,)))
        return cur.rowcount > 0

    async def list_files(self, tenant: str, limit: int) -> list[dict[str, Any]]:
        rows = await self._run(
            lambda db: db.execute(
                "SELECT data FROM files WHERE tenant = ? ORDER BY created DESC, id DESC LIMIT ?", (tenant, limit)
            ).fetchall()
        )
        return [orjson.loads(r[0]) for r in rows]

    # ------------------------------------------------------------ batches
    async def put_batch(self, record: dict[str, Any]) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT INTO batches (id, tenant, created, status, data) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET status = excluded.status, data = excluded.data",
                (record["id"], record["_tenant"], record["created_at"], record["status"], orjson.dumps(record)),
            )
        )

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        row = await self._run(lambda db: db.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone())
        return None if row is None else orjson.loads(row[0])

    async def list_batches(self, tenant: str | None, limit: int, after: str | None = None) -> list[dict[str, Any]]:
        def query(db: sqlite3.Connection) -> list[Any]:
            where, args = [], []
            if tenant is not None:
                where.append("tenant = ?")
                args.append(tenant)
            if after is not None:
                row = db.execute("SELECT created FROM batches WHERE id = ?", (after,)).fetchone()
                if row is not None:
                    where.append("(created < ? OR (created = ? AND id < ?))")
                    args += [row[0], row[0], after]
            sql = "SELECT data FROM batches" + (" WHERE " + " AND ".join(where) if where else "")
            return db.execute(sql + " ORDER BY created DESC, id DESC LIMIT ?", (*args, limit)).fetchall()

        return [orjson.loads(r[0]) for r in await self._run(query)]

    async def open_batches(self) -> list[dict[str, Any]]:
        marks = ",".join("?" * len(OPEN_STATUSES))
        rows = await self._run(
            lambda db: db.execute(
                f"SELECT data FROM batches WHERE status IN ({marks}) ORDER BY created", tuple(OPEN_STATUSES)
            ).fetchall()
        )
        return [orjson.loads(r[0]) for r in rows]

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        now = time.time()
        cur = await self._run(
            lambda db: db.execute(
                "UPDATE batches SET owner = ?, lease_until = ? WHERE id = ? AND (owner IS NULL OR owner = ? "
                "OR lease_until < ?)",
                (owner, now + lease_s, batch_id, owner, now),
            )
        )
        return cur.rowcount > 0

    async def release(self, batch_id: str, owner: str) -> None:
        await self._run(
            lambda db: db.execute(
                "UPDATE batches SET owner = NULL, lease_until = 0 WHERE id = ? AND owner = ?", (batch_id, owner)
            )
        )

    async def request_cancel(self, batch_id: str) -> None:
        await self._run(lambda db: db.execute("UPDATE batches SET cancel = 1 WHERE id = ?", (batch_id,)))

    async def cancel_requested(self, batch_id: str) -> bool:
        row = await self._run(lambda db: db.execute("SELECT cancel FROM batches WHERE id = ?", (batch_id,)).fetchone())
        return bool(row and row[0])

    async def close(self) -> None:
        await self._run(lambda db: db.close())
