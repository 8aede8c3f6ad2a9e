"""The object index: which object lives where, and which namespace belongs to whom.

Transient objects live only in memory. Persistent objects are also rows in an SQLite
database (WAL journal, synchronous=FULL). Commit order makes them crash-consistent:
an object's new bytes go to freshly allocated extents and are fdatasync'ed *before*
the row that points at them is committed, and the old extents are reused only after
that commit. A crash at any moment leaves each object at its previous or its new
version, never a mix; extents of uncommitted writes are simply free again at restart.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from fuyoud.storage.layout import Layout

SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    namespace TEXT NOT NULL,
    name      TEXT NOT NULL,
    size      INTEGER NOT NULL,
    version   INTEGER NOT NULL,
    layout    TEXT NOT NULL,
    checksums BLOB,
    PRIMARY KEY (namespace, name)
);
CREATE TABLE IF NOT EXISTS namespaces (
    name TEXT PRIMARY KEY,
    uid  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class ObjectMeta:
    namespace: str
    name: str
    size: int
    persistent: bool
    version: int
    layout: Layout
    session_id: int = 0  # the owning session for transient objects
    checksums: bytes = b""  # CRC32C per 1 MiB block (persistent objects; see checksums.py)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


class IndexDB:
    """The persistent half of the index. Thread-safe; every write is one transaction."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(objects)")}
        if "checksums" not in columns:  # an index from before checksums: its objects go unchecked
            self._db.execute("ALTER TABLE objects ADD COLUMN checksums BLOB")
        self._lock = threading.Lock()

    def load(self) -> list[ObjectMeta]:
        with self._lock:
            rows = self._db.execute("SELECT namespace, name, size, version, layout, checksums FROM objects").fetchall()
        return [ObjectMeta(ns, name, size, True, version, Layout.from_json(size, json.loads(layout)), 0, sums or b"")
                for ns, name, size, version, layout, sums in rows]

    def commit(self, put: list[ObjectMeta], delete: list[tuple[str, str]] = ()) -> None:
        with self._lock:
            with self._db:  # one transaction
                self._db.execute("BEGIN")
                self._db.executemany(
                    "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?)",
                    [(m.namespace, m.name, m.size, m.version, json.dumps(m.layout.to_json()), m.checksums)
                     for m in put])
                self._db.executemany("DELETE FROM objects WHERE namespace = ? AND name = ?", list(delete))

    def namespace_owner(self, namespace: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT uid FROM namespaces WHERE name = ?", (namespace,)).fetchone()
        return row[0] if row else None

    def claim_namespace(self, namespace: str, uid: int) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR IGNORE INTO namespaces VALUES (?, ?)", (namespace, uid))

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.set_metas({key: value})

    def set_metas(self, values: dict[str, str]) -> None:
        """Several keys in one transaction."""
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(values.items()))

    def delete_meta(self, key: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM meta WHERE key = ?", (key,))

    def meta_items(self, prefix: str) -> list[tuple[str, str]]:
        with self._lock:
            return self._db.execute("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?",
                                    (len(prefix), prefix)).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()
