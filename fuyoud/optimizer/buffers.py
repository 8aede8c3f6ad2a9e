"""Daemon-private buffers that hold optimizer state while it is read, stepped and written.

A fixed number of buffers (``[optimizer] buffers``, 6 by default) within a byte budget,
so the optimizer's memory is bounded whatever the model size: a step holds one buffer,
with the group's whole state when it fits (and a read-ahead of a group's state holds
another until its step); a group larger than a buffer is stepped in chunks through
scratch blocks and three stages (read, compute, write back: see chunks.py) in one
buffer, or in up to three, one per stage, taken without waiting while one stays free. A
buffer that more than CACHE_RESERVE free ones leave spare after a step keeps that group's
state until its next step (the state cache, groups.py), unless a step needs it first. Buffers
are private anonymous mappings on transparent huge pages (contiguous memory makes
O_DIRECT faster) and are kept between steps: mapping and faulting in hundreds of MB
per step would cost more than the step.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from fuyoud.memory.hugepages import HUGE, huge_page_buffer
from fuyoud.units import align_up


class _Buffer:
    def __init__(self, size: int):
        self.size = size
        self.map, self.view = huge_page_buffer(size)


class StateBuffers:
    def __init__(self, count: int, budget: int):
        self.count = count
        self.per_buffer = budget // count // HUGE * HUGE
        self._free: list[_Buffer | None] = [None] * count  # None: not mapped yet
        self._owners: dict[int, _Buffer] = {}  # id(view handed out) -> its buffer
        self._cond = threading.Condition()
        self.in_use = 0
        self.evict: Callable[[], bool] | None = None  # gives back a buffer kept by the state cache

    def fits(self, nbytes: int) -> bool:
        """Whether one buffer holds ``nbytes``; larger groups are stepped in chunks."""
        return nbytes <= self.per_buffer

    def try_acquire(self, nbytes: int, leave: int = 0) -> memoryview | None:
        """A buffer if more than ``leave`` are free, else None. Read-ahead leaves one free,
        so a step that was not read ahead can always proceed (read-ahead buffers are only
        given back when their group steps)."""
        with self._cond:
            if len(self._free) <= leave:
                return None
            return self._take(nbytes)

    def acquire_blocking(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` (waits for one); give it back with release().
        When none is free, ``evict`` (the state cache's) is asked to give one back first."""
        while True:
            with self._cond:
                if self._free:
                    return self._take(nbytes)
            if self.evict is None or not self.evict():
                break
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._take(nbytes)

    def spare(self) -> int:
        """Buffers free now."""
        with self._cond:
            return len(self._free)

    @contextmanager
    def acquire(self, nbytes: int) -> Iterator[memoryview]:
        view = self.acquire_blocking(nbytes)
        try:
            yield view
        finally:
            self.release(view)

    def _take(self, nbytes: int) -> memoryview:
        buf = self._free.pop()
        if buf is None or buf.size < nbytes:
            buf = _Buffer(align_up(nbytes, HUGE))  # grown once to the largest group seen
        self.in_use += 1
        view = buf.view[:nbytes]
        self._owners[id(view)] = buf
        return view

    def release(self, view: memoryview) -> None:
        with self._cond:
            self._free.append(self._owners.pop(id(view)))
            self.in_use -= 1
            self._cond.notify()

    @property
    def mapped_bytes(self) -> int:
        with self._cond:
            return sum(b.size for b in self._free if b is not None) + sum(b.size for b in self._owners.values())
