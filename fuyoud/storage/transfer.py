"""The transfer layer: bytes between memory and an object's extents on the SSD array.

It knows layouts, not objects: a transfer is planned (``plan``: each range cut into
engine requests, O_DIRECT in place where addresses, lengths and device offsets are
4 KiB aligned, through a staging slab where not), run (``execute``: one engine batch,
errors per item) and, for reads, checked against the object's checksums
(``read_checked``, which also retries a failed read once). It counts the bytes it
moves, per device and direction, and the requests in flight. The store (store.py) uses
it for whole objects, pending writes (pending.py) and the chunked optimizer steps
(optimizer/chunks.py) for pieces of one.

The array is shared fairly between tenants: an engine batch goes to the engine in
windows of at most WINDOW_BYTES, each taking one of IO_SLOTS turns on the array
(concurrency/fairness.py) on behalf of the batch's namespace. A tenant alone keeps up to IO_SLOTS
windows in flight (each with the engine's queue depth: as many requests as before);
tenants that all want more get the turns in a round, so each has an equal share of the
array in flight however many transfers it runs at once (a checkpoint copy, an export
or a burst of swaps of one job no longer crowds out another's step).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from fuyoud.concurrency.fairness import FairTurns
from fuyoud.errors import DataLoss, StorageFull
from fuyoud.io.engine import IOEngine, IORequest, IOResult, Op
from fuyoud.memory.staging import StagingPool
from fuyoud.storage import checksums
from fuyoud.storage.device import Device
from fuyoud.storage.index import ObjectMeta
from fuyoud.storage.layout import Layout
from fuyoud.units import align_down, align_up
from fuyou_proto.contract import PAGE as BLOCK, buffer_address

log = logging.getLogger(__name__)
READ_ATTEMPTS = 2
IO_SLOTS = 4  # windows in flight on the array at once, all tenants together
WINDOW_BYTES = 32 << 20  # the most one window (one turn) moves

# Called after each engine batch: (device, "read"|"write", bytes, operations, seconds).
IOObserver = Callable[[int, str, int, int, float], None]


class Item(Protocol):
    """What a transfer's errors name: the object it moves bytes of."""
    namespace: str
    name: str


@dataclass
class ReadItem:
    """Bytes of an object read into ``dst`` from ``object_offset``."""
    namespace: str
    name: str
    dst: memoryview
    object_offset: int = 0


@dataclass
class Batch:
    """The engine requests of one batch and, per request, which item it serves."""
    direct: list[IORequest] = field(default_factory=list)
    direct_items: list[int] = field(default_factory=list)
    # Ranges O_DIRECT cannot do in place: (item, device, device_offset, buffer view).
    bounce: list[tuple[int, int, int, memoryview]] = field(default_factory=list)


class Transfers:
    def __init__(self, devices: Sequence[Device], engine: IOEngine, staging: StagingPool, chunk_size: int,
                 observer: IOObserver | None = None, turns: FairTurns | None = None):
        self.devices = list(devices)
        self.engine = engine
        self.turns = turns or FairTurns(IO_SLOTS)  # the array's turns, shared by the tenants
        self.staging = staging
        self.chunk_size = chunk_size
        self._observe = observer or (lambda *a: None)
        self._lock = threading.Lock()
        self._moved = {Op.READ: 0, Op.WRITE: 0}  # bytes since start
        self._moved_dev: dict[tuple[int, str], int] = defaultdict(int)
        self._in_flight = [0] * len(self.devices)

    # -- counters ---------------------------------------------------------------------------
    def moved(self) -> tuple[int, int]:
        """(bytes read, bytes written) since start."""
        with self._lock:
            return self._moved[Op.READ], self._moved[Op.WRITE]

    def moved_by_device(self) -> dict[tuple[int, str], int]:
        """Bytes since start per (device, "read"|"write")."""
        with self._lock:
            return dict(self._moved_dev)

    def in_flight(self) -> list[int]:
        """Engine requests in flight, per device."""
        with self._lock:
            return list(self._in_flight)

    # -- transfers --------------------------------------------------------------------------
    def plan(self, batch: Batch, item: int, layout: Layout, start: int, buf: memoryview, op: Op) -> None:
        """Add the requests moving bytes [start, start + len(buf)) of ``layout`` to or from
        ``buf``, on behalf of item number ``item`` of the batch."""
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

    def execute(self, batch: Batch, op: Op, items: Sequence[Item]) -> dict[int, Exception]:
        """Run a batch; returns {item index: error} for the items that failed."""
        errors: dict[int, Exception] = {}
        owner = items[0].namespace if items else None
        if batch.direct:
            results = self._timed(batch.direct, op, owner)
            for req, item, res in zip(batch.direct, batch.direct_items, results):
                self._check(res, len(req.buf), op, req.device, req.offset, items[item], item, errors)
        if batch.bounce:
            self._bounce(batch.bounce, op, items, errors, owner)
        return errors

    def read_checked(self, items: Sequence[ReadItem], metas: Sequence[ObjectMeta]) -> None:
        """Read and verify the checksums; an item that fails (EIO, short read, checksum)
        is read once more - reading is safe to repeat - before its error is raised."""
        todo = list(range(len(items)))
        for attempt in range(READ_ATTEMPTS):
            batch = Batch()
            for i in todo:
                self.plan(batch, i, metas[i].layout, items[i].object_offset, items[i].dst, Op.READ)
            errors = self.execute(batch, Op.READ, items)
            for i in todo:
                if i not in errors and metas[i].checksums:
                    exc = self.verify(metas[i], items[i].object_offset, items[i].dst)
                    if exc is not None:
                        errors[i] = exc
            if not errors:
                return
            todo = sorted(errors)
            if attempt + 1 < READ_ATTEMPTS:
                log.warning("read of %d object(s) failed, retrying: %s", len(todo), errors[todo[0]])
        raise errors[todo[0]]

    def verify(self, meta: ObjectMeta, object_offset: int, dst: memoryview) -> Exception | None:
        """Whether bytes read raw into ``dst`` match the object's checksums (None) or not
        (the error); blocks ``dst`` covers in part are read whole to check them."""
        return checksums.verify(meta, object_offset, dst, self.read_raw, self.where)

    def read_raw(self, meta: ObjectMeta, object_offset: int, dst: memoryview) -> Exception | None:
        """One range, unchecked; its error or None."""
        batch = Batch()
        self.plan(batch, 0, meta.layout, object_offset, dst, Op.READ)
        return self.execute(batch, Op.READ, [ReadItem(meta.namespace, meta.name, dst, object_offset)]).get(0)

    def where(self, meta: ObjectMeta, object_offset: int) -> str:
        """The device and device offset of an object's byte, for error messages."""
        piece = next(iter(meta.layout.pieces(object_offset, 1, self.chunk_size)))
        dev = self.devices[piece.device]
        return f"device {dev.index} ({dev.path}) at device offset {piece.device_offset}"

    # -- inside a batch -----------------------------------------------------------------------
    def _bounce(self, pieces, op: Op, items, errors: dict[int, Exception], owner=None) -> None:
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
                results = self._timed(reqs, op, owner)
                for (item, dev, dev_off, view, lo, space), res in zip(group, results):
                    if self._check(res, len(space), op, dev, lo, items[item], item, errors) and op is Op.READ:
                        view[:] = space[dev_off - lo:dev_off - lo + len(view)]

    def _timed(self, reqs: list[IORequest], op: Op, owner=None) -> list[IOResult]:
        queued: dict[int, int] = defaultdict(int)
        for req in reqs:
            queued[req.device] += 1
        self._count_in_flight(queued, 1)
        t0 = time.perf_counter()
        try:
            results = []
            for window in _windows(reqs):
                with self.turns.turn(owner):
                    results.extend(self.engine.execute(window))
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

    def _check(self, res: IOResult, want: int, op: Op, dev: int, offset: int, item: Item, index: int,
               errors: dict[int, Exception]) -> bool:
        if res.ok and res.nbytes == want:
            return True
        verb = "reading" if op is Op.READ else "writing"
        where = f"device {dev} ({self.devices[dev].path}) {verb} object {item.namespace}/{item.name} at device offset {offset}"
        if res.errno:
            if res.errno == 28:  # ENOSPC: the file system under the data file is full, not a failing disk
                err = StorageFull(f"no space left on {where}: the file system holding the data file is full "
                                  f"(free space there, or lower [storage] capacity_per_device)")
            else:
                err = DataLoss(f"I/O error on {where}: {os.strerror(res.errno)} (errno {res.errno})")
        else:
            err = DataLoss(f"short {op.name.lower()} on {where}: {res.nbytes} of {want} bytes")
        errors.setdefault(index, err)
        return False


def _windows(reqs: list[IORequest]) -> list[list[IORequest]]:
    """The requests cut, in order, into runs of at most WINDOW_BYTES (one request at least)."""
    out, run, size = [], [], 0
    for r in reqs:
        if run and size + len(r.buf) > WINDOW_BYTES:
            out.append(run)
            run, size = [], 0
        run.append(r)
        size += len(r.buf)
    if run:
        out.append(run)
    return out
