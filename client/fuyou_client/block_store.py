"""The tensors block-major training keeps between its passes (blockmajor.py): each
micro-batch's input to each block and the gradients flowing between blocks, keyed
(kind, block, micro-batch).

On the CPU they are the tensors themselves. On a device with its own memory they live in
equal slots of one host arena of shared memory (registered like every segment): put
downloads on the download stream, ``prefetch`` uploads ahead on the upload stream, and
``take`` makes the compute stream wait for its upload only. A slot takes a new download
only after the upload out of it ran (ordered by events, not by the host).
"""
from __future__ import annotations

import torch

from fuyou_client.device import DONE, Device

SLOT_ALIGN = 4096


class Store:
    """Tensors kept between the passes, keyed (kind, block, micro-batch): on the CPU the
    tensors themselves; on a device with its own memory, equal slots of a host arena in
    shared memory, downloaded when put and uploaded (ahead, by ``prefetch``) when taken."""

    def __init__(self, session, device: Device, budget: int):
        self.session, self.device, self.budget = session, device, budget
        self.arena = None
        self.slot = 0
        self._free: list[int] = []
        self._entries: dict = {}  # key -> (slot, [(offset, shape, dtype) | None], downloaded event)
        self._on_device: dict = {}  # key -> ([tensor | None], upload event)
        self._slot_uploaded: dict[int, object] = {}
        self.bytes_down = self.bytes_up = 0

    def reserve(self, nbytes: int, count: int) -> None:
        """Room for ``count`` entries of up to ``nbytes`` each (on a discrete device)."""
        if self.device.shares_host_memory:
            return
        slot = -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
        if slot * count > self.budget:
            raise ValueError(
                f"train_step keeps {count} checkpoints and gradients of {nbytes} bytes each (blocks + 2, times the "
                f"micro-batches) in host memory: {slot * count} bytes, but host_budget is {self.budget}; attach with "
                f"host_budget={slot * count} or more, or use fewer or smaller micro-batches")
        if self.arena is None or self.slot != slot or len(self._free) + len(self._entries) < count:
            self.close()
            self.arena = self.session.allocate(slot * count)
            self.slot = slot
            self._free = [i * slot for i in range(count)]
            self._slot_uploaded = {}

    def put(self, key, tensors: list) -> None:
        if self.device.shares_host_memory:
            self._entries[key] = [None if t is None else t.detach() for t in tensors]
            return
        if not self._free:
            raise RuntimeError("train_step's host arena is full (a model whose checkpoints changed size mid-step)")
        base, layout, off = self._free.pop(0), [], 0
        events = []
        for t in tensors:
            if t is None:
                layout.append(None)
                continue
            n = t.numel() * t.element_size()
            if off + n > self.slot:
                raise RuntimeError(f"a checkpoint of {off + n} bytes does not fit train_step's slots of {self.slot}")
            dst = self.arena.tensor(torch.uint8)[base + off:base + off + n].view(t.dtype).view(t.shape)
            events.append(self.device.download(dst, t.detach(), after=self._slot_uploaded.pop(base, None)))
            layout.append((base + off, t.shape, t.dtype))
            off += -(-n // 64) * 64
            self.bytes_down += n
        self._entries[key] = (base, layout, events)

    def prefetch(self, key) -> None:
        if self.device.shares_host_memory or key in self._on_device or key not in self._entries:
            return
        base, layout, events = self._entries[key]
        out, last = [], DONE
        for spec, downloaded in zip((s for s in layout if s is not None), events):
            off, shape, dtype = spec
            n = shape.numel() * dtype.itemsize
            t, last = self.device.upload_new(self.arena.tensor(torch.uint8)[off:off + n].view(dtype).view(shape),
                                             after=downloaded)
            out.append(t)
            self.bytes_up += n
        it = iter(out)
        self._on_device[key] = ([None if s is None else next(it) for s in layout], last)

    def take(self, key, keep: bool = False) -> list:
        """The entry's tensors on the compute device (the compute stream waits for them);
        ``keep``: the entry stays for a later take."""
        if self.device.shares_host_memory:
            return self._entries[key] if keep else self._entries.pop(key)
        self.prefetch(key)
        tensors, uploaded = self._on_device.pop(key)
        self.device.wait(uploaded)
        if not keep:
            base, _, _ = self._entries.pop(key)
            self._slot_uploaded[base] = uploaded  # the next download into the slot waits for this upload
            self._free.append(base)
        return tensors

    def discard(self) -> None:
        for key in list(self._entries):
            if not self.device.shares_host_memory:
                base = self._entries[key][0]
                if key in self._on_device:  # (an upload ahead still reads the slot)
                    self._slot_uploaded[base] = self._on_device[key][1]
                self._free.append(base)
            del self._entries[key]
        self._on_device.clear()

    def close(self) -> None:
        self.discard()
        if self.arena is not None:
            self.device.synchronize()
            self.arena.free()
            self.arena = None
