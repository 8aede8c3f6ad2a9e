"""The store: named objects on the SSD array, moved by the I/O engine.

Writes go to freshly allocated extents and are committed only when every byte is on
the device (see index.py for the crash-consistency argument); a failed or short
transfer frees those extents and leaves the previous version in place. Readers pin
the version they read, so an overwrite or delete never recycles extents under them.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from fuyoud.allocator import OutOfSpace
from fuyoud.errors import DataLoss, InvalidArgument, NotFound, QuotaExceeded, StorageFull
from fuyoud.io.engine import IOEngine, IORequest, IOResult, Op
from fuyoud.memory.segment import buffer_address
from fuyoud.memory.staging import StagingPool
from fuyoud.storage import checksums
from fuyoud.storage.device import Device
from fuyoud.storage.extents import ExtentRefs
from fuyoud.storage.index import IndexDB, ObjectMeta
from fuyoud.storage.layout import Extent, Layout, extent_lengths
from fuyoud.units import align_down, align_up, format_size

if TYPE_CHECKING:
    from fuyoud.storage.pending import PendingWrite

log = logging.getLogger(__name__)
BLOCK = 4096
READ_ATTEMPTS = 2

# Called after each engine batch: (device, "read"|"write", bytes, operations, seconds).
IOObserver = Callable[[int, str, int, int, float], None]


@dataclass
class WriteItem:
    namespace: str
    name: str
    src: memoryview
    persistent: bool = False
    session_id: int = 0


@dataclass
class ReadItem:
    namespace: str
    name: str
    dst: memoryview
    object_offset: int = 0


@dataclass
class _Entry:
    meta: ObjectMeta
    readers: int = 0
    retired: bool = False


@dataclass
class _Batch:
    """The engine requests of one batch and, per request, which item it serves."""
    direct: list[IORequest] = field(default_factory=list)
    direct_items: list[int] = field(default_factory=list)
    # Ranges O_DIRECT cannot do in place: (item, device, device_offset, buffer view).
    bounce: list[tuple[int, int, int, memoryview]] = field(default_factory=list)


@dataclass
class StoreUsage:
    devices: list[tuple[str, int, int]]  # (path, capacity, used)
    objects: dict[bool, int]  # persistent? -> count
    object_bytes: dict[bool, int]
    bytes_read: int = 0
    bytes_written: int = 0
    in_flight: list[int] = field(default_factory=list)  # engine requests in flight, per device
    # Bytes moved per (device, "read"|"write") over the array's whole life (drive endurance).
    lifetime: dict[tuple[int, str], int] = field(default_factory=dict)


class Store:
    def __init__(self, devices: Sequence[Device], index: IndexDB, engine: IOEngine,
                 staging: StagingPool, chunk_size: int = 1 << 20, stripe_size: int = 4 << 20,
                 observer: IOObserver | None = None, namespace_quota: int = 0):
        self.devices = list(devices)
        self.engine = engine
        self.staging = staging
        self.chunk_size = chunk_size
        self.stripe_size = stripe_size
        self.index_db = index
        self._observe = observer or (lambda *a: None)
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], _Entry] = {}
        self.namespace_quota = namespace_quota  # bytes per namespace on the array, 0: none
        self._reserved: dict[str, int] = defaultdict(int)  # bytes of writes in flight, per namespace
        self._moved = {Op.READ: 0, Op.WRITE: 0}  # bytes since start
        self._moved_dev: dict[tuple[int, str], int] = defaultdict(int)
        self._in_flight = [0] * len(self.devices)
        self._lifetime_base = {(d.index, direction): int(self.index_db.get_meta(f"lifetime_{direction}:{d.index}") or 0)
                               for d in self.devices for direction in ("read", "write")}
        self._extents = ExtentRefs(self.devices)
        self._check_devices()
        for meta in index.load():
            self._extents.load(meta.layout)
            self._objects[meta.key] = _Entry(meta)
        self._next_version = 1 + max((m.meta.version for m in self._objects.values()), default=0)
        if self._objects:
            log.info("index: %d persistent objects restored", len(self._objects))

    def _check_devices(self) -> None:
        """Persistent objects name devices by index: refuse a changed array."""
        now = ";".join(str(d.directory.resolve()) for d in self.devices)
        before = self.index_db.get_meta("devices")
        if before is not None and before != now and self.index_db.load():
            raise RuntimeError(
                f"the data directories changed (were {before.split(';')}, now {now.split(';')}) but "
                "persistent objects live on the old ones; restore [storage.data_dirs] or move the state away")
        self.index_db.set_meta("devices", now)

    # -- writing ------------------------------------------------------------------------
    def write(self, items: Sequence[WriteItem]) -> list[ObjectMeta]:
        """Store every item; commit each one whose bytes all reached the device. Raises the
        first failure after committing the others."""
        metas: list[ObjectMeta | None] = []
        try:
            try:
                for it in items:
                    sums = checksums.block_checksums(it.src) if it.persistent else b""
                    metas.append(replace(self._allocate(it.namespace, it.name, len(it.src)),
                                         persistent=it.persistent, session_id=it.session_id, checksums=sums))
            except BaseException:
                self._free_layouts(m.layout for m in metas)
                raise
            batch = _Batch()
            for i, (it, meta) in enumerate(zip(items, metas)):
                self._plan(batch, i, meta.layout, 0, it.src, Op.WRITE)
            errors = self._execute(batch, Op.WRITE, items)
            done = [m for i, m in enumerate(metas) if i not in errors]
            self._free_layouts(m.layout for i, m in enumerate(metas) if i in errors)
            try:
                self._commit(done)
            except BaseException:
                self._free_layouts(m.layout for m in done)
                raise
        finally:
            self._unreserve(metas)
        if errors:
            raise errors[min(errors)]
        return done

    def _check_quota(self, namespace: str, name: str, size: int) -> None:  # with self._lock held
        """A namespace may hold at most ``namespace_quota`` bytes on the array (objects,
        snapshots, writes in flight; the version an object's write replaces is not counted
        twice), so one tenant cannot fill it for the others."""
        used = self._reserved[namespace] + sum(e.meta.size for (ns, n), e in self._objects.items()
                                               if ns == namespace and n != name)
        if used + size > self.namespace_quota:
            raise QuotaExceeded(
                f"namespace {namespace!r} would hold {format_size(used + size)} on the SSD array with "
                f"{namespace}/{name} ({format_size(size)}); its quota is {format_size(self.namespace_quota)} "
                "([storage] namespace_quota): delete objects first")

    def _unreserve(self, metas: Iterable[ObjectMeta]) -> None:
        with self._lock:
            for m in metas:
                self._reserved[m.namespace] -= m.size

    def _allocate(self, namespace: str, name: str, size: int) -> ObjectMeta:
        """Extents for a new version; the bytes count against the namespace's quota until
        the caller ``_unreserve``s them (committed objects count by themselves)."""
        with self._lock:
            if self.namespace_quota:
                self._check_quota(namespace, name, size)
            n = len(self.devices)
            lengths = extent_lengths(size, self.stripe_size, n)
            # Start with the emptiest device so that small objects spread out too.
            order = sorted(range(n), key=lambda d: -self.devices[d].allocator.free_bytes)
            extents: list[Extent] = []
            try:
                for dev, length in zip(order, lengths):
                    extents.append(Extent(dev, self.devices[dev].allocator.allocate(length), length))
            except OutOfSpace as exc:
                for e in extents:
                    self.devices[e.device].allocator.free(e.offset, e.length)
                free = sum(d.allocator.free_bytes for d in self.devices)
                raise StorageFull(
                    f"SSD array full: object {namespace}/{name} needs {format_size(size)}, "
                    f"{format_size(free)} free over {n} device(s) (largest hole {format_size(exc.largest)} "
                    "on one of them); delete objects or add capacity") from None
            version = self._next_version
            self._next_version += 1
            layout = Layout(size, self.stripe_size, tuple(extents))
            self._extents.adopt(layout)
            self._reserved[namespace] += size
        return ObjectMeta(namespace, name, size, False, version, layout)

    def _commit(self, metas: list[ObjectMeta]) -> None:
        persistent = [m for m in metas if m.persistent]
        if persistent:
            for dev in {e.device for m in persistent for e in m.layout.extents}:
                self.devices[dev].sync()
        with self._lock:
            replaced = [m.key for m in metas if not m.persistent and m.key in self._objects
                        and self._objects[m.key].meta.persistent]
            if persistent or replaced:
                self.index_db.commit(persistent, delete=replaced)
            for m in metas:
                old = self._objects.get(m.key)
                self._objects[m.key] = _Entry(m)
                if old is not None:
                    self._retire(old)

    def open_write(self, namespace: str, name: str, size: int, persistent: bool = True,
                   session_id: int = 0) -> "PendingWrite":
        """An object written in pieces (from a file, say) and committed at the end, as
        ``write`` commits: the old version, if any, stays until then."""
        from fuyoud.storage.pending import PendingWrite

        return PendingWrite(self, replace(self._allocate(namespace, name, size), persistent=persistent,
                                          session_id=session_id))

    def commit_writes(self, pending: Sequence[PendingWrite]) -> list[ObjectMeta]:
        """Commit several pieced writes in one index transaction (all or none)."""
        metas = [w.meta for w in pending]
        self._commit(metas)
        for w in pending:
            w._open = False
        self._unreserve(metas)
        return metas

    def link(self, src_namespace: str, namespace: str, pairs: Sequence[tuple[str, str]]) -> list[ObjectMeta]:
        """Make each ``namespace/dst`` a persistent object with the bytes of persistent
        object ``src_namespace/src`` by sharing its extents (no copy): snapshots and
        their restore. All pairs commit in one index transaction; a ``dst`` that existed
        is replaced."""
        with self._lock:
            metas = []
            for src, dst in pairs:
                meta = self._get(src_namespace, src).meta
                if not meta.persistent:
                    raise InvalidArgument(f"object {src_namespace}/{src} is transient: only persistent objects "
                                          "are linked")
                metas.append(replace(meta, namespace=namespace, name=dst, version=self._next_version, session_id=0))
                self._next_version += 1
            if len({m.name for m in metas}) != len(metas):
                raise InvalidArgument("a link target appears twice")
            if self.namespace_quota and metas:  # a snapshot counts in full, though it shares extents
                self._check_quota(namespace, "", sum(m.size for m in metas))
            self.index_db.commit(metas)
            for m in metas:
                self._extents.share(m.layout)
                old = self._objects.get(m.key)
                self._objects[m.key] = _Entry(m)
                if old is not None:
                    self._retire(old)
        return metas

    # -- reading ------------------------------------------------------------------------
    def read(self, items: Sequence[ReadItem]) -> None:
        entries = []
        try:
            with self._lock:
                for it in items:
                    entry = self._get(it.namespace, it.name)
                    end = it.object_offset + len(it.dst)
                    if it.object_offset < 0 or end > entry.meta.size:
                        raise InvalidArgument(
                            f"range [{it.object_offset}, {end}) is outside object "
                            f"{it.namespace}/{it.name} of {entry.meta.size} bytes")
                    entry.readers += 1
                    entries.append(entry)
            self._read_checked(items, [e.meta for e in entries])
        finally:
            self.unpin(entries)

    # -- snapshots: versions held past a later overwrite -----------------------------------
    def pin(self, namespace: str) -> list[_Entry]:
        """Hold the current version of every persistent object of a namespace: later
        overwrites and deletes do not recycle its extents until ``unpin``."""
        with self._lock:
            entries = [e for (ns, _), e in self._objects.items() if ns == namespace and e.meta.persistent]
            for e in entries:
                e.readers += 1
        return entries

    def unpin(self, entries: Iterable[_Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.readers -= 1
                if entry.retired and entry.readers == 0:
                    self._free_layouts([entry.meta.layout], locked=True)

    def read_pinned(self, entry: _Entry, dst: memoryview, object_offset: int) -> None:
        """Read a range of the version ``pin`` returned (whatever was written since)."""
        meta = entry.meta
        if object_offset < 0 or object_offset + len(dst) > meta.size:
            raise InvalidArgument(f"range outside object {meta.namespace}/{meta.name} of {meta.size} bytes")
        self._read_checked([ReadItem(meta.namespace, meta.name, dst, object_offset)], [meta])

    def _read_checked(self, items: Sequence[ReadItem], metas: Sequence[ObjectMeta]) -> None:
        """Read and verify the checksums; an item that fails (EIO, short read, checksum)
        is read once more - reading is safe to repeat - before its error is raised."""
        todo = list(range(len(items)))
        for attempt in range(READ_ATTEMPTS):
            batch = _Batch()
            for i in todo:
                self._plan(batch, i, metas[i].layout, items[i].object_offset, items[i].dst, Op.READ)
            errors = self._execute(batch, Op.READ, items)
            for i in todo:
                if i not in errors and metas[i].checksums:
                    exc = checksums.verify(metas[i], items[i].object_offset, items[i].dst, self._read_raw,
                                           self._where)
                    if exc is not None:
                        errors[i] = exc
            if not errors:
                return
            todo = sorted(errors)
            if attempt + 1 < READ_ATTEMPTS:
                log.warning("read of %d object(s) failed, retrying: %s", len(todo), errors[todo[0]])
        raise errors[todo[0]]

    def _read_raw(self, meta: ObjectMeta, object_offset: int, dst: memoryview) -> Exception | None:
        """One range, unchecked (checksums.verify reads partly covered blocks with it)."""
        batch = _Batch()
        self._plan(batch, 0, meta.layout, object_offset, dst, Op.READ)
        errors = self._execute(batch, Op.READ, [ReadItem(meta.namespace, meta.name, dst, object_offset)])
        return errors.get(0)

    def _where(self, meta: ObjectMeta, object_offset: int) -> str:
        piece = next(iter(meta.layout.pieces(object_offset, 1, self.chunk_size)))
        dev = self.devices[piece.device]
        return f"device {dev.index} ({dev.path}) at device offset {piece.device_offset}"

    # -- planning and running transfers --------------------------------------------------
    def _plan(self, batch: _Batch, item: int, layout: Layout, start: int, buf: memoryview, op: Op) -> None:
        base = buffer_address(buf) if len(buf) else 0
        for p in layout.pieces(start, len(buf), self.chunk_size):
            view = buf[p.object_offset - start:p.object_offset - start + p.length]
            dev = self.devices[p.device]
            aligned = ((base + p.object_offset - start) % BLOCK == 0 and p.length % BLOCK == 0
                       and p.device_offset % BLOCK == 0)
            if aligned or not dev.direct:
                batch.direct.append(IORequest(op, dev.fd, p.device_offset, view, p.device))
                batch.direct_items.append(item)
            else:
                batch.bounce.append((item, p.device, p.device_offset, view))

    def _execute(self, batch: _Batch, op: Op, items: Sequence) -> dict[int, Exception]:
        """Run a batch; returns {item index: error} for the items that failed."""
        errors: dict[int, Exception] = {}
        if batch.direct:
            results = self._timed(batch.direct, op)
            for req, item, res in zip(batch.direct, batch.direct_items, results):
                self._check(res, len(req.buf), op, req.device, req.offset, items[item], item, errors)
        if batch.bounce:
            self._bounce(batch.bounce, op, items, errors)
        return errors

    def _bounce(self, pieces, op: Op, items, errors: dict[int, Exception]) -> None:
        """Unaligned ranges go through a staging slab: aligned superset on the device side."""
        pending = list(pieces)
        while pending:
            with self.staging.slab() as slab:
                used, group = 0, []
                while pending:
                    item, dev, dev_off, view = pending[0]
                    lo, hi = align_down(dev_off, BLOCK), align_up(dev_off + len(view), BLOCK)
                    if used + hi - lo > len(slab):
                        break
                    pending.pop(0)
                    group.append((item, dev, dev_off, view, lo, slab[used:used + hi - lo]))
                    used += hi - lo
                if not group:
                    raise AssertionError("staging slab smaller than one chunk")
                if op is Op.WRITE:  # writes start on a block boundary: pad the tail with zeros
                    for _, _, _, view, _, space in group:
                        space[:len(view)] = view
                        space[len(view):] = bytes(len(space) - len(view))
                reqs = [IORequest(op, self.devices[dev].fd, lo, space, dev) for _, dev, _, _, lo, space in group]
                results = self._timed(reqs, op)
                for (item, dev, dev_off, view, lo, space), res in zip(group, results):
                    if self._check(res, len(space), op, dev, lo, items[item], item, errors) and op is Op.READ:
                        view[:] = space[dev_off - lo:dev_off - lo + len(view)]

    def _timed(self, reqs: list[IORequest], op: Op) -> list[IOResult]:
        queued: dict[int, int] = defaultdict(int)
        for req in reqs:
            queued[req.device] += 1
        self._count_in_flight(queued, 1)
        t0 = time.perf_counter()
        try:
            results = self.engine.execute(reqs)
        finally:
            self._count_in_flight(queued, -1)
        elapsed = time.perf_counter() - t0
        per_dev: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for req, res in zip(reqs, results):
            per_dev[req.device][0] += res.nbytes
            per_dev[req.device][1] += 1
        direction = "read" if op is Op.READ else "write"
        with self._lock:
            self._moved[op] += sum(r.nbytes for r in results)
            for dev, (nbytes, _) in per_dev.items():
                self._moved_dev[(dev, direction)] += nbytes
        for dev, (nbytes, ops) in per_dev.items():
            self._observe(dev, direction, nbytes, ops, elapsed)
        return results

    def _count_in_flight(self, queued: dict[int, int], sign: int) -> None:
        with self._lock:
            for dev, n in queued.items():
                self._in_flight[dev] += sign * n

    def _check(self, res: IOResult, want: int, op: Op, dev: int, offset: int, item, index: int,
               errors: dict[int, Exception]) -> bool:
        if res.ok and res.nbytes == want:
            return True
        verb = "reading" if op is Op.READ else "writing"
        where = f"device {dev} ({self.devices[dev].path}) {verb} object {item.namespace}/{item.name} at device offset {offset}"
        if res.errno:
            cls = StorageFull if res.errno == 28 else DataLoss  # ENOSPC
            err = cls(f"I/O error on {where}: {os.strerror(res.errno)} (errno {res.errno})")
        else:
            err = DataLoss(f"short {op.name.lower()} on {where}: {res.nbytes} of {want} bytes")
        errors.setdefault(index, err)
        return False

    # -- the rest of the index ------------------------------------------------------------
    def _get(self, namespace: str, name: str) -> _Entry:
        entry = self._objects.get((namespace, name))
        if entry is None:
            raise NotFound(f"no object {name!r} in namespace {namespace!r}")
        return entry

    def stat(self, namespace: str, name: str) -> ObjectMeta:
        with self._lock:
            return self._get(namespace, name).meta

    def list(self, namespace: str, prefix: str = "") -> list[ObjectMeta]:
        with self._lock:
            return sorted((e.meta for (ns, n), e in self._objects.items()
                           if ns == namespace and n.startswith(prefix)), key=lambda m: m.name)

    def delete(self, namespace: str, names: Iterable[str], missing_ok: bool = False) -> int:
        names = list(names)
        with self._lock:
            if not missing_ok:
                for name in names:
                    self._get(namespace, name)
            entries = [self._objects[(namespace, n)] for n in names if (namespace, n) in self._objects]
            persistent = [e.meta.key for e in entries if e.meta.persistent]
            if persistent:
                self.index_db.commit([], delete=persistent)
            for e in entries:
                del self._objects[e.meta.key]
                self._retire(e)
            return len(entries)

    def drop_transient(self, session_id: int) -> int:
        """Forget every transient object of a session (it ended or died)."""
        with self._lock:
            gone = [e for e in self._objects.values() if not e.meta.persistent and e.meta.session_id == session_id]
            for e in gone:
                del self._objects[e.meta.key]
                self._retire(e)
            return len(gone)

    def _retire(self, entry: _Entry) -> None:  # with self._lock held
        entry.retired = True
        if entry.readers == 0:
            self._free_layouts([entry.meta.layout], locked=True)

    def _free_layouts(self, layouts: Iterable[Layout], locked: bool = False) -> None:
        def free():
            for layout in layouts:
                self._extents.release(layout)
        if locked:
            free()
        else:
            with self._lock:
                free()

    def usage(self) -> StoreUsage:
        with self._lock:
            objects = {True: 0, False: 0}
            nbytes = {True: 0, False: 0}
            for e in self._objects.values():
                objects[e.meta.persistent] += 1
                nbytes[e.meta.persistent] += e.meta.size
            devices = [(str(d.directory), d.capacity, d.allocator.used_bytes) for d in self.devices]
            lifetime = self._lifetime_locked()
            return StoreUsage(devices, objects, nbytes, self._moved[Op.READ], self._moved[Op.WRITE],
                              list(self._in_flight), lifetime)

    def _lifetime_locked(self) -> dict[tuple[int, str], int]:
        return {key: base + self._moved_dev.get(key, 0) for key, base in self._lifetime_base.items()}

    def save_lifetime(self) -> None:
        """Record the lifetime byte counters in the index (every minute and at close: a
        crash loses at most a minute of them, never committed data)."""
        with self._lock:
            lifetime = self._lifetime_locked()
        self.index_db.set_metas({f"lifetime_{direction}:{dev}": str(value)
                                 for (dev, direction), value in lifetime.items()})

    def close(self) -> None:
        self.save_lifetime()
        with self._lock:
            for d in self.devices:
                d.sync()
                d.close()
            self.index_db.close()
