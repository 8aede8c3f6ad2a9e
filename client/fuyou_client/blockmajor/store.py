"""The tensors block-major training keeps between its passes (schedule.py), keyed
(kind, block, micro-batch): ("x", l, i) is micro-batch i's input to block l (l = n, the
last block's output, is the rest's input), ("g", l, i) the gradient flowing into block
l's output. A step of n blocks and K micro-batches keeps (n + 2) K of them at its peak
(every input, the last outputs, the last block's gradients), one slot each.

Where they live. On the CPU, the tensors themselves. On a device with its own memory,
slots of one host arena of shared memory (registered like every segment): put downloads
on the download stream, ``prefetch`` uploads ahead on the upload stream, ``take`` makes
the compute stream wait for its upload only, and a slot takes a new download only after
the upload out of it ran (ordered by events, not by the host).

``host_budget`` bounds them (on the CPU too), in slots of one entry rounded up to 4 KiB.
What does not fit goes to the SSD array through fuyoud, with activations/spill.py's tier (the
activation swapper's: transient objects, a CRC32C each, checked on the way back):

* *What goes* is planned at ``reserve``, when the step's shape is known: the entries
  backward needs last (furthest next use first: the last block's outputs, which only the
  rest's backward reads, then the first blocks' inputs, the last micro-batch first),
  just as many as make forward's peak plus ``STAGING`` slots (transfers in flight) fit.
  Gradients never go: each lives through one block's backward. The order is fixed, so
  the plan is made once rather than evicting on demand: the bytes spilled are exactly
  the excess, and each entry can be written the moment it exists;
* *when*: as forward produces it (the daemon writes from the arena; on the CPU through a
  staging slot of it), so writes overlap forward's compute instead of waiting for room;
  its host copy goes once written and once forward, which takes each block input once
  (``keep=True``), is done with it;
* *back*: from backward's first take on, in the order backward takes them (blocks in
  reverse, micro-batches ascending, then the last outputs for the rest), into free
  arena space, ``READ_AHEAD`` reads in flight and (on a device) one slot left for the
  gradient backward puts next; ``take`` waits only for what that did not hide. A read
  that fails its checksum is a ``DataLoss`` naming the block and micro-batch.

``reserve`` refuses, before anything is written, a budget below what must be in memory
at once: K entries (one block's micro-batches in forward, the gradients in backward)
plus ``STAGING``. ``stats`` counts each step: bytes written to and read back from the
SSD array, and the seconds ``take`` waited for a read and ``put`` for a write (exposed).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from fuyou_client.device.devices import DONE, Device
from fuyou_client.connection.session import flatten
from fuyou_client.activations.spill import Arena, Spilled, SsdTier, aligned

STAGING = 2  # slots beyond the plan's: writes in flight in forward, reads in backward
READ_AHEAD = 4  # reads from the SSD array in flight at once


@dataclass
class StoreStats:
    """One step's traffic to and from the SSD array (reset when the next step starts)."""
    spilled: int = 0  # bytes written
    read_back: int = 0  # bytes read back
    spilled_entries: int = 0
    read_entries: int = 0
    read_ahead: int = 0  # of those, reads started before backward asked for them
    read_wait_s: float = 0.0  # take waited for a read from the SSD array (exposed)
    write_wait_s: float = 0.0  # put waited for room held by writes in flight (exposed)
    # Swapped blocks' activations (swap_blocks: blockmajor/swapped.py), bytes this step:
    swapped_blocks: int = 0
    activations_to_host: int = 0  # down into their arena
    activations_back: int = 0  # taken back by backward
    activations_to_ssd: int = 0  # beyond the arena: written to the SSD array
    activations_from_ssd: int = 0  # and read back


def spill_order(blocks: int, micro_batches: int, last: bool = True, swapped=frozenset()) -> list[tuple]:
    """The entries that may go to the SSD array, the one backward needs last first (not
    the inputs of ``swapped`` blocks: backward does not take them)."""
    n, k = blocks, micro_batches
    tail = [("x", n, i) for i in reversed(range(k))] if last else []
    return tail + [("x", l, i) for l in range(n) if l not in swapped for i in reversed(range(k))]


def need_order(blocks: int, micro_batches: int, last: bool = True, swapped=frozenset()) -> list[tuple]:
    """The block inputs in the order backward (then the rest) takes them."""
    n, k = blocks, micro_batches
    return [("x", l, i) for l in reversed(range(n)) if l not in swapped for i in range(k)] + \
        ([("x", n, i) for i in range(k)] if last else [])


def forward_peak(blocks: int, micro_batches: int, to_ssd, last: bool = True, prologue_first: bool = False,
                 swapped=frozenset()) -> int:
    """The most entries host memory holds at once in forward (its peak: backward only
    frees) when ``to_ssd`` go: one that goes leaves once forward has taken it (the last
    outputs, which forward does not take, pass through ``STAGING``; so do block 0's inputs,
    but with ``prologue_first``, a device with its own memory, where every micro-batch's
    input to block 0 leaves the device before block 0 runs and forward takes it back). A
    ``swapped`` block's inputs leave once forward has taken them too (backward does not
    need them: blockmajor/swapped.py)."""
    n, k = blocks, micro_batches
    held = peak = k if prologue_first else 0
    for l in range(n):
        for i in range(k):
            if l == 0 and not prologue_first:
                held += ("x", 0, i) not in to_ssd and 0 not in swapped
            elif ("x", l, i) in to_ssd or l in swapped:
                held -= 1  # (forward's take was its last use before backward)
            if l + 1 < n or last:
                held += 1
                peak = max(peak, held)
                if l + 1 == n and ("x", n, i) in to_ssd:
                    held -= 1
            if l == n - 1:
                held += 1  # the last block's gradient
            peak = max(peak, held)
    return peak


class Plan:
    """Which entries of a step go to the SSD array, and the order they come back in."""

    def __init__(self, nbytes: int, blocks: int, micro_batches: int, budget: int, last: bool = True,
                 prologue_first: bool = False, swapped=frozenset()):
        self.slot = aligned(max(nbytes, 1))
        self.blocks, self.micro_batches, self.last = blocks, micro_batches, last
        self.prologue_first, self.swapped = prologue_first, frozenset(swapped)
        n, k = blocks, micro_batches
        self.entries = (n + 1 + last) * k
        self.capacity = budget // self.slot
        self.to_ssd: frozenset = frozenset()
        if forward_peak(n, k, frozenset(), last, prologue_first, swapped) > self.capacity:
            order = spill_order(n, k, last, swapped)
            least = forward_peak(n, k, set(order), last, prologue_first, swapped) + STAGING
            if least > self.capacity:
                raise ValueError(
                    f"train_step keeps each micro-batch's input to every block until backward, {self.slot} bytes "
                    f"each, and needs at least {least} of them in host memory at once ({k} micro-batches of one "
                    f"block, plus {STAGING} for transfers to and from the SSD array): {least * self.slot} bytes, but "
                    f"host_budget is {budget}; attach with host_budget={least * self.slot} or more "
                    f"({self.entries * self.slot} keeps all {self.entries} in memory, without SSD traffic), or use "
                    "fewer or smaller micro-batches")
            lo, hi = 0, len(order)  # the fewest that fit (the peak falls as more go)
            while lo < hi:
                mid = (lo + hi) // 2
                if forward_peak(n, k, set(order[:mid]), last, prologue_first, swapped) + STAGING <= self.capacity:
                    hi = mid
                else:
                    lo = mid + 1
            self.to_ssd = frozenset(order[:lo])
        self.reads = [key for key in need_order(n, k, last, swapped) if key in self.to_ssd]
        peak = forward_peak(n, k, self.to_ssd, last, prologue_first, swapped) + (STAGING if self.to_ssd else 0)
        self.held = min(peak, self.capacity) * self.slot  # (the most host memory the step's entries take)

    def same(self, nbytes: int, blocks: int, micro_batches: int, last: bool, swapped=frozenset()) -> bool:
        return (aligned(max(nbytes, 1)), blocks, micro_batches, last, frozenset(swapped)) == \
            (self.slot, self.blocks, self.micro_batches, self.last, self.swapped)

    def label(self, key) -> str:
        kind, l, i = key
        if l == self.blocks:
            return f"train_step's output of block {l - 1} (the last) for micro-batch {i}"
        return f"train_step's input to block {l} for micro-batch {i}"


@dataclass(eq=False)
class _Entry:
    key: tuple
    layout: list  # per tensor: (offset in the entry, shape, dtype), or None
    nbytes: int  # its extent: what goes to the SSD array
    tensors: list | None = None  # CPU: the tensors themselves, while held
    offset: int | None = None  # in the arena: its slot (device), a staging slot (CPU)
    events: list = field(default_factory=list)  # device: the downloads into the slot
    uploaded: object | None = None  # device: the last upload out of the slot
    forward_take: bool = False  # forward will take it once (keep=True) before backward
    write: Future | None = None  # to the SSD array, in flight
    spilled: Spilled | None = None  # its copy there
    fetch: Future | None = None  # read back into ``offset`` (in flight, or done and checked)


class Store:
    """Tensors kept between the passes, keyed (kind, block, micro-batch), within
    ``budget`` bytes of host memory, the excess on the SSD array."""

    def __init__(self, session, device: Device, budget: int):
        self.session, self.device, self.budget = session, device, budget
        self.host = device.shares_host_memory  # (entries are the tensors themselves)
        self.arena: Arena | None = None
        self.tier: SsdTier | None = None
        self.slot = 0
        self.plan: Plan | None = None
        self.stats = StoreStats()
        self._arenas = 0
        self._open = False  # a step has reserved and not yet discarded
        self._entries: dict = {}
        self._on_device: dict = {}  # key -> ([tensor | None], upload event)
        self._after: dict[int, object] = {}  # device: slot offset -> the upload out of it that was last
        self._writing: list[_Entry] = []  # writes in flight
        self._reading: list[_Entry] = []  # reads in flight
        self._retiring: list[_Entry] = []  # taken, their write still in flight
        self._backward = False  # backward has taken an entry: read-ahead runs
        self._read_next = 0  # plan.reads[:this] have been read ahead (or needed no read)
        self._read_index: dict = {}
        self.bytes_down = self.bytes_up = 0

    # -- the step -------------------------------------------------------------------------
    def reserve(self, nbytes: int, blocks: int, micro_batches: int, last: bool = True, swapped=frozenset()) -> None:
        """Room for a step of ``blocks`` blocks and ``micro_batches`` micro-batches whose
        entries are of up to ``nbytes`` each (``last``: the last block's outputs are kept
        for the rest; ``swapped``: blocks whose inputs forward takes for the last time).
        Called before the step's first put (again within a step: no-op)."""
        if self._open:
            if not self.plan.same(nbytes, blocks, micro_batches, last, swapped):
                raise RuntimeError("train_step's kept inputs changed size mid-step")
            return
        plan = self.plan if self.plan is not None and self.plan.same(nbytes, blocks, micro_batches, last, swapped) \
            else Plan(nbytes, blocks, micro_batches, self.budget, last, prologue_first=not self.host, swapped=swapped)
        if plan is not self.plan and plan.to_ssd:
            self._check_room(len(plan.to_ssd) * plan.slot)
        if self.host:
            slots = STAGING if plan.to_ssd else 0
        else:
            slots = min(plan.entries, plan.capacity)
        if self.arena is not None and (plan.slot != self.slot or self.arena.size < slots * plan.slot):
            self.close()
        if self.arena is None and slots:
            self.arena = Arena(self.session, slots * plan.slot)
            self._arenas += 1
            self.tier = SsdTier(self.session, self.arena, f"train_step/{id(self):x}/{self._arenas}")
            self._after = {}
        self.plan, self.slot, self._open = plan, plan.slot, True
        self.stats = StoreStats()
        self._backward, self._read_next = False, 0
        self._read_index = {key: j for j, key in enumerate(plan.reads)}

    def _check_room(self, nbytes: int) -> None:
        """Refuse, before anything is written, a step whose spilled inputs the SSD array
        cannot hold now."""
        devices = self.session.status().devices
        free = sum(d.available_bytes if d.HasField("available_bytes") else d.capacity_bytes - d.used_bytes
                   for d in devices)
        if nbytes > free:
            raise ValueError(
                f"train_step would spill {nbytes} bytes of kept block inputs to the SSD array (beyond host_budget="
                f"{self.budget}), but the array can take {free} bytes more: raise host_budget (every input in "
                "memory needs (blocks + 2) x micro-batches of them), use fewer or smaller micro-batches, or free "
                "space on fuyoud's disks")

    def put(self, key, tensors: list) -> None:
        self._reap()
        layout, off = [], 0
        for t in tensors:
            if t is None:
                layout.append(None)
                continue
            layout.append((off, t.shape, t.dtype))
            off = -(-(off + t.numel() * t.element_size()) // 64) * 64
        nbytes = max((o + s.numel() * d.itemsize for o, s, d in filter(None, layout)), default=0)
        e = _Entry(key, layout, nbytes)
        goes = self.plan is not None and key in self.plan.to_ssd and nbytes > 0
        if nbytes > self.slot and (goes or not self.host):
            raise RuntimeError(f"a kept input of {nbytes} bytes does not fit train_step's slots of {self.slot}")
        e.forward_take = goes and (0 < key[1] or not self.host) and key[1] < self.plan.blocks
        if self.host:
            e.tensors = [None if t is None else t.detach() for t in tensors]
            if goes:
                e.offset = self._slot()
                for spec, t in zip(layout, e.tensors):
                    if spec is not None:
                        self._view(e.offset, spec).copy_(t)
                e.write = self.tier.write(e.offset, nbytes, self.plan.label(key))
                if not e.forward_take:
                    e.tensors = None
        else:
            e.offset = self._slot()
            after = self._after.pop(e.offset, None)
            for spec, t in zip(layout, tensors):
                if spec is not None:
                    e.events.append(self.device.download(self._view(e.offset, spec), t.detach(), after=after))
                    self.bytes_down += t.numel() * t.element_size()
            if goes:
                events, label = list(e.events), self.plan.label(key)

                def write(e=e, events=events, label=label):
                    for ev in events:
                        ev.synchronize()
                    return self.tier.write(e.offset, e.nbytes, label)
                e.write = flatten(self.device.then(events[-1], write))
        if e.write is not None:
            self._writing.append(e)
            self.stats.spilled += nbytes
            self.stats.spilled_entries += 1
        self._entries[key] = e

    def prefetch(self, key) -> None:
        self._reap()
        self._read_ahead()
        e = self._entries.get(key)
        if self.host or e is None or key in self._on_device or e.offset is None:
            return
        if e.fetch is not None:
            if not e.fetch.done():
                return  # (take waits for it)
            e.fetch.result()  # (checked: a bad checksum raises)
        self._upload(e)

    def take(self, key, keep: bool = False, forward: bool = False) -> list:
        """The entry's tensors on the compute device (the compute stream waits for them);
        ``keep``: the entry stays for a later take; ``forward``: forward's take, and the
        entry's last (a swapped block's input): backward's reads do not start yet."""
        self._reap()
        e = self._entries[key]
        self._backward = self._backward or not (keep or forward)
        if e.fetch is not None or not self._held(e):
            self._read_back(e)  # (a failed one stays an entry: discard cleans it up)
        if not keep:
            del self._entries[key]
        if self.host:
            if e.tensors is not None:
                out = e.tensors
                if keep and e.forward_take:
                    e.tensors = None  # (it is on the SSD array, or on its way)
            else:  # from the arena: a copy of its own (the slot is reused)
                out = [None if s is None else self._view(e.offset, s).clone() for s in e.layout]
        else:
            self._upload(e)
            out, uploaded = self._on_device.pop(key)
            self.device.wait(uploaded)
            e.uploaded = uploaded
        if keep:
            e.forward_take = False
            self._leave(e)
        else:
            self._retire(e)
        self._read_ahead()
        return out

    def drop(self, key) -> None:
        """An entry no one will take (a swapped block 0's input on the CPU): gone now."""
        self._reap()
        e = self._entries.pop(key, None)
        if e is not None:
            e.tensors = None
            self._retire(e)

    def discard(self) -> None:
        """End the step: wait for the transfers in flight, delete what is on the SSD
        array, give every slot back."""
        entries = list(self._entries.values()) + self._retiring
        for e in entries:
            for f in (e.write, e.fetch):
                if f is not None:
                    f.exception()
        if self.tier is not None:
            self.tier.reset()
        for e in entries:
            if e.offset is not None:
                pending = self._on_device[e.key][1] if e.key in self._on_device else e.uploaded
                self._give(e, pending)
        self._entries.clear()
        self._on_device.clear()
        self._writing, self._reading, self._retiring = [], [], []
        self._open = False

    def close(self) -> None:
        self.discard()
        if self.arena is not None:
            self.device.synchronize()
            self.arena.free()
            self.arena = self.tier = None
            self._after = {}

    # -- the parts ------------------------------------------------------------------------
    def _view(self, offset: int, spec) -> torch.Tensor:
        off, shape, dtype = spec
        return self.arena.view(offset + off, shape.numel() * dtype.itemsize).view(dtype).view(shape)

    def _held(self, e: _Entry) -> bool:
        """Its bytes are in host memory (as tensors, or in its slot), not only on the SSD."""
        return e.tensors is not None or (e.offset is not None and (e.fetch is None or e.fetch.done()))

    def _slot(self, wait: bool = True) -> int | None:
        """A free slot of the arena; ``wait``: for a write in flight to free one."""
        while True:
            off = self.arena.take(self.slot)
            if off is not None or not wait:
                return off
            writes = [e.write for e in self._writing]
            if not writes:
                raise RuntimeError(f"train_step's host arena ({self.arena.size} bytes) is full: a model whose "
                                   "kept inputs changed size mid-step?")
            t0 = time.perf_counter()
            wait_futures(writes, return_when=FIRST_COMPLETED)
            self.stats.write_wait_s += time.perf_counter() - t0
            self._reap()

    def _give(self, e: _Entry, uploaded=None) -> None:
        """Its slot back to the arena (a later download into it waits for ``uploaded``)."""
        if uploaded is not None and uploaded is not DONE:
            self._after[e.offset] = uploaded
        self.arena.give(e.offset, self.slot)
        e.offset, e.events = None, []

    def _reap(self) -> None:
        """Writes that have committed: their entries' host copies go once forward is done
        with them (unless read-ahead has already passed them: then they stay until taken);
        taken entries' objects are deleted."""
        if not self._writing:
            return
        still = []
        for e in self._writing:
            if not e.write.done():
                still.append(e)
                continue
            e.spilled, e.write = e.write.result(), None  # (a failed write raises here)
            if e in self._retiring:
                self._retiring.remove(e)
                self._retire(e)
            else:
                self._leave(e)
        self._writing = still

    def _leave(self, e: _Entry) -> None:
        """An entry that goes leaves host memory once its write has committed and forward
        is done with it - unless read-ahead has passed it (then it stays until taken). On
        the CPU its staging slot goes as soon as it is written while its tensors are held."""
        if e.write is not None or e.spilled is None or e.offset is None or e.fetch is not None:
            return
        j = self._read_index.get(e.key)
        passed = j is not None and j < self._read_next
        if self.host:
            if e.tensors is not None or not passed:
                self._give(e)
        elif not e.forward_take and not passed and e.key not in self._on_device:
            self._give(e, e.uploaded)

    def _retire(self, e: _Entry) -> None:
        """A taken entry: its slot back, its object deleted (once its write committed)."""
        if e.write is not None:
            self._retiring.append(e)  # (_reap finishes it once written)
            return
        if e.spilled is not None:
            self.tier.drop(e.spilled)
        if e.offset is not None:
            self._give(e, e.uploaded)

    def _start_read(self, e: _Entry, off: int) -> None:
        after = self._after.pop(off, None)
        if after is not None:
            after.synchronize()  # (the daemon writes into the slot: the upload out of it ran)
        e.offset = off
        e.fetch = self.tier.read(e.spilled, off)
        self._reading.append(e)
        self.stats.read_back += e.nbytes
        self.stats.read_entries += 1

    def _read_back(self, e: _Entry) -> None:
        """Take's wait for an entry's read (started now if read-ahead did not), checked: a
        bad checksum raises DataLoss naming its block and micro-batch."""
        if e.fetch is None:
            self._start_read(e, self._slot())
        t0 = time.perf_counter()
        e.fetch.exception()
        self.stats.read_wait_s += time.perf_counter() - t0
        e.fetch.result()

    def _read_ahead(self) -> None:
        """Backward's next spilled entries, in the order it takes them, into free room."""
        if not self._backward or self.tier is None:
            return
        self._reading = [e for e in self._reading if not e.fetch.done()]
        reads = self.plan.reads
        while self._read_next < len(reads) and len(self._reading) < READ_AHEAD:
            e = self._entries.get(reads[self._read_next])
            if e is not None and e.fetch is None and not self._held(e):
                if not self.host and self.arena.free_bytes < 2 * self.slot:
                    return  # (a slot stays free for the gradient backward puts next)
                off = self._slot(wait=False)
                if off is None:
                    return
                self._start_read(e, off)
                self.stats.read_ahead += 1
            self._read_next += 1

    def _upload(self, e: _Entry) -> None:
        """Device: start uploading its tensors (once)."""
        if e.key in self._on_device:
            return
        out, last = [], DONE
        events = iter(e.events)
        for spec in e.layout:
            if spec is None:
                out.append(None)
                continue
            t, last = self.device.upload_new(self._view(e.offset, spec), after=next(events, None))
            out.append(t)
            self.bytes_up += spec[1].numel() * spec[2].itemsize
        self._on_device[e.key] = (out, last)
