"""The store: named objects on the SSD array, their versions, pins, quota and space.

Writes go to freshly allocated extents and are committed only when every byte is on
the device (see index.py for the crash-consistency argument); a failed or short
transfer frees those extents and leaves the previous version in place. Readers pin
the version they read, so an overwrite or delete never recycles extents under them.
The bytes move through the transfer layer (transfer.py); objects written in pieces
go through pending.py, which uses the public version API here (new_version,
commit_versions, discard_versions).
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, NamedTuple, Sequence

from fuyoud.concurrency.fairness import FairTurns, Tenant
from fuyoud.errors import InvalidArgument, NotFound, QuotaExceeded, StorageFull
from fuyoud.io.engine import IOEngine, Op
from fuyoud.memory.allocator import OutOfSpace
from fuyoud.memory.staging import StagingPool
from fuyoud.storage import checksums
from fuyoud.storage.device import Device
from fuyoud.storage.extents import ExtentRefs
from fuyoud.storage.index import IndexDB, ObjectMeta
from fuyoud.storage.layout import Extent, Layout, extent_lengths
from fuyoud.sessions.user_limits import SSD, UserLimits
from fuyoud.storage.transfer import IO_SLOTS, Batch, IOObserver, ReadItem, Transfers
from fuyoud.units import format_size

__all__ = ["Store", "WriteItem", "ReadItem", "Entry", "StoreUsage"]
log = logging.getLogger(__name__)


@dataclass
class WriteItem:
    namespace: str
    name: str
    src: memoryview
    persistent: bool = False
    session_id: int = 0


@dataclass
class Entry:
    """A version of an object as the store holds it; pinned while ``readers`` > 0."""
    meta: ObjectMeta
    readers: int = 0
    retired: bool = False


@dataclass
class StoreUsage:
    devices: list["DeviceUsage"]
    objects: dict[bool, int]  # persistent? -> count
    object_bytes: dict[bool, int]
    bytes_read: int = 0
    bytes_written: int = 0
    in_flight: list[int] = field(default_factory=list)  # engine requests in flight, per device
    # Bytes moved per (device, "read"|"write") over the array's whole life (drive endurance).
    lifetime: dict[tuple[int, str], int] = field(default_factory=dict)


class DeviceUsage(NamedTuple):
    path: str
    capacity: int  # the data file's size
    used: int
    available: int  # still allocatable: free in the file plus what an "auto" file may grow by


class Store:
    def __init__(self, devices: Sequence[Device], index: IndexDB, engine: IOEngine,
                 staging: StagingPool, chunk_size: int = 1 << 20, stripe_size: int = 4 << 20,
                 observer: IOObserver | None = None, namespace_quota: int = 0,
                 limits: UserLimits | None = None, user_of: Callable[[str], int | None] = lambda namespace: None,
                 tenant: Tenant | None = None):
        """``limits``' user_ssd bounds what the namespaces of one uid (``user_of``: a
        namespace's uid, None for none known) hold together; ``tenant`` keys the array's
        fair turns (concurrency/fairness.py)."""
        self.devices = list(devices)
        self.io = Transfers(self.devices, engine, staging, chunk_size, observer, FairTurns(IO_SLOTS, tenant))
        self.limits, self._user_of = limits, user_of
        self.stripe_size = stripe_size
        self.index_db = index
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], Entry] = {}
        self.namespace_quota = namespace_quota  # bytes per namespace on the array, 0: none
        self._reserved: dict[str, int] = defaultdict(int)  # bytes of writes in flight, per namespace
        self._lifetime_base = {(d.index, direction): int(self.index_db.get_meta(f"lifetime_{direction}:{d.index}") or 0)
                               for d in self.devices for direction in ("read", "write")}
        self._extents = ExtentRefs(self.devices)
        self._check_devices()
        for meta in index.load():
            self._extents.load(meta.layout)
            self._objects[meta.key] = Entry(meta)
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
            batch = Batch()
            for i, (it, meta) in enumerate(zip(items, metas)):
                self.io.plan(batch, i, meta.layout, 0, it.src, Op.WRITE)
            errors = self.io.execute(batch, Op.WRITE, items)
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

    def _check_user_quota(self, namespace: str, name: str, size: int) -> None:  # with self._lock held
        """The namespaces of one uid hold at most [limits] user_ssd bytes on the array
        together (counted as ``_check_quota`` counts one namespace)."""
        if self.limits is None or not self.limits.limits_ssd:
            return
        uid = self._user_of(namespace)
        if uid is None:
            return
        limit = self.limits.ssd(sum(d.allocator.used_bytes + d.available() for d in self.devices))
        users: dict[str, int | None] = {namespace: uid}

        def mine(ns: str) -> bool:
            if ns not in users:
                users[ns] = self._user_of(ns)
            return users[ns] == uid

        held: dict[str, int] = defaultdict(int)
        for key, e in self._objects.items():
            if key != (namespace, name) and mine(key[0]):
                held[key[0]] += e.meta.size
        for ns, n in self._reserved.items():
            if n and mine(ns):
                held[ns] += n
        total = sum(held.values())
        if total + size <= limit:
            return
        top = sorted(held.items(), key=lambda kv: -kv[1])
        names = "; ".join(f"{ns} {format_size(n)}" for ns, n in top[:4]) + (
            f"; {len(top) - 4} more namespaces" if len(top) > 4 else "")
        raise self.limits.refuse(
            SSD, uid, f"would hold {format_size(total + size)} on the SSD array with {namespace}/{name} "
            f"({format_size(size)}): its namespaces hold {format_size(total)} ({names or 'nothing'})",
            "delete checkpoints or namespaces it no longer needs (fuyouctl namespaces lists them)")

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
            self._check_user_quota(namespace, name, size)
            n = len(self.devices)
            lengths = extent_lengths(size, self.stripe_size, n)
            # Start with the emptiest device so that small objects spread out too.
            order = sorted(range(n), key=lambda d: -self.devices[d].allocator.free_bytes)
            extents: list[Extent] = []
            try:
                for dev, length in zip(order, lengths):
                    extents.append(Extent(dev, self._allocate_on(self.devices[dev], length), length))
            except OutOfSpace as exc:
                for e in extents:
                    self.devices[e.device].allocator.free(e.offset, e.length)
                free = sum(d.available() for d in self.devices)
                raise StorageFull(
                    f"SSD array full: object {namespace}/{name} needs {format_size(size)}, "
                    f"{format_size(free)} free over {n} device(s) (largest hole {format_size(exc.largest)} "
                    "on one of them); delete objects, add capacity ([storage] capacity_per_device, data_dirs) "
                    "or free space on the disks") from None
            version = self._next_version
            self._next_version += 1
            layout = Layout(size, self.stripe_size, tuple(extents))
            self._extents.adopt(layout)
            self._reserved[namespace] += size
        return ObjectMeta(namespace, name, size, False, version, layout)

    @staticmethod
    def _allocate_on(device: Device, length: int) -> int:
        """(lock held) An extent on ``device``, growing an "auto" data file when it has no
        hole large enough."""
        try:
            return device.allocator.allocate(length)
        except OutOfSpace:
            if not device.grow(length):
                raise
            return device.allocator.allocate(length)

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
                self._objects[m.key] = Entry(m)
                if old is not None:
                    self._retire(old)

    # -- versions written in pieces (pending.py) ---------------------------------------------
    def new_version(self, namespace: str, name: str, size: int, persistent: bool = True,
                    session_id: int = 0) -> ObjectMeta:
        """Extents for a new version of an object, reserved against the namespace's quota:
        its bytes are written by the caller (through ``io``) and the version then
        committed (``commit_versions``) or discarded (``discard_versions``), never both.
        Until the commit the old version, if any, stays the object."""
        return replace(self._allocate(namespace, name, size), persistent=persistent, session_id=session_id)

    def commit_versions(self, metas: Sequence[ObjectMeta]) -> list[ObjectMeta]:
        """Make new versions the objects, in one index transaction (all or none: on an
        error they are discarded)."""
        metas = list(metas)
        try:
            self._commit(metas)
        except BaseException:
            self._free_layouts(m.layout for m in metas)
            raise
        finally:
            self._unreserve(metas)
        return metas

    def discard_versions(self, metas: Sequence[ObjectMeta]) -> None:
        """Give back the extents and reservations of versions never committed."""
        self._free_layouts(m.layout for m in metas)
        self._unreserve(metas)

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
            if metas:
                self._check_user_quota(namespace, "", sum(m.size for m in metas))
            self.index_db.commit(metas)
            for m in metas:
                self._extents.share(m.layout)
                old = self._objects.get(m.key)
                self._objects[m.key] = Entry(m)
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
            self.io.read_checked(items, [e.meta for e in entries])
        finally:
            self.unpin(entries)

    # -- snapshots: versions held past a later overwrite -----------------------------------
    def pin(self, namespace: str, exclude: str | None = None) -> list[Entry]:
        """Hold the current version of every persistent object of a namespace (but those
        whose names start with ``exclude``): later overwrites and deletes do not recycle
        its extents until ``unpin`` of exactly these entries."""
        with self._lock:
            entries = [e for (ns, n), e in self._objects.items() if ns == namespace and e.meta.persistent
                       and not (exclude and n.startswith(exclude))]
            for e in entries:
                e.readers += 1
        return entries

    def pin_object(self, namespace: str, name: str) -> Entry:
        """Hold the current version of one object (as ``pin``); NotFound if there is none."""
        with self._lock:
            entry = self._get(namespace, name)
            entry.readers += 1
        return entry

    def unpin(self, entries: Iterable[Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.readers -= 1
                if entry.retired and entry.readers == 0:
                    self._free_layouts([entry.meta.layout], locked=True)

    def read_pinned(self, entry: Entry, dst: memoryview, object_offset: int) -> None:
        """Read a range of the version ``pin`` returned (whatever was written since)."""
        meta = entry.meta
        if object_offset < 0 or object_offset + len(dst) > meta.size:
            raise InvalidArgument(f"range outside object {meta.namespace}/{meta.name} of {meta.size} bytes")
        self.io.read_checked([ReadItem(meta.namespace, meta.name, dst, object_offset)], [meta])

    # -- the rest of the index ------------------------------------------------------------
    def _get(self, namespace: str, name: str) -> Entry:
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

    def namespaces(self) -> set[str]:
        """The namespaces that hold objects."""
        with self._lock:
            return {ns for ns, _ in self._objects}

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

    def _retire(self, entry: Entry) -> None:  # with self._lock held
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
            devices = [DeviceUsage(str(d.directory), d.capacity, d.allocator.used_bytes, d.available())
                       for d in self.devices]
        read, written = self.io.moved()
        return StoreUsage(devices, objects, nbytes, read, written, self.io.in_flight(), self._lifetime())

    def _lifetime(self) -> dict[tuple[int, str], int]:
        moved = self.io.moved_by_device()
        return {key: base + moved.get(key, 0) for key, base in self._lifetime_base.items()}

    def save_lifetime(self) -> None:
        """Record the lifetime byte counters in the index (every minute and at close: a
        crash loses at most a minute of them, never committed data)."""
        lifetime = self._lifetime()
        self.index_db.set_metas({f"lifetime_{direction}:{dev}": str(value)
                                 for (dev, direction), value in lifetime.items()})

    def close(self) -> None:
        """Save the counters, sync and close every data file, close the index: each one
        even when another failed (its lock and descriptors are released); the first
        failure is raised afterwards."""
        errors: list[BaseException] = []

        def attempt(fn) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - raised below, after the rest is closed
                errors.append(exc)

        attempt(self.save_lifetime)
        with self._lock:
            for d in self.devices:
                attempt(d.sync)
                attempt(d.close)
            attempt(self.index_db.close)
        if errors:
            raise errors[0]
