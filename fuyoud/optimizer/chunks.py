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

Checksum blocks: a chunk's ranges rarely end on the 1 MiB blocks every persistent
object has a CRC32C for; chunk_io.py reads and writes them block by block.
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

from fuyoud.concurrency.threads import named
from fuyoud.errors import ResourceExhausted
from fuyoud.memory.hugepages import HUGE
from fuyoud.optimizer.chunk_io import BatchedWrite, BlockWriter, Source, StreamReader
from fuyoud.optimizer.layout import HEADER, Layout
from fuyoud.storage import checksums
from fuyoud.storage.pending import PendingWrite, commit_all
from fuyoud.storage.store import ReadItem, Store
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
    reads = ThreadPoolExecutor(1, **named("optim-read"))
    writes = ThreadPoolExecutor(1, **named("optim-write"))
    write_io = ThreadPoolExecutor(1, **named("optim-write-io"))  # (checksums meanwhile)
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
