"""Checkpoints of a namespace (optimizer state and any other persistent objects), taken
while training goes on, restored all or nothing.

The consistent point: with the lock of every optimizer group of the namespace held (no
step is running) and all groups at the same step count (between iterations), the store
either links every persistent object under ``snapshots/<id>/`` (snapshot mode: the new
rows share the objects' extents, nothing is copied, and since every write goes to fresh
extents the shared ones never change) or pins their current versions for copying (copy
mode: the locks go at once and the copy runs while the client trains on). A namespace
whose groups stay mid-iteration past the timeout gets FAILED_PRECONDITION, and nothing
is written.

On disk (fuyoud/checkpoints/files.py: the layout, the manifest's schema, and access
confined to the directory), written as ``DIR.partial-<pid>`` (each file fsynced, 0600 in
0700 directories) and renamed to ``DIR``, so ``DIR`` is complete or absent. A copy is
refused (ResourceExhausted, nothing created) when the sizes of its objects and manifest
exceed the free space of DIR's filesystem; one that runs out of room anyway, another
writer having filled it, is removed and reported as ResourceExhausted too.

Trust: a manifest is a file in a directory a tenant may be able to write, so it decides
nothing. Every checkpoint the daemon writes is recorded in its index (real path,
namespace, owner uid, mode, snapshot prefix, the manifest's SHA-256); restore and delete
take the namespace, the owner and the snapshot's objects from that record and refuse a
manifest that no longer matches it. A checkpoint the daemon has no record of (copied
from another host, or written by an older fuyoud) is a copy whose files a tenant must
own, one link each: reading it gives back nothing the tenant could not read already.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fuyou_proto.contract import SNAPSHOT_PREFIX, group_of
from fuyoud import __version__, failpoints
from fuyoud.checkpoints.files import (CLIENT_STATE, FORMAT, MANIFEST, MAX_CLIENT_STATE, MAX_MANIFEST,
                                     CheckpointDir, Location, Manifest, NewCheckpoint, object_file, parse_manifest,
                                     refuse_existing, require_room, write_failure)
from fuyoud.checkpoints.handed import HandedCheckpoint, HandedLocation
from fuyoud.errors import DataLoss, FailedPrecondition, FuyouError, InvalidArgument, NotFound, PermissionDenied
from fuyoud.memory.hugepages import huge_page_buffer
from fuyoud.optimizer.group import Group
from fuyoud.optimizer.layout import HEADER
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.sessions.names import shown
from fuyoud.sessions.namespaces import delete_state
from fuyoud.storage.index import CheckpointRecord
from fuyoud.storage.pending import PendingWrite, commit_all
from fuyoud.units import format_size

if TYPE_CHECKING:
    from fuyoud.optimizer.groups import Optimizer
    from fuyoud.sessions.registry import Session, SessionRegistry
    from fuyoud.storage.store import Store

log = logging.getLogger(__name__)
COPY_CHUNK = 8 << 20
SNAPSHOTS = SNAPSHOT_PREFIX


@dataclass
class CheckpointResult:
    directory: str
    namespace: str
    objects: int
    bytes: int
    step: int
    seconds: float
    mode: str
    client_state: bytes = b""
    manifest: bytes = b""  # (a checkpoint into the client's files: the client writes it)


def privileged(uid: int | None) -> bool:
    """Operators (``uid`` None), root and the daemon's own user act with the daemon's
    permissions anyway: they may name any absolute path and restore any checkpoint."""
    return uid is None or uid in (0, os.getuid())


def _group_entry(name: str, head: bytes) -> dict:
    spec, numel, step = OptimizerSpec.parse_header(head)
    return {"name": group_of(name), "numel": numel, "step": step, "optimizer": spec.to_dict()}


HANDED_PENDING = "handed_checkpoint|"


def _pending_key(namespace: str, snap: str, handed: bool = False) -> str:
    prefix = HANDED_PENDING if handed else "pending_checkpoint|"
    return f"{prefix}{namespace}|{snap}|{secrets.token_hex(4)}"


@dataclass
class _Uncommitted:
    """A checkpoint written into a client's handed files, kept only once its client
    commits it (CommitCheckpoint, after renaming its directory into place)."""
    key: str  # its pending mark in the index
    record: CheckpointRecord
    links: list[str]  # a snapshot's linked objects


def recover(store) -> None:
    """At start-up, for each checkpoint the daemon died taking: remove its partial
    directory and, for a snapshot, the objects it had linked (unless the directory was
    renamed into place just before the crash: then it is complete)."""
    index = store.index_db
    for key, target in index.meta_items(HANDED_PENDING):  # (never committed by their client: never kept)
        _, namespace, snap, _ = key.split("|")
        if snap:
            store.delete(namespace, [m.name for m in store.list(namespace, snap)], missing_ok=True)
        index.delete_meta(key)
        log.warning("checkpoint %s of %s never completed (the daemon stopped before its client committed it): "
                    "removed what it had linked", target, namespace)
    for key, target in index.meta_items("pending_checkpoint|"):
        _, namespace, snap, _ = key.split("|")
        try:
            with Location(target, None) as where:
                complete = where.exists()
                if not complete:
                    for partial in where.partials():
                        where.remove(partial)
        except FuyouError:  # its parent is gone: nothing of it is left there
            complete = False
        if not complete:
            if snap:
                names = [m.name for m in store.list(namespace, snap)]
                store.delete(namespace, names, missing_ok=True)
            index.forget_checkpoint(target)
            log.warning("checkpoint %s of %s never completed (the daemon stopped while taking it): removed what "
                        "it had written", target, namespace)
        index.delete_meta(key)



@dataclass
class _Known:
    """What restore and delete go by: the daemon's record, or for a checkpoint it has no
    record of, the directory's owner and (for privileged callers only) the manifest."""
    manifest: Manifest
    namespace: str
    owner: int
    snapshot: str | None  # the prefix of a recorded snapshot's objects


class Checkpointer:
    """Checkpoints of a namespace: taking them (``checkpoint``), restoring and deleting
    them, where a caller may (``location``). Works on the store, the optimizer's groups
    (their locks give the consistent point) and the sessions (a restore claims the
    namespace); ``dirs`` are ``[daemon] checkpoint_dirs``; ``store_outlives``: False where the
    store is deleted when the daemon stops, and "auto" then never gives a snapshot (it would
    go with the store)."""

    def __init__(self, store: "Store", optimizer: "Optimizer", sessions: "SessionRegistry", dirs: list[Path],
                 store_outlives: bool = True):
        self.store, self.optimizer, self.sessions, self.dirs = store, optimizer, sessions, list(dirs)
        self.store_outlives = store_outlives
        self._lock = threading.Lock()
        self._uncommitted: dict[tuple[int, str], _Uncommitted] = {}  # (session id, directory) -> it

    def location(self, directory: str, uid: int | None) -> Location:
        """The checkpoint directory's location, if the caller may use it: other users only
        paths inside ``[daemon] checkpoint_dirs`` (the daemon acts there with its own
        permissions), checked on the real path of the opened parent directory."""
        roots = None if privileged(uid) else [r.resolve() for r in self.dirs]
        return Location(directory, roots)

    @staticmethod
    def handed_location(directory: str, handed, new: bool) -> HandedLocation:
        """The checkpoint directory the client holds, reached only through the descriptors
        it handed (``new``: a checkpoint to write; else one to restore or delete)."""
        return HandedLocation(directory, handed, new)

    def _on_array(self, where: Location) -> bool:
        devices = {os.stat(d.directory).st_dev for d in self.store.devices}
        return where.device in devices

    def _at_common_step(self, namespace: str, timeout: float, action):
        """Run ``action()`` with every group of the namespace locked and at one step count;
        returns (its result, that step)."""
        deadline = time.monotonic() + timeout
        while True:
            groups: list[Group] = self.optimizer.groups_of(namespace)
            with ExitStack() as held:
                all_locked = True
                for g in groups:  # sorted by name: every checkpoint takes them in one order
                    if not g.lock.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
                        all_locked = False
                        break
                    held.callback(g.lock.release)
                steps = {g.step for g in groups}
                if all_locked and len(steps) <= 1:
                    return action(), max(steps, default=0)
            if time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"namespace {namespace!r}: its optimizer groups did not reach a common step within "
                    f"{timeout:g} s (steps seen: {sorted(steps)}); retry between iterations or with a longer timeout")
            time.sleep(0.01)

    def checkpoint(self, namespace: str, uid: int, where: Location | HandedLocation, timeout: float = 60.0,
                   mode: str = "auto", client_state: bytes = b"", session_id: int = 0) -> CheckpointResult:
        """Checkpoint ``namespace`` (whose state belongs to ``uid``) into a new directory.
        Into handed files (``where`` a HandedLocation): kept only once ``session_id``
        commits it (``commit``)."""
        if mode not in ("auto", "snapshot", "copy"):
            raise InvalidArgument(f"checkpoint mode must be auto, snapshot or copy, not {shown(mode)}")
        if len(client_state) > MAX_CLIENT_STATE:
            raise InvalidArgument(f"client_state of {len(client_state)} bytes exceeds {MAX_CLIENT_STATE}")
        if mode == "auto":
            mode = "snapshot" if self.store_outlives and self._on_array(where) else "copy"
        refuse_existing(where)
        t0 = time.perf_counter()
        target = where.path
        new: NewCheckpoint | HandedCheckpoint | None = None
        store = self.store
        entries, links = [], []
        # Until DIR exists the checkpoint is marked pending in the index: a crash in between
        # leaves a partial directory and, for a snapshot, objects no manifest names; the next
        # start removes both (recover()).
        snap = f"{SNAPSHOTS}{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}/" if mode == "snapshot" else ""
        handed = isinstance(where, HandedLocation)
        pending = _pending_key(namespace, snap, handed)
        store.index_db.set_meta(pending, str(target))
        try:
            if isinstance(where, HandedLocation):
                self._replace_stale_record(str(target), uid)
            if mode == "snapshot":
                new = where.new_checkpoint()

                def link():
                    names = [m.name for m in store.list(namespace)
                             if m.persistent and not m.name.startswith(SNAPSHOTS)]
                    return store.link(namespace, namespace, [(n, snap + n) for n in names])

                links, step = self._at_common_step(namespace, timeout, link)
                failpoints.hit("checkpoint.linked")
                objects = [{"name": m.name[len(snap):], "snapshot": m.name, "size": m.size, "version": m.version}
                           for m in links]
                groups = self._groups_from_headers(namespace, [m.name for m in links])
            else:
                # (the snapshots' objects are not copied, so not pinned either: a pin kept on
                # them outlived the copy, and their extents leaked when their checkpoint went)
                entries, step = self._at_common_step(namespace, timeout,
                                                     lambda: store.pin(namespace, exclude=SNAPSHOTS))
                # Before the first byte, and before the directory: a copy its filesystem has no
                # room for is refused whole (one that fills up mid-way anyway: write_failure).
                require_room(where, [(e.meta.name, e.meta.size) for e in entries], len(client_state))
                failpoints.hit("checkpoint.room_checked")
                new = where.new_checkpoint()
                if isinstance(new, HandedCheckpoint):
                    new.require_objects(len(entries))
                objects, groups = self._copy_all(entries, new)
                failpoints.hit("checkpoint.copied")
            manifest = {"format": FORMAT, "mode": mode, "fuyoud_version": __version__, "namespace": namespace,
                        "step": step, "created": time.time(), "groups": groups, "objects": objects}
            data = json.dumps(manifest, indent=1).encode()
            new.write(CLIENT_STATE, client_state)
            new.write(MANIFEST, data)
            record = CheckpointRecord(str(target), namespace, uid, mode, snap, hashlib.sha256(data).hexdigest())
            if handed:  # (recorded at the client's commit; until then pending, and undone with its session)
                with self._lock:
                    self._uncommitted[(session_id, str(target))] = _Uncommitted(pending, record,
                                                                                [m.name for m in links])
            else:  # Recorded before DIR appears: a checkpoint in place is always one the index knows.
                store.index_db.record_checkpoint(record)
            new.publish()
        except BaseException as exc:
            if new is not None:  # (before it, nothing of this checkpoint is on disk or recorded)
                new.discard()
                store.index_db.forget_checkpoint(str(target))
            store.delete(namespace, [m.name for m in links], missing_ok=True)
            if isinstance(exc, OSError):
                raise write_failure(target, exc) from None
            raise
        finally:
            if not handed or (session_id, str(target)) not in self._uncommitted:
                store.index_db.delete_meta(pending)
            store.unpin(entries)
        total = sum(o["size"] for o in objects)
        seconds = time.perf_counter() - t0
        log.info("checkpoint of %s at step %d (%s): %d objects, %s in %.2f s to %s", namespace, step, mode,
                 len(objects), format_size(total), seconds, target)
        return CheckpointResult(str(target), namespace, len(objects), total, step, seconds, mode, manifest=data)

    def commit(self, session_id: int, directory: str) -> None:
        """The client renamed a checkpoint written into its handed files into place: the
        daemon records it (restore and delete go by the record) and keeps a snapshot's objects."""
        with self._lock:
            pending = self._uncommitted.pop((session_id, directory), None)
        if pending is None:
            raise NotFound(f"this session has no checkpoint of {shown(directory)} to commit (it commits its own, once, "
                           "after the checkpoint's reply)")
        self.store.index_db.record_checkpoint(pending.record)
        self.store.index_db.delete_meta(pending.key)

    def session_closed(self, session_id: int) -> int:
        """The session ended: the checkpoints it never committed go (a snapshot's objects
        removed, nothing recorded). Returns how many."""
        with self._lock:
            mine = [k for k in self._uncommitted if k[0] == session_id]
            gone = [self._uncommitted.pop(k) for k in mine]
        for pending in gone:
            rec = pending.record
            self.store.delete(rec.namespace, pending.links, missing_ok=True)
            self.store.index_db.delete_meta(pending.key)
            log.warning("checkpoint %s of %s was never committed (its session ended first): removed what it had "
                        "linked", rec.directory, rec.namespace)
        return len(gone)

    def _replace_stale_record(self, target: str, uid: int) -> None:
        """A checkpoint the client writes where the daemon recorded one of the same user's
        before: the client found no directory there (it refuses an existing one), so the old
        one was removed without DeleteCheckpoint; its snapshot's objects go with its record.
        Another user's record there is never touched (the daemon cannot see the path)."""
        old = self.store.index_db.checkpoint_record(target)
        if old is None:
            return
        if old.uid != uid:
            raise PermissionDenied(f"a checkpoint of uid {old.uid} is recorded at {target}; name another directory")
        if old.mode == "snapshot" and old.snapshot:
            self.store.delete(old.namespace, [m.name for m in self.store.list(old.namespace, old.snapshot)],
                              missing_ok=True)
        self.store.index_db.forget_checkpoint(target)
        log.info("checkpoint %s was removed without DeleteCheckpoint; its record (and a snapshot's objects) went "
                 "as a new one was written there", target)

    def _groups_from_headers(self, namespace: str, names: list[str]) -> list[dict]:
        from fuyoud.storage.store import ReadItem

        groups = []
        with self.optimizer.buffers.acquire(HEADER) as buf:
            for name in names:
                if group_of(name) is not None:  # snapshots/<id>/optim/<g>
                    self.store.read([ReadItem(namespace, name, buf[:HEADER])])
                    groups.append(_group_entry(name, bytes(buf[:HEADER])))
        return groups

    def _copy_all(self, entries, new: NewCheckpoint | HandedCheckpoint) -> tuple[list[dict], list[dict]]:
        mapping, buf = huge_page_buffer(COPY_CHUNK)
        try:
            objects, groups = [], []
            for i, entry in enumerate(sorted(entries, key=lambda e: e.meta.name)):
                meta = entry.meta
                rel = object_file(i)
                crc, head = self._copy_out(entry, buf, new.create(rel))
                if group_of(meta.name) is not None:
                    groups.append(_group_entry(meta.name, head))
                objects.append({"name": meta.name, "file": rel, "size": meta.size, "version": meta.version, "crc32": crc})
            return objects, groups
        finally:
            buf.release()
            mapping.close()

    def _copy_out(self, entry, buf: memoryview, fd: int) -> tuple[int, bytes]:
        """One pinned object into a new file (``fd``, closed here); returns its crc32 and its
        first 4 KiB."""
        size, crc, head = entry.meta.size, 0, b""
        try:
            for off in range(0, size, COPY_CHUNK):
                # (released however the write ends: a view left alive makes closing the
                # buffer's mapping raise BufferError, which would hide the write's error)
                with buf[:min(COPY_CHUNK, size - off)] as view:
                    self.store.read_pinned(entry, view, off)
                    crc = zlib.crc32(view, crc)
                    if off == 0:
                        head = bytes(view[:HEADER])
                    written = 0
                    while written < len(view):
                        written += os.write(fd, view[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        return crc, head

    def _open(self, uid: int | None, where: Location) -> tuple[CheckpointDir, _Known]:
        """The checkpoint directory, opened as the caller may, and what is known of it."""
        record = self.store.index_db.checkpoint_record(str(where.path))
        trusted = privileged(uid)
        if record is not None:
            if not trusted and record.uid != uid:
                raise PermissionDenied(f"checkpoint {where.path} belongs to uid {record.uid}")
            # The daemon wrote every file of it: a file of anyone else's was put there since.
            d = where.open(owner=None if trusted else os.getuid(), single_links=not trusted)
            try:
                data = d.read(MANIFEST, MAX_MANIFEST)
                if hashlib.sha256(data).hexdigest() != record.manifest_sha256:
                    raise DataLoss(f"the manifest of checkpoint {where.path} changed since fuyoud wrote it; refusing "
                                   "the checkpoint")
                manifest = parse_manifest(data)
            except BaseException:
                d.close()
                raise
            return d, _Known(manifest, record.namespace, record.uid,
                             record.snapshot if record.mode == "snapshot" else None)
        d = where.open(owner=None if trusted else uid, single_links=not trusted)
        try:
            if not d.has_manifest():  # (not a damaged checkpoint: none was ever here, as far as this fuyoud knows)
                raise NotFound(f"{where.path} holds no checkpoint: it has no {MANIFEST} and this fuyoud has no "
                               "record of one there")
            manifest = parse_manifest(d.read(MANIFEST, MAX_MANIFEST))
            if manifest.mode == "snapshot" and not trusted:
                raise PermissionDenied(f"checkpoint {where.path} is a snapshot this fuyoud has no record of (taken "
                                       "by another daemon or an older version, or moved): only root or the daemon's "
                                       "user may restore or delete it")
        except BaseException:
            d.close()
            raise
        return d, _Known(manifest, manifest.namespace, os.fstat(d.fd).st_uid, None)

    def restore(self, session: "Session", where: Location) -> CheckpointResult:
        """The checkpoint's objects become the session's, under their own names, in one
        index commit after every byte is written (copy) and checked."""
        t0 = time.perf_counter()
        store = self.store
        d, known = self._open(session.uid, where)
        with d:
            manifest = known.manifest
            self.sessions.claim_namespace(session)
            if manifest.mode == "snapshot":
                pairs = [(o.snapshot, o.name) for o in manifest.objects]
                if known.snapshot is not None and any(s != known.snapshot + n for s, n in pairs):
                    raise DataLoss(f"snapshot checkpoint {where.path} names objects outside its snapshot")
                try:
                    store.link(known.namespace, session.namespace, pairs)
                except NotFound:
                    raise DataLoss(f"snapshot checkpoint {where.path} lost its objects") from None
            else:
                self._restore_copies(session, d, manifest)
            self.optimizer.forget(session.namespace)  # group headers (steps) come from the restored state
            state = d.read(CLIENT_STATE, MAX_CLIENT_STATE, missing_ok=True)
        seconds = time.perf_counter() - t0
        total = sum(o.size for o in manifest.objects)
        log.info("session %d restored %s (%s, step %d): %d objects, %s in %.2f s", session.id, where.path,
                 manifest.mode, manifest.step, len(manifest.objects), format_size(total), seconds)
        return CheckpointResult(str(where.path), known.namespace, len(manifest.objects), total, manifest.step,
                                seconds, manifest.mode, state)

    def _restore_copies(self, session: "Session", d: CheckpointDir, manifest: Manifest) -> None:
        store = self.store
        pending = []
        mapping, buf = huge_page_buffer(COPY_CHUNK)
        try:
            for o in manifest.objects:
                with open(d.open_file(o.file, size=o.size), "rb", buffering=0) as f:
                    w = PendingWrite.start(store, session.namespace, o.name, o.size, persistent=True,
                                           session_id=session.id)
                    pending.append(w)
                    crc = 0
                    for off in range(0, o.size, COPY_CHUNK):
                        with buf[:min(COPY_CHUNK, o.size - off)] as view:  # (released on errors too: _copy_out)
                            if f.readinto(view) != len(view):
                                raise DataLoss(f"{o.file} of checkpoint {d.path} is shorter than its {o.size} bytes")
                            crc = zlib.crc32(view, crc)
                            w.write(off, view)
                if crc != o.crc32:  # (no values in the message: they tell about bytes the caller may not read)
                    raise DataLoss(f"{o.file} of checkpoint {d.path} ({shown(o.name)}) is corrupt: it does not match the "
                                   "checksum in its manifest; nothing was restored")
            commit_all(store, pending)
        except BaseException:
            for w in pending:
                w.abort()
            raise
        finally:
            buf.release()
            mapping.close()

    def delete(self, uid: int | None, where: Location) -> None:
        d, known = self._open(uid, where)
        d.close()
        store = self.store
        if known.snapshot is not None:  # recorded: its objects are those under its prefix
            store.delete(known.namespace, [m.name for m in store.list(known.namespace, known.snapshot)],
                         missing_ok=True)
        elif known.manifest.mode == "snapshot":  # one it has no record of (privileged callers only)
            store.delete(known.namespace, [o.snapshot for o in known.manifest.objects], missing_ok=True)
        where.remove()
        store.index_db.forget_checkpoint(str(where.path))
        log.info("checkpoint %s deleted", where.path)
        if known.namespace in store.index_db.unnamed_namespaces() and not self.sessions.holds(known.namespace):
            delete_state(store, known.namespace)  # (its session is over: its owner goes with its last object)
