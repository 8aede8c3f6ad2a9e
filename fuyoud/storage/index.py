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
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from fuyoud.storage.layout import Layout

UNNAMED_KEY = "unnamed|"  # meta rows "unnamed|<namespace>": namespaces the daemon named

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
CREATE TABLE IF NOT EXISTS checkpoints (
    directory TEXT PRIMARY KEY,   -- its real path when it was written
    namespace TEXT NOT NULL,      -- whose state it holds
    uid       INTEGER NOT NULL,   -- who may restore or delete it (and root, the daemon's user)
    mode      TEXT NOT NULL,      -- copy | snapshot
    snapshot  TEXT NOT NULL,      -- snapshot mode: the prefix of its linked objects
    manifest_sha256 TEXT NOT NULL -- a manifest that no longer matches is refused
);
"""
FILE_MODE = 0o600  # the index names every namespace, object and uid: the daemon's alone


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint this daemon wrote: what its manifest may not be trusted to say."""
    directory: str
    namespace: str
    uid: int
    mode: str
    snapshot: str
    manifest_sha256: str


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
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _private(path)
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

    def claim_namespace(self, namespace: str, uid: int, unnamed: bool = False) -> None:
        """Record ``uid`` as the namespace's owner; ``unnamed``: the daemon named it (for a
        session that named none), so nobody can come back to it (fuyoud/sessions/unnamed.py)."""
        with self._lock, self._db:
            self._db.execute("INSERT OR IGNORE INTO namespaces VALUES (?, ?)", (namespace, uid))
            if unnamed:
                self._db.execute("INSERT OR IGNORE INTO meta VALUES (?, '')", (UNNAMED_KEY + namespace,))

    def unnamed_namespaces(self) -> set[str]:
        """The namespaces recorded as the daemon's own (claim_namespace's ``unnamed``)."""
        return {key[len(UNNAMED_KEY):] for key, _ in self.meta_items(UNNAMED_KEY)}

    def owned_namespaces(self) -> list[str]:
        """The namespaces with a recorded owner."""
        with self._lock:
            return [row[0] for row in self._db.execute("SELECT name FROM namespaces")]

    def release_namespace(self, namespace: str) -> None:
        """Forget a namespace's owner (it holds no object any more)."""
        with self._lock, self._db:
            self._db.execute("DELETE FROM namespaces WHERE name = ?", (namespace,))
            self._db.execute("DELETE FROM meta WHERE key = ?", (UNNAMED_KEY + namespace,))

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

    # -- checkpoints this daemon wrote ------------------------------------------------------------
    def record_checkpoint(self, record: CheckpointRecord) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                             (record.directory, record.namespace, record.uid, record.mode, record.snapshot,
                              record.manifest_sha256))

    def checkpoint_counts(self) -> dict[str, int]:
        """Recorded checkpoints per namespace."""
        with self._lock:
            return dict(self._db.execute("SELECT namespace, count(*) FROM checkpoints GROUP BY namespace"))

    def checkpoint_record(self, directory: str) -> CheckpointRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM checkpoints WHERE directory = ?", (directory,)).fetchone()
        return CheckpointRecord(*row) if row else None

    def forget_checkpoint(self, directory: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM checkpoints WHERE directory = ?", (directory,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _private(path: Path) -> None:
    """Create the database file 0600 before SQLite does (SQLite then gives its -wal and
    -shm files the same mode); an existing one from an older fuyoud is made private."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    for extra in ("-wal", "-shm", "-journal"):
        side = path.with_name(path.name + extra)
        if side.exists() and not side.is_symlink():
            os.chmod(side, FILE_MODE)
