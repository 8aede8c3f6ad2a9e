"""The weight slots of the offloader: room for a group's weights, a shared host buffer and
its device counterpart, each slot of the size the memory plan gave it (memory/budget.py:
the largest block or sub-block; cut blocks' own groups have smaller ones).

A slot is *free*, held by a resident group (the offloader's ``g.slot``), *cached* (its
group released it, its weights still there until a fetch takes it: a group used again
before that needs no fetch, offload/offloader.py), or *lent* to a step that reads the fp32
masters in it (until that step is done). ``SlotPool`` keeps the free, cached and lent
ones; the offloader owns what a group holds.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from fuyou_client.connection.session import Session
from fuyou_client.device.devices import DONE, Device


class Slot:
    """Room for one group's weights: a shared host buffer and its device counterpart."""

    def __init__(self, session: Session, device: Device, nbytes: int, host: bool = True):
        self.nbytes = nbytes
        self.host = session.allocate(nbytes) if host else None  # (none when every group's weights are on the host)
        self.device = self.host.tensor(torch.uint8) if device.shares_host_memory else device.empty(nbytes)
        self.uploaded = DONE  # the last upload out of ``host`` (a new fetch may land only after it)
        self.released = device.record()  # compute's last use of ``device`` (a new upload waits for it)

    def weights(self, dtype: torch.dtype) -> torch.Tensor:
        return self.device.view(dtype)


class SlotPool:
    """The slots not held by a resident group. ``caching=False`` (data parallelism, where
    every rank must fetch, and gather, in the same order): released slots are free at once."""

    def __init__(self, session: Session, device: Device, sizes: list[int], from_ssd: bool, caching: bool = True):
        self.free = [Slot(session, device, nbytes, host=from_ssd) for nbytes in sizes]
        self.count = len(self.free)
        self.caching = caching
        # released groups' slots whose weights are still there, oldest first (slot -> group)
        self.cached: dict[Slot, object] = {}
        self.lent: deque[tuple[Future, Slot]] = deque()  # slots whose masters a step reads, oldest first
        self.lending: Slot | None = None  # lent, its step not submitted yet

    def take(self, g) -> Slot | None:
        """A slot large enough for ``g``'s weights: a free one (of the smallest size that
        fits; among those the longest free, its last use furthest back), else the one cached
        longest (its group must be fetched again), else None."""
        fits = [i for i, s in enumerate(self.free) if s.nbytes >= g.nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: (self.free[i].nbytes, i)))
        slot = next((s for s in self.cached if s.nbytes >= g.nbytes), None)
        if slot is not None:
            self.cached.pop(slot).cached = None
        return slot

    def could_take(self, g) -> bool:
        """Whether a free or cached slot is large enough for ``g``."""
        return any(s.nbytes >= g.nbytes for s in (*self.free, *self.cached))

    def keep(self, g, slot: Slot) -> None:
        """``g`` released ``slot``: cached with its weights (or free, without caching)."""
        if self.caching:
            g.cached = slot
            self.cached[slot] = g
        else:
            self.free.append(slot)

    def reclaim(self, g) -> Slot:
        """``g``'s cached slot back to it (its weights are still there)."""
        slot, g.cached = g.cached, None
        del self.cached[slot]
        return slot

    def forget(self, g) -> None:
        """``g``'s cached weights are stale (its step is under way) or no longer wanted."""
        if g.cached is not None:
            self.free.append(g.cached)
            del self.cached[g.cached]
            g.cached = None

    def forget_all(self) -> None:
        for g in list(self.cached.values()):
            self.forget(g)

    def lend(self, slot: Slot) -> None:
        """``slot`` goes to a step not submitted yet (``lent_until`` names it)."""
        self.lending = slot

    def lent_until(self, step: Future) -> None:
        """The step that reads the slot just lent; the slot is free again once it is done."""
        self.lent.append((step, self.lending))
        self.lending = None

    def take_back(self, wait: bool = False) -> None:
        """Slots lent to steps that are done are free again (``wait``: the oldest is waited for)."""
        if wait and self.lent:
            self.lent[0][0].exception()  # (waits; whatever the step's outcome, it reads the slot no more)
        while self.lent and self.lent[0][0].done():
            self.free.append(self.lent.popleft()[1])

    def take_back_all(self) -> None:
        """(at the barrier, every step landed) Every lent slot is free again."""
        for step, slot in self.lent:
            step.exception()
            self.free.append(slot)
        self.lent.clear()
