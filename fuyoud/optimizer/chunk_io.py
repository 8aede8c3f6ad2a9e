"""Reading and writing a chunked step's ranges (chunks.py) whole checksum block by block.

Checksum blocks: every persistent object carries a CRC32C per 1 MiB block. On the
write side a pending write takes whole blocks only, and a chunk's ranges rarely end on
block boundaries: BlockWriter writes the whole blocks of a range in place and gathers
the bytes of a partly covered block in a scratch block until the block is complete (a
slot's first block also holds the end of the previous slot, or the header, which come
later or earlier). On the read side a partly covered block would be read whole once
more by the checksum check; StreamReader instead reads the block a chunk ends in whole
into a scratch block and the next chunk takes its head from there, so every block is
read once. The reader reads raw (Source) and the stepping thread checks the checksums
of what it read before using it, while the reader goes on (Store.read checks each batch
before the next can start); a chunk that fails its check, or took bytes from a cache
block that failed, is read again from its ranges with Store's checked, retried read.
Likewise the writer's batches run on a helper thread while the writer computes their
checksums.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fuyoud.io.engine import Op
from fuyoud.storage import checksums
from fuyoud.storage.index import ObjectMeta
from fuyoud.storage.pending import PendingWrite
from fuyoud.storage.store import ReadItem, Store
from fuyoud.storage.transfer import Batch

BLOCK = checksums.BLOCK


class BatchedWrite:
    """A pending write that takes many pieces in one engine batch (PendingWrite.write
    takes one: a chunk's ranges of three slots, written one after the other, kept few
    requests in flight and wrote at a fraction of the disk's speed). With ``io`` (a
    thread) the batch runs there while the calling thread computes its checksums."""

    def __init__(self, pending: PendingWrite, io: ThreadPoolExecutor | None = None):
        self.pending, self.io = pending, io

    @property
    def meta(self) -> ObjectMeta:
        return self.pending.meta

    def write_many(self, pieces: list[tuple[int, memoryview]]) -> None:
        """Bytes [offset, offset + len(src)) for each (offset, src), each a run of whole
        checksum blocks (the object's last one may be short)."""
        if not pieces:
            return
        for offset, src in pieces:
            if offset % BLOCK or offset < 0 or offset + len(src) > self.meta.size or (
                    len(src) % BLOCK and offset + len(src) != self.meta.size):
                raise AssertionError(f"piece [{offset}, {offset + len(src)}) of {self.meta.name!r} is not a run of "
                                     "whole checksum blocks")
        batch, items = self.pending.plan(pieces)
        running = self.io.submit(self.pending.run, batch, items) if self.io is not None else None
        sums = [checksums.block_checksums(src) for _, src in pieces] if self.pending.checksummed else []
        errors = running.result() if running is not None else self.pending.run(batch, items)
        self.pending.write_batch(pieces, sums, errors)

    def abort(self) -> None:
        self.pending.abort()


class BlockWriter:
    """Bytes of an object being written through a BatchedWrite, put in pieces at any
    offsets (each byte once): whole 1 MiB blocks go to the device in place, a block
    covered in part waits in a scratch block for the rest of its bytes. What ``put``
    gathers is written by ``flush``, in one batch. Not thread-safe."""

    def __init__(self, pending: BatchedWrite, scratch: list[memoryview]):
        self.pending, self.size = pending, pending.meta.size
        self.scratch = scratch  # free blocks, shared with other writers of the same step
        self.open: dict[int, list] = {}  # block index -> [scratch block, bytes still missing]
        self.ready: list[tuple[int, memoryview]] = []  # (offset, bytes) to write
        self.done: list[memoryview] = []  # scratch blocks to give back once written

    def put(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        run: list[int] = []  # [start, end) of whole blocks to write straight from data
        k = offset // BLOCK
        while k * BLOCK < end:
            lo, hi = k * BLOCK, min((k + 1) * BLOCK, self.size)
            if offset <= lo and hi <= end:
                run = [run[0] if run else lo, hi]
            else:
                a, b = max(lo, offset), min(hi, end)
                entry = self.open.get(k)
                if entry is None:
                    if not self.scratch:  # the completed ones come back once written
                        self.flush()
                    entry = self.open[k] = [self.scratch.pop(), hi - lo]
                entry[0][a - lo:b - lo] = data[a - offset:b - offset]
                entry[1] -= b - a
                if entry[1] == 0:
                    del self.open[k]
                    self.ready.append((lo, entry[0][:hi - lo]))
                    self.done.append(entry[0])
            k += 1
        if run:
            self.ready.append((run[0], data[run[0] - offset:run[1] - offset]))

    def flush(self) -> None:
        ready, self.ready = self.ready, []
        self.pending.write_many(ready)
        self.scratch.extend(self.done)
        self.done = []

    def finish(self) -> None:
        self.flush()
        if self.open:
            raise AssertionError(f"blocks {sorted(self.open)} of {self.pending.meta.name!r} were never completed")


class Source:
    """The committed version of an object, pinned while a step reads it in pieces (an
    overwrite or delete meanwhile does not recycle its extents), read raw in batches and
    checked apart: the reader thread keeps the device busy while the stepping thread
    checks what it read (Store.read checks each batch before the next can start, which
    left the device idle a fifth of the time)."""

    def __init__(self, store: Store, namespace: str, name: str):
        self.store = store
        self.entry = store.pin_object(namespace, name)
        self.meta = self.entry.meta

    def close(self) -> None:
        self.store.unpin([self.entry])

    def read_raw(self, items: list[tuple[int, memoryview]]) -> dict[int, Exception]:
        """Bytes [offset, offset + len(dst)) into each dst, unchecked, in one batch; the
        items that failed, with their errors."""
        batch = Batch()
        for i, (offset, dst) in enumerate(items):
            self.store.io.plan(batch, i, self.meta.layout, offset, dst, Op.READ)
        return self.store.io.execute(batch, Op.READ, [ReadItem(self.meta.namespace, self.meta.name, dst, offset)
                                                      for offset, dst in items])

    def check(self, offset: int, dst: memoryview) -> Exception | None:
        """Whether bytes read raw match the object's checksums (None) or not (the error)."""
        if not self.meta.checksums:
            return None
        return self.store.io.verify(self.meta, offset, dst)

    def read(self, offset: int, dst: memoryview) -> None:
        """Checked, with Store's retry: for ranges whose raw read failed."""
        self.store.read_pinned(self.entry, dst, offset)


class StreamReader:
    """Consecutive ranges of one stream (a slot) of a committed object, read so that no
    checksum block is read twice: the block a range ends in is read whole into a cache
    block, and the next range takes its head from there. STAGES - 1 cache blocks, used
    in turn: the reader runs up to STAGES - 2 chunks ahead of the check of a chunk's
    reads, so the block a chunk read is not overwritten before it is checked. Not
    thread-safe."""

    def __init__(self, size: int, caches: list[memoryview]):
        self.size, self.caches = size, caches
        self.cached, self.which = -1, 0  # the block index held in caches[which]
        self.cached_by = -1  # the chunk that read it

    def plan(self, chunk: int, lo: int, hi: int, dst: memoryview, items: list[tuple[int, memoryview]],
             after: list[Callable[[], None]], sources: set[int]) -> bool:
        """Bytes [lo, hi) of ``chunk`` into ``dst``: what the cache holds is copied now
        (the chunk that read it goes to ``sources``: those bytes are checked with that
        chunk's reads), the raw reads are added to ``items`` and the copies out of the
        cache they fill to ``after``. Returns whether the last item added is a cache block."""
        last = (hi - 1) // BLOCK
        run: list[int] = []
        cache_read = False
        for k in range(lo // BLOCK, last + 1):
            blo, bhi = k * BLOCK, min((k + 1) * BLOCK, self.size)
            a, b = max(lo, blo), min(hi, bhi)
            if a == blo and b == bhi:
                run = [run[0] if run else a, b]
                continue
            if k == self.cached:
                dst[a - lo:b - lo] = self.caches[self.which][a - blo:b - blo]
                sources.add(self.cached_by)
            elif k == last:  # where the next range begins: whole, into the next cache block
                self.which, self.cached, self.cached_by = (self.which + 1) % len(self.caches), k, chunk
                cache = self.caches[self.which]
                cache_read = True
                items.append((blo, cache[:bhi - blo]))
                after.append(lambda a=a, b=b, blo=blo, cache=cache: dst.__setitem__(slice(a - lo, b - lo),
                                                                                    cache[a - blo:b - blo]))
            else:  # a stream's first block, never cached: its check reads it whole
                items.append((a, dst[a - lo:b - lo]))
        if run:  # (before the cache block: that stays the last item)
            items.insert(len(items) - cache_read, (run[0], dst[run[0] - lo:run[1] - lo]))
        return cache_read
