"""Layer groups whose state does not fit one optimizer buffer: created and stepped in chunks.

The state object keeps its layout (groups.py: [4 KiB header][weights][exp_avg][exp_avg_sq],
each slot 4 KiB aligned), so checkpoints, export and the clients' weight reads do not
know whether a group is chunked. A chunked step holds one optimizer buffer, as any
step does, or up to three when that many are free (groups.py), and cuts them into

  * scratch: 1 MiB blocks for the edges of the checksum blocks (below), 5 per slot + 1;
  * three *stages*, each holding one chunk: the chunk's range of every slot and room for
    its new weights in the compute dtype (the transient weights object of bf16 offload).

A chunk is a run of elements, a multiple of GRANULE (2048) elements so that every
range of it in the object and in a 16-bit weights copy is 4 KiB aligned (O_DIRECT in
place; int8 state, with a scale per 256 elements, needs 262144: ``granule``), and as large as the stages allow (at most a quarter of the group, so that the
pipeline has something to overlap): larger chunks are fewer, longer transfers, and on
the reference machine a 256M-parameter step in one 42 MiB buffer (chunks of 2.2 MiB per
slot) took 1.4x the SSD bound, in three 1.2x.

While the stepping thread runs the kernel on chunk c, a reader thread reads chunk c+1
from the committed version (pinned for the whole step) and a writer thread writes
chunk c-1 into the new version: a pending write (storage/pending.py) committed once, at
the end, with the header (the new step count) in it and with the weights object when
there is one (pending.commit_all: one index transaction). Until that commit nothing of
the step is visible in the store; a failure anywhere (a non-finite chunk, an I/O error)
aborts the pending writes once the reader and writer have stopped.

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

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from fuyoud.errors import ResourceExhausted
from fuyoud.io.engine import Op
from fuyoud.memory.hugepages import HUGE
from fuyoud.optimizer.layout import HEADER, Layout
from fuyoud.storage import checksums
from fuyoud.storage.index import ObjectMeta
from fuyoud.storage.pending import PendingWrite, commit_all
from fuyoud.storage.store import ReadItem, Store
from fuyoud.storage.transfer import Batch
from fuyoud.units import align_up, format_size

log = logging.getLogger(__name__)
BLOCK = checksums.BLOCK
STAGES = 3  # read-ahead, compute, write-back
GRANULE = 2048  # elements: fp32 ranges 8 KiB aligned, 16-bit ones 4 KiB
MIN_CHUNKS = 4
OUT_BYTES = 4  # room per element for the new weights in the compute dtype (fp32 at most)


def scratch_blocks(slots: int) -> int:
    """1 MiB blocks a chunked step needs beside its stages: per slot STAGES - 1 read-side
    blocks (StreamReader) and three write-side ones (the block the chunk ends in, the one
    the chunk before ended in, which this chunk completes and writes with its batch, and
    the slot's first block, complete only at the end); one more for the weights object."""
    return (STAGES - 1 + 3) * slots + 1


def granule(layout: Layout) -> int:
    """Chunks are a multiple of this many elements: GRANULE, and so that every slot's
    range of a chunk is 4 KiB aligned (a scale per 256 parameters needs 262144)."""
    g = GRANULE
    for s in layout.slots:
        g = math.lcm(g, s.per * 4096 // math.gcd(4096, s.itemsize))
    return g


def _elem_bytes(layout: Layout, count: int) -> int:
    """One stage's bytes for a chunk of ``count`` elements (a multiple of the granule)."""
    return sum(s.itemsize * -(-count // s.per) for s in layout.slots) + OUT_BYTES * count


def min_buffer(layout: Layout) -> int:
    """The smallest optimizer buffer a group of this layout can be stepped in."""
    return align_up(scratch_blocks(len(layout.slots)) * BLOCK + STAGES * _elem_bytes(layout, granule(layout)), HUGE)


def _stage_room(per_buffer: int, scratch: int, buffers: int) -> tuple[int, list[int]]:
    """The largest stage that STAGES stages fit in ``buffers`` buffers of ``per_buffer``
    bytes, the first of which also holds ``scratch`` bytes: (stage bytes, which buffer
    each stage is in)."""
    best, where = 0, []
    for first in range(STAGES + 1):  # stages in the first buffer, the rest spread evenly over the others
        rest = STAGES - first
        if rest and buffers == 1:
            continue
        per_other = -(-rest // (buffers - 1)) if rest else 0
        room = min((per_buffer - scratch) // first if first else per_buffer,
                   per_buffer // per_other if per_other else per_buffer)
        if room > best:
            best = room
            where = [0] * first + [1 + k // per_other for k in range(rest)] if rest else [0] * first
    return best, where


@dataclass(frozen=True)
class ChunkPlan:
    layout: Layout  # the state object's slots (layout.py)
    chunk: int  # elements per chunk
    buffers: int = 1  # optimizer buffers the step holds
    where: tuple[int, ...] = (0,) * STAGES  # the buffer each stage is in

    @classmethod
    def make(cls, layout: Layout, per_buffer: int, what: str, buffers: int = 1) -> "ChunkPlan":
        """Chunks as large as the stages allow in ``buffers`` buffers of ``per_buffer``
        bytes (ResourceExhausted when even one buffer is too small for the smallest)."""
        if per_buffer < min_buffer(layout):
            raise ResourceExhausted(
                f"{what} needs {format_size(layout.size + 4 * layout.numel)} of optimizer state in memory, more than "
                f"one optimizer buffer ({format_size(per_buffer)} = [optimizer] buffer_budget / buffers), and a "
                f"buffer that small cannot step it in chunks either (that needs at least "
                f"{format_size(min_buffer(layout))} per buffer); raise [optimizer] buffer_budget")
        g = granule(layout)
        room, where = _stage_room(per_buffer, scratch_blocks(len(layout.slots)) * BLOCK, buffers)
        fit = g * max(1, room // _elem_bytes(layout, g))
        want = align_up(-(-layout.numel // MIN_CHUNKS), g)
        return cls(layout, min(fit, want), buffers, tuple(where))

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def offsets(self) -> tuple[int, ...]:  # object offset of each slot
        return self.layout.offsets

    @property
    def size(self) -> int:  # the object's bytes
        return self.layout.size

    @property
    def slots(self) -> int:
        return len(self.layout.slots)

    @property
    def scratch_bytes(self) -> int:
        return scratch_blocks(self.slots) * BLOCK

    def region_bytes(self, i: int) -> int:
        """Slot ``i``'s room in a stage: its range of one chunk."""
        s = self.layout.slots[i]
        return s.itemsize * -(-self.chunk // s.per)

    @property
    def stage_bytes(self) -> int:
        return _elem_bytes(self.layout, self.chunk)

    def span(self, i: int, a: int, b: int) -> tuple[int, int]:
        """(object offset, bytes) of slot ``i``'s elements for parameters [a, b)."""
        s = self.layout.slots[i]
        return self.offsets[i] + s.itemsize * (a // s.per), s.itemsize * -(-(b - a) // s.per)

    def buffer_bytes(self, index: int) -> int:
        """What the plan uses of buffer ``index``."""
        return (self.scratch_bytes if index == 0 else 0) + self.where.count(index) * self.stage_bytes

    def ranges(self) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk, self.numel)) for a in range(0, self.numel, self.chunk)]

    def scratch(self, bufs: list[memoryview]) -> list[memoryview]:
        return [bufs[0][k * BLOCK:(k + 1) * BLOCK] for k in range(scratch_blocks(self.slots))]

    def stages(self, bufs: list[memoryview]) -> list[memoryview]:
        """Each stage's memory in the buffers the step holds."""
        out, used = [], [self.scratch_bytes] + [0] * (len(bufs) - 1)
        for b in self.where:
            out.append(bufs[b][used[b]:used[b] + self.stage_bytes])
            used[b] += self.stage_bytes
        return out


class _Stage:
    """One chunk's place: a region per slot, then the weights copy."""

    def __init__(self, mem: memoryview, plan: ChunkPlan):
        self.layout = plan.layout
        self.regions, at = [], 0
        for i in range(plan.slots):
            self.regions.append(mem[at:at + plan.region_bytes(i)])
            at += plan.region_bytes(i)
        self.out = mem[at:plan.stage_bytes]

    def slots(self, m: int) -> list[torch.Tensor]:
        return [torch.frombuffer(r, dtype=s.dtype)[:s.count(m)] for r, s in zip(self.regions, self.layout.slots)]

    def weights(self, m: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(self.out, dtype=dtype)[:m]


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


@dataclass
class _Read:
    """One chunk as the reader left it: raw items, which of them are cache blocks, the
    items whose reads failed, and the earlier chunks whose cache blocks it copied from."""
    items: list[tuple[int, memoryview]]
    cache_items: set[int]
    errors: dict[int, Exception]
    sources: set[int]


class _Stop(Exception):
    """The step already failed: the reader and writer do nothing more."""


@dataclass
class Timing:
    read_s: float = 0.0  # waiting for reads
    compute_s: float = 0.0
    write_s: float = 0.0  # waiting for the last writes and the commit


# compute(a, b, slots, weights): one chunk's step in place on ``slots`` (fp32, b - a
# elements each), its new weights into ``weights`` (compute dtype) when given; raises to
# refuse the step.
Compute = Callable[[int, int, list[torch.Tensor], "torch.Tensor | None"], None]


def step(store: Store, bufs: list[memoryview], plan: ChunkPlan, namespace: str, name: str, header: bytes,
         session_id: int, compute: Compute, weights_object: str = "",
         out_dtype: torch.dtype | None = None, held=None) -> Timing:
    """One step of the group whose state is ``namespace/name``, chunk by chunk through
    ``bufs`` (``plan.buffers`` of them): the new state, ``header`` first, is committed as
    one new version of the object (with the ``weights_object``, ``out_dtype`` elements,
    when named) once every chunk is computed and written, or not at all. ``held``
    (held.HeldWeights): master weights already in memory, copied for the chunks it
    covers instead of read. When this returns or raises, no thread touches ``bufs``
    (or ``held``) any more."""
    timing = Timing()
    chunks = plan.ranges()
    stages = [_Stage(mem, plan) for mem in plan.stages(bufs)]
    blocks = plan.scratch(bufs)
    rc = STAGES - 1
    readers = [StreamReader(plan.size, blocks[rc * i:rc * (i + 1)]) for i in range(plan.slots)]
    free = blocks[rc * plan.slots:]  # the writers' scratch
    wsize = torch.empty(0, dtype=out_dtype).element_size() if weights_object else 0
    pending: list[BatchedWrite] = []
    failure: list[BaseException] = []  # the first error of the reader or writer
    failed = threading.Event()
    reads = ThreadPoolExecutor(1, thread_name_prefix="optim-read")
    writes = ThreadPoolExecutor(1, thread_name_prefix="optim-write")
    write_io = ThreadPoolExecutor(1, thread_name_prefix="optim-write-io")  # (checksums meanwhile)
    source: Source | None = None
    bad_caches: set[int] = set()  # chunks whose cache blocks failed their check

    def guarded(fn):
        def run(*args):
            if failed.is_set():
                raise _Stop()
            try:
                return fn(*args)
            except BaseException as exc:
                if not failed.is_set():
                    failure.append(exc)
                    failed.set()  # (a writer must never touch a pending write that was aborted)
                raise
        return run

    @guarded
    def read(c: int, before: Future | None) -> _Read:
        if before is not None:
            before.result()  # the stage's previous chunk is written
            if failed.is_set():
                raise _Stop()
        a, b = chunks[c]
        stage = stages[c % STAGES]
        items: list[tuple[int, memoryview]] = []
        cache_items: set[int] = set()
        sources: set[int] = set()
        after: list[Callable[[], None]] = []
        for i, reader in enumerate(readers):
            lo, n = plan.span(i, a, b)
            if i == 0 and held is not None and held.covers(a, b):
                held.copy(a, b, stage.regions[0][:n])  # (checked when it was read)
                held.done_below(b)
                continue
            if reader.plan(c, lo, lo + n, stage.regions[i], items, after, sources):
                cache_items.add(len(items) - 1)
        errors = source.read_raw(items)
        for copy in after:
            copy()
        return _Read(items, cache_items, errors, sources)

    def check(c: int, got: _Read) -> None:
        """Chunk c's raw reads checked (in the stepping thread, while the reader reads
        on); a chunk with a failed item, or with bytes copied from a cache block that
        failed, is read again, checked, from its ranges."""
        bad = dict(got.errors)
        for i, (offset, dst) in enumerate(got.items):
            if i not in bad:
                exc = source.check(offset, dst)
                if exc is not None:
                    bad[i] = exc
        if got.cache_items & bad.keys():
            bad_caches.add(c)  # the chunks that copy from it are read again too
        if not bad and not got.sources & bad_caches:
            return
        if bad:
            log.warning("chunk %d of %s: %d read(s) failed, reading it again: %s", c, name, len(bad),
                        next(iter(bad.values())))
        a, b = chunks[c]
        for i, region in enumerate(stages[c % STAGES].regions):
            lo, n = plan.span(i, a, b)
            source.read(lo, region[:n])

    @guarded
    def write(c: int) -> None:
        a, b = chunks[c]
        stage = stages[c % STAGES]
        if c == 0:
            state.put(0, memoryview(header))
        for i, region in enumerate(stage.regions):
            lo, n = plan.span(i, a, b)
            if b == plan.numel:  # the slot's padding: zeros, like every version's
                end = plan.offsets[i] + plan.layout.slot_bytes(plan.layout.slots[i]) - lo
                region[n:end] = bytes(end - n)
                n = end
            state.put(lo, region[:n])
        state.flush()
        if weights is not None:
            weights.put(a * wsize, stage.out[:(b - a) * wsize])
            weights.flush()

    try:
        source = Source(store, namespace, name)
        pending.append(BatchedWrite(PendingWrite.start(store, namespace, name, plan.size, True, session_id), write_io))
        state = BlockWriter(pending[0], free)
        weights = None
        if weights_object:
            pending.append(BatchedWrite(PendingWrite.start(store, namespace, weights_object, plan.numel * wsize, False,
                                                           session_id), write_io))
            weights = BlockWriter(pending[1], free)
        read_futures = {c: reads.submit(read, c, None) for c in range(min(STAGES - 1, len(chunks)))}
        write_futures: dict[int, Future] = {}
        for c, (a, b) in enumerate(chunks):
            t0 = time.perf_counter()
            check(c, read_futures.pop(c).result())
            t1 = time.perf_counter()
            stage = stages[c % STAGES]
            compute(a, b, stage.slots(b - a), stage.weights(b - a, out_dtype) if weights is not None else None)
            t2 = time.perf_counter()
            timing.read_s += t1 - t0
            timing.compute_s += t2 - t1
            write_futures[c] = writes.submit(write, c)
            nxt = c + STAGES - 1
            if nxt < len(chunks):  # into the stage of chunk c - 1, once that is written
                read_futures[nxt] = reads.submit(read, nxt, write_futures.get(nxt - STAGES))
        t0 = time.perf_counter()
        for f in write_futures.values():
            f.result()
        state.finish()
        if weights is not None:
            weights.finish()
        commit_all(store, [w.pending for w in pending])
        timing.write_s = time.perf_counter() - t0
        return timing
    except BaseException as exc:
        failed.set()
        reads.shutdown(wait=True, cancel_futures=True)
        writes.shutdown(wait=True, cancel_futures=True)
        write_io.shutdown(wait=True)
        for w in pending:
            w.abort()
        if isinstance(exc, _Stop) and failure:
            raise failure[0] from None
        raise
    finally:
        reads.shutdown(wait=True)
        writes.shutdown(wait=True)
        write_io.shutdown(wait=True)
        if source is not None:
            source.close()


def create(store: Store, buf: memoryview, plan: ChunkPlan, namespace: str, name: str, header: bytes,
           body: memoryview, session_id: int) -> None:
    """A new state object, in pieces through ``buf``: ``header``, then ``body`` (copied
    into ``buf`` first: the client's memory may change while it is written) and zeros
    to the object's end. A body of fp32 master weights gives zero moments; one of the
    whole slot area, a state as given. Committed at the end or not at all."""
    blocks = plan.scratch([buf])
    area = buf[plan.scratch_bytes:plan.buffer_bytes(0)]
    piece = len(area) // 8192 * 8192
    raw = torch.frombuffer(area, dtype=torch.uint8)
    pending = BatchedWrite(PendingWrite.start(store, namespace, name, plan.size, True, session_id))
    try:
        out = BlockWriter(pending, blocks)
        out.put(0, memoryview(header))
        size, clean = plan.size - HEADER, 0  # area[:clean] holds zeros already
        for off in range(0, size, piece):
            m = min(piece, size - off)
            real = max(0, min(m, len(body) - off))
            area[:real] = body[off:off + real]
            if real or clean < m:
                raw[real:m].zero_()
            clean = 0 if real else m
            out.put(HEADER + off, area[:m])
            out.flush()
        out.finish()
        commit_all(store, [pending.pending])
    except BaseException:
        pending.abort()
        raise


def read_weights(store: Store, area: memoryview, plan: ChunkPlan, namespace: str, name: str, end: int,
                 into: Callable[[int, int, torch.Tensor], None]) -> None:
    """The committed master weights of elements [0, ``end``), piece by piece through
    ``area`` (a stage's memory, say): ``into(a, b, weights)`` for each piece."""
    piece = len(area) // 4 // GRANULE * GRANULE
    for a in range(0, end, piece):
        b = min(a + piece, end)
        store.read([ReadItem(namespace, name, area[:4 * (b - a)], plan.offsets[0] + 4 * a)])
        into(a, b, torch.frombuffer(area, dtype=torch.float32)[:b - a])
