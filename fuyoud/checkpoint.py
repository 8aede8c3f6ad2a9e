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

On disk, written as ``DIR.partial-<pid>`` (each file fsynced) and renamed to ``DIR``,
so ``DIR`` is complete or absent:

    DIR/manifest.json      format, mode, namespace, step, groups, objects (name, size,
                           version; copy: file and crc32; snapshot: the linked name)
    DIR/client_state.bin   what the client asked to keep (lr, schedules, data position)
    DIR/objects/<n>.bin    copy mode: each object's bytes
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fuyoud import __version__, failpoints
from fuyoud.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from fuyoud.memory.hugepages import huge_page_buffer
from fuyoud.optimizer.groups import HEADER, Group
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.units import format_size

if TYPE_CHECKING:
    from fuyoud.server import Daemon
    from fuyoud.sessions import Session

log = logging.getLogger(__name__)
FORMAT = "fuyou-checkpoint/1"
COPY_CHUNK = 8 << 20
SNAPSHOTS = "snapshots/"
MAX_CLIENT_STATE = 16 << 20


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


# -- where a session may read and write checkpoints -------------------------------------------
def checkpoint_path(daemon: "Daemon", directory: str, session: "Session | None") -> Path:
    """The directory, if the caller may use it. Operators (``session`` None) and sessions
    of the daemon's own uid or root may name any absolute path; other users only paths
    inside ``[daemon] checkpoint_dirs`` (they act through the daemon's permissions)."""
    path = Path(directory)
    if not path.is_absolute():
        raise InvalidArgument(f"checkpoint directory must be an absolute path on the daemon's host, got {directory!r}")
    if session is None or session.uid in (0, os.getuid()):
        return path
    real = path.parent.resolve() / path.name
    roots = [r.resolve() for r in daemon.config.checkpoint_dirs]
    if not any(real.is_relative_to(r) for r in roots):
        raise PermissionDenied(f"uid {session.uid} may keep checkpoints only under "
                               f"{', '.join(map(str, roots))} ([daemon] checkpoint_dirs), not {path}")
    return real


def _new_target(path: Path) -> Path:
    if path.exists():
        raise FailedPrecondition(f"checkpoint directory {path} already exists; name a new one")
    if not path.parent.is_dir():
        raise FailedPrecondition(f"the parent of checkpoint directory {path} does not exist")
    return path


def _on_array(daemon: "Daemon", path: Path) -> bool:
    devices = {os.stat(d.directory).st_dev for d in daemon.store.devices}
    return os.stat(path.parent).st_dev in devices


# -- taking one ----------------------------------------------------------------------------------
def _at_common_step(daemon: "Daemon", namespace: str, timeout: float, action):
    """Run ``action()`` with every group of the namespace locked and at one step count;
    returns (its result, that step)."""
    deadline = time.monotonic() + timeout
    while True:
        groups: list[Group] = daemon.optimizer.groups_of(namespace)
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


def _group_entry(name: str, head: bytes) -> dict:
    spec, numel, step = OptimizerSpec.parse_header(head)
    return {"name": name[len("optim/"):], "numel": numel, "step": step, "optimizer": spec.to_dict()}


def checkpoint(daemon: "Daemon", namespace: str, target: Path, timeout: float = 60.0, mode: str = "auto",
               client_state: bytes = b"") -> CheckpointResult:
    _new_target(target)
    if mode not in ("auto", "snapshot", "copy"):
        raise InvalidArgument(f"checkpoint mode must be auto, snapshot or copy, not {mode!r}")
    if len(client_state) > MAX_CLIENT_STATE:
        raise InvalidArgument(f"client_state of {len(client_state)} bytes exceeds {MAX_CLIENT_STATE}")
    if mode == "auto":
        mode = "snapshot" if _on_array(daemon, target) else "copy"
    t0 = time.perf_counter()
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    store = daemon.store
    entries, links = [], []
    # Until DIR exists the checkpoint is marked pending in the index: a crash in between
    # leaves a partial directory and, for a snapshot, objects no manifest names; the next
    # start removes both (recover()).
    snap = f"{SNAPSHOTS}{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}/" if mode == "snapshot" else ""
    pending = _pending_key(namespace, snap)
    store.index_db.set_meta(pending, str(target))
    try:
        (partial / "objects").mkdir(parents=True)
        if mode == "snapshot":
            def link():
                names = [m.name for m in store.list(namespace) if m.persistent and not m.name.startswith(SNAPSHOTS)]
                return store.link(namespace, namespace, [(n, snap + n) for n in names])

            links, step = _at_common_step(daemon, namespace, timeout, link)
            failpoints.hit("checkpoint.linked")
            objects = [{"name": m.name[len(snap):], "snapshot": m.name, "size": m.size, "version": m.version}
                       for m in links]
            groups = _groups_from_headers(daemon, namespace, [m.name for m in links])
        else:
            entries, step = _at_common_step(daemon, namespace, timeout,
                                            lambda: [e for e in store.pin(namespace)
                                                     if not e.meta.name.startswith(SNAPSHOTS)])
            objects, groups = _copy_all(daemon, entries, partial)
            failpoints.hit("checkpoint.copied")
        manifest = {"format": FORMAT, "mode": mode, "fuyoud_version": __version__, "namespace": namespace,
                    "step": step, "created": time.time(), "groups": groups, "objects": objects}
        _write_file(partial / "client_state.bin", client_state)
        _write_file(partial / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(partial / "objects")
        _fsync_dir(partial)
        os.rename(partial, target)
        _fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        store.delete(namespace, [m.name for m in links], missing_ok=True)
        if isinstance(exc, OSError):
            raise FailedPrecondition(f"cannot write checkpoint {target}: {exc}") from None
        raise
    finally:
        store.index_db.delete_meta(pending)
        store.unpin(entries)
    total = sum(o["size"] for o in objects)
    seconds = time.perf_counter() - t0
    log.info("checkpoint of %s at step %d (%s): %d objects, %s in %.2f s to %s", namespace, step, mode,
             len(objects), format_size(total), seconds, target)
    return CheckpointResult(str(target), namespace, len(objects), total, step, seconds, mode)


def _groups_from_headers(daemon: "Daemon", namespace: str, names: list[str]) -> list[dict]:
    from fuyoud.storage.store import ReadItem

    groups = []
    with daemon.optimizer.buffers.acquire(HEADER) as buf:
        for name in names:
            base = name.split("/", 2)[-1]  # snapshots/<id>/optim/<g> -> optim/<g>
            if base.startswith("optim/"):
                daemon.store.read([ReadItem(namespace, name, buf[:HEADER])])
                groups.append(_group_entry(base, bytes(buf[:HEADER])))
    return groups


def _copy_all(daemon: "Daemon", entries, partial: Path) -> tuple[list[dict], list[dict]]:
    mapping, buf = huge_page_buffer(COPY_CHUNK)
    try:
        objects, groups = [], []
        for i, entry in enumerate(sorted(entries, key=lambda e: e.meta.name)):
            meta = entry.meta
            rel = f"objects/{i:06d}.bin"
            crc, head = _copy_out(daemon, entry, buf, partial / rel)
            if meta.name.startswith("optim/"):
                groups.append(_group_entry(meta.name, head))
            objects.append({"name": meta.name, "file": rel, "size": meta.size, "version": meta.version, "crc32": crc})
        return objects, groups
    finally:
        buf.release()
        mapping.close()


def _copy_out(daemon: "Daemon", entry, buf: memoryview, path: Path) -> tuple[int, bytes]:
    """One pinned object into a new file; returns its crc32 and its first 4 KiB."""
    size, crc, head = entry.meta.size, 0, b""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for off in range(0, size, COPY_CHUNK):
            view = buf[:min(COPY_CHUNK, size - off)]
            daemon.store.read_pinned(entry, view, off)
            crc = zlib.crc32(view, crc)
            if off == 0:
                head = bytes(view[:HEADER])
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            view.release()
        os.fsync(fd)
    finally:
        os.close(fd)
    return crc, head


def _pending_key(namespace: str, snap: str) -> str:
    return f"pending_checkpoint|{namespace}|{snap}|{secrets.token_hex(4)}"


def recover(daemon: "Daemon") -> None:
    """At start-up, for each checkpoint the daemon died taking: remove its partial
    directory and, for a snapshot, the objects it had linked (unless the directory was
    renamed into place just before the crash: then it is complete)."""
    index = daemon.store.index_db
    for key, target in index.meta_items("pending_checkpoint|"):
        _, namespace, snap, _ = key.split("|")
        path = Path(target)
        complete = (path / "manifest.json").exists()
        if not complete:
            for partial in path.parent.glob(f"{path.name}.partial-*"):
                shutil.rmtree(partial, ignore_errors=True)
            if snap:
                names = [m.name for m in daemon.store.list(namespace, snap)]
                daemon.store.delete(namespace, names, missing_ok=True)
            log.warning("checkpoint %s of %s never completed (the daemon stopped while taking it): removed what "
                        "it had written", target, namespace)
        index.delete_meta(key)


# -- restoring and deleting ----------------------------------------------------------------------
def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise NotFound(f"no checkpoint at {path} (no manifest.json)") from None
    except (OSError, ValueError) as exc:
        raise DataLoss(f"checkpoint manifest {path / 'manifest.json'} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InvalidArgument(f"{path} is not a {FORMAT} checkpoint")
    return manifest


def _may_read(daemon: "Daemon", session: "Session", namespace: str) -> None:
    owner = daemon.store.index_db.namespace_owner(namespace)
    if namespace != session.namespace and session.uid != 0 and owner not in (None, session.uid):
        raise PermissionDenied(f"the checkpoint belongs to namespace {namespace!r} of uid {owner}")


def restore(daemon: "Daemon", session: "Session", path: Path) -> CheckpointResult:
    """The checkpoint's objects become the session's, under their own names, in one
    index commit after every byte is written (copy) and checked."""
    t0 = time.perf_counter()
    manifest = read_manifest(path)
    source_ns, objects = manifest["namespace"], manifest["objects"]
    _may_read(daemon, session, source_ns)
    daemon.sessions.claim_namespace(session)
    store = daemon.store
    if manifest["mode"] == "snapshot":
        try:
            store.link(source_ns, session.namespace, [(o["snapshot"], o["name"]) for o in objects])
        except NotFound as exc:
            raise DataLoss(f"snapshot checkpoint {path} lost its objects ({exc})") from None
    else:
        _restore_copies(daemon, session, path, objects)
    daemon.optimizer.forget(session.namespace)  # group headers (steps) come from the restored state
    state = (path / "client_state.bin").read_bytes() if (path / "client_state.bin").exists() else b""
    seconds = time.perf_counter() - t0
    total = sum(o["size"] for o in objects)
    log.info("session %d restored %s (%s, step %d): %d objects, %s in %.2f s", session.id, path, manifest["mode"],
             manifest["step"], len(objects), format_size(total), seconds)
    return CheckpointResult(str(path), source_ns, len(objects), total, manifest["step"], seconds, manifest["mode"],
                            state)


def _restore_copies(daemon: "Daemon", session: "Session", path: Path, objects: list[dict]) -> None:
    store = daemon.store
    pending = []
    mapping, buf = huge_page_buffer(COPY_CHUNK)
    try:
        for o in objects:
            w = store.open_write(session.namespace, o["name"], o["size"], persistent=True, session_id=session.id)
            pending.append(w)
            crc = 0
            with open(path / o["file"], "rb", buffering=0) as f:
                for off in range(0, o["size"], COPY_CHUNK):
                    view = buf[:min(COPY_CHUNK, o["size"] - off)]
                    if f.readinto(view) != len(view):
                        raise DataLoss(f"checkpoint file {path / o['file']} ({o['name']}) is shorter than its "
                                       f"{o['size']} bytes")
                    crc = zlib.crc32(view, crc)
                    w.write(off, view)
                    view.release()
            if crc != o["crc32"]:
                raise DataLoss(f"checkpoint file {path / o['file']} ({o['name']}) is corrupt: crc32 {crc:#010x}, "
                               f"manifest says {o['crc32']:#010x}; nothing was restored")
        store.commit_writes(pending)
    except BaseException:
        for w in pending:
            w.abort()
        raise
    finally:
        buf.release()
        mapping.close()


def delete(daemon: "Daemon", session: "Session | None", path: Path) -> None:
    manifest = read_manifest(path)
    if session is not None:
        _may_read(daemon, session, manifest["namespace"])
    if manifest["mode"] == "snapshot":
        daemon.store.delete(manifest["namespace"], [o["snapshot"] for o in manifest["objects"]], missing_ok=True)
    shutil.rmtree(path)
    log.info("checkpoint %s deleted", path)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
