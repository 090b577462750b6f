"""Stored responses: an SQLite file every gateway process of the daemon shares (``[http] responses_store``).

Each row is one response as it was served (its JSON), the input items it was given, the response it
continued (``previous_response_id``) and its owner: a keyed hash of the API key that made it (HMAC with
a salt kept in the file, never the key), and the trusted header's tenant where one was given; without
API keys everything has one owner. Several processes write to it safely: WAL journal (readers never
wait for a writer), a busy timeout, one connection per process used from one thread (the store's
executor, so the event loop never waits on the file), and every write a short ``BEGIN IMMEDIATE``
transaction. The store is bounded by age (``responses_ttl``: an older row is invisible, and deleted by
the next write) and by size (``responses_max_mb``: the rows' JSON bytes, kept in ``meta`` by triggers;
past it the oldest rows go first). A failure to store is a :class:`StoreError` (``full`` or
``unwritable``): the caller serves the response all the same (gateway/openai/responses.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

BUSY_TIMEOUT = 5.0  # seconds a write waits for another process's transaction
EVICT_BATCH = 64  # oldest rows read at a time when the store is over its size
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the order rows were stored in: the oldest go first
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    created REAL NOT NULL,  -- unix time
    previous TEXT,  -- the response it continued (previous_response_id)
    input TEXT NOT NULL,  -- its input items (JSON)
    body TEXT NOT NULL,  -- the response object (JSON)
    size INTEGER NOT NULL  -- bytes of input and body
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value);
INSERT OR IGNORE INTO meta VALUES ('schema', 1), ('bytes', 0), ('salt', randomblob(32));
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses
    BEGIN UPDATE meta SET value = value + NEW.size WHERE key = 'bytes'; END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses
    BEGIN UPDATE meta SET value = value - OLD.size WHERE key = 'bytes'; END;
"""
CHAIN = """
WITH RECURSIVE chain (id, previous, input, body, depth) AS (
    SELECT id, previous, input, body, 0 FROM responses WHERE id = :id AND owner = :owner AND created >= :since
    UNION ALL
    SELECT r.id, r.previous, r.input, r.body, c.depth + 1 FROM responses r JOIN chain c ON r.id = c.previous
    WHERE r.owner = :owner AND r.created >= :since
)
SELECT id, previous, input, body FROM chain ORDER BY depth DESC
"""


class StoreError(Exception):
    """The store could not do what was asked: ``reason`` is ``full`` (a response larger than the whole
    store, or the disk full) or ``unwritable`` (the file cannot be opened, read or written)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class Owner:
    """Who asks: the API key that authenticated the request (b"": no keys) and the tenant a trusted
    header named ("": none)."""

    key: bytes = b""
    named: str = ""


@dataclass
class Stored:
    """One stored response: its object as served, its own input items, and the response it continued."""

    id: str
    body: dict[str, Any]
    input: list[dict[str, Any]]
    previous: str | None = None


@dataclass
class Chain:
    """A response and those before it, oldest first: each one's input items and output items, in order
    (``items``); ``missing`` names a response of the chain no longer stored (expired or evicted)."""

    items: list[dict[str, Any]]
    missing: str | None = None


class ResponseStore:
    """The store of one gateway process: its one connection, opened at first use (and again after a
    failure), used only from the store's one thread."""

    def __init__(self, path: str, ttl: float, max_bytes: int):
        self.path, self.ttl, self.max_bytes = path, ttl, max_bytes
        self._db: sqlite3.Connection | None = None
        self._salt = b""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self.failures, self.logged_at = 0, float("-inf")  # failures to store not yet logged, the last log line

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        """Close the connection (in the thread that opened it) and the thread."""
        self._thread.submit(self._close).result()
        self._thread.shutdown(wait=True)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ------------------------------------------------------------ in the store's thread

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            # one thread uses it at a time (the store's, or a caller's that never hands it over)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            try:
                with contextlib.suppress(OSError):  # conversations: the owner's alone (WAL files follow its mode)
                    os.chmod(self.path, 0o600)
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at each checkpoint, never corrupt
                db.executescript(f"BEGIN IMMEDIATE; {SCHEMA} COMMIT;")  # once, whichever process comes first
                self._salt = bytes(db.execute("SELECT value FROM meta WHERE key = 'salt'").fetchone()[0])
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    @contextlib.contextmanager
    def _guard(self, writing: bool) -> Iterator[sqlite3.Connection]:
        """The connection; an SQLite or OS error becomes a :class:`StoreError` (and the connection is
        opened anew next time, so a store that was fixed is used again)."""
        try:
            yield self._open()
        except (sqlite3.Error, OSError) as e:
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    self._db.close()
                self._db = None
            code = getattr(e, "sqlite_errorcode", None)
            full = code == sqlite3.SQLITE_FULL or getattr(e, "errno", None) == 28  # ENOSPC
            what = "write" if writing else "read"
            raise StoreError("full" if full else "unwritable",
                             f"cannot {what} the response store {self.path}: {e}") from None

    def owner(self, who: Owner) -> str:
        """The owner column of ``who``: the key's HMAC under the store's salt (never the key)."""
        key = hmac.new(self._salt, who.key, hashlib.sha256).hexdigest()[:32] if who.key else ""
        return f"{key}/{who.named}" if who.named else key

    def _since(self) -> float:
        return time.time() - self.ttl

    def put(self, who: Owner, row: Stored) -> None:
        """Store ``row``: expired rows are deleted, and the oldest while the store is over its size."""
        text_in, text_body = json.dumps(row.input), json.dumps(row.body)
        size = len(text_in) + len(text_body)  # ASCII: json.dumps escapes the rest
        if size > self.max_bytes:
            raise StoreError("full", f"the response ({size} bytes) is larger than the whole response store "
                                     f"({self.max_bytes} bytes, http.responses_max_mb)")
        with self._guard(writing=True) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM responses WHERE created < ?", (self._since(),))
            db.execute("INSERT INTO responses (id, owner, created, previous, input, body, size) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (row.id, self.owner(who), time.time(), row.previous, text_in, text_body, size))
            self._evict(db)
            db.execute("COMMIT")

    def _evict(self, db: sqlite3.Connection) -> None:
        """The oldest rows deleted until the rows' bytes are within the bound (the newest row, at most
        the bound itself, always stays)."""
        excess = int(db.execute("SELECT value FROM meta WHERE key = 'bytes'").fetchone()[0]) - self.max_bytes
        while excess > 0:
            last = None
            for seq, size in db.execute("SELECT seq, size FROM responses ORDER BY seq LIMIT ?", (EVICT_BATCH,)):
                last, excess = seq, excess - size
                if excess <= 0:
                    break
            if last is None:
                return
            db.execute("DELETE FROM responses WHERE seq <= ?", (last,))

    def get(self, who: Owner, rid: str) -> Stored | None:
        """``who``'s stored response ``rid`` (None: no such one, expired, or another owner's)."""
        with self._guard(writing=False) as db:
            got = db.execute("SELECT body, input, previous FROM responses WHERE id = ? AND owner = ? AND "
                             "created >= ?", (rid, self.owner(who), self._since())).fetchone()
        if got is None:
            return None
        return Stored(rid, json.loads(got[0]), json.loads(got[1]), got[2])

    def chain(self, who: Owner, rid: str) -> Chain | None:
        """The conversation up to and including ``who``'s response ``rid`` (None: no such one)."""
        with self._guard(writing=False) as db:
            rows = db.execute(CHAIN, {"id": rid, "owner": self.owner(who), "since": self._since()}).fetchall()
        if not rows:
            return None
        items: list[dict[str, Any]] = []
        for _, _, text_in, text_body in rows:
            items += json.loads(text_in)
            items += json.loads(text_body).get("output") or []
        return Chain(items, rows[0][1])

    def delete(self, who: Owner, rid: str) -> bool:
        """Delete ``who``'s response ``rid``; False when there was none."""
        with self._guard(writing=True) as db:
            gone = db.execute("DELETE FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                              (rid, self.owner(who), self._since())).rowcount
        return gone > 0
