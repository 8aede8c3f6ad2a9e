"""Checkpoints: a namespace's persistent objects (optimizer state included) copied to a
directory while training goes on.

The consistent point: with the lock of every optimizer group of the namespace held (no
step is running) and all groups at the same step count (between iterations), the store
pins the current version of each persistent object, so later steps write new extents
and never recycle these. The locks go at once; the pinned versions are then copied
while the client trains on. A namespace whose groups stay mid-iteration past the
timeout gets FAILED_PRECONDITION and nothing is written.

On disk, written as ``DIR.partial-<pid>`` (each file fsynced) and renamed to ``DIR``,
so ``DIR`` is complete or absent:

    DIR/manifest.json      format, namespace, step, groups, objects (name, file, size,
                           version, crc32)
    DIR/objects/<n>.bin    each object's bytes
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fuyoud import __version__
from fuyoud.errors import FailedPrecondition, InvalidArgument
from fuyoud.memory.hugepages import huge_page_buffer
from fuyoud.optimizer.groups import HEADER, Group
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.units import format_size

if TYPE_CHECKING:
    from fuyoud.server import Daemon

log = logging.getLogger(__name__)
FORMAT = "fuyou-checkpoint/1"
COPY_CHUNK = 8 << 20


@dataclass
class CheckpointResult:
    directory: str
    namespace: str
    objects: int
    bytes: int
    step: int
    seconds: float


def _target(directory: str) -> Path:
    path = Path(directory)
    if not path.is_absolute():
        raise InvalidArgument(f"checkpoint directory must be an absolute path on the daemon's host, got {directory!r}")
    if path.exists():
        raise FailedPrecondition(f"checkpoint directory {path} already exists; name a new one")
    if not path.parent.is_dir():
        raise FailedPrecondition(f"the parent of checkpoint directory {path} does not exist")
    return path


def _quiesce_and_pin(daemon: "Daemon", namespace: str, timeout: float):
    """Pin the namespace's objects at a point where its groups agree on the step count."""
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
                return daemon.store.pin(namespace), max(steps, default=0)
        if time.monotonic() > deadline:
            raise FailedPrecondition(
                f"namespace {namespace!r}: its optimizer groups did not reach a common step within "
                f"{timeout:g} s (steps seen: {sorted(steps)}); retry between iterations or with a longer timeout")
        time.sleep(0.01)


def _group_entry(name: str, head: bytes) -> dict:
    spec, numel, step = OptimizerSpec.parse_header(head)
    return {"name": name[len("optim/"):], "numel": numel, "step": step, "optimizer": spec.to_dict()}


def checkpoint(daemon: "Daemon", namespace: str, directory: str, timeout: float = 60.0) -> CheckpointResult:
    target = _target(directory)
    t0 = time.perf_counter()
    entries, step = _quiesce_and_pin(daemon, namespace, timeout)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    mapping = None
    try:
        (partial / "objects").mkdir(parents=True)
        mapping, buf = huge_page_buffer(COPY_CHUNK)
        objects, groups, total = [], [], 0
        for i, entry in enumerate(sorted(entries, key=lambda e: e.meta.name)):
            meta = entry.meta
            rel = f"objects/{i:06d}.bin"
            crc, head = _copy(daemon, entry, buf, partial / rel)
            if meta.name.startswith("optim/"):
                groups.append(_group_entry(meta.name, head))
            objects.append({"name": meta.name, "file": rel, "size": meta.size, "version": meta.version, "crc32": crc})
            total += meta.size
        manifest = {"format": FORMAT, "fuyoud_version": __version__, "namespace": namespace, "step": step,
                    "created": time.time(), "groups": groups, "objects": objects}
        with open(partial / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial / "objects")
        _fsync_dir(partial)
        os.rename(partial, target)
        _fsync_dir(target.parent)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise FailedPrecondition(f"cannot write checkpoint {target}: {exc}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        daemon.store.unpin(entries)
        if mapping is not None:
            buf.release()
            mapping.close()
    seconds = time.perf_counter() - t0
    log.info("checkpoint of %s at step %d: %d objects, %s in %.2f s to %s", namespace, step, len(objects),
             format_size(total), seconds, target)
    return CheckpointResult(str(target), namespace, len(objects), total, step, seconds)


def _copy(daemon: "Daemon", entry, buf: memoryview, path: Path) -> tuple[int, bytes]:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
