"""Durable store in one SQLite file (``--store sqlite``, the default).

Why a file by default: a worker killed between publishing a job's final
result and acking it gets that delivery back after the restart; with the
result on disk the redelivery is answered from it (same text, ``replayed``)
instead of being run again with a different sample. WAL mode with
``synchronous=NORMAL`` survives a killed process (the OS has the pages);
only a power loss can drop the last transactions.

Several workers on one host may share the file: claims are rows with an
expiry, and a claim whose owner process is gone counts as free (so a
restarted worker picks up its own redeliveries at once).

Calls are synchronous and short (no fsync per commit in WAL/NORMAL), so
they run on the event loop; a locked database after ``busy_timeout`` is
:class:`StoreUnavailable` and the worker retries.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from jaxserve.worker.store.base import Record, StoreUnavailable, TokenChunk

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, record BLOB NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS results_expires ON results (expires);
CREATE TABLE IF NOT EXISTS delivered (key TEXT NOT NULL, dest TEXT NOT NULL, PRIMARY KEY (key, dest));
CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, owner TEXT NOT NULL, pid INTEGER NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS cancels (key TEXT PRIMARY KEY, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS responses (ckey TEXT PRIMARY KEY, result BLOB NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires);
CREATE TABLE IF NOT EXISTS saved_tokens (key TEXT NOT NULL, chunk BLOB NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS saved_tokens_key ON saved_tokens (key);
"""


def default_state_dir() -> Path:
    """``$JAXSERVE_STATE_DIR``, else ``$XDG_STATE_HOME/jaxserve``, else
    ``~/.local/state/jaxserve``."""
    env = os.environ.get("JAXSERVE_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "jaxserve"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SqliteStore:
    """Results kept ``result_ttl_s`` and at most ``max_entries`` (oldest go
    first, pruned every ``prune_every`` writes); the response cache likewise,
    at most ``max_cached_responses``."""

    def __init__(
        self,
        path: str | Path,
        *,
        result_ttl_s: float = 7 * 86400.0,
        max_entries: int = 1_000_000,
        max_cached_responses: int = 100_000,
        prune_every: int = 1000,
        busy_timeout_ms: int = 2000,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.result_ttl_s = result_ttl_s
        self.max_entries = max_entries
        self.max_cached_responses = max_cached_responses
        self.prune_every = prune_every
        self._writes = 0
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._pid = os.getpid()

    def _run(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, args)
        except sqlite3.OperationalError as exc:  # locked / busy / disk I/O
            raise StoreUnavailable(f"sqlite {self.path}: {exc}") from exc

    async def ping(self) -> None:
        self._run("SELECT 1")

    async def get(self, key: str) -> Record | None:
        row = self._run("SELECT record, expires FROM results WHERE key = ?", (key,)).fetchone()
        if row is None or row[1] < time.time():
            return None
        rec = Record.from_json(orjson.loads(row[0]))
        dests = [r[0] for r in self._run("SELECT dest FROM delivered WHERE key = ?", (key,))]
        rec.delivered = sorted({*rec.delivered, *dests})
        return rec

    async def put(self, key: str, record: Record) -> None:
        blob = orjson.dumps(record.to_json())
        self._run("BEGIN IMMEDIATE")
        try:
            self._run(
                "INSERT OR REPLACE INTO results (key, record, expires) VALUES (?, ?, ?)",
                (key, blob, time.time() + self.result_ttl_s),
            )
            for dest in record.delivered:
                self._run("INSERT OR IGNORE INTO delivered (key, dest) VALUES (?, ?)", (key, dest))
            self._run("DELETE FROM claims WHERE key = ?", (key,))
            self._run("DELETE FROM saved_tokens WHERE key = ?", (key,))
            self._run("COMMIT")
        except BaseException:
            self._rollback()
            raise
        self._writes += 1
        if self._writes % self.prune_every == 0:
            self.prune()

    async def save_tokens(self, chunks: Sequence[tuple[str, TokenChunk]]) -> None:
        """One transaction for every chunk (rows read back in rowid order:
        the order written)."""
        expires = time.time() + self.result_ttl_s
        rows = [(key, orjson.dumps(chunk.to_json()), expires) for key, chunk in chunks]
        self._run("BEGIN IMMEDIATE")
        try:
            try:
                self._db.executemany("INSERT INTO saved_tokens (key, chunk, expires) VALUES (?, ?, ?)", rows)
            except sqlite3.OperationalError as exc:
                raise StoreUnavailable(f"sqlite {self.path}: {exc}") from exc
            self._run("COMMIT")
        except BaseException:
            self._rollback()
            raise

    async def saved_tokens(self, key: str) -> list[TokenChunk]:
        rows = self._run(
            "SELECT chunk FROM saved_tokens WHERE key = ? AND expires >= ? ORDER BY rowid", (key, time.time())
        )
        return [TokenChunk.from_json(orjson.loads(row[0])) for row in rows]

    async def drop_tokens(self, key: str) -> None:
        self._run("DELETE FROM saved_tokens WHERE key = ?", (key,))

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def prune(self) -> None:
        """Drop expired results, cancels and saved tokens, and the oldest
        results beyond ``max_entries``."""
        now = time.time()
        self._run("DELETE FROM results WHERE expires < ?", (now,))
        self._run(
            "DELETE FROM results WHERE key IN (SELECT key FROM results ORDER BY expires DESC LIMIT -1 OFFSET ?)",
            (self.max_entries,),
        )
        self._run("DELETE FROM delivered WHERE key NOT IN (SELECT key FROM results)")
        self._run("DELETE FROM cancels WHERE expires < ?", (now,))
        self._run("DELETE FROM responses WHERE expires < ?", (now,))
        self._run(
            "DELETE FROM responses WHERE ckey IN (SELECT ckey FROM responses ORDER BY expires DESC LIMIT -1 OFFSET ?)",
            (self.max_cached_responses,),
        )
        self._run("DELETE FROM claims WHERE expires < ?", (now,))
        self._run("DELETE FROM saved_tokens WHERE expires < ?", (now,))

    async def mark_delivered(self, key: str, dest: str) -> None:
        self._run("INSERT OR IGNORE INTO delivered (key, dest) VALUES (?, ?)", (key, dest))

    async def claim(self, key: str, owner: str, lease_s: float) -> str | None:
        now = time.time()
        self._run("BEGIN IMMEDIATE")
        try:
            row = self._run("SELECT owner, pid, expires FROM claims WHERE key = ?", (key,)).fetchone()
            if row is not None and row[0] != owner and row[2] > now and _pid_alive(int(row[1])):
                self._run("COMMIT")
                return str(row[0])
            self._run(
                "INSERT OR REPLACE INTO claims (key, owner, pid, expires) VALUES (?, ?, ?, ?)",
                (key, owner, self._pid, now + lease_s),
            )
            self._run("COMMIT")
            return None
        except BaseException:
            self._rollback()
            raise

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        cur = self._run(
            "UPDATE claims SET expires = ? WHERE key = ? AND owner = ?", (time.time() + lease_s, key, owner)
        )
        return cur.rowcount > 0

    async def release(self, key: str, owner: str) -> None:
        self._run("DELETE FROM claims WHERE key = ? AND owner = ?", (key, owner))

    async def mark_cancelled(self, key: str, ttl_s: float) -> None:
        self._run("INSERT OR REPLACE INTO cancels (key, expires) VALUES (?, ?)", (key, time.time() + ttl_s))

    async def is_cancelled(self, key: str) -> bool:
        row = self._run("SELECT expires FROM cancels WHERE key = ?", (key,)).fetchone()
        return row is not None and row[0] > time.time()

    async def cache_get(self, cache_key: str) -> dict | None:
        row = self._run("SELECT result, expires FROM responses WHERE ckey = ?", (cache_key,)).fetchone()
        if row is None or row[1] < time.time():
            return None
        return orjson.loads(row[0])

    async def cache_put(self, cache_key: str, result: dict) -> None:
        self._run(
            "INSERT OR REPLACE INTO responses (ckey, result, expires) VALUES (?, ?, ?)",
            (cache_key, orjson.dumps(result), time.time() + self.result_ttl_s),
        )
        self._writes += 1
        if self._writes % self.prune_every == 0:
            self.prune()

    async def close(self) -> None:
        try:
            self._db.close()
        except sqlite3.Error:
            pass
