"""Daemon-private bounce buffers for transfers O_DIRECT cannot do in place.

O_DIRECT needs 4 KiB-aligned addresses, lengths and file offsets. Buffer ranges that are
not (an object's tail that is not a multiple of 4 KiB, a range starting mid-page) go
through these slabs. They are private anonymous mappings advised for transparent huge
pages: physically contiguous memory lets the block layer merge requests (measured on
the project's machine: 1.2-1.5x faster O_DIRECT I/O than scattered 4 KiB pages).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from fuyoud.memory.hugepages import huge_page_buffer
from fuyoud.units import align_up


class StagingPool:
    def __init__(self, total_bytes: int, slab_bytes: int):
        self.slab_bytes = align_up(slab_bytes, 4096)
        count = max(2, total_bytes // self.slab_bytes)
        self.total_bytes = count * self.slab_bytes
        self._map, base = huge_page_buffer(self.total_bytes)  # one mapping, cut into slabs
        self._free = [base[i * self.slab_bytes:(i + 1) * self.slab_bytes] for i in range(count)]
        self._cond = threading.Condition()

    @contextmanager
    def slab(self) -> Iterator[memoryview]:
        """Borrow one slab (blocks while all are in use)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            buf = self._free.pop()
        try:
            yield buf
        finally:
            with self._cond:
                self._free.append(buf)
                self._cond.notify()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.total_bytes - len(self._free) * self.slab_bytes

